"""GPU suite plumbing: one vLLM server per configuration, all booted at once, shared by every
test that needs it, killed at the end of the session.

Tiny-model configurations go through the product path, ``python3 -m onecard.launch`` (env knobs
-> plan -> preflight -> exec vllm serve), with the CTX / SPEC profiles as shipped (prefix caching
+ ``--mamba-cache-mode align``, the profile's MTP k, vLLM's default CUDA graphs) and a few
test-only values: a small KV pin, MAX_LEN 2048, ``--seed 0``, ``--logprobs-mode raw_logits``
(the exactness rule reads raw logits), a small ``--gpu-memory-utilization`` so all servers fit
on one GPU at once, no reasoning parser, whitespace-free forced JSON. The float32 strict-mode
servers add ``--dtype float32``, ``TRITON_F32_DEFAULT=ieee`` and tests/gpu/fp32_shim (see its
docstring: vLLM 0.27.1's FLA GDN prefill refuses float32). SmolLM2 is served directly (a
Llama checkpoint, not what the launcher is for).

Tests name the servers they use with ``@pytest.mark.uses("off", "mtp")``; the session boots the
union of those (or ``ONECARD_GPU_CONFIGS=off,mtp,...``) in parallel as soon as it starts, and a
test waits only for its own servers. Every server log goes to ``$JOB_OUT/server-<name>.log``;
the record of the session (boots, argv, per-test wall time, results) to
``$JOB_OUT/gpu_suite.json`` (atomic writes).

Knobs: ONECARD_GPU_EAGER=1 (all servers --enforce-eager), ONECARD_GPU_BOOT_TIMEOUT (default
400 s, from launch), ONECARD_GPU_MEM (per-server gpu_memory_utilization, default 0.06),
ONECARD_GPU_CONFIGS (comma list, overrides what the collected tests ask for),
ONECARD_GPU_WARM_FIRST (a server name: it boots alone first; default empty: all at once).
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HOST = "127.0.0.1"
HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
BOOT_TIMEOUT = float(os.environ.get("ONECARD_GPU_BOOT_TIMEOUT", "400"))
GPU_MEM = os.environ.get("ONECARD_GPU_MEM", "0.06")
EAGER = os.environ.get("ONECARD_GPU_EAGER", "") not in ("", "0")
# ONECARD_GPU_WARM_FIRST=<server>[,<server>...]: the first of these that the run needs boots
# alone first, so the others reuse its compile caches. Measured 2026-12-02 (bare H200): `off`
# alone 274 s, then eight at once 227-234 s each (every vLLM profiling run still 80-91 s: each
# configuration had its own Triton cache, see onecard/plan.py) = ~510 s before the first sweep,
# against 147-388 s for all at once in an overloaded lease: so all at once by default.
WARM_FIRST = [n for n in os.environ.get("ONECARD_GPU_WARM_FIRST", "").split(",") if n]
SHIM_DIR = HERE / "fp32_shim"
STRUCTURED = json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})


@dataclass(frozen=True)
class Config:
    name: str
    model: str                 # "tiny" | "smol"
    ctx: str = "fast"          # launcher CTX profile (tiny)
    spec: str = "off"          # launcher SPEC profile (tiny)
    dtype: str = "bfloat16"    # activation dtype: bfloat16 | float32 (strict mode)
    extra: tuple = field(default=())
    knobs: tuple = field(default=())  # more launcher knobs, (NAME, VALUE) pairs

    @property
    def kv(self) -> str:
        from onecard.profiles import CTX_PROFILES

        return CTX_PROFILES[self.ctx].kv


# The SPEC=off references of the bf16 and int8 sweeps run vLLM's own GDN metadata path (a build
# per KV cache group, GDN_SHARED_META=0); their MTP servers run patch 0082's one shared build, so
# the 128-residue sweep proves 0082 exact under verify too.
STOCK_GDN_META = (("GDN_SHARED_META", "0"),)
CONFIGS: dict[str, Config] = {c.name: c for c in [
    Config("off", "tiny", "fast", "off", knobs=STOCK_GDN_META),
    Config("mtp", "tiny", "fast", "mtp"),
    Config("int8", "tiny", "long", "off", knobs=STOCK_GDN_META),
    Config("int8-mtp", "tiny", "long", "mtp"),
    Config("fp32", "tiny", "fast", "off", "float32"),
    Config("fp32-mtp", "tiny", "fast", "mtp", "float32"),
    Config("fp32-int8", "tiny", "long", "off", "float32"),
    Config("fp32-int8-mtp", "tiny", "long", "mtp", "float32"),
    Config("smol", "smol"),
]}

# Launcher knobs every tiny server gets (the rest are the CTX / SPEC profile defaults). KV_MEM
# 3 GiB: the residue sweep keeps 128 prompts of 1024..1151 tokens cached for its second pass; an
# LRU pool smaller than that footprint evicts each prompt before it comes back (2026-12-02: 512 MiB,
# 2,496 hit tokens instead of ~56k). vLLM's own KV cache manager on CPU (tests/test_prefix_cache.py
# ::test_gpu_suite_sweep_hits_its_ideal) gives every bf16/int8 server of the sweep its ideal hits
# at 2 GiB; at 3 GiB vLLM's real scheduler on CPU gives every server, float32 included, its
# whole-block hits (docs/results/2026-12-03-prefix-cache-cpu/new-sweep-settings-output.txt).
TINY_KNOBS = {"SERVED_NAME": "tiny", "HOST": HOST, "MAX_LEN": "2048", "KV_MEM": "3G",
              "GDN_PREFILL": "triton", "REASONING_PARSER": "none"}


def out_dir() -> Path:
    d = os.environ.get("JOB_OUT")
    p = Path(d) if d else Path(tempfile.gettempdir()) / "onecard-gpu-tests"
    p.mkdir(parents=True, exist_ok=True)
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def tiny_knobs(cfg: Config, model: Path, port: int) -> dict[str, str]:
    """The launcher environment of a tiny-model configuration."""
    extra = ["--seed", "0", "--gpu-memory-utilization", GPU_MEM, "--logprobs-mode", "raw_logits",
             "--structured-outputs-config", STRUCTURED]
    if cfg.dtype == "float32":
        extra += ["--dtype", "float32"]
    if EAGER:
        extra += ["--enforce-eager"]
    return {**TINY_KNOBS, **dict(cfg.knobs), "MODEL": str(model), "PORT": str(port), "CTX": cfg.ctx,
            "SPEC": cfg.spec, "EXTRA_ARGS": shlex.join([*extra, *cfg.extra])}


def tiny_plan(cfg: Config, model: Path, port: int, root: Path):
    """What `python3 -m onecard.launch` will exec for this configuration (same call as launch)."""
    from onecard import memory
    from onecard.plan import make_plan

    return make_plan(tiny_knobs(cfg, model, port), root, sys.executable, None,
                     memory.ModelGeometry.from_model_dir(model), check_paths=True)


def child_env(cfg: Config, knobs: dict[str, str]) -> dict[str, str]:
    from onecard.profiles import KNOBS

    env = {k: v for k, v in os.environ.items() if k not in KNOBS}   # no stray knobs
    env.update(knobs)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "2")   # many servers compile at once
    if cfg.dtype == "float32":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIM_DIR), str(REPO),
                                                        env.get("PYTHONPATH", "")) if p)
        env["TRITON_F32_DEFAULT"] = "ieee"     # Triton dots in true fp32, not tf32
    else:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def smol_argv(model: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
            "--host", HOST, "--port", str(port), "--served-model-name", "smol",
            "--max-model-len", "2048", "--max-num-seqs", "8", "--seed", "0",
            "--gpu-memory-utilization", GPU_MEM, "--kv-cache-memory-bytes", str(1 << 30),
            "--enforce-eager"]


class Server:
    """One server process in its own session (process group): launch, wait healthy, stop."""

    def __init__(self, name: str, argv: list[str], served: str, port: int | None = None,
                 env: dict | None = None, vllm_argv: list[str] | None = None):
        self.name, self.argv, self.served, self.env = name, argv, served, env
        self.port = port or free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.vllm_argv = vllm_argv or argv
        self.log_path = out_dir() / f"server-{name}.log"
        self.proc: subprocess.Popen | None = None
        self.t_launch: float | None = None
        self.boot_s: float | None = None
        self.error: str | None = None
        self._log = None
        self._lock = threading.Lock()
        self._client_lock = threading.Lock()
        self._client = None

    def launch(self) -> None:
        print(f"[gpu-suite] launch {self.name}: {shlex.join(self.argv)}", flush=True)
        self._log = open(self.log_path, "w")
        self._log.write(shlex.join(self.vllm_argv) + "\n\n")
        self._log.flush()
        self.t_launch = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=self.env, cwd=str(REPO))
        with open(out_dir() / "server.pids", "a") as f:   # for the job's leftover cleanup
            f.write(f"{self.proc.pid}\n")

    def wait(self, timeout: float = BOOT_TIMEOUT) -> None:
        """Block until /health answers 200 (timeout counted from launch); raise with the log
        tail if the process dies or the time runs out (and stop it)."""
        import httpx

        with self._lock:
            if self.boot_s is not None:
                return
            if self.error is not None:
                raise RuntimeError(self.error)
            if self.proc is None:
                self.launch()
            while True:
                if self.proc.poll() is not None:
                    rc = self.proc.returncode
                    self.stop()
                    self.error = (f"server {self.name} exited rc={rc} during boot; "
                                  f"log tail:\n{self.tail()}")
                    raise RuntimeError(self.error)
                if time.monotonic() - self.t_launch > timeout:
                    self.stop()
                    self.error = (f"server {self.name} not healthy {timeout:.0f} s after launch; "
                                  f"log tail:\n{self.tail()}")
                    raise RuntimeError(self.error)
                try:
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            self.boot_s = time.monotonic() - self.t_launch
            print(f"[gpu-suite] {self.name} healthy {self.boot_s:.1f} s after launch", flush=True)

    def start(self) -> None:
        self.launch()
        self.wait()

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def terminate(self) -> None:
        """SIGTERM the process group without waiting (Pool.close signals all, then waits)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.proc is not None:
            try:   # the group may outlive its leader (engine core, compile workers)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._log is not None:
            self._log.close()
            self._log = None

    # --- requests -------------------------------------------------------------------------
    def client(self):
        """One pooled HTTP client per server, shared by the threads of a concurrent sweep."""
        import httpx

        with self._client_lock:
            if self._client is None:
                from onecard.bench.client import http_limits  # idle connections dropped first

                self._client = httpx.Client(limits=http_limits(max_connections=256, max_keepalive_connections=256))
            return self._client

    def post(self, path: str, payload: dict, timeout: float = 120) -> dict:
        r = self.client().post(self.url + path, json=payload, timeout=timeout)
        assert r.status_code == 200, f"{self.name} {path} -> {r.status_code}: {r.text[:500]}"
        return r.json()

    def stream(self, path: str, payload: dict, timeout: float = 120) -> list[dict]:
        import httpx

        chunks = []
        with httpx.stream("POST", self.url + path, json=payload, timeout=timeout) as r:
            assert r.status_code == 200, f"{self.name} {path} -> {r.status_code}"
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data.strip() == "[DONE]":
                    break
                chunks.append(json.loads(data))
        return chunks

    def metrics(self) -> str:
        import httpx

        return httpx.get(self.url + "/metrics", timeout=10).text


