"""Speculative decoding through vLLM 0.27.1's rejection rule keeps the target distribution.

- exact enumeration on a 4-token vocabulary: the distribution of the first 3 generated tokens
  under speculation (sampled selector drafts, lookup-lane point masses, padded drafts, a drafter
  that proposes impossible tokens) equals plain sampling's, to 1e-12;
- the torch re-statement of the rule (``rejection_sample``) agrees with the analytic step
  distribution (chi-square), and whole generations pass a chi-square against the target;
- greedy speculation with the torch DFlash2 drafter + selector + lookup lane reproduces greedy
  decoding token for token.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from dflash_helpers import random_weights, small_config

from onecard.dflash import drafter, rejection, select
from onecard.dflash.config import DrafterConfig
from onecard.dflash.lookup import LookupLane

D = torch.float64
V = 4


# --------------------------------------------------------------------------- toy world

def make_target(v=V, seed=0, zeros=True):
    """p(. | prefix) keyed by the last two tokens; some contexts forbid a token (p = 0)."""
    g = torch.Generator().manual_seed(seed)
    table = {}
    for a, b in itertools.product(range(v), repeat=2):
        p = torch.softmax(1.5 * torch.randn(v, generator=g, dtype=D), 0)
        if zeros and (a + b) % 3 == 0:
            p[(a * b) % v] = 0
            p = p / p.sum()
        table[(a, b)] = p

    def target(ids):
        a, b = (list(ids)[-2:] if len(ids) >= 2 else [0, *ids][-2:])
        return table[(a, b)]
    return target


class ToySelector:
    """A DFlash2-style proposer on the toy vocabulary: unary logits from the last token, top-k
    candidates, the selector's transition scores, sampled at temperature ``temp``."""

    def __init__(self, t=2, k=3, r=3, temp=0.8, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.t, self.k, self.temp = t, k, temp
        self.unary_table = 2.0 * torch.randn(V, t, V, generator=g, dtype=D)
        self.hproj = torch.randn(t, r, generator=g, dtype=D)
        self.pred = torch.randn(V, r, generator=g, dtype=D)
        self.succ = torch.randn(V, r, generator=g, dtype=D)

    def lattice(self, ids):
        return select.top_candidates(self.unary_table[ids[-1]], self.k)

    def sample(self, ids, g):
        cand, unary = self.lattice(ids)
        p = select.selector_walk(unary, cand, self.hproj, ids[-1], self.pred, self.succ,
                                 temperature=self.temp, generator=g, vocab_size=V)
        return p.tokens.tolist(), p.probs

    def enumerate(self, ids):
        """Every path with its probability and q rows, from the transition scores."""
        cand, unary = self.lattice(ids)
        out = []
        for js in itertools.product(range(self.k), repeat=self.t):
            prev, prob, toks, rows = ids[-1], 1.0, [], torch.zeros(self.t, V, dtype=D)
            for t, j in enumerate(js):
                s = select.transition_scores(unary[t], cand[t], self.hproj[t], prev, self.pred, self.succ)
                q = torch.softmax(s / self.temp, 0)
                rows[t, cand[t]] = q
                prob *= float(q[j])
                prev = int(cand[t, j])
                toks.append(prev)
            out.append((prob, toks, rows))
        return out


def with_lookup(proposals, cap):
    """Append lookup-lane tokens (point masses: one-hot q rows) after each proposal."""
    def props(ids):
        out = []
        for prob, toks, rows in proposals(ids):
            lane = LookupLane(key_len=1, max_match=4)
            lane.extend(ids)
            extra = lane.propose(toks, cap=cap)
            if rows is not None and extra:
                rows = torch.cat([rows, select.point_mass_rows(torch.tensor(extra), V, D)])
            out.append((prob, toks + extra, rows))
        return out
    return props


PROMPT = [1, 2, 3, 1, 2]
M = 3


def assert_same(dist_a, dist_b, tol=1e-12):
    keys = set(dist_a) | set(dist_b)
    worst = max(abs(dist_a.get(k, 0.0) - dist_b.get(k, 0.0)) for k in keys)
    assert worst < tol, worst
    assert abs(sum(dist_a.values()) - 1) < 1e-12


# --------------------------------------------------------------------------- exact enumeration

@pytest.mark.parametrize("case", ["selector", "selector+lookup", "point-mass+lookup", "padded",
                                  "impossible-drafts", "q-rows-none-sampled-drafter"])
def test_exact_enumeration(case):
    target = make_target()
    sel = ToySelector()
    if case == "selector":
        props = sel.enumerate
    elif case == "selector+lookup":
        props = with_lookup(sel.enumerate, cap=2)
    elif case == "point-mass+lookup":          # greedy walk, verified as point masses (q None)
        def props(ids):
            cand, unary = sel.lattice(ids)
            toks = select.selector_walk(unary, cand, sel.hproj, ids[-1], sel.pred, sel.succ).tokens
            return [(1.0, toks.tolist(), None)]
        props = with_lookup(props, cap=2)
    elif case == "padded":                     # a fixed-width block padded with -1 (zero q rows)
        def props(ids):
            return [(p, toks[:1] + [-1], torch.cat([rows[:1], torch.zeros(1, V, dtype=D)]))
                    for p, toks, rows in sel.enumerate(ids)]
    elif case == "impossible-drafts":          # drafts the target forbids, with q mass on them
        def props(ids):
            bad = []
            for p, toks, rows in sel.enumerate(ids):
                x = (ids[-1] * ids[-2]) % V
                rows = rows.clone()
                rows[0] = 0.5 * rows[0]
                rows[0, x] += 0.5
                bad.append((p * 0.5, toks, rows))
                bad.append((p * 0.5, [x] + toks[1:], rows))
            return bad
    else:                                      # sampled drafts verified WITHOUT their q rows
        def props(ids):
            return [(p, toks, None) for p, toks, _ in sel.enumerate(ids)]
    m = 2 if case in ("impossible-drafts", "q-rows-none-sampled-drafter") else M
    spec = rejection.exact_output_distribution(target, props, PROMPT, m)
    plain = rejection.target_distribution(target, PROMPT, m)
    assert_same(spec, plain)


def test_enumeration_catches_a_wrong_rule():
    """Sanity of the harness: verifying sampled drafts against the WRONG q breaks exactness."""
    target = make_target()
    sel = ToySelector()

    def props(ids):
        return [(p, toks, torch.full_like(rows, 1.0 / V)) for p, toks, rows in sel.enumerate(ids)]
    spec = rejection.exact_output_distribution(target, props, PROMPT, M)
    plain = rejection.target_distribution(target, PROMPT, M)
    assert max(abs(spec.get(k, 0) - plain.get(k, 0)) for k in plain) > 1e-3


# --------------------------------------------------------------------------- the restated kernel

def chi2(counts, probs, n):
    return sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in probs.items() if p > 0)


