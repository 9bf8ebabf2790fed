"""Ring mode of patch 0080 (ONECARD_DFLASH_RING=1, docs/dflash2-huge.md §3 design (d)), on the CPU.

* The pure parts the patch ships (``dflash2_lane.py``: geometry, slot map, block-table gather,
  the -1 context filter, the window rule), loaded from ``onecard/dflash/patch_src`` by path:
  neither vLLM nor Triton is imported here (the suite runs Triton kernel tests under
  TRITON_INTERPRET=1 and an early Triton import breaks them).
* Paged ring attention (vLLM's slot rule, negative slots skipped, FlashAttention's symmetric
  window over the block table) equals dense windowed non-causal-block attention, float64, over
  many wraps of the ring, chunked prefill longer than the ring, rejected verify rows, a batch
  sharing one ring, and a slot handed from a finished request to a new one.
"""
from __future__ import annotations

import importlib.util
import random
import types
from pathlib import Path

import pytest
import torch

from onecard.dflash import ring, ring_ref

LANE_PATH = Path(__file__).resolve().parents[2] / "onecard" / "dflash" / "patch_src" / \
    "dflash2_lane.py"


@pytest.fixture(scope="module")
def lane():
    spec = importlib.util.spec_from_file_location("dflash2_lane_under_test", LANE_PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- geometry + switch

def test_geometry_equals_onecard_ring(lane):
    assert lane.RING_BLOCK == ring.RING_BLOCK
    for window in (1, 15, 16, 40, 64, 2046, 2048, 4096):
        for k in (1, 7, 15, 23, 64):
            assert lane.ring_blocks(window, k) == ring.ring_blocks(window, k)
            for slots in (1, 2, 16):
                assert lane.ring_total_blocks(slots, window, k) == \
                    ring.ring_total_blocks(slots, window, k)
    for slot in range(3):
        for j in range(40):
            assert lane.physical_block(slot, j, 5) == ring.physical_block(slot, j, 5)
    table = lane.ring_rows_table(3, 5, 40)
    assert table.dtype == torch.int32 and table.shape == (3, 40)
    assert table.tolist() == [[ring.physical_block(s, j, 5) for j in range(40)]
                              for s in range(3)]


def test_ring_switch_reads_one_env_value(lane):
    assert lane.ring_mode_enabled({}) is False
    assert lane.ring_mode_enabled({"ONECARD_DFLASH_RING": "0"}) is False
    assert lane.ring_mode_enabled({"ONECARD_DFLASH_RING": "1"}) is True
    with pytest.raises(ValueError, match=r"ONECARD_DFLASH_RING='yes' is not valid; valid: 0") as e:
        lane.ring_mode_enabled({"ONECARD_DFLASH_RING": "yes"})
    assert "\n" not in str(e.value)


def _hf(**kw):
    return types.SimpleNamespace(**kw)


GOOD_WINDOWS = [
    # the tiny / quoted 27B form: top-level use_sliding_window, transformers' all-full layer_types
    ({"use_sliding_window": True, "sliding_window": 64, "layer_types": ["full_attention"] * 5,
      "dflash_config": {}}, 64),
    ({"use_sliding_window": False, "sliding_window": 2048,
      "dflash_config": {"use_swa": True, "swa_window_size": 1024}}, 1024),
    ({"sliding_window": 512, "layer_types": ["sliding_attention"] * 3, "dflash_config": {}}, 512),
]
BAD_WINDOWS = [
    {"use_sliding_window": False, "sliding_window": 64, "layer_types": ["full_attention"] * 5,
     "dflash_config": {}},
    {"use_sliding_window": True, "sliding_window": 64,
     "layer_types": ["sliding_attention", "full_attention"], "dflash_config": {}},
    {"use_sliding_window": True, "sliding_window": None, "dflash_config": {}},
    {"use_sliding_window": True, "sliding_window": 0, "dflash_config": {}},
]


def test_ring_window_accepts_only_all_sliding_drafters(lane):
    """The server's rule (patch 0080's ring_window on the hf config) and the launcher's
    (onecard.dflash.ring.window_from_config on config.json) agree on every case."""
    for cfg, window in GOOD_WINDOWS:
        assert lane.ring_window(_hf(**cfg)) == ring.window_from_config(cfg) == window
    for cfg in BAD_WINDOWS:
        with pytest.raises(ValueError, match="valid") as e:
            lane.ring_window(_hf(**cfg))
        assert "\n" not in str(e.value) and "ONECARD_DFLASH_RING=1" in str(e.value)
        with pytest.raises(ValueError, match="valid") as e:
            ring.window_from_config(cfg)
        assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- slot map

def test_slot_map_alloc_keep_free_reuse(lane):
    s = lane.RingSlots(3)
    assert s.assign(["a", "b"]) == ([0, 1], [0, 1])
    assert s.assign(["b", "a"]) == ([1, 0], [])            # kept, batch order
    assert s.assign(["a", "b", "c"]) == ([0, 1, 2], [2])
    s.free("b")
    assert s.assign(["c", "d"]) == ([2, 1], [1])            # d reuses b's slot, fresh
    s.free("nobody")                                        # unknown id: no-op


def test_slot_map_reclaims_finished_then_absent(lane):
    s = lane.RingSlots(2)
    s.assign(["a", "b"])
    # "a" finished (not alive), "b" alive but not in this batch: the finished one goes first
    slots, fresh = s.assign(["c"], alive=lambda r: r == "b")
    assert (slots, fresh) == ([0], [0]) and s.owner == {"b": 1, "c": 0}
    # all alive, none free: a request outside the batch gives its slot up
    slots, fresh = s.assign(["c", "d"], alive=lambda r: True)
    assert (slots, fresh) == ([0, 1], [1]) and s.owner == {"c": 0, "d": 1}


def test_slot_map_exhausted_is_one_line(lane):
    s = lane.RingSlots(2)
    with pytest.raises(ValueError, match=r"ring slots exhausted: 3 requests .*valid: at most "
                                         r"max_num_seqs=2") as e:
        s.assign(["a", "b", "c"])
    assert "\n" not in str(e.value)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="valid: max_num_seqs"):
            lane.RingSlots(bad)


