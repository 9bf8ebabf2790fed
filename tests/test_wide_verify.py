"""Wide-verify attention kernel vs the float64 reference, under Triton's CPU interpreter.

Tiny shapes (head_dim 32, pages of 16/48 tokens); data drawn fresh per test from a random seed
printed on failure; outputs poisoned with NaN before every call.
"""

from __future__ import annotations


import pytest

from tests.interpret import child_rerun, enable, inproc_mark

_PREIMPORTED = enable()  # before the first `import triton` (tests/interpret.py)

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("vllm.v1.attention.ops.int4_per_token_head")

if _PREIMPORTED:
    ref_mod = wv = None
else:
    from onecard.kernels import reference as ref_mod
    from onecard.kernels import wide_verify as wv

inproc = inproc_mark(_PREIMPORTED)


test_in_child_process = child_rerun(__file__, _PREIMPORTED)


TOL = 3e-2  # bf16 queries/outputs and bf16 P.V operands vs a float64 reference


def _run(case, **kw):
    out = torch.full_like(case.q, float("nan"))
    wv.wide_verify_attention(
        case.q, case.key_cache, case.value_cache, out,
        cu_seqlens_q=case.cu_seqlens_q, seq_lens=case.seq_lens, block_table=case.block_table,
        max_query_len=case.max_query_len, softmax_scale=case.softmax_scale,
        kv_mode=case.kv_dtype, k_scale_cache=case.k_scale_cache,
        v_scale_cache=case.v_scale_cache, max_seq_len=case.max_seq_len, **kw)
    return out


def _check(case, out, seed, causal=True):
    assert not torch.isnan(out).any(), f"unwritten rows (seed {seed})"
    want = case.reference(causal=causal)
    err = (out.double() - want).abs()
    scale = want.abs().amax().clamp_min(1.0)
    assert err.max() <= TOL * scale, (
        f"max err {err.max():.4g} (ref max {want.abs().max():.3g}) seed {seed}")


CASES = {
    # name: (q_lens, seq_lens, heads (q, kv), block_size, num_splits, tile_n)
    "decode-q1-ragged": ([1, 1, 1], [5, 16, 33], (6, 2), 16, 1, 16),
    "q8-block-boundary-splits3": ([8, 3], [48, 21], (6, 2), 16, 3, 16),
    "q16-no-context-group6": ([16], [16], (12, 2), 16, 2, 16),
    "q16-q8-ragged-splits4": ([16, 8], [64, 47], (6, 2), 16, 4, 16),
    "q8-page48-tile32": ([8, 2], [97, 50], (6, 2), 48, 3, 32),
}


def _named_case(name, kv_dtype, gen):
    """A CASES entry as a fresh random case, with its split count and tile."""
    q_lens, seq_lens, (hq, hkv), bs, splits, tile = CASES[name]
    case = ref_mod.make_verify_case(
        q_lens=q_lens, seq_lens=seq_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=32,
        block_size=bs, kv_dtype=kv_dtype, generator=gen)
    return case, splits, tile


# head_split=2 (an opt-in A/B of bench/kernel_verify.py's sweep): the head dim in two halves, two
# Q.K^T dots summed and two P.V accumulators. Every format (int8 / int4 words 0..W/2 hold
# elements 0..D/2), ragged lengths, page / block boundaries, splits, PAGE_TILES (tile divides the
# page) and the per-key path ("q8-page48-tile32": tile 32 in pages of 48), vs float64.
@inproc
@pytest.mark.parametrize("head_split", [1, 2])
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(kv_dtype, name, head_split, gen):
    case, splits, tile = _named_case(name, kv_dtype, gen)
    _check(case, _run(case, num_splits=splits, tile_n=tile, head_split=head_split), gen.initial_seed())