def test_rejection_sample_matches_step_outcomes():
    """The kernel re-statement (uniforms + Exp race) samples the analytic step distribution."""
    target = make_target()
    sel = ToySelector()
    ids = PROMPT
    g = torch.Generator().manual_seed(5)
    _, toks, rows = sel.enumerate(ids)[4]
    want = dict(rejection.step_outcomes(target, ids, toks, rows))
    p_rows = torch.stack([target(ids + toks[:i]) for i in range(len(toks) + 1)])
    n, counts = 8000, {}
    for _ in range(n):
        bonus = int(torch.multinomial(p_rows[-1], 1, generator=g))
        u = torch.rand(len(toks), generator=g, dtype=D)
        e = torch.empty(V, dtype=D).exponential_(generator=g)
        out = tuple(rejection.rejection_sample(torch.tensor(toks), rows, p_rows[:-1], bonus,
                                               greedy=False, uniforms=u, exp_noise=e))
        counts[out] = counts.get(out, 0) + 1
    assert set(counts) <= {k for k, p in want.items() if p > 0}
    df = sum(1 for p in want.values() if p > 0) - 1
    assert chi2(counts, want, n) < 3.0 * df + 20     # far below the p = 0.001 quantile


@pytest.mark.parametrize("lookup_cap", [0, 2])
def test_generation_chi_square(lookup_cap):
    """Whole generations (2 tokens) through speculative_decode vs the exact target."""
    target = make_target(seed=3)
    sel = ToySelector(seed=4)

    def propose(ids, g):
        toks, rows = sel.sample(ids, g)
        lane = LookupLane(key_len=1, max_match=4)
        lane.extend(ids)
        extra = lane.propose(toks, cap=lookup_cap)
        if extra:
            rows = torch.cat([rows, select.point_mass_rows(torch.tensor(extra), V, D)])
        return toks + extra, rows
    g = torch.Generator().manual_seed(11)
    n, counts = 2000, {}
    for _ in range(n):
        out, _ = rejection.speculative_decode(target, propose, PROMPT, 2, greedy=False, generator=g)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    want = rejection.target_distribution(target, PROMPT, 2)
    df = sum(1 for p in want.values() if p > 0) - 1
    assert df >= 10
    assert chi2(counts, want, n) < 37.7 if df == 15 else chi2(counts, want, n) < 3.0 * df + 20


