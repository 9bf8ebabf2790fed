"""Candidate top-k and the selector walk, greedy and sampled."""
from __future__ import annotations

import itertools

import pytest
import torch

from onecard.dflash import select

D = torch.float64


def lattice(t=3, k=4, v=10, r=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, v, generator=g, dtype=D)
    cand, unary = select.top_candidates(logits, k)
    hproj = torch.randn(t, r, generator=g, dtype=D)
    pred = torch.randn(v, r, generator=g, dtype=D)
    succ = torch.randn(v, r, generator=g, dtype=D)
    return logits, cand, unary, hproj, pred, succ


def test_top_candidates_sorted_ties_to_lower_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0]])
    ids, vals = select.top_candidates(logits, 3)
    assert ids.tolist() == [[1, 2, 4]] and vals.tolist() == [[3.0, 3.0, 3.0]]
    with pytest.raises(ValueError):
        select.top_candidates(logits, 6)


def test_zero_codebooks_walk_is_argmax():
    logits, cand, unary, hproj, pred, succ = lattice()
    p = select.selector_walk(unary, cand, hproj, 0, pred * 0, succ * 0)
    assert p.tokens.tolist() == logits.argmax(-1).tolist() and p.probs is None


def test_greedy_walk_uses_predecessor_edges():
    """Edges can overturn the unary order: the walk follows the best transition from the pick."""
    v, r = 6, 2
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.3, 0.2, 0.1]], dtype=D)
    cand, unary = select.top_candidates(logits, 3)
    hproj = torch.ones(2, r, dtype=D)
    pred = torch.zeros(v, r, dtype=D)
    succ = torch.zeros(v, r, dtype=D)
    pred[5, 0] = 1.0       # anchor 5 prefers successor 1 at position 0
    succ[1, 0] = 10.0
    pred[1, 1] = 1.0       # after 1, prefer 5 at position 1
    succ[5, 1] = 10.0
    p = select.selector_walk(unary, cand, hproj, 5, pred, succ)
    assert p.tokens.tolist() == [1, 5]
    p = select.selector_walk(unary, cand, hproj, 0, pred, succ)   # no edges from anchor 0
    assert p.tokens.tolist() == [2, 3]


def test_greedy_walk_matches_brute_force_definition():
    logits, cand, unary, hproj, pred, succ = lattice(t=4, k=3, seed=3)
    p = select.selector_walk(unary, cand, hproj, 7, pred, succ)
    prev, want = 7, []
    for t in range(4):
        s = [float(unary[t, j] + (pred[prev] * hproj[t]) @ succ[cand[t, j]]) for j in range(3)]
        prev = int(cand[t, max(range(3), key=lambda j: s[j])])
        want.append(prev)
    assert p.tokens.tolist() == want


def test_sampled_walk_reports_the_distribution_it_samples():
    logits, cand, unary, hproj, pred, succ = lattice(t=2, k=3, v=8, seed=1)
    temp = 0.7
    # exact path probabilities from the transition scores
    exact = {}
    for j0, j1 in itertools.product(range(3), repeat=2):
        a, b = int(cand[0, j0]), int(cand[1, j1])
        p0 = torch.softmax(select.transition_scores(unary[0], cand[0], hproj[0], 2, pred, succ) / temp, 0)[j0]
        p1 = torch.softmax(select.transition_scores(unary[1], cand[1], hproj[1], a, pred, succ) / temp, 0)[j1]
        exact[(a, b)] = float(p0 * p1)
    g = torch.Generator().manual_seed(0)
    n = 3000
    counts: dict = {}
    for _ in range(n):
        p = select.selector_walk(unary, cand, hproj, 2, pred, succ, temperature=temp, generator=g,
                                 vocab_size=8)
        key = tuple(p.tokens.tolist())
        counts[key] = counts.get(key, 0) + 1
        # the reported q rows are the conditionals of the drawn path
        assert abs(float(p.probs[0, key[0]] * p.probs[1, key[1]]) - exact[key]) < 1e-12
        assert torch.allclose(p.probs.sum(-1), torch.ones(2, dtype=D))
    chi2 = sum((counts.get(k, 0) - n * e) ** 2 / (n * e) for k, e in exact.items())
    assert chi2 < 26.1   # df 8, p = 0.001


def test_uniforms_make_the_walk_reproducible_and_inverse_cdf():
    logits, cand, unary, hproj, pred, succ = lattice(t=3, k=4)
    u = torch.tensor([0.0, 0.5, 0.999999])
    a = select.selector_walk(unary, cand, hproj, 1, pred, succ, temperature=1.0, uniforms=u)
    b = select.selector_walk(unary, cand, hproj, 1, pred, succ, temperature=1.0, uniforms=u)
    assert torch.equal(a.tokens, b.tokens)
    # u = 0 picks the first candidate with positive probability
    assert int(a.tokens[0]) == int(cand[0, 0])


def test_independent_draft_greedy_and_sampled():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]], dtype=D)
    p = select.independent_draft(logits)
    assert p.tokens.tolist() == [1, 0] and p.probs is None
    p = select.independent_draft(logits, temperature=1.0, uniforms=torch.tensor([0.99, 0.0]))
    assert p.tokens.tolist() == [2, 0]
    assert torch.allclose(p.probs, torch.softmax(logits, -1))


def test_point_mass_rows():
    rows = select.point_mass_rows(torch.tensor([2, 0]), 4)
    assert rows.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]


def test_batched_walk_equals_per_request_walk():
    g = torch.Generator().manual_seed(7)
    b, t, k, v, r = 6, 5, 4, 12, 3
    logits = torch.randn(b, t, v, generator=g, dtype=D)
    cand, unary = select.top_candidates(logits, k)
    hproj = torch.randn(b, t, r, generator=g, dtype=D)
    pred = torch.randn(v, r, generator=g, dtype=D)
    succ = torch.randn(v, r, generator=g, dtype=D)
    anchors = torch.randint(0, v, (b,), generator=g)
    temps = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.3, 0.5], dtype=D)
    u = torch.rand(b, t, generator=g, dtype=D)
    u[1, 0] = 0.0
    tokens, probs = select.selector_walk_batched(unary, cand, hproj, anchors, pred, succ,
                                                 temperature=temps, uniforms=u)
    greedy_only, none = select.selector_walk_batched(unary, cand, hproj, anchors, pred, succ)
    assert none is None
    for i in range(b):
        one = select.selector_walk(unary[i], cand[i], hproj[i], int(anchors[i]), pred, succ,
                                   temperature=float(temps[i]), uniforms=u[i])
        assert tokens[i].tolist() == one.tokens.tolist()
        if temps[i] > 0:
            assert torch.allclose(probs[i], one.cand_probs, atol=1e-12)
        else:
            assert torch.count_nonzero(probs[i]) == 0
            assert greedy_only[i].tolist() == one.tokens.tolist()
