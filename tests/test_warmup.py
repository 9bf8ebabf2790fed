"""The launcher's boot warm-up (onecard/warmup.py, knob WARMUP): requests after /health, against
the fake OpenAI server; the launcher forks it only with WARMUP=1 and with the server's URL."""
from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

from onecard import launch, warmup
from tests.fake_openai_server import FakeServer


def test_warm_sends_greedy_and_sampled_rounds_after_health():
    with FakeServer() as srv:
        lines = []
        out = warmup.warm(srv.url, "fake", api_key="k", timeout_s=10, log=lines.append)
        bodies = srv.state.bodies
    n = sum(len(r) for r in warmup._requests("fake"))
    assert out["healthy"] and out["requests"] == len(bodies) == n == 7 and out["failed"] == 0
    assert {b["temperature"] for b in bodies} == {0.0, 1.0} and all(b["model"] == "fake" for b in bodies)
    assert len({len(b["prompt"]) for b in bodies}) == 2  # a short and a long prompt
    assert lines and lines[0].startswith("onecard warm-up: 7 requests in") and "WARMUP=0" in lines[0]


def test_warm_with_the_chunk_sends_a_prompt_of_one_and_a_half_chunks_twice():
    """With the server's prefill chunk, two more rounds: token ids of 1.5 chunks (sized with the
    server's /tokenize, capped 64 under its max_model_len), alone, then again beside a sampled
    short request; none when max_model_len leaves no second chunk."""
    with FakeServer(max_model_len=8192) as srv:
        out = warmup.warm(srv.url, "fake", timeout_s=10, log=lambda s: None, chunk=2048)
        bodies = srv.state.bodies
    assert out["requests"] == 10 and out["failed"] == 0
    assert sum(1 for b in bodies if b.get("add_special_tokens") is False) == 1   # the one /tokenize call
    longs = [b for b in bodies if isinstance(b.get("prompt"), list)]
    assert len(longs) == 2 and all(len(b["prompt"]) == 3072 for b in longs) and longs[0] == longs[1]
    assert longs[0]["temperature"] == 0.0 and set(longs[0]["prompt"]) <= set(range(100, 100 + len(warmup._LONG.split())))
    with FakeServer(max_model_len=3000) as srv:
        warmup.warm(srv.url, "fake", timeout_s=10, log=lambda s: None, chunk=2048)
        longs = [b for b in srv.state.bodies if isinstance(b.get("prompt"), list)]
    assert [len(b["prompt"]) for b in longs] == [3000 - 64] * 2
    for max_len in (2048, 2112):   # no room past one chunk: the rounds are left out
        with FakeServer(max_model_len=max_len) as srv:
            out = warmup.warm(srv.url, "fake", timeout_s=10, log=lambda s: None, chunk=2048)
        assert out["requests"] == 7


def test_warm_waits_for_health_then_gives_up_quietly():
    lines = []
    t = time.monotonic()
    out = warmup.warm("http://127.0.0.1:9", "m", timeout_s=0.5, log=lines.append)
    assert not out["healthy"] and out["requests"] == 0 and time.monotonic() - t < 5
    assert lines == []  # nothing to say: the server never came up


def test_warm_stops_when_the_server_process_is_gone():
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    t = time.monotonic()
    out = warmup.warm("http://127.0.0.1:9", "m", timeout_s=60, parent_pid=p.pid, log=lambda s: None)
    assert not out["healthy"] and time.monotonic() - t < 5


def test_warm_reports_failed_requests():
    with FakeServer() as srv:
        srv.state.stall = {}
        orig = srv.httpd.RequestHandlerClass.do_POST

        def refuse(self):
            self._json({"error": "no"}, 400)
        srv.httpd.RequestHandlerClass.do_POST = refuse
        lines = []
        out = warmup.warm(srv.url, "fake", timeout_s=10, log=lines.append)
        srv.httpd.RequestHandlerClass.do_POST = orig
    assert out["failed"] == out["requests"] == 7 and "7 failed" in lines[0]


def _launch(monkeypatch, tmp_path, env):
    calls = {}
    monkeypatch.setattr(os, "execvpe", lambda f, a, e: calls.update(a=a, e=e))
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text("{}")
    for k, v in {"MODEL": str(tmp_path / "m"), **env}.items():
        monkeypatch.setenv(k, v)
    assert launch.run(SimpleNamespace(dry_run=False, json=False, root=str(tmp_path))) == 1
    return calls


def test_launcher_forks_the_warmup_with_the_servers_url(monkeypatch, tmp_path, _no_real_warmup):
    _launch(monkeypatch, tmp_path, {"PORT": "18555", "SERVED_NAME": "qx"})
    assert _no_real_warmup == [(("http://127.0.0.1:18555", "qx", None), {"chunk": 2048})]
    _no_real_warmup.clear()
    _launch(monkeypatch, tmp_path, {"HOST": "0.0.0.0", "VLLM_API_KEY": "s3", "PORT": "18556"})
    assert _no_real_warmup[0][0][0] == "http://127.0.0.1:18556" and _no_real_warmup[0][0][2] == "s3"
    _no_real_warmup.clear()
    _launch(monkeypatch, tmp_path, {"WARMUP": "0"})
    assert _no_real_warmup == []


def test_warmup_knob_validated(monkeypatch, tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "onecard.launch", "--dry-run"], capture_output=True, text=True,
                       env={**os.environ, "WARMUP": "maybe"}, cwd=str(tmp_path), timeout=60)
    assert r.returncode == 2 and "WARMUP" in r.stderr and "valid" in r.stderr, r.stderr
