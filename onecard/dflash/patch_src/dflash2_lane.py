# SPDX-License-Identifier: Apache-2.0
# onecard 0080 (DFlash2): the pure parts of the DFlash2 proposer, plain torch, no CUDA needed.
"""DFlash2 drafting pieces that do not touch the model or the runner.

* ``selector_walk``: the DFlash2 selector walk over the per-position top-k candidates, for a
  batch (greedy, or sampled from softmax(scores / T) with the distribution it sampled from).
* ``candidate_probs_to_rows``: the sampled walk's candidate distributions as full-vocab q rows.
* ``LookupLane`` / ``LaneBook``: the lookup lane, an incremental suffix index per request that
  proposes tokens for the verify positions past the drafter's block.
* ``assemble_block``: drafter rows + lookup tokens (+ fill) -> one row of ``k`` draft ids.
* ``DeviceLane`` (+ ``lane_query`` / ``lane_match_torch`` / ``lane_match_triton`` /
  ``lane_tokens``): the same lookup lane on the device, with no host sync per step (its match is
  one Triton kernel on CUDA, plain torch elsewhere).

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


# ---------------------------------------------------------------------------------------------
# The lookup lane on the device (ONECARD_DFLASH_LANE=device, the default): the same suffix match
# as LookupLane, computed on the GPU over a per-slot token history, so a step with k > block rows
# has no device-to-host copy and no host wait (docs/dflash2-host-overhead.md §3). The history of
# a slot (RingSlots, max_num_seqs slots) is seeded once from the host (prompt + known outputs,
# one pinned non-blocking copy) and then fed on the device with each step's accepted tokens.
# Unlike LookupLane it considers every earlier occurrence of the key, not only the
# max_candidates most recent; where a key occurs at most max_candidates times the two pick the
# same tokens (tests/dflash/test_device_lane.py). Lookup tokens are proposals with one-hot q
# rows, so any deterministic choice keeps greedy and sampled output exact.

LANE_ENV = "ONECARD_DFLASH_LANE"
LANE_MODES = ("device", "host")
_NO_TOKEN = -4  # query position before the sequence start: never equal to a history token
_PAD = -3  # history position before 0 (torch path) / outside the row (Triton path)
LANE_BLOCK = 1024  # end positions per program of the Triton match (dflash2_lane_kernel.py)


def lane_mode(environ: dict | None = None) -> str:
    """ONECARD_DFLASH_LANE: "device" (the default; suffix match on the GPU, no host sync) or
    "host" (LookupLane on the CPU, one device-to-host copy per step with k > block rows)."""
    import os

    value = (os.environ if environ is None else environ).get(LANE_ENV, "").strip() or "device"
    if value not in LANE_MODES:
        raise ValueError(f"{LANE_ENV}={value!r} is not valid; valid: device (the default: the "
                         "lookup lane's match on the GPU) or host (on the CPU, one sync per step)")
    return value


def lane_query(hist: torch.Tensor, slot_idx: torch.Tensor, count: torch.Tensor,
               drafts: torch.Tensor, max_match: int) -> torch.Tensor:
    """[B, max_match] int32: the last max_match tokens of history + drafts, newest first
    (column j = j-th token from the end); positions before the start are _NO_TOKEN."""
    b, rows = drafts.shape
    dev = drafts.device
    j = torch.arange(max_match, device=dev, dtype=torch.int64)
    pos = count[:, None] + (rows - 1) - j[None, :]  # [B, M] position in history + drafts
    from_drafts = pos >= count[:, None]
    d_idx = (pos - count[:, None]).clamp(0, max(rows - 1, 0))
    flat = slot_idx[:, None] * hist.shape[1] + pos.clamp(0, hist.shape[1] - 1)
    from_hist = hist.view(-1)[flat.view(-1)].view(b, max_match).to(torch.int64)
    tok = torch.where(from_drafts, drafts.to(torch.int64).gather(1, d_idx), from_hist)
    return torch.where(pos >= 0, tok, _NO_TOKEN).to(torch.int32)


def _score(length: torch.Tensor, ends: torch.Tensor, count: torch.Tensor, key_len: int,
           want: int) -> torch.Tensor:
    """Lexicographic (match length, tokens available up to want, recency) packed in int64;
    -1 where the end is not a candidate (match shorter than the key, or no token after it)."""
    avail = torch.minimum(count[:, None] - ends, torch.full_like(ends, want))
    score = ((length.to(torch.int64) * (want + 1) + avail) << 32) | ends
    ok = (length >= key_len) & (ends >= key_len) & (ends < count[:, None])
    return torch.where(ok, score, -1)


def lane_match_torch(hist: torch.Tensor, slot_idx: torch.Tensor, count: torch.Tensor,
                     query: torch.Tensor, key_len: int, want: int) -> torch.Tensor:
    """[B] int64 best score over all end positions (-1: no match); plain torch, memory
    B x width x max_match bytes (the CPU path and the reference of the Triton kernel)."""
    b, m = query.shape
    width = hist.shape[1]
    rows = hist.index_select(0, slot_idx)
    padded = torch.cat([torch.full((b, m), _PAD, dtype=hist.dtype, device=hist.device), rows], 1)
    # window at end e covers history e-m .. e-1, oldest first: compare to the query reversed
    win = padded.unfold(1, m, 1)[:, :width]  # [B, width, m]
    eq = win == query.flip(1)[:, None, :].to(hist.dtype)
    # trailing run of matches = m - (last mismatch index + 1)
    idx = torch.arange(1, m + 1, device=hist.device, dtype=torch.int16)
    length = m - torch.where(eq, 0, idx).amax(-1).to(torch.int64)
    ends = torch.arange(width, device=hist.device, dtype=torch.int64)[None, :].expand(b, width)
    return _score(length, ends, count, key_len, want).amax(-1)


def lane_match_triton(hist: torch.Tensor, slot_idx: torch.Tensor, count: torch.Tensor,
                      query: torch.Tensor, key_len: int, want: int,
                      block: int = LANE_BLOCK) -> torch.Tensor:
    """lane_match_torch as one Triton launch (+ one max over the per-program maxima); the
    kernel lives in dflash2_lane_kernel.py so that this module stays importable without Triton."""
    from vllm.v1.spec_decode.dflash2_lane_kernel import lane_match

    return lane_match(hist, slot_idx, count, query, key_len, want, block, _PAD)


def lane_tokens(hist: torch.Tensor, slot_idx: torch.Tensor, count: torch.Tensor,
                score: torch.Tensor, drafts: torch.Tensor, k: int,
                max_model_len: int) -> torch.Tensor:
    """[B, k]: the drafts, then up to k - rows tokens copied from after the best match (at most
    to the end of the history and within max_model_len), then the last token repeated
    (assemble_block's rule)."""
    b, rows = drafts.shape
    cap = k - rows
    found = score >= 0
    end = torch.where(found, score & 0xFFFFFFFF, 0)
    room = max_model_len - count - rows - 1
    n = torch.minimum(torch.minimum(count - end, room), torch.full_like(end, cap))
    n = torch.where(found, n, 0).clamp(min=0)
    t = torch.arange(cap, device=drafts.device, dtype=torch.int64)[None, :]
    pos = end[:, None] + torch.minimum(t, (n - 1).clamp(min=0)[:, None])
    flat = slot_idx[:, None] * hist.shape[1] + pos.clamp(max=hist.shape[1] - 1)
    copied = hist.view(-1)[flat.view(-1)].view(b, cap).to(drafts.dtype)
    fill = drafts[:, -1:].expand(b, cap)
    return torch.cat([drafts, torch.where((n > 0)[:, None], copied, fill)], 1)


class DeviceLane:
    """The lookup lane's state on the device: one token-history row per slot (+ a scratch row
    for batch padding) and its length; the request -> slot map lives on the host."""

    def __init__(self, slots: int, max_model_len: int, k_max: int, key_len: int = 2,
                 max_match: int = 16, device: torch.device | str = "cpu"):
        if key_len < 1 or max_match < key_len:
            raise ValueError("dflash2 lookup lane: need 1 <= key_len <= max_match")
        self.slots = RingSlots(slots)
        self.key_len, self.max_match = key_len, max_match
        self.max_model_len = max_model_len
        self.scratch = slots
        width = -(-(max_model_len + k_max + 2) // 16) * 16  # rows 64-byte aligned for the kernel
        self.hist = torch.zeros(slots + 1, width, dtype=torch.int32, device=device)
        self.count = torch.zeros(slots + 1, dtype=torch.int64, device=device)
        self._batch: tuple = ()
        self._slot_idx: torch.Tensor | None = None
        self._real: torch.Tensor | None = None
        self.fresh_rows: set[int] = set()  # batch rows seeded by the last bind that changed it
        self.use_triton = self.hist.is_cuda  # the match: Triton on CUDA, else plain torch

    @property
    def nbytes(self) -> int:
        return self.hist.numel() * self.hist.element_size() + self.count.numel() * 8

    def upload(self, values, dtype: torch.dtype) -> torch.Tensor:
        """Host values -> the lane's device, pinned and non-blocking (no stream sync)."""
        t = torch.as_tensor(values, dtype=dtype)
        if self.hist.is_cuda:
            t = t.pin_memory()
        return t.to(self.hist.device, non_blocking=True)

    def bind(self, req_ids: Sequence[str | None], alive: Callable[[str], bool],
             history: Callable[[str], Sequence[int]]) -> torch.Tensor:
        """Slots for this batch (rows without a request use the scratch row); a request seen
        for the first time is seeded with ``history(req_id)``. Host work only when the batch's
        request ids change."""
        key = tuple(req_ids)
        if key == self._batch and self._slot_idx is not None:
            self.fresh_rows = set()
            return self._slot_idx
        real = [r for r in req_ids if r is not None]
        slots, fresh = self.slots.assign(real, alive)
        by_id = dict(zip(real, slots))
        for rid, slot in by_id.items():
            if slot not in fresh:
                continue
            ids = torch.as_tensor(list(history(rid)), dtype=torch.int64)
            ids = ids[ids >= 0][: self.hist.shape[1]]
            if ids.numel():
                self.hist[slot, : ids.numel()].copy_(self.upload(ids, torch.int32),
                                                     non_blocking=True)
            self.count[slot] = int(ids.numel())
        self.fresh_rows = {i for i, r in enumerate(req_ids) if r is not None and by_id[r] in fresh}
        idx = [by_id[r] if r is not None else self.scratch for r in req_ids]
        self._slot_idx = self.upload(idx, torch.int64)
        self._real = self.upload([r is not None for r in req_ids], torch.bool)
        self._batch = key
        return self._slot_idx

    def append(self, sampled: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Write each row's accepted tokens (the first ``valid`` of ``sampled``; -1 = none)
        after its history; no host sync. Rows without a request write nothing."""
        assert self._slot_idx is not None and self._real is not None
        b = self._slot_idx.shape[0]
        sampled = sampled[:b].to(self.hist.device)
        width = sampled.shape[1]
        if valid is None:
            valid = (sampled >= 0).sum(1)
        valid = torch.where(self._real, valid[:b].to(self.count.dtype), 0)
        j = torch.arange(width, device=self.hist.device, dtype=torch.int64)[None, :]
        base = self.count.index_select(0, self._slot_idx)
        pos = base[:, None] + j
        keep = (j < valid[:, None]) & (pos < self.hist.shape[1])
        flat = torch.where(keep, self._slot_idx[:, None] * self.hist.shape[1] + pos,
                           self.scratch * self.hist.shape[1])  # dropped: scratch row, col 0
        self.hist.view(-1).index_put_((flat.view(-1),), sampled.reshape(-1).to(self.hist.dtype)
                                      .where(keep.view(-1), 0))
        self.count.index_add_(0, self._slot_idx, valid)  # padding rows add 0

    def rows(self, drafts: torch.Tensor, k: int, use_triton: bool | None = None) -> torch.Tensor:
        """[B, k] draft ids for the bound batch: drafts, lookup tokens, fill."""
        assert self._slot_idx is not None
        b = drafts.shape[0]
        slot_idx = self._slot_idx[:b]
        count = self.count.index_select(0, slot_idx)
        query = lane_query(self.hist, slot_idx, count, drafts, self.max_match)
        want = k - drafts.shape[1]
        if use_triton is None:
            use_triton = self.use_triton
        match = lane_match_triton if use_triton else lane_match_torch
        score = match(self.hist, slot_idx, count, query, self.key_len, want)
        return lane_tokens(self.hist, slot_idx, count, score, drafts, k, self.max_model_len)
