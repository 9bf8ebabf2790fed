"""Small helpers the GPU job drivers share (gpu/jobs/*.py, gpu/lib/pools.py): an atomic JSON
write, a free local port, and stopping a server started in a process group of its own.
Import with gpu/lib on sys.path: `sys.path.insert(0, str(REPO / "gpu" / "lib")); import jobutil`."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
from pathlib import Path


def write_json(path: Path, obj, indent: int = 1, default=None) -> None:
    """Write obj as JSON to path atomically: a temp file in the same folder, renamed. indent and
    default go to json.dump (default=str for records that may hold paths or exceptions)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=indent, default=default)
    os.replace(tmp, path)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, sigint_wait: float = 10) -> None:
    """End proc's process group (proc was started with start_new_session=True, so its pid is the
    group's id and nothing else is signalled): SIGINT, wait sigint_wait s; SIGTERM, 10 s; SIGKILL, 5 s."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGINT, sigint_wait), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