# row_split=2 (an opt-in A/B of bench/kernel_verify.py's sweep): a sequence's query tokens in two
# programs over the same keys. Decode (q=1: the second part reads nothing), q < half the block,
# ragged lengths, splits, both paths (PAGE_TILES and per-key), every format; non-causal (a DFlash
# drafter's block) and head_split=2 on top in the second test.
@inproc
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("name", list(CASES))
def test_row_split_matches_reference(kv_dtype, name, gen):
    case, splits, tile = _named_case(name, kv_dtype, gen)
    _check(case, _run(case, num_splits=splits, tile_n=tile, row_split=2), gen.initial_seed())


@inproc
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_row_split_non_causal_and_head_split(kv_dtype, gen):
    case = ref_mod.make_verify_case(
        q_lens=[16, 5, 9], seq_lens=[70, 21, 40], num_q_heads=6, num_kv_heads=2, head_dim=32,
        block_size=16, kv_dtype=kv_dtype, generator=gen)
    for causal in (True, False):
        for splits in (1, 3):
            out = _run(case, num_splits=splits, tile_n=16, causal=causal, row_split=2, head_split=2)
            _check(case, out, gen.initial_seed(), causal=causal)
    with pytest.raises(ValueError, match="row_split=3 is not valid; valid: 1, 2"):
        _run(case, row_split=3)


def _extreme_codes_case(kv_dtype, gen):
    """Extreme codes in both head halves (byte / nibble order, sign, zero point of each half's
    words), and NaN scales / 0xFF codes in the slots past seq_len that PAGE_TILES reads unmasked."""
    case = ref_mod.make_verify_case(
        q_lens=[3, 1, 7], seq_lens=[21, 5, 50], num_q_heads=4, num_kv_heads=2, head_dim=32,
        block_size=16, kv_dtype=kv_dtype, generator=gen)
    _fill_extreme_codes(case, kv_dtype, gen)
    case.poison_past_the_end(spare_blocks=False)
    return case


# flat_words (session 27): int8 / int4 tiles loaded as one flat vector of words and reshaped in
# registers (no 16-way shared-memory bank conflicts when Triton stages the tile). Both defaults of
# the wrapper are exercised by the other tests; here the explicit True and False on every case
# (PAGE_TILES and the per-key path, which ignores it), head_split 1 and 2, row_split 2 on top,
# non-causal, and the extreme codes with NaN slots past the end.
@inproc
@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("name", list(CASES))
def test_flat_words_matches_reference(kv_dtype, name, flat, gen):
    case, splits, tile = _named_case(name, kv_dtype, gen)
    for head_split in (1, 2):
        out = _run(case, num_splits=splits, tile_n=tile, head_split=head_split, flat_words=flat)
        _check(case, out, gen.initial_seed())


@inproc
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_flat_words_row_split_non_causal_extreme(kv_dtype, gen):
    case = _extreme_codes_case(kv_dtype, gen)
    for causal in (True, False):
        for kw in ({}, {"row_split": 2}, {"head_split": 2, "row_split": 2}):
            out = _run(case, num_splits=3, tile_n=16, causal=causal, flat_words=True, **kw)
            _check(case, out, gen.initial_seed(), causal=causal)


# qk_int8 (session 29; the Hopper default since session 33): Q.K^T as an int8 dot of the row-quantized query with the key
# bytes as stored. Against the float64 reference fed the same quantized query (the kernel's only
# new error is that quantization), and against the plain reference (how far the quantization
# moves the output); head_split 1 / 2, row_split 2, non-causal, and the extreme codes with NaN
# scales and 0xFF bytes in the slots past the end, which the int8 dot reads unmasked.
_PAGE_TILE_CASES = [n for n, c in CASES.items() if c[3] % c[5] == 0]