class Pool:
    """Every configuration's server, launched together; ``get(name)`` waits for one."""

    def __init__(self):
        self.servers: dict[str, Server] = {}
        self.cache: dict = {}
        self.record: dict = {"boots": {}, "tests": {}, "eager": EAGER, "gpu_mem": GPU_MEM}
        self._models: dict[str, Path] = {}
        self._root = Path(tempfile.mkdtemp(prefix="onecard-launch-root-"))  # no stray .env
        self.t0 = time.monotonic()

    def model(self, key: str) -> Path:
        if key not in self._models:
            t0 = time.monotonic()
            if key == "tiny":
                from onecard.prepare.tiny import ensure_tiny_model
                self._models[key] = ensure_tiny_model()
            else:
                from onecard.prepare.gguf import ensure_smollm2
                self._models[key] = ensure_smollm2()
            print(f"[gpu-suite] model {key}: {self._models[key]} "
                  f"({time.monotonic() - t0:.1f} s to ensure)", flush=True)
        return self._models[key]

    def make_server(self, name: str) -> Server:
        if name not in CONFIGS:
            raise ValueError(f"unknown GPU-suite config {name!r}; valid: {', '.join(CONFIGS)}")
        cfg = CONFIGS[name]
        port = free_port()
        model = self.model(cfg.model)
        if cfg.model == "smol":
            return Server(name, smol_argv(model, port), "smol", port)
        plan = tiny_plan(cfg, model, port, self._root)     # recorded; launch re-plans the same
        argv = [sys.executable, "-m", "onecard.launch", "--root", str(self._root)]
        return Server(name, argv, "tiny", port, env=child_env(cfg, tiny_knobs(cfg, model, port)),
                      vllm_argv=plan.argv)

    def launch_all(self, names) -> None:
        for name in names:
            if name in self.servers:
                continue
            try:
                s = self.make_server(name)
                self.servers[name] = s
                s.launch()
                self.record["boots"][name] = {"argv": s.vllm_argv, "via": s.argv[:3]}
            except Exception as e:     # a bad plan fails that config's tests, not the session
                self.record["boots"][name] = {"error": f"launch: {e}"}
        self.save()

    def get(self, name: str) -> Server:
        if name not in self.servers:
            self.launch_all([name])
        s = self.servers.get(name)
        if s is None:
            pytest.fail(f"server {name} could not be launched: {self.record['boots'][name]}")
        try:
            s.wait()
        except RuntimeError as e:
            self.record["boots"][name]["error"] = str(e)[-2000:]
            self.save()
            pytest.fail(f"server {name} failed to boot: {str(e)[:3000]}")
        self.record["boots"][name]["boot_s"] = round(s.boot_s or 0, 1)
        self.save()
        return s

    def close(self) -> None:
        for s in self.servers.values():
            s.terminate()
        for s in self.servers.values():
            s.stop()
        import shutil

        shutil.rmtree(self._root, ignore_errors=True)

    def save(self) -> None:
        path = out_dir() / "gpu_suite.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.record, indent=2, default=str) + "\n")
        os.replace(tmp, path)


