"""Client-side stalls: a request the engine saw late (client TTFT far above the server's, or the
engine idle while we waited) makes TTFT axes INVALID and other axes warn (2026-12-02: a
prefix_turns turn 1 at 103.8 s for 1.8k tokens was marked VALID)."""
import re

import pytest

from fake_openai_server import FakeServer
from onecard.bench import fairness, metrics, prompts, runner

STALL = 1.3  # s, before the fake's "engine" sees the request


def _target(url, tmp_path, **kw):
    return runner.Target(url=url, model="fake", out_dir=str(tmp_path), metrics_interval=0.05,
                         log=lambda s: None, **kw)


def _stalls(res):
    return [r for r in res["verdict_reasons"] if r.startswith("client-side stall")]


def test_stalled_turn_is_invalid_with_the_reason(tmp_path):
    with FakeServer(stall={2: STALL}) as s:  # POST 1 is the warmup, POST 2 turn 1
        res = runner.prefix_turns(_target(s.url, tmp_path), 100, 2, 8)
    assert res["verdict"] == "INVALID", res["verdict_reasons"]
    (why,) = _stalls(res)
    assert re.fullmatch(r"client-side stall: client TTFT 1\.\d{3} s vs server 0\.\d{3} s"
                        r"(; engine idle .*)? \(request 1, turn 1\)", why), why
    t1, t2 = res["data"]["turns"]
    assert t1["ttft"] > STALL and t1["server_ttft"] < 0.2 and t2["server_ttft"] < 0.2
    rec = res["server_side"]["requests"][0]
    assert rec["server_e2e"] is not None and rec["server_queue"] == 0.0


def test_normal_runs_stay_valid_with_the_server_view(tmp_path):
    with FakeServer() as s:
        t = _target(s.url, tmp_path)
        pt = runner.prefix_turns(t, 100, 2, 8)
        dp = runner.depth(t, [50, 100], 6)
        nd = runner.needle(t, [100], [0.5])
    for res in (pt, dp, nd):
        assert (res["verdict"], res["verdict_reasons"]) == ("VALID", [])
        recs = res["server_side"]["requests"]
        assert recs and all(r["server_ttft"] is not None and r["server_ttft"] <= r["client_ttft"]
                            for r in recs)
        assert all(r["engine_idle_s"] is not None and r["engine_idle_s"] < 1.0 for r in recs)
    assert [r["n"] for r in dp["server_side"]["requests"]] == [1, 2]


def test_engine_idle_alone_catches_a_stall_without_histograms(tmp_path):
    with FakeServer(stall={2: 1.6}, histograms=False) as s:
        res = runner.depth(_target(s.url, tmp_path), [50], 6)
    assert res["verdict"] == "INVALID"
    (why,) = _stalls(res)
    assert "engine idle (vllm:num_requests_running 0) for 1." in why and "(request 1, context 50)" in why


def test_missing_histograms_are_said_not_failed(tmp_path):
    with FakeServer(histograms=False) as s:
        res = runner.prefix_turns(_target(s.url, tmp_path), 100, 1, 8)
    assert res["verdict"] == "VALID"
    assert res["verdict_reasons"] == ["client-side stalls checked by the engine-idle gauge only: "
                                      "server exposes no vllm:time_to_first_token_seconds histogram"]


def test_stall_in_a_ladder_invalidates_it(tmp_path):
    # the ladder's TTFT column and its aggregate tok/s (wall time) both contain the stall
    with FakeServer(stall={2: STALL}) as s:
        res = runner.ladder(_target(s.url, tmp_path), prompts.load("prose"), [1], 9, 1)
    assert res["verdict"] == "INVALID"
    (why,) = _stalls(res)
    assert "(request 1, C1 rep0)" in why and not why.endswith("warning only)")
    assert res["data"]["levels"][0]["reps"][0]["requests"][0]["server"]["server_ttft"] < 0.2


