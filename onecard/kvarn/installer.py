"""kvarn/install.sh: put the KVarN cache into an installed (patched) vLLM 0.27.1, or take it out.

Installed = three things, all or nothing:

* new files: ``vllm/v1/attention/ops/kvarn/{__init__,format,kernels,stage}.py`` (verbatim copies
  of ``onecard/kvarn/``) and ``vllm/v1/attention/backends/kvarn_attn.py`` (``kvarn/vllm/``);
* the one patch of ``kvarn/series`` (dtype registration, page size, hybrid alignment, backend
  registry), through onecard's patch machinery (``onecard.patching``: applied in memory first,
  "applied" = the reverse applies);
* the marker ``vllm/kvarn_installed.txt`` (written last; the launcher refuses CTX=huge without it).

A second install changes nothing; ``--uninstall`` reverts the patch, deletes the files and the
marker, leaving the package byte-identical to before the install. Every file write is atomic
(temp file + rename); a failure part-way restores what was written. Not copied into vLLM.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from onecard import patching

PKG = Path(__file__).resolve().parent
REPO = PKG.parent.parent
SERIES = REPO / "kvarn" / "series"
OPS_DIR = "vllm/v1/attention/ops/kvarn"
BACKEND = "vllm/v1/attention/backends/kvarn_attn.py"
MARKER = "vllm/kvarn_installed.txt"
COPIED = ("__init__.py", "format.py", "kernels.py", "stage.py")


class KvarnError(Exception):
    """One-line, user-facing."""


def sources() -> dict[str, Path]:
    """Installed path (relative to the site dir) -> source file in this checkout."""
    out = {f"{OPS_DIR}/{name}": PKG / name for name in COPIED}
    out[BACKEND] = REPO / "kvarn" / "vllm" / "kvarn_attn.py"
    return out


def marker_text() -> str:
    lines = ["KVarN KV cache installed by onecard (kvarn/install.sh); remove with --uninstall",
             f"series {patching.series_hash(SERIES)}"]
    for rel, src in sorted(sources().items()):
        lines.append(f"{hashlib.sha256(src.read_bytes()).hexdigest()[:16]}  {rel}")
    return "\n".join(lines) + "\n"


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _drop_bytecode(path: Path) -> None:
    cache = path.parent / "__pycache__"
    for pyc in cache.glob(f"{path.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)
    if cache.is_dir() and not any(cache.iterdir()):
        cache.rmdir()


def state(vllm_dir: Path) -> dict:
    """{'patch': applied|not applied|does not fit (detail), 'files': {rel: ok|missing|differs},
    'marker': ok|missing|stale}."""
    site = vllm_dir.parent
    report = patching.status(vllm_dir, SERIES)
    (_, pstate, detail), = report.states
    files = {}
    for rel, src in sources().items():
        dest = site / rel
        files[rel] = "missing" if not dest.is_file() else "ok" if dest.read_bytes() == src.read_bytes() else "differs"
    m = site / MARKER
    marker = "missing" if not m.is_file() else "ok" if m.read_text(encoding="utf-8") == marker_text() else "stale"
    return {"patch": pstate, "patch_detail": detail, "files": files, "marker": marker}


def problems(st: dict) -> list[str]:
    """What a state() lacks against this checkout: [] when patch, files and marker all match."""
    bad = [f"patch {st['patch']}"] if st["patch"] != patching.APPLIED else []
    bad += [f"marker {st['marker']}"] if st["marker"] != "ok" else []
    return bad + [f"{rel.rsplit('/', 1)[-1]} {s}" for rel, s in st["files"].items() if s != "ok"]


def install(vllm_dir: Path, dry_run: bool = False) -> list[str]:
    site = vllm_dir.parent
    st = state(vllm_dir)
    if st["patch"] == patching.DOES_NOT_FIT:
        raise KvarnError(f"{SERIES.parent.name}/{SERIES.name}: the KVarN patch does not fit vllm at "
                         f"{vllm_dir} ({st['patch_detail']}); valid: a vLLM 0.27.1 with patches/series "
                         f"applied; nothing was written")
    todo = [rel for rel, s in st["files"].items() if s != "ok"]
    if not todo and st["patch"] == patching.APPLIED and st["marker"] == "ok":
        return [f"already installed: KVarN on {vllm_dir}; nothing to do"]
    msgs = [f"{'would write' if dry_run else 'wrote'} {rel}" for rel in todo]
    if st["patch"] != patching.APPLIED:
        msgs.append(f"{'would apply' if dry_run else 'applied'} kvarn/patches/0001-kvarn-kv-cache.patch")
    msgs.append(f"{'would write' if dry_run else 'wrote'} {MARKER}")
    if dry_run:
        return msgs
    written: list[tuple[Path, bytes | None]] = []
    made_dir = not (site / OPS_DIR).exists()
    applied = False
    try:
        for rel in todo:
            dest = site / rel
            before = dest.read_bytes() if dest.is_file() else None
            _atomic_write(dest, sources()[rel].read_bytes())
            written.append((dest, before))
            _drop_bytecode(dest)
        if st["patch"] != patching.APPLIED:
            patching.apply(vllm_dir, SERIES)
            applied = True
        _atomic_write(site / MARKER, marker_text().encode("utf-8"))
    except BaseException as exc:
        if applied:
            patching.revert(vllm_dir, SERIES)
        for dest, before in reversed(written):
            if before is None:
                dest.unlink(missing_ok=True)
            else:
                dest.write_bytes(before)
            _drop_bytecode(dest)
        if made_dir:
            shutil.rmtree(site / OPS_DIR, ignore_errors=True)
        if isinstance(exc, patching.PatchError):
            raise KvarnError(f"{exc}; nothing was left changed") from None
        raise
    return msgs


def uninstall(vllm_dir: Path, dry_run: bool = False) -> list[str]:
    site = vllm_dir.parent
    st = state(vllm_dir)
    present = [rel for rel, s in st["files"].items() if s != "missing"]
    if st["patch"] == patching.DOES_NOT_FIT:
        raise KvarnError(f"the KVarN patch is neither applied nor appliable on {vllm_dir} "
                         f"({st['patch_detail']}); valid: reinstall vllm==0.27.1; nothing was changed")
    if not present and st["patch"] != patching.APPLIED and st["marker"] == "missing":
        return [f"not installed: no KVarN on {vllm_dir}; nothing to do"]
    verb = "would remove" if dry_run else "removed"
    msgs = []
    if st["marker"] != "missing":
        msgs.append(f"{verb} {MARKER}")
    if st["patch"] == patching.APPLIED:
        msgs.append(f"{'would revert' if dry_run else 'reverted'} kvarn/patches/0001-kvarn-kv-cache.patch")
    msgs += [f"{verb} {rel}" for rel in present]
    if dry_run:
        return msgs
    (site / MARKER).unlink(missing_ok=True)  # first: the launcher stops offering CTX=huge
    if st["patch"] == patching.APPLIED:
        patching.revert(vllm_dir, SERIES)  # all or nothing
    for rel in present:
        (site / rel).unlink(missing_ok=True)
        _drop_bytecode(site / rel)
    ops = site / OPS_DIR
    if ops.is_dir():
        shutil.rmtree(ops / "__pycache__", ignore_errors=True)
        if not any(ops.iterdir()):
            ops.rmdir()
    return msgs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvarn/install.sh", description="install or remove the KVarN KV cache in vLLM")
    ap.add_argument("--vllm-dir", help="the vllm package directory (default: the one this Python imports)")
    ap.add_argument("--uninstall", action="store_true", help="revert the patch and remove the files and marker")
    ap.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    ap.add_argument("--status", action="store_true", help="print the KVarN state and exit 0 if installed")
    args = ap.parse_args(argv)
    try:
        vllm_dir = patching.locate_vllm(args.vllm_dir)
        if args.status:
            st = state(vllm_dir)
            ok = st["patch"] == patching.APPLIED and st["marker"] == "ok" and all(
                s == "ok" for s in st["files"].values())
            bad = [f"{r} {s}" for r, s in st["files"].items() if s != "ok"]
            print(f"KVarN on {vllm_dir}: patch {st['patch']}, marker {st['marker']}, files "
                  + ("ok" if not bad else "; ".join(bad)))
            return 0 if ok else 1
        msgs = uninstall(vllm_dir, args.dry_run) if args.uninstall else install(vllm_dir, args.dry_run)
    except (KvarnError, patching.PatchError) as exc:
        print(f"kvarn/install.sh: {exc}", file=sys.stderr)
        return 2
    for m in msgs:
        print(m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
