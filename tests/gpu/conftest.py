"""GPU suite plumbing: one vLLM server at a time on 127.0.0.1, booted per named config.

Tests ask ``servers.use("off")`` etc.; the pool stops the previous server first, so tests of
one config should sit together (file order). Outputs that later tests compare against are
cached in ``servers.cache``. Every server log goes to ``$JOB_OUT`` (else a temp dir) and a
JSON record of what the suite saw is written to ``$JOB_OUT/gpu_suite.json``.

Knobs: ONECARD_GPU_EAGER=1 boots everything with --enforce-eager (faster boots);
ONECARD_GPU_BOOT_TIMEOUT (default 420 s); ONECARD_GPU_MEM (default 0.30).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HOST = "127.0.0.1"
BOOT_TIMEOUT = float(os.environ.get("ONECARD_GPU_BOOT_TIMEOUT", "420"))
GPU_MEM = os.environ.get("ONECARD_GPU_MEM", "0.30")
EAGER = os.environ.get("ONECARD_GPU_EAGER", "") not in ("", "0")

COMMON = ["--max-model-len", "2048", "--max-num-seqs", "8", "--seed", "0",
          "--gpu-memory-utilization", GPU_MEM]
GRAPHS = ["-cc", json.dumps({"cudagraph_capture_sizes": [1, 2, 4, 8]})]
TINY = ["--language-model-only",
        "--additional-config", json.dumps({"gdn_prefill_backend": "triton"}),
        "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
        # a random model must not pad forced-JSON tool calls with whitespace until max_tokens
        "--structured-outputs-config",
        json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
MTP = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2})]
INT8 = ["--kv-cache-dtype", "int8_per_token_head", "--attention-backend", "TRITON_ATTN"]

# name -> (model key, served name, extra args)
CONFIGS: dict[str, tuple[str, str, list[str]]] = {
    "off": ("tiny", "tiny", TINY),
    "mtp": ("tiny", "tiny", TINY + MTP),
    # eager: int8 vs bf16 is report-only, and a third compile boot costs ~100 s of device time
    "int8": ("tiny", "tiny", TINY + INT8 + ["--enforce-eager"]),
    "smol": ("smol", "smol", ["--enforce-eager"]),
}


def out_dir() -> Path:
    d = os.environ.get("JOB_OUT")
    p = Path(d) if d else Path(tempfile.gettempdir()) / "onecard-gpu-tests"
    p.mkdir(parents=True, exist_ok=True)
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, model: Path, served: str, args: list[str]):
        self.name, self.model, self.served = name, model, served
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = out_dir() / f"server-{name}.log"
        mode = ["--enforce-eager"] if EAGER else GRAPHS
        if "--enforce-eager" in args:
            mode = []
        self.argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
                     "--host", HOST, "--port", str(self.port), "--served-model-name", served,
                     *COMMON, *mode, *args]
        self.proc: subprocess.Popen | None = None
        self.boot_s: float | None = None

    def start(self) -> None:
        print(f"[gpu-suite] boot {self.name}: {' '.join(self.argv)}", flush=True)
        self._log = open(self.log_path, "w")
        self._log.write(" ".join(self.argv) + "\n\n")
        self._log.flush()
        t0 = time.monotonic()
        # Own session: stop() signals this process group only (ours).
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        with open(out_dir() / "server.pids", "a") as f:   # for the job's leftover cleanup
            f.write(f"{self.proc.pid}\n")
        import httpx

        while True:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.stop()
                raise RuntimeError(f"server {self.name} exited rc={rc} during "
                                   f"boot; log tail:\n{self.tail()}")
            if time.monotonic() - t0 > BOOT_TIMEOUT:
                self.stop()
                raise RuntimeError(f"server {self.name} not healthy after {BOOT_TIMEOUT:.0f} s; "
                                   f"log tail:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.boot_s = time.monotonic() - t0
        print(f"[gpu-suite] {self.name} healthy after {self.boot_s:.1f} s", flush=True)

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        self.proc = None
        self._log.close()

    # --- requests -------------------------------------------------------------------------
    def post(self, path: str, payload: dict, timeout: float = 120) -> dict:
        import httpx

        r = httpx.post(self.url + path, json=payload, timeout=timeout)
        assert r.status_code == 200, f"{path} -> {r.status_code}: {r.text[:500]}"
        return r.json()

    def stream(self, path: str, payload: dict, timeout: float = 120) -> list[dict]:
        import httpx

        chunks = []
        with httpx.stream("POST", self.url + path, json=payload, timeout=timeout) as r:
            assert r.status_code == 200, f"{path} -> {r.status_code}"
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data.strip() == "[DONE]":
                    break
                chunks.append(json.loads(data))
        return chunks


class Pool:
    def __init__(self):
        self.current: Server | None = None
        self.cache: dict = {}
        self.record: dict = {"boots": {}, "eager": EAGER}
        self._models: dict[str, Path] = {}
        self.failed: dict[str, str] = {}

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

    def use(self, name: str) -> Server:
        if self.current is not None and self.current.name == name:
            return self.current
        self.close()
        if name in self.failed:   # one failed boot per config, not one per test
            pytest.fail(f"server {name} failed to boot earlier: {self.failed[name][:300]}")
        key, served, args = CONFIGS[name]
        try:
            server = Server(name, self.model(key), served, args)
            server.start()
        except Exception as e:
            self.failed[name] = str(e)
            self.record["boots"][name] = {"error": str(e)[-2000:]}
            self.save()
            raise
        self.current = server
        self.record["boots"][name] = {"boot_s": round(server.boot_s or 0, 1), "argv": server.argv}
        self.save()
        return server

    def close(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None

    def save(self) -> None:
        path = out_dir() / "gpu_suite.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.record, indent=2, default=str) + "\n")
        os.replace(tmp, path)


def _sigterm_to_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    # `timeout` sends SIGTERM: turn it into an interrupt so fixture teardown stops the server.
    if config.getoption("-m") and "gpu" in config.getoption("-m") and "not gpu" not in config.getoption("-m"):
        signal.signal(signal.SIGTERM, _sigterm_to_interrupt)


@pytest.fixture(scope="session")
def servers():
    pool = Pool()
    try:
        yield pool
    finally:
        pool.close()
        pool.save()
