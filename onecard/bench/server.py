"""Start / wait for / stop a server process (its own process group, always killed)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


class ServerProcess:
    def __init__(self, cmd: str, env: dict[str, str] | None = None, log_path: str | Path | None = None):
        self.cmd, self.env_over = cmd, dict(env or {})
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> "ServerProcess":
        env = {**os.environ, **self.env_over}
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(["bash", "-c", self.cmd], env=env, start_new_session=True,
                                     stdout=self._log or subprocess.DEVNULL, stderr=subprocess.STDOUT)
        return self

    def wait_healthy(self, base_url: str, timeout: float = 600.0) -> float:
        """Seconds until GET /health answered 200; raises if the process dies or time runs out."""
        import httpx
        url = base_url.rstrip("/").removesuffix("/v1") + "/health"
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before becoming healthy"
                                   f"{' (log: ' + str(self.log_path) + ')' if self.log_path else ''}")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy at {url} after {timeout:.0f} s")

    def stop(self, grace: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._close()
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self._close()

    def _close(self) -> None:
        if self._log:
            self._log.close()
            self._log = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
