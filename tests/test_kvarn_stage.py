"""KVarN vLLM-integration core: the stage planner + write + attention over several steps
(prefill chunks, decode, speculative verify with rejected drafts, prefix-shared first block),
against a float64 reference of what the cache must represent. Triton interpreter, tiny shapes.
"""

from __future__ import annotations


import pytest

from tests.interpret import child_rerun, enable, inproc_mark

_PREIMPORTED = enable()

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from onecard.kvarn import reference as R  # noqa: E402
from onecard.kvarn import stage as S  # noqa: E402

if _PREIMPORTED:
    K = None
else:
    from onecard.kvarn import kernels as K

inproc = inproc_mark(_PREIMPORTED)
test_in_child_process = child_rerun(__file__, _PREIMPORTED)

PRESET = "k4v2_g64"
T, D, HKV, HQ = 64, 64, 2, 4


class Sim:
    """Two requests over a paged cache, driven step by step like vLLM's model runner."""

    def __init__(self, gen, tiles_per_page=2, num_slots=None, shared_first_page=False,
                 prefill_min_q=None, max_tokens_per_launch=1024, window=2, sinks=1, **prefill_kw):
        if num_slots is None:  # two requests' worth of the read rule's slots, and spares
            num_slots = max(12, 2 * S.SLOTS_PER_SEQ[(window, sinks)] + 2)
        self.g = gen
        self.prefill_min_q = prefill_min_q
        self.max_tokens_per_launch = max_tokens_per_launch
        self.prefill_kw = prefill_kw  # kvarn_prefill knobs (window_tokens, query_group, ...)
        self.tpp = tiles_per_page
        p = R.get_preset(PRESET)
        self.layout = p.layout(D)
        pages = 40
        self.cache = torch.randint(0, 256, (pages * self.tpp, HKV, self.layout.block_bytes),
                                   dtype=torch.uint8, generator=gen)
        self.stage_k = torch.randn(num_slots * T, HKV, D, generator=gen).half()
        self.stage_v = torch.randn(num_slots * T, HKV, D, generator=gen).half()
        perm = torch.randperm(pages - 1, generator=gen) + 1
        self.bt = torch.stack([perm[:10], perm[10:20]]).to(torch.int32)
        if shared_first_page:
            self.bt[1, 0] = self.bt[0, 0]
        self.planner = S.StagePlanner(PRESET, num_slots, tiles_per_page, window=window, sinks=sinks)
        self.k = [torch.zeros(0, HKV, D, dtype=torch.float16) for _ in range(2)]
        self.v = [torch.zeros(0, HKV, D, dtype=torch.float16) for _ in range(2)]
        self.ctx = [0, 0]

    def step(self, rows: list[tuple[int, int, int]]):
        """rows: (request, new context len c (<= committed), q_len). Returns max error."""
        ctx, seq, q0, k_new, v_new = [], [], [], [], []
        n = 0
        for r, c, ql in rows:
            k = (torch.randn(ql, HKV, D, generator=self.g) * 1.5 + 0.3).half()
            v = torch.randn(ql, HKV, D, generator=self.g).half()
            if self.k[r].shape[0] < c:  # a prefix-cache hit on request 0's first page
                self.k[r], self.v[r] = self.k[0][:c].clone(), self.v[0][:c].clone()
            self.k[r] = torch.cat([self.k[r][:c], k])
            self.v[r] = torch.cat([self.v[r][:c], v])
            ctx.append(c)
            seq.append(c + ql)
            q0.append(n)
            n += ql
            k_new.append(k)
            v_new.append(v)
        bt = self.bt[[r for r, _, _ in rows]]
        cols = {i: self.planner.tile_cols(c, s) for i, (c, s) in enumerate(zip(ctx, seq))}
        tb = S.tile_block_ids(bt, cols, self.tpp)
        plan = self.planner.plan(ctx, seq, q0, tb, prefill_min_q=self.prefill_min_q)
        krot = R.rotate(torch.cat(k_new), torch.float32).half()
        vrot = R.rotate(torch.cat(v_new), torch.float32).half()
        S.apply_write(plan, krot, vrot, self.stage_k, self.stage_v, self.cache, PRESET,
                      K.kvarn_pack_rows)
        q = (torch.randn(n, HQ, D, generator=self.g) * 1.2).half()
        qp = q[torch.cat([torch.arange(q0[i], q0[i] + seq[i] - ctx[i]) for i in range(len(rows))])]
        out = torch.full((n, HQ, D), float("nan"))
        self.last_plan = plan
        prefill = lambda *a, **kw: K.kvarn_prefill(*a, **kw, **self.prefill_kw)  # noqa: E731
        S.apply_attention(
            plan, qp, out, self.cache, self.stage_k, self.stage_v,
            block_table=bt[plan.req_index].contiguous(), req_block_table=bt,
            softmax_scale=D ** -0.5, preset=PRESET, tiles_per_page=self.tpp,
            attention_rows=K.kvarn_attention_rows, prefill=prefill,
            max_tokens_per_launch=self.max_tokens_per_launch, key_rot=krot, val_rot=vrot)
        err = 0.0
        for i, (r, c, ql) in enumerate(rows):
            s = c + ql
            ref = self._reference(r, s, q[q0[i]:q0[i] + ql])
            got = out[q0[i]:q0[i] + ql].double()
            assert torch.isfinite(got).all()
            err = max(err, float(((got - ref).abs() / ref.abs().clamp_min(1)).max()))
        return err

    def _reference(self, r, s, q):
        """Float64 attention of the last q.shape[0] positions of request r under the read rule
        (reference.own_tile_attention_f64): the fp16 window (own tile, and the previous one at
        window 2), tile 0 fp16 while its slot lives, other tiles quantized."""
        kr = R.rotate(self.k[r][:s], torch.float32).half()
        vr = R.rotate(self.v[r][:s], torch.float32).half()
        kq, vq = R.quantized_view(kr, vr, PRESET)
        return R.own_tile_attention_f64(q, R.rotate(kr), R.rotate(vr), R.rotate(kq), R.rotate(vq),
                                        T, D ** -0.5, sink=self.live_sinks(r),
                                        window=self.planner.window, sinks=self.planner.sinks)

    def live_sinks(self, r):
        """Leading sink tiles of request r whose slots live (the read rule's sink prefix)."""
        n = 0
        while n < self.planner.sinks and (
                int(self.bt[r, n // self.tpp]) * self.tpp + n % self.tpp) in self.planner.slot_of:
            n += 1
        return n


TOL = 2e-2  # the reference re-quantizes with its own rounding (rare ties differ by one code)


# read rules (fp16 window, sink tiles): the old two and window 3 + two sinks
RULES = [(1, 1), (2, 1), (3, 2)]
WINDOWS = pytest.mark.parametrize("window,sinks", RULES)


@WINDOWS
@inproc
def test_prefill_chunks_decode_and_verify_with_rejections(gen, window, sinks):
    sim = Sim(gen, window=window, sinks=sinks)
    errs = [
        sim.step([(0, 0, 100), (1, 0, 40)]),  # prefill chunk (pseudo-sequences), short prefill
        sim.step([(0, 100, 25), (1, 40, 30)]),  # chunks cross tiles (1 crosses tile 0)
        sim.step([(0, 125, 4), (1, 70, 1)]),  # verify k=3 crossing 128 / decode
        sim.step([(0, 126, 4), (1, 71, 4)]),  # 3 drafts rejected: back below the boundary
        sim.step([(0, 128, 16)]),  # request 1 not scheduled this step
        sim.step([(0, 130, 1), (1, 73, 1)]),  # rollback inside a packed-then-reopened tile
    ]
    assert max(errs) < TOL, errs
    # committed, non-sink tiles released their slots; sinks kept
    live = {b for b in sim.planner.slot_of}
    first = {int(sim.bt[r, j // sim.tpp]) * sim.tpp + j % sim.tpp for r in range(2) for j in range(sinks)}
    assert first <= live and len(live) <= 2 * sinks + (2 + window) * 2


@WINDOWS
@inproc
def test_prefill_jobs_with_decode_and_verify_in_the_batch(gen, window, sinks):
    """Prefill chunks through kvarn_prefill (dequantize once per chunk, windows + LSE merge,
    several query groups), mixed with decode / verify pseudo-sequences in one batch (a prefill
    job between them: launches stay contiguous in the batch), against the same reference."""
    sim = Sim(gen, prefill_min_q=S.MAX_QUERY_LEN + 1, max_tokens_per_launch=8, window=window,
              sinks=sinks, window_tokens=128, query_group=40)
    errs = [sim.step([(0, 0, 100), (1, 0, 40)])]  # two prefill jobs (40 < tile, 100 crosses it)
    assert [j.q_len for j in sim.last_plan.prefill] == [100, 40] and sim.last_plan.seq_lens.numel() == 0
    errs.append(sim.step([(1, 40, 3), (0, 100, 190)]))  # verify, then a prefill from mid-tile
    assert len(sim.last_plan.prefill) == 1 and sim.last_plan.seq_tok0 == [0]
    errs.append(sim.step([(0, 290, 17), (1, 43, 2)]))  # shortest prefill job, then a verify
    assert sim.last_plan.prefill[0].tok0 == 0 and sim.last_plan.seq_tok0 == [17]
    errs.append(sim.step([(1, 45, 16), (0, 307, 1)]))  # 16 queries stay a pseudo-sequence
    assert not sim.last_plan.prefill
    assert max(errs) < TOL, errs


@WINDOWS
@inproc
def test_prefix_shared_first_page(gen, window, sinks):
    sim = Sim(gen, tiles_per_page=1, num_slots=3 + 2 * window, shared_first_page=True, window=window,
              sinks=sinks)
    assert sim.step([(0, 0, 64 + 10)]) < TOL
    # request 1 hits the first page (tile 0) through the prefix cache: starts at 64
    assert sim.step([(1, 64, 20), (0, 74, 1)]) < TOL
    assert sim.step([(0, 75, 3), (1, 84, 2)]) < TOL


def test_planner_evicts_sinks_first():
    p = S.StagePlanner(PRESET, 3)
    a = {(0, t): 10 + t for t in range(4)}
    b = {(0, t): 20 + t for t in range(4)}
    p.plan([0], [T + 1], [0], a)  # A: sink 10 + partial tile 11
    p.plan([0], [5], [0], b)  # B: partial tile 0 (block 20)
    plan = p.plan([5], [T + 2], [0], b)  # B fills tile 0, needs tile 1: A's sink goes
    assert 10 not in p.slot_of and {11, 20, 21} <= set(p.slot_of)
    job, = plan.prefill  # 61 queries: a prefill job (runs > 16 always are)
    assert job.sink_row == p.slot_of[20] * T and job.tail_row == p.slot_of[20] * T  # from 5
    assert (job.ctx, job.seq, job.packed) == (5, T + 2, 1) and plan.seq_lens.numel() == 0
    plan = p.plan([T + 1], [T + 2], [0], a)  # A reads tile 0 packed now
    assert plan.sink_rows.tolist() == [-1] and plan.packed_tiles.tolist() == [1]


def test_planner_errors_and_release():
    p = S.StagePlanner(PRESET, 2, window=2, sinks=1)
    tb = {(0, t): 10 + t for t in range(8)}
    plan = p.plan([0], [T + 5], [0], tb)  # tiles 0 (sink) and 1 (partial)
    assert plan.pack_stage_blocks.tolist() == [10] and set(p.slot_of) == {10, 11}
    with pytest.raises(S.StageExhausted, match="valid:"):
        p.plan([T + 5, 0], [T + 6, 2 * T + 1], [0, 1], {**tb, **{(1, t): 20 + t for t in range(4)}})
    q = S.StagePlanner(PRESET, 3, window=2, sinks=1)
    q.plan([0], [10], [0], tb)
    with pytest.raises(S.StageExhausted, match="evicted"):
        q.plan([10], [11], [0], {(0, 0): 99})  # mid-tile write whose rows were never staged
    assert S.default_num_slots(2, window=2, sinks=1) == 14 and S.default_num_slots(2, window=1, sinks=1) == 10
    # window 3 + two sink tiles (the default since session 17): 2 + 3 + 2 slots per request
    assert S.default_num_slots(2, window=3, sinks=2) == 18 == S.default_num_slots(2)
    assert S.default_num_slots(2, 3, sinks=1) == 16
    with pytest.raises(ValueError, match="valid: 1, 2, 3"):
        S.default_num_slots(2, window=4)
    with pytest.raises(ValueError, match="valid: 1, 2$"):
        S.default_num_slots(2, sinks=3)
    with pytest.raises(ValueError, match="valid: 1, 2, 3"):
        S.StagePlanner(PRESET, 4, window=0)
    with pytest.raises(ValueError, match="sink tiles 0 is not valid"):
        S.StagePlanner(PRESET, 4, sinks=0)


def test_planner_null_page_dummy_runs():
    p = S.StagePlanner(PRESET, 4, tiles_per_page=2)
    tb = {(r, t): t % 2 for r in range(3) for t in range(4)}  # all on page 0 (dummy run)
    plan = p.plan([0, 0, 5], [3, 130, 9], [0, 3, 133], tb, null_page_blocks=2)
    assert not p.slot_of and plan.stage_dst.numel() == 0 and plan.pack_stage_rows.numel() == 0
    assert plan.pack_new_rows.numel() == 0 and set(plan.tail_rows.tolist()) == {-1}
    assert plan.num_tokens == 3 + 130 + 4 and set(plan.sink_rows.tolist()) == {-1}
    assert plan.all_null and not p.plan([0], [3], [0], {(0, 0): 7}, null_page_blocks=2).all_null
    # with prefill jobs: the 130-query run is a job reading its tiles packed, nothing staged
    p = S.StagePlanner(PRESET, 4, tiles_per_page=2)
    plan = p.plan([0, 0, 5], [3, 130, 9], [0, 3, 133], tb, null_page_blocks=2, prefill_min_q=17)
    job, = plan.prefill
    assert (job.req, job.tok0, job.ctx, job.seq, job.packed) == (1, 3, 0, 130, 3)
    assert (job.sink_row, job.tail_row, job.null) == (-1, -1, True) and not p.slot_of
    assert plan.num_tokens == 3 + 130 + 4 and plan.seq_tok0 == [0, 133] and plan.all_null


@pytest.mark.parametrize("window", [1, 2])
def test_planner_prefill_jobs(window):
    p = S.StagePlanner(PRESET, 12, window=window, sinks=1)
    tb = {(r, t): 10 * r + t for r in range(2) for t in range(8)}
    plan = p.plan([0, 0], [3 * T + 5, 40], [0, 3 * T + 5], tb, prefill_min_q=17)
    a, b = plan.prefill
    assert (a.packed, a.sink_row, a.tail_row) == (3, p.slot_of[0] * T, -1)  # own tiles: new rows
    assert (b.packed, b.sink_row, b.tail_row) == (0, -1, -1) and a.prev_row == b.prev_row == -1
    # staged: tile 0 and the tiles a query after s - 16 reads in fp16 (window 2: tile 1 too,
    # the previous tile of tile 2); the others are packed from this step's rows
    if window == 1:
        assert plan.pack_stage_blocks.tolist() == [0, 2] and plan.pack_new_blocks.tolist() == [1]
    else:
        assert plan.pack_stage_blocks.tolist() == [0, 1, 2] and plan.pack_new_blocks.tolist() == []
    assert plan.seq_lens.numel() == 0 and plan.num_tokens == 3 * T + 45
    plan = p.plan([3 * T + 5, 40], [3 * T + 30, 41], [0, 25], tb, prefill_min_q=17)
    assert [j.tok0 for j in plan.prefill] == [0] and plan.seq_tok0 == [25]
    assert plan.prefill[0].packed == 3 and plan.cu_seqlens_q.tolist() == [0, 1]
    assert plan.prefill[0].tail_row == p.slot_of[3] * T  # the first tile's rows before ctx
    # window 2: the tile before ctx's from its slot
    assert plan.prefill[0].prev_row == (p.slot_of[2] * T if window == 2 else -1)
    assert plan.packed_tiles.tolist() == [0] and plan.tail_rows.tolist() == [p.slot_of[10] * T]
    assert plan.prev_rows.tolist() == [-1]
    # a verify block crossing a tile boundary: one pseudo-sequence per tile, each reading its
    # own tile from its slot (the full one too, packed by this step's write); window 2: the
    # previous tile from its slot too (tile 0's slot is the sink)
    p = S.StagePlanner(PRESET, 12, window=window, sinks=1)
    p.plan([0], [2 * T - 3], [0], tb, prefill_min_q=17)
    plan = p.plan([2 * T - 3], [2 * T + 4], [0], tb, prefill_min_q=17)
    assert plan.cu_seqlens_q.tolist() == [0, 3, 7] and plan.seq_lens.tolist() == [2 * T, 2 * T + 4]
    assert plan.pack_stage_blocks.tolist() == [1] and plan.window == window
    assert plan.tail_rows.tolist() == [p.slot_of[1] * T, p.slot_of[2] * T]
    if window == 1:
        assert plan.packed_tiles.tolist() == [1, 2] and plan.prev_rows.tolist() == [-1, -1]
        assert plan.sink_rows.tolist() == [p.slot_of[0] * T] * 2
    else:
        assert plan.packed_tiles.tolist() == [0, 1]
        assert plan.prev_rows.tolist() == [p.slot_of[0] * T, p.slot_of[1] * T]
        assert plan.sink_rows.tolist() == [-1, p.slot_of[0] * T]


def test_planner_window2_keeps_and_releases_the_previous_tile():
    """Window 2: the previous tile's slot lives while a query (up to STAGE_LAST before the
    context) can read it, then is released; when it is gone (a prefix-cache hit past it) the
    tile is read packed."""
    p = S.StagePlanner(PRESET, 12, window=2, sinks=1)
    tb = {(0, t): 10 + t for t in range(8)}
    p.plan([0], [2 * T + 3], [0], tb, prefill_min_q=17)
    assert {11, 12} <= set(p.slot_of)  # tile 1 (previous of 2) and tile 2 (own)
    plan = p.plan([2 * T + 3], [2 * T + 4], [0], tb)
    assert plan.packed_tiles.tolist() == [1] and plan.prev_rows.tolist() == [p.slot_of[11] * T]
    p.plan([2 * T + 4], [3 * T + 16], [0], tb)  # a prefill job into tile 3
    assert 11 in p.slot_of  # a drafter's context may still be in tile 2 -> reads tile 1
    p.plan([3 * T + 16], [3 * T + 17], [0], tb)
    assert 11 not in p.slot_of and 12 in p.slot_of and 10 in p.slot_of
    # a prefix-cache hit at 4T whose tile 3 (block 13 of another request) has no slot
    plan = p.plan([4 * T], [4 * T + 20], [0], {**{(0, t): 30 + t for t in range(8)}, (0, 0): 10},
                  prefill_min_q=17)
    job, = plan.prefill
    assert (job.packed, job.prev_row, job.tail_row) == (4, -1, -1)


def test_memory_model_stage_reserve():
    from onecard import memory

    g = memory.QWEN38_27B
    # 17 layers x (7*2+4) slots x 128 rows x 4 heads x 256 x K,V x fp16 (the default: fp16
    # window 3, two sink tiles)
    assert memory.kvarn_stage_bytes(g, "kvarn", 2) == 17 * 18 * 128 * 4 * 256 * 4 == 160_432_128
    # window 2, one sink: 5*2+4 slots; window 1, one sink: 3*2+4 slots
    assert memory.kvarn_stage_bytes(g, "kvarn", 2, window=2, sinks=1) == 17 * 14 * 128 * 4 * 256 * 4 == 124_780_544
    assert memory.kvarn_stage_bytes(g, "kvarn", 2, window=1, sinks=1) == 17 * 10 * 128 * 4 * 256 * 4 == 89_128_960
    # the prefill scratch, once per process: fp16 K/V window 16k x 4 x 256 x 2 x 2 B + one
    # 2048-query group's fp16 queries and fp32 state (24 heads x (256 x 2 + 256 x 4 + 8) B)
    win = 16384 * 4 * 256 * 2 * 2
    assert memory.kvarn_prefill_scratch_bytes(g) == win + 2048 * 24 * 1544 == 142_999_552
    assert memory.kvarn_reserve_bytes(g, "kvarn", 2) == 160_432_128 + 142_999_552


def _run_schedule(steps, k, v, q, gen, num_slots=14, tiles_per_page=1, window=2, sinks=1):
    """One request through the real planner + write + attention, steps (context c, q_len);
    K/V/q of a position are fixed (a re-written position gets the same rows). Returns the
    output [L, HQ, D] float64, each position from the last step that computed it."""
    L = k.shape[0]
    layout = R.get_preset(PRESET).layout(D)
    pages = L // T + 3
    cache = torch.randint(0, 256, (pages * tiles_per_page, HKV, layout.block_bytes),
                          dtype=torch.uint8, generator=gen)
    stage_k = torch.randn(num_slots * T, HKV, D, generator=gen).half()
    stage_v = torch.randn(num_slots * T, HKV, D, generator=gen).half()
    bt = (torch.randperm(pages - 1, generator=gen) + 1)[None].to(torch.int32)
    planner = S.StagePlanner(PRESET, num_slots, tiles_per_page, window=window, sinks=sinks)
    out = torch.full((L, HQ, D), float("nan"), dtype=torch.float64)
    krot = R.rotate(k, torch.float32).half()
    vrot = R.rotate(v, torch.float32).half()
    for c, ql in steps:
        s = c + ql
        tb = S.tile_block_ids(bt, {0: planner.tile_cols(c, s)}, tiles_per_page)
        plan = planner.plan([c], [s], [0], tb, prefill_min_q=S.MAX_QUERY_LEN + 1)
        S.apply_write(plan, krot[c:s], vrot[c:s], stage_k, stage_v, cache, PRESET, K.kvarn_pack_rows)
        o = torch.full((ql, HQ, D), float("nan"))
        S.apply_attention(plan, q[c:s], o, cache, stage_k, stage_v,
                          block_table=bt[plan.req_index].contiguous(), req_block_table=bt,
                          softmax_scale=D ** -0.5, preset=PRESET, tiles_per_page=tiles_per_page,
                          attention_rows=K.kvarn_attention_rows, prefill=K.kvarn_prefill,
                          key_rot=krot[c:s], val_rot=vrot[c:s])
        out[c:s] = o.double()
    return out


@pytest.mark.parametrize("window,sinks", RULES + [(3, 1), (2, 2)])
@inproc
def test_attention_does_not_depend_on_the_step_schedule(gen, window, sinks):
    """The read rule (reference.own_tile_attention_f64): a query reads its fp16 window (its
    own tile; at window 2 the previous one too) and the sink in fp16, older tiles quantized. So one prefill chunk, odd chunks starting mid-tile,
    verify blocks of 7 / 16 crossing tile boundaries (with rejected drafts re-written), and
    one-token decode give the same attention at every position (teacher forcing == generation;
    speculative verify == plain decode)."""
    L = (3 if window < 3 else 5) * T + 40  # window 3: tiles read packed between sinks and window
    k = ((torch.randn(L, HKV, D, generator=gen) * 1.5 + 0.3)).half()
    v = torch.randn(L, HKV, D, generator=gen).half()
    q = (torch.randn(L, HQ, D, generator=gen) * 1.2).half()
    verify, c = [(0, 60)], 60
    for i, n in enumerate([7, 16] * 20):
        if c >= L:
            break
        n = min(n, L - c)
        verify.append((c, n))
        c += n if i % 3 else max(1, n - 4)  # every third block: the last 4 drafts rejected
    cuts = [c for c in (0, 37, 90, 99, 161, 259) if c < L] + [L]
    schedules = {
        "one-chunk": [(0, L)],
        "odd-chunks": [(a, b - a) for a, b in zip(cuts, cuts[1:])],
        "verify-7-16": verify,
        "decode": [(p, 1) for p in range(L)],
    }
    kr = R.rotate(k, torch.float32).half()
    vr = R.rotate(v, torch.float32).half()
    kq, vq = R.quantized_view(kr, vr, PRESET)
    want = R.own_tile_attention_f64(q, R.rotate(kr), R.rotate(vr), R.rotate(kq), R.rotate(vq),
                                    T, D ** -0.5, window=window, sinks=sinks)
    got = {name: _run_schedule(st, k, v, q, gen, window=window, sinks=sinks)
           for name, st in schedules.items()}
    rel = lambda a, b: float(((a - b).abs() / b.abs().clamp_min(1)).max())  # noqa: E731
    errs = {name: rel(o, want) for name, o in got.items()}
    diffs = {name: rel(o, got["decode"]) for name, o in got.items()}
    print("vs reference", errs, "vs decode", diffs)
    assert all(torch.isfinite(o).all() for o in got.values())
    assert max(errs.values()) < TOL, errs
    assert max(diffs.values()) < TOL, diffs


def test_uniform_rows_layout_and_refusals():
    """stage.uniform_rows: a decode plan in fixed-size rows (token j = pseudo-sequence j, padding
    empty, pack jobs padded with block -1, unstaged rows to the trash row), a verify plan in two
    rows per request (the second empty unless the block crosses a tile); a plan that is not
    uniform is refused with a one-line error naming what is valid."""
    F = {n: i for i, n in enumerate(S.DECODE_FIELDS)}
    pl = S.StagePlanner(PRESET, 8, tiles_per_page=2)
    bt = torch.tensor([[3, 5, 2, 0], [6, 1, 7, 0]], dtype=torch.int32)
    cols = {i: pl.tile_cols(0, s) for i, s in enumerate([T - 1, 5])}
    pl.plan([0, 0], [T - 1, 5], [0, T - 1], S.tile_block_ids(bt, cols, 2))  # prefill
    ctx, seq = [T - 1, 5], [T, 6]  # request 0 fills tile 0 (a pack job); request 1 mid-tile
    cols = {i: pl.tile_cols(c, s) for i, (c, s) in enumerate(zip(ctx, seq))}
    plan = pl.plan(ctx, seq, [0, 1], S.tile_block_ids(bt, cols, 2))
    i32, dst = S.uniform_rows(plan, 1, 4, 6, trash_row=999)
    f = {n: i32[F[n]].tolist() for n in S.DECODE_FIELDS}
    assert i32.shape == (len(S.DECODE_FIELDS), 13) and dst.shape == (6,)
    assert f["cu_seqlens_q"][:5] == [0, 1, 2, 3, 4] and f["req_index"][:4] == [0, 1, 2, 3]
    assert f["seq_lens"][:4] == [T, 6, 0, 0] and f["sink_rows"][2:] == [-1] * 11
    assert f["pack_blocks"][0] == 3 * 2 and f["pack_blocks"][1:] == [-1] * 12  # one pack job
    assert dst[2:].tolist() == [999] * 4 and dst[0] != 999 and dst[1] != 999
    # verify blocks of 4: request 0 crosses into tile 1 (two rows), request 1 stays in tile 0
    ctx, seq = [T - 2, 6], [T + 2, 10]
    cols = {i: pl.tile_cols(c, s) for i, (c, s) in enumerate(zip(ctx, seq))}
    vplan = pl.plan(ctx, seq, [0, 4], S.tile_block_ids(bt, cols, 2))
    i32, dst = S.uniform_rows(vplan, 4, 12, 16, trash_row=999)  # 3 requests: one padding
    f = {n: i32[F[n]].tolist() for n in S.DECODE_FIELDS}
    assert f["cu_seqlens_q"][:7] == [0, 2, 4, 8, 8, 12, 12] and f["req_index"][:6] == [0, 0, 1, 1, 2, 2]
    assert f["seq_lens"][:6] == [T, T + 2, 10, 0, 0, 0]
    assert dst[:8].ne(999).all() and dst[8:].tolist() == [999] * 8
    with pytest.raises(ValueError) as e:
        S.uniform_rows(vplan, 1, 8, 16, trash_row=0)  # a verify plan read as decode
    assert "valid:" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError):
        S.uniform_rows(plan, 1, 8, 6, trash_row=0)  # more tokens than rows
    with pytest.raises(ValueError):
        S.uniform_rows(vplan, 4, 10, 16, trash_row=0)  # not a multiple of the block


def test_planner_window3_two_sinks_fields_release_and_lost_slots():
    """Window 3 + two sink tiles: a pseudo-sequence in tile t reads tiles 0 and 1 from their
    sink slots, t - 2 and t - 1 from theirs (prev_tile_rows, ascending), the tiles between
    packed; sink tiles are never released, window tiles once no query can read them; a lost
    previous tile ends the fp16 run there (it and every tile before it read packed), a lost
    sink 0 drops sink 1 too. A verify block crossing a tile is two rows; uniform_rows carries
    the second columns (sink_rows_1, prev_rows_1)."""
    p = S.StagePlanner(PRESET, 16, window=3, sinks=2)
    tb = {(0, t): 10 + t for t in range(10)}
    sl = lambda blk: p.slot_of[blk] * T  # noqa: E731
    plan = p.plan([0], [5 * T + 3], [0], tb, prefill_min_q=17)
    assert set(p.slot_of) == set(range(10, 16))  # sinks 0, 1 and tiles 2..5 (a query reads them)
    plan = p.plan([5 * T + 3], [5 * T + 4], [0], tb)
    assert plan.packed_tiles.tolist() == [3] and plan.window == 3 and plan.sinks == 2
    assert plan.sink_tile_rows.tolist() == [[sl(10), sl(11)]]
    assert plan.prev_tile_rows.tolist() == [[sl(13), sl(14)]] and plan.tail_rows.tolist() == [sl(15)]
    p.plan([5 * T + 4], [6 * T + 20], [0], tb, prefill_min_q=17)
    job = p.plan([6 * T + 20], [6 * T + 40], [0], tb, prefill_min_q=17).prefill[0]
    assert job.sink_rows == (sl(10), sl(11)) and job.prev_rows == (sl(14), sl(15))
    assert job.prev_row == sl(15) and job.tail_row == sl(16)
    assert not {12, 13} & set(p.slot_of) and {10, 11, 14, 15, 16} <= set(p.slot_of)
    # a verify block crossing into tile 7: two rows, each with its own window
    p.plan([6 * T + 40], [7 * T - 2], [0], tb, prefill_min_q=17)
    plan = p.plan([7 * T - 2], [7 * T + 2], [0], tb)
    assert plan.cu_seqlens_q.tolist() == [0, 2, 4] and plan.packed_tiles.tolist() == [4, 5]
    assert plan.prev_tile_rows.tolist() == [[sl(14), sl(15)], [sl(15), sl(16)]]
    assert plan.sink_tile_rows.tolist() == [[sl(10), sl(11)]] * 2
    F = {n: i for i, n in enumerate(S.DECODE_FIELDS)}
    i32, _ = S.uniform_rows(plan, 4, 4, 8, trash_row=999)
    assert i32[F["sink_rows_1"], :2].tolist() == [sl(11)] * 2
    assert i32[F["prev_rows"], :2].tolist() == [sl(14), sl(15)]
    assert i32[F["prev_rows_1"], :3].tolist() == [sl(15), sl(16), -1]
    assert F["sink_rows_1"] == F["sink_rows"] + 1 and F["prev_rows_1"] == F["prev_rows"] + 1
    # a lost previous tile (tile 6's slot): tiles 5 and 6 read packed, though 5's slot lives
    p._release(16)
    plan = p.plan([7 * T + 2], [7 * T + 3], [0], tb)
    assert plan.packed_tiles.tolist() == [7] and plan.prev_tile_rows.tolist() == [[-1, -1]]
    # a lost sink 0: both sink tiles read packed
    p._release(10)
    plan = p.plan([7 * T + 3], [7 * T + 4], [0], tb)
    assert plan.sink_tile_rows.tolist() == [[-1, -1]]
