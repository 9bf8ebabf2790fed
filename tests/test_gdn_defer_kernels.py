"""Deferred GDN commit kernels (onecard/kernels/gdn_defer.py) vs vLLM's stock spec-decode kernel
and a float64 reference, under Triton's CPU interpreter.

The stock kernel is vLLM 0.27.1's ``fused_sigmoid_gating_delta_rule_update``. vLLM replaces
Triton by a placeholder when no GPU driver is active, so the stock file is executed a second
time under a private module name with real (interpreted) Triton behind ``vllm.triton_utils``.

Tiny shapes (H=2 key heads, HV=4 value heads, K/V 16..64); fresh random inputs per test from the
seed the ``gen`` fixture prints; 2-4 ragged sequences.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from tests.interpret import child_rerun, enable, inproc_mark

_PREIMPORTED = enable()  # before the first `import triton` (tests/interpret.py)

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
_stock_mod = pytest.importorskip("vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating")


def _load_stock():
    """The stock file, run again with Triton itself as ``vllm.triton_utils``."""
    shim = types.ModuleType("vllm.triton_utils")
    shim.triton, shim.tl = triton, triton.language
    saved = sys.modules.get("vllm.triton_utils")
    sys.modules["vllm.triton_utils"] = shim
    try:
        spec = importlib.util.spec_from_file_location("_onecard_test_stock_fsg", _stock_mod.__file__)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        if saved is None:
            sys.modules.pop("vllm.triton_utils", None)
        else:
            sys.modules["vllm.triton_utils"] = saved
    return mod.fused_sigmoid_gating_delta_rule_update


if _PREIMPORTED:
    gd = STOCK = None
else:
    from onecard.kernels import gdn_defer as gd
    STOCK = _load_stock()

inproc = inproc_mark(_PREIMPORTED)


test_in_child_process = child_rerun(__file__, _PREIMPORTED)


H, HV = 2, 4
TIGHT = 1e-6            # defer vs stock: the same fp32 operations (observed: bitwise)
REF_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # vs float64, by output / state dtype
I32 = torch.int32


class Case:
    """Inputs of one verify step: ragged sequences `lens`, q/k/v/a/b in `dtype`."""

    def __init__(self, gen, lens, K, V, dtype):
        self.lens, self.K, self.V, self.dtype = list(lens), K, V, dtype
        T = sum(lens)
        self.N = len(lens)
        self.q = torch.randn(1, T, H, K, generator=gen).to(dtype)
        self.k = torch.randn(1, T, H, K, generator=gen).to(dtype)
        self.v = torch.randn(1, T, HV, V, generator=gen).to(dtype)
        a = torch.randn(T, HV, generator=gen)
        a[T - 1, 1] = 24.0  # softplus past the threshold (x returned as is)
        self.a = a.to(dtype)
        self.b = torch.randn(T, HV, generator=gen).to(dtype)
        self.A_log = torch.empty(HV).uniform_(-1.5, 0.5, generator=gen)
        self.dt_bias = torch.randn(HV, generator=gen) * 0.5
        self.cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=I32)

    def args(self):
        return (self.A_log, self.a, self.b, self.dt_bias, self.q, self.k, self.v)

    def scratch(self, max_seqs=None, max_tokens=16):
        sc = gd.DeferScratch(max_seqs or self.N, max_tokens, H, HV, self.K, self.V, self.dtype, "cpu")
        for t in (sc.k, sc.v, sc.g, sc.beta):
            t.fill_(float("nan"))  # poison: every row a test reads must have been written
        return sc


def _pool(gen, num_blocks, K, V, dtype=torch.float32):
    return torch.randn(num_blocks, HV, V, K, generator=gen).to(dtype)


def _stock(c, pool, idx, num_accepted):
    o, _ = STOCK(*c.args(), initial_state=pool, inplace_final_state=True, cu_seqlens=c.cu,
                 ssm_state_indices=idx, num_accepted_tokens=num_accepted,
                 use_qk_l2norm_in_kernel=True)
    return o


def _verify(c, pool, idx, scratch):
    return gd.gdn_defer_verify(*c.args(), initial_state=pool, cu_seqlens=c.cu,
                               ssm_state_indices=idx, scratch=scratch)


def _reference(c, pool, idx, **kw):
    return gd.gdn_defer_reference_verify(*c.args(), initial_state=pool, cu_seqlens=c.cu,
                                         ssm_state_indices=idx, **kw)


def _err(x, want):
    """max |x - want| over the max of 1 and |want| (want's finite entries)."""
    x, want = x.double(), want.double()
    return ((x - want).abs().max() / want.abs().max().clamp_min(1.0)).item()


def _same(x, y):
    """Bitwise equality (NaN payloads included)."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}
    return x.dtype == y.dtype and torch.equal(x.view(ints[x.dtype]), y.view(ints[y.dtype]))


def _seq_rows(c, n):
    return slice(int(c.cu[n]), int(c.cu[n + 1]))


def _check_outputs(c, o, o_stock, o_ref, seed, skip=()):
    assert o.shape == o_stock.shape and o.dtype == o_stock.dtype
    worst_s = worst_r = 0.0
    for n in range(c.N):
        if n in skip or not c.lens[n]:
            continue
        rows = _seq_rows(c, n)
        worst_s = max(worst_s, _err(o[0, rows], o_stock[0, rows]))
        worst_r = max(worst_r, _err(o[0, rows], o_ref[0, rows]))
    print(f"outputs {c.dtype}: max rel err vs stock {worst_s:.3g}, vs float64 {worst_r:.3g}")
    assert worst_s <= TIGHT, f"vs stock {worst_s:.4g} (seed {seed})"
    assert worst_r <= REF_TOL[c.dtype], f"vs float64 {worst_r:.4g} (seed {seed})"
    return worst_s, worst_r


def _spec_layout(N, C):
    """Block ids for the stock kernel: sequence n owns blocks 1 + n*C .. (n+1)*C (0 is null)."""
    return (1 + torch.arange(N * C, dtype=I32)).reshape(N, C)


def _defer_indices(running, C, poison_block):
    """[N, C] indices for verify: column 0 the running block, other columns a NaN block that
    must never be read."""
    idx = torch.full((len(running), C), poison_block, dtype=I32)
    idx[:, 0] = torch.as_tensor(running, dtype=I32)
    return idx


CASES = {
    # name: (lens, K, V)
    "k3-ragged": ([4, 1, 3], 16, 16),
    "k7-ragged-V64": ([8, 2, 5, 1], 32, 64),   # V=64: two value blocks (BV=32)
    "16-tokens": ([16, 3], 32, 32),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _stock_and_defer_pools(gen, c, state_dtype=torch.float32):
    """A stock pool with separate column blocks and a defer pool whose running block of each
    sequence holds the same initial state as the stock column-0 block; returns
    (stock_pool, stock_idx, defer_pool, defer_idx)."""
    C = max(c.lens)
    s_idx = _spec_layout(c.N, C)
    nb = 1 + c.N * C
    s_pool = _pool(gen, nb, c.K, c.V, state_dtype)
    d_pool = s_pool.clone()
    d_pool[-1] = float("nan")  # the poison block of the defer indices' other columns
    d_idx = _defer_indices(s_idx[:, 0], C, nb - 1)
    # the last sequence's column 0 must not be the poison block
    assert int(s_idx[-1, 0]) != nb - 1 or C == 1
    return s_pool, s_idx, d_pool, d_idx


# ---------------------------------------------------------------------------------------------
@inproc
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_verify_matches_stock_and_reference(name, dtype, gen):
    lens, K, V = CASES[name]
    c = Case(gen, lens, K, V, DTYPES[dtype])
    s_pool, s_idx, d_pool, d_idx = _stock_and_defer_pools(gen, c)
    o_ref = _reference(c, s_pool.clone(), s_idx)
    o_stock = _stock(c, s_pool, s_idx, torch.ones(c.N, dtype=I32))
    o = _verify(c, d_pool, d_idx, c.scratch())
    _check_outputs(c, o, o_stock, o_ref, gen.initial_seed())


@inproc
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_verify_writes_no_state_and_fills_scratch(dtype, gen):
    c = Case(gen, [5, 2, 7], 32, 64, DTYPES[dtype])
    pool = _pool(gen, 1 + c.N, c.K, c.V)
    before = pool.clone()
    idx = torch.arange(1, c.N + 1, dtype=I32)[:, None].repeat(1, 3).contiguous()
    sc = c.scratch(max_seqs=c.N + 1, max_tokens=8)
    _verify(c, pool, idx, sc)
    assert torch.equal(pool, before), "verify wrote state"
    ref = c.scratch(max_seqs=c.N + 1, max_tokens=8)
    _reference(c, before.clone(), idx, scratch=ref)
    seed = gen.initial_seed()
    for n, T_n in enumerate(c.lens):
        assert torch.equal(sc.v[n, :T_n], ref.v[n, :T_n]), f"raw v of seq {n} (seed {seed})"
        for name in ("k", "g", "beta"):
            got, want = getattr(sc, name)[n, :T_n], getattr(ref, name)[n, :T_n]
            assert _err(got, want) <= 1e-6, f"{name} of seq {n}: {_err(got, want):.3g} (seed {seed})"
        for t in (sc.k, sc.v, sc.g, sc.beta):  # rows past the sequence: untouched
            assert torch.isnan(t[n, T_n:].float()).all()
    for t in (sc.k, sc.v, sc.g, sc.beta):  # the unused spec slot
        assert torch.isnan(t[c.N].float()).all()


@inproc
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_commit_matches_stock_column(name, dtype, gen):
    lens, K, V = CASES[name]
    c = Case(gen, lens, K, V, DTYPES[dtype])
    s_pool, s_idx, d_pool, d_idx = _stock_and_defer_pools(gen, c)
    _, states = _reference(c, s_pool.clone(), s_idx, return_states=True)
    _stock(c, s_pool, s_idx, torch.ones(c.N, dtype=I32))
    sc = c.scratch()
    _verify(c, d_pool, d_idx, sc)
    acc = [int(torch.randint(1, T_n + 1, (1,), generator=gen)) for T_n in c.lens]
    perm = torch.randperm(c.N, generator=gen).to(I32)  # batch rows in another order than specs
    rows = dict(row_to_spec=perm, num_accepted=torch.tensor(acc, dtype=I32)[perm.long()],
                running_block=d_idx[perm.long(), 0].contiguous(), num_rows=c.N)
    ref_pool = d_pool.double()
    gd.gdn_defer_reference_commit(ref_pool, sc, **rows)
    gd.gdn_defer_commit(d_pool, sc, **rows)
    seed = gen.initial_seed()
    worst_s = worst_r = worst_rc = 0.0
    bitwise = True
    for n in range(c.N):
        got = d_pool[int(d_idx[n, 0])]
        want = s_pool[int(s_idx[n, acc[n] - 1])]
        bitwise &= torch.equal(got, want)
        worst_s = max(worst_s, _err(got, want))
        worst_r = max(worst_r, _err(got, states[n][acc[n] - 1]))
        worst_rc = max(worst_rc, _err(got, ref_pool[int(d_idx[n, 0])]))
    print(f"commit {dtype} a={acc}: vs stock {worst_s:.3g} (bitwise {bitwise}), vs float64 "
          f"{worst_r:.3g}, vs reference commit {worst_rc:.3g}")
    assert worst_s <= TIGHT, f"vs stock {worst_s:.4g} (seed {seed})"
    assert worst_r <= REF_TOL[torch.float32] and worst_rc <= REF_TOL[torch.float32], seed
    assert not torch.isnan(d_pool[:-1]).any()  # all but the NaN poison block


@inproc
def test_commit_bf16_state(gen):
    c = Case(gen, [3, 6, 1], 32, 32, torch.bfloat16)
    s_pool, s_idx, d_pool, d_idx = _stock_and_defer_pools(gen, c, state_dtype=torch.bfloat16)
    _, states = _reference(c, s_pool.clone(), s_idx, return_states=True)
    o_stock = _stock(c, s_pool, s_idx, torch.ones(c.N, dtype=I32))
    sc = c.scratch()
    o = _verify(c, d_pool, d_idx, sc)
    assert _err(o, o_stock) <= TIGHT
    acc = [3, 4, 1]
    gd.gdn_defer_commit(d_pool, sc, row_to_spec=torch.arange(c.N, dtype=I32),
                        num_accepted=torch.tensor(acc, dtype=I32),
                        running_block=d_idx[:, 0].contiguous(), num_rows=c.N)
    for n in range(c.N):
        got = d_pool[int(d_idx[n, 0])]
        e_s = _err(got, s_pool[int(s_idx[n, acc[n] - 1])])
        e_r = _err(got, states[n][acc[n] - 1])
        print(f"bf16 state seq {n}: vs stock {e_s:.3g}, vs float64 {e_r:.3g}")
        assert e_s <= TIGHT and e_r <= REF_TOL[torch.bfloat16], (n, e_s, e_r, gen.initial_seed())


@inproc
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_multi_step_matches_stock(dtype, gen):
    """4 steps: stock with 1 + k blocks per sequence and num_accepted_tokens fed back, defer with
    one block per sequence and a commit after each step."""
    N, kmax, K, V = 3, 7, 16, 32
    C = kmax + 1
    s_idx = _spec_layout(N, C)
    nb = 1 + N * C + 1
    s_pool = _pool(gen, nb, K, V)
    d_pool = s_pool.clone()
    d_pool[nb - 1] = float("nan")
    running = s_idx[:, 0].clone()
    d_idx = _defer_indices(running, C, nb - 1)
    ref_pool = s_pool.double()
    prev_acc = torch.ones(N, dtype=I32)
    seed = gen.initial_seed()
    worst = 0.0
    for step in range(4):
        lens = [int(x) for x in torch.randint(1, C + 1, (N,), generator=gen)]
        c = Case(gen, lens, K, V, DTYPES[dtype])
        # float64 chain of the defer scheme (reference verify + states from the ref pool)
        o_ref, states = _reference(c, ref_pool, d_idx, return_states=True)
        o_stock = _stock(c, s_pool, s_idx, prev_acc)
        sc = c.scratch(max_tokens=C)
        o = _verify(c, d_pool, d_idx, sc)
        w_s, _ = _check_outputs(c, o, o_stock, o_ref, seed)
        worst = max(worst, w_s)
        acc = torch.tensor([int(torch.randint(1, T_n + 1, (1,), generator=gen)) for T_n in lens], dtype=I32)
        gd.gdn_defer_commit(d_pool, sc, row_to_spec=torch.arange(N, dtype=I32), num_accepted=acc,
                            running_block=running, num_rows=N)
        for n in range(N):
            ref_pool[int(running[n])] = states[n][int(acc[n]) - 1]
        prev_acc = acc
    for n in range(N):
        got = d_pool[int(running[n])]
        want = s_pool[int(s_idx[n, int(prev_acc[n]) - 1])]
        e_s, e_r = _err(got, want), _err(got, ref_pool[int(running[n])])
        print(f"final state seq {n}: vs stock {e_s:.3g} (bitwise {torch.equal(got, want)}), vs float64 {e_r:.3g}")
        assert e_s <= TIGHT and e_r <= REF_TOL[torch.float32], (n, e_s, e_r, seed)


@inproc
def test_boundary_store(gen):
    c = Case(gen, [6, 4, 8], 16, 32, torch.float32)
    s_pool, s_idx, d_pool, d_idx = _stock_and_defer_pools(gen, c)
    _stock(c, s_pool, s_idx, torch.ones(c.N, dtype=I32))
    sc = c.scratch()
    _verify(c, d_pool, d_idx, sc)
    spare = torch.tensor([int(s_idx[n, 1]) for n in range(c.N)], dtype=I32)  # free blocks
    base = d_pool.clone()
    running = d_idx[:, 0].contiguous()
    acc = torch.tensor([int(torch.randint(1, T_n + 1, (1,), generator=gen)) for T_n in c.lens], dtype=I32)
    bcount = torch.tensor([int(torch.randint(1, int(a) + 1, (1,), generator=gen)) for a in acc], dtype=I32)
    gd.gdn_defer_commit(d_pool, sc, row_to_spec=torch.arange(c.N, dtype=I32), num_accepted=acc,
                        running_block=running, num_rows=c.N, boundary_count=bcount,
                        boundary_block=spare)
    touched = set(running.tolist()) | set(spare.tolist())
    for n in range(c.N):
        assert torch.equal(d_pool[int(running[n])], s_pool[int(s_idx[n, int(acc[n]) - 1])]), n
        assert torch.equal(d_pool[int(spare[n])], s_pool[int(s_idx[n, int(bcount[n]) - 1])]), n
    for blk in range(d_pool.shape[0]):
        if blk not in touched:
            assert _same(d_pool[blk], base[blk]), blk

    # no extra store: boundary block == running block, <= 0, or a count outside 1..a
    d_pool.copy_(base)
    acc = torch.tensor([3, 2, 5], dtype=I32)
    gd.gdn_defer_commit(d_pool, sc, row_to_spec=torch.arange(c.N, dtype=I32), num_accepted=acc,
                        running_block=running, num_rows=c.N,
                        boundary_count=torch.tensor([2, 1, 6], dtype=I32),
                        boundary_block=torch.tensor([int(running[0]), 0, int(spare[2])], dtype=I32))
    d_pool2 = base.clone()
    gd.gdn_defer_commit(d_pool2, sc, row_to_spec=torch.arange(c.N, dtype=I32), num_accepted=acc,
                        running_block=running, num_rows=c.N,
                        boundary_count=torch.tensor([2, 1, 2], dtype=I32),
                        boundary_block=torch.tensor([-1, int(running[1]), 0], dtype=I32))
    for pool in (d_pool, d_pool2):
        for n in range(c.N):
            assert torch.equal(pool[int(running[n])], s_pool[int(s_idx[n, int(acc[n]) - 1])]), n
        for blk in range(pool.shape[0]):
            if blk not in set(running.tolist()):
                assert _same(pool[blk], base[blk]), blk


@inproc
def test_padded_rows_and_null_blocks_are_skipped(gen):
    c = Case(gen, [3, 2, 4, 1], 16, 16, torch.float32)
    s_pool, s_idx, d_pool, d_idx = _stock_and_defer_pools(gen, c)
    s_idx[2, 0] = 0   # sequence 2: a padded entry in both layouts (stock reads column a-1 = 0)
    d_idx[2, 0] = 0
    o_ref = _reference(c, s_pool.clone(), s_idx)
    o_stock = _stock(c, s_pool, s_idx, torch.ones(c.N, dtype=I32))
    sc = c.scratch(max_seqs=5)
    base = d_pool.clone()
    o = _verify(c, d_pool, d_idx, sc)
    assert _same(d_pool, base), "verify wrote state"
    _check_outputs(c, o, o_stock, o_ref, gen.initial_seed(), skip=(2,))
    for t in (sc.k, sc.v, sc.g, sc.beta):
        assert torch.isnan(t[2].float()).all(), "scratch of a skipped sequence written"
    # rows: 0 -> seq 1; 1 padded (-1); 2 -> seq 0; 3 -> seq 3 with running block 0 (skipped);
    # 4 -> seq 2 with running block 0; entries past num_rows=5 look valid but must be skipped
    n_real = 5
    row_to_spec = torch.tensor([1, -1, 0, 3, 2, 3, 3], dtype=I32)
    running = torch.tensor([int(d_idx[1, 0]), int(d_idx[0, 0]), int(d_idx[0, 0]), 0, 0,
                            int(d_idx[3, 0]), int(d_idx[3, 0])], dtype=I32)
    acc = torch.tensor([2, 1, 3, 1, 1, 1, 1], dtype=I32)
    gd.gdn_defer_commit(d_pool, sc, row_to_spec=row_to_spec, num_accepted=acc,
                        running_block=running, num_rows=n_real)
    for n, a in ((1, 2), (0, 3)):
        assert torch.equal(d_pool[int(d_idx[n, 0])], s_pool[int(s_idx[n, a - 1])]), n
    changed = {int(d_idx[0, 0]), int(d_idx[1, 0])}
    for blk in range(d_pool.shape[0] - 1):  # all but the NaN poison block
        assert not torch.isnan(d_pool[blk]).any(), blk
        if blk not in changed:
            assert _same(d_pool[blk], base[blk]), blk
    assert _same(d_pool[0], base[0])  # the null block


@inproc
def test_strided_pool_with_padded_block_stride(gen):
    c = Case(gen, [4, 7, 2], 32, 32, torch.bfloat16)
    C, K, V = 7, c.K, c.V
    nb = 1 + c.N * C
    page = HV * V * K + 96
    raw = torch.full((nb, page), 7.0)
    raw[:, : HV * V * K] = torch.randn(nb, HV * V * K, generator=gen)

    def view(t):
        return t.as_strided((nb, HV, V, K), (page, V * K, K, 1))

    s_raw, d_raw = raw.clone(), raw.clone()
    s_pool, d_pool = view(s_raw), view(d_raw)
    assert d_pool.stride(0) == page > HV * V * K
    s_idx = _spec_layout(c.N, C)
    o_ref, states = _reference(c, s_pool.clone(), s_idx, return_states=True)
    o_stock = _stock(c, s_pool, s_idx, torch.ones(c.N, dtype=I32))
    sc = c.scratch()
    o = _verify(c, d_pool, s_idx, sc)
    assert torch.equal(d_raw, raw), "verify wrote the pool"
    _check_outputs(c, o, o_stock, o_ref, gen.initial_seed())
    acc = torch.tensor([4, 5, 1], dtype=I32)
    bnd = torch.tensor([int(s_idx[n, C - 1]) for n in range(c.N)], dtype=I32)
    bcount = torch.tensor([2, 5, 1], dtype=I32)  # row 2: count == a == 1
    gd.gdn_defer_commit(d_pool, sc, row_to_spec=torch.arange(c.N, dtype=I32), num_accepted=acc,
                        running_block=s_idx[:, 0].contiguous(), num_rows=c.N,
                        boundary_count=bcount, boundary_block=bnd)
    for n in range(c.N):
        assert torch.equal(d_pool[int(s_idx[n, 0])], s_pool[int(s_idx[n, int(acc[n]) - 1])]), n
        assert torch.equal(d_pool[int(bnd[n])], s_pool[int(s_idx[n, int(bcount[n]) - 1])]), n
    assert (d_raw[:, HV * V * K:] == 7.0).all(), "padding between blocks written"


@inproc
def test_long_sequence_clamped_to_max_tokens(gen):
    """Sequences longer than scratch.max_tokens (only the static bound is checked on the host):
    outputs stay exact, tokens past max_tokens are not saved (the next spec slot's rows stay
    untouched), and a commit of more than max_tokens tokens stops at max_tokens."""
    c = Case(gen, [6, 2, 7], 16, 16, torch.float32)   # 15 tokens <= 4 slots * 4
    s_pool, s_idx, d_pool, d_idx = _stock_and_defer_pools(gen, c)
    o_ref = _reference(c, s_pool.clone(), s_idx)
    o_stock = _stock(c, s_pool, s_idx, torch.ones(c.N, dtype=I32))
    sc = c.scratch(max_seqs=4, max_tokens=4)
    o = _verify(c, d_pool, d_idx, sc)
    _check_outputs(c, o, o_stock, o_ref, gen.initial_seed())
    ref = c.scratch(max_seqs=4, max_tokens=4)
    _reference(c, s_pool.clone(), d_idx, scratch=ref)
    for t in ("k", "v", "g", "beta"):
        got, want = getattr(sc, t), getattr(ref, t)
        assert _err(got[:3].nan_to_num(9.0), want[:3].nan_to_num(9.0)) <= 1e-6, t
        assert torch.isnan(got[1, 2:].float()).all() and torch.isnan(got[3].float()).all(), t
    base = d_pool.clone()
    for a in (4, 6):
        d_pool.copy_(base)
        gd.gdn_defer_commit(d_pool, sc, row_to_spec=torch.tensor([0, 2], dtype=I32),
                            num_accepted=torch.tensor([a, a + 1], dtype=I32),
                            running_block=d_idx[[0, 2], 0].contiguous(), num_rows=2)
        for n in (0, 2):
            assert torch.equal(d_pool[int(d_idx[n, 0])], s_pool[int(s_idx[n, 3])]), (n, a)


@inproc
def test_host_bounds_raise_value_error(gen):
    c = Case(gen, [2, 1, 3], 16, 16, torch.float32)
    pool = _pool(gen, 4, c.K, c.V)
    idx = torch.arange(1, 4, dtype=I32)[:, None]
    with pytest.raises(ValueError, match="3 sequences exceed scratch.max_seqs=2"):
        _verify(c, pool, idx, c.scratch(max_seqs=2, max_tokens=8))
    with pytest.raises(ValueError, match=r"6 tokens exceed scratch.max_seqs \* scratch.max_tokens=3"):
        _verify(c, pool, idx, c.scratch(max_seqs=3, max_tokens=1))
    with pytest.raises(ValueError, match="scratch.v is"):
        _verify(c, pool, idx, gd.DeferScratch(3, 8, H, HV, 16, 16, torch.bfloat16, "cpu"))
    sc = c.scratch()
    with pytest.raises(ValueError, match=">= num_rows=3"):
        gd.gdn_defer_commit(pool, sc, row_to_spec=torch.zeros(2, dtype=I32),
                            num_accepted=torch.ones(3, dtype=I32),
                            running_block=torch.ones(3, dtype=I32), num_rows=3)
    assert "\n" not in str(pytest.raises(ValueError, _verify, c, pool, idx,
                                         c.scratch(max_seqs=2)).value)


@inproc
def test_scratch_size_and_no_value_specialization():
    sc = gd.DeferScratch(3, 5, H, HV, 32, 16, torch.bfloat16, "cpu")
    assert sc.k.shape == (3, 5, H, 32) and sc.v.shape == (3, 5, HV, 16)
    assert sc.g.shape == sc.beta.shape == (3, 5, HV) and sc.v.dtype == torch.bfloat16
    assert sc.nbytes == sum(t.numel() * t.element_size() for t in (sc.k, sc.v, sc.g, sc.beta))
    assert gd.DeferScratch.nbytes_for(3, 5, H, HV, 32, 16, 2) == sc.nbytes
    for kernel, name in ((gd._gdn_defer_verify_kernel, "MAXT"), (gd._gdn_defer_commit_kernel, "num_rows")):
        dns = getattr(kernel, "do_not_specialize", None)
        if dns is None:  # the interpreter's wrapper: read the jit options it keeps
            dns = (getattr(kernel, "kwargs", None) or {}).get("do_not_specialize")
        assert dns is not None and name in [getattr(kernel, "arg_names", [None])[d]
                                            if isinstance(d, int) else d for d in dns]
