"""Job 62's driver (61-kvarn-serve.py decode) without a GPU: the arms' boots and requests are
faked; what is checked is the arm order and environment, the per-depth rows, the ratio table,
the text comparison and the JSON."""
import importlib.util
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _load():
    sys.path.insert(0, str(REPO / "gpu" / "lib"))
    spec = importlib.util.spec_from_file_location("job61", REPO / "gpu" / "jobs" / "61-kvarn-serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_table_and_ratio(tmp_path, monkeypatch, capsys):
    mod = _load()
    monkeypatch.setattr("signal.signal", lambda *a: None)   # the driver's SIGTERM hook, not pytest's
    (tmp_path / "models" / "qwen38-27b-geom").mkdir(parents=True)
    (tmp_path / "models" / "qwen38-27b-geom" / "config.json").write_text("{}")
    launched = []

    def fake_launch(env, log, deadline, need_health):
        launched.append((env["CTX"], env["KVARN_GRAPHS"]))
        assert env["PREFILL_LAUNCH"] == "auto"
        assert env["SPEC"] == "off" and "--enforce-eager" not in env["EXTRA_ARGS"]
        Path(log).write_text("".join(f"x [onecard host timing] steps {i}-{i + 39} (median ms): step 28.0\n"
                                     for i in (1, 41, 81, 121))
                             + "WARNING x CUDAGraphMode.FULL_AND_PIECEWISE ...; setting cudagraph_mode=PIECEWISE\n")
        return ({"healthy": True, "pool_tokens": 1000, "prediction": {"pool_tokens": 1000},
                 "values": {"SERVED_NAME": {"value": "m"}}, "boot_s": 1.0}, None, "http://x")

    speed = {("huge", "1"): 40.0, ("huge", "0"): 20.0, ("long", "1"): 25.0}
    monkeypatch.setattr(mod, "_launch", fake_launch)
    monkeypatch.setattr(mod, "_decode", lambda url, model, d: {
        "ok": True, "error": None, "prompt_tokens": d, "completion_tokens": 128, "ttft_s": 0.5,
        "decode_tps": speed[launched[-1]], "first_run_decode_tps": 1.0,
        "text_sha256": "same" if launched[-1][0] == "huge" else "other"})
    a = type("A", (), {"out": str(tmp_path / "o"), "models": str(tmp_path / "models"),
                       "deadline": time.time() + 1000, "depths": "8192,32768",
                       "arms": mod.DECODE_ARMS})()
    assert mod.decode(a) == 0
    assert launched == [("huge", "1"), ("huge", "0"), ("long", "1")]
    out = capsys.readouterr().out
    assert "| depth | kvarn tok/s | kvarn-pw tok/s | int8 tok/s | kvarn / int8 | kvarn-pw / int8 | " \
           "kvarn / kvarn-pw | kvarn text == kvarn-pw |" in out
    assert "| 8192 | 40.0 | 20.0 | 25.0 | 1.600 | 0.800 | 2.000 | SAME |" in out
    assert "| 32768 | 40.0 | 20.0 | 25.0 | 1.600 | 0.800 | 2.000 | SAME |" in out
    assert "kvarn-pw: WARNING x CUDAGraphMode.FULL_AND_PIECEWISE" in out
    rec = json.loads((tmp_path / "o" / "decode.json").read_text())
    assert rec["depths"] == [8192, 32768] and rec["kvarn"]["decode"]["8192"]["decode_tps"] == 40.0
    assert "provenance" in rec
    # the probe's last three windows per arm, in the summary and the JSON
    assert "kvarn: [onecard host timing] steps 121-160 (median ms): step 28.0" in out
    assert rec["int8"]["host_timing"][0].startswith("steps 41-80") and len(rec["kvarn"]["host_timing"]) == 3


def test_decode_skips_arms_without_time(tmp_path, monkeypatch, capsys):
    mod = _load()
    monkeypatch.setattr("signal.signal", lambda *a: None)
    (tmp_path / "m" / "qwen38-27b-geom").mkdir(parents=True)
    (tmp_path / "m" / "qwen38-27b-geom" / "config.json").write_text("{}")
    monkeypatch.setattr(mod, "_launch", lambda *a: (_ for _ in ()).throw(AssertionError("no boot")))
    a = type("A", (), {"out": str(tmp_path / "o"), "models": str(tmp_path / "m"),
                       "deadline": time.time() + 60, "depths": "8192", "arms": "kvarn:huge:1,int8:long:1"})()
    assert mod.decode(a) == 1
    assert "kvarn: skipped" in capsys.readouterr().out


def test_decode_arms_are_validated():
    mod = _load()
    assert mod.parse_arms("a:huge:1, b:long:0") == [("a", "huge", "1", "auto", {}), ("b", "long", "0", "auto", {})]
    assert mod.parse_arms("i:long:1:64:64:8:2") == [("i", "long", "1", "64:64:8:2", {})]
    assert mod.parse_arms("s:long:1:stock") == [("s", "long", "1", "stock", {})]
    assert mod.parse_arms("w:huge:1:KVARN_WINDOW=3:KVARN_SINKS=2") == [
        ("w", "huge", "1", "auto", {"KVARN_WINDOW": "3", "KVARN_SINKS": "2"})]
    for bad in ("a:huge", "a:tiny:1", "a:huge:2", "a:huge:1,a:long:1", "", "a:long:1:64:64", "a:long:1:x:64:8:2",
                "a:long:1:fast", "a:huge:1:kvarn_window=3", "a:huge:1:KVARN_WINDOW="):
        try:
            mod.parse_arms(bad)
        except ValueError as e:
            assert "valid" in str(e) or "distinct" in str(e)
        else:
            raise AssertionError(bad)


def _quality(tmp_path, capsys, arms: dict) -> tuple[int, str]:
    """Job 61's quality report over a compare.json holding ``arms``: (exit code, what it printed)."""
    import types

    (tmp_path / "compare.json").write_text(json.dumps({"arms": arms}))
    rc = _load().quality(types.SimpleNamespace(dir=str(tmp_path), max_delta=25))
    return rc, capsys.readouterr().out


def test_job61_quality_reports_the_k4v4_arm(tmp_path, capsys):
    rc, out = _quality(tmp_path, capsys, {
        "kvarn": {"ppl": 52.28, "base_ppl": 52.05, "delta_ppl_pct": 0.435, "first_divergence_min": 10},
        "kvarn-v4": {"ppl": 52.1, "delta_ppl_pct": 0.09}})
    assert rc == 0 and "kvarn k4v4_g128 perplexity 52.1000: +0.090 % vs bf16 (goal <= 0.5 %: MET)" in out


def test_prompt_sized_with_the_served_tokenizer(monkeypatch):
    """The word count comes from the server's /tokenize, not a words-per-token guess: a tokenizer
    that makes 1.54 tokens per word (session 14's 27B geometry) still gets prompts within 1 %."""
    import httpx

    mod = _load()
    calls = []

    class Resp:
        def __init__(self, n):
            self.n = n

        def raise_for_status(self):
            return None

        def json(self):
            return {"count": self.n}

    def post(url, json=None, timeout=None):
        calls.append(url)
        return Resp(int(len(json["prompt"].split()) * 1.54) + 3)

    monkeypatch.setattr(httpx, "post", post)
    words = ["w"] * 200_000
    for target in (8192, 32768, 120000):
        n = mod._words_for_tokens("http://h:1", "m", words, target)
        assert abs(int(n * 1.54) + 3 - target) <= target // 100
    assert all(u == "http://h:1/tokenize" for u in calls) and len(calls) <= 12


def test_job61_quality_names_the_default_rule_and_the_old_one(tmp_path, capsys, monkeypatch):
    """The kvarn arm is the server's default read rule (window 3 + two sinks since session 17);
    the old default's arm (kvarn-w2s1) is judged against the goal beside it."""
    for v in ("ONECARD_KVARN_WINDOW", "ONECARD_KVARN_SINKS"):
        monkeypatch.delenv(v, raising=False)
    rc, out = _quality(tmp_path, capsys, {
        "kvarn": {"ppl": 51.922, "base_ppl": 51.709, "delta_ppl_pct": 0.413, "first_divergence_min": 6},
        "kvarn-w2s1": {"ppl": 52.044, "delta_ppl_pct": 0.649}})
    assert rc == 0 and "goal |delta| <= 0.5 % vs bf16 (window 3 + sinks 2): MET" in out
    assert "kvarn fp16 window 2 + sink 1 perplexity 52.0440: +0.649 % vs bf16 (goal <= 0.5 %: NOT MET)" in out
