"""The wide-verify kernels compile for the RTX 3090 (sm_86) at every default launch the runtime
picks, and fit its shared memory, on the CPU.

An sm_86 / sm_89 block may have 99 KiB (101,376 B) of shared memory (an A100 163 KiB, Hopper 227
KiB); a kernel compiled for more fails at its launch on the card (Triton's OutOfResources), which
for the verify path means at the server's first speculative step or CUDA-graph capture. Session 23
found the bf16 default at 128 query rows (a verify block of 9..16 tokens, i.e. DFLASH_TOKENS 8..15
with CTX=fast's bf16 KV) at 104 KiB. This test calls the real wrapper (``wide_verify_attention``,
no tile / warps / stages given, so ``default_launch`` decides as on a GPU of capability 8.x) on CPU
tensors in vLLM's layout, intercepts each launch, and compiles it with Triton's own compiler for
``GPUTarget("cuda", 86, 32)`` (a child process without TRITON_INTERPRET). Nothing runs on a device.
Shapes: the 27B target (24 query / 4 KV heads x 256, causal) for bf16 / int8 / int4 KV at every
block of query rows (verify blocks of 1..16 tokens), and the DFlash2 drafter's own attention (32 /
8 x 128, non-causal block of 8 or 16) for bf16 / int8.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SM86_SHARED = 101_376   # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_86 / sm_89

_CHILD = r'''
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, "scripts")
import wide_verify_sass as W          # the launch capture and Triton's JIT specialization
from onecard.kernels import wide_verify as wv
from onecard.kernels.reference import paged_views

tgt = GPUTarget("cuda", 86, 32)
gen = torch.Generator().manual_seed(0)
seen = set()


def case(hq, hkv, d, kv, q_len, page=64, ctx=256):
    blocks = ctx // page
    padded, cdt = {"bf16": (d, torch.bfloat16), "int8": (d + 4, torch.int8), "int4": (d // 2 + 4, torch.uint8)}[kv]
    cache = torch.zeros(blocks + 1, hkv, page, 2 * padded, dtype=cdt)
    k, v, ks, vs = paged_views(cache, d, kv)
    q = torch.randn(q_len, hq, d, generator=gen).to(torch.bfloat16)
    return dict(q=q, key_cache=k, value_cache=v, out=torch.empty_like(q), kv_mode=kv, k_scale_cache=ks,
                v_scale_cache=vs, cu_seqlens_q=torch.tensor([0, q_len], dtype=torch.int32),
                seq_lens=torch.tensor([ctx], dtype=torch.int32),
                block_table=torch.arange(blocks, dtype=torch.int32)[None], max_query_len=q_len,
                softmax_scale=d ** -0.5, max_seq_len=ctx, num_splits=4)


def run(name, hq, hkv, d, kv, q_len, causal):
    kernels = {n: getattr(wv, n) for n in ("_wide_verify_split_kernel", "_wide_verify_reduce_kernel", "_rht_rows_kernel")}
    caps = {n: W._Capture(k) for n, k in kernels.items()}
    for n, c in caps.items():
        setattr(wv, n, c)
    try:
        a = case(hq, hkv, d, kv, q_len)
        out = a.pop("out")
        wv.wide_verify_attention(a.pop("q"), a.pop("key_cache"), a.pop("value_cache"), out, causal=causal, **a)
    finally:
        for n, k in kernels.items():
            setattr(wv, n, k)
    for n, c in caps.items():
        for grid, args, kwargs in c.calls:
            sig, constexprs, attrs, launch = W._specialize(kernels[n], args, {**kwargs, "DOT_F32": False}
                                                           if n == "_wide_verify_split_kernel" else kwargs)
            key = (n, tuple(sorted(sig.items())), tuple(sorted((k, str(v)) for k, v in constexprs.items())),
                   tuple(sorted(launch.items())))
            if key in seen:
                continue
            seen.add(key)
            k = triton.compile(ASTSource(kernels[n], sig, constexprs, attrs), target=tgt, options=launch)
            assert k.asm.get("cubin"), (name, n)
            print("ROW" + json.dumps({"case": name, "kernel": n, "kv": kv, "q_len": q_len,
                                      "launch": launch, "shared": k.metadata.shared}), flush=True)


for kv in ("bf16", "int8", "int4"):
    for q_len in (1, 2, 4, 5, 8, 9, 16):      # every block of query rows (block_q 2, 2, 4, 8, 8, 16, 16)
        run("target", 24, 4, 256, kv, q_len, True)
for kv in ("bf16", "int8"):
    for q_len in (8, 16):
        run("drafter", 32, 8, 128, kv, q_len, False)
'''


def test_default_launches_fit_an_rtx_3090(tmp_path):
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), TRITON_DEFAULT_FP_FUSION="1")
    p = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=900,
                       cwd=str(REPO))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(x[3:]) for x in p.stdout.splitlines() if x.startswith("ROW")]
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"_wide_verify_split_kernel", "_wide_verify_reduce_kernel", "_rht_rows_kernel"}, kernels
    assert {(r["case"], r["kv"]) for r in rows if r["kernel"] == "_wide_verify_split_kernel"} == {
        ("target", "bf16"), ("target", "int8"), ("target", "int4"), ("drafter", "bf16"), ("drafter", "int8")}
    over = [r for r in rows if r["shared"] > SM86_SHARED]
    assert not over, over
    # the case that did not fit before: 128 query rows x 256, bf16 KV
    big = [r for r in rows if r["kernel"] == "_wide_verify_split_kernel" and r["case"] == "target"
           and r["kv"] == "bf16" and r["q_len"] >= 9]
    assert big and all(r["launch"]["num_stages"] == 1 for r in big), big
