"""Keep-alive timers between our HTTP clients and vLLM's server (job 71's first run, 2026-12-07:
one request in ~1,500 failed with "Server disconnected without sending a response" against a
healthy server, the race of two equal 5 s idle timers). The launcher gives the server 30 s unless
the user set one; our pooled clients drop an idle connection after 2 s."""
import http.server
import inspect
import threading
import time

import httpx
import pytest

from onecard import plan as P
from onecard.bench import client as C


def mk(env, root):
    return P.make_plan(env, root, python="python3")


def test_launcher_gives_the_server_a_longer_keep_alive_unless_set(tmp_path):
    assert mk({}, tmp_path).child_env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == "30"
    assert mk({"CTX": "long", "SPEC": "mtp"}, tmp_path).child_env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == "30"
    assert "VLLM_HTTP_TIMEOUT_KEEP_ALIVE" not in mk({"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "7"}, tmp_path).child_env
    # longer than what common clients keep idle (httpx 5 s, aiohttp 15 s), and than ours
    assert P.SERVER_KEEP_ALIVE_S > 15 > C.KEEPALIVE_EXPIRY_S


def test_pinned_vllm_reads_the_variable_into_uvicorn(monkeypatch):
    """The variable is what vLLM 0.27.1 hands uvicorn as timeout_keep_alive (envs.py,
    entrypoints/openai/api_server.py); a vLLM that stopped reading it would make the launcher's
    value a no-op."""
    envs = pytest.importorskip("vllm.envs")
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "30")
    assert envs.__getattr__("VLLM_HTTP_TIMEOUT_KEEP_ALIVE") == 30
    import importlib.util
    spec = importlib.util.find_spec("vllm.entrypoints.openai.api_server")
    src = open(spec.origin).read()
    assert "timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE" in src


def test_http_limits_expire_idle_connections_before_the_server():
    limits = C.http_limits(max_connections=8, max_keepalive_connections=4)
    assert (limits.max_connections, limits.max_keepalive_connections) == (8, 4)
    assert limits.keepalive_expiry == C.KEEPALIVE_EXPIRY_S < 5   # vLLM's own default is 5 s


def test_every_pooled_client_takes_the_short_expiry():
    """The pools that talk to a vLLM server: the benchmark client, the metrics scraper and the GPU
    suites' servers (read as text: the GPU modules need a GPU host's packages)."""
    from pathlib import Path

    from onecard.bench import metrics
    repo = Path(__file__).resolve().parents[1]
    assert "http_limits(" in inspect.getsource(C.Client._http)
    assert "http_limits(" in inspect.getsource(metrics)
    for rel in ("tests/gpu/test_dflash2.py", "tests/gpu/conftest.py"):
        text = (repo / rel).read_text()
        assert "http_limits(" in text and "httpx.Limits(" not in text, rel


class _Echo(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive
    ports: list = []

    def do_GET(self):  # noqa: N802 - http.server's name
        self.ports.append(self.client_address[1])
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_pool_opens_a_new_connection_after_the_expiry():
    """Against a real keep-alive server: two requests back to back share a connection; after the
    expiry the pool does not reuse the idle one (the server, keeping it longer, never closes a
    connection under a request)."""
    _Echo.ports = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/"
    try:
        with httpx.Client(limits=C.http_limits(max_connections=4, max_keepalive_connections=4)) as c:
            assert c.get(url).text == "ok"
            assert c.get(url).text == "ok"
            time.sleep(C.KEEPALIVE_EXPIRY_S + 0.3)
            assert c.get(url).text == "ok"
    finally:
        srv.shutdown()
        srv.server_close()
    a, b, later = _Echo.ports
    assert a == b and later != b, _Echo.ports
