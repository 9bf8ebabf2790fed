"""The lookup lane: longest suffix match, caps, LOOKUP=0, bounded cost on a 100k context."""
from __future__ import annotations

import random
import time

import pytest

from onecard.dflash.lookup import LookupLane, longest_suffix_match_bruteforce


def lane(ids, **kw):
    ln = LookupLane(**kw)
    ln.extend(ids)
    return ln


def test_copies_what_followed():
    ln = lane([5, 6, 7, 8, 9, 1, 5, 6])
    assert ln.propose(cap=3) == [7, 8, 9]
    # the drafts extend the query: ids + [7, 8] ends in (7, 8) -> continue with 9, 1, 5
    assert ln.propose([7, 8], cap=8) == [9, 1, 5, 6]


def test_never_past_the_end_and_room():
    ln = lane([1, 2, 3, 1, 2])
    assert ln.propose(cap=8) == [3, 1, 2]          # only the tokens that exist
    assert ln.propose(cap=8, room=1) == [3]        # max_model_len room
    assert ln.propose(cap=8, room=0) == []


def test_cap_and_disabled():
    ln = lane(list(range(20)) + [3, 4])
    assert ln.propose(cap=8) == list(range(5, 13))
    assert ln.propose(cap=2) == [5, 6]
    assert ln.propose(cap=0) == []
    off = lane(list(range(20)) + [3, 4], enabled=False)   # LOOKUP=0
    assert off.propose(cap=8) == [] and off.last_cost == 0


def test_no_match_and_short():
    assert lane([1, 2, 3, 4]).propose(cap=4) == []
    assert lane([1]).propose(cap=4) == []
    assert lane([]).propose([1], cap=4) == []


def test_longest_wins_then_most_recent():
    # (8, 9) occurs twice; the occurrence preceded by 7 matches the longer suffix 7 8 9
    ids = [7, 8, 9, 100, 0, 8, 9, 200, 0, 7, 8, 9]
    assert lane(ids).propose(cap=1) == [100]
    ids = [8, 9, 100, 0, 8, 9, 200, 0, 8, 9]        # equal lengths: most recent
    assert lane(ids).propose(cap=1) == [200]
    # equal lengths, but the most recent leaves too little to copy: take the one that fills cap
    ids = [5, 8, 9, 1, 2, 3, 4, 5, 8, 9, 6]
    assert lane(ids).propose([5, 8, 9], cap=3) == [1, 2, 3]
    assert lane(ids).propose([5, 8, 9], cap=1) == [6]


@pytest.mark.parametrize("seed", range(30))
def test_matches_bruteforce(seed):
    rng = random.Random(seed)
    alphabet = rng.choice([2, 3, 5])
    ids = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 80))]
    drafts = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 5))]
    for key_len, max_match in ((1, 4), (2, 6), (3, 16)):
        ln = lane(ids, key_len=key_len, max_match=max_match, max_candidates=10_000)
        assert ln.match(drafts) == longest_suffix_match_bruteforce(ids, drafts, key_len, max_match)


def test_truncate_equals_fresh_index():
    rng = random.Random(1)
    ids = [rng.randrange(4) for _ in range(200)]
    ln = lane(ids, max_candidates=10_000)
    ln.truncate(120)
    fresh = lane(ids[:120], max_candidates=10_000)
    assert ln.ids == fresh.ids and ln._index == fresh._index


def test_cost_on_100k_context():
    """Appending 100k tokens and querying stays fast; comparisons per query are bounded."""
    rng = random.Random(0)
    passage = [rng.randrange(50_000) for _ in range(400)]
    ctx = [rng.randrange(50_000) for _ in range(100_000)]
    ctx[60_000:60_400] = passage
    t0 = time.perf_counter()
    ln = lane(ctx, key_len=2, max_match=16, max_candidates=8)
    t_build = time.perf_counter() - t0
    # quote the passage back: every step proposes the passage's continuation
    ln.append(passage[0])
    t0 = time.perf_counter()
    for i in range(1, 201):
        ln.append(passage[i])
        got = ln.propose(cap=8)
        assert got == passage[i + 1:i + 9]
        assert ln.last_cost <= 8 * 16
    t_query = (time.perf_counter() - t0) / 200
    assert t_build < 5.0, t_build          # ~0.2 s on a 2-core CI box
    assert t_query < 2e-3, t_query         # ~20 us; independent of context length


def test_cost_bounded_on_a_degenerate_context():
    """100k copies of one token: only max_candidates occurrences are examined."""
    ln = lane([7] * 100_000, key_len=2, max_match=16, max_candidates=8)
    # the 8 most recent occurrences leave at most 7 tokens to copy; the lane takes the most
    assert ln.propose([7], cap=8) == [7] * 7
    assert ln.last_cost <= 8 * 16
    assert len(ln._index[(7, 7)]) == 8


def test_bad_parameters():
    with pytest.raises(ValueError):
        LookupLane(key_len=0)
    with pytest.raises(ValueError):
        LookupLane(key_len=4, max_match=3)
