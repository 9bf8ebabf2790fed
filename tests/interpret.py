"""Running Triton kernels under the CPU interpreter inside one pytest process.

Triton decorates its own standard library (tl.zeros, tl.sum, ...) when it is imported, so the
interpreter must be on before the process first imports `triton`. A kernel test module calls
`enable()` before importing Triton; when another module already imported Triton without the
interpreter, its in-process tests are skipped (`inproc`) and `child_rerun` runs the whole module
again in a child pytest with the interpreter on.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


_preimported: bool | None = None  # decided once per process, at the first enable()


def enable() -> bool:
    """Turn the interpreter on; True when Triton was already imported without it.

    Decided once per process: after a first module turned the variable on, a second module must
    not mistake an uninterpreted Triton for an interpreted one.
    """
    global _preimported
    if _preimported is None:
        _preimported = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
        os.environ["TRITON_INTERPRET"] = "1"
    return _preimported


def inproc_mark(preimported: bool):
    return pytest.mark.skipif(preimported, reason="Triton was imported uninterpreted; see test_in_child_process")


def child_rerun(path: str, preimported: bool):
    """A test that re-runs the module at `path` in a child pytest (only when `preimported`)."""

    @pytest.mark.skipif(not preimported, reason="runs only when Triton was imported before")
    def test_in_child_process(pytestconfig):
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                              cwd=str(pytestconfig.rootpath), env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

    return test_in_child_process
