#!/usr/bin/env python3
"""Regenerate the new-file part of the wide-verify patch (0070-wide-verify-triton-attn.patch).

The patch ships onecard/kernels/wide_verify.py as vllm/v1/attention/ops/onecard_wide_verify.py
(tests/test_wide_verify_patch.py checks the two are identical). After editing the kernel run:

  python3 scripts/make_wide_verify_patch.py [PATCH_FILE] [--check]

It rewrites only the hunk that creates the kernel file; the header and the triton_attn.py hunks
stay as they are. The file is replaced atomically.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KERNEL = REPO / "onecard" / "kernels" / "wide_verify.py"
TARGET = "vllm/v1/attention/ops/onecard_wide_verify.py"


def new_file_diff(text: str) -> str:
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        raise SystemExit(f"{KERNEL} must end with a newline")
    out = ["--- /dev/null\n", f"+++ b/{TARGET}\n", f"@@ -0,0 +1,{len(lines)} @@\n"]
    out += ["+" + line for line in lines]
    return "".join(out)


DEFAULT = REPO / "patches" / "0070-wide-verify-triton-attn.patch"


def render(path: Path) -> str:
    """The patch text with its kernel hunk regenerated from KERNEL; the rest of the file kept."""
    text = path.read_text(encoding="utf-8")
    marker = "--- /dev/null\n+++ b/" + TARGET
    keep = text.split(marker)[0] if marker in text else text
    if keep and not keep.endswith("\n"):
        keep += "\n"
    return keep + new_file_diff(KERNEL.read_text(encoding="utf-8"))


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("patch", nargs="?", default=str(DEFAULT),
                    help="the wide-verify patch to rewrite (default: %(default)s)")
    ap.add_argument("--check", action="store_true", help="exit 1 if the patch is out of date; write nothing")
    args = ap.parse_args(argv)
    path = Path(args.patch)
    # an existing patch with its header only: a mistyped path must not become a new file
    if not path.is_file() or "Applies-To:" not in path.read_text(encoding="utf-8"):
        print(f"make_wide_verify_patch: {path} is not valid; valid: an existing patch file with its header "
              f"(default {DEFAULT.relative_to(REPO)})", file=sys.stderr)
        return 2
    body = render(path)
    if args.check:
        if path.read_text(encoding="utf-8") != body:
            print(f"{path}: out of date with {KERNEL.relative_to(REPO)}: run python3 scripts/make_wide_verify_patch.py",
                  file=sys.stderr)
            return 1
        print(f"{path}: up to date")
        return 0
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(body)
    os.replace(tmp, path)
    print(f"wrote {path} ({len(body)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