# --------------------------------------------------------------------------- greedy, real drafter

def test_greedy_speculation_equals_greedy_decoding():
    """The torch DFlash2 drafter + selector (+ lookup lane) drafting, greedy verification."""
    cfg = DrafterConfig.from_dict(small_config())
    w = random_weights(cfg, seed=2)
    vocab = cfg.vocab_size
    g = torch.Generator().manual_seed(9)
    embed = torch.randn(vocab, cfg.hidden_size, generator=g, dtype=D)
    lm_head = torch.randn(vocab, cfg.hidden_size, generator=g, dtype=D)
    feat = torch.randn(vocab, cfg.fc_in, generator=g, dtype=D)
    target = make_target(v=vocab, seed=5, zeros=False)     # falls into cycles: lookup hits

    def proposer(lookup_cap):
        def propose(ids, _g):
            anchor = ids[-1]
            ctx = torch.tensor(ids[:-1])
            th = feat[ctx] + 0.01 * ctx[:, None].to(D)
            p = drafter.forward(cfg, w, target_hidden=th, block_ids=drafter.block_ids_for(cfg, anchor),
                                block_start=len(ids) - 1, embed=embed, lm_head=lm_head)
            toks = select.draft_from_pass(cfg, w, p.hidden, p.logits, anchor).tokens.tolist()
            lane = LookupLane()
            lane.extend(ids)
            return toks + lane.propose(toks, cap=lookup_cap), None
        return propose

    prompt = [3, 9, 27, 3, 9, 27, 5]
    want = rejection.greedy_decode(target, prompt, 40)
    for cap in (0, 3):
        got, steps = rejection.speculative_decode(target, proposer(cap), prompt, 40, greedy=True)
        assert got == want


@pytest.mark.parametrize("lookup_cap", [0, 4])
def test_greedy_with_a_partly_right_drafter(lookup_cap):
    """An oracle drafter that is wrong at one random position per block: acceptance stops
    exactly there, lookup tokens are verified only after a fully accepted block, and the
    output is still greedy decoding token for token."""
    vocab = 16
    target = make_target(v=vocab, seed=6, zeros=False)
    prompt = [1, 2, 3, 1, 2, 3, 4]
    want = rejection.greedy_decode(target, prompt, 120)
    k = 4

    def propose(ids, g):
        truth = rejection.greedy_decode(target, ids, k)
        wrong = int(torch.randint(0, 2 * k, (1,), generator=g))    # >= k: all right
        if wrong < k:
            truth[wrong] = (truth[wrong] + 1) % vocab
        lane = LookupLane()
        lane.extend(ids)
        return truth + lane.propose(truth, cap=lookup_cap), None

    got, steps = rejection.speculative_decode(target, propose, prompt, 120, greedy=True,
                                              generator=torch.Generator().manual_seed(3))
    assert got == want
    assert max(steps) == k + (lookup_cap if lookup_cap else 0)
    assert min(steps) == 0
