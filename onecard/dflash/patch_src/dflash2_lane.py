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
