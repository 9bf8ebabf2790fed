"""The GPU suite's `vllm serve` argv parse with vLLM 0.27.1's own CLI parser (CPU check)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _gpu_conftest():
    import sys

    spec = importlib.util.spec_from_file_location("_gpu_conftest", REPO / "tests/gpu/conftest.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_gpu_conftest"] = mod     # dataclasses resolve annotations through it
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from onecard.prepare.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models"))


def test_every_config_parses(monkeypatch, tmp_path, tiny_dir):
    """Each server's argv: tiny configs through the launcher plan (the call `python3 -m
    onecard.launch` makes), parsed by vLLM 0.27.1's own serve parser."""
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
    for name, cfg in gc.CONFIGS.items():
        if cfg.model == "smol":
            argv = gc.smol_argv(tmp_path / "smol", 12345)
        else:
            argv = gc.tiny_plan(cfg, tiny_dir, 12345, tmp_path).argv
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[argv.index("serve") + 1:])
        seen[name] = (ns, AsyncEngineArgs.from_cli_args(ns))
    tiny = [n for n, c in gc.CONFIGS.items() if c.model == "tiny"]
    assert len(tiny) == 8
    for n in tiny:
        ns, ea = seen[n]
        cfg = gc.CONFIGS[n]
        assert ea.language_model_only and ns.tool_call_parser == "qwen3_coder", n
        assert ea.enable_prefix_caching and ea.mamba_cache_mode == "align", n
        assert not ea.enforce_eager, f"{n}: CUDA graphs as the profiles launch them"
        assert ea.logprobs_mode == "raw_logits" and ea.seed == 0, n
        # the suite asks SPEC=off for TOP_K top logprobs: vLLM must allow that many
        assert ea.max_logprobs == -1 or ea.max_logprobs >= 8, (n, ea.max_logprobs)
        assert ea.additional_config == {"gdn_prefill_backend": "triton"}, n
        assert ea.kv_cache_memory_bytes == 3 * 2**30 and ea.max_model_len == 2048, n
        assert ea.dtype == ("float32" if cfg.dtype == "float32" else "auto"), n
        if cfg.ctx == "long":
            assert ea.kv_cache_dtype == "int8_per_token_head", n
            assert str(ea.attention_backend).endswith("TRITON_ATTN"), n
        else:
            assert ea.kv_cache_dtype == "auto", n
        if cfg.spec == "mtp":   # the profile's k: 4 on CTX=fast, 3 on CTX=long
            assert ea.speculative_config == {"method": "mtp",
                                             "num_speculative_tokens": 4 if cfg.ctx == "fast" else 3}, n
        else:
            assert ea.speculative_config is None, n
    assert seen["smol"][1].enforce_eager and seen["smol"][1].kv_cache_memory_bytes == 2**30


def test_tiny_servers_run_the_launcher(monkeypatch, tmp_path, tiny_dir):
    """A tiny server's process is `python -m onecard.launch`; its env carries the knobs (and no
    stray knob of the caller); float32 servers get the shim first on PYTHONPATH."""
    monkeypatch.setenv("JOB_OUT", str(tmp_path))
    monkeypatch.setenv("CTX", "huge")           # a caller's knob must not leak into a server
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    gc = _gpu_conftest()
    pool = gc.Pool()
    pool._models["tiny"] = tiny_dir
    s = pool.make_server("fp32-int8-mtp")
    assert s.argv[1:3] == ["-m", "onecard.launch"]
    assert s.env["CTX"] == "long" and s.env["SPEC"] == "mtp" and s.env["MODEL"] == str(tiny_dir)
    assert s.env["PYTHONPATH"].split(":")[0] == str(gc.SHIM_DIR)
    assert s.env["PYTHONPATH"].endswith("/somewhere") and s.env["TRITON_F32_DEFAULT"] == "ieee"
    assert "--dtype float32" in s.env["EXTRA_ARGS"]
    b = pool.make_server("off")
    assert b.env["CTX"] == "fast" and "TRITON_F32_DEFAULT" not in b.env
    assert str(gc.SHIM_DIR) not in b.env["PYTHONPATH"]
    assert b.vllm_argv[b.vllm_argv.index("--port") + 1] == str(b.port)
    with pytest.raises(ValueError, match="valid: off, mtp"):
        pool.make_server("bogus")
    # the same plan as the launcher process would make from that env, dry-run
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "onecard.launch", "--root", str(tmp_path),
                          "--json"], env=b.env, cwd=str(REPO), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    assert json.loads(out.stdout)["argv"][1:] == b.vllm_argv[1:]


def test_shim_lifts_only_the_float32_refusal(tmp_path):
    """tests/gpu/fp32_shim wraps FLA's chunk_gated_delta_rule in a fresh interpreter: the
    float32 refusal is gone, other dtypes go to the original, and a float32 kernel failure falls
    back (loudly) to the bf16 kernels."""
    pytest.importorskip("vllm")
    pytest.importorskip("torch")
    import os
    import subprocess
    import sys

    gc = _gpu_conftest()
    code = r"""
import sys, torch
import vllm.third_party.flash_linear_attention.ops as ops
import vllm.third_party.flash_linear_attention.ops.chunk as chunk
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
assert ops.chunk_gated_delta_rule is chunk.chunk_gated_delta_rule is gdn.fla_chunk_gated_delta_rule
seen = []
class Fn:
    @staticmethod
    def apply(*a):
        seen.append(("fp32", a[0].dtype, a[5]))
        if len(seen) > 1:
            raise RuntimeError("out of resource: shared memory")
        return a[0] * 2, None
chunk.ChunkGatedDeltaRuleFunction = Fn
def orig(q, *a, **k):
    seen.append(("orig", q.dtype))
    return q, None
import sitecustomize as sc
w = sc._make_wrapper(chunk, orig)
x = torch.ones(1, 4, 2, 8)
g = torch.zeros(1, 4, 2); b = torch.ones(1, 4, 2)
o, _ = w(x, x, x, g, b)                         # float32: the same Function, no refusal
assert o.dtype == torch.float32 and float(o[0, 0, 0, 0]) == 2.0
w(x.bfloat16(), x.bfloat16(), x.bfloat16(), g, b)    # bf16: the original
o, _ = w(x, x, x, g, b)                         # the fp32 kernel fails -> bf16 kernels, fp32 out
assert o.dtype == torch.float32
o, _ = w(x, x, x, g, b)                         # and stays there
print(seen)
assert seen[0] == ("fp32", torch.float32, 8 ** -0.5)
assert [s[:2] for s in seen[1:]] == [("orig", torch.bfloat16), ("fp32", torch.float32),
                                    ("orig", torch.bfloat16), ("orig", torch.bfloat16)]
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(gc.SHIM_DIR), str(REPO),
                                                       os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "onecard-fp32-shim: FLA chunk_gated_delta_rule float32 refusal lifted" in r.stderr
    assert "GDN chunk prefill ran in float32" in r.stderr
    assert "FELL BACK to bf16 kernels" in r.stderr


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
    port = gc.free_port()
    s = gc.Server("fake", [sys.executable, "-c", HEALTH_SERVER, str(port)], "fake", port)
    s.start()
    try:
        assert s.boot_s is not None and s.boot_s < 30
        pid = s.proc.pid
        assert (tmp_path / "server.pids").read_text().split() == [str(pid)]
        s.wait()                                  # a second wait returns at once
    finally:
        s.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)

    dead = gc.Server("dead", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], "dead")
    with pytest.raises(RuntimeError, match="exited rc=3 during boot"):
        dead.start()
    assert "boom" in dead.tail()
    with pytest.raises(RuntimeError, match="exited rc=3"):   # remembered: no second boot
        dead.wait()

    slow = gc.Server("slow", [sys.executable, "-c", "import time; time.sleep(60)"], "slow")
    slow.launch()
    with pytest.raises(RuntimeError, match="not healthy 1 s after launch"):
        slow.wait(timeout=1)
    assert slow.proc is None


# A vLLM-shaped fake: greedy ids from a hash of the prompt; prompt_tokens counted with the tiny
# tokenizer (argv[2]); raw-logit top-`logprobs` per position (a three-way bf16 near-tie:
# 12.0 / 11.9375 / 11.875, then lower values); mode "tie" (argv[3]) takes the third (2 ulps
# below the top) at position 3 for every third prompt, as a bf16 rounding flip would; mode
# "far" takes a token outside the top-k there; prefix-cache hit counter grows when a prompt
# comes again (not with argv[4] "nohits").
FAKE_VLLM = r'''
import hashlib, json, sys, threading, http.server
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[2])
mode = sys.argv[3]
nohits = sys.argv[4:] == ["nohits"]
lock = threading.Lock()
seen, hits = set(), [0.0]

def ids_for(prompt, n):
    h = hashlib.sha256(prompt.encode()).digest()
    return [(h[i % 32] * 7 + i * 13) % 4000 + 1 for i in range(n)]

def alt(t):
    return t % 4000 + 2

def alt3(t):
    return (t + 5) % 4000 + 1

def top(t, k):
    vals = [(t, 12.0), (alt(t), 11.9375), (alt3(t), 11.875)]
    vals += [(5000 + (t * 31 + j * 97) % 3000, 10.0 - j) for j in range(max(0, k - 3))]
    return {f"token_id:{i}": v for i, v in vals[:k]}

class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, code, body, ctype="application/json"):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code); self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health": return self._send(200, {})
        if self.path == "/metrics":
            return self._send(200, 'vllm:spec_decode_num_draft_tokens_total{engine="0"} 12.0\n'
                              f'vllm:prefix_cache_hits_total{{engine="0"}} {hits[0]}\n', "text/plain")
        self._send(404, {})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = req.get("max_tokens", 16)
        prompt = req.get("prompt", "")
        pt = len(tok.encode(prompt, add_special_tokens=False).ids) if isinstance(prompt, str) else 5
        with lock:
            if prompt in seen and not nohits:
                hits[0] += pt // 208 * 208
            seen.add(prompt)
        usage = {"prompt_tokens": pt, "completion_tokens": n, "total_tokens": pt + n}
        if self.path == "/v1/completions":
            ids = ids_for(prompt, n)
            if mode in ("tie", "far") and n > 3 and hashlib.sha256(prompt.encode()).digest()[0] % 3 == 0:
                ids = ids[:3] + [alt3(ids[3]) if mode == "tie" else 9000] + ids_for(prompt + "x", n - 4)
            choice = {"index": 0, "text": "x", "token_ids": ids, "finish_reason": "length"}
            if req.get("logprobs"):
                choice["logprobs"] = {"top_logprobs": [top(i, req["logprobs"]) for i in ids]}
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

class S(http.server.ThreadingHTTPServer):
    request_queue_size = 1024      # the sweep opens 128 connections at once (uvicorn: 2048)
S(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


def _load_suite(monkeypatch, tmp_path, module_name):
    """tests/gpu/conftest.py and tests/gpu/test_serve_suite.py (as module_name) for a CPU run against
    FAKE_VLLM: JOB_OUT in tmp_path, 16 residues. Returns (conftest, suite, fake server script)."""
    pytest.importorskip("httpx")
    monkeypatch.setenv("JOB_OUT", str(tmp_path))
    monkeypatch.syspath_prepend(str(REPO / "tests/gpu"))
    gc = _gpu_conftest()
    spec = importlib.util.spec_from_file_location(module_name, REPO / "tests/gpu/test_serve_suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    monkeypatch.setattr(suite, "MODULUS", 16)   # 16 residues: the CPU box is small (128: GPU)
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    return gc, suite, script


@pytest.mark.filterwarnings("ignore::pytest.PytestUnknownMarkWarning")
def test_suite_logic_against_fake_server(monkeypatch, tmp_path, tiny_dir):
    """Run every GPU-suite test function against fake vLLM-shaped servers (response keys, the
    residue sweep and its report, the bf16 near-tie acceptance, the fp32 strict path)."""
    import json
    import sys

    gc, suite, script = _load_suite(monkeypatch, tmp_path, "_suite")

    class FakePool(gc.Pool):
        def model(self, key):
            return tiny_dir

        def make_server(self, name):
            cfg = gc.CONFIGS[name]
            mode = "tie" if cfg.spec == "mtp" and cfg.dtype == "bfloat16" else "same"
            port = gc.free_port()
            return gc.Server(name, [sys.executable, str(script), str(port),
                                    str(tiny_dir / "tokenizer.json"), mode]
                             + (["nohits"] if name == "mtp" else []),   # the H200 finding
                             "smol" if name == "smol" else "tiny", port)

    pool = FakePool()
    gc._POOL = pool
    try:
        names = [n for n in dir(suite) if n.startswith("test_")]
        order = sorted(names, key=lambda n: suite.__dict__[n].__code__.co_firstlineno)
        uses = []
        for name in order:
            for mark in getattr(suite.__dict__[name], "pytestmark", []):
                if mark.name == "uses":
                    uses += [n for n in mark.args if n not in uses]
        assert set(uses) == set(gc.CONFIGS), "every configuration is used by some test"
        # (pytest runs a module's tests in this order) float32 strict right after bf16
        i = order.index("test_residue_sweep_bf16_kv")
        assert order[i + 1:i + 4] == ["test_residue_sweep_fp32_strict",
                                      "test_residue_sweep_fp32_int8_strict",
                                      "test_residue_sweep_int8_kv"], order
        pool.launch_all(uses)
        for name in order:
            getattr(suite, name)(pool)
    finally:
        pool.close()
        pool.save()
        gc._POOL = None
    record = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert record["smol_answer"].startswith("Paris")
    assert record["tool_call"][0]["function"]["name"] == "get_weather"
    assert set(record["boots"]) == set(gc.CONFIGS)
    assert all("boot_s" in b for b in record["boots"].values())
    # bf16: SPEC=mtp took off's third (a three-way tie, 2 ulps below the top) in some prompts:
    # reported, accepted (only if the suite asked off for more than two logprobs)
    ties = record["mtp_vs_off"]
    assert any(v["position"] == 3 and v["accepted"] and v["gap_ulps"] == 2.0 and v["got_rank"] == 3
               and v["top_k"] == 8 for v in ties.values())
    for label in ("bf16-kv", "int8-kv"):
        sw = record[f"sweep_{label}"]
        cold = sw["mtp vs off (cold prefix)"]
        assert cold["diverged_residues"] and not cold["failing_residues"]
        assert sw["off cached vs off cold"]["diverged_residues"] == []
        assert sw["noise_floor"]["off_cold_vs_off_cached_differ"] == 0
        assert sw["noise_floor"]["mtp_vs_off_cold_differ"] == len(cold["diverged_residues"])
        assert sw["prefix_cache_hit_tokens"]["off"][1] > 0
    # the speculating bf16 server had no prefix-cache hits: a finding, the sweep still passed
    assert record["sweep_bf16-kv"]["prefix_cache_hit_tokens"]["mtp"][1] == 0
    assert any("zero prefix-cache hits" in f for f in record["sweep_bf16-kv"]["findings"])
    assert record["sweep_int8-kv"]["findings"] == []
    for label, bf in (("fp32-strict", "bf16-kv"), ("fp32-int8-strict", "int8-kv")):
        assert record[f"sweep_{label}"]["mtp vs off (cold prefix)"]["diverged_residues"] == []
        assert record[f"sweep_{label}"][f"vs_{bf}"]["same_first_token"] == 16
    assert record["fp32_prefill"] == {"fp32": "shim NOT applied", "fp32-mtp": "shim NOT applied"}


def _sweep_fails_against_fake_mtp(monkeypatch, tmp_path, tiny_dir, module_name, mtp_mode, sweep, match):
    """Run suite.<sweep> on fake servers whose SPEC=mtp side answers in mtp_mode (the SPEC=off
    side answers 'same'); it must fail with an AssertionError matching match. Returns the pool."""
    import sys

    gc, suite, script = _load_suite(monkeypatch, tmp_path, module_name)

    class FakePool(gc.Pool):
        def model(self, key):
            return tiny_dir

        def make_server(self, name):
            port = gc.free_port()
            return gc.Server(name, [sys.executable, str(script), str(port),
                                    str(tiny_dir / "tokenizer.json"),
                                    mtp_mode if name.endswith("mtp") else "same"], "tiny", port)

    pool = FakePool()
    try:
        with pytest.raises(AssertionError, match=match):
            getattr(suite, sweep)(pool)
    finally:
        pool.close()
    return pool


@pytest.mark.filterwarnings("ignore::pytest.PytestUnknownMarkWarning")
def test_bf16_sweep_fails_outside_off_top_k(monkeypatch, tmp_path, tiny_dir):
    """A fake bf16 SPEC=mtp server that picks a token outside off's top-k: a real failure,
    reported with its rank as '> 8'."""
    pool = _sweep_fails_against_fake_mtp(monkeypatch, tmp_path, tiny_dir, "_suite3", "far",
                                         "test_residue_sweep_bf16_kv", "the bfloat16 rule does not accept")
    div = pool.record["sweep_bf16-kv"]["mtp vs off (cold prefix)"]["divergences"]
    assert div and all(v["got_rank"] == "> 8" and not v["accepted"] for v in div.values())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnknownMarkWarning")
def test_fp32_sweep_fails_on_any_divergence(monkeypatch, tmp_path, tiny_dir):
    """The strict mode does fail: a fake float32 SPEC=mtp server that flips one 1-ulp tie."""
    _sweep_fails_against_fake_mtp(monkeypatch, tmp_path, tiny_dir, "_suite2", "tie",
                                  "test_residue_sweep_fp32_strict", "the float32 rule does not accept")
