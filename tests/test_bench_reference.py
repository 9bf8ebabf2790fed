"""The reference run (bench/reference.sh) end to end against the fake server: both arms booted
through a server command from the launcher's env knobs, the table and goals, pools against the
plan's prediction, partial results kept when the stock arm crashes or fails to boot, unfair
comparisons refused, and the roofline arithmetic."""
import json
import math
import os
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from fake_openai_server import FakeServer
from onecard.bench import prompts, reference, roofline, runner

REPO = Path(__file__).resolve().parents[1]
FAKE = Path(__file__).with_name("fake_openai_server.py")
BYTES = {"I32": 4, "BF16": 2, "F32": 4, "I64": 8}

TINY_TIER = reference.Tier(
    "test", decode=((50, (1, 2)),), decode_tokens=16, reps=1, prefill=(100,), verify_context=50,
    verify_tokens=9, spec=("mtp", "dflash2"), prefix_context=100, prefix_tokens=6, pool_ctx=("long", "huge"),
    boots=1, budget_s=300, verify_ctx=("fast", "long"), essential=("pool fast/off", "decode 50 C1", "decode 50 C2", "prefill 100",
                                      "prefix 100 turn2/turn1", "verify mtp/plain"))


@pytest.fixture(autouse=True)
def _fixed_commit(monkeypatch):
    """Other engineers commit to this tree while tests run; a commit landing between two arms
    would (rightly) make a comparison CONFOUNDED."""
    from onecard.bench import provenance
    monkeypatch.setattr(provenance, "git_info", lambda *a: {"commit": "fixed", "dirty": False})


def write_geometry_checkpoint(d: Path) -> Path:
    """The 27B-geometry checkpoint as config.json + a header-only safetensors file (the memory
    model and the roofline read headers, never tensor data) + the borrowed tiny tokenizer."""
    from onecard.prepare import geometry, tiny
    d.mkdir(parents=True, exist_ok=True)
    spec = geometry.spec_for("27b")
    (d / "config.json").write_text(json.dumps(tiny.make_config(spec, defaultdict(int))))
    header, off = {}, 0
    for name, code, shape, _ in geometry.plan(spec):
        n = math.prod(shape) * BYTES[code]
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    tiny.build_tokenizer(tiny.DEFAULT_SPEC.vocab).save(str(d / "tokenizer.json"))  # as job 20 borrows it
    return d


@pytest.fixture(scope="module")
def geom_dir(tmp_path_factory):
    return write_geometry_checkpoint(tmp_path_factory.mktemp("geom"))


def _cfg(tmp_path, geom_dir, stock_env=None, tier=TINY_TIER, **kw):
    pp = os.pathsep.join([str(REPO), str(REPO / "tests")])
    arms = [reference.Arm("patched", pp), reference.Arm("stock", pp, env=dict(stock_env or {}))]
    return reference.RefConfig(model=str(geom_dir), tier=tier, out_dir=tmp_path / "ref", arms=arms,
                               md=tmp_path / "performance.md", server_cmd=f"exec {sys.executable} {FAKE}",
                               bandwidth_gbs=4000.0, boot_timeout=30, argv=["test"],
                               # 4 ms a chunk: C>1 streams overlap by far more than their start skew
                               # (the decode window needs every stream decoding at once)
                               base_env={"FAKE_VLLM_LOG": "1", "FAKE_TOKENS_PER_CHUNK": "2", "FAKE_DELAY": "0.004"},
                               log=lambda s: None, **kw)


def _row(doc, key):
    return next(r for r in doc["rows"] if r["key"] == key)


