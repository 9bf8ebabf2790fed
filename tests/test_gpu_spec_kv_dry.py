"""CPU checks of GPU jobs 71-spec-quant-kv (issue 7) and 63-kvarn-spec (issue 9), both driven by
tests/gpu/spec_kv_sweep.py: bash syntax and time headers; the dry runs (every server's plan
parses with vLLM 0.27.1's own serve parser on the patched tree, + KVarN for job 63, and the
attention backends vLLM would accept for target and drafter layers); whole runs of the driver
against fake servers (a clean run passes; a dead server and a real divergence fail, a near-tie
does not)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import check_job_contract

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "tests" / "gpu" / "spec_kv_sweep.py"
JOBS = {"quant": REPO / "gpu" / "jobs" / "71-spec-quant-kv.sh",
        "kvarn": REPO / "gpu" / "jobs" / "63-kvarn-spec.sh",
        "defer": REPO / "gpu" / "jobs" / "75-gdn-defer.sh"}


@pytest.mark.parametrize("suite", sorted(JOBS))
def test_job_header_and_syntax(suite):
    job = JOBS[suite]
    text = check_job_contract(job)
    assert f"--suite {suite}" in text and "kill_leftover_groups" in text
    assert os.access(job, os.X_OK)
    if suite == "kvarn":   # KVarN exactly as job 61 installs it, into a view of this job's own
        assert "61-kvarn-serve.py setup" in text and "SITE=/var/tmp/site-kvarn-63" in text


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def _dry(suite: str, site: Path, models: Path, out: Path) -> dict:
    env = dict(os.environ, MODELS=str(models), PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    env.pop("GPU_UTIL", None)
    p = subprocess.run([sys.executable, str(DRIVER), "--suite", suite, "--dry-run", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0 and f"[{suite}] dry run PASS" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    lines = {}
    for kind in ("argv", "parsed", "backends", "child_env", "block"):
        lines[kind] = {m.group(1): m.group(2) for m in
                       re.finditer(rf"^\[{suite}\] {kind} (\S+): (.*)$", p.stdout, re.M)}
    return lines


def test_quant_dry_run(tmp_path, patched_site, models):
    if not (patched_site / "vllm" / "dflash2_installed.txt").is_file():
        pytest.skip("patches/series does not list 0080-dflash2.patch")
    d = _dry("quant", patched_site, models, tmp_path)
    names = {f"{kv}-{s}" for kv in ("int8", "int4") for s in ("off", "mtp", "d2k7")}
    assert set(d["parsed"]) == names
    for n in names:
        a = json.loads(d["parsed"][n])
        kv = "int8_per_token_head" if n.startswith("int8") else "int4_per_token_head"
        assert a["kv_cache_dtype"] == kv and a["attention_backend"] == "TRITON_ATTN", n
        assert a["enable_prefix_caching"] and a["mamba_cache_mode"] == "align", n
        assert not a["enforce_eager"] and a["language_model_only"], n   # CUDA graphs, text only
        assert a["max_model_len"] == 2048 and a["kv_cache_memory_bytes"] == 1 << 30, n
        assert a["gpu_memory_utilization"] == 0.06 and a["logprobs_mode"] == "raw_logits", n
        assert a["seed"] == 0 and a["host"] == "127.0.0.1", n
        assert a["additional_config"] == {"gdn_prefill_backend": "triton"}, n
        sc = a["speculative_config"]
        if n.endswith("-off"):
            assert sc is None, n
        elif n.endswith("-mtp"):
            assert sc == {"method": "mtp", "num_speculative_tokens": 3}, n   # CTX=long's k
        else:
            assert sc["method"] == "dflash2" and sc["num_speculative_tokens"] == 7, n
            assert sc["model"] == str(models / "qwen35-tiny-dflash2"), n
        # the launcher's child env goes to every server (wide verify on)
        assert json.loads(d["child_env"][n])["ONECARD_WIDE_VERIFY"] == "1", n
        be = json.loads(d["backends"][n])
        assert be["target"]["ok"] == ["TRITON_ATTN"], n
        if n.endswith("d2k7"):   # the drafter's non-causal block on the quantized cache
            assert be["drafter"]["non_causal"] and be["drafter"]["ok"] == ["TRITON_ATTN"], n
    # blocks the prompt lengths were chosen for (a spec hit needs L > 2B; prompts >= 1,664)
    assert {n: int(b) for n, b in d["block"].items()} == {
        "int8-off": 400, "int8-mtp": 400, "int8-d2k7": 416,
        "int4-off": 768, "int4-mtp": 784, "int4-d2k7": 800}


def test_defer_dry_run(tmp_path, patched_site, models):
    """Job 75: the GDN_DEFER=1 servers get ONECARD_GDN_DEFER=1 (and nothing else differs from
    their stock twins), prefix caching on except mtp-defer-nopc (mamba cache mode none)."""
    if not (patched_site / "vllm" / "dflash2_installed.txt").is_file():
        pytest.skip("patches/series does not list 0080-dflash2.patch")
    d = _dry("defer", patched_site, models, tmp_path)
    names = {"off", "mtp", "mtp-defer", "mtp-defer-nopc", "d2k7-defer", "d2k15-defer"}
    assert set(d["parsed"]) == names
    for n in names:
        a = json.loads(d["parsed"][n])
        child = json.loads(d["child_env"][n])
        assert a["kv_cache_dtype"] == "int8_per_token_head" and a["max_model_len"] == 4096, n
        nopc = n == "mtp-defer-nopc"
        assert a["enable_prefix_caching"] is (not nopc), n
        assert a["mamba_cache_mode"] == ("none" if nopc else "align"), n
        want = "1" if n.endswith(("-defer", "-nopc")) else ("0" if n == "mtp" else None)   # none for SPEC=off
        assert child.get("ONECARD_GDN_DEFER") == want, n
        sc = a["speculative_config"]
        if n == "off":
            assert sc is None
        elif n.startswith("mtp"):
            assert sc == {"method": "mtp", "num_speculative_tokens": 3}, n
        else:
            assert sc["method"] == "dflash2" and sc["num_speculative_tokens"] == int(n[3:5].rstrip("-")), n
    # the defer servers' pools hold fewer GDN blocks: equal attention block sizes as their twins
    assert d["block"]["mtp"] == d["block"]["mtp-defer"]


@pytest.fixture(scope="module")
def kvarn_site(patched_site, tmp_path_factory):
    """KVarN installed as job 63 does it (job 61's setup) into a view of the patched tree."""
    site = tmp_path_factory.mktemp("site-kvarn")
    p = subprocess.run([sys.executable, str(REPO / "gpu/jobs/61-kvarn-serve.py"), "setup",
                        "--src", str(patched_site / "vllm"), "--site", str(site)],
                       capture_output=True, text=True, timeout=120, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(patched_site), str(REPO)])))
    assert p.returncode == 0, p.stdout + p.stderr
    return site


