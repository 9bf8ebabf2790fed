#!/usr/bin/env python3
"""Shared memory of vLLM's kernel_unified_attention prefill launches (patch 0083,
ONECARD_PREFILL_LAUNCH), compiled for a CUDA capability on a machine without a GPU: which
launches fit an RTX 3090 (sm86: 101,376 bytes per block) at the 27B's attention shape (24 q / 4 kv
heads, head_dim 256, pages of 1,552), int8 per-token-head and bf16 caches. Nothing runs: Triton
compiles each variant for the named target (a stand-in driver answers the target) and the
compiled kernel's metadata gives its shared memory.

  PYTHONPATH=<patched vLLM site>:<repo> python3 scripts/prefill_launch_smem.py 86 stock,64:32:8:2,...

Prints one line per (dtype, launch). Compiled with this machine's Triton, which may pipeline
differently from the Triton a 3090 runs: an estimate; the patch's fallback covers a miss.
"""
import sys
import torch
from triton.backends.compiler import GPUTarget
import triton.runtime as R
import triton.backends as _tb

if len(sys.argv) != 3 or not sys.argv[1].isdigit():
    sys.exit("usage: prefill_launch_smem.py CAPABILITY(e.g. 86) LAUNCHES(comma list); valid launches: "
             "stock or BLOCK_M:TILE:WARPS:STAGES")
CAP = int(sys.argv[1])
for _name, _b in _tb.backends.items():
    if _b.driver is not None:
        _b.driver.is_active = staticmethod(lambda n=_name: n == "nvidia")


class FakeDriver:
    def get_current_target(self):
        return GPUTarget("cuda", CAP, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


R.driver.set_active(FakeDriver())
import vllm.v1.attention.ops.triton_unified_attention as U
from vllm.v1.kv_cache_interface import KVQuantMode

compiled = {}


def launcher(kernel, grid, key):
    def run(**kw):
        k = kernel.warmup(grid=grid, **kw)
        compiled["k"] = k
        return k
    return run


U._onecard_launcher = launcher
NQ, NKV, HS, PAGE = 24, 4, 256, 1552
nb = 4
for dtype in ("int8", "bf16"):
    for launch in sys.argv[2].split(","):
        U.ONECARD_PREFILL_LAUNCH = U.onecard_parse_prefill_launch(launch)
        q = torch.zeros(128, NQ, HS, dtype=torch.bfloat16)
        o = torch.empty_like(q)
        kw = {}
        if dtype == "int8":
            kc = torch.zeros(nb, PAGE, NKV, HS, dtype=torch.int8)
            ks = torch.zeros(nb, PAGE, NKV)
            kw = dict(kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD, k_scale_cache=ks, v_scale_cache=ks)
        else:
            kc = torch.zeros(nb, PAGE, NKV, HS, dtype=torch.bfloat16)
        cu = torch.tensor([0, 128], dtype=torch.int32)
        sl = torch.tensor([3000], dtype=torch.int32)
        bt = torch.arange(nb, dtype=torch.int32)[None]
        try:
            U.unified_attention(q=q, k=kc, v=kc, out=o, cu_seqlens_q=cu, max_seqlen_q=128, seqused_k=sl,
                                max_seqlen_k=3000, softmax_scale=HS ** -0.5, causal=True, window_size=(-1, -1),
                                block_table=bt, softcap=0, q_descale=None, k_descale=None, v_descale=None, **kw)
            k = compiled["k"]
            md = k.metadata
            print(f"sm{CAP} {dtype:5s} {launch:12s} shared {md.shared:7d} B  warps {md.num_warps} stages {md.num_stages}"
                  f"  {'fits' if md.shared <= 101376 else 'DOES NOT FIT'} 101,376", flush=True)
        except Exception as e:
            print(f"sm{CAP} {dtype:5s} {launch:12s} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
