"""Turning one drafter pass into draft tokens: candidate top-k and the DFlash2 selector walk.

DFlash2 keeps, per drafted position t, the ``selector_top_k`` candidates of the unary logits
U_t and scores a transition from the token a chosen at t-1 to a candidate b as::

    S_t(a, b) = U_t(b) + < predecessor_codebook[a] * hidden_projection(h_t), successor_codebook[b] >

The walk starts at the anchor token and picks, position by position, the best candidate given
the previous pick (greedy), or samples one from ``softmax(S_t(a, .) / T)`` over the candidates
(sampled drafting). The sampled walk reports the distribution it sampled from as a full-vocab row
(zero outside the candidates): that row is the ``q`` the rejection sampler needs for exactness.

DFlash (v1) drafters have no selector: every position is drafted independently from U_t.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onecard.dflash.config import DrafterConfig


@dataclass
class Proposal:
    tokens: torch.Tensor              # [T] long, the drafted tokens in order
    probs: torch.Tensor | None        # [T, V] proposal distribution q_t (None: greedy / point mass)
    cand_ids: torch.Tensor | None = None    # [T, k] candidates (selector drafters)
    cand_probs: torch.Tensor | None = None  # [T, k] q over the candidates (sampled walk)


def top_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the k largest logits and their ids, best first; ties go to the lower id."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"top-k {k}; valid: 1..{logits.shape[-1]}")
    vals, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    return ids[..., :k], vals[..., :k]


def _pick(scores: torch.Tensor, temperature: float, u: float | None,
          generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """Index into ``scores`` [k]: argmax (first max) when greedy, else a softmax(scores/T) draw
    by inverse CDF of ``u`` (or a fresh uniform from ``generator``). Returns (index, probs)."""
    if temperature <= 0:
        return int(torch.argmax(scores)), None
    probs = torch.softmax(scores / temperature, dim=-1)
    if u is None:
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
    cdf = torch.cumsum(probs.to(torch.float64), 0)
    j = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)[0])
    j = min(j, len(probs) - 1)
    while probs[j] == 0 and j > 0:   # never pick a zero-probability candidate (rounding at 1.0)
        j -= 1
    return j, probs


def transition_scores(unary_t: torch.Tensor, cand_t: torch.Tensor, hproj_t: torch.Tensor,
                      prev: int, predecessor: torch.Tensor, successor: torch.Tensor
                      ) -> torch.Tensor:
    """S_t(prev, b) for the k candidates b of one position: [k]."""
    return unary_t + successor[cand_t] @ (predecessor[prev] * hproj_t)


def selector_walk(unary: torch.Tensor, cand_ids: torch.Tensor, hproj: torch.Tensor, anchor: int,
                  predecessor: torch.Tensor, successor: torch.Tensor, *, temperature: float = 0.0,
                  uniforms: torch.Tensor | None = None, generator: torch.Generator | None = None,
                  vocab_size: int | None = None) -> Proposal:
    """Walk the candidate lattice from ``anchor``.

    unary, cand_ids: [T, k] (from ``top_candidates``); hproj: [T, R] = hidden_projection of the
    mask rows; predecessor, successor: [V, R] codebooks. ``uniforms`` [T] makes a sampled walk
    reproducible (one uniform per position, as a fused kernel would take them).
    """
    t_len, k = cand_ids.shape
    tokens = torch.empty(t_len, dtype=torch.long)
    cprobs = None if temperature <= 0 else torch.zeros(t_len, k, dtype=unary.dtype)
    prev = int(anchor)
    for t in range(t_len):
        scores = transition_scores(unary[t], cand_ids[t], hproj[t], prev, predecessor, successor)
        u = None if uniforms is None else float(uniforms[t])
        j, p = _pick(scores, temperature, u, generator)
        if cprobs is not None:
            cprobs[t] = p
        prev = int(cand_ids[t, j])
        tokens[t] = prev
    probs = None
    if cprobs is not None:
        v = vocab_size if vocab_size is not None else predecessor.shape[0]
        probs = torch.zeros(t_len, v, dtype=cprobs.dtype).scatter_(1, cand_ids, cprobs)
    return Proposal(tokens=tokens, probs=probs, cand_ids=cand_ids, cand_probs=cprobs)


def selector_walk_batched(unary: torch.Tensor, cand_ids: torch.Tensor, hproj: torch.Tensor,
                          anchors: torch.Tensor, predecessor: torch.Tensor,
                          successor: torch.Tensor, *, temperature: torch.Tensor | None = None,
                          uniforms: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The walk for a batch, in tensor ops only (the shape of the GPU version: T sequential
    steps, each a gather + a [B, k, R] x [B, R] product + argmax / inverse-CDF draw).

    unary, cand_ids: [B, T, k]; hproj: [B, T, R]; anchors: [B]; temperature: [B] (<= 0 =
    greedy for that row; None = all greedy); uniforms: [B, T]. Returns (tokens [B, T],
    candidate probabilities [B, T, k] or None when every row is greedy). Same picks as
    ``selector_walk`` row by row given the same uniforms.
    """
    b, t_len, k = cand_ids.shape
    tokens = torch.empty(b, t_len, dtype=torch.long)
    sampled = temperature is not None and bool((temperature > 0).any())
    cprobs = torch.zeros(b, t_len, k, dtype=unary.dtype) if sampled else None
    prev = anchors.long()
    rows = torch.arange(b)
    for t in range(t_len):
        edge = torch.einsum("bkr,br->bk", successor[cand_ids[:, t]], predecessor[prev] * hproj[:, t])
        scores = unary[:, t] + edge                                            # [B, k]
        j = scores.argmax(-1)
        if sampled:
            temp = temperature.to(scores.dtype).clamp_min(1e-30)[:, None]
            p = torch.softmax(scores / temp, -1)
            cdf = torch.cumsum(p.to(torch.float64), -1)
            u = uniforms[:, t].to(torch.float64)[:, None].contiguous()
            js = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(k - 1)
            # step back over zero-probability candidates (rounding at the top of the CDF)
            for _ in range(k):
                zero = (p[rows, js] == 0) & (js > 0)
                if not bool(zero.any()):
                    break
                js = torch.where(zero, js - 1, js)
            is_sampled = temperature > 0
            j = torch.where(is_sampled, js, j)
            cprobs[:, t] = torch.where(is_sampled[:, None], p, torch.zeros_like(p))
        prev = cand_ids[rows, t, j]
        tokens[:, t] = prev
    return tokens, cprobs