def test_kvarn_dry_run(tmp_path, patched_site, kvarn_site, models):
    if not (patched_site / "vllm" / "dflash2_installed.txt").is_file():
        pytest.skip("patches/series does not list 0080-dflash2.patch")
    d = _dry("kvarn", kvarn_site, models, tmp_path)
    names = {"kvarn-off", "kvarn-mtp", "kvarn-d2k7"}
    assert set(d["parsed"]) == names
    for n in names:
        a = json.loads(d["parsed"][n])
        assert a["kv_cache_dtype"] == "kvarn_k4v2_g128" and a["attention_backend"] is None, n
        assert a["enable_prefix_caching"] and a["mamba_cache_mode"] == "align", n
        assert not a["enforce_eager"] and a["max_model_len"] == 4096, n
        assert a["kv_cache_memory_bytes"] == 1 << 30 and a["logprobs_mode"] == "raw_logits", n
        assert a["kv_cache_dtype_skip_layers"] == [], n
        assert int(d["block"][n]) == 1024, n   # prompts of 2,176.. > 2B
        be = json.loads(d["backends"][n])
        assert be["target"]["ok"] == ["KVARN"] and be["target"]["head_dim"] == 256, n
        child = json.loads(d["child_env"][n])
        sc = a["speculative_config"]
        if n == "kvarn-d2k7":
            # KVARN has no non-causal attention for the drafter's block, and bf16 skip layers fail at
            # vLLM's KV-cache setup (docs/results/2026-12-03-huge-dflash2-cpu): the drafter's layers
            # live in rings outside the pool instead (DFLASH_RING=1), bf16 on FLASH_ATTN
            assert sc["method"] == "dflash2" and sc["num_speculative_tokens"] == 7, n
            assert sc["model"] == str(models / "qwen35-tiny-dflash2"), n
            assert child["ONECARD_DFLASH_RING"] == "1", n
            assert be["drafter"]["non_causal"] and be["drafter"]["kv"] == "auto", n
            assert "FLASH_ATTN" in be["drafter"]["ok"] and "KVARN" not in be["drafter"]["ok"], n
        else:
            assert "ONECARD_DFLASH_RING" not in child and "drafter" not in be, n


