# SPDX-License-Identifier: Apache-2.0
# onecard 0080 (DFlash2): the pure parts of the DFlash2 proposer, plain torch, no CUDA needed.
"""DFlash2 drafting pieces that do not touch the model or the runner.

* ``selector_walk``: the DFlash2 selector walk over the per-position top-k candidates, for a
  batch (greedy, or sampled from softmax(scores / T) with the distribution it sampled from).
* ``candidate_probs_to_rows``: the sampled walk's candidate distributions as full-vocab q rows.
* ``LookupLane`` / ``LaneBook``: the lookup lane, an incremental suffix index per request that
  proposes tokens for the verify positions past the drafter's block.
* ``assemble_block``: drafter rows + lookup tokens (+ fill) -> one row of ``k`` draft ids.

Every token produced here is a proposal only: vLLM's verify pass and rejection sampler decide
what is emitted, so any deterministic rule (greedy walk, lookup, fill) keeps greedy decoding
exact, and sampled drafts keep sampling exact when their q rows are handed to the sampler.
The reference these are tested against is onecard.dflash (select.py, lookup.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

GREEDY_EPS = 1e-5  # vLLM stores temperature 0.0 for greedy requests


def selector_walk(
    unary: torch.Tensor,
    cand_ids: torch.Tensor,
    hproj: torch.Tensor,
    anchors: torch.Tensor,
    predecessor: torch.Tensor,
    successor: torch.Tensor,
    temperature: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The walk for a batch: T sequential steps of gather + [B,k,R]x[B,R] + pick.

    unary, cand_ids: [B, T, k] (top-k logits, best first, and their ids); hproj: [B, T, R]
    (hidden_projection of the mask rows); anchors: [B]; predecessor, successor: [V, R];
    temperature: [B] (<= GREEDY_EPS: greedy row; None: all greedy); uniforms: [B, T].
    S_t(a, b) = U_t(b) + <predecessor[a] * hproj_t, successor[b]>.
    Returns (tokens [B, T] int64, candidate probabilities [B, T, k] float32 or None when
    every row is greedy; greedy rows of a mixed batch get one-hot rows at their pick).
    """
    b, t_len, k = cand_ids.shape
    dev = cand_ids.device
    tokens = torch.empty(b, t_len, dtype=torch.long, device=dev)
    # No host sync anywhere below (a sync per position stalled the step behind the GPU queue:
    # docs/dflash2-host-overhead.md). The caller passes ``temperature`` only when some row
    # samples (vLLM's host-side all_greedy); greedy rows of a sampled batch still take argmax.
    sampled = temperature is not None
    cprobs = (
        torch.zeros(b, t_len, k, dtype=torch.float32, device=dev) if sampled else None
    )
    prev = anchors.to(device=dev, dtype=torch.long)
    rows = torch.arange(b, device=dev)
    unary = unary.float()
    hproj = hproj.float()
    if sampled:
        assert uniforms is not None
        is_sampled = temperature.to(dev) > GREEDY_EPS
        temp = temperature.to(device=dev, dtype=torch.float32).clamp_min(GREEDY_EPS)
        col = torch.arange(k, device=dev)
    for t in range(t_len):
        cand_t = cand_ids[:, t].long()
        succ = successor[cand_t].float()                                   # [B, k, R]
        pred = predecessor[prev].float() * hproj[:, t]                     # [B, R]
        scores = unary[:, t] + torch.einsum("bkr,br->bk", succ, pred)      # [B, k]
        j = scores.argmax(-1)
        if sampled:
            p = torch.softmax(scores / temp[:, None], -1)
            cdf = torch.cumsum(p.double(), -1)
            u = uniforms[:, t].to(device=dev, dtype=torch.float64)[:, None].contiguous()
            js = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(k - 1)
            js = step_back_to_nonzero(p, js, col)
            j = torch.where(is_sampled, js, j)
            onehot = torch.nn.functional.one_hot(j, k).float()
            cprobs[:, t] = torch.where(is_sampled[:, None], p, onehot)
        prev = cand_t[rows, j]
        tokens[:, t] = prev
    return tokens, cprobs