@inproc
@pytest.mark.parametrize("name", _PAGE_TILE_CASES)
def test_qk_int8_matches_reference(name, gen):
    case, splits, tile = _named_case(name, "int8", gen)
    want_q8 = ref_mod.reference_verify_attention(
        ref_mod.quantize_query_rows_int8(case.q), case.key_cache, case.value_cache,
        cu_seqlens_q=case.cu_seqlens_q, seq_lens=case.seq_lens, block_table=case.block_table,
        softmax_scale=case.softmax_scale, kv_dtype="int8", k_scale_cache=case.k_scale_cache,
        v_scale_cache=case.v_scale_cache)
    # flat words + qk_int8: the Hopper default launch for int8 since session 33
    for kw in ({}, {"head_split": 2}, {"row_split": 2}, {"flat_words": True}):
        out = _run(case, num_splits=splits, tile_n=tile, qk_int8=True, **kw)
        _check(case, out, gen.initial_seed())
        err = (out.double() - want_q8).abs().max()
        assert err <= TOL * want_q8.abs().amax().clamp_min(1.0), (kw, float(err), gen.initial_seed())


@inproc
def test_qk_int8_quantizes_the_query_like_the_reference(gen):
    # one outlier element per query row makes the row's int8 codes coarse: the plain reference is
    # then far off, the quantized-query reference is not (the kernel quantizes exactly so)
    case, splits, tile = _named_case("q16-q8-ragged-splits4", "int8", gen)
    case.q[..., 0] = 40.0 * case.q.abs().amax()
    case.q[..., 1:] *= 8.0  # scores large enough that the coarse codes move the softmax
    want_q8 = ref_mod.reference_verify_attention(
        ref_mod.quantize_query_rows_int8(case.q), case.key_cache, case.value_cache,
        cu_seqlens_q=case.cu_seqlens_q, seq_lens=case.seq_lens, block_table=case.block_table,
        softmax_scale=case.softmax_scale, kv_dtype="int8", k_scale_cache=case.k_scale_cache,
        v_scale_cache=case.v_scale_cache)
    plain = case.reference()
    scale = want_q8.abs().amax().clamp_min(1.0)
    assert (want_q8 - plain).abs().max() > 4 * TOL * scale, "the case does not separate the two"
    for kw in ({}, {"head_split": 2}):
        out = _run(case, num_splits=splits, tile_n=tile, qk_int8=True, **kw)
        err = (out.double() - want_q8).abs().max()
        assert err <= TOL * scale, (kw, float(err), gen.initial_seed())


@inproc
def test_qk_int8_non_causal_extreme_and_bad_input(gen):
    case = _extreme_codes_case("int8", gen)
    for causal in (True, False):
        for kw in ({}, {"head_split": 2, "row_split": 2}):
            out = _run(case, num_splits=3, tile_n=16, causal=causal, qk_int8=True, **kw)
            _check(case, out, gen.initial_seed(), causal=causal)
    with pytest.raises(ValueError, match="qk_int8 is not valid for kv_mode 'int8' with page 16 and "
                                         "tile_n 32; valid: int8 KV with page a multiple of tile_n"):
        _run(case, tile_n=32, qk_int8=True)
    for kv_dtype in ("bf16", "int4"):
        other, _, _ = _named_case("decode-q1-ragged", kv_dtype, gen)
        with pytest.raises(ValueError, match=f"qk_int8 is not valid for kv_mode '{kv_dtype}'"):
            _run(other, qk_int8=True)


@inproc
def test_more_splits_than_tiles_and_auto_splits(gen):
    case = ref_mod.make_verify_case(
        q_lens=[4, 2], seq_lens=[40, 9], num_q_heads=4, num_kv_heads=1, head_dim=32,
        block_size=16, kv_dtype="int8", generator=gen)
    _check(case, _run(case, num_splits=9, tile_n=16), gen.initial_seed())  # empty splits
    _check(case, _run(case, tile_n=16), gen.initial_seed())  # heuristic choice


@inproc
def test_split_count_does_not_change_result(gen):
    case = ref_mod.make_verify_case(
        q_lens=[5], seq_lens=[80], num_q_heads=6, num_kv_heads=2, head_dim=32,
        block_size=16, kv_dtype="bf16", generator=gen)
    a = _run(case, num_splits=1, tile_n=16).float()
    b = _run(case, num_splits=5, tile_n=16).float()
    assert (a - b).abs().max() <= 2e-2 * a.abs().max()