# ----------------------------------------------------------------------------- fake servers

FAKE = textwrap.dedent('''
    """A stand-in for a vLLM server: /health, /metrics, /v1/completions (greedy, raw logits)."""
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    port, mode = int(sys.argv[1]), sys.argv[2]
    if mode == "die":
        sys.stderr.write("ValueError: No valid attention backend found ... "
                         "['non-causal attention not supported']\\n")
        sys.exit(3)
    seen, hits = {}, [0.0]

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"   # keep-alive, as uvicorn

        def log_message(self, *a):
            pass

        def _send(self, code, body, ctype="application/json"):
            b = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(b)))
            self.end_headers()
            self.wfile.write(b)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, "")
            elif self.path == "/metrics":
                self._send(200, 'vllm:prefix_cache_queries_total{engine="0"} 1000.0\\n'
                                f'vllm:prefix_cache_hits_total{{engine="0"}} {hits[0]}\\n'
                                'vllm:spec_decode_num_drafts_total{engine="0"} 5.0\\n', "text/plain")
            else:
                self._send(404, "")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = len(body["prompt"])
            seen[n] = seen.get(n, 0) + 1
            if seen[n] > 1:
                hits[0] += n
            toks, top = [], []
            for i in range(body["max_tokens"]):
                t = 10 + (n * 7 + i) % 50
                top.append({f"token_id:{t}": 5.0, f"token_id:{t + 1}": 4.98, f"token_id:{t + 2}": 1.0})
                if i == 3 and n % 128 == 5 and mode == "tie":
                    t += 1          # a near-tie of off's logits: allowed
                if i == 3 and n % 128 == 9 and mode == "diverge" and seen[n] > 1:
                    t += 2          # 4.0 below off's top: a real divergence (pass 2 only)
                toks.append(f"token_id:{t}")
            lp = {"tokens": toks, "top_logprobs": top}
            self._send(200, json.dumps({"choices": [{"text": "", "logprobs": lp}]}))

    ThreadingHTTPServer.request_queue_size = 512   # 64 concurrent clients (uvicorn: 2048)
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')


def _fake_run(tmp_path, monkeypatch, models, modes: dict, warm_first=None):
    pytest.importorskip("httpx")
    monkeypatch.setenv("MODELS", str(models))
    sys.path.insert(0, str(DRIVER.parent))
    import spec_kv_sweep as sk

    fake = tmp_path / "fake_server.py"
    fake.write_text(FAKE)
    monkeypatch.setattr(sk, "WARM_MAX_S", 20)
    monkeypatch.setattr(sk, "WARM_RESERVE_S", 10)
    monkeypatch.setattr(sk, "SWEEP_RESERVE_S", 10)

    def fake_plans(st, model, root):
        out = {}
        for n in st["servers"]:
            port = sk.d2.free_port()
            argv = [sys.executable, str(fake), str(port), modes.get(n, "ok"), "--port", str(port)]
            out[n] = (argv, {}, SimpleNamespace(prediction={"block_size": 400}))
        return out

    out = tmp_path / "out"
    out.mkdir()
    rc = sk.run("quant", out, 120.0, warm_first, plans_fn=fake_plans)
    return rc, json.loads((out / "quant.json").read_text())


def test_run_against_fake_servers_clean(tmp_path, monkeypatch, models, capsys):
    rc, rec = _fake_run(tmp_path, monkeypatch, models, {"int4-mtp": "tie"})
    text = capsys.readouterr().out
    assert rc == 0, text[-3000:]
    assert rec["failures"] == [] and all(s["boot_s"] is not None for s in rec["servers"].values())
    r = rec["greedy"]["int4-mtp-pass1"]
    assert r["equal"] == 127 and len(r["near_ties"]) == 1 and r["near_ties"][0]["residue"] == 5
    assert rec["greedy"]["int8-d2k7-pass2-cached"]["equal"] == 128
    # pass 2 resends every prompt: the fake counts them as hits
    assert rec["prefix_cache"]["int8-off-pass2-cached"]["hits"] == sum(range(1664, 1792))
    assert "[quant] boot: int8-off" in text and "[quant] PASS" in text
    assert re.search(r"\[quant\] greedy int4-mtp vs int4-off pass1: 127/128 identical, 1 bf16 "
                     r"near-ties", text)


def test_run_against_fake_servers_failures(tmp_path, monkeypatch, models, capsys):
    rc, rec = _fake_run(tmp_path, monkeypatch, models,
                        {"int8-mtp": "die", "int4-d2k7": "diverge"}, warm_first="")
    text = capsys.readouterr().out
    assert rc == 1
    assert rec["servers"]["int8-mtp"]["boot_s"] is None
    assert "non-causal" in rec["servers"]["int8-mtp"]["error"]
    assert rec["greedy"]["int4-d2k7-pass1"]["bad"] == []
    bad = rec["greedy"]["int4-d2k7-pass2-cached"]["bad"]
    assert len(bad) == 1 and bad[0]["residue"] == 9 and bad[0]["pos"] == 3
    assert rec["failures"] == ["int8-mtp did not boot (" + rec["servers"]["int8-mtp"]["error"] + ")",
                               "int4-d2k7 vs int4-off pass2-cached: 1 real divergences"]
    assert "boot int8-mtp: FAILED" in text and "[quant] FAIL" in text


def test_spec_kv_knobs_reach_every_server_of_the_suite(monkeypatch):
    """SPEC_KV_KNOBS lays launcher knobs over the suite's base (job 63 with KVARN_DRAFT_HOST=1):
    an exported ONECARD_* variable would be overwritten by the plan's child environment."""
    sys.path.insert(0, str(DRIVER.parent))
    import spec_kv_sweep as sk

    st = sk.suite("kvarn", environ={"SPEC_KV_KNOBS": "KVARN_DRAFT_HOST=1  KVARN_WINDOW=3"})
    assert st["base"]["KVARN_DRAFT_HOST"] == "1" and st["base"]["KVARN_WINDOW"] == "3"
    assert st["base"]["CTX"] == "huge"
    assert "KVARN_DRAFT_HOST" not in sk.suite("kvarn", environ={})["base"]
    for bad in ("KVARN_DRAFT_HOST", "kvarn_window=3", "X=", "=1"):
        with pytest.raises(ValueError, match="valid: KNOB=VALUE"):
            sk.suite("kvarn", environ={"SPEC_KV_KNOBS": bad})
