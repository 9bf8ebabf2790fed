"""The wide-verify patch: it ships exactly onecard's kernel, applies to pristine vLLM 0.27.1 after
the current series, and the patched TRITON_ATTN backend imports and reads ONECARD_WIDE_VERIFY."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from onecard import patching

REPO = Path(__file__).resolve().parent.parent
_NAME = "0070-wide-verify-triton-attn.patch"
# patches/pending/ holds it until the lead lists it in patches/series and moves it to patches/
PATCH = next((p for p in (REPO / "patches" / _NAME, REPO / "patches" / "pending" / _NAME)
              if p.is_file()), REPO / "patches" / _NAME)
KERNEL = REPO / "onecard" / "kernels" / "wide_verify.py"
TARGET = "vllm/v1/attention/ops/onecard_wide_verify.py"


def test_shipped_kernel_is_identical_to_onecard_kernel():
    patch = patching.parse_patch(PATCH)
    for key in ("What", "Why", "Test", "Upstream"):
        assert patch.header.get(key), f"header lacks {key}:"
    files = {fd.path: fd for fd in patch.files}
    assert set(files) == {TARGET, "vllm/v1/attention/backends/triton_attn.py"}
    fd = files[TARGET]
    assert fd.created, f"{TARGET} must be created by the patch"
    shipped = "".join(fd.hunks[0].new)
    assert shipped == KERNEL.read_text(encoding="utf-8"), (
        "run: python3 scripts/make_wide_verify_patch.py " + str(PATCH.relative_to(REPO)))


@pytest.fixture(scope="module")
def patched_view(vllm_dir, tmp_path_factory):
    """The current series plus this patch (if the series does not list it yet), overlaid."""
    tmp = tmp_path_factory.mktemp("wv-series")
    names = [p.name for p in patching.read_series()]
    for name in names:
        shutil.copy2(REPO / "patches" / name, tmp / name)
    if PATCH.name not in names:
        names.append(PATCH.name)
    shutil.copy2(PATCH, tmp / PATCH.name)
    (tmp / "series").write_text("\n".join(names) + "\n")
    dest = tmp_path_factory.mktemp("wv-site")
    return patching.overlay(vllm_dir, dest, series=tmp / "series")


def test_patched_backend_imports_and_reads_knob(patched_view):
    code = textwrap.dedent(
        """
        import os
        import vllm.v1.attention.backends.triton_attn as t
        from vllm.v1.attention.ops import onecard_wide_verify as k
        assert t._ONECARD_WIDE_VERIFY is True, "default must be on"
        for val, want in (("off", False), ("0", False), ("auto", True), ("1", True)):
            os.environ["ONECARD_WIDE_VERIFY"] = val
            assert t._onecard_wide_verify_setting() is want, val
        os.environ["ONECARD_WIDE_VERIFY"] = "sometimes"
        try:
            t._onecard_wide_verify_setting()
        except ValueError as exc:
            assert "valid: auto, 1, on, 0, off" in str(exc), exc
        else:
            raise AssertionError("bad value accepted")
        assert k.MAX_QUERY_LEN == 16
        print("OK", t.__file__)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "ONECARD_WIDE_VERIFY"}
    env["PYTHONPATH"] = str(patched_view) + os.pathsep + str(REPO)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, cwd=str(patched_view))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "OK" in proc.stdout
    assert str(patched_view) in proc.stdout  # the overlay, not the pristine install, was imported
