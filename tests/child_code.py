"""Source that tests run at the top of a child interpreter importing vLLM from a patched overlay.

``TRITON_DRIVER_ACTIVE``: vLLM turns its Triton wrappers off when no GPU driver is active, so the
child reports Triton's nvidia driver active before vLLM is imported; the kernels then run through
``TRITON_INTERPRET=1`` on the CPU.
``TRITON_ATTN_BUILDER``: ``builder()``, a ``TritonAttentionMetadataBuilder`` whose ``__init__``
(vllm_config, device) is skipped, so a test calls the real (patched) ``build()``. Needs ``torch``
and the backend module imported as ``t``.
"""
from __future__ import annotations

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
