"""Benchmarks end to end against the fake server: VALID results, partial results on a dying
server, other tenants caught, config, report, compare CLI, boot-per-arm A/B."""
import json
import math
import socket
import sys
from pathlib import Path

import pytest

from fake_openai_server import FakeServer
from onecard.bench import config, prompts, report, runner
from onecard.bench.cli import main as bench_main
from onecard.bench.client import RequestResult


def _target(url, tmp_path, **kw):
    return runner.Target(url=url, model="fake", out_dir=str(tmp_path), metrics_interval=0.05,
                         log=lambda s: None, **kw)


def test_ladder_counts_usage_tokens_and_is_valid(tmp_path):
    with FakeServer(tokens_per_chunk=4) as s:
        res = runner.ladder(_target(s.url, tmp_path), prompts.load("prose"), [1, 2], max_tokens=17, reps=1)
    assert res["verdict"] == "VALID", res["verdict_reasons"]
    lv = res["data"]["levels"]
    assert [x["n"] for x in lv] == [1, 2]
    rep = lv[1]["reps"][0]
    assert rep["completion_tokens"] == 34 and rep["chunks"] == 10  # chunks never counted
    assert rep["aggregate_tps"] == pytest.approx(34 / rep["wall_s"])
    on_disk = json.loads(Path(res["path"]).read_text())
    assert on_disk["verdict"] == "VALID" and on_disk["partial"] is False
    assert on_disk["provenance"]["prompt_set"]["hash"] == prompts.load("prose").hash
    assert on_disk["provenance"]["warmup"]["discarded"] == 1


def test_dying_server_leaves_partial_invalid_result(tmp_path):
    with FakeServer(tokens_per_chunk=2, die_after_chunks=3) as s:
        res = runner.ladder(_target(s.url, tmp_path, warmup=0), prompts.load("prose"), [1], 20, 1)
    on_disk = json.loads(Path(res["path"]).read_text())
    assert on_disk["verdict"] == "INVALID" and on_disk["partial"] is True
    assert "[DONE]" in on_disk["verdict_reasons"][0]


def test_other_tenant_is_caught(tmp_path):
    with FakeServer(tokens_per_chunk=2, phantom_requests_per_scrape=1) as s:
        res = runner.ladder(_target(s.url, tmp_path), prompts.load("code"), [1], 9, 1)
    assert res["verdict"] == "INVALID"
    assert any("other client traffic" in r for r in res["verdict_reasons"])


def test_perplexity_and_needle_and_turns(tmp_path):
    with FakeServer(tokens_per_chunk=3) as s:
        t = _target(s.url, tmp_path)
        ppl = runner.perplexity(t, prompts.load("copy"))
        nd = runner.needle(t, [100], [0.0, 1.0])
        pt = runner.prefix_turns(t, 100, 2, 8)
        dp = runner.depth(t, [50, 100], 6)
    assert ppl["verdict"] == "VALID" and ppl["data"]["ppl"] == pytest.approx(math.e)
    assert ppl["data"]["method"] == "echo+logprobs"
    assert nd["verdict"] == "VALID" and nd["data"]["recall"] == 0.0  # the fake never recalls
    assert [x["turn"] for x in pt["data"]["turns"]] == [1, 2]
    assert pt["data"]["turns"][1]["prompt_tokens"] > pt["data"]["turns"][0]["prompt_tokens"]
    assert dp["verdict"] == "VALID" and dp["provenance"]["prompt_set"]["salted"]


def test_build_context_places_needle():
    text = runner.build_context(300, needle="NEEDLE", depth=0.0)
    assert text.startswith("NEEDLE") and len(text) >= 1200
    assert runner.build_context(300, needle="NEEDLE", depth=1.0).endswith("NEEDLE")


def test_max_overlap_and_tail_mode():
    assert runner.max_overlap([(0, 2), (1, 3), (2.5, 4)]) == 2
    assert runner.max_overlap([(0, 1), (1, 2)]) == 1


def test_config_validation_messages(tmp_path):
    with pytest.raises(config.ConfigError, match="kind must be one of"):
        config.validate({"server": {"url": "u", "model": "m"}, "runs": [{"kind": "nope"}]})
    with pytest.raises(config.ConfigError, match="unknown key"):
        config.validate({"server": {"url": "u", "model": "m"}, "runs": [{"kind": "ladder", "x": 1}]})
    with pytest.raises(config.ConfigError, match="url and model"):
        config.validate({"server": {}, "runs": [{"kind": "ladder"}]})