@inproc
def test_quantizers_round_trip(gen):
    x = torch.randn(3, 2, 32, generator=gen)
    d8, s8 = ref_mod.quantize_int8(x)
    assert (ref_mod.dequant_tokens(d8, s8, "int8", 32) - x.double()).abs().max() <= (
        s8.double().max() * 0.51)
    d4, s4 = ref_mod.quantize_int4(x)
    back = ref_mod.dequant_tokens(d4, s4, "int4", 32)
    rel = (back - x.double()).norm() / x.double().norm()
    assert rel < 0.2, rel
    assert torch.allclose(ref_mod.rht_inverse(ref_mod.rht_forward(x)), x.double(), atol=1e-6)


@inproc
def test_paged_views_match_vllm_scale_views(gen):
    # the scale views alias the padding bytes right after each half's data
    kv = torch.zeros(2, 3, 16, 2 * (32 + 4), dtype=torch.int8)
    k, v, ks, vs = ref_mod.paged_views(kv, 32, "int8")
    assert k.shape == (2, 16, 3, 36) and ks.shape == (2, 16, 3)
    ks[1, 5, 2] = 1.5
    raw = kv[1, 2, 5, 32:36].contiguous().view(torch.float32)
    assert raw.item() == 1.5
    vs[0, 7, 1] = -2.0
    assert kv[0, 1, 7, 68:72].contiguous().view(torch.float32).item() == -2.0


@inproc
def test_choose_num_splits():
    assert wv.choose_num_splits(200, 1, 4, 132) == 1
    assert wv.choose_num_splits(131072, 1, 4, 132) == 33  # one wave of 132 SMs
    assert wv.choose_num_splits(131072, 1, 4, 132, waves=2.0) == 64
    assert wv.choose_num_splits(8192, 4, 4, 132) == 8  # 128 programs, 1 wave (9: 144, a 2nd wave)
    assert wv.choose_num_splits(8192, 64, 4, 132) == 1  # more programs than SMs already
    assert wv.choose_num_splits(1000, 1, 4, 82) == 4  # capped by min chunk


@inproc
def test_reduce_launch_buckets_and_no_value_specialization():
    """Few compiles for any split count (a drafter's split count follows the live context): the
    reduce kernel pads to 16 or 64 splits, its warps follow the bucket, and neither kernel is
    specialized on num_splits' value."""
    assert [wv.reduce_launch(n, 256)[0] for n in (2, 3, 9, 16, 17, 33, 64)] == [16, 16, 16, 16, 64, 64, 64]
    assert wv.reduce_launch(65, 256)[0] == 128            # an explicit count above the cap still fits
    assert wv.reduce_launch(3, 256)[1] == 4 and wv.reduce_launch(33, 256)[1] == 8
    assert wv.reduce_launch(33, 128)[1] == 8 and wv.reduce_launch(16, 128)[1] == 4
    for kernel in (wv._wide_verify_split_kernel, wv._wide_verify_reduce_kernel):
        dns = getattr(kernel, "do_not_specialize", None)
        if dns is None:  # the interpreter's wrapper: read the jit options it keeps
            dns = (getattr(kernel, "kwargs", None) or {}).get("do_not_specialize")
        assert dns is not None and "num_splits" in [getattr(kernel, "arg_names", [None])[d]
                                                    if isinstance(d, int) else d for d in dns]


@inproc
def test_more_than_sixteen_splits_match_reference(gen):
    case = ref_mod.make_verify_case(
        q_lens=[3], seq_lens=[400], num_q_heads=4, num_kv_heads=2, head_dim=32,
        block_size=16, kv_dtype="int8", generator=gen)
    _check(case, _run(case, num_splits=20, tile_n=16), gen.initial_seed())   # the 64 bucket


