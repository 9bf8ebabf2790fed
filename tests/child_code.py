"""Source that tests run at the top of a child interpreter importing vLLM from a patched overlay,
and ``run_child``, which runs it.

``TRITON_DRIVER_ACTIVE``: vLLM turns its Triton wrappers off when no GPU driver is active, so the
child reports Triton's nvidia driver active before vLLM is imported; the kernels then run through
``TRITON_INTERPRET=1`` on the CPU.
``TRITON_ATTN_BUILDER``: ``builder()``, a ``TritonAttentionMetadataBuilder`` whose ``__init__``
(vllm_config, device) is skipped, so a test calls the real (patched) ``build()``. Needs ``torch``
and the backend module imported as ``t``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the server variables the patches read at import: a test sets them itself, never inherits them
PATCH_KNOBS = ("ONECARD_WIDE_VERIFY", "ONECARD_WIDE_DECODE", "ONECARD_MTP_DRAFT_WIDE", "ONECARD_HADACORE_PAD")


def run_child(site: Path, code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter importing vLLM from ``site`` (a patched overlay) and onecard
    from this tree, under TRITON_INTERPRET=1, without the patches' knobs from this environment."""
    env = {k: v for k, v in os.environ.items() if k not in PATCH_KNOBS}
    env.update(PYTHONPATH=f"{site}{os.pathsep}{REPO}", TRITON_INTERPRET="1", **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=str(site), timeout=600)

TRITON_DRIVER_ACTIVE = """
import triton.backends as _tb
for _name, _b in _tb.backends.items():
    if _b.driver is not None:
        _b.driver.is_active = staticmethod(lambda n=_name: n == "nvidia")
"""

TRITON_ATTN_BUILDER = """
def builder():
    b = object.__new__(t.TritonAttentionMetadataBuilder)
    b.device = torch.device("cpu")
    b.seq_threshold_3D = 32
    b.num_par_softmax_segments = 16
    b.softmax_segm_output = torch.empty(32, 4, 16, 32)
    b.softmax_segm_max = torch.empty(32, 4, 16)
    b.softmax_segm_expsum = torch.empty(32, 4, 16)
    b.rswa_window = None
    return b
"""