def test_yaml_config_runs_and_report(tmp_path):
    with FakeServer(tokens_per_chunk=4) as s:
        cfg = tmp_path / "run.yaml"
        cfg.write_text(f"""
server: {{url: "{s.url}", model: fake}}
out_dir: "{tmp_path / 'res'}"
metrics_interval: 0.05
runs:
  - {{kind: ladder, prompts: chat, n: [1, 2], max_tokens: 8, reps: 1}}
  - {{kind: spec, prompts: [prose, code], max_tokens: 8}}
""")
        assert bench_main(["run", str(cfg)]) == 0
    md = tmp_path / "report.md"
    text = report.write_report([tmp_path / "res"], md)
    assert "| C2 |" in text and "**VALID**" in text and "acceptance per position" in text
    assert md.read_text() == text
    files = sorted((tmp_path / "res").glob("ladder-*.json"))
    assert bench_main(["compare", str(files[0]), str(files[0])]) == 0


def test_compare_cli_refuses_different_prompts(tmp_path, capsys):
    with FakeServer(tokens_per_chunk=2) as s:
        t = _target(s.url, tmp_path)
        a = runner.ladder(t, prompts.load("prose"), [1], 6, 1)
        b = runner.ladder(t, prompts.load("code"), [1], 6, 1)
    assert bench_main(["compare", a["path"], b["path"]]) == 1
    assert "REFUSED" in capsys.readouterr().out


def _free_port():
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def test_ab_boots_each_arm_and_reads_the_floor(tmp_path, monkeypatch):
    from onecard.bench import provenance
    from onecard.bench.ab import run_ab
    # a commit landing between boots would (rightly) make the A/B CONFOUNDED: pin it here
    monkeypatch.setattr(provenance, "git_info", lambda *a: {"commit": "fixed", "dirty": False})
    port = _free_port()
    fake = Path(__file__).with_name("fake_openai_server.py")
    cmd = f"exec {sys.executable} {fake} {port}"
    t = runner.Target(url=f"http://127.0.0.1:{port}", model="fake", out_dir=str(tmp_path),
                      metrics_interval=0.05, log=lambda s: None)
    res = run_ab(t, cmd, "FAKE_DELAY", "0.002", "0.004", boots=2, max_tokens=12, boot_timeout=30)
    v = res["data"]["verdict"]
    assert v["status"] in ("RESOLVED", "UNRESOLVED"), v  # never CONFOUNDED: only the knob differs
    assert v["boots"] == [2, 2] and v["floor"] is not None
    assert len(res["data"]["per_boot"]) == 4
    one = run_ab(t, cmd, "FAKE_DELAY", "0.002", "0.004", boots=1, max_tokens=8, boot_timeout=30)
    assert one["data"]["verdict"]["status"] == "UNRESOLVED"
    assert "boot floor unknown" in one["data"]["verdict"]["reasons"][0]


def test_suites_are_valid_configs():
    for mode in ("single", "batch"):
        cfg = config.suite(mode, "http://127.0.0.1:1", "m", "out", prefill=True, long=True)
        kinds = {r["kind"] for r in cfg["runs"]}
        assert "ladder" in kinds and "depth" in kinds
    with pytest.raises(config.ConfigError, match="single, batch"):
        config.suite("huge", "u", "m", "o")


