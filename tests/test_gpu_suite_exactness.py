"""CPU tests of the GPU suite's exactness rule (ulp derivation, near-tie judgement, report) and
of the 128-residue prompt builder (with the tiny model's tokenizer built here)."""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _lib():
    spec = importlib.util.spec_from_file_location("gpu_suite_lib", REPO / "tests/gpu/gpu_suite_lib.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_suite_lib", mod)
    spec.loader.exec_module(mod)
    return mod


lib = _lib()


# ------------------------------------------------------------------------------ ulp

@pytest.mark.parametrize("dtype,int_dtype", [("bfloat16", "int16"), ("float16", "int16"),
                                             ("float32", "int32")])
def test_ulp_matches_the_format_grid(dtype, int_dtype):
    """ulp(x) is the distance from x to the next representable value of the format (torch)."""
    torch = pytest.importorskip("torch")
    tdt, idt = getattr(torch, dtype), getattr(torch, int_dtype)
    rng = random.Random(0)
    values = [rng.uniform(-1, 1) * 2.0 ** rng.randint(-20, 14) for _ in range(400)]
    values += [1.0, 2.0, 0.0625, 7.99, 8.0, 12.0, 15.9, 16.0, -3.0, 1e-3, 6e-5]
    for v in values:
        x = torch.tensor([abs(v)], dtype=torch.float32).to(tdt)
        if x.item() == 0 or not torch.isfinite(x).all():
            continue
        nxt = (x.view(idt) + 1).view(tdt)
        spacing = nxt.double().item() - x.double().item()
        assert lib.ulp(x.item(), dtype) == spacing, (dtype, v, x.item())
        assert lib.ulp(-x.item(), dtype) == spacing


def test_ulp_known_values_and_errors():
    assert lib.ulp(1.0) == 2.0 ** -7
    assert lib.ulp(12.0) == 0.0625            # the H200 near-ties: 1 bf16 ulp at |logit| 8..16
    assert lib.ulp(8.0) == 0.0625 and lib.ulp(7.999) == 0.03125
    assert lib.ulp(1.0, "float32") == 2.0 ** -23
    assert lib.ulp(0.0) == 2.0 ** (-126 - 7)   # subnormal spacing
    assert lib.ulp(1e-40, "float32") == 2.0 ** (-126 - 23)
    with pytest.raises(ValueError, match="valid: bfloat16, float16, float32"):
        lib.ulp(1.0, "fp8")
    with pytest.raises(ValueError, match="non-finite"):
        lib.ulp(float("inf"))


# ------------------------------------------------------------------------------ judge

def _top(*pairs):
    return [(t, v) for t, v in pairs]


def test_top_entries_parse_openai_entries():
    entry = {"token_id:7": -0.5, "token_id:3": -0.25, "token_id:9": -3.0, "token_id:1": None}
    assert lib.top_entries(entry) == [(3, -0.25), (7, -0.5), (9, -3.0)]
    assert lib.top2(entry) == [(3, -0.25), (7, -0.5)]
    assert lib.top2({"token_id:4": 2.0}) == [(4, 2.0)]
    assert lib.top_entries(None) == [] and lib.top2(None) == []
    assert lib.TOP_K >= 3


def test_identical_and_length():
    assert lib.judge([1, 2, 3], [1, 2, 3], None, "bfloat16").accepted
    d = lib.judge([1, 2, 3], [1, 2], None, "bfloat16")
    assert not d.accepted and d.position == 2 and "length" in d.why


def test_near_tie_within_two_ulps_is_accepted_and_reported():
    ref, got = [5, 6, 7, 8], [5, 6, 9, 1]
    tops = [_top((5, 3.0), (1, 1.0)), _top((6, 3.0), (1, 1.0)), _top((7, 12.0), (9, 11.9375)), []]
    d = lib.judge(ref, got, tops, "bfloat16")
    assert d.accepted and d.position == 2 and d.gap == 0.0625 and d.gap_ulps == 1.0
    assert d.ulp == 0.0625 and "near-tie" in d.why
    # two ulps: still a tie; an exact tie (gap 0): accepted
    tops[2] = _top((7, 12.0), (9, 11.875))
    assert lib.judge(ref, got, tops, "bfloat16").gap_ulps == 2.0
    assert lib.judge(ref, got, tops, "bfloat16").accepted
    tops[2] = _top((7, 12.0), (9, 12.0))
    assert lib.judge(ref, got, tops, "bfloat16").accepted