def step_back_to_nonzero(p: torch.Tensor, js: torch.Tensor, col: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """The largest index i <= js[b] with p[b, i] != 0, else 0: a sampled pick that landed on a
    zero-probability candidate (rounding at the top of the CDF) steps back to the nearest
    candidate it could have drawn. p [B, k], js [B] -> [B]; no host sync (one masked max, the
    same result as stepping back one index at a time)."""
    if col is None:
        col = torch.arange(p.shape[-1], device=p.device)
    ok = ((p != 0) | (col == 0)) & (col <= js[:, None])
    return torch.where(ok, col, -1).amax(-1)


def candidate_probs_to_rows(
    cand_ids: torch.Tensor, cprobs: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """[B, T, k] candidate probabilities -> [B, T, V] q rows (zero outside the candidates)."""
    b, t_len, _ = cand_ids.shape
    out = torch.zeros(b, t_len, vocab_size, dtype=torch.float32, device=cprobs.device)
    return out.scatter_(2, cand_ids.long(), cprobs.float())


def one_hot_rows(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q rows of deterministic proposals (lookup / fill tokens): one-hot, float32."""
    out = torch.zeros(*tokens.shape, vocab_size, dtype=torch.float32, device=tokens.device)
    return out.scatter_(-1, tokens.long().unsqueeze(-1), 1.0)


class LookupLane:
    """Incremental suffix index over one request's prompt + generated tokens.

    ``append`` is O(1) amortized (key_len-gram -> the max_candidates most recent end
    positions); ``propose`` examines at most max_candidates occurrences, extending each match
    backwards at most max_match tokens, whatever the context length. Best occurrence = longest
    match, then most tokens available (up to cap), then most recent. Never proposes past the
    known sequence or past ``room``.
    """

    def __init__(self, key_len: int = 2, max_match: int = 16, max_candidates: int = 8):
        if key_len < 1 or max_match < key_len or max_candidates < 1:
            raise ValueError(
                "dflash2 lookup lane: need 1 <= key_len <= max_match and "
                "max_candidates >= 1"
            )
        self.key_len = key_len
        self.max_match = max_match
        self.max_candidates = max_candidates
        self.ids: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def append(self, token: int) -> None:
        ids = self.ids
        ids.append(int(token))
        n = len(ids)
        if n >= self.key_len:
            key = tuple(ids[n - self.key_len :])
            ends = self._index.get(key)
            if ends is None:
                self._index[key] = [n]
            else:
                ends.append(n)
                if len(ends) > self.max_candidates:
                    del ends[0]

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def match(self, drafts: Sequence[int] = (), want: int = 1) -> tuple[int, int]:
        """(end, length) of the best earlier occurrence of the suffix of ids + drafts."""
        ids = self.ids
        n = len(ids)
        total = n + len(drafts)
        if total < self.key_len:
            return 0, 0

        def q(i: int) -> int:  # i-th token from the end of the query (0 = last)
            j = total - 1 - i
            return drafts[j - n] if j >= n else ids[j]

        key = tuple(q(i) for i in range(self.key_len - 1, -1, -1))
        best_end, best_len, best_avail = 0, 0, 0
        limit_all = min(self.max_match, total)
        for end in reversed(self._index.get(key, ())):  # most recent first
            if end >= n:
                continue
            length = self.key_len
            limit = min(limit_all, end)
            while length < limit and ids[end - 1 - length] == q(length):
                length += 1
            avail = min(n - end, want)
            if (length, avail) > (best_len, best_avail):
                best_end, best_len, best_avail = end, length, avail
                if length == limit_all and avail == want:
                    break
        return best_end, best_len

    def propose(
        self, drafts: Sequence[int] = (), cap: int = 8, room: int | None = None
    ) -> list[int]:
        if cap <= 0 or (room is not None and room <= 0):
            return []
        end, length = self.match(drafts, want=cap)
        if length == 0:
            return []
        n = min(cap, len(self.ids) - end, room if room is not None else cap)
        return self.ids[end : end + n]


class LaneBook:
    """One LookupLane per request id, fed with each step's accepted tokens."""

    def __init__(self, key_len: int = 2, max_match: int = 16, max_candidates: int = 8):
        self.params = (key_len, max_match, max_candidates)
        self.lanes: dict[str, LookupLane] = {}

    def lane(self, req_id: str, history: Callable[[], Iterable[int]]) -> LookupLane:
        """The request's lane; a new one is seeded from ``history()`` (prompt + outputs)."""
        lane = self.lanes.get(req_id)
        if lane is None:
            lane = LookupLane(*self.params)
            lane.extend(t for t in history() if t >= 0)
            self.lanes[req_id] = lane
        return lane

    def prune(self, alive: Callable[[str], bool]) -> None:
        for rid in [r for r in self.lanes if not alive(r)]:
            del self.lanes[rid]


def assemble_block(
    drafts: Sequence[int], lookup: Sequence[int], k: int
) -> list[int]:
    """``k`` draft ids: the drafter's rows, then lookup tokens, then the last known token
    repeated (a valid id the target verifies like any other proposal)."""
    row = list(drafts[:k]) + list(lookup[: max(0, k - len(drafts))])
    fill = row[-1] if row else 0
    return row + [fill] * (k - len(row))


# ---------------------------------------------------------------------------------------------
# Ring mode (ONECARD_DFLASH_RING=1, docs/dflash2-huge.md §3 design (d)): the drafter's K/V live
# in one private paged tensor per drafter layer instead of vLLM's KV pool. Each live request owns
# a slot of ``blocks_per_slot`` blocks of RING_BLOCK rows; its logical block j sits at physical
# block ``slot * blocks_per_slot + j % blocks_per_slot``. A sliding-window drafter never reads a
# position more than ``window - 1`` behind its newest query, so the wrap is invisible while a slot
# holds window + k_max + 1 rows. The geometry below is the formula of onecard/dflash/ring.py,
# duplicated because the vLLM side cannot import onecard; tests/dflash/test_ring_mode.py checks
# the two agree.

RING_ENV = "ONECARD_DFLASH_RING"
RING_BLOCK = 16  # rows per ring block: FlashAttention's paged KV needs a multiple of 16
SLIDING_ATTENTION = "sliding_attention"


def ring_mode_enabled(environ: dict | None = None) -> bool:
    """ONECARD_DFLASH_RING: "1" keeps the drafter's K/V in per-request rings, "0"/unset in vLLM's
    pool (the default)."""
    import os

    value = (os.environ if environ is None else environ).get(RING_ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"{RING_ENV}={value!r} is not valid; valid: 0 (drafter K/V in vLLM's "
                         "pool, the default) or 1 (per-request rings)")
    return value == "1"


def ring_blocks(window: int, k_max: int) -> int:
    """Blocks of RING_BLOCK rows per request slot (onecard/dflash/ring.py ring_blocks)."""
    return -(-(window + k_max + 1) // RING_BLOCK)


def ring_total_blocks(slots: int, window: int, k_max: int) -> int:
    """Physical blocks of one layer's ring: every slot plus one spare block
    (onecard/dflash/ring.py ring_total_blocks)."""
    return slots * ring_blocks(window, k_max) + 1


def physical_block(slot: int, logical_block: int, blocks_per_slot: int) -> int:
    """Where a request's logical block lands (onecard/dflash/ring.py physical_block)."""
    return slot * blocks_per_slot + logical_block % blocks_per_slot


def ring_window(hf_config) -> int:
    """The drafter's sliding window, refusing a drafter whose layers are not all sliding-window.

    All layers slide when ``dflash_config.use_swa`` or the top-level ``use_sliding_window`` is
    true (onecard.dflash.config's reading of the published drafters; transformers may fill
    ``layer_types`` with "full_attention" from ``max_window_layers`` then, which is ignored), or
    when ``layer_types`` lists only "sliding_attention". The window is
    ``dflash_config.swa_window_size``, else the top-level ``sliding_window``.
    """
    dc = getattr(hf_config, "dflash_config", None) or {}
    layer_types = list(getattr(hf_config, "layer_types", None) or [])
    flagged = bool(dc.get("use_swa", False)) or bool(getattr(hf_config, "use_sliding_window",
                                                               False))
    all_sliding = bool(layer_types) and all(t == SLIDING_ATTENTION for t in layer_types)
    mixed = SLIDING_ATTENTION in layer_types and not all_sliding
    if mixed or not (flagged or all_sliding):
        raise ValueError(
            f"{RING_ENV}=1 needs a drafter whose every layer is sliding-window, but this one has "
            f"use_sliding_window={getattr(hf_config, 'use_sliding_window', None)!r}, "
            f"dflash_config.use_swa={dc.get('use_swa')!r}, layer_types={layer_types or None!r}; "
            "valid: use_sliding_window true (or dflash_config.use_swa true, or layer_types all "
            f"{SLIDING_ATTENTION}) with sliding_window >= 1, or {RING_ENV}=0")
    window = dc.get("swa_window_size", getattr(hf_config, "sliding_window", None))
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"{RING_ENV}=1: the drafter's sliding window is {window!r}; valid: "
            "dflash_config.swa_window_size or sliding_window, an int >= 1")
    return window


def ring_rows_table(slots: int, blocks_per_slot: int, width: int,
                    device: torch.device | str | None = None,
                    spare_row: bool = False) -> torch.Tensor:
    """[slots, width] int32: row s is slot s's block table (physical_block for j = 0..width-1).
    ``spare_row``: one more row (index ``slots``) pointing every block at the spare block
    ``slots * blocks_per_slot``, for the batch's padding rows (their writes land there)."""
    if slots < 1 or blocks_per_slot < 1 or width < 1:
        raise ValueError(f"ring table slots={slots}, blocks_per_slot={blocks_per_slot}, "
                         f"width={width}; valid: each an int >= 1")
    j = torch.arange(width, dtype=torch.int64, device=device)
    s = torch.arange(slots + int(spare_row), dtype=torch.int64, device=device)
    table = s[:, None] * blocks_per_slot + j[None, :] % blocks_per_slot
    if spare_row:
        table[slots] = slots * blocks_per_slot
    return table.to(torch.int32)


def ring_block_table(rows_table: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """The drafter's block table for a batch: the ring rows of each request's slot, [B, width]."""
    return rows_table.index_select(0, slot_ids.to(device=rows_table.device, dtype=torch.long))


class RingSlots:
    """Request id -> ring slot, for at most ``slots`` live requests (slots = max_num_seqs).

    ``assign`` gives every request of a batch a slot, keeping the one it had. A new request takes
    a free slot; when none is free, slots of requests that are no longer alive (finished: not in
    the runner's requests) are freed first, then slots of requests outside this batch (their rows
    are lost: drafts only). It returns the slots in batch order and the slots handed out fresh,
    whose rows the caller clears.
    """

    def __init__(self, slots: int):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"ring slots={slots!r} is not valid; valid: max_num_seqs, an int >= 1")
        self.slots = slots
        self.owner: dict[str, int] = {}
        self.free_slots: list[int] = list(range(slots - 1, -1, -1))  # pop() gives 0 first

    def free(self, req_id: str) -> None:
        slot = self.owner.pop(req_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def _reclaim(self, keep: Callable[[str], bool]) -> None:
        for rid in [r for r in self.owner if not keep(r)]:
            self.free(rid)

    def assign(self, req_ids: Sequence[str],
               alive: Callable[[str], bool] | None = None) -> tuple[list[int], list[int]]:
        if len(set(req_ids)) > self.slots:
            raise ValueError(
                f"ring slots exhausted: {len(set(req_ids))} requests in one batch, "
                f"{self.slots} slots; valid: at most max_num_seqs={self.slots} requests")
        batch = set(req_ids)
        fresh: list[int] = []
        out: list[int] = []
        for rid in req_ids:
            slot = self.owner.get(rid)
            if slot is None:
                if not self.free_slots and alive is not None:
                    self._reclaim(lambda r: alive(r) or r in batch)
                if not self.free_slots:
                    self._reclaim(lambda r: r in batch)
                slot = self.free_slots.pop()
                self.owner[rid] = slot
                fresh.append(slot)
            out.append(slot)
        return out, fresh


def ring_filter_context_slots(slot_mapping: torch.Tensor, context_positions: torch.Tensor,
                              query_start_loc: torch.Tensor, query_positions: torch.Tensor,
                              batch_size: int, query_rows: int, k_max: int,
                              ring_rows: int) -> torch.Tensor:
    """Set to -1 (in place) the context slots a request's ring cannot hold this step.

    A request whose query block starts at position S writes context rows up to S + k_max - 1
    (rejected verify rows included) and query rows S..S + query_rows - 1 <= S + k_max; its ring
    holds ``ring_rows`` >= window + k_max + 1 distinct rows, so keeping only context positions
    >= S + k_max + 1 - ring_rows makes every write of the step land on a distinct ring row (a
    prefill chunk longer than the ring would otherwise write two positions to one row in the same
    kernel) while keeping all rows the window reads (>= S - window + 1). Rows past the batch's
    last request get -1 too. Cache writes skip negative slots. No host sync.
    """
    n = slot_mapping.shape[0]
    if n == 0:
        return slot_mapping
    qsl = query_start_loc[1:batch_size + 1]
    idx = torch.arange(n, device=slot_mapping.device, dtype=qsl.dtype)
    req = torch.searchsorted(qsl.contiguous(), idx, right=True)
    inside = req < batch_size
    first_q = query_positions[req.clamp(max=batch_size - 1).long() * query_rows]
    keep = inside & (context_positions.long() >= first_q.long() + (k_max + 1 - ring_rows))
    slot_mapping.masked_fill_(~keep, -1)
    return slot_mapping
