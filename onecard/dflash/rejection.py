"""vLLM 0.27.1's rejection-sampling rule, re-stated in torch for one request, plus the exact
(analytic) outcome distribution of one verify step and a speculative-decoding simulator.

The rule (vllm/v1/sample/rejection_sampler.py, ``rejection_sample`` and its kernels), per
drafted position i with draft token x, draft row q_i (or none), target probabilities p_i:

- greedy request: accept while x == argmax p_i; at the first mismatch emit argmax p_i, stop;
- random request: a padded draft (x < 0) is rejected; otherwise accept iff
  ``q_i(x) > 0 and p_i(x) / q_i(x) >= u_i`` (u_i uniform; without draft rows q_i(x) := 1);
  on rejection emit the *recovered* token ``argmax_v max(p_i(v) - q_i(v), 0) / E_v`` (without
  draft rows: p_i with x removed), E_v iid Exp(1) — one E vector per request and step — which
  samples the normalized residual exactly; stop;
- every draft accepted: emit the bonus token, sampled by the ordinary sampler from p_k.

Why the output is the target distribution: for one position, P(emit y) =
q(y) min(1, p(y)/q(y)) + (1 - sum_x min(q(x), p(x))) * max(p(y) - q(y), 0) / Z = p(y), for any q
the draft was actually drawn from — and with a point-mass q (a deterministic draft, a lookup
token) it reduces to ``p(x) + (1 - p(x)) * 0`` for y = x and ``(1 - p(x)) p(y) / (1 - p(x))``
otherwise. Later positions are conditioned on the accepted prefix, so the argument repeats.
tests/dflash/test_exactness.py checks this by exact enumeration and by chi-square.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

TargetFn = Callable[[Sequence[int]], torch.Tensor]   # prefix -> [V] next-token probabilities


def rejection_sample(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, bonus_id: int, *, greedy: bool,
                     uniforms: torch.Tensor | None = None,
                     exp_noise: torch.Tensor | None = None) -> list[int]:
    """One request's verify step (see the module docstring). Returns the emitted tokens.

    draft_ids [k]; draft_probs [k, V] or None; target_probs [k, V] (rows for the drafted
    positions); bonus_id sampled by the caller from the (k+1)-th target row; uniforms [k];
    exp_noise [V] (Exp(1) draws).
    """
    out: list[int] = []
    k = draft_ids.shape[0]
    if greedy:
        target_argmax = target_probs.argmax(dim=-1)
        for i in range(k):
            t = int(target_argmax[i])
            out.append(t)
            if int(draft_ids[i]) != t:
                return out
        return out + [int(bonus_id)]
    assert uniforms is not None and exp_noise is not None
    inv_q = exp_noise.reciprocal()
    for i in range(k):
        x = int(draft_ids[i])
        p = target_probs[i]
        if x < 0:
            accepted = False
        else:
            q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
            accepted = q_x > 0 and float(p[x]) / q_x >= float(uniforms[i])
        if accepted:
            out.append(x)
            continue
        if draft_probs is None:
            resid = p.clone()
            if x >= 0:
                resid[x] = 0
        else:
            resid = torch.clamp(p - draft_probs[i], min=0)
        out.append(int(torch.argmax(resid * inv_q)))
        return out
    return out + [int(bonus_id)]


def step_outcomes(target: TargetFn, ids: Sequence[int], drafts: Sequence[int],
                  q_rows: torch.Tensor | None) -> list[tuple[tuple[int, ...], float]]:
    """Exact distribution of what one random-request verify step emits: [(tokens, prob)].

    The analytic form of the rule: accept with probability min(1, p(x)/q(x)), else a token
    drawn from the normalized residual (the Exp-race argmax samples it exactly).
    """
    outcomes: list[tuple[tuple[int, ...], float]] = []
    alive = 1.0
    for i, x in enumerate(drafts):
        p = target(list(ids) + list(drafts[:i])).to(torch.float64)
        if q_rows is None:
            q = torch.zeros_like(p)
            if x >= 0:
                q[x] = 1.0
        else:
            q = q_rows[i].to(torch.float64)
        a = 0.0 if x < 0 or q[x] <= 0 else min(1.0, float(p[x] / q[x]))
        if x < 0 and q_rows is None:
            resid = p.clone()
        else:
            resid = torch.clamp(p - q, min=0)
        z = float(resid.sum())
        if a < 1.0 and z > 0:
            for y in torch.nonzero(resid).flatten().tolist():
                outcomes.append((tuple(drafts[:i]) + (y,), alive * (1 - a) * float(resid[y]) / z))
        alive *= a
        if alive == 0.0:
            return outcomes
    p = target(list(ids) + list(drafts)).to(torch.float64)
    for y in torch.nonzero(p).flatten().tolist():
        outcomes.append((tuple(drafts) + (y,), alive * float(p[y])))
    return outcomes


ProposalsFn = Callable[[Sequence[int]], list[tuple[float, list[int], torch.Tensor | None]]]


def exact_output_distribution(target: TargetFn, proposals: ProposalsFn, prompt: Sequence[int],
                              m: int) -> dict[tuple[int, ...], float]:
    """Exact distribution of the first m generated tokens under speculative sampling.

    ``proposals(ids)`` enumerates the drafter's possible proposals after ``ids``:
    [(probability, draft tokens, q rows or None)].
    """
    dist: dict[tuple[int, ...], float] = defaultdict(float)

    def rec(ids: list[int], gen: tuple[int, ...], w: float) -> None:
        if len(gen) >= m:
            dist[gen[:m]] += w
            return
        for pw, drafts, q_rows in proposals(ids):
            if pw == 0:
                continue
            for emitted, pe in step_outcomes(target, ids, drafts, q_rows):
                if pe > 0:
                    rec(ids + list(emitted), gen + emitted, w * pw * pe)

    rec(list(prompt), (), 1.0)
    return dict(dist)


def target_distribution(target: TargetFn, prompt: Sequence[int], m: int
                        ) -> dict[tuple[int, ...], float]:
    """Exact distribution of the first m tokens of plain (non-speculative) sampling."""
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(m):
        nxt: dict[tuple[int, ...], float] = {}
        for seq, w in dist.items():
            p = target(list(prompt) + list(seq)).to(torch.float64)
            for y in torch.nonzero(p).flatten().tolist():
                nxt[seq + (y,)] = w * float(p[y])
        dist = nxt
    return dist


Proposer = Callable[[Sequence[int], torch.Generator], tuple[list[int], torch.Tensor | None]]


def speculative_decode(target: TargetFn, propose: Proposer, prompt: Sequence[int], n: int, *,
                       greedy: bool, generator: torch.Generator | None = None
                       ) -> tuple[list[int], list[int]]:
    """Generate n tokens with speculation through ``rejection_sample``.

    ``propose(ids, generator)`` returns (draft tokens, q rows or None). Returns (tokens,
    accepted-drafts count per step).
    """
    g = generator or torch.Generator().manual_seed(0)
    ids = list(prompt)
    steps: list[int] = []
    while len(ids) - len(prompt) < n:
        drafts, q_rows = propose(ids, g)
        k = len(drafts)
        rows = torch.stack([target(ids + drafts[:i]) for i in range(k + 1)])
        if greedy:
            bonus = int(rows[k].argmax())
            emitted = rejection_sample(torch.tensor(drafts, dtype=torch.long), None, rows[:k],
                                       bonus, greedy=True)
        else:
            bonus = int(torch.multinomial(rows[k].to(torch.float64), 1, generator=g))
            u = torch.rand(k, generator=g, dtype=torch.float64)
            e = torch.empty(rows.shape[1], dtype=torch.float64).exponential_(generator=g)
            emitted = rejection_sample(torch.tensor(drafts, dtype=torch.long), q_rows, rows[:k],
                                       bonus, greedy=False, uniforms=u, exp_noise=e)
        steps.append(len(emitted) - 1)
        ids += emitted
    return ids[len(prompt):len(prompt) + n], steps


def greedy_decode(target: TargetFn, prompt: Sequence[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(target(ids).argmax()))
    return ids[len(prompt):]