def test_gap_beyond_two_ulps_fails_and_ulp_follows_the_magnitude():
    ref, got = [7], [9]
    assert not lib.judge(ref, got, [_top((7, 12.0), (9, 11.8125))], "bfloat16").accepted  # 3 ulps
    # The same 0.0625 gap is 1 ulp at |logit| 12 but 4 ulps at |logit| 2.5: fails there.
    d = lib.judge(ref, got, [_top((7, 2.5), (9, 2.4375))], "bfloat16")
    assert not d.accepted and d.gap_ulps == 4.0 and "> 2 bfloat16 ulps" in d.why
    # Negative logits: the magnitude, not the sign, sets the ulp.
    assert lib.judge(ref, got, [_top((7, -12.0), (9, -12.0625))], "bfloat16").accepted


def test_three_way_tie_within_two_ulps_is_accepted():
    """The H200 failures of 2026-12-02 (prompt 119: gap 0; prompt 107: gap 0.0625 = 1 ulp): the
    chosen token was off's third, tied with its first two. A tie, whatever the rank."""
    top = _top((2964, 12.0), (3389, 12.0), (2647, 12.0), (5, 10.0))
    d = lib.judge([2964], [2647], [top], "bfloat16")
    assert d.accepted and d.got_rank == 3 and d.gap == 0.0 and d.gap_ulps == 0.0
    top = _top((3821, 12.0), (2049, 12.0), (3116, 11.9375), (5, 11.0))
    d = lib.judge([3821], [3116], [top], "bfloat16")
    assert d.accepted and d.got_rank == 3 and d.gap_ulps == 1.0 and "rank 3" in d.why
    # rank 5 of 8, still 2 ulps below the top: a tie; any order of the entries
    top = _top((9, 11.875), (1, 12.0), (2, 11.9375), (3, 11.9375), (4, 11.9375), (6, 11.0),
               (7, 10.0), (8, 9.0))
    d = lib.judge([1], [9], [top], "bfloat16")
    assert d.accepted and d.got_rank == 5 and d.gap_ulps == 2.0 and d.top_k == 8


def test_chosen_token_outside_off_top_k_fails_with_rank_beyond_k():
    top = _top((7, 12.0), (9, 12.0), (3, 12.0), (4, 11.9375), (5, 11.9375), (6, 11.9375),
               (8, 11.875), (2, 11.875))
    d = lib.judge([7], [11], [top], "bfloat16")
    assert not d.accepted and d.got_rank == "> 8" and d.got_logit is None and d.gap is None
    assert "not among SPEC=off's top 8" in d.why and "rank > 8" in d.why
    lines, bad = lib.summarize("k", {0: d})
    assert bad == [0]
    assert lines[1] == ("  FAIL prompt 0 position 0: off token 7, got 11 (rank > 8 in off's top "
                        "8), gap - (- ulps): " + d.why)
    d = lib.judge([7], [4], [_top((7, 12.0), (9, 12.0))], "bfloat16")
    assert not d.accepted and d.got_rank == "> 2"


def test_chosen_token_in_top_k_but_three_ulps_below_the_top_fails():
    top = _top((7, 12.0), (9, 11.9375), (3, 11.875), (4, 11.8125), (5, 11.0))
    d = lib.judge([7], [4], [top], "bfloat16")
    assert not d.accepted and d.got_rank == 4 and d.gap_ulps == 3.0
    assert "> 2 bfloat16 ulps" in d.why
    # the ulp comes from the values, not the rank: 3 ulps at |logit| 2.5 fails too
    d = lib.judge([7], [4], [_top((7, 2.5), (9, 2.5), (4, 2.453125))], "bfloat16")
    assert not d.accepted and d.gap_ulps == 3.0


def test_missing_logits_fail():
    assert not lib.judge([7], [9], None, "bfloat16").accepted
    assert not lib.judge([7], [9], [[]], "bfloat16").accepted


def test_float32_is_strict():
    d = lib.judge([7], [9], [_top((7, 12.0), (9, 12.0))], "float32")
    assert not d.accepted and "strict" in d.why and d.gap == 0.0
    # a three-way exact tie is no allowance either
    d = lib.judge([7], [3], [_top((7, 12.0), (9, 12.0), (3, 12.0))], "float32")
    assert not d.accepted and "strict" in d.why and d.got_rank == 3
    assert lib.judge([7, 1], [7, 1], None, "float32").accepted
    with pytest.raises(ValueError, match="valid: bfloat16, float16, float32"):
        lib.judge([1], [1], None, "bf16")


