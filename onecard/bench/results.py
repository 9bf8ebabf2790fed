"""Result files that are never half-written and never lost.

* :func:`atomic_write_json` writes a temp file in the target directory, fsyncs it and
  ``os.replace``-s it over the target: a reader sees the old file or the new one, never a torn
  one. A run rewrites its own result file after every step, so a killed server or client leaves
  the last complete state on disk (marked ``partial`` and ``INVALID``).
* :func:`append_jsonl` appends one line per finished run to ``runs.jsonl`` (append-only log,
  one ``write`` of one line with O_APPEND, then fsync).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

RUNS_LOG = "runs.jsonl"


def _dumps(obj: Any, indent: int | None = 2) -> str:
    return json.dumps(obj, indent=indent, sort_keys=False, default=str, allow_nan=False)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Serialise first (so a non-serialisable object never truncates a file), then write."""
    text = _dumps(_clean(obj)) + "\n"
    return atomic_write_text(path, text)


def append_jsonl(path: str | os.PathLike, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (_dumps(_clean(obj), indent=None) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL log; a torn last line (crash mid-append) is skipped, never fatal."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _clean(obj: Any) -> Any:
    """Replace NaN/inf by None so the JSON stays standard."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def new_result_path(out_dir: str | os.PathLike, kind: str, label: str | None = None) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", label or "").strip("-")
    name = f"{kind}-{slug + '-' if slug else ''}{stamp}-{uuid.uuid4().hex[:6]}.json"
    return Path(out_dir) / name


class ResultFile:
    """One result JSON, rewritten atomically after every step; logged to runs.jsonl on close.

    ``result`` always carries ``partial`` (True until :meth:`finish`) and ``verdict``.
    """

    def __init__(self, out_dir: str | os.PathLike, kind: str, result: dict, label: str | None = None):
        self.out_dir = Path(out_dir)
        self.path = new_result_path(out_dir, kind, label)
        self.result = result
        self.result.setdefault("kind", kind)
        self.result["partial"] = True
        self.result.setdefault("verdict", "INVALID")
        self.result.setdefault("verdict_reasons", ["run not finished"])
        self.save()

    def save(self) -> Path:
        return atomic_write_json(self.path, self.result)

    def finish(self, verdict: str, reasons: list[str]) -> Path:
        self.result["partial"] = False
        self.result["verdict"] = verdict
        self.result["verdict_reasons"] = list(reasons)
        self.save()
        append_jsonl(self.out_dir / RUNS_LOG, {
            "file": self.path.name, "kind": self.result.get("kind"), "verdict": verdict,
            "reasons": list(reasons), "date": self.result.get("provenance", {}).get("date"),
        })
        return self.path

    def abort(self, reason: str) -> Path:
        """Keep what was measured, say why it is not a result."""
        self.result["partial"] = True
        self.result["verdict"] = "INVALID"
        self.result["verdict_reasons"] = [reason]
        self.save()
        append_jsonl(self.out_dir / RUNS_LOG, {
            "file": self.path.name, "kind": self.result.get("kind"), "verdict": "INVALID",
            "reasons": [reason], "date": self.result.get("provenance", {}).get("date"),
        })
        return self.path
