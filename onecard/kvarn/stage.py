# SPDX-License-Identifier: Apache-2.0
"""The fp16 stage of the vLLM integration and the per-step plan (pure Python + torch, no vLLM).

vLLM's attention backends see no request identity, only block tables, so the stage is keyed
by the *physical block of a tile*: a stage slot holds the ``tile`` fp16 rotated rows of one
tile (rows ``slot * tile + p % tile``). A tile being written is private to its request (vLLM
never writes into a block a prefix-cache hit shares), so its block id names it; the first
tile's slot is kept after it fills and serves as the fp16 sink (shared by requests that share
that block through the prefix cache, whose contents are identical).

Per step, for every request (context ``c`` committed tokens, ``s`` after this step's tokens):

* Staged tiles: the sink tiles (0 .. S - 1, ``sinks``) whenever written, the tile holding ``c``
  when ``c`` is mid-tile (its
  earlier rows are only in the stage), and every tile that a query at a position after
  ``s - STAGE_LAST`` may read in fp16 (drafts that may be rejected live there; a tile that
  becomes partial again needs its fp16 rows, and with the two-tile window so does the tile
  before it). New rows of staged tiles go to their slot.
* Every tile that is full after the write is packed: staged ones from their slot, the others
  (interior tiles of a long prefill chunk) straight from the new rotated rows.
* Attention follows one read rule for every path (``reference.own_tile_attention_f64``): a
  query at position p reads its fp16 window -- the ``window`` tiles ending with its own tile
  p // tile (format.DEFAULT_WINDOW = 3: its own and the two previous ones; 1 to 3) -- in fp16, the
  sink tiles 0 .. S - 1 from their sink slots (format.DEFAULT_SINKS = 2: tiles 0 and 1; 1 or 2) while
  they live, and every other earlier tile packed. So the attention at a
  position does not depend on how tokens were grouped into steps: a prompt scored in one
  chunk, in odd chunks, by verify blocks or one token at a time sees the same keys (teacher
  forcing == generation; speculative verify == plain decode). The one exception: a previous
  tile whose slot is gone (a prefix-cache hit on a released tile, an LRU eviction) is read
  packed, as a sink tile is when its slot is gone. Runs, not single tiles: the sink tiles read
  in fp16 are the live prefix (a lost sink 0 makes sink 1 packed too), the previous tiles the
  live suffix ending at the own tile (a lost tile t - 1 makes t - 2 packed too).
* Query runs of more than ``MAX_QUERY_LEN`` (or at least ``prefill_min_q``) queries become
  ``PrefillJob``s for ``kernels.kvarn_prefill``: tiles before each query's own are dequantized
  once per chunk (tile 0 from its sink slot when it has one); own tiles come from this step's
  rotated rows (``apply_attention``'s ``key_rot`` / ``val_rot``) and, for a chunk starting
  mid-tile, the first tile's earlier rows from its slot (``tail_row``). Shorter runs are
  pseudo-sequences of at most 16 queries that never cross a tile: pseudo-sequence queries in
  tile t read tiles ``[0, t)`` packed and ``[t * tile, end)`` from tile t's slot; with the
  window W, tiles ``[0, t - W + 1)`` packed (but the sinks) and tiles t - W + 1 .. t - 1 from
  their slots (``prev_tile_rows``) too (a verify block crossing a tile boundary is two
  pseudo-sequences). A tile is packed as
  soon as it is full (the write precedes attention); its slot keeps the fp16 rows for queries
  that read it in fp16.
* Slots of tiles no query will read in fp16 again and not a sink tile (``(t + window) * tile <= c -
  STAGE_LAST``: a drafter's build may pass unverified positions as context) are released;
  others age out LRU (sinks first). Running out of slots is an error, never a silent reuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .format import (DEFAULT_SINKS, DEFAULT_WINDOW, FP16_WINDOWS, MAX_PREV, MAX_SINKS, SINK_TILES,
                     Preset, get_preset)

MAX_QUERY_LEN = 16
STAGE_LAST = 16  # tiles ending after s - STAGE_LAST stay staged (>= k + 1 of any speculation)


# Stage slots per request by (fp16 window W, sink tiles S): the S sink tiles, the window's W
# tiles, one more for a verify block crossing into the next tile, and (W >= 2) one for a tile
# kept for a drafter's unverified context or a rejected draft's rollback: S + W + 1 (+ 1).
SLOTS_PER_SEQ = {(w, n): n + w + (2 if w >= 2 else 1) for w in FP16_WINDOWS for n in SINK_TILES}


def check_rule(window: int, sinks: int) -> None:
    """One-line ValueError unless (window, sinks) is a read rule every path implements."""
    if window not in FP16_WINDOWS:
        raise ValueError(f"KVarN fp16 window {window} is not valid; valid: "
                         f"{', '.join(map(str, FP16_WINDOWS))}")
    if sinks not in SINK_TILES:
        raise ValueError(f"KVarN fp16 sink tiles {sinks} is not valid; valid: "
                         f"{', '.join(map(str, SINK_TILES))}")


def default_num_slots(max_num_seqs: int, window: int = DEFAULT_WINDOW,
                      sinks: int = DEFAULT_SINKS) -> int:
    """Stage slots per layer: SLOTS_PER_SEQ[(window, sinks)] per request, plus 4 spares."""
    check_rule(window, sinks)
    return SLOTS_PER_SEQ[(window, sinks)] * max(1, int(max_num_seqs)) + 4


class StageExhausted(RuntimeError):
    pass


@dataclass
class PrefillJob:
    """One request's prefill chunk for ``kernels.kvarn_prefill`` (host ints)."""

    req: int  # batch row of the block table
    tok0: int  # first query's index among this step's tokens
    ctx: int
    seq: int
    packed: int  # tiles [0, packed) packed in the cache (tile j read from sink_rows[j] if any)
    sink_rows: tuple  # rows of the live sink tiles 0, 1, .. (a prefix; () : tile 0 read packed)
    tail_row: int  # own-tile rows before ctx (chunk starting mid-tile): tail_row + p % tile
    null: bool = False  # on vLLM's null page (a dummy run): nothing staged, garbage read
    # window >= 2: rows of the tiles before ctx's that the chunk reads in fp16, ascending, ending
    # with tile ctx // tile - 1 (live slots only; () : all read packed)
    prev_rows: tuple = ()

    @property
    def sink_row(self) -> int:
        """Tile 0's sink rows (-1: read packed)."""
        return self.sink_rows[0] if self.sink_rows else -1

    @property
    def prev_row(self) -> int:
        """Rows of the tile just before ctx's (-1: none / read packed)."""
        return self.prev_rows[-1] if self.prev_rows else -1

    @property
    def q_len(self) -> int:
        return self.seq - self.ctx


