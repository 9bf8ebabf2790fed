"""KVarN vLLM-integration core: the stage planner + write + attention over several steps
(prefill chunks, decode, speculative verify with rejected drafts, prefix-shared first block),
against a float64 reference of what the cache must represent. Triton interpreter, tiny shapes.
"""

from __future__ import annotations

import random

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

    def __init__(self, gen, tiles_per_page=2, num_slots=10, shared_first_page=False,
                 prefill_min_q=None, max_tokens_per_launch=1024, **prefill_kw):
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
        self.planner = S.StagePlanner(PRESET, num_slots, tiles_per_page)
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
            max_tokens_per_launch=self.max_tokens_per_launch)
        err = 0.0
        for i, (r, c, ql) in enumerate(rows):
            s = c + ql
            kr, vr = self._represented(r, s, sink=plan.sink_rows.numel() > 0)
            ref = R.attention_f64(q[q0[i]:q0[i] + ql], R.rotate(kr), R.rotate(vr), D ** -0.5)
            got = out[q0[i]:q0[i] + ql].double()
            assert torch.isfinite(got).all()
            err = max(err, float(((got - ref).abs() / ref.abs().clamp_min(1)).max()))
        return err

    def _represented(self, r, s, sink):
        """Rotated K/V [s] as the cache holds them: full tiles quantized (tile 0 fp16 when its
        slot is alive), the partial tile fp16."""
        kr = R.rotate(self.k[r][:s], torch.float32).half()
        vr = R.rotate(self.v[r][:s], torch.float32).half()
        ks, vs = [], []
        for t in range(s // T):
            blk = int(self.bt[r, t // self.tpp]) * self.tpp + t % self.tpp
            if t == 0 and blk in self.planner.slot_of:
                ks.append(kr[:T].double())
                vs.append(vr[:T].double())
                continue
            qt = R.quantize_tile(kr[t * T:(t + 1) * T].float(), vr[t * T:(t + 1) * T].float(), PRESET)
            k, v = R.dequant_tile(qt)
            ks.append(k)
            vs.append(v)
        ks.append(kr[s // T * T:].double())
        vs.append(vr[s // T * T:].double())
        return torch.cat(ks), torch.cat(vs)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))


TOL = 2e-2  # the reference re-quantizes with its own rounding (rare ties differ by one code)


@inproc
def test_prefill_chunks_decode_and_verify_with_rejections(gen):
    sim = Sim(gen)
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
    first = {int(sim.bt[r, 0]) * sim.tpp for r in range(2)}
    assert first <= live and len(live) <= 2 + 3 * 2


@inproc
def test_prefill_jobs_with_decode_and_verify_in_the_batch(gen):
    """Prefill chunks through kvarn_prefill (dequantize once per chunk, windows + LSE merge,
    several query groups), mixed with decode / verify pseudo-sequences in one batch (a prefill
    job between them: launches stay contiguous in the batch), against the same reference."""
    sim = Sim(gen, prefill_min_q=S.MAX_QUERY_LEN + 1, max_tokens_per_launch=8,
              window_tokens=128, query_group=40)
    errs = [sim.step([(0, 0, 100), (1, 0, 40)])]  # two prefill jobs (40 < tile, 100 crosses it)
    assert [j.q_len for j in sim.last_plan.prefill] == [100, 40] and sim.last_plan.seq_lens.numel() == 0
    errs.append(sim.step([(1, 40, 3), (0, 100, 190)]))  # verify, then a prefill from mid-tile
    assert len(sim.last_plan.prefill) == 1 and sim.last_plan.seq_tok0 == [0]
    errs.append(sim.step([(0, 290, 17), (1, 43, 2)]))  # shortest prefill job, then a verify
    assert sim.last_plan.prefill[0].tok0 == 0 and sim.last_plan.seq_tok0 == [17]
    errs.append(sim.step([(1, 45, 16), (0, 307, 1)]))  # 16 queries stay a pseudo-sequence
    assert not sim.last_plan.prefill
    assert max(errs) < TOL, errs


@inproc
def test_prefix_shared_first_page(gen):
    sim = Sim(gen, tiles_per_page=1, num_slots=5, shared_first_page=True)
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
    assert set(plan.sink_rows.tolist()) == {p.slot_of[20] * T}  # 61 queries: 4 pseudo-sequences
    assert plan.cu_seqlens_q.tolist() == [0, 16, 32, 48, 61]
    plan = p.plan([T + 1], [T + 2], [0], a)  # A reads tile 0 packed now
    assert plan.sink_rows.tolist() == [-1] and plan.packed_tiles.tolist() == [1]


def test_planner_errors_and_release():
    p = S.StagePlanner(PRESET, 2)
    tb = {(0, t): 10 + t for t in range(8)}
    plan = p.plan([0], [T + 5], [0], tb)  # tiles 0 (sink) and 1 (partial)
    assert plan.pack_stage_blocks.tolist() == [10] and plan.tail_rows.tolist()[-1] >= 0
    with pytest.raises(S.StageExhausted, match="valid:"):
        p.plan([T + 5, 0], [T + 6, 2 * T + 1], [0, 1], {**tb, **{(1, t): 20 + t for t in range(4)}})
    q = S.StagePlanner(PRESET, 3)
    q.plan([0], [10], [0], tb)
    with pytest.raises(S.StageExhausted, match="evicted"):
        q.plan([10], [11], [0], {(0, 0): 99})  # mid-tile write whose rows were never staged
    assert S.default_num_slots(2) == 10


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


def test_planner_prefill_jobs():
    p = S.StagePlanner(PRESET, 10)
    tb = {(r, t): 10 * r + t for r in range(2) for t in range(8)}
    plan = p.plan([0, 0], [3 * T + 5, 40], [0, 3 * T + 5], tb, prefill_min_q=17)
    a, b = plan.prefill
    assert (a.packed, a.sink_row, a.tail_row) == (3, p.slot_of[0] * T, p.slot_of[3] * T)
    assert (b.packed, b.sink_row, b.tail_row) == (0, -1, p.slot_of[10] * T)
    assert plan.pack_stage_blocks.tolist() == [0, 2] and plan.pack_new_blocks.tolist() == [1]
    assert plan.seq_lens.numel() == 0 and plan.num_tokens == 3 * T + 45
    plan = p.plan([3 * T + 5, 40], [3 * T + 30, 41], [0, 25], tb, prefill_min_q=17)
    assert [j.tok0 for j in plan.prefill] == [0] and plan.seq_tok0 == [25]
    assert plan.prefill[0].packed == 3 and plan.cu_seqlens_q.tolist() == [0, 1]


def test_memory_model_stage_reserve():
    from onecard import memory

    g = memory.QWEN38_27B
    # 17 layers x (3*2+4) slots x 128 rows x 4 heads x 256 x K,V x fp16
    assert memory.kvarn_stage_bytes(g, "kvarn", 2) == 17 * 10 * 128 * 4 * 256 * 4 == 89_128_960
    # the prefill scratch, once per process: fp16 K/V window 16k x 4 x 256 x 2 x 2 B + one
    # 2048-query group's fp16 queries and fp32 state (24 heads x (256 x 2 + 256 x 4 + 8) B)
    win = 16384 * 4 * 256 * 2 * 2
    assert memory.kvarn_prefill_scratch_bytes(g) == win + 2048 * 24 * 1544 == 142_999_552
    assert memory.kvarn_reserve_bytes(g, "kvarn", 2) == 89_128_960 + 142_999_552
