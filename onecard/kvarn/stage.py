# SPDX-License-Identifier: Apache-2.0
"""The fp16 stage of the vLLM integration and the per-step plan (pure Python + torch, no vLLM).

vLLM's attention backends see no request identity, only block tables, so the stage is keyed
by the *physical block of a tile*: a stage slot holds the ``tile`` fp16 rotated rows of one
tile (rows ``slot * tile + p % tile``). A tile being written is private to its request (vLLM
never writes into a block a prefix-cache hit shares), so its block id names it; the first
tile's slot is kept after it fills and serves as the fp16 sink (shared by requests that share
that block through the prefix cache, whose contents are identical).

Per step, for every request (context ``c`` committed tokens, ``s`` after this step's tokens):

* Staged tiles: tile 0 whenever written, the tile holding ``c`` when ``c`` is mid-tile (its
  earlier rows are only in the stage), and every tile ending after ``s - STAGE_LAST`` (drafts
  that may be rejected live there; a tile that becomes partial again needs its fp16 rows).
  New rows of staged tiles go to their slot.
* Every tile that is full after the write is packed: staged ones from their slot, the others
  (interior tiles of a long prefill chunk) straight from the new rotated rows.
* Attention reads tiles ``[0, s // tile)`` packed (tile 0 from its sink slot when it has one)
  and positions ``[s // tile * tile, s)`` from the slot of the partial tile.
* A query run longer than ``MAX_QUERY_LEN`` (a prefill chunk) is split into pseudo-sequences
  of 16 queries; pseudo-sequence i ends at ``c + 16 (i + 1)`` and reads the tile holding its
  last key packed (masked by causality) unless that tile is the partial one.
* Slots of tiles that are committed and not tile 0 (``(t + 1) * tile <= c - STAGE_LAST``: a
  drafter's build may pass unverified positions as context) are released;
  others age out LRU (sinks first). Running out of slots is an error, never a silent reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .format import Preset, get_preset

MAX_QUERY_LEN = 16
STAGE_LAST = 16  # tiles ending after s - STAGE_LAST stay staged (>= k + 1 of any speculation)


def default_num_slots(max_num_seqs: int) -> int:
    """Stage slots per layer: a sink and up to two staged tiles per request, plus spares."""
    return 3 * max(1, int(max_num_seqs)) + 4


class StageExhausted(RuntimeError):
    pass


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
    sink_rows: torch.Tensor  # [S'] int32 (-1: tile 0 read packed)
    tail_rows: torch.Tensor  # [S'] int32 (-1: no tail)
    max_query_len: int
    max_packed_tiles: int
    num_tokens: int
    all_null: bool = False  # every request sits on vLLM's null page (a dummy run)

    def to(self, device) -> "StepPlan":
        kw = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
              for k, v in self.__dict__.items()}
        return StepPlan(**kw)


class StagePlanner:
    """Stage-slot bookkeeping (CPU) shared by all KVarN layers of one KV-cache group."""

    def __init__(self, preset: str | Preset | None, num_slots: int, tiles_per_page: int = 1):
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
        need = {0, *range(first_w, last_w + 1)}
        need.update(t for t in (first_w - 1, first_w - 2, first_w - 3) if t >= 1)
        return sorted(t for t in need if t * T < max(seq, 1))

    def plan(self, ctx_lens: list[int], seq_lens: list[int], q_starts: list[int],
             tile_block: dict, null_page_blocks: int = 0) -> StepPlan:
        """``tile_block[(r, t)]`` = block id of tile t of request r for every t in
        ``tile_cols(ctx_lens[r], seq_lens[r])``. A request with a tile in a block below
        ``null_page_blocks`` (vLLM's null page 0: dummy and profile runs) writes nothing and
        reads its tiles packed (garbage in, garbage out, nothing staged)."""
        T = self.tile
        self.step += 1
        used: set[int] = set()
        st_src, st_dst, p1r, p1b, p2r, p2b = [], [], [], [], [], []
        req, cu, sl_, pk, sink, tail = [], [0], [], [], [], []
        max_q = 1
        nulls = []
        # release committed, non-sink tiles first so allocation has room. A drafter's metadata
        # build passes unverified positions as context (at most STAGE_LAST ahead of what the
        # target committed), so a tile counts as committed only STAGE_LAST tokens later.
        for r, (c, s) in enumerate(zip(ctx_lens, seq_lens)):
            for t in (c // T - 1, c // T - 2, c // T - 3):
                if t >= 1 and (t + 1) * T <= c - STAGE_LAST and (r, t) in tile_block:
                    self._release(tile_block[(r, t)])
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
                staged = t == 0 or (c % T and t == c // T) or (t + 1) * T > s - STAGE_LAST
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
                    if t == 0:
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
            # attention pseudo-sequences
            sink_sl = self.slot_of.get(tile_block.get((r, 0), -1)) if s >= T and not null else None
            if sink_sl is not None:
                used.add(sink_sl)
                self.last_use[sink_sl] = self.step
            part_t = s // T  # the partial tile (if s % T)
            tail_sl = self.slot_of.get(tile_block[(r, part_t)]) if s % T and not null else None
            for i0 in range(0, q_len, MAX_QUERY_LEN):
                n = min(MAX_QUERY_LEN, q_len - i0)
                si = c + i0 + n
                if s % T and si > part_t * T and not null:
                    pk_i, tail_i = part_t, tail_sl * T
                else:
                    pk_i, tail_i = -(-si // T), -1
                req.append(r)
                cu.append(cu[-1] + n)
                sl_.append(si)
                pk.append(pk_i)
                sink.append(sink_sl * T if sink_sl is not None and pk_i >= 1 else -1)
                tail.append(tail_i)
                max_q = max(max_q, n)
        i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
        i64 = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        return StepPlan(
            stage_src=i64(st_src), stage_dst=i64(st_dst),
            pack_stage_rows=i32(p1r), pack_stage_blocks=i32(p1b),
            pack_new_rows=i32(p2r), pack_new_blocks=i32(p2b),
            req_index=i64(req), cu_seqlens_q=i32(cu), seq_lens=i32(sl_), packed_tiles=i32(pk),
            sink_rows=i32(sink), tail_rows=i32(tail), max_query_len=max_q,
            max_packed_tiles=max(pk, default=0), num_tokens=cu[-1],
            all_null=bool(nulls) and all(nulls))


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
