"""The provenance record every result JSON carries.

Fields: git commit (+ dirty flag), vLLM version (server's ``/version`` when reachable, else the
installed package's metadata), patch-series hash, GPU / driver (nvidia-smi when present), full
argv, env knobs (secrets redacted), prompt set id + hash, sampling, token-count source, warmup
policy, server URL / model, date (UTC ISO-8601), host.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SERIES = REPO_ROOT / "patches" / "series"

#: Environment variables recorded as knobs: these prefixes, plus the exact names below.
KNOB_PREFIXES = ("ONECARD_", "VLLM_", "CUDA_", "PYTORCH_", "TORCH_", "TRITON_", "NCCL_", "HF_")
KNOB_NAMES = ("CTX", "SPEC", "KV", "MAX_SEQS", "PROFILE", "MODEL", "PORT", "HOST",
              "KV_DTYPE", "DRAFT", "NUM_SPEC", "ENFORCE_EAGER", "PYTHONPATH")
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _run(cmd: list[str], cwd: Path | None = None, timeout: float = 10) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_info(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """commit / dirty from the checkout's git, and tree_rev: ONECARD_TREE_REV, the commit the
    caller says the tree is (the GPU host gets a copy of the working tree whose .git can be
    stale: there `commit` is not what ran; gpu/run.sh exports ONECARD_TREE_REV)."""
    tree_rev = os.environ.get("ONECARD_TREE_REV") or None
    if shutil.which("git") is None:
        return {"commit": None, "dirty": None, "tree_rev": tree_rev}
    commit = _run(["git", "rev-parse", "HEAD"], cwd=repo)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo)
    return {"commit": commit, "dirty": (bool(status) if status is not None else None),
            "tree_rev": tree_rev}


def _fallback_series_hash(series_path: Path) -> str | None:
    """sha256 over the series file and every patch it lists (in order), name + bytes."""
    if not series_path.is_file():
        return None
    h = hashlib.sha256()
    h.update(b"series\0" + series_path.read_bytes())
    for line in series_path.read_text(encoding="utf-8").splitlines():
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        p = series_path.parent / name
        h.update(b"\0" + name.encode() + b"\0")
        h.update(p.read_bytes() if p.is_file() else b"<missing>")
    return h.hexdigest()


def series_hash(series_path: str | os.PathLike = DEFAULT_SERIES) -> dict[str, Any]:
    """The patch-series hash: onecard.patching.series_hash when it exists, else our own."""
    series_path = Path(series_path)
    try:
        from onecard.patching import series_hash as lead_hash  # lazy: module may not exist yet
    except Exception:  # noqa: BLE001 - any import failure means "not there yet"
        lead_hash = None
    if lead_hash is not None:
        try:
            return {"hash": str(lead_hash(series_path)), "source": "onecard.patching.series_hash",
                    "series": str(series_path)}
        except Exception as exc:  # noqa: BLE001
            fallback = _fallback_series_hash(series_path)
            return {"hash": fallback, "source": f"bench fallback (patching failed: {exc})",
                    "series": str(series_path)}
    return {"hash": _fallback_series_hash(series_path), "source": "bench fallback",
            "series": str(series_path)}


def gpu_info() -> dict[str, Any]:
    if shutil.which("nvidia-smi") is None:
        return {"gpus": [], "driver": None, "source": "none (no nvidia-smi)"}
    out = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,power.limit",
                "--format=csv,noheader"])
    gpus, driver = [], None
    for line in (out or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2:
            driver = parts[1]
            gpus.append({"name": parts[0], "memory": parts[2] if len(parts) > 2 else None,
                         "power_limit": parts[3] if len(parts) > 3 else None})
    return {"gpus": gpus, "driver": driver, "source": "nvidia-smi"}


def env_knobs(environ: dict[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    out = {}
    for k in sorted(env):
        if k.startswith(KNOB_PREFIXES) or k in KNOB_NAMES:
            secret = any(w in k.upper() for w in _SECRET_WORDS)
            out[k] = "<redacted>" if secret else env[k]
    return out


def local_vllm_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("vllm")
    except Exception:  # noqa: BLE001
        return None


def build(*, argv: list[str] | None = None, prompt_set: dict | None = None,
          sampling: dict | None = None, token_count_source: str = "usage.completion_tokens",
          warmup: dict | None = None, server: dict | None = None,
          max_tokens: Any = None,
          series_path: str | os.PathLike = DEFAULT_SERIES,
          environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Assemble the record. ``server`` may carry url / model / version (from the server)."""
    server = dict(server or {})
    return {
        "date": utc_now(),
        "git": git_info(),
        "vllm_version": server.get("version") or local_vllm_version(),
        "vllm_version_source": "server /version" if server.get("version") else "local metadata",
        "patch_series": series_hash(series_path),
        "gpu": gpu_info(),
        "argv": list(sys.argv if argv is None else argv),
        "env_knobs": env_knobs(environ),
        "prompt_set": prompt_set,
        "sampling": sampling,
        "max_tokens": max_tokens,
        "token_count_source": token_count_source,
        "warmup": warmup,
        "server": server,
        "host": platform.node(),
        "python": platform.python_version(),
    }