@inproc
def test_bad_input_messages(gen):
    case = ref_mod.make_verify_case(
        q_lens=[2], seq_lens=[20], num_q_heads=2, num_kv_heads=1, head_dim=32,
        block_size=16, kv_dtype="bf16", generator=gen)
    with pytest.raises(ValueError, match="valid: auto, bf16, fp16, int8, int4"):
        _run(case.__class__(**{**case.__dict__, "kv_dtype": "fp8"}))
    with pytest.raises(ValueError, match="valid: 1..16"):
        _run(case.__class__(**{**case.__dict__, "max_query_len": 17}))
    with pytest.raises(ValueError, match="k_scale_cache"):
        _run(case.__class__(**{**case.__dict__, "kv_dtype": "int8"}))


@inproc
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_extreme_codes_unpack_exactly(kv_dtype, gen):
    # every data byte of K and V set to an extreme code (int8: -128, -1, 0, 127; int4 bytes with
    # nibbles 0 / 15), so the word unpacking (byte / nibble order, sign, zero point) is checked
    # at the edges of its range; the reference reads the same cache
    case = ref_mod.make_verify_case(
        q_lens=[6], seq_lens=[37], num_q_heads=4, num_kv_heads=2, head_dim=32,
        block_size=16, kv_dtype=kv_dtype, generator=gen)
    _fill_extreme_codes(case, kv_dtype, gen)
    _check(case, _run(case, num_splits=2, tile_n=16), gen.initial_seed())


def _fill_extreme_codes(case, kv_dtype, gen) -> int:
    """Every data byte of K and V an extreme code; returns the data bytes per row."""
    codes = torch.tensor([0x80, 0xFF, 0x00, 0x7F] if kv_dtype == "int8" else
                         [0x00, 0xFF, 0x0F, 0xF0], dtype=torch.uint8)
    n = 32 if kv_dtype == "int8" else 16
    for half in (case.key_cache, case.value_cache):
        data = half[..., :n].view(torch.uint8)
        data.copy_(codes[torch.randint(0, 4, data.shape, generator=gen)])
    return n


@inproc
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_slots_past_the_end_are_never_used(kv_dtype, gen):
    # int8 / int4 tiles that lie in one page read K/V and scales unmasked (PAGE_TILES): the
    # slots past seq_len in a sequence's last page are read but must not count, whatever they
    # hold. Fill them with NaN scales and extreme codes; tiles of 16 in pages of 16 and 48.
    for bs, tile in ((16, 16), (48, 16)):
        case = ref_mod.make_verify_case(
            q_lens=[3, 1, 7], seq_lens=[21, 5, 50], num_q_heads=4, num_kv_heads=2,
            head_dim=32, block_size=bs, kv_dtype=kv_dtype, generator=gen)
        case.poison_past_the_end(spare_blocks=False)
        for splits in (1, 3):
            _check(case, _run(case, num_splits=splits, tile_n=tile), gen.initial_seed())


@inproc
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
def test_non_causal_block_sees_every_key(kv_dtype, gen):
    # a DFlash drafter's block: 8 rows per sequence, non-causal (every row sees all seq_len keys,
    # its own block included); ragged contexts across page boundaries, 1 and 3 splits. The
    # causal and non-causal results must differ (the mask really changes), and non-causal must
    # match the float64 reference.
    case = ref_mod.make_verify_case(
        q_lens=[8, 8, 8], seq_lens=[8, 29, 70], num_q_heads=8, num_kv_heads=2, head_dim=32,
        block_size=16, kv_dtype=kv_dtype, generator=gen)
    for splits in (1, 3):
        out = _run(case, num_splits=splits, tile_n=16, causal=False)
        _check(case, out, gen.initial_seed(), causal=False)
    causal = _run(case, num_splits=1, tile_n=16)
    assert (causal.float() - out.float()).abs().max() > 1e-2