def test_run_benchmarks_sh_refuses_bad_mode():
    import subprocess
    sh = Path(__file__).resolve().parents[1] / "bench" / "run_benchmarks.sh"
    r = subprocess.run(["bash", str(sh), "nope"], capture_output=True, text=True,
                       env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHON": sys.executable})
    assert r.returncode == 2 and "single" in r.stderr


def test_onecard_bench_without_benchmark_names_valid_ones(capsys):
    from onecard.cli import main
    assert main(["bench"]) == 2
    assert "ladder" in capsys.readouterr().err


def test_unknown_prompt_set_names_valid_ones():
    with pytest.raises(ValueError, match="prose"):
        prompts.load("nonexistent")


def test_shipped_prompt_sets_load():
    for name in ("prose", "code", "copy", "chat"):
        ps = prompts.load(name)
        assert len(ps.prompts) >= 6 and len(ps.hash) == 64


def test_plots_when_matplotlib_is_there(tmp_path):
    pytest.importorskip("matplotlib")
    with FakeServer(tokens_per_chunk=2) as s:
        t = _target(s.url, tmp_path / "res")
        runner.ladder(t, prompts.load("prose"), [1, 2], 6, 1)
        runner.depth(t, [50, 200], 6)
    text = report.write_report([tmp_path / "res"], tmp_path / "r.md", tmp_path / "ladder.png")
    assert (tmp_path / "ladder.png").stat().st_size > 1000
    assert (tmp_path / "ladder-depth.png").stat().st_size > 1000
    assert "![ladder](ladder.png)" in text and "![depth](ladder-depth.png)" in text


def test_contexts_beyond_max_model_len_are_skipped(tmp_path):
    with FakeServer(tokens_per_chunk=2) as s:  # the fake reports max_model_len 4096
        res = runner.depth(_target(s.url, tmp_path), [100, 8000], 6)
    assert [p["context"] for p in res["data"]["points"]] == [100]
    assert res["data"]["skipped"][0]["context"] == 8000 and res["verdict"] == "VALID"


def test_smoke_suite_has_every_single_user_axis_and_fits_8k():
    cfg = config.suite("single", "http://127.0.0.1:1", "m", "out", prefill=True, size="smoke", label="smol")
    kinds = [r["kind"] for r in cfg["runs"]]
    assert set(kinds) == {"ladder", "depth", "prefix_turns", "needle", "perplexity", "spec"}
    assert cfg["label"] == "smol"
    # estimated contexts x 4/2.6 (small-vocabulary tokenizer) + output must fit 8,192
    for r in cfg["runs"]:
        for ctx in r.get("contexts", []) + [r.get("context_tokens", 0)]:
            assert ctx * 4 / 2.6 * 1.05 + r.get("max_tokens", 64) < 8192, r
    with pytest.raises(config.ConfigError, match="valid: default, smoke"):
        config.suite("single", "u", "m", "o", size="tiny")
    with pytest.raises(config.ConfigError, match="without --long"):
        config.suite("single", "u", "m", "o", long=True, size="smoke")


def _stream(first, chunks, dt, tokens=None, lead=()):
    """A finished request whose content chunks arrive ``lead`` (explicit times) then ``chunks``
    more every ``dt`` s from ``first``."""
    r = RequestResult(ok=True, t_start=0.0)
    r.chunk_times = list(lead) + [first + i * dt for i in range(chunks)]
    r.t_first, r.t_last, r.t_end = r.chunk_times[0], r.chunk_times[-1], r.chunk_times[-1]
    r.completion_tokens = tokens if tokens is not None else len(r.chunk_times)
    r.chunks = len(r.chunk_times)
    return r


def test_decode_window_leaves_prefill_out():
    """Job 80, 2026-12-05 (session 26), decode 32k C2: stream 1 decoded 16 tokens at prefill-step
    pace (0.35 s a step) while stream 2 prefilled, then both decoded together at ~100 tok/s each.
    Tokens over the wall time said ~19 tok/s; the window in which both decode says ~200."""
    a = _stream(11.6 + 0.01, 112, 0.01, lead=[6.0 + 0.35 * i for i in range(16)])
    b = _stream(11.6, 128, 0.01)
    w = runner.decode_window([a, b])
    assert w["tps"] == pytest.approx(200.0, rel=0.03) and w["window_s"] == pytest.approx(1.11, abs=0.01)
    st = runner.level_stats([a, b], 2)
    assert st["decode_window_tps"] == w["tps"] and st["aggregate_tps"] < 25
    # the usage count, not the chunks: two tokens a chunk doubles the rate
    a2, b2 = _stream(0.0, 50, 0.01, tokens=100), _stream(0.0, 50, 0.01, tokens=100)
    assert runner.decode_window([a2, b2])["tps"] == pytest.approx(400.0, rel=0.03)


def test_decode_window_none_when_streams_never_decode_together():
    a, b = _stream(0.0, 50, 0.01), _stream(5.0, 50, 0.01)  # one after the other (a queued stream)
    w = runner.decode_window([a, b])
    assert w["tps"] is None and "never all decoded" in w["why"]
    c = _stream(0.475, 50, 0.01)  # overlaps a for 2 chunks only
    w = runner.decode_window([a, c])
    assert w["tps"] is None and "< 4" in w["why"]
    assert runner.decode_window([RequestResult(ok=True, completion_tokens=5)]) is None  # no chunk times
    failed = _stream(0.0, 50, 0.01)
    failed.ok = False
    assert runner.decode_window([a, failed]) is None
    # a level is windowed only if every rep had a window
    reps = [dict(runner.level_stats([a, _stream(0.0, 50, 0.01)], 2), metrics={}),
            dict(runner.level_stats([a, b], 2), metrics={})]
    assert runner._ladder_level(2, reps)["decode_window_tps"] is None
    assert runner._ladder_level(2, reps[:1])["decode_window_tps"] == pytest.approx(200.0, rel=0.05)
