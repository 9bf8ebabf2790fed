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
    assert seen["smol"][1].enforce_eager


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
