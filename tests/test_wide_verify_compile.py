"""The wide-verify kernels compile for the RTX 3090 (sm_86) at every default launch the runtime
picks, and fit its shared memory, on the CPU.

An sm_86 / sm_89 block may have 99 KiB (101,376 B) of shared memory (an A100 163 KiB, Hopper 227
KiB); a kernel compiled for more fails at its launch on the card (Triton's OutOfResources), which
for the verify path means at the server's first speculative step or CUDA-graph capture. Session 23
found the bf16 default at 128 query rows (a verify block of 9..16 tokens, i.e. DFLASH_TOKENS 8..15
with CTX=fast's bf16 KV) at 104 KiB. This test calls the real wrapper (``wide_verify_attention``,
no tile / warps / stages given, so ``default_launch`` decides as on a GPU with under 200 KiB per block) on CPU
tensors in vLLM's layout, intercepts each launch, and compiles it with Triton's own compiler for
``GPUTarget("cuda", 86, 32)`` (tests/sm86.py: a child process without TRITON_INTERPRET). Nothing runs
on a device.
Shapes: the 27B target (24 query / 4 KV heads x 256, causal) for bf16 / int8 / int4 KV at every
block of query rows (verify blocks of 1..16 tokens), and the DFlash2 drafter's own attention (32 /
8 x 128, non-causal block of 8 or 16) for bf16 / int8; and int8 / int4 with ``flat_words=True``
(VERIFY_FLAT_WORDS=1) at blocks of 1 and 16 tokens; and int8 with ``qk_int8=True``
(VERIFY_QK_INT8=1: the int8 Q.K^T dot) for the target at 1 and 16 tokens and the drafter's block.
"""
from __future__ import annotations

import pytest

from tests.sm86 import SM86_SHARED, compile_rows

_BODY = r'''
from onecard.kernels import wide_verify as wv
from onecard.kernels.reference import paged_views

gen = torch.Generator().manual_seed(0)
NAMES = ("_wide_verify_split_kernel", "_wide_verify_reduce_kernel", "_rht_rows_kernel")


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


def run(name, hq, hkv, d, kv, q_len, causal, **kw):
    a = case(hq, hkv, d, kv, q_len)
    out = a.pop("out")
    compile_calls(f"{name} {kv} q{q_len}", wv, NAMES, lambda: wv.wide_verify_attention(
        a.pop("q"), a.pop("key_cache"), a.pop("value_cache"), out, causal=causal, **kw, **a))


for kv in ("bf16", "int8", "int4"):
    for q_len in (1, 2, 4, 5, 8, 9, 16):      # every block of query rows (block_q 2, 2, 4, 8, 8, 16, 16)
        run("target", 24, 4, 256, kv, q_len, True)
for kv in ("bf16", "int8"):
    for q_len in (8, 16):
        run("drafter", 32, 8, 128, kv, q_len, False)
# VERIFY_FLAT_WORDS=1 on a 3090 (the A/B the knob exists for): the flat load at the defaults
for kv in ("int8", "int4"):
    for q_len in (1, 16):
        run("target-flat", 24, 4, 256, kv, q_len, True, flat_words=True)
# VERIFY_QK_INT8=1 on a 3090: the int8 Q.K^T dot (IMMA) at the defaults
for q_len in (1, 16):
    run("target-qk8", 24, 4, 256, "int8", q_len, True, qk_int8=True)
run("drafter-qk8", 32, 8, 128, "int8", 16, False, qk_int8=True)
'''


def test_default_launches_fit_an_rtx_3090(tmp_path):
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    rows = compile_rows(_BODY, tmp_path)
    for r in rows:
        name, r["kv"], q = r["case"].split()
        r["q_len"], r["case"] = int(q[1:]), name
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"_wide_verify_split_kernel", "_wide_verify_reduce_kernel", "_rht_rows_kernel"}, kernels
    assert {(r["case"], r["kv"]) for r in rows if r["kernel"] == "_wide_verify_split_kernel"} == {
        ("target", "bf16"), ("target", "int8"), ("target", "int4"), ("drafter", "bf16"), ("drafter", "int8"),
        ("target-flat", "int8"), ("target-flat", "int4"), ("target-qk8", "int8"), ("drafter-qk8", "int8")}
    over = [r for r in rows if r["shared"] > SM86_SHARED]
    assert not over, over
    # the case that did not fit before: 128 query rows x 256, bf16 KV
    big = [r for r in rows if r["kernel"] == "_wide_verify_split_kernel" and r["case"] == "target"
           and r["kv"] == "bf16" and r["q_len"] >= 9]
    assert big and all(r["launch"]["num_stages"] == 1 for r in big), big


def test_default_launch_decides_on_shared_memory_not_architecture(monkeypatch):
    """Hopper / B200 (232,448 B per block) get the deep pipelines; an RTX 3090 / 4090 / 5090 (101,376
    B: sm_120 is newer than Hopper but has a 3090's shared memory) and an A100 (166,912) the
    small launches the test above compiles; the CPU interpreter those too."""
    torch = pytest.importorskip("torch")
    from onecard.kernels import wide_verify as wv

    cuda = torch.device("cuda", 0)
    for shared, deep in ((232_448, True), (166_912, False), (101_376, False)):
        monkeypatch.setattr(wv, "block_shared", lambda device, s=shared: s)
        assert wv.default_launch(0, 128, 256, cuda) == ((32, 8, 4) if deep else (32, 8, 1))
        assert wv.default_launch(2, 128, 256, cuda) == ((16, 8, 4) if deep else (16, 8, 2))
        assert wv.default_launch(4, 64, 256, cuda) == ((16, 8, 4) if deep else (16, 8, 1))
    monkeypatch.undo()
    assert wv.block_shared(torch.device("cpu")) == 0
    assert wv.default_launch(0, 128, 256, torch.device("cpu")) == (32, 8, 1)


def test_default_head_split_only_where_it_was_measured(monkeypatch):
    """head_split 2 is the default for int4 verify blocks of 9..16 tokens (128 rows x 256) on a GPU
    with Hopper's shared memory (-20 % twice on the H100, sessions 24 and 25); bf16 / int8, q <= 8
    and the small-shared-memory launches (untimed with it) keep 1, and an explicit value wins."""
    torch = pytest.importorskip("torch")
    from onecard.kernels import wide_verify as wv

    cuda = torch.device("cuda", 0)
    for shared, deep in ((232_448, True), (166_912, False), (101_376, False)):
        monkeypatch.setattr(wv, "block_shared", lambda device, s=shared: s)
        assert wv.default_head_split(4, 128, 256, cuda) == (2 if deep else 1)
        assert wv.default_head_split(4, 64, 256, cuda) == 1  # q <= 8
        assert wv.default_head_split(2, 128, 256, cuda) == 1 and wv.default_head_split(0, 128, 256, cuda) == 1
    monkeypatch.undo()
    assert wv.default_head_split(4, 128, 256, torch.device("cpu")) == 1
