"""Plain-torch reference for the DFlash2 drafter's K/V rings (docs/dflash2-huge.md §3, design (d)).

What vLLM does in ring mode, written out slowly so a CPU test can compare it with dense attention:

* ``kernel_slots``: the slot rule of vLLM's ``copy_and_expand_dflash_inputs_kernel``
  (``block_table[pos // block] * block + pos % block``, block index clamped to the table width);
* ``write_rows``: a cache write that skips negative slots (``reshape_and_cache_flash``);
* ``paged_window_attention``: FlashAttention's paged, non-causal, sliding-window read: queries are
  the last rows of the key sequence (bottom-right aligned) and a causal window ``(W - 1, 0)`` is
  made symmetric ``(W - 1, W - 1)`` for non-causal queries (vLLM 0.27.1 ``flash_attn.py``
  ``_maybe_symmetrize_window``);
* ``dense_window_attention``: the drafter's own rule (``onecard.dflash.drafter.attention``): a
  query at position p sees every key with ``p - k_pos < window``, block rows included;
* ``RingBatch``: the per-step bookkeeping of one batch over a shared ring (slot per request,
  block table, context writes with the -1 filter, query-block writes), with the slot map, table
  and filter functions passed in so the test can run the ones shipped in patch 0080.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from onecard.dflash import ring


def kernel_slots(table_row: torch.Tensor, positions: torch.Tensor,
                 block: int = ring.RING_BLOCK) -> torch.Tensor:
    blk = torch.clamp(positions // block, max=table_row.shape[0] - 1)
    return table_row.long()[blk] * block + positions % block


def write_rows(cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor) -> None:
    """cache_*: [rows, H, D] (blocks flattened); slots < 0 are skipped."""
    ok = slots >= 0
    cache_k[slots[ok]] = k[ok]
    cache_v[slots[ok]] = v[ok]


def paged_window_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                           table_row: torch.Tensor, seq_len: int, window: int,
                           block: int = ring.RING_BLOCK) -> torch.Tensor:
    """q: [nq, H, D], the last nq positions of a ``seq_len``-key sequence read through
    ``table_row``. Returns [nq, H, D]."""
    nq = q.shape[0]
    kpos = torch.arange(seq_len)
    rows = table_row.long()[kpos // block] * block + kpos % block
    k, v = cache_k[rows], cache_v[rows]
    qpos = torch.arange(seq_len - nq, seq_len)
    d = kpos[None, :] - qpos[:, None]
    visible = (d >= -(window - 1)) & (d <= window - 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def dense_window_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, window: int) -> torch.Tensor:
    """q: [nq, H, D] at positions q_pos; k, v: [n, H, D] at positions 0..n-1."""
    kpos = torch.arange(k.shape[0])
    visible = (q_pos[:, None] - kpos[None, :]) < window
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def reference_keep(ctx_pos: int, first_query_pos: int, k_max: int, ring_rows: int) -> bool:
    """The -1 filter for one context row: keep it iff the ring can hold it this step."""
    return ctx_pos >= first_query_pos + k_max + 1 - ring_rows


class RingBatch:
    """One layer's ring shared by a batch of requests, driven step by step.

    ``assign(req_ids, alive) -> (slots, fresh)``, ``table(rows_table, slot_ids) -> [B, width]``
    and ``filter_(slot_mapping, ctx_pos, qsl, query_pos, B, nq, k_max, ring_rows)`` are the
    functions under test (patch 0080's ``RingSlots.assign`` / ``ring_block_table`` /
    ``ring_filter_context_slots``); ``rows_table`` is its ``ring_rows_table``.
    """

    def __init__(self, slots: int, window: int, k_max: int, heads: int, head_dim: int,
                 width: int, assign: Callable, table: Callable, filter_: Callable,
                 rows_table: torch.Tensor, dtype: torch.dtype = torch.float64):
        self.window, self.k_max = window, k_max
        self.bps = ring.ring_blocks(window, k_max)
        self.ring_rows = self.bps * ring.RING_BLOCK
        total = ring.ring_total_blocks(slots, window, k_max) * ring.RING_BLOCK
        self.cache_k = torch.zeros(total, heads, head_dim, dtype=dtype)
        self.cache_v = torch.zeros(total, heads, head_dim, dtype=dtype)
        self.assign, self.table, self.filter_ = assign, table, filter_
        self.rows_table = rows_table
        self.width = width

    def step(self, req_ids: Sequence[str], contexts: Sequence[tuple[torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]],
             first_query_pos: Sequence[int], queries: Sequence[tuple[torch.Tensor, torch.Tensor,
                                                                    torch.Tensor]],
             alive: Callable[[str], bool] | None = None) -> list[torch.Tensor]:
        """contexts[r] = (positions, k, v) of request r's context rows this step (accepted and
        rejected); queries[r] = (q, k, v) of its query block, at positions first_query_pos[r]
        onwards. Context rows are written first, then query rows, then every request attends
        (the order of vLLM's precompute, forward K/V write and attention). Returns each
        request's paged attention output [nq, H, D]."""
        slots, fresh = self.assign(list(req_ids), alive)
        for s in fresh:   # a slot handed out fresh starts from zero rows
            lo, hi = s * self.ring_rows, (s + 1) * self.ring_rows
            self.cache_k[lo:hi] = 0
            self.cache_v[lo:hi] = 0
        bt = self.table(self.rows_table, torch.tensor(slots))
        b = len(req_ids)
        nq = queries[0][0].shape[0]
        ctx_pos = torch.cat([c[0] for c in contexts])
        qsl = torch.tensor([0] + [len(c[0]) for c in contexts]).cumsum(0).to(torch.int32)
        ctx_slots = torch.cat([kernel_slots(bt[r], contexts[r][0]) for r in range(b)])
        qpos = torch.cat([torch.arange(p, p + nq) for p in first_query_pos])
        ctx_slots = self.filter_(ctx_slots, ctx_pos, qsl, qpos, b, nq, self.k_max,
                                 self.ring_rows)
        write_rows(self.cache_k, self.cache_v, ctx_slots, torch.cat([c[1] for c in contexts]),
                   torch.cat([c[2] for c in contexts]))
        out = []
        for r in range(b):
            qp = torch.arange(first_query_pos[r], first_query_pos[r] + nq)
            write_rows(self.cache_k, self.cache_v, kernel_slots(bt[r], qp), queries[r][1],
                       queries[r][2])
        for r in range(b):
            out.append(paged_window_attention(queries[r][0], self.cache_k, self.cache_v, bt[r],
                                              first_query_pos[r] + nq, self.window))
        return out
