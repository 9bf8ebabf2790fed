"""The client counts tokens from usage, never from streamed chunks; the /metrics parser."""
from pathlib import Path

import pytest

from fake_openai_server import FakeServer
from onecard.bench import metrics
from onecard.bench.client import Client


@pytest.fixture
def server():
    with FakeServer(tokens_per_chunk=4) as s:
        yield s


def test_tokens_come_from_usage_not_chunks(server):
    r = Client(server.url, "fake").stream("a b c", 21)
    assert r.ok, r.error
    assert r.completion_tokens == 21
    assert r.chunks == 6  # 1 first token + 5 verify steps of up to 4 tokens
    assert r.chunks != r.completion_tokens
    assert r.token_count_source == "usage.completion_tokens"
    assert r.decode_tps == pytest.approx(20 / (r.t_last - r.t_first))
    assert r.e2e_tps == pytest.approx(21 / r.e2e)
    assert 0 < r.ttft < r.e2e
    body = server.state.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_chat_endpoint(server):
    r = Client(server.url + "/v1", "fake", endpoint="chat").stream("hello", 9)
    assert r.ok and r.completion_tokens == 9 and r.chunks == 3
    assert "messages" in server.state.bodies[-1]


def test_missing_usage_is_an_error_not_a_chunk_count():
    with FakeServer(tokens_per_chunk=3, send_usage=False) as s:
        r = Client(s.url, "fake").stream("x", 10)
    assert not r.ok
    assert r.completion_tokens is None and r.decode_tps is None
    assert "usage" in r.error


def test_server_dying_mid_stream_is_reported():
    with FakeServer(tokens_per_chunk=2, die_after_chunks=2) as s:
        r = Client(s.url, "fake").stream("x", 50)
    assert not r.ok and "[DONE]" in r.error


def test_bad_endpoint_names_valid_ones():
    with pytest.raises(ValueError, match="completions, chat"):
        Client("http://127.0.0.1:1", "m", endpoint="responses")


def test_unreachable_server_is_an_error():
    r = Client("http://127.0.0.1:9", "m", timeout=2).stream("x", 4)
    assert not r.ok and r.error


def test_metrics_parse_vllm_names(server):
    Client(server.url, "fake").stream("a b", 13)
    snap = metrics.scrape(server.url)
    assert snap.values["vllm:generation_tokens_total"] == 13
    assert snap.values["vllm:request_success_total"] == 1  # summed over finished_reason
    assert snap.per_pos == {0: 4.0, 1: 4.0, 2: 4.0}
    assert snap.engines == {"0"}


def test_gauge_time_weighted_mean_and_peak():
    s = [metrics.Snapshot(0.0, {"g": 1.0}), metrics.Snapshot(1.0, {"g": 0.0})]
    st = metrics.gauge_stats(s, "g", t_end=3.0)
    assert st["peak"] == 1.0 and st["mean"] == pytest.approx(1 / 3) and st["duration_s"] == 3.0


def test_spec_summary_per_position():
    d = {"spec_drafts": 10.0, "spec_draft_tokens": 30.0, "spec_accepted": 15.0,
         "spec_accepted_per_pos": [8.0, 5.0, 2.0]}
    sp = metrics.spec_summary(d)
    assert sp["acceptance_per_position"] == [0.8, 0.5, 0.2]
    assert sp["tokens_per_step"] == pytest.approx(2.5)
    assert sp["draft_acceptance_rate"] == pytest.approx(0.5)
    assert metrics.spec_summary({"spec_drafts": 0}) is None


def test_sampler_window_deltas(server):
    samp = metrics.Sampler(server.url, interval=0.05).start()
    Client(server.url, "fake").stream("a", 9)
    m = samp.stop()
    assert m["available"] and m["counters"]["generation_tokens"] == 9
    assert m["counters"]["requests_finished"] == 1
    assert m["gauges"]["kv_usage"]["samples"] >= 2


def test_parse_text_written_by_prometheus_client():
    """Names as vLLM 0.27.1 registers them; exposition as prometheus_client writes it."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    reg = CollectorRegistry()
    lab = ["model_name", "engine"]
    Gauge("vllm:kv_cache_usage_perc", "kv", lab, registry=reg).labels("m", "0").set(0.25)
    Counter("vllm:generation_tokens", "gen", lab, registry=reg).labels("m", "0").inc(40)
    Counter("vllm:num_preemptions", "pre", lab, registry=reg).labels("m", "0").inc(2)
    Counter("vllm:spec_decode_num_drafts", "d", lab, registry=reg).labels("m", "0").inc(10)
    pp = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "p", lab + ["position"], registry=reg)
    pp.labels("m", "0", "0").inc(7)
    pp.labels("m", "0", "1").inc(3)
    Histogram("vllm:time_to_first_token_seconds", "t", lab, registry=reg).labels("m", "0").observe(0.1)
    snap = metrics.parse(generate_latest(reg).decode())
    assert snap.values["vllm:kv_cache_usage_perc"] == 0.25
    assert snap.values["vllm:generation_tokens_total"] == 40
    assert snap.values["vllm:num_preemptions_total"] == 2
    assert snap.per_pos == {0: 7.0, 1: 3.0}
    empty = metrics.parse("")
    d = metrics.counter_deltas(empty, snap)
    assert d["preemptions"] == 2 and d["spec_accepted_per_pos"] == [7.0, 3.0]


def test_chunk_times_only_when_asked(server):
    c = Client(server.url, "fake")
    r = c.stream("a b c", 12, keep_times=True)
    assert r.ok and len(r.chunk_times) == r.chunks and r.chunk_times == sorted(r.chunk_times)
    assert r.chunk_times[0] == r.t_first and r.chunk_times[-1] == r.t_last
    plain = c.stream("a b c", 12)
    assert plain.chunk_times == [] and "chunk_times" not in plain.summary()


def test_job31_gap_stats_see_a_stall():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "job31", Path(__file__).resolve().parents[1] / "gpu" / "jobs" / "31-verify-e2e.py")
    job31 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job31)
    times = [0.0]
    for i in range(47):
        times.append(times[-1] + (0.150 if i == 20 else 0.010))
    g = job31.gap_stats(times)
    assert abs(g["client_gap_ms_p50"] - 10) < 1e-6 and abs(g["client_gap_ms_max"] - 150) < 1e-6
    assert g["client_stalls"] == 1
    assert job31.gap_stats([1.0])["client_gap_ms_p50"] is None


def test_job31_median_repeat():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "job31", Path(__file__).resolve().parents[1] / "gpu" / "jobs" / "31-verify-e2e.py")
    job31 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job31)
    reps = [{"server_ms_per_step": v, "client_ms_per_step": v, "text": "t", "problems": []}
            for v in (17.0, 14.0, 15.0)]
    row = job31.median_repeat(reps)
    assert row["server_ms_per_step"] == 15.0 and row["server_ms_per_step_repeats"] == [17.0, 14.0, 15.0]
    assert row["repeat_texts_equal"] and row["problems"] == []
    reps[1]["text"] = "u"
    row = job31.median_repeat(reps)
    assert not row["repeat_texts_equal"] and "differ" in row["problems"][-1]
