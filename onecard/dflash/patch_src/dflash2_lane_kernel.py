# SPDX-License-Identifier: Apache-2.0
# onecard 0080 (DFlash2): the lookup lane's suffix match as one Triton kernel.
"""The device lookup lane's match (dflash2_lane.DeviceLane, ONECARD_DFLASH_LANE=device).

For every end position e of a request's token history (e < its length, e >= key_len) the
kernel counts how many tokens before e equal the last tokens of history + drafts (at most M =
dflash2_lookup_max_match), packs (length, tokens available after e up to ``want``, e) into one
int64 (dflash2_lane._score: longest match, then most tokens, then most recent) and keeps the
block's maximum; torch takes the max over blocks. No host sync, no temporary larger than
B x cdiv(width, BLOCK) int64. Reference: dflash2_lane.lane_match_torch
(tests/dflash/test_device_lane.py, under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from vllm.triton_utils import tl, triton


@triton.jit
def _lane_match_kernel(hist_ptr, hist_stride, slot_ptr, count_ptr, query_ptr, part_ptr,
                       n_blocks, key_len, want, M: tl.constexpr, BLOCK: tl.constexpr,
                       PAD: tl.constexpr):
    b = tl.program_id(0)
    blk = tl.program_id(1)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    n = tl.load(count_ptr + b).to(tl.int64)
    ends = blk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    alive = (ends >= key_len) & (ends < n)
    length = tl.zeros([BLOCK], dtype=tl.int64)
    row = hist_ptr + slot * hist_stride
    for j in tl.static_range(M):
        qj = tl.load(query_ptr + b * M + j)
        at = ends - 1 - j
        h = tl.load(row + at, mask=alive & (at >= 0), other=PAD)
        alive = alive & (h == qj)
        length += alive.to(tl.int64)
    avail = tl.minimum(n - ends, want)
    score = ((length * (want + 1) + avail) << 32) | ends
    ok = (length >= key_len) & (ends >= key_len) & (ends < n)
    score = tl.where(ok, score, -1)
    tl.store(part_ptr + b * n_blocks + blk, tl.max(score, axis=0))


def lane_match(hist: torch.Tensor, slot_idx: torch.Tensor, count: torch.Tensor,
               query: torch.Tensor, key_len: int, want: int, block: int,
               pad: int) -> torch.Tensor:
    """[B] int64 best packed score (dflash2_lane._score's packing), -1 where nothing matches:
    one program per (batch row, ``block`` end positions), then a max over the programs."""
    b, m = query.shape
    n_blocks = triton.cdiv(hist.shape[1], block)
    part = torch.empty(b, n_blocks, dtype=torch.int64, device=hist.device)
    _lane_match_kernel[(b, n_blocks)](
        hist, hist.stride(0), slot_idx, count, query.contiguous(), part, n_blocks, key_len,
        want, M=m, BLOCK=block, PAD=pad)
    return part.amax(-1)
