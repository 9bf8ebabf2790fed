"""Wide-verify kernel on CUDA at the real geometry (24 q / 4 kv heads, head_dim 256) vs the
float64 reference: bf16 / int8 / int4 KV, ragged q_len 1..16, pages 16 and 544, 1 / auto / 7 /
20 splits, the lazy-rescale option; plain decode batches (WIDE_DECODE=1); the DFlash2 drafter's
non-causal block (32 q / 8 kv x 128).
Run on the GPU host: python3 -m pytest -m gpu tests/gpu/test_wide_verify_kernel.py"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("page", [16, 544])
@pytest.mark.parametrize("splits,lazy", [(1, False), (None, False), (7, False), (20, False),
                                         (None, True), (7, True)])
def test_kernel_matches_reference_on_gpu(kv_dtype, page, splits, lazy):
    from onecard.kernels.reference import make_verify_case
    from onecard.kernels.wide_verify import wide_verify_attention

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = make_verify_case(
        q_lens=[16, 9, 1, 2], seq_lens=[700, 1100, 37, 545], num_q_heads=24, num_kv_heads=4,
        head_dim=256, block_size=page, kv_dtype=kv_dtype, device="cuda", generator=gen)
    out = torch.full_like(case.q, float("nan"))
    wide_verify_attention(
        case.q, case.key_cache, case.value_cache, out, cu_seqlens_q=case.cu_seqlens_q,
        seq_lens=case.seq_lens, block_table=case.block_table, max_query_len=case.max_query_len,
        softmax_scale=case.softmax_scale, kv_mode=kv_dtype, k_scale_cache=case.k_scale_cache,
        v_scale_cache=case.v_scale_cache, max_seq_len=case.max_seq_len, num_splits=splits,
        lazy_rescale=lazy)
    torch.cuda.synchronize()
    ref = case.reference()
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)
    assert err <= 3e-2, f"rel err {err:.4g} seed {gen.initial_seed()}"


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("splits", [1, None, 33])
def test_plain_decode_batch_on_gpu(kv_dtype, splits):
    """WIDE_DECODE=1's batches: every sequence one query token (max_query_len 1), the 27B geometry,
    vLLM's int8 page of 1584 tokens, contexts from one page to several."""
    from onecard.kernels.reference import make_verify_case
    from onecard.kernels.wide_verify import wide_verify_attention

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = make_verify_case(
        q_lens=[1, 1, 1, 1], seq_lens=[9000, 1, 1584, 3170], num_q_heads=24, num_kv_heads=4,
        head_dim=256, block_size=1584, kv_dtype=kv_dtype, device="cuda", generator=gen)
    out = torch.full_like(case.q, float("nan"))
    wide_verify_attention(
        case.q, case.key_cache, case.value_cache, out, cu_seqlens_q=case.cu_seqlens_q,
        seq_lens=case.seq_lens, block_table=case.block_table, max_query_len=1,
        softmax_scale=case.softmax_scale, kv_mode=kv_dtype, k_scale_cache=case.k_scale_cache,
        v_scale_cache=case.v_scale_cache, max_seq_len=case.max_seq_len, num_splits=splits)
    torch.cuda.synchronize()
    ref = case.reference()
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)
    assert err <= 3e-2, f"rel err {err:.4g} seed {gen.initial_seed()}"


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("splits", [1, None])
def test_drafter_block_non_causal_on_gpu(kv_dtype, splits):
    """The published 27B DFlash2 drafter's attention: 32 q / 8 kv heads x 128, a non-causal block
    of 8 rows per request over the context (page 1616 = the int8 block of CTX=long k=7)."""
    from onecard.kernels.reference import make_verify_case
    from onecard.kernels.wide_verify import wide_verify_attention

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = make_verify_case(
        q_lens=[8, 8], seq_lens=[3300, 40], num_q_heads=32, num_kv_heads=8, head_dim=128,
        block_size=1616, kv_dtype=kv_dtype, device="cuda", generator=gen)
    out = torch.full_like(case.q, float("nan"))
    wide_verify_attention(
        case.q, case.key_cache, case.value_cache, out, cu_seqlens_q=case.cu_seqlens_q,
        seq_lens=case.seq_lens, block_table=case.block_table, max_query_len=case.max_query_len,
        softmax_scale=case.softmax_scale, kv_mode=kv_dtype, k_scale_cache=case.k_scale_cache,
        v_scale_cache=case.v_scale_cache, max_seq_len=case.max_seq_len, num_splits=splits,
        causal=False)
    torch.cuda.synchronize()
    ref = case.reference(causal=False)
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)
    assert err <= 3e-2, f"rel err {err:.4g} seed {gen.initial_seed()}"


def test_decode_at_smollm2_geometry_with_poison_on_gpu():
    """Session 30: an int4 SmolLM2 server (9 q / 3 kv heads, head_dim 64) returned a NaN
    log-probability while greedy decoding ran on this kernel. The probe's decode check on CUDA:
    one- and four-token launches with the server's defaults for bf16 / int8 / int4 at that geometry
    and the model's, ragged contexts up to 2,047, NaN scales and 0xFF codes past every end and in
    every unowned block; each must match the float64 reference with no NaN."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu" / "lib"))
    import verify_probe

    rows = verify_probe.decode_check(torch.device("cuda"), torch.Generator().manual_seed(30))
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad[:4]