def test_reference_run_makes_the_table(tmp_path, geom_dir):
    doc = reference.Reference(_cfg(tmp_path, geom_dir)).run()
    assert doc["verdict"] == "VALID", doc["verdict_reasons"]
    for key in ("decode 50 C1", "decode 50 C2", "prefill 100", "prefix 100 turn1", "prefix 100 turn2",
                "step plain", "step mtp"):
        r = _row(doc, key)
        assert r["arms"]["stock"]["value"] and r["arms"]["patched"]["value"], key
        # one boot per arm: the contract says UNRESOLVED (boot floor unknown), never OK or CONFOUNDED
        assert r["verdict"]["status"] == "UNRESOLVED", (key, r["verdict"])
        assert r["ratio"] == pytest.approx(r["arms"]["patched"]["value"] / r["arms"]["stock"]["value"])
    c1 = _row(doc, "decode 50 C1")
    assert c1["roofline"] and 0 < c1["arms"]["patched"]["pct_roofline"]
    pool = _row(doc, "pool fast/off")
    assert pool["arms"]["patched"]["dev_pct"] == 0 and pool["verdict"]["status"] == "OK"
    assert _row(doc, "pool fast/mtp")["arms"]["stock"]["value"] > 0
    # plain step: the fake sends one token per chunk with SPEC=off; mtp: 2 tokens per verify step
    assert _row(doc, "verify mtp/plain")["arms"]["patched"]["value"] is not None
    skipped = " ".join(f"{x['what']}: {x['reason']}" for x in doc["skipped"])
    assert "dflash2" in skipped and "kvarn" in skipped  # plan refusals are rows with their reason
    assert "pool long/off" in [r["key"] for r in doc["rows"]]
    # verify rows per CTX: the long profile's plain and mtp steps come from their own boots
    long_v = _row(doc, "verify mtp/plain long")["arms"]["patched"]
    assert long_v["value"] is not None and long_v["verdict"]["status"] == "UNRESOLVED"
    assert _row(doc, "step mtp long")["metric"].startswith("ms per verify step (CTX=long, SPEC=mtp, k=3)")
    assert [g["row"] for g in doc["goals"] if g["goal"].startswith("verify")][::2] == ["verify mtp/plain",
                                                                                     "verify mtp/plain long"]
    md = (tmp_path / "performance.md").read_text()
    assert "| decode 50 C1 (" in md and "UNRESOLVED" in md and "## Goals" in md
    assert "copy bandwidth 4000.0 GB/s" in md and "pools within 1%" in md
    cal = doc["calibration"]  # the borrowed small-vocabulary tokenizer: fewer chars per token
    assert 2.0 < cal["chars_per_token"] < 3.5 and "tokenizer.json" in cal["source"]
    assert _row(doc, "prefill 100")["prompt_tokens"] > 60
    on_disk = json.loads(Path(doc["path"]).read_text())
    assert on_disk["verdict"] == "VALID" and on_disk["partial"] is False and on_disk["rows"]
    stock_files = list((tmp_path / "ref" / "stock").glob("ladder-*.json"))
    prov = json.loads(stock_files[0].read_text())["provenance"]
    assert prov["patch_series"]["hash"] is None and prov["arm"] == "stock"
    assert "--kv-cache-memory-bytes" in prov["server_launch"]["argv"]


def test_stock_crash_keeps_everything_and_says_so(tmp_path, geom_dir):
    doc = reference.Reference(_cfg(tmp_path, geom_dir, stock_env={"FAKE_CRASH_AFTER": "4"})).run()
    assert doc["verdict"] == "INCOMPLETE"
    c1 = _row(doc, "decode 50 C1")
    assert c1["arms"]["patched"]["value"] and c1["arms"]["stock"]["value"] is None
    assert any("[stock]" in m for m in doc["missing"])
    assert not any("[patched]" in m for m in doc["missing"])
    later = _row(doc, "prefill 100")["arms"]["stock"]
    assert later["value"] is None and "server died during 'decode 50'" in later["note"]
    assert "fake engine crash" in later["note"]  # the server log's error line
    # the stock arm's partial results are on disk, marked, and logged
    runs = [json.loads(x) for x in (tmp_path / "ref" / "stock" / "runs.jsonl").read_text().splitlines()]
    assert any(r["verdict"] == "INVALID" for r in runs)
    md = (tmp_path / "performance.md").read_text()
    assert "INVALID" in md and "**INCOMPLETE**" in md
    assert json.loads(Path(doc["path"]).read_text())["rows"]