def test_judge_all_and_summary_table():
    refs = [[1, 2], [3, 4], [5, 6]]
    gots = [[1, 2], [3, 9], [8, 6]]
    tops = [None, [_top((3, 1.0), (0, 0.0)), _top((4, 12.0), (9, 11.9375))],
            [_top((5, 5.0), (8, 1.0))]]
    v = lib.judge_all(refs, gots, tops, "bfloat16", labels=[10, 11, 12])
    lines, bad = lib.summarize("demo", v)
    assert bad == [12]
    assert lines[0] == "demo: 3 compared, 1 identical, 1 near-tie divergence(s) accepted, 1 failing"
    assert lines[1] == "  near-ties (prompt@position gap in ulps): 11@1 1u"
    assert lines[2].startswith("  FAIL prompt 12 position 0: off token 5, got 8 (rank 2 in "
                               "off's top 2), gap 4 (")
    assert lines[2].endswith("gap 4 > 2 bfloat16 ulps (0.0625)")
    many = lib.judge_all([[1]] * 40, [[2]] * 40, [[_top((1, 12.0), (2, 12.0))]] * 40, "bfloat16")
    lines, bad = lib.summarize("many", many, width=60)
    assert not bad and all(len(ln) <= 60 for ln in lines[1:])
    assert sum(ln.count("@0 0u") for ln in lines) == 40
    with pytest.raises(ValueError, match="reference outputs"):
        lib.judge_all(refs, gots[:2], tops, "bfloat16")
    # an accepted tie with a rank beyond 2 says so in the packed list
    v = lib.judge_all([[1]], [[3]], [[_top((1, 12.0), (2, 12.0), (3, 11.9375))]], "bfloat16")
    lines, bad = lib.summarize("r3", v)
    assert not bad and lines[1] == "  near-ties (prompt@position gap in ulps): 0@0 1u r3"


# ------------------------------------------------------------------------------ residues

@pytest.fixture(scope="module")
def tiny_tokenizer():
    pytest.importorskip("tokenizers")
    from onecard.prepare.tiny import DEFAULT_SPEC, build_tokenizer

    return build_tokenizer(DEFAULT_SPEC.vocab)


def test_residue_prompts_cover_all_128_residues(tiny_tokenizer):
    tok = tiny_tokenizer
    enc = lambda t: tok.encode(t, add_special_tokens=False).ids  # noqa: E731
    dec = lambda i: tok.decode(i, skip_special_tokens=False)     # noqa: E731
    prompts = lib.residue_prompts(enc, dec, lib.corpus_text(), base=512, modulus=128)
    assert [r for r, _, _ in prompts] == list(range(128))
    assert {n % 128 for _, _, n in prompts} == set(range(128))
    for r, text, n in prompts:
        assert n == 512 + r and len(enc(text)) == n   # measured with the tokenizer
    heads = {text[:40] for _, text, _ in prompts}
    assert len(heads) >= 120, "prompts should start at different places of the corpus"
    # deterministic
    assert prompts == lib.residue_prompts(enc, dec, lib.corpus_text(), base=512, modulus=128)


def test_residue_prompts_bad_input(tiny_tokenizer):
    enc = lambda t: tiny_tokenizer.encode(t).ids  # noqa: E731
    dec = lambda i: tiny_tokenizer.decode(i)      # noqa: E731
    with pytest.raises(ValueError, match="valid: at least"):
        lib.residue_prompts(enc, dec, "too short", base=512, modulus=128)
    with pytest.raises(ValueError, match="valid: both >= 1"):
        lib.residue_prompts(enc, dec, lib.corpus_text(), base=0)


def test_counter_reads_totals_not_created_timestamps(monkeypatch):
    """The suite's /metrics reader: counter samples, never prometheus_client's _created series."""
    import importlib.util

    monkeypatch.syspath_prepend(str(REPO / "tests/gpu"))
    spec = importlib.util.spec_from_file_location("_suite_c", REPO / "tests/gpu/test_serve_suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    text = "\n".join([
        "# TYPE vllm:prefix_cache_hits counter",
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 416.0',
        'vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7643e+09',
        'vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 4.0',
        'vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 900.0',
        'vllm:spec_decode_num_draft_tokens_created{engine="0"} 1.7643e+09',
    ])
    assert suite.counter(text, "vllm:prefix_cache_hits") == [416.0, 4.0]
    assert suite.counter(text, "vllm:spec_decode_num_draft_tokens") == []