# --------------------------------------------------------------------------- table + filter

def test_spare_row_points_at_the_spare_block(lane):
    table = lane.ring_rows_table(3, 5, 12, spare_row=True)
    assert table.shape == (4, 12)
    assert table[:3].tolist() == lane.ring_rows_table(3, 5, 12).tolist()
    assert table[3].tolist() == [15] * 12     # block 3 * 5: the last of 3 * 5 + 1 blocks
    with pytest.raises(ValueError, match="valid: each an int >= 1"):
        lane.ring_rows_table(0, 5, 12)


def test_block_table_gather(lane):
    table = lane.ring_rows_table(4, 3, 10)
    bt = lane.ring_block_table(table, torch.tensor([2, 0, 2]))
    assert bt.dtype == torch.int32
    assert bt.tolist() == [[ring.physical_block(s, j, 3) for j in range(10)] for s in (2, 0, 2)]


def test_context_filter_matches_reference(lane):
    rng = random.Random(3)
    for _ in range(50):
        b, nq, k_max = rng.randint(1, 4), 8, rng.choice([7, 15])
        ring_rows = ring.ring_blocks(64, k_max) * 16
        lens = [rng.randint(1, 300) for _ in range(b)]
        starts = [rng.randint(0, 500) for _ in range(b)]
        pad = rng.randint(0, 5)                       # context rows past the last request
        ctx_pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]
                            + [torch.zeros(pad, dtype=torch.long)])
        rejected = [rng.randint(0, min(n - 1, k_max)) for n in lens]
        first_q = [s + n - r for s, n, r in zip(starts, lens, rejected)]
        qpos = torch.cat([torch.arange(p, p + nq) for p in first_q])
        qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        slots = torch.arange(len(ctx_pos), dtype=torch.int64) + 1000
        got = lane.ring_filter_context_slots(slots.clone(), ctx_pos, qsl, qpos, b, nq, k_max,
                                             ring_rows)
        want = []
        for r in range(b):
            for i in range(lens[r]):
                keep = ring_ref.reference_keep(starts[r] + i, first_q[r], k_max, ring_rows)
                want.append(1000 + len(want) if keep else -1)
        want += [-1] * pad
        assert got.tolist() == want
        # what is kept lands on distinct ring rows (one kernel never writes a row twice)
        for r in range(b):
            kept = [p for p in range(starts[r], starts[r] + lens[r])
                    if ring_ref.reference_keep(p, first_q[r], k_max, ring_rows)]
            # (a rejected context row and a query row may be the same position: written in
            # that order by two kernels, so only distinct positions must not share a row)
            written = set(kept) | set(range(first_q[r], first_q[r] + nq))
            assert len({p % ring_rows for p in written}) == len(written)


