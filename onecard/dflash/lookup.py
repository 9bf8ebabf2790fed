"""The lookup lane: extend a verify block with tokens copied from the request's own context.

With ``DFLASH_TOKENS`` > the drafter's ``block_size - 1`` drafts, the positions past the
drafter's block are filled by a suffix match: take the sequence *as it would read if every
draft were accepted* (prompt + generated + drafts), find an earlier place in prompt + generated
where the same suffix occurred, and propose the tokens that followed it there. When the answer
quotes the prompt this is nearly free and nearly always right.

Index and cost (documented bound, tested on a 100k-token context):

- ``append`` adds one token in O(1) amortized: the ``key_len``-gram ending at it is recorded
  under its key, keeping only the ``max_candidates`` most recent end positions per key
  (list of at most ``max_candidates`` ints; trimming is O(max_candidates)).
- ``propose`` looks up the key of the query's last ``key_len`` tokens and, for each of the at
  most ``max_candidates`` recorded occurrences, extends the match backwards up to ``max_match``
  tokens. Cost: at most ``max_candidates * max_match`` token comparisons plus the copy of
  ``cap`` tokens — independent of the context length. ``last_cost`` reports the comparisons.
- Memory: one dict entry per distinct ``key_len``-gram, at most ``max_candidates`` ints each.

Result: among the examined occurrences, the one with the longest backwards match (capped at
``max_match``; at least ``key_len``) wins, then the one with more tokens after it (up to
``cap``), then the most recent; it proposes
``min(cap, room, tokens left after the occurrence)`` tokens — never past the end of the known
sequence and never past ``room`` (what is left of max_model_len). ``enabled=False`` (LOOKUP=0)
or ``cap == 0`` proposes nothing.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence


class LookupLane:
    def __init__(self, *, enabled: bool = True, key_len: int = 2, max_match: int = 16,
                 max_candidates: int = 8) -> None:
        if key_len < 1 or max_match < key_len or max_candidates < 1:
            raise ValueError("lookup lane: need 1 <= key_len <= max_match and max_candidates >= 1")
        self.enabled = enabled
        self.key_len = key_len
        self.max_match = max_match
        self.max_candidates = max_candidates
        self.ids: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}
        self.last_cost = 0

    # ------------------------------------------------------------------ index
    def append(self, token: int) -> None:
        self.ids.append(int(token))
        n = len(self.ids)
        if n >= self.key_len:
            key = tuple(self.ids[n - self.key_len:])
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

    def truncate(self, length: int) -> None:
        """Drop tokens past ``length`` (rare: a preempted or rewound request). O(dropped * M)."""
        while len(self.ids) > length:
            n = len(self.ids)
            if n >= self.key_len:
                key = tuple(self.ids[n - self.key_len:])
                ends = self._index.get(key)
                if ends and ends[-1] == n:
                    ends.pop()
                    if not ends:
                        del self._index[key]
            self.ids.pop()

    def __len__(self) -> int:
        return len(self.ids)

    # ------------------------------------------------------------------ query
    def match(self, drafts: Sequence[int] = (), want: int = 1) -> tuple[int, int]:
        """(end, length) of the best earlier occurrence of the suffix of ids + drafts.

        ``end`` is the index in ``ids`` just past the occurrence (the first token to copy);
        (0, 0) when nothing matches. Occurrences ending at len(ids) have nothing to copy and
        are skipped. Best = longest match, then more tokens to copy (up to ``want``), then the
        most recent.
        """
        ids = self.ids
        n = len(ids)
        d = len(drafts)
        total = n + d
        self.last_cost = 0
        if total < self.key_len:
            return 0, 0

        def q(i: int) -> int:   # i-th token from the end of the query (0 = last)
            j = total - 1 - i
            return drafts[j - n] if j >= n else ids[j]

        key = tuple(q(i) for i in range(self.key_len - 1, -1, -1))
        best_end, best_len, best_avail = 0, 0, 0
        limit_all = min(self.max_match, total)
        for end in reversed(self._index.get(key, ())):       # most recent first
            if end >= n:
                continue
            # the key matched; extend backwards (the occurrence may not overlap the query end)
            length = self.key_len
            limit = min(limit_all, end)
            while length < limit:
                self.last_cost += 1
                if ids[end - 1 - length] != q(length):
                    break
                length += 1
            avail = min(n - end, want)
            if (length, avail) > (best_len, best_avail):
                best_end, best_len, best_avail = end, length, avail
                if length == limit_all and avail == want:
                    break
        return best_end, best_len

    def propose(self, drafts: Sequence[int] = (), cap: int = 8, room: int | None = None
                ) -> list[int]:
        """Up to ``cap`` tokens to verify after ``drafts`` (see the module docstring)."""
        self.last_cost = 0
        if not self.enabled or cap <= 0 or (room is not None and room <= 0):
            return []
        end, length = self.match(drafts, want=cap)
        if length == 0:
            return []
        n = min(cap, len(self.ids) - end, room if room is not None else cap)
        return self.ids[end:end + n]


def longest_suffix_match_bruteforce(ids: Sequence[int], drafts: Sequence[int], key_len: int,
                                    max_match: int) -> tuple[int, int]:
    """The reference for tests: scan every end position (O(len(ids) * max_match))."""
    query = list(ids) + list(drafts)
    n = len(ids)
    best_end, best_len = 0, 0
    for end in range(n - 1, key_len - 1, -1):                # most recent first
        length = 0
        while (length < min(max_match, end, len(query))
               and ids[end - 1 - length] == query[len(query) - 1 - length]):
            length += 1
        if length >= key_len and length > best_len:
            best_end, best_len = end, length
    return best_end, best_len
