"""The GPU suite's `vllm serve` argv parse with vLLM 0.27.1's own CLI parser (CPU check)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _gpu_conftest():
    spec = importlib.util.spec_from_file_location("_gpu_conftest", REPO / "tests/gpu/conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_config_parses(monkeypatch, tmp_path):
    pytest.importorskip("vllm")
    import vllm.config.device as device

    # No GPU here: DeviceConfig cannot infer a device while the parser builds its defaults.
    monkeypatch.setattr(device.DeviceConfig, "__post_init__", lambda self: None)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setenv("JOB_OUT", str(tmp_path))
    gc = _gpu_conftest()
    seen = {}
    for name, (_, served, args) in gc.CONFIGS.items():
        server = gc.Server(name, tmp_path / "model", served, args)
        assert server.argv[server.argv.index("--host") + 1] == "127.0.0.1"
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(
            server.argv[server.argv.index("serve") + 1:])
        seen[name] = (ns, AsyncEngineArgs.from_cli_args(ns))
    assert seen["off"][1].language_model_only and seen["off"][0].tool_call_parser == "qwen3_coder"
    assert seen["mtp"][1].speculative_config == {"method": "mtp", "num_speculative_tokens": 2}
    assert seen["int8"][1].kv_cache_dtype == "int8_per_token_head"
    assert str(seen["int8"][1].attention_backend).endswith("TRITON_ATTN")
    assert seen["off"][1].compilation_config.cudagraph_capture_sizes == [1, 2, 4, 8]
    assert seen["smol"][1].enforce_eager and seen["int8"][1].enforce_eager
    assert not seen["off"][1].enforce_eager and not seen["mtp"][1].enforce_eager


HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == '/health' else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
"""


def test_server_boot_and_stop_plumbing(monkeypatch, tmp_path):
    """Boot detection, pid record, process-group stop, and fast failure of a dead server."""
    import os
    import sys

    pytest.importorskip("httpx")
    monkeypatch.setenv("JOB_OUT", str(tmp_path))
    gc = _gpu_conftest()
    s = gc.Server("fake", tmp_path, "fake", [])
    s.argv = [sys.executable, "-c", HEALTH_SERVER, str(s.port)]
    s.start()
    try:
        assert s.boot_s is not None and s.boot_s < 30
        pid = s.proc.pid
        assert (tmp_path / "server.pids").read_text().split() == [str(pid)]
    finally:
        s.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)

    dead = gc.Server("dead", tmp_path, "dead", [])
    dead.argv = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited rc=3 during boot"):
        dead.start()
    assert "boom" in dead.tail()


FAKE_VLLM = r'''
import hashlib, json, sys, http.server

def ids_for(prompt, n):
    h = hashlib.sha256(prompt.encode()).digest()
    return [(h[i % 32] * 7 + i * 13) % 4000 + 1 for i in range(n)]

class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, code, body, ctype="application/json"):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code); self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health": return self._send(200, {})
        if self.path == "/metrics":
            return self._send(200, 'vllm:spec_decode_num_draft_tokens_total{engine="0"} 12.0\n', "text/plain")
        self._send(404, {})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = req.get("max_tokens", 16)
        usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
        if self.path == "/v1/completions":
            ids = ids_for(req["prompt"], n)
            choice = {"index": 0, "text": "x", "token_ids": ids, "finish_reason": "length"}
            if req.get("logprobs"):
                choice["logprobs"] = {"top_logprobs": [{f"token_id:{i}": -0.1, "token_id:0": -2.0} for i in ids]}
            return self._send(200, {"choices": [choice], "usage": usage})
        if self.path == "/v1/chat/completions":
            if req.get("stream"):
                self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
                for k in range(4):
                    c = {"choices": [{"index": 0, "delta": {"content": f"t{k} "}, "finish_reason": "length" if k == 3 else None}]}
                    self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
                self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n"); return
            msg = {"role": "assistant", "content": "Paris is the capital." if "France" in json.dumps(req) else "hi"}
            if req.get("tool_choice") == "required":
                msg = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": req["tools"][0]["function"]["name"], "arguments": '{"city": "Paris"}'}}]}
            return self._send(200, {"choices": [{"index": 0, "message": msg, "finish_reason": "stop"}], "usage": usage})
        self._send(404, {})

http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


def test_suite_logic_against_fake_server(monkeypatch, tmp_path):
    """Run every GPU-suite test function against a fake vLLM-shaped server (response keys)."""
    import json
    import sys

    pytest.importorskip("httpx")
    monkeypatch.setenv("JOB_OUT", str(tmp_path))
    gc = _gpu_conftest()
    spec = importlib.util.spec_from_file_location("_suite", REPO / "tests/gpu/test_serve_suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)

    class FakePool(gc.Pool):
        def model(self, key):
            return tmp_path

        def use(self, name):
            if self.current is not None and self.current.name == name:
                return self.current
            self.close()
            server = gc.Server(name, tmp_path, gc.CONFIGS[name][1], [])
            server.argv = [sys.executable, str(script), str(server.port)]
            server.start()
            self.current = server
            return server

    pool = FakePool()
    try:
        names = [n for n in dir(suite) if n.startswith("test_")]
        order = sorted(names, key=lambda n: suite.__dict__[n].__code__.co_firstlineno)
        for name in order:
            getattr(suite, name)(pool)
    finally:
        pool.close()
        pool.save()
    record = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert record["smol_answer"].startswith("Paris")
    assert all(r["first_divergence"] is None for r in record["mtp_vs_off"].values())
    assert record["tool_call"][0]["function"]["name"] == "get_weather"