_POOL: Pool | None = None
_NEEDED: list[str] = []


def _sigterm_to_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _gpu_run(config) -> bool:
    m = config.getoption("-m") or ""
    return "gpu" in m and "not gpu" not in m


def pytest_configure(config):
    config.addinivalue_line("markers", "uses(*configs): GPU-suite servers a test needs")
    # `timeout` sends SIGTERM: turn it into an interrupt so fixture teardown stops the servers.
    if _gpu_run(config):
        signal.signal(signal.SIGTERM, _sigterm_to_interrupt)


@pytest.hookimpl(trylast=True)   # after -k / -m deselection: boot only what the kept tests use
def pytest_collection_modifyitems(session, config, items):
    wanted = os.environ.get("ONECARD_GPU_CONFIGS", "")
    if wanted:
        names = [n.strip() for n in wanted.split(",") if n.strip()]
    else:
        names = []
        for item in items:
            for mark in item.iter_markers("uses"):
                names += [n for n in mark.args if n not in names]
    _NEEDED[:] = names


def pytest_runtest_logreport(report):
    if _POOL is None or report.when not in ("setup", "call"):
        return
    rec = _POOL.record["tests"].setdefault(report.nodeid.split("::")[-1], {"wall_s": 0.0})
    rec["wall_s"] = round(rec["wall_s"] + report.duration, 1)
    if report.when == "call" or report.failed:
        rec["outcome"] = report.outcome
    if report.when == "call" or report.failed:
        print(f"\n[gpu-suite] time {report.nodeid.split('::')[-1]}: {rec['outcome']} "
              f"{rec['wall_s']:.1f} s", flush=True)
    _POOL.save()


@pytest.fixture(scope="session")
def servers():
    global _POOL
    pool = Pool()
    _POOL = pool
    try:
        first = next((n for n in WARM_FIRST if n in _NEEDED), "") if len(_NEEDED) > 1 else ""
        if first:   # one server compiles the shared Triton / inductor kernels, the rest reuse them
            pool.launch_all([first])
            try:
                pool.servers[first].wait()
            except (KeyError, RuntimeError):
                pass     # its tests report the failure; the others still boot
            print(f"[gpu-suite] warm-first {first} done {time.monotonic() - pool.t0:.1f} s "
                  f"after the session start; launching the rest", flush=True)
        pool.launch_all(_NEEDED)
        yield pool
    finally:
        pool.close()
        pool.record["session_wall_s"] = round(time.monotonic() - pool.t0, 1)
        pool.save()
        _POOL = None
