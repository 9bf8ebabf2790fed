"""Probe (2026-12-03, issue #8): does a first FlashAttention-2 call on this GPU pay a driver PTX JIT?

The sixth and seventh sessions' DFlash2 servers spent 124-149 s in their first drafter step, and the
seventh session's stack dumps put the engine thread inside ``flash_attn_varlen_func`` (the drafter's
non-causal attention) at 45 s and again at 110 s. vLLM logged "Using FlashAttention version 2" on the
H200, and the wheel's FA2 library carries sm_80 cubins only, which an sm_90 GPU cannot run: the driver
must compile the PTX at first use. This probe times first and second calls of the FA2 varlen kernel
(paged KV, bfloat16, causal and non-causal) in this process, and prints why FA3 is not used.
Run it twice with the same CUDA_CACHE_PATH: the second process shows whether the driver's JIT cache
removes the cost. Usage: python3 gpu/probe/fa_jit.py HEAD_DIM [HEAD_DIM ...]
"""
from __future__ import annotations

import os
import sys
import time

import torch


def main(argv: list[str]) -> int:
    from vllm.vllm_flash_attn import flash_attn_interface as fai

    dims = [int(a) for a in argv] or [64]
    cap = torch.cuda.get_device_capability()
    print(f"device sm_{cap[0]}{cap[1]}, torch {torch.__version__}, "
          f"CUDA_CACHE_PATH={os.environ.get('CUDA_CACHE_PATH', '(default ~/.nv/ComputeCache)')}, "
          f"CUDA_CACHE_MAXSIZE={os.environ.get('CUDA_CACHE_MAXSIZE', '(default)')}")
    for v in (2, 3):
        print(f"FA{v} supported: {fai.is_fa_version_supported(v)}; reason: {fai.fa_version_unsupported_reason(v)}")
    dev = torch.device("cuda")
    block, blocks, heads, kv_heads, q_len, k_len = 256, 8, 8, 2, 8, 300
    for d in dims:
        for causal in (False, True):
            q = torch.randn(q_len, heads, d, device=dev, dtype=torch.bfloat16)
            kc = torch.randn(blocks, block, kv_heads, d, device=dev, dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            bt = torch.arange(blocks, device=dev, dtype=torch.int32).view(1, -1)
            cu_q = torch.tensor([0, q_len], device=dev, dtype=torch.int32)
            used = torch.tensor([k_len], device=dev, dtype=torch.int32)
            times = []
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.monotonic()
                fai.flash_attn_varlen_func(q, kc, vc, q_len, cu_q, k_len, seqused_k=used,
                                           causal=causal, block_table=bt, fa_version=2,
                                           softmax_scale=d ** -0.5)
                torch.cuda.synchronize()
                times.append(time.monotonic() - t0)
            print(f"FA2 head_dim {d} causal={causal}: first call {times[0]:.2f} s, second {times[1] * 1e3:.2f} ms",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
