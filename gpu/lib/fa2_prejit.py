"""Compile FlashAttention-2's kernels for this GPU once, before any server needs them.

Why (measured on the lent H200, 2026-12-03, docs/measurements.md "seventh GPU session"): under the
image's torch 2.11 vLLM 0.27.1's FA3 library does not load (an undefined torch symbol), so vLLM uses
FA2 on the H200, and the wheel's FA2 library carries sm_80 cubins only, which an sm_90 GPU cannot
run: the CUDA driver compiles the PTX of a whole kernel module at its first use. A lone process
spent 107.8 s in its first non-causal head_dim-64 FA2 call (the tiny DFlash2 drafter's), and the
next process, sharing the driver's JIT cache, 0.12 s. Six DFlash2 servers paid 143-149 s each in
their first drafter step, and a warm-first tiny server 126 s in CUDA-graph capture (causal
head_dim 256). On an RTX 3090 (sm_86) the sm_80 cubins run as they are: nothing to compile.

This runs one process per (head_dim, causal) pair, all at once, each calling the FA2 varlen kernel
over paged KV with the shapes a vLLM server uses (decode, speculative verify, prefill; split and
non-split KV), so every module lands in the driver's JIT cache (CUDA_CACHE_PATH, size
CUDA_CACHE_MAXSIZE) before the jobs' servers start. gpu/run.sh starts it at the top of a lease.

  python3 gpu/lib/fa2_prejit.py [--head-dims 64,128,256] [--dtype bfloat16] [--dry-run]
  python3 gpu/lib/fa2_prejit.py --one HEAD_DIM CAUSAL   (one worker; what the parent spawns)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

# (batch, query tokens per sequence, KV tokens per sequence): decode, a verify block of 8 and of 16,
# a batched verify, a short and a long prefill; the long-KV decode rows make FA2 pick split-KV.
SHAPES = ((1, 1, 300), (1, 1, 8192), (4, 1, 8192), (1, 8, 300), (1, 16, 2048), (4, 8, 2048),
          (1, 300, 300), (2, 512, 1024))
HEAD_DIMS = (64, 128, 256)     # tiny drafter, 27B-geometry drafter, both targets (tests/, gpu/jobs/)
DTYPES = ("bfloat16", "float16")
PAGE = 256                     # the probe's page size; a runtime argument, not part of a kernel module


def parse_dims(text: str) -> list[int]:
    try:
        dims = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        dims = []
    if not dims or any(d % 8 or not 32 <= d <= 256 for d in dims):
        raise SystemExit(f"--head-dims {text!r} is not valid; valid: a comma list of multiples of 8 "
                         "in 32..256, e.g. 64,128,256")
    return dims


def worker_argv(dim: int, causal: bool, dtype: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--one", str(dim), "1" if causal else "0",
            "--dtype", dtype]


def plan(dims: list[int], dtype: str) -> list[list[str]]:
    """One worker per (head_dim, causal): the driver JIT-compiles per module, modules differ by
    head_dim, dtype, causality and split-KV, and separate processes compile at once."""
    return [worker_argv(d, c, dtype) for d in dims for c in (False, True)]


def run_one(dim: int, causal: bool, dtype: str) -> int:
    import torch
    from vllm.vllm_flash_attn import flash_attn_interface as fai

    dt = getattr(torch, dtype)
    dev = torch.device("cuda")
    heads, kv_heads = 8, 2
    t_all = time.monotonic()
    for b, q_len, k_len in SHAPES:
        pages = -(-k_len // PAGE)
        q = torch.randn(b * q_len, heads, dim, device=dev, dtype=dt)
        kc = torch.randn(b * pages, PAGE, kv_heads, dim, device=dev, dtype=dt)
        vc = torch.randn_like(kc)
        bt = torch.arange(b * pages, device=dev, dtype=torch.int32).view(b, pages)
        cu_q = torch.arange(0, (b + 1) * q_len, q_len, device=dev, dtype=torch.int32)
        used = torch.full((b,), k_len, device=dev, dtype=torch.int32)
        torch.cuda.synchronize()
        t0 = time.monotonic()
        fai.flash_attn_varlen_func(q, kc, vc, q_len, cu_q, k_len, seqused_k=used, causal=causal,
                                   block_table=bt, fa_version=2, softmax_scale=dim ** -0.5)
        torch.cuda.synchronize()
        dt_s = time.monotonic() - t0
        if dt_s > 1.0:
            print(f"[fa2-prejit] head_dim {dim} causal={causal} {dtype} b={b} q={q_len} k={k_len}: "
                  f"first call {dt_s:.1f} s (driver JIT)", flush=True)
    print(f"[fa2-prejit] head_dim {dim} causal={causal} {dtype}: done in {time.monotonic() - t_all:.1f} s",
          flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--dry-run", action="store_true", help="print the workers, start none")
    ap.add_argument("--one", nargs=2, metavar=("HEAD_DIM", "CAUSAL"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.dtype not in DTYPES:
        raise SystemExit(f"--dtype {a.dtype!r} is not valid; valid: {', '.join(DTYPES)}")
    if a.one:
        dim = parse_dims(a.one[0])[0]
        if a.one[1] not in ("0", "1"):
            raise SystemExit(f"CAUSAL {a.one[1]!r} is not valid; valid: 0, 1")
        return run_one(dim, a.one[1] == "1", a.dtype)
    workers = plan(parse_dims(a.head_dims), a.dtype)
    print(f"[fa2-prejit] CUDA_CACHE_PATH={os.environ.get('CUDA_CACHE_PATH', '~/.nv/ComputeCache (default)')} "
          f"CUDA_CACHE_MAXSIZE={os.environ.get('CUDA_CACHE_MAXSIZE', '(default)')}; {len(workers)} workers",
          flush=True)
    if a.dry_run:
        for w in workers:
            print(" ".join(w[1:]))
        return 0
    t0 = time.monotonic()
    procs = [subprocess.Popen(w) for w in workers]
    rcs = [p.wait() for p in procs]
    bad = sum(1 for rc in rcs if rc)
    print(f"[fa2-prejit] {len(workers) - bad}/{len(workers)} workers done in {time.monotonic() - t0:.1f} s"
          + (f"; {bad} failed (their servers compile at first use instead)" if bad else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