@inproc
@pytest.mark.parametrize("head_split", [1, 2])  # 2: both accumulators take the same lazy decision
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
def test_lazy_rescale_matches_reference(kv_dtype, head_split, gen):
    # the lazy-rescale option (an A/B of the sweep, off by default): the running max moves only
    # when a row's tile max grows by > 2^8. Keys scaled up page by page (x 2^j, exact for every
    # cache format, int4's zero point included: a power of two leaves the mantissa bits alone) make
    # later tiles dominate, so some tiles rescale and some do not; causal and non-causal, 1 and 3
    # splits, against float64.
    case = ref_mod.make_verify_case(
        q_lens=[8, 3], seq_lens=[130, 61], num_q_heads=6, num_kv_heads=2, head_dim=32,
        block_size=16, kv_dtype=kv_dtype, generator=gen)
    halves = case.k_scale_cache if kv_dtype != "bf16" else case.key_cache
    for s, sl in enumerate(case.seq_lens.tolist()):
        for j in range(-(-sl // 16)):
            halves[int(case.block_table[s, j])] *= 2.0 ** min(j, 4)
    for causal in (True, False):
        for splits in (1, 3):
            _check(case, _run(case, num_splits=splits, tile_n=16, lazy_rescale=True, causal=causal,
                              head_split=head_split), gen.initial_seed(), causal=causal)


@inproc
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
def test_head_split_halves_are_not_swapped(kv_dtype, gen):
    # the two halves of K, V and the output must line up: zero the first half of every K row
    # (codes / values; int4's zero point then gives a constant, still a valid input) and make V's
    # second half large, so a half read from the wrong words, a K half dotted with the wrong Q
    # half or an output half stored at the wrong offset all miss the reference by far; causal and
    # non-causal, 1 and 3 splits, tiles 16 (PAGE_TILES) and 32 in pages of 48 (per-key path).
    for bs, tile in ((16, 16), (48, 32)):
        case = ref_mod.make_verify_case(
            q_lens=[7, 2], seq_lens=[70, 33], num_q_heads=6, num_kv_heads=2, head_dim=32,
            block_size=bs, kv_dtype=kv_dtype, generator=gen)
        if kv_dtype == "bf16":
            case.key_cache[..., :16] = 0
            case.value_cache[..., 16:32] *= 8
        else:
            n = 16 if kv_dtype == "int8" else 8  # bytes of the first half of a row
            case.key_cache[..., :n].view(torch.uint8).fill_(0)
            case.value_cache[..., n:2 * n].view(torch.uint8).fill_(0x7F if kv_dtype == "int8"
                                                                   else 0xF0)
        for causal in (True, False):
            for splits in (1, 3):
                ref1 = _run(case, num_splits=splits, tile_n=tile, causal=causal)
                out = _run(case, num_splits=splits, tile_n=tile, causal=causal, head_split=2)
                _check(case, out, gen.initial_seed(), causal=causal)
                assert (out.float() - ref1.float()).abs().max() <= 2e-2 * max(
                    1.0, ref1.float().abs().max().item())


@inproc
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_head_split_extreme_codes_and_slots_past_the_end(kv_dtype, gen):
    # extreme codes in both halves (byte / nibble order, sign, zero point of each half's words),
    # and NaN scales / 0xFF codes in the slots past seq_len that PAGE_TILES reads unmasked
    case = _extreme_codes_case(kv_dtype, gen)
    for splits in (1, 3):
        _check(case, _run(case, num_splits=splits, tile_n=16, head_split=2), gen.initial_seed())


@inproc
def test_head_split_bad_value(gen):
    case = ref_mod.make_verify_case(
        q_lens=[2], seq_lens=[20], num_q_heads=2, num_kv_heads=1, head_dim=32,
        block_size=16, kv_dtype="int8", generator=gen)
    for bad in (0, 3, 4):
        with pytest.raises(ValueError, match="head_split=.* valid: 1, 2"):
            _run(case, head_split=bad)