@dataclass
class StepPlan:
    # write: new rotated row index -> stage row
    stage_src: torch.Tensor  # [W] int64 token index into this step's rows
    stage_dst: torch.Tensor  # [W] int64 stage row
    # pack jobs from the stage (rows slot * tile) and from the new rows (token index)
    pack_stage_rows: torch.Tensor  # [P1] int32
    pack_stage_blocks: torch.Tensor  # [P1] int32 (tile block ids)
    pack_new_rows: torch.Tensor  # [P2] int32
    pack_new_blocks: torch.Tensor  # [P2] int32
    # attention over pseudo-sequences (<= 16 queries each)
    req_index: torch.Tensor  # [S'] int64: batch row of the block table
    cu_seqlens_q: torch.Tensor  # [S' + 1] int32
    seq_lens: torch.Tensor  # [S'] int32
    packed_tiles: torch.Tensor  # [S'] int32
    # [S', MAX_SINKS] int32: column j the rows of sink tile j (< packed_tiles) read in fp16; a
    # prefix of live ones, then -1 (tile 0 and on read packed)
    sink_tile_rows: torch.Tensor
    tail_rows: torch.Tensor  # [S'] int32 (-1: no tail)
    # [S', MAX_PREV] int32: column j the rows of tile packed_tiles + j (the own tile's previous
    # tiles read in fp16, window >= 2); a prefix, then -1
    prev_tile_rows: torch.Tensor
    max_query_len: int
    max_packed_tiles: int
    num_tokens: int
    all_null: bool = False  # every request sits on vLLM's null page (a dummy run)
    window: int = DEFAULT_WINDOW  # the read rule's fp16 tiles per query
    sinks: int = DEFAULT_SINKS  # the read rule's fp16 sink tiles
    seq_tok0: list = field(default_factory=list)  # [S'] host: first query's token index
    prefill: list = field(default_factory=list)  # [PrefillJob] in batch order

    @property
    def sink_rows(self) -> torch.Tensor:
        """[S'] tile 0's sink rows (-1: read packed)."""
        return self.sink_tile_rows[:, 0]

    @property
    def prev_rows(self) -> torch.Tensor:
        """[S'] rows of tile packed_tiles when read from a slot (-1: none)."""
        return self.prev_tile_rows[:, 0]

    def to(self, device) -> "StepPlan":
        kw = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
              for k, v in self.__dict__.items()}
        return StepPlan(**kw)