def independent_draft(logits: torch.Tensor, *, temperature: float = 0.0,
                      uniforms: torch.Tensor | None = None,
                      generator: torch.Generator | None = None) -> Proposal:
    """DFlash (v1) drafting: each position from its own unary logits, full vocabulary."""
    t_len = logits.shape[0]
    tokens = torch.empty(t_len, dtype=torch.long)
    probs = None if temperature <= 0 else torch.zeros_like(logits)
    for t in range(t_len):
        u = None if uniforms is None else float(uniforms[t])
        j, p = _pick(logits[t], temperature, u, generator)
        tokens[t] = j
        if probs is not None:
            probs[t] = p
    return Proposal(tokens=tokens, probs=probs)


def draft_from_pass(cfg: DrafterConfig, w: dict[str, torch.Tensor], hidden: torch.Tensor,
                    logits: torch.Tensor, anchor: int, *, temperature: float = 0.0,
                    uniforms: torch.Tensor | None = None,
                    generator: torch.Generator | None = None) -> Proposal:
    """Draft tokens from a ``drafter.forward`` result (hidden [B, H], logits [B-1, V])."""
    if not cfg.has_selector:
        return independent_draft(logits, temperature=temperature, uniforms=uniforms,
                                 generator=generator)
    cand_ids, unary = top_candidates(logits, cfg.selector_top_k)
    hproj = hidden[1:] @ w["candidate_selector.hidden_projection.weight"].T
    return selector_walk(unary, cand_ids, hproj, anchor,
                         w["candidate_selector.predecessor_codebook"],
                         w["candidate_selector.successor_codebook"], temperature=temperature,
                         uniforms=uniforms, generator=generator, vocab_size=logits.shape[-1])


def point_mass_rows(tokens: torch.Tensor, vocab_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q rows for deterministic proposals (greedy drafts, lookup-lane tokens): one-hot.

    In vLLM's rule a one-hot q row behaves exactly as ``draft_probs=None`` does for that
    position (accept with probability p(x); on rejection sample p with x removed), so a verify
    block can mix sampled drafter rows with lookup rows in one ``draft_probs`` tensor.
    """
    return torch.nn.functional.one_hot(tokens.long(), vocab_size).to(dtype)