# -- the rule itself, no server --------------------------------------------------------------
@pytest.mark.parametrize("client, server, idle, stalled", [
    (0.9, 0.5, 0.0, False),     # 0.4 s over: below the 0.5 s floor
    (1.1, 0.5, 0.0, True),      # 0.6 s over
    (28.0, 19.0, 0.0, False),   # 9 s over a 19 s prefill: below 50 %
    (30.0, 19.0, 0.0, True),
    (103.849, 0.03, None, True),  # 2026-12-02
    (0.3, None, 1.2, True),     # no histogram, engine idle 1.2 s
    (0.3, None, 0.9, False),
    (None, 0.1, 5.0, False),    # failed request: nothing to compare
])
def test_stall_rule(client, server, idle, stalled):
    rec = {"n": 3, "client_ttft": client, "server_ttft": server, "engine_idle_s": idle}
    why = fairness.stall_reason(rec)
    assert (why is not None) == stalled
    if stalled and server is not None:
        assert why == f"client-side stall: client TTFT {client:.3f} s vs server {server:.3f} s (request 3)"


def _result(kind, **rec):
    return {"kind": kind, "provenance": {"token_count_source": "usage.completion_tokens",
                                         "warmup": {"discarded": 1},
                                         "prompt_set": {"hash": "h", "salted": True}},
            "traffic": {"requests": 1, "failed": 0}, "metrics": {"available": True, "engines": ["0"]},
            "server_side": {"requests": [{"n": 1, "histograms": True, **rec}]}}


@pytest.mark.parametrize("kind, verdict", [("prefix_turns", "INVALID"), ("depth", "INVALID"),
                                           ("needle", "INVALID"), ("spec", "VALID"), ("ladder", "INVALID")])
def test_stall_verdict_by_axis(kind, verdict):
    res = _result(kind, client_ttft=103.849, server_ttft=0.031, engine_idle_s=100.0)
    v, reasons = fairness.verdict_for(res)
    assert v == verdict and reasons[0].startswith("client-side stall: client TTFT 103.849 s vs server "
                                                  "0.031 s; engine idle")


def test_no_server_series_is_not_verified():
    res = _result("depth", client_ttft=0.2, server_ttft=None, engine_idle_s=None, histograms=False,
                  note="server exposes no vllm:time_to_first_token_seconds histogram")
    assert fairness.verdict_for(res) == ("VALID", [
        "client-side stalls not verified: server exposes no vllm:time_to_first_token_seconds histogram"])


# -- metrics helpers ---------------------------------------------------------------------------
def _snap(t, running=None, ttft=None, n=None):
    v = {}
    if running is not None:
        v["vllm:num_requests_running"] = running
    if ttft is not None:
        v["vllm:time_to_first_token_seconds_sum"], v["vllm:time_to_first_token_seconds_count"] = ttft, n
    return metrics.Snapshot(t, v)


def test_server_view_and_engine_idle():
    s = [_snap(0.0, 0, 1.0, 4)] + [_snap(0.1 + 0.25 * i, 0, 1.0, 4) for i in range(8)] \
        + [_snap(2.2, 1, 1.03, 5), _snap(2.5, 0, 1.03, 5)]
    v = metrics.server_view(s, t_start=0.05, t_first=2.1, t_end=2.4)
    assert v["server_ttft"] == pytest.approx(0.03) and v["histograms"]
    assert v["server_e2e"] is None  # not exposed here
    assert v["engine_idle_s"] == pytest.approx(1.75)  # 0.1 .. 1.85, samples only
    assert metrics.engine_idle_s([_snap(0.0, 1)], 0, 1) == 0.0
    assert metrics.engine_idle_s([metrics.Snapshot(0.0, {})], 0, 1) is None
    two = metrics.server_view([_snap(0.0, 0, 1.0, 4), _snap(3.0, 0, 1.1, 6)], 0.1, 1.0, 2.0)
    assert two["server_ttft"] is None and "need exactly 1" in two["note"]
    assert two["engine_idle_s"] is None  # prefill time ambiguous: no idle verdict


def test_histogram_names_as_prometheus_client_writes_them():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    reg = CollectorRegistry()
    for name in metrics.HISTOGRAMS.values():
        Histogram(name, "h", ["model_name", "engine"], registry=reg).labels("m", "0").observe(0.25)
    snap = metrics.parse(generate_latest(reg).decode())
    for name in metrics.HISTOGRAMS.values():
        assert metrics.histogram_delta(metrics.parse(""), snap, name) == (0.25, 1.0)