class StagePlanner:
    """Stage-slot bookkeeping (CPU) shared by all KVarN layers of one KV-cache group."""

    def __init__(self, preset: str | Preset | None, num_slots: int, tiles_per_page: int = 1,
                 window: int = DEFAULT_WINDOW, sinks: int = DEFAULT_SINKS):
        check_rule(window, sinks)
        self.window = int(window)
        self.sinks = int(sinks)
        self.preset = get_preset(preset)
        self.tile = self.preset.tile
        self.num_slots = int(num_slots)
        self.tiles_per_page = int(tiles_per_page)
        self.slot_of: dict[int, int] = {}
        self.key: list[int | None] = [None] * self.num_slots
        self.is_sink: list[bool] = [False] * self.num_slots
        self.last_use = [-1] * self.num_slots
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.step = 0

    # -- slot table ------------------------------------------------------------------------
    def _release(self, blk: int) -> None:
        sl = self.slot_of.pop(blk, None)
        if sl is not None:
            self.key[sl] = None
            self.is_sink[sl] = False
            self.free.append(sl)

    def _alloc(self, blk: int, used: set) -> int:
        if not self.free:
            cands = [i for i in range(self.num_slots) if i not in used and self.key[i] is not None]
            if not cands:
                raise StageExhausted(
                    f"KVarN stage: all {self.num_slots} slots are in use by this step; valid: "
                    f"more slots (max_num_seqs is too small for the batch)")
            victim = min(cands, key=lambda i: (not self.is_sink[i], self.last_use[i]))
            self._release(self.key[victim])
        sl = self.free.pop()
        self.slot_of[blk] = sl
        self.key[sl] = blk
        self.is_sink[sl] = False
        return sl

    # -- per-step plan ----------------------------------------------------------------------
    def tile_cols(self, ctx: int, seq: int) -> list[int]:
        """Tiles whose block ids the plan needs for a request (context ctx, length seq)."""
        T = self.tile
        first_w, last_w = ctx // T, (seq - 1) // T
        need = {*range(self.sinks), *range(first_w, last_w + 1)}
        need.update(t for t in range(first_w - self.window - 2, first_w) if t >= 0)
        return sorted(t for t in need if t * T < max(seq, 1))

    def plan(self, ctx_lens: list[int], seq_lens: list[int], q_starts: list[int],
             tile_block: dict, null_page_blocks: int = 0,
             prefill_min_q: int | None = None) -> StepPlan:
        """``tile_block[(r, t)]`` = block id of tile t of request r for every t in
        ``tile_cols(ctx_lens[r], seq_lens[r])``. A request with a tile in a block below
        ``null_page_blocks`` (vLLM's null page 0: dummy and profile runs) writes nothing and
        reads its tiles packed (garbage in, garbage out, nothing staged). Query runs of at
        least ``prefill_min_q`` tokens, and every run longer than ``MAX_QUERY_LEN`` (only the
        prefill kernel reads an interior tile's fp16 rows: this step's), become
        ``PrefillJob``s; shorter runs become pseudo-sequences."""
        T = self.tile
        self.step += 1
        used: set[int] = set()
        st_src, st_dst, p1r, p1b, p2r, p2b = [], [], [], [], [], []
        req, cu, sl_, pk, sink, tail, prev, tok0, pre = [], [0], [], [], [], [], [], [], []
        W, NS = self.window, self.sinks
        max_q = 1
        nulls = []
        # release tiles no query reads in fp16 again (non-sink) first so allocation has room. A
        # drafter's metadata build passes unverified positions as context (at most STAGE_LAST
        # ahead of what the target committed), so positions count as committed only STAGE_LAST
        # tokens later; a query in tile u reads tiles u - W + 1 .. u in fp16.
        for r, (c, s) in enumerate(zip(ctx_lens, seq_lens)):
            for t in range(c // T - W - 2, c // T):
                if t >= NS and (t + W) * T <= c - STAGE_LAST and (r, t) in tile_block:
                    self._release(tile_block[(r, t)])
        # keep every request's earlier window tiles (read in fp16 this step) from being taken by
        # an allocation of this step (a lookup that finds no slot reads the tile packed)
        for r, (c, s) in enumerate(zip(ctx_lens, seq_lens)):
            if s > c:
                for t in range(max(c // T - W + 1, 0), c // T):
                    sl = self.slot_of.get(tile_block.get((r, t), -1))
                    if sl is not None:
                        used.add(sl)
        for r, (c, s, q0) in enumerate(zip(ctx_lens, seq_lens, q_starts)):
            q_len = s - c
            if q_len <= 0:
                continue
            null = any(b < null_page_blocks for (rr, _), b in tile_block.items() if rr == r)
            nulls.append(null)
            for t in range(c // T, (s - 1) // T + 1):
                if null:
                    break
                blk = tile_block[(r, t)]
                lo, hi = max(c, t * T), min(s, (t + 1) * T)
                staged = t < NS or (c % T and t == c // T) or (t + W) * T > s - STAGE_LAST
                full = hi == (t + 1) * T
                if staged:
                    sl = self.slot_of.get(blk)
                    if sl is None:
                        if lo != t * T:
                            raise StageExhausted(
                                f"KVarN stage: the fp16 rows of tile {t} (block {blk}) were "
                                f"evicted; valid: a stage with more slots")
                        sl = self._alloc(blk, used)
                    used.add(sl)
                    self.last_use[sl] = self.step
                    if t < NS:
                        self.is_sink[sl] = full
                    st_src.extend(range(q0 + lo - c, q0 + hi - c))
                    st_dst.extend(range(sl * T + lo - t * T, sl * T + hi - t * T))
                    if full:
                        p1r.append(sl * T)
                        p1b.append(blk)
                elif full:  # interior tile covered by this step's rows
                    assert lo == t * T
                    p2r.append(q0 + lo - c)
                    p2b.append(blk)
            # attention. The read rule: a query at position p reads the W tiles up to its own
            # p // T in fp16 (stage rows / this step's rows), tiles 0 .. NS - 1 from their sink
            # slots while they live (a prefix: a lost sink tile is read packed, and so is every
            # later one), and the other earlier tiles packed -- the same for prefill, verify and
            # decode.
            sink_sls = self._live_slots(r, range(min(NS, s // T)) if not null else (), tile_block, used)
            if q_len > MAX_QUERY_LEN or (prefill_min_q is not None and q_len >= prefill_min_q):
                # own tiles of a chunk: this step's rows, plus the first tile's earlier rows
                head_sl = self.slot_of.get(tile_block[(r, c // T)]) if c % T and not null else None
                prevs = self._prev_slots(r, c // T, tile_block, used) if not null else []
                pre.append(PrefillJob(
                    req=r, tok0=q0, ctx=c, seq=s, packed=-(-s // T) if null else s // T,
                    sink_rows=tuple(sl * T for sl in sink_sls),
                    tail_row=head_sl * T if head_sl is not None else -1, null=null,
                    prev_rows=tuple(sl * T for sl in prevs)))
                continue
            # pseudo-sequences: at most MAX_QUERY_LEN queries, all in one tile t, which they
            # read from its stage slot (staged: it ends after c >= s - STAGE_LAST)
            a = c
            while a < s:
                t = a // T
                b = min(s, a + MAX_QUERY_LEN, (t + 1) * T)
                pk_i, tail_i, prevs = -(-b // T), -1, []
                if not null:
                    pk_i, tail_i = t, self.slot_of[tile_block[(r, t)]] * T
                    prevs = self._prev_slots(r, t, tile_block, used)
                    pk_i = t - len(prevs)  # tiles [t - len, t) from their slots, not packed
                req.append(r)
                tok0.append(q0 + a - c)
                cu.append(cu[-1] + b - a)
                sl_.append(b)
                pk.append(pk_i)
                sinks_i = [sl * T for sl in sink_sls[:pk_i]]  # sink tiles inside the packed range
                sink.append(sinks_i + [-1] * (MAX_SINKS - len(sinks_i)))
                tail.append(tail_i)
                prev.append([sl * T for sl in prevs] + [-1] * (MAX_PREV - len(prevs)))
                max_q = max(max_q, b - a)
                a = b
        i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
        i32w = lambda x, w: torch.tensor(x, dtype=torch.int32).reshape(len(x), w)  # noqa: E731
        i64 = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        return StepPlan(
            stage_src=i64(st_src), stage_dst=i64(st_dst),
            pack_stage_rows=i32(p1r), pack_stage_blocks=i32(p1b),
            pack_new_rows=i32(p2r), pack_new_blocks=i32(p2b),
            req_index=i64(req), cu_seqlens_q=i32(cu), seq_lens=i32(sl_), packed_tiles=i32(pk),
            sink_tile_rows=i32w(sink, MAX_SINKS), tail_rows=i32(tail),
            prev_tile_rows=i32w(prev, MAX_PREV), max_query_len=max_q,
            max_packed_tiles=max(pk, default=0), num_tokens=cu[-1] + sum(j.q_len for j in pre),
            all_null=bool(nulls) and all(nulls), window=W, sinks=NS, seq_tok0=tok0, prefill=pre)

    def _prev_slots(self, r: int, t: int, tile_block: dict, used: set) -> list[int]:
        """The live slots of the tiles before tile t that its window reads in fp16 (tiles
        t - W + 1 .. t - 1 of request r), ascending and ending with tile t - 1: walking back from
        t - 1, stopping at the first tile whose slot is gone (it and all before it are read
        packed). Kept for this step."""
        return self._live_slots(r, range(t - 1, max(t - self.window, -1), -1), tile_block, used)[::-1]

    def _live_slots(self, r: int, tiles, tile_block: dict, used: set) -> list[int]:
        """The slots of request r's ``tiles``, in that order, up to the first tile whose slot is
        gone (a run: it and every later one are read packed). Kept for this step."""
        out: list[int] = []
        for u in tiles:
            sl = self.slot_of.get(tile_block.get((r, u), -1))
            if sl is None:
                break
            used.add(sl)
            self.last_use[sl] = self.step
            out.append(sl)
        return out


# Rows of the fixed-size plan of a uniform batch (``uniform_rows``): int32 fields, in this order.
# The MAX_SINKS sink columns (sink_rows, sink_rows_1, ..) and the MAX_PREV previous-tile columns
# (prev_rows, prev_rows_1, ..) are consecutive: ``fields[i:i + n].t()`` is the kernel's [rows, n].
SINK_FIELDS = tuple("sink_rows" if j == 0 else f"sink_rows_{j}" for j in range(MAX_SINKS))
PREV_FIELDS = tuple("prev_rows" if j == 0 else f"prev_rows_{j}" for j in range(MAX_PREV))
DECODE_FIELDS = ("cu_seqlens_q", "seq_lens", "packed_tiles", *SINK_FIELDS, "tail_rows", *PREV_FIELDS,
                 "req_index", "pack_rows", "pack_blocks")


def rows_per_request(q_len: int) -> int:
    """Pseudo-sequences a uniform batch lays out per request: one for single-token decode, two for
    a verify block of 2..16 queries (it crosses at most one tile boundary)."""
    return 1 if q_len == 1 else 2


def uniform_rows(plan: StepPlan, q_len: int, num_tokens: int, max_tokens: int, trash_row: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A uniform step's plan (every request ``q_len`` queries: single-token decode, or a
    speculative verify block) laid out in fixed-size host arrays, so that a CUDA graph captured
    for ``num_tokens`` tokens replays it. Request r holds tokens [r * q_len, (r + 1) * q_len) and
    pseudo-sequence rows ``rows_per_request(q_len) * r`` (+ 1): the planner's one or two
    pseudo-sequences of that request, the second empty when the block stays in one tile; a
    request the plan has nothing for (graph padding) gets one row over its tokens with seq_len 0
    (queries that see nothing) and an empty one. ``req_index`` maps a row to its request (its
    block-table row). Rows past the batch are empty. Returns (int32 [len(DECODE_FIELDS),
    2 * max_tokens + 1], int64 [max_tokens]: the stage row each token's rotated K/V goes to,
    ``trash_row`` where nothing is staged). Pack jobs fill the first entries of pack_rows /
    pack_blocks; the rest have block -1 (skipped by the pack kernel). Raises ValueError for a
    plan that is not such a step."""
    Q = int(q_len)
    bad = (f"KVarN uniform rows need a plan of {Q}-query blocks within {max_tokens} tokens; valid: "
           f"a uniform batch (every request {Q} queries, at most two pseudo-sequences each)")
    if not 1 <= Q <= MAX_QUERY_LEN or plan.prefill or plan.pack_new_rows.numel() or num_tokens > max_tokens \
            or num_tokens % Q:
        raise ValueError(bad)
    n_req, k = num_tokens // Q, rows_per_request(Q)
    width = 2 * max_tokens + 1
    # host lists, one tensor at the end (this runs on every step's host path)
    neg = {*SINK_FIELDS, "tail_rows", *PREV_FIELDS, "pack_blocks"}
    out = {name: [-1 if name in neg else 0] * width for name in DECODE_FIELDS}
    cu = plan.cu_seqlens_q.tolist()
    by_req: dict[int, list[int]] = {}
    for i, t0 in enumerate(plan.seq_tok0):
        by_req.setdefault(t0 // Q, []).append(i)
    if any(r >= n_req for r in by_req) or any(len(v) > k for v in by_req.values()):
        raise ValueError(bad)
    fields = ("seq_lens", "packed_tiles", *SINK_FIELDS, "tail_rows", *PREV_FIELDS)
    cols = {name: getattr(plan, name).tolist() for name in ("seq_lens", "packed_tiles", "tail_rows")}
    for names, tab in ((SINK_FIELDS, plan.sink_tile_rows), (PREV_FIELDS, plan.prev_tile_rows)):
        for name, col in zip(names, tab.t().tolist()):
            cols[name] = col
    bounds = [0]
    for r in range(n_req):
        entries = by_req.get(r, [])
        starts = [plan.seq_tok0[i] for i in entries]
        lens = [cu[i + 1] - cu[i] for i in entries]
        if entries and (starts[0] != r * Q or sum(lens) != Q
                        or any(starts[j + 1] != starts[j] + lens[j] for j in range(len(entries) - 1))):
            raise ValueError(bad)
        for j in range(k):
            row = r * k + j
            out["req_index"][row] = r
            if j < len(entries):
                for name in fields:
                    out[name][row] = cols[name][entries[j]]
                bounds.append(bounds[-1] + lens[j])
            else:  # padding: its tokens in the first row (seeing nothing), the second empty
                bounds.append(bounds[-1] + (Q if not entries and j == 0 else 0))
    out["cu_seqlens_q"] = bounds + [bounds[-1]] * (width - len(bounds))
    n_pack = plan.pack_stage_rows.numel()
    if n_pack > n_req:  # a block of <= 16 queries fills at most one tile
        raise ValueError(bad)
    out["pack_rows"][:n_pack] = plan.pack_stage_rows.tolist()
    out["pack_blocks"][:n_pack] = plan.pack_stage_blocks.tolist()
    i32 = torch.tensor([out[name] for name in DECODE_FIELDS], dtype=torch.int32)
    dst = torch.full((max_tokens,), int(trash_row), dtype=torch.int64)
    if plan.stage_src.numel():
        if int(plan.stage_src.max()) >= num_tokens:
            raise ValueError(bad)
        dst[plan.stage_src] = plan.stage_dst
    return i32, dst


def tile_block_ids(block_table_cpu: torch.Tensor, cols: dict, tiles_per_page: int) -> dict:
    """Block ids of tiles from a host copy of the block table: ``cols`` maps request row ->
    tiles. A page of ``tiles_per_page`` tiles is that many consecutive cache blocks."""
    bt = block_table_cpu.tolist() if isinstance(block_table_cpu, torch.Tensor) else block_table_cpu
    return {(r, t): int(bt[r][t // tiles_per_page]) * tiles_per_page + t % tiles_per_page
            for r, ts in cols.items() for t in ts}


def apply_write(plan: StepPlan, key_rot: torch.Tensor, val_rot: torch.Tensor,
                stage_k: torch.Tensor, stage_v: torch.Tensor, cache: torch.Tensor,
                preset: str | Preset | None, pack_rows) -> None:
    """Run a plan's write on one layer: stage rows, then pack every full tile.
    key_rot/val_rot [N, Hkv, D] fp16 rotated; stage_* [slots * tile, Hkv, D] fp16;
    ``pack_rows`` is kernels.kvarn_pack_rows (or a reference with the same signature)."""
    if plan.stage_dst.numel():
        stage_k.index_copy_(0, plan.stage_dst, key_rot.index_select(0, plan.stage_src))
        stage_v.index_copy_(0, plan.stage_dst, val_rot.index_select(0, plan.stage_src))
    if plan.pack_stage_rows.numel():
        pack_rows(stage_k, stage_v, cache, src_rows=plan.pack_stage_rows,
                  blocks=plan.pack_stage_blocks, preset=preset)
    if plan.pack_new_rows.numel():
        pack_rows(key_rot, val_rot, cache, src_rows=plan.pack_new_rows,
                  blocks=plan.pack_new_blocks, preset=preset)


def apply_attention(plan: StepPlan, q: torch.Tensor, out: torch.Tensor, cache: torch.Tensor,
                    stage_k: torch.Tensor, stage_v: torch.Tensor, *, block_table: torch.Tensor,
                    req_block_table: torch.Tensor | None, softmax_scale: float,
                    preset: str | Preset | None, tiles_per_page: int, attention_rows, prefill,
                    max_tokens_per_launch: int = 1024, cu_cpu: list | None = None,
                    key_rot: torch.Tensor | None = None,
                    val_rot: torch.Tensor | None = None) -> None:
    """Run a plan's attention on one layer (after ``apply_write``): pseudo-sequences through
    ``attention_rows`` (kernels.kvarn_attention_rows) in launches of runs contiguous in the
    batch of at most ``max_tokens_per_launch`` tokens; each prefill job through ``prefill``
    (kernels.kvarn_prefill). q / out [N, Hq, D]; ``block_table`` [S', pages] rows of the
    pseudo-sequences; ``req_block_table`` [requests, pages]; ``key_rot`` / ``val_rot`` [N, Hkv,
    D] fp16: this step's rotated rows (what ``apply_write`` got), the prefill jobs' own tiles
    (required when the plan has prefill jobs)."""
    if plan.prefill and (key_rot is None or val_rot is None):
        raise ValueError("KVarN prefill jobs need this step's rotated rows; valid: "
                         "apply_attention(..., key_rot=, val_rot=)")
    T = get_preset(preset).tile
    cu = cu_cpu if cu_cpu is not None else plan.cu_seqlens_q.tolist()
    tok0 = plan.seq_tok0
    i0 = 0
    while i0 < len(cu) - 1:
        i1 = i0 + 1
        while (i1 < len(cu) - 1 and cu[i1 + 1] - cu[i0] <= max_tokens_per_launch
               and tok0[i1] == tok0[i0] + cu[i1] - cu[i0]):
            i1 += 1
        t0, t1 = tok0[i0], tok0[i0] + cu[i1] - cu[i0]
        whole = i0 == 0 and i1 == len(cu) - 1
        attention_rows(
            q[t0:t1], cache, stage_k, stage_v, out[t0:t1],
            cu_seqlens_q=plan.cu_seqlens_q if whole else plan.cu_seqlens_q[i0:i1 + 1] - cu[i0],
            seq_lens=plan.seq_lens[i0:i1], packed_tiles=plan.packed_tiles[i0:i1],
            sink_rows=plan.sink_tile_rows[i0:i1], tail_rows=plan.tail_rows[i0:i1], ring=T,
            prev_rows=plan.prev_tile_rows[i0:i1],
            block_table=block_table[i0:i1], max_query_len=plan.max_query_len,
            softmax_scale=softmax_scale, preset=preset, tiles_per_page=tiles_per_page,
            max_packed_tiles=plan.max_packed_tiles)
        i0 = i1
    for job in plan.prefill:  # one dequantization pass over the prefix per chunk
        t0, t1 = job.tok0, job.tok0 + job.q_len
        prefill(q[t0:t1], cache, stage_k, stage_v, out[t0:t1],
                block_table_row=req_block_table[job.req], ctx_len=job.ctx, seq_len=job.seq,
                packed_tiles=job.packed, sink_rows=job.sink_rows, tail_row=job.tail_row, ring=T,
                fp16_window=plan.window, prev_rows=job.prev_rows,
                new_k=key_rot[t0:t1], new_v=val_rot[t0:t1],
                softmax_scale=softmax_scale, preset=preset, tiles_per_page=tiles_per_page)