def test_context_filter_empty_and_in_place(lane):
    empty = torch.zeros(0, dtype=torch.int64)
    got = lane.ring_filter_context_slots(empty, empty, torch.tensor([0, 0], dtype=torch.int32),
                                         torch.zeros(8, dtype=torch.long), 1, 8, 7, 80)
    assert got.numel() == 0
    slots = torch.tensor([5, 6, 7])
    out = lane.ring_filter_context_slots(slots, torch.tensor([0, 1, 99]),
                                         torch.tensor([0, 3], dtype=torch.int32),
                                         torch.arange(100, 108), 1, 8, 7, 80)
    assert out is slots and slots.tolist() == [-1, -1, 7]


# --------------------------------------------------------------------------- ring == dense

class _Req:
    """One request's truth: K/V of every position, and where its next context starts."""

    def __init__(self, rid: str, n: int, heads: int, hd: int, gen: torch.Generator,
                 start: int = 0):
        self.rid = rid
        self.k = torch.randn(n, heads, hd, dtype=torch.float64, generator=gen)
        self.v = torch.randn(n, heads, hd, dtype=torch.float64, generator=gen)
        self.c0 = start          # first context position of the next step


def _run(lane, window: int, k_max: int, rows: int, slots: int, plan, seed: int,
         heads: int = 2, hd: int = 16, hit_zero: dict | None = None):
    """plan: list of steps; each step a list of (rid, kind, arg) with kind "prefill" (arg =
    chunk length) or "decode" (arg = accepted count 1..1+k_max). Returns the worst |ring -
    dense| over every request and step, and the number of steps checked."""
    gen = torch.Generator().manual_seed(seed)
    nq = 1 + rows
    width = 4096 // 16
    rows_table = lane.ring_rows_table(slots, ring.ring_blocks(window, k_max), width)
    book = lane.RingSlots(slots)
    rb = ring_ref.RingBatch(slots, window, k_max, heads, hd, width, book.assign,
                            lane.ring_block_table, lane.ring_filter_context_slots, rows_table)
    reqs: dict[str, _Req] = {}
    worst, checked = 0.0, 0
    for step in plan:
        ids, ctxs, firsts, queries, dense = [], [], [], [], []
        for rid, kind, arg in step:
            if rid not in reqs:
                start = (hit_zero or {}).get(rid, 0)
                reqs[rid] = _Req(rid, 3000, heads, hd, gen, start=start)
            r = reqs[rid]
            if kind == "prefill":
                pos = torch.arange(r.c0, r.c0 + arg)
                kk, vv = r.k[pos], r.v[pos]
                first = r.c0 + arg
            else:                                     # verify 1 + k_max rows, arg accepted
                pos = torch.arange(r.c0, r.c0 + 1 + k_max)
                kk, vv = r.k[pos].clone(), r.v[pos].clone()
                kk[arg:] = torch.randn(1 + k_max - arg, heads, hd, dtype=torch.float64,
                                       generator=gen) * 7   # rejected rows: garbage
                vv[arg:] = -vv[arg:] * 3
                first = r.c0 + arg
            q = torch.randn(nq, heads, hd, dtype=torch.float64, generator=gen)
            qk = torch.randn(nq, heads, hd, dtype=torch.float64, generator=gen)
            qv = torch.randn(nq, heads, hd, dtype=torch.float64, generator=gen)
            ids.append(rid)
            ctxs.append((pos, kk, vv))
            firsts.append(first)
            queries.append((q, qk, qv))
            # dense truth: every earlier position's K/V (zeros where a prefix hit skipped them)
            k_all, v_all = r.k[:first].clone(), r.v[:first].clone()
            start = (hit_zero or {}).get(rid, 0)
            k_all[:start] = 0
            v_all[:start] = 0
            qpos = torch.arange(first, first + nq)
            dense.append(ring_ref.dense_window_attention(
                q, qpos, torch.cat([k_all, qk]), torch.cat([v_all, qv]), window))
            r.c0 = first
        outs = rb.step(ids, ctxs, firsts, queries, alive=lambda rid: rid in reqs)
        for got, want in zip(outs, dense):
            worst = max(worst, (got - want).abs().max().item())
            checked += 1
    return worst, checked, reqs, book


def _plan_single(rng: random.Random, k_max: int, prefill: list[int], decodes: int):
    plan = [[("a", "prefill", n)] for n in prefill]
    plan += [[("a", "decode", rng.randint(1, 1 + k_max))] for _ in range(decodes)]
    return plan