def test_stock_boot_failure_is_a_row(tmp_path, geom_dir):
    tier = reference.Tier("t", decode=((50, (1,)),), decode_tokens=6, reps=1, prefill=(), verify_context=None,
                          verify_tokens=0, spec=(), prefix_context=None, prefix_tokens=0, pool_ctx=(), boots=1,
                          budget_s=60, essential=("decode 50 C1",))
    doc = reference.Reference(_cfg(tmp_path, geom_dir, stock_env={"FAKE_BOOT_FAIL": "1"}, tier=tier)).run()
    c1 = _row(doc, "decode 50 C1")
    assert c1["arms"]["patched"]["value"] and "server failed" in c1["arms"]["stock"]["note"]
    assert "fake boot failure" in c1["arms"]["stock"]["note"]
    assert c1["ratio"] is None and doc["verdict"] == "INCOMPLETE"
    assert "## Failed boots" in (tmp_path / "performance.md").read_text()


def test_budget_skips_optional_boots_with_a_reason(tmp_path, geom_dir):
    doc = reference.Reference(_cfg(tmp_path, geom_dir, budget_s=0.0)).run()
    # the essential plain boots always run; plan refusals (dflash2, huge here) are rows, never boots
    assert {b["spec"] for b in doc["boots"] if not b.get("skipped")} == {"off"}
    assert all("refuses this plan" in b["skipped"] for b in doc["boots"] if b.get("skipped"))
    assert any("budget" in s["reason"] for s in doc["skipped"])
    assert _row(doc, "step mtp")["arms"]["patched"]["value"] is None


def test_unfair_comparison_is_refused_in_the_table(tmp_path):
    with FakeServer(tokens_per_chunk=1) as s:
        t = runner.Target(url=s.url, model="fake", out_dir=str(tmp_path), metrics_interval=0.05, log=lambda x: None)
        a = runner.ladder(t, reference.haystack_set(50), [1], 6, 1)
        b = runner.ladder(t, reference.haystack_set(50), [1], 9, 1)  # other output length
        c = runner.ladder(t, prompts.load("code"), [1], 6, 1)  # other prompts
    tier = reference.Tier("t", decode=((50, (1,)),), decode_tokens=6, reps=1, prefill=(), verify_context=None,
                          verify_tokens=0, spec=(), prefix_context=None, prefix_tokens=0, pool_ctx=(), boots=1,
                          budget_s=1, essential=())
    for other, why in ((b, "different output lengths"), (c, "different prompts")):
        boots = [{"arm": arm, "spec": "off", "ctx": "fast", "pool_only": False, "results": {"decode 50": {"path": r["path"]}}}
                 for arm, r in (("stock", a), ("patched", other))]
        doc = {"arms": [{"name": "stock"}, {"name": "patched"}], "bandwidth": {}, "step_bytes": {}}
        rows = reference.build_rows(boots, {a["path"]: a, other["path"]: other}, doc, tier)
        row = next(r for r in rows if r["key"] == "decode 50 C1")
        assert row["verdict"]["status"] == "REFUSED" and row["ratio"] is None
        assert any(why in x for x in row["verdict"]["reasons"])
        doc.update(rows=rows, goals=reference.goals(rows, tier), tier={"name": "t"})
        assert "REFUSED: " in reference.markdown(doc)


