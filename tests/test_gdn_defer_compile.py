"""Patch 0085's Triton kernels compile for the RTX 3090 (sm_86) down to a cubin, within its 99 KiB
of shared memory per block, on the CPU.

The interpreter tests (tests/test_gdn_defer_kernels.py) check the arithmetic but not that the
kernels lower through Triton's real compiler (types across branches, pointer casts, constexpr
calls into the shared replay helper). Triton's wheel carries ptxas, so a child process without
TRITON_INTERPRET compiles every kernel variant the runtime launches for the 27B's GDN shapes
(H 16, HV 48, K = V = 128; fp32 state, bf16 values) against a GPUTarget, no GPU needed, and the
per-layer commit kernel of the tests' oracle (tests/gdn_defer_oracle.py), which calls the shipped
replay helper across modules.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

_CHILD = r'''
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import onecard.kernels.gdn_defer as g
import tests.gdn_defer_oracle as oracle   # the per-layer commit: a test oracle, not shipped

tgt = GPUTarget("cuda", 86, 32)   # RTX 3090
opts = {"num_warps": 4, "num_stages": 3}
shape = dict(H=16, HV=48, K=128, V=128, BK=128, BV=32)


def build(fn, sig, **const):
    k = triton.compile(ASTSource(fn, sig, constexprs={**shape, **const}), target=tgt, options=opts)
    assert k.asm.get("cubin"), fn.__name__
    assert k.metadata.shared <= 101_376, (fn.__name__, k.metadata.shared)  # an sm_86 block's shared memory
    print("OK", fn.__name__, sorted(const.items()), k.metadata.shared)


build(g._gdn_defer_verify_kernel,
      {"A_log": "*fp32", "a": "*bf16", "b": "*bf16", "dt_bias": "*fp32", "q": "*bf16", "k": "*bf16", "v": "*bf16",
       "o": "*bf16", "h0": "*fp32", "cu_seqlens": "*i32", "ssm_state_indices": "*i32", "s_k": "*fp32",
       "s_v": "*bf16", "s_g": "*fp32", "s_beta": "*fp32", "scale": "fp32", "softplus_beta": "fp32",
       "threshold": "fp32", "MAXT": "i32", "stride_h0_blk": "i64", "stride_idx_seq": "i32"},
      USE_QK_L2NORM_IN_KERNEL=True)
for hb in (True, False):
    build(oracle._gdn_defer_commit_kernel,
          {"state": "*fp32", "s_k": "*fp32", "s_v": "*bf16", "s_g": "*fp32", "s_beta": "*fp32",
           "row_to_spec": "*i32", "num_accepted": "*i32", "running_block": "*i32", "boundary_count": "*i32",
           "boundary_block": "*i32", "num_rows": "i32", "MAXS": "i32", "MAXT": "i32", "stride_blk": "i64"},
          HAS_BOUNDARY=hb)
for align in (True, False):   # mode align (prefix caching) and none, as the runtime launches them
    build(g._gdn_defer_commit_all_kernel,
          {"state_addrs": "*i64", "state_strides": "*i64", "sk_addrs": "*i64", "sv_addrs": "*i64",
           "sg_addrs": "*i64", "sb_addrs": "*i64", "layer_group": "*i32", "bt_addrs": "*i64",
           "stride_bt_row": "i32", "spec_mask": "*i1", "num_accepted": "*i32", "running_col": "*i32",
           "num_computed": "*i32", "num_scheduled": "*i32", "num_draft": "*i32", "num_rows": "i32",
           "MAXS": "i32", "MAXT": "i32", "block_size": "i32"},
          BLOCK_R=4, STATE_DTYPE=tl.float32, V_DTYPE=tl.bfloat16, HAS_COL=align, ALIGN=align)
'''


def test_kernels_compile_for_sm86(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), TRITON_CACHE_DIR=str(tmp_path / "triton-cache"),
               TRITON_DEFAULT_FP_FUSION="1")
    p = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300,
                       cwd=str(REPO))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("OK ") == 5, p.stdout