@pytest.mark.parametrize("window,k_max,rows", [(64, 7, 7), (64, 15, 7), (40, 7, 7), (33, 3, 3)])
def test_ring_equals_dense_over_many_wraps(lane, window, k_max, rows):
    rng = random.Random(window * 100 + k_max)
    # prefill chunks shorter and longer than the ring, then verify steps with random acceptance
    plan = _plan_single(rng, k_max, [5, 150, 1, 37, 300], 120)
    worst, checked, reqs, _ = _run(lane, window, k_max, rows, 1, plan, seed=window + k_max)
    ring_rows = ring.ring_blocks(window, k_max) * 16
    assert checked == len(plan)
    assert worst < 1e-12
    assert reqs["a"].c0 > 6 * ring_rows          # the ring wrapped at least six times


def test_ring_batch_shares_one_ring_and_hands_slots_over(lane):
    """Three requests at different depths in one ring tensor (3 slots); "a" finishes and "d"
    takes its slot (cleared on hand-over), all equal to dense attention every step."""
    window, k_max, rows = 64, 7, 7
    rng = random.Random(11)
    plan = []
    plan.append([("a", "prefill", 100), ("b", "prefill", 20), ("c", "prefill", 200)])
    for i in range(60):
        step = [(rid, "decode", rng.randint(1, 8)) for rid in ("a", "b", "c")]
        if i % 9 == 3:
            step[1] = ("b", "prefill", rng.choice([3, 90]))
        plan.append(step)
    plan.append([("b", "decode", 8), ("c", "decode", 1), ("d", "prefill", 130)])
    for _ in range(40):
        plan.append([(rid, "decode", rng.randint(1, 8)) for rid in ("b", "d", "c")])
    worst, checked, _, book = _run(lane, window, k_max, rows, 3, plan, seed=5)
    assert checked == sum(len(s) for s in plan)
    assert worst < 1e-12
    assert sorted(book.owner.values()) == [0, 1, 2] and "a" not in book.owner
    assert book.owner["d"] == 0                              # a's slot, handed over


def test_prefix_hit_reads_zero_rows_then_heals(lane):
    """A request whose first 200 positions came from the prefix cache never writes them to its
    ring: its drafts read zero rows there (never another request's K/V, the slot was cleared on
    hand-over) until the window has moved past them, then equal full dense attention."""
    window, k_max, rows = 64, 7, 7
    rng = random.Random(2)
    # "x" fills slot 0 with its own K/V and finishes; "y" takes slot 0 with a 200-token hit
    plan = [[("x", "prefill", 250)]] + [[("x", "decode", rng.randint(1, 8))] for _ in range(10)]
    plan += [[("y", "prefill", 10)]] + [[("y", "decode", rng.randint(1, 8))] for _ in range(30)]

    gen = torch.Generator().manual_seed(9)
    heads, hd, nq = 2, 16, 1 + rows
    width = 4096 // 16
    rows_table = lane.ring_rows_table(1, ring.ring_blocks(window, k_max), width)
    book = lane.RingSlots(1)
    rb = ring_ref.RingBatch(1, window, k_max, heads, hd, width, book.assign,
                            lane.ring_block_table, lane.ring_filter_context_slots, rows_table)
    truth = {rid: _Req(rid, 3000, heads, hd, gen, start=(200 if rid == "y" else 0))
             for rid in ("x", "y")}
    alive = {"x"}
    healed = zero_matched = 0
    for step in plan:
        ((rid, kind, arg),) = step
        if rid == "y":
            alive = {"y"}
        r = truth[rid]
        n = arg if kind == "prefill" else 1 + k_max
        pos = torch.arange(r.c0, r.c0 + n)
        kk, vv = r.k[pos], r.v[pos]
        first = r.c0 + arg                  # prefill: the chunk; decode: the accepted rows
        q, qk, qv = (torch.randn(nq, heads, hd, dtype=torch.float64, generator=gen)
                     for _ in range(3))
        (got,) = rb.step([rid], [(pos, kk, vv)], [first], [(q, qk, qv)],
                         alive=lambda x: x in alive)
        r.c0 = first
        if rid != "y":
            continue
        qpos = torch.arange(first, first + nq)
        k_all, v_all = r.k[:first].clone(), r.v[:first].clone()
        full = ring_ref.dense_window_attention(q, qpos, torch.cat([k_all, qk]),
                                               torch.cat([v_all, qv]), window)
        k_all[:200] = 0
        v_all[:200] = 0
        zeroed = ring_ref.dense_window_attention(q, qpos, torch.cat([k_all, qk]),
                                                 torch.cat([v_all, qv]), window)
        assert (got - zeroed).abs().max().item() < 1e-12
        zero_matched += 1
        if first - window + 1 >= 200:
            assert (got - full).abs().max().item() < 1e-12
            healed += 1
    assert zero_matched == 31 and healed > 5