def test_cli_bad_input_is_one_line(tmp_path, geom_dir, capsys):
    assert reference.main(["--tier", "huge", "--model", str(geom_dir)]) == 2
    err = capsys.readouterr().err
    assert "valid: quick, full" in err and err.count("\n") == 1
    assert reference.main(["--model", str(tmp_path)]) == 2
    assert "not a checkpoint" in capsys.readouterr().err
    from onecard.bench.cli import main as bench_main
    assert bench_main(["reference", "--tier", "nope", "--model", str(geom_dir)]) == 2
    assert "valid: quick, full" in capsys.readouterr().err
    assert reference.main(["--model", str(geom_dir), "--verify-ctx", "fast,wide"]) == 2
    assert "valid: comma-separated fast, long, huge" in capsys.readouterr().err
    r = subprocess.run(["bash", str(REPO / "bench" / "reference.sh"), "--tier", "nope", "--model", str(geom_dir)],
                       capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 2 and "valid: quick, full" in r.stderr


def test_arm_without_pythonpath_is_skipped_with_reason(geom_dir, monkeypatch):
    import argparse
    monkeypatch.delenv("STOCK_PYTHONPATH", raising=False)
    ap = argparse.ArgumentParser()
    reference.configure(ap)
    cfg = reference.from_args(ap.parse_args(["--model", str(geom_dir)]))
    stock = next(a for a in cfg.arms if a.name == "stock")
    assert "STOCK_PYTHONPATH" in stock.skip_reason and cfg.tier.name == "quick"
    with pytest.raises(SystemExit):
        ap.parse_args(["--arm", "other=/x"])


def test_roofline_bytes_and_arithmetic(geom_dir):
    sb = roofline.step_bytes(geom_dir)
    from onecard import memory
    total = memory.weight_bytes(geom_dir)
    assert 12 * 2**30 < sb.weights < total  # W4A16 27B body + lm_head, no MTP / vision / embedding
    assert sb.mtp > 0 and sb.lm_head == 248320 * 5120 * 2
    assert sb.attn_bytes_per_token == 16 * 2 * 4 * 256 * 2  # bf16 K+V, 16 full-attention layers
    assert sb.decode(2, 1000) == sb.weights + 2 * (1000 * sb.attn_bytes_per_token + sb.gdn_state_bytes)
    assert sb.verify(1, 0, 4) - sb.decode(1, 0) == 4 * (sb.mtp + sb.lm_head)
    # DFlash2: one drafter pass and one lm_head read per step, whatever the block size
    assert sb.verify_block(1, 0, 2 * 10**9) - sb.decode(1, 0) == 2 * 10**9 + sb.lm_head
    assert roofline.tok_s(4 * 10**9, 4000.0) == pytest.approx(1000.0)


def test_copy_bandwidth_runs_on_cpu():
    pytest.importorskip("torch")
    bw = roofline.copy_bandwidth(1 << 20, reps=2)
    assert bw["gbps_read_plus_write"] > 0 and bw["device"] in ("cpu", "cuda")


def test_sigterm_stops_the_server_and_keeps_the_table(tmp_path, geom_dir):
    import signal
    import socket
    import time
    pp = os.pathsep.join([str(REPO), str(REPO / "tests")])
    out, md = tmp_path / "ref", tmp_path / "p.md"
    env = {**os.environ, "PYTHONPATH": pp, "FAKE_DELAY": "0.05", "FAKE_VLLM_LOG": "1"}
    cmd = [sys.executable, "-m", "onecard.bench.reference", "--tier", "quick", "--model", str(geom_dir),
           "--out", str(out), "--md", str(md), "--server-cmd", f"exec {sys.executable} {FAKE}",
           "--bandwidth-gbs", "4000", "--arm", f"stock={pp}", "--arm", f"patched={pp}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    while not list(out.glob("patched/ladder-*.json")) and time.monotonic() - t0 < 180:  # loaded 2-CPU box: slow
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, text
    doc = json.loads(next(out.glob("reference-quick-*.json")).read_text())
    assert doc["verdict"] == "INVALID" and "interrupted" in doc["verdict_reasons"][0]
    assert doc["boots"][0]["wall_s"] is not None  # the boot's finally ran: server stopped
    port = int(doc["url"].rsplit(":", 1)[1])
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more
    assert "interrupted" in md.read_text()


def test_rebuild_the_table_from_a_killed_run(tmp_path, geom_dir):
    doc = reference.Reference(_cfg(tmp_path, geom_dir, stock_env={"FAKE_CRASH_AFTER": "4"})).run()
    ref = Path(doc["path"])
    killed = json.loads(ref.read_text())
    for k in ("rows", "goals", "missing"):  # as if SIGKILLed before build()
        killed.pop(k)
    ref.write_text(json.dumps(killed))
    md = tmp_path / "again.md"
    assert reference.main(["--rebuild", str(ref), "--md", str(md)]) == 1  # INCOMPLETE, kept
    again = reference.rebuild(ref)
    assert [r["key"] for r in again["rows"]] == [r["key"] for r in doc["rows"]]
    assert _row(again, "decode 50 C1")["arms"]["patched"]["value"] == _row(doc, "decode 50 C1")["arms"]["patched"]["value"]
    assert again["missing"] == doc["missing"] and "| decode 50 C1 (" in md.read_text()
    assert reference.main(["--rebuild", str(tmp_path / "nope.json")]) == 2
    # the result directory copied elsewhere (a lent GPU's /var/tmp/out -> docs/results) and the
    # original gone: the result files are found relative to the reference JSON
    import shutil
    moved = tmp_path / "moved" / "results"
    shutil.copytree(ref.parent, moved)
    shutil.rmtree(ref.parent)
    there = reference.rebuild(moved / ref.name, md=tmp_path / "moved.md")
    assert _row(there, "decode 50 C1")["arms"]["patched"]["value"] == _row(doc, "decode 50 C1")["arms"]["patched"]["value"]
    assert there["missing"] == doc["missing"]
    # the provenance lines read the moved result files too (vLLM version source, prompt ids)
    text = (tmp_path / "moved.md").read_text()
    assert "(server /version)" in text and "- prompts: `" in text and "this table rebuilt from it" in text


def _ladder(n, streams, waiting):
    rep = {"max_streams_decoding": streams, "metrics": {"gauges": {"waiting": {"peak": waiting}}}}
    return {"data": {"levels": [{"n": n, "aggregate_tps": 18.0, "reps": [rep]}]}}


def test_queued_concurrency_is_flagged_not_called_a_decode_rate():
    """A C>1 level whose requests did not decode together (vLLM kept them waiting: 2026-12-05,
    four 32k prompts on CTX=fast ran one at a time) is footnoted and gets no % of roofline."""
    assert reference.decode_overlap(_ladder(4, 1, 3.0), 4) == (1, 3.0)
    assert reference.decode_overlap(_ladder(4, 4, 0.0), 4) == (4, 0.0)
    assert reference.decode_overlap(_ladder(4, 4, 0.0), 2) is None
    assert reference.decode_overlap({"data": {"levels": [{"n": 2, "reps": [{}]}]}}, 2) is None
    doc = {"arms": [{"name": "patched"}, {"name": "stock"}], "rows": [{
        "key": "decode 32k C4", "unit": "tok/s", "roofline": 490.5, "verdict": {"status": "UNRESOLVED"}, "ratio": 1.0,
        "arms": {"patched": {"value": 18.0, "flag": "at most 1 of 4 streams decoded at once"},
                 "stock": {"value": 17.9, "pct_roofline": 3.6}}}], "goals": [], "tier": {"name": "lease"}}
    md = reference.markdown(doc)
    assert "| 18.0 [1] | 17.9 |" in md and "[1] `decode 32k C4` [patched]: at most 1 of 4 streams" in md


def test_preemptions_and_the_point_that_filled_the_pool():
    """Job 80 (2026-12-05): the depth benchmark's counter rose by 2 and only its 60k point filled the
    pool, so only that prefill row is footnoted; a result without a sampler counts 0."""
    r = {"metrics": {"counters": {"preemptions": 2.0}},
         "data": {"points": [{"context": 665, "kv": {"peak": 0.045}}, {"context": 39905, "kv": {"peak": 1.0}}]}}
    assert reference._preemptions(r) == 2.0 and reference._preemptions({}) == 0.0
    assert reference._point_kv_peak(r, 39905) == 1.0 and reference._point_kv_peak(r, 665) == 0.045
    assert reference._point_kv_peak(r, 123) is None


def test_commit_text_names_the_tree_that_ran():
    assert reference._commit_text({"commit": "7dcd1268cd8c76", "dirty": True, "tree_rev": "82ccec6"}) == (
        "tree `82ccec6` (ONECARD_TREE_REV; the machine's stale git HEAD: `7dcd1268cd8c`)")
    assert reference._commit_text({"commit": "82ccec6abc", "dirty": False, "tree_rev": "82ccec6"}) == "commit `82ccec6abc`"
    assert reference._commit_text({"commit": "abc", "dirty": True}) == "commit `abc` (dirty)"


def _lease_arms(tmp_path):
    """Arms whose PYTHONPATH starts with a vllm dir of their own, as on the GPU machine: the
    patched one with the DFlash2 and KVarN markers, the stock one (pristine 0.27.1) without."""
    from onecard import profiles
    from onecard.kvarn.installer import marker_text
    pp = os.pathsep.join([str(REPO), str(REPO / "tests")])
    paths = {}
    for arm, markers in (("patched", profiles.FEATURE_MARKERS.values()), ("stock", ())):
        d = tmp_path / f"site-{arm}" / "vllm"
        d.mkdir(parents=True)
        (d / "__init__.py").write_text("")
        for m in markers:  # KVarN's marker as a current install writes it
            (d / m).write_text(marker_text() if m == profiles.FEATURE_MARKERS["kvarn"] else "1")
        paths[arm] = os.pathsep.join([str(d.parent), pp])
    draft = tmp_path / "drafter"
    draft.mkdir()
    (draft / "config.json").write_text("{}")  # the memory model falls back to the published drafter
    return [reference.Arm("patched", paths["patched"]), reference.Arm("stock", paths["stock"])], str(draft)


def test_lease_tier_schedule_rows_and_estimate(tmp_path, geom_dir):
    """The lease tier: SPEC=off of both arms first (fast: every decode/prefill/prefix row; long:
    the plain step, which also gives the long pool), mtp on both arms, dflash2 and the huge pool
    on the patched arm only (refused for stock by its own vLLM's plan, at no cost), no pool-only
    boot where another boot already logs the pool, and the issue's rows as essential."""
    lease = reference.TIERS["lease"]
    assert lease.boots == 1 and 1000 <= lease.budget_s <= 1050 and lease.decode_tokens == 128
    assert lease.decode == ((1000, (1, 2, 4, 8)), (32000, (1, 2, 4, 8))) and lease.prefill == (1000, 16000, 60000)
    assert lease.spec == ("mtp", "dflash2") and lease.prefix_context == 60000
    assert set(lease.essential) == {
        "pool fast/off", "pool long/off", "pool huge/off",
        *(f"decode {s} C{n}" for s in ("1k", "32k") for n in (1, 2, 4, 8)),
        "prefill 1k", "prefill 16k", "prefill 60k", "prefix 60k turn2/turn1",
        "verify mtp/plain long", "verify dflash2/plain long"}
    assert set(lease.patched_only) == {"pool huge/off", "verify dflash2/plain long"}
    arms, draft = _lease_arms(tmp_path)
    logs = []
    cfg = _cfg(tmp_path, geom_dir, tier=lease, draft=draft)
    cfg.arms, cfg.log = arms, logs.append
    ref = reference.Reference(cfg)
    plan = ref.schedule(arms)
    got = [(b["arm"].name, b["ctx"], b["spec"], b["steps"], bool(b["refused"])) for b in plan]
    assert got == [("patched", "fast", "off", "plain", False), ("stock", "fast", "off", "plain", False),
                   ("patched", "long", "off", "verify", False), ("stock", "long", "off", "verify", False),
                   ("patched", "long", "mtp", "verify", False), ("stock", "long", "mtp", "verify", False),
                   ("patched", "long", "dflash2", "verify", False), ("stock", "long", "dflash2", "verify", True),
                   ("patched", "huge", "off", "pool", False), ("stock", "huge", "off", "pool", True)]
    assert "DFlash2" in plan[7]["refused"] and "KVarN" in plan[9]["refused"]
    # the first SPEC=off boots always run; fast keeps its 65,536 (the 60k rows fit), every long
    # boot runs at the smallest MAX_LEN of its SPEC values (dflash2's drafter layers cap it where one
    # sequence runs without preemption: 90,368 with the patched arm's default GDN_DEFER=auto -> 1; the
    # stock arm plans as stock sizes its pool, GDN_DEFER=0: its SPEC=mtp cap is 118,784, above that)
    assert plan[0]["margin"] is None and plan[0]["env"] == {} and plan[0]["max_len"] == 65536
    assert {b["env"].get("MAX_LEN") for b in plan if b["ctx"] == "long"} == {"90368"}
    assert ref.env_for(arms[1], "long", "mtp")["GDN_DEFER"] == "0" and "GDN_DEFER" not in ref.env_for(arms[0], "long", "mtp")
    assert ref.plan({**os.environ, **ref.env_for(arms[1], "long", "mtp")})["server_config"]["MAX_LEN"] == 118_784
    text = reference.schedule_text(plan, lease.budget_s, lease)
    total = sum(b["est_s"] for b in plan)
    assert 900 < total < 1400 and plan[0]["est_s"] > plan[2]["est_s"] > plan[8]["est_s"] > reference.BOOT_WARM_S * 0.7
    assert text[0].startswith("schedule, tier lease (budget 1050 s") and f"estimated {total:.0f} s warm" in text[-1]
    assert "refused by the plan, no boot" in text[8] and "over budget: likely skipped" in text[9]
    # --verify-ctx renames the verify essentials; CLI names the new tier
    import argparse
    ap = argparse.ArgumentParser()
    reference.configure(ap)
    c = reference.from_args(ap.parse_args(["--tier", "lease", "--model", str(geom_dir), "--verify-ctx", "fast,long",
                                           "--draft", draft]))
    assert c.draft == draft and "verify dflash2/plain" in c.tier.essential and "verify mtp/plain long" in c.tier.essential
    assert "verify dflash2/plain" in c.tier.patched_only and "pool huge/off" in c.tier.patched_only


def test_lease_tier_end_to_end_every_row(tmp_path, geom_dir):
    """The lease tier against the fake server (real prompt sizes, short outputs; 96 decode tokens so
    that C8 has a window of >= 4 chunks a stream in which all 8 decode): every essential
    row measured in each arm that can run it, stock's DFlash2/KVarN rows say why, VALID."""
    lease = dataclasses_replace(reference.TIERS["lease"], decode_tokens=96, verify_tokens=9, prefix_tokens=6)
    arms, draft = _lease_arms(tmp_path)
    logs = []
    cfg = _cfg(tmp_path, geom_dir, tier=lease, draft=draft, budget_s=600)
    cfg.arms, cfg.log = arms, logs.append
    doc = reference.Reference(cfg).run()
    assert doc["verdict"] == "VALID", doc["verdict_reasons"]
    assert [ln for ln in logs if "schedule, tier lease" in ln] and logs.index(
        next(ln for ln in logs if "schedule" in ln)) < logs.index(next(ln for ln in logs if " boot patched-fast-off-b0" in ln))
    booted = [b["name"] for b in doc["boots"] if not b.get("skipped")]
    assert booted == ["patched-fast-off-b0", "stock-fast-off-b0", "patched-long-off-b0", "stock-long-off-b0",
                      "patched-long-mtp-b0", "stock-long-mtp-b0", "patched-long-dflash2-b0", "patched-huge-off-b0"]
    keys = [r["key"] for r in doc["rows"]]
    # CTX=fast's pool (80,827 tokens, the fake logs the plan's) holds two 32k streams: C4 / C8 at
    # 32k are not run, and say why (a measured fact, not a missing row)
    unfit = {"decode 32k C4", "decode 32k C8"}
    for key in unfit:
        for arm in ("patched", "stock"):
            c = _row(doc, key)["arms"][arm]
            assert c["value"] is None and c["measured"] and "holds 2 stream(s)" in c["note"], (key, arm)
    for key in set(lease.essential) - unfit:
        r = _row(doc, key)
        assert r["arms"]["patched"]["value"] is not None, (key, r["arms"]["patched"].get("note"))
        if key in lease.patched_only:
            assert r["arms"]["stock"]["value"] is None and "refuses this plan" in r["arms"]["stock"]["note"], key
        else:
            assert r["arms"]["stock"]["value"] is not None, (key, r["arms"]["stock"].get("note"))
    for key in ("decode 32k C2", "prefill 60k", "prefix 60k turn2/turn1", "step mtp long"):
        assert _row(doc, key)["verdict"]["status"] in ("UNRESOLVED", "OK"), key
    assert _row(doc, "decode 32k C8")["roofline"] and (_row(doc, "prefill 60k")["prompt_tokens"]
                                                       > 3 * _row(doc, "prefill 16k")["prompt_tokens"])
    assert "step plain" not in keys and "step dflash2 long" in keys  # no verify rows on fast
    # the dflash2 roofline: target decode + the plan's drafter bytes + lm_head once (not k MTP passes)
    sb, bw = roofline.StepBytes(**doc["step_bytes"]), doc["bandwidth"]["gbps_read_plus_write"]
    dw = next(b["plan"]["prediction"]["vram"]["drafter_weights"] for b in doc["boots"]
              if b["spec"] == "dflash2" and b.get("plan") and "prediction" in b["plan"])
    assert dw > 0 and _row(doc, "step dflash2 long")["roofline"] == pytest.approx(
        1000.0 * sb.verify_block(1, lease.verify_context, dw) / (bw * 1e9))
    assert _row(doc, "pool long/off")["verdict"]["status"] == "OK"
    assert doc["missing"] == [] and "refuses this plan" in " ".join(s["reason"] for s in doc["skipped"])
    assert "stock-huge-off-b0" in [b["name"] for b in doc["boots"]] and len(doc["schedule"]) == 10


def dataclasses_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


def test_decode_rows_use_the_window_in_which_all_streams_decode():
    """Session 26: a C>1 row is the rate while all C streams decode (runner.decode_window), not
    tokens over a wall time that was mostly 32k prefills; a level vLLM could not run all together
    (a pool of 80k tokens holds two 32k streams) is a measured fact with a note, not a missing row;
    results written before the window existed keep their wall-time aggregate."""
    def lv(n, window, together, why=None):
        rep = {"max_streams_decoding": together, "metrics": {"gauges": {"waiting": {"peak": n - together}}},
               "decode_window": {"tps": window, "why": why}, "decode_window_tps": window}
        return {"n": n, "aggregate_tps": 19.2, "decode_window_tps": window, "reps": [rep]}
    tier = reference.Tier("t", decode=((32000, (2, 4)),), decode_tokens=128, reps=1, prefill=(), verify_context=None,
                          verify_tokens=9, spec=(), prefix_context=None, prefix_tokens=6, pool_ctx=(), boots=1,
                          budget_s=100, essential=("decode 32k C2", "decode 32k C4"))
    arms = ["patched", "stock"]
    boots = [{"arm": a, "spec": "off", "ctx": "fast", "pool_only": False, "name": f"{a}-b0",
              "results": {"decode 32k": {"path": f"{a}.json"}}} for a in arms]
    results = {"patched.json": {"verdict": "VALID", "data": {"levels": [
                   lv(2, 190.0, 2), lv(4, None, 2, "the streams never all decoded at once")]}},
               "stock.json": {"verdict": "VALID", "data": {"levels": [
                   lv(2, None, 1, "the streams never all decoded at once"), lv(4, None, 1)]}}}
    rows = reference.build_rows(boots, results, {"arms": [{"name": a} for a in arms]}, tier)
    c2, c4 = _row({"rows": rows}, "decode 32k C2"), _row({"rows": rows}, "decode 32k C4")
    assert c2["arms"]["patched"]["value"] == 190.0 and not c2["arms"]["patched"].get("flag")
    for cell in (c2["arms"]["stock"], c4["arms"]["patched"], c4["arms"]["stock"]):
        assert cell["value"] is None and cell["measured"] and "streams decoded at once" in cell["note"]
    assert "at most 2 of 4" in c4["arms"]["patched"]["note"] and "no rate of 4 streams" in c4["arms"]["patched"]["note"]
    assert reference.missing_rows(rows, tier, arms) == []
    # a legacy level (no window key): the wall-time aggregate, flagged as before
    legacy = {"data": {"levels": [{"n": 2, "aggregate_tps": 19.2, "reps": [{"max_streams_decoding": 1}]}]}}
    assert reference.fig_decode(legacy, 2) == 19.2
    assert reference.fig_decode(results["patched.json"], 4) is None


def test_pool_levels_skip_only_what_cannot_fit():
    """CTX=fast's pool (80,827 tokens) holds two ~32k streams: C4 / C8 are not run (n prefills for
    a '2 of N' footnote); C1 always runs; no pool known -> every level runs."""
    run, why = reference.pool_levels([1, 2, 4, 8], 32000, 128, 80827)
    assert run == [1, 2] and set(why) == {4, 8} and "holds 2 stream(s) of ~32k + 128 tokens" in why[4]
    assert reference.pool_levels([1, 2, 4, 8], 1000, 128, 80827) == ([1, 2, 4, 8], {})
    assert reference.pool_levels([1, 2], 32000, 128, None) == ([1, 2], {})
    assert reference.pool_levels([1, 2], 90000, 64, 80827) == ([1], {2: reference.pool_levels([2], 90000, 64, 80827)[1][2]})
