"""Deferred GDN commit kernels (onecard/kernels/gdn_defer.py) vs vLLM's stock spec-decode kernel
and a float64 reference, under Triton's CPU interpreter.

The per-layer commit ``gdn_defer_commit``, the torch ``boundary()`` rule and the float64
references are test oracles in tests/gdn_defer_oracle.py (not shipped into vLLM); the shipped
one-launch ``gdn_defer_commit_all`` is held to them bitwise.

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
    gd = rt = oracle = STOCK = None
else:
    from onecard.kernels import gdn_defer as gd
    from onecard.kernels import gdn_defer_runtime as rt
    from tests import gdn_defer_oracle as oracle  # the per-layer commit, boundary(), float64 refs
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
    return oracle.gdn_defer_reference_verify(*c.args(), initial_state=pool, cu_seqlens=c.cu,
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
    oracle.gdn_defer_reference_commit(ref_pool, sc, **rows)
    oracle.gdn_defer_commit(d_pool, sc, **rows)
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
    oracle.gdn_defer_commit(d_pool, sc, row_to_spec=torch.arange(c.N, dtype=I32),
                            num_accepted=torch.tensor(acc, dtype=I32),
                            running_block=d_idx[:, 0].contiguous(), num_rows=c.N)
    for n in range(c.N):
        got = d_pool[int(d_idx[n, 0])]
        e_s = _err(got, s_pool[int(s_idx[n, acc[n] - 1])])
        e_r = _err(got, states[n][acc[n] - 1])
        print(f"bf16 state seq {n}: vs stock {e_s:.3g}, vs float64 {e_r:.3g}")
        assert e_s <= TIGHT and e_r <= REF_TOL[torch.bfloat16], (n, e_s, e_r, gen.initial_seed())


@inproc
@pytest.mark.parametrize("dtype,commit", [("fp32", "layer"), ("bf16", "layer"), ("fp32", "all"),
                                          ("bf16", "all")])
def test_multi_step_matches_stock(dtype, commit, gen):
    """4 steps: stock with 1 + k blocks per sequence and num_accepted_tokens fed back, defer with
    one block per sequence and a commit after each step: ``gdn_defer_commit`` per layer, or
    ``gdn_defer_commit_all`` through a plan (batch rows with a non-spec row in the middle, the
    block ids and the prefix-cache boundary looked up on the device: every boundary block must
    hold stock's state after the boundary's token)."""
    N, kmax, K, V = 3, 7, 16, 32
    C = kmax + 1
    s_idx = _spec_layout(N, C)
    BS, NCOL = 3, 12                       # commit_all: cache block size, block-table columns
    nb = 1 + N * C + 1 + 1 + N * (NCOL - 1)  # + poison, the non-spec row's block, spare blocks
    poison = 1 + N * C
    s_pool = _pool(gen, nb, K, V)
    d_pool = s_pool.clone()
    d_pool[poison] = float("nan")
    running = s_idx[:, 0].clone()
    d_idx = _defer_indices(running, C, poison)
    ref_pool = s_pool.double()
    prev_acc = torch.ones(N, dtype=I32)
    seed = gen.initial_seed()
    sc = gd.DeferScratch(N, C, H, HV, K, V, DTYPES[dtype], "cpu")
    if commit == "all":
        # batch rows 0, 2, 3 verify sequences 0, 1, 2; row 1 decodes without drafts (its
        # block, and everything but the running and boundary blocks, must stay untouched)
        rows = [0, 2, 3]
        mask = torch.tensor([True, False, True, True, False])   # padded past num_rows=4
        table = torch.zeros(5, NCOL + 2, dtype=I32)[:, :NCOL]  # padded row stride
        table[1, 0] = poison + 1
        for n, r in enumerate(rows):
            table[r, 0] = running[n]
            table[r, 1:] = poison + 2 + n * (NCOL - 1) + torch.arange(NCOL - 1, dtype=I32)
        plan = gd.CommitPlan([d_pool], [sc], [0], [table])
        computed = [int(x) for x in torch.randint(0, BS + 1, (N,), generator=gen)]
    worst = 0.0
    boundaries = 0
    for step in range(4):
        lens = [int(x) for x in torch.randint(1, C + 1, (N,), generator=gen)]
        c = Case(gen, lens, K, V, DTYPES[dtype])
        # float64 chain of the defer scheme (reference verify + states from the ref pool)
        o_ref, states = _reference(c, ref_pool, d_idx, return_states=True)
        o_stock = _stock(c, s_pool, s_idx, prev_acc)
        for t in (sc.k, sc.v, sc.g, sc.beta):
            t.fill_(float("nan"))
        o = _verify(c, d_pool, d_idx, sc)
        w_s, _ = _check_outputs(c, o, o_stock, o_ref, seed)
        worst = max(worst, w_s)
        acc = torch.tensor([int(torch.randint(1, T_n + 1, (1,), generator=gen)) for T_n in lens], dtype=I32)
        if commit == "layer":
            oracle.gdn_defer_commit(d_pool, sc, row_to_spec=torch.arange(N, dtype=I32), num_accepted=acc,
                                    running_block=running, num_rows=N)
        else:
            before = d_pool.clone()
            per_row = torch.zeros(5, dtype=I32)
            per_row[1] = 3   # the non-spec row's values must be ignored
            nacc, ncomp, nsched, ndraft = (per_row.clone() for _ in range(4))
            for n, r in enumerate(rows):
                nacc[r], ncomp[r], nsched[r], ndraft[r] = int(acc[n]), computed[n], lens[n], lens[n] - 1
            gd.gdn_defer_commit_all(plan, spec_mask=mask, num_accepted=nacc, num_rows=4,
                                    running_col=torch.zeros(5, dtype=I32), num_computed=ncomp,
                                    num_scheduled=nsched, num_draft=ndraft, block_size=BS)
            touched = {int(b) for b in running}
            for n, r in enumerate(rows):
                R = computed[n] + 1
                aligned = (R + int(acc[n]) - 1) // BS * BS
                if aligned >= R and aligned // BS - 1 >= 1:   # column 0 is the running column
                    bblk, cnt = int(table[r, aligned // BS - 1]), aligned - R + 1
                    assert _same(d_pool[bblk], s_pool[int(s_idx[n, cnt - 1])]), (step, n, cnt, seed)
                    touched.add(bblk)
                    boundaries += 1
                computed[n] += int(acc[n])
            for blk in range(nb):
                if blk not in touched:
                    assert _same(d_pool[blk], before[blk]), (step, blk, seed)
        for n in range(N):
            ref_pool[int(running[n])] = states[n][int(acc[n]) - 1]
        prev_acc = acc
    if commit == "all":
        print(f"{boundaries} boundary stores checked")
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
    oracle.gdn_defer_commit(d_pool, sc, row_to_spec=torch.arange(c.N, dtype=I32), num_accepted=acc,
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
    oracle.gdn_defer_commit(d_pool, sc, row_to_spec=torch.arange(c.N, dtype=I32), num_accepted=acc,
                            running_block=running, num_rows=c.N,
                            boundary_count=torch.tensor([2, 1, 6], dtype=I32),
                            boundary_block=torch.tensor([int(running[0]), 0, int(spare[2])], dtype=I32))
    d_pool2 = base.clone()
    oracle.gdn_defer_commit(d_pool2, sc, row_to_spec=torch.arange(c.N, dtype=I32), num_accepted=acc,
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
    oracle.gdn_defer_commit(d_pool, sc, row_to_spec=row_to_spec, num_accepted=acc,
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
    oracle.gdn_defer_commit(d_pool, sc, row_to_spec=torch.arange(c.N, dtype=I32), num_accepted=acc,
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
        oracle.gdn_defer_commit(d_pool, sc, row_to_spec=torch.tensor([0, 2], dtype=I32),
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
        oracle.gdn_defer_commit(pool, sc, row_to_spec=torch.zeros(2, dtype=I32),
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
    for kernel, name in ((gd._gdn_defer_verify_kernel, "MAXT"), (oracle._gdn_defer_commit_kernel, "num_rows"),
                         (gd._gdn_defer_commit_all_kernel, "num_rows")):
        dns = getattr(kernel, "do_not_specialize", None)
        if dns is None:  # the interpreter's wrapper: read the jit options it keeps
            dns = (getattr(kernel, "kwargs", None) or {}).get("do_not_specialize")
        assert dns is not None and name in [getattr(kernel, "arg_names", [None])[d]
                                            if isinstance(d, int) else d for d in dns]


@pytest.mark.parametrize("model", ["27b", "tiny"])
def test_scratch_bytes_equal_the_memory_model(model):
    """The plan's scratch VRAM (onecard.memory.gdn_defer_scratch_bytes) is what the patched GDN
    layers allocate: one DeferScratch(max_num_seqs, 1 + k, H // tp, HV // tp, K, V, model dtype)
    per GDN layer (patch 0085's qwen_gdn_linear_attn edit). No kernel runs here."""
    from collections import defaultdict

    from onecard import memory
    from onecard.kernels.gdn_defer import DeferScratch
    from onecard.prepare import tiny

    if model == "27b":
        geom = memory.QWEN38_27B
    else:
        geom = memory.ModelGeometry.from_config(tiny.make_config(tiny.DEFAULT_SPEC, defaultdict(int)))
    v_dtype = {2: torch.bfloat16, 4: torch.float32}[geom.dtype_bytes]
    for tp in (1, 2):
        H, HV = geom.linear_num_key_heads // tp, geom.linear_num_value_heads // tp
        K, V = geom.linear_key_head_dim, geom.linear_value_head_dim
        for max_seqs, k in ((1, 1), (4, 3), (4, 7), (2, 15), (8, 4)):
            per_layer = DeferScratch.nbytes_for(max_seqs, 1 + k, H, HV, K, V, geom.dtype_bytes)
            got = memory.gdn_defer_scratch_bytes(geom, max_seqs, k, tp=tp)
            assert got == geom.num_gdn * per_layer, (model, tp, max_seqs, k, got, geom.num_gdn * per_layer)
            if tp == 1 and (max_seqs, k) == (4, 7):   # the tensors the layer allocates, once
                sc = DeferScratch(max_seqs, 1 + k, H, HV, K, V, v_dtype, "cpu")
                assert sc.nbytes == per_layer == sum(t.numel() * t.element_size()
                                                     for t in (sc.k, sc.v, sc.g, sc.beta))
    assert memory.gdn_defer_scratch_bytes(geom, 4, 0) == 0   # no speculation: no scratch
    if model == "27b":
        assert memory.gdn_defer_scratch_bytes(geom, 4, 7) == 32_047_104   # memory's docstring figure


# ---------------------------------------------------------------------------------------------
# gdn_defer_commit_all: every layer in one launch, block ids and the boundary on the device
# ---------------------------------------------------------------------------------------------
def _paged_pools(gen, nb, K, V, dtype, pads):
    """One pool per layer, each its own page-padded buffer ([nb, HV*V*K + pad], NaN padding):
    returns (raws, views)."""
    raws, views = [], []
    for pad in pads:
        page = HV * V * K + pad
        raw = torch.full((nb, page), float("nan"), dtype=dtype)
        raw[:, : HV * V * K] = torch.randn(nb, HV * V * K, generator=gen).to(dtype)
        raws.append(raw)
        views.append(raw.as_strided((nb, HV, V, K), (page, V * K, K, 1)))
    return raws, views


def _filled_scratch(gen, max_seqs, max_tokens, K, V, v_dtype):
    """A scratch as a verify leaves it (random normalized keys, values, decays, betas)."""
    sc = gd.DeferScratch(max_seqs, max_tokens, H, HV, K, V, v_dtype, "cpu")
    sc.k.copy_(oracle._ref_l2norm(torch.randn(sc.k.shape, generator=gen)))
    sc.v.copy_(torch.randn(sc.v.shape, generator=gen).to(v_dtype))
    sc.g.copy_(-torch.rand(sc.g.shape, generator=gen))
    sc.beta.copy_(torch.rand(sc.beta.shape, generator=gen))
    return sc


def _commit_per_layer(pools, scratches, groups, tables, *, spec_mask, num_accepted, num_rows,
                      running_col=None, align=None):
    """The second formulation of the commit (tests/gdn_defer_oracle.py): the row -> spec sequence
    map, block-id gathers and oracle.boundary() in torch, then one oracle.gdn_defer_commit per
    layer."""
    n = num_rows
    mask = spec_mask[:n]
    row_to_spec = torch.where(mask, torch.cumsum(mask.to(I32), 0) - 1,
                              torch.full_like(mask, -1, dtype=I32)).to(I32)
    a = num_accepted[:n].to(I32)
    per_group = []
    if align is None:
        cols = torch.zeros(n, dtype=torch.int64) if running_col is None else running_col[:n].to(torch.int64)
        for bt in tables:
            per_group.append((bt[:n].gather(1, cols.clamp(min=0)[:, None])[:, 0].to(I32).contiguous(), None, None))
    else:
        count, col, needs = oracle.boundary(a, align, n)
        src = align.state_idx[:n].to(torch.int64).clamp(min=0).unsqueeze(1)
        dst = col.clamp(min=0).unsqueeze(1)
        for bt in tables:
            rows = bt[:n]
            running = rows.gather(1, src).squeeze(1).to(I32)
            bblk = torch.where(needs, rows.gather(1, dst).squeeze(1), torch.zeros_like(running)).to(I32)
            per_group.append((running, count, bblk))
    for pool, sc, g in zip(pools, scratches, groups):
        running, count, bblk = per_group[g]
        oracle.gdn_defer_commit(pool, sc, row_to_spec=row_to_spec, num_accepted=a, running_block=running,
                                num_rows=n, boundary_count=count, boundary_block=bblk)


def _padded_table(rows, cols, pad=3):
    """An int32 [rows, cols] block table with row stride cols + pad (as a persistent buffer)."""
    return torch.zeros(rows, cols + pad, dtype=I32)[:, :cols]


@inproc
@pytest.mark.parametrize("mode,state", [("none", "fp32"), ("col", "bf16"), ("align", "fp32"), ("align", "bf16")])
def test_commit_all_matches_per_layer_commit(mode, state, gen):
    """4 layers in 2 KV-cache groups (different block tables), each layer its own page-padded
    pool; batch rows with non-spec rows in the middle and at the end. mode none: running block in
    column 0; col: in running_col; align: running_col plus the counts of the boundary rule."""
    K, V, BS = 16, 48, 4                       # V=48: two value blocks, the second one masked
    R_MAX, NCOL, num_rows = 11, 5, 10
    sdt = DTYPES[state]
    groups = [1, 0, 0, 1]
    nb = 1 + 2 * R_MAX * NCOL
    raws, pools = _paged_pools(gen, nb, K, V, sdt, pads=[0, 32, 96, 8])
    scs = [_filled_scratch(gen, 7, 5, K, V, torch.bfloat16) for _ in groups]
    tables = [_padded_table(R_MAX, NCOL), _padded_table(R_MAX, NCOL, pad=3)]
    # distinct block ids in each group (the tables differ), some null entries
    for i, bt in enumerate(tables):
        ids = 1 + torch.randperm(nb - 1, generator=gen)[: R_MAX * NCOL].to(I32)
        bt.copy_(ids.reshape(R_MAX, NCOL))
    spec = [True, False, True, True, False, True, True, True, True, False, True]  # 10: past num_rows
    mask = torch.tensor(spec)
    # per row: (num_computed, num_draft, accepted, running column); scheduled = 1 + draft, so
    # R = computed + 1 tokens in the base state; block size 4
    rows = {
        0: (6, 3, 4, 2),   # aligned 8 >= R=7, dest 1 != 2: boundary mid-run (count 2 of 4)
        1: (5, 3, 3, 2),   # non-spec row with a boundary-looking run: nothing at all
        2: (5, 3, 3, 1),   # aligned 8, dest 1 == running column: the final state is the boundary
        3: (8, 2, 2, 2),   # aligned 8 < R=9: no boundary
        4: (2, 1, 2, 0),   # non-spec
        5: (2, 3, 3, 1),   # aligned 4, dest 0 (count 2): boundary block id 0 in group 0 only
        6: (3, 0, 1, 1),   # aligned 4, dest 0: boundary at the run's last token (count == a == 1)
        7: (7, 3, 2, 2),   # running block id 0 in both groups: skipped
        8: (0, 1, 3, 2),   # scheduled 0, R = -1: new = 1, aligned 0 >= R but dest -1: none
        9: (2, 2, 3, 1),   # non-spec at the end
        10: (6, 3, 4, 2),  # past num_rows
    }
    tables[0][5, 0] = 0
    tables[0][7, 2] = tables[1][7, 2] = 0
    if mode == "none":
        for bt in tables:
            bt[7, 0] = 0
    comp, draft, acc, col = (torch.tensor([rows[r][j] for r in range(R_MAX)], dtype=I32) for j in range(4))
    sched = draft + 1
    sched[8] = 0
    kw = dict(spec_mask=mask, num_accepted=acc, num_rows=num_rows)
    align = None
    if mode != "none":
        kw["running_col"] = col
    if mode == "align":
        align = rt.AlignInputs(state_idx=col, num_scheduled=sched, num_computed=comp, num_draft=draft,
                               block_size=BS)
        count, _, needs = oracle.boundary(acc.clone(), align, num_rows)
        assert needs.tolist() == [True, True, False, False, False, True, True, True, False, True], needs
        assert count[[0, 5, 6]].tolist() == [2, 2, 1]

    want_raws = [r.clone() for r in raws]
    want_pools = [w.as_strided(p.shape, p.stride()) for w, p in zip(want_raws, pools)]
    _commit_per_layer(want_pools, scs, groups, tables, running_col=kw.get("running_col"), align=align,
                      **{k: kw[k] for k in ("spec_mask", "num_accepted", "num_rows")})
    before = [r.clone() for r in raws]
    plan = gd.CommitPlan(pools, scs, groups, tables)
    assert plan.num_layers == 4 and plan.max_reqs == R_MAX and plan.block_r == 16
    extra = {}
    if mode == "align":
        extra = dict(num_computed=comp, num_scheduled=sched, num_draft=draft, block_size=BS)
    gd.gdn_defer_commit_all(plan, **kw, **extra)

    seed = gen.initial_seed()
    c = col if mode != "none" else torch.zeros_like(col)

    def expected(g, spec_rows):
        bt = tables[g]
        blocks = {int(bt[r, int(c[r])]) for r in spec_rows}
        if mode == "align":  # rows 0 and 6 (and 5 in group 1): their boundary blocks
            blocks |= {int(bt[r, d]) for r, d in ((0, 1), (6, 0), (5, 0)) if r in spec_rows}
        return blocks - {0}

    for l, g in enumerate(groups):
        changed = {b for b in range(nb) if not _same(raws[l][b], before[l][b])}
        assert changed == expected(g, [0, 2, 3, 5, 6, 8]), (l, mode, sorted(changed), seed)
        assert _same(raws[l], want_raws[l]), (l, mode, seed)
    # a fresh plan on the same tensors, a shorter batch: rows past num_rows stay untouched
    for r, b in zip(raws, before):
        r.copy_(b)
    gd.gdn_defer_commit_all(gd.CommitPlan(pools, scs, groups, tables), **{**kw, "num_rows": 3}, **extra)
    for l, g in enumerate(groups):
        changed = {b for b in range(nb) if not _same(raws[l][b], before[l][b])}
        assert changed == expected(g, [0, 2]), (l, mode, sorted(changed), seed)


@inproc
def test_commit_all_boundary_rule_equals_runtime(gen):
    """Random align-mode batches: commit_all with the raw counts leaves every pool bitwise as
    the per-layer commit driven by the oracle's boundary() and its gathers (state_idx
    sometimes -1 or equal to the boundary column, null blocks, a boundary column holding the
    running block's id, a > max_tokens, a = 0, R <= 0, more verified rows than
    scratch.max_seqs)."""
    K, V = 16, 32
    R_MAX, NCOL, MAXT = 12, 24, 5
    groups = [0, 1, 1]
    nb = 1 + R_MAX * NCOL
    raws, pools = _paged_pools(gen, nb, K, V, torch.float32, pads=[0, 16, 40])
    scs = [_filled_scratch(gen, 8, MAXT, K, V, torch.float32) for _ in groups]  # spec rows past 8: skipped
    tables = [_padded_table(R_MAX, NCOL, pad=1) for _ in range(2)]
    plan = gd.CommitPlan(pools, scs, groups, tables)
    seed = gen.initial_seed()
    on = off = past = 0
    for trial in range(6):
        for bt in tables:
            bt.copy_((1 + torch.randperm(nb - 1, generator=gen)[: R_MAX * NCOL].to(I32)).reshape(R_MAX, NCOL))
            bt[torch.rand(R_MAX, NCOL, generator=gen) < 0.1] = 0
        bs = [2, 3, 4, 8, 5, 16][trial]
        num_rows = int(torch.randint(R_MAX // 2, R_MAX + 1, (1,), generator=gen))
        mask = torch.rand(R_MAX, generator=gen) < 0.75
        draft = torch.randint(0, MAXT, (R_MAX,), generator=gen, dtype=I32)
        sched = draft + 1 + (torch.rand(R_MAX, generator=gen) < 0.2).to(I32)
        acc = (torch.randint(0, 100, (R_MAX,), generator=gen) % (draft + 2)).to(I32)  # 0..draft+1
        acc[torch.rand(R_MAX, generator=gen) < 0.1] = MAXT + 1
        comp = torch.randint(0, 40, (R_MAX,), generator=gen, dtype=I32)
        # half the rows: an accepted run that reaches a multiple of bs (R = m*bs - j, j < a)
        j = torch.randint(0, 100, (R_MAX,), generator=gen) % acc.clamp(min=1)
        m = torch.randint(1, 40 // bs + 1, (R_MAX,), generator=gen)
        crossing = (m * bs - j - sched + draft).clamp(min=0).to(I32)
        comp = torch.where(torch.rand(R_MAX, generator=gen) < 0.5, crossing, comp)
        neg = torch.rand(R_MAX, generator=gen) < 0.15  # R <= 0 (new < 0: // floors vs truncates)
        comp[neg], sched[neg] = 0, 0
        acc[neg] = torch.randint(1, MAXT + 1, (R_MAX,), generator=gen, dtype=I32)[neg]
        if trial == 0:  # a full batch of verified rows: rows 8.. have no scratch slot
            num_rows, mask[:] = R_MAX, True
            acc.clamp_(min=1)
        running = comp + sched - draft
        dest = (running + acc - 1) // bs * bs // bs - 1
        col = torch.randint(-1, NCOL, (R_MAX,), generator=gen, dtype=I32)
        pick = torch.rand(R_MAX, generator=gen)
        col = torch.where(pick < 0.3, dest.clamp(0, NCOL - 1), col)
        col = torch.where((pick >= 0.3) & (pick < 0.6), ((running - 1) // bs).clamp(0, NCOL - 1), col)
        col[pick >= 0.9] = -1
        assert int(dest.max()) < NCOL
        # some rows hold their running block id in the boundary column too (no boundary store)
        for r in torch.nonzero(torch.rand(R_MAX, generator=gen) < 0.15).flatten().tolist():
            d, cr = max(int(dest[r]), 0), max(int(col[r]), 0)
            for bt in tables:
                bt[r, d] = bt[r, cr]
        align = rt.AlignInputs(state_idx=col, num_scheduled=sched, num_computed=comp, num_draft=draft,
                               block_size=bs)
        _, _, needs = oracle.boundary(acc.clone(), align, num_rows)
        live = mask[:num_rows] & (acc[:num_rows] > 0)
        on += int((needs & live).sum())
        past += int((mask[:num_rows].cumsum(0) > 8)[live].sum())
        off += int((~needs & live).sum())
        base = [r.clone() for r in raws]
        want = [r.clone() for r in raws]
        want_pools = [w.as_strided(p.shape, p.stride()) for w, p in zip(want, pools)]
        _commit_per_layer(want_pools, scs, groups, tables, spec_mask=mask, num_accepted=acc,
                          num_rows=num_rows, align=align)
        gd.gdn_defer_commit_all(plan, spec_mask=mask, num_accepted=acc, num_rows=num_rows,
                                running_col=col, num_computed=comp, num_scheduled=sched,
                                num_draft=draft, block_size=bs)
        for l in range(len(groups)):
            assert _same(raws[l], want[l]), (trial, l, seed)
            assert not _same(raws[l], base[l]) or not live.any(), (trial, l, seed)
    print(f"rows with a boundary {on}, without {off}, past scratch.max_seqs {past}")
    assert on >= 5 and off >= 5 and past >= 1, (on, off, past, seed)


@inproc
def test_commit_plan_value_errors(gen):
    K, V = 16, 16
    pools = [_pool(gen, 5, K, V) for _ in range(2)]
    scs = [gd.DeferScratch(2, 3, H, HV, K, V, torch.float32, "cpu") for _ in range(2)]
    bt = torch.ones(4, 3, dtype=I32)
    plan = gd.CommitPlan(pools, scs, [0, 0], [bt])
    cases = [
        ((pools, scs[:1], [0, 0], [bt]), "2 states, 1 scratches and 2 groups"),
        (([], [], [], [bt]), "no layers"),
        ((pools, scs, [0, 0], []), "no block tables"),
        ((pools, scs, [0, 1], [bt]), r"groups\[1\]=1 is not a block table index"),
        ((pools, [scs[0], gd.DeferScratch(2, 4, H, HV, K, V, torch.float32, "cpu")], [0, 0], [bt]),
         r"scratches\[1\] .* differs from scratches\[0\]"),
        (([pools[0], _pool(gen, 5, K, 32)], scs, [0, 0], [bt]), r"states\[1\]: shape"),
        (([pools[0], pools[1].bfloat16()], scs, [0, 0], [bt]), r"states\[1\] is torch.bfloat16"),
        (([pools[0], pools[1].transpose(2, 3)], scs, [0, 0], [bt]), r"states\[1\]: inner dims"),
        ((pools, scs, [0, 1], [bt, bt.long()]), r"block_tables\[1\] is torch.int64"),
        ((pools, scs, [0, 1], [bt, torch.ones(4, 5, dtype=I32)]), r"block_tables\[1\] strides"),
        ((pools, scs, [0, 1], [bt, bt.t()]), r"block_tables\[1\] strides"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match) as err:
            gd.CommitPlan(*args)
        assert "\n" not in str(err.value) and str(err.value).startswith("CommitPlan: "), err.value
    m = torch.ones(4, dtype=torch.bool)
    a = torch.ones(4, dtype=I32)
    for kw, match in [
        (dict(spec_mask=m[:2], num_accepted=a, num_rows=3), r"spec_mask must be 1-D with >= num_rows=3"),
        (dict(spec_mask=m.to(I32), num_accepted=a, num_rows=3), "spec_mask is torch.int32; bool"),
        (dict(spec_mask=m, num_accepted=a, num_rows=3, running_col=a[:1]), "running_col must be"),
        (dict(spec_mask=m, num_accepted=a, num_rows=3, num_computed=a), "together, or none"),
        (dict(spec_mask=m, num_accepted=a, num_rows=3, num_computed=a, num_scheduled=a, num_draft=a),
         "block_size=0 must be > 0"),
        (dict(spec_mask=torch.ones(8, dtype=torch.bool), num_accepted=torch.ones(8, dtype=I32), num_rows=5),
         "num_rows=5 exceeds the block tables' 4 rows"),
    ]:
        with pytest.raises(ValueError, match=match) as err:
            gd.gdn_defer_commit_all(plan, **kw)
        assert "\n" not in str(err.value), err.value
    gd.gdn_defer_commit_all(plan, spec_mask=m, num_accepted=a, num_rows=0)  # nothing to do
