# SPDX-License-Identifier: Apache-2.0
"""Wide-verify attention: 1..16 query tokens per sequence against a long paged KV cache.

Speculative decoding verifies a block of q_len (draft + 1) tokens per sequence. This kernel is
split-KV (flash-decoding style): program (sequence, kv head, split) reads its slice of the
sequence's K/V pages once and applies it to every query row of the block times every query head
of the GQA group (q_len x group rows, e.g. 16 x 6 = 96), keeping a partial softmax state. A
second kernel combines the splits with log-sum-exp weights. With one split the first kernel
writes the output directly.

Cache layout (vLLM 0.27.1, TRITON_ATTN backend, as handed to ``unified_attention``):
  key_cache / value_cache : [num_blocks, block_size, num_kv_heads, D_store] (any strides; the
                            last dim must be contiguous). D_store >= head_dim for bf16/fp16 and
                            int8, >= head_dim // 2 for int4 (two 4-bit values per byte, element
                            2i in the low nibble, 2i+1 in the high nibble).
  k_scale_cache / v_scale_cache : [num_blocks, block_size, num_kv_heads] float32 (int8/int4).
      int8 : x = q * scale                   (symmetric per token and head)
      int4 : x = (nibble - zp) * scale       where the float32's low 4 mantissa bits hold zp;
             the cache holds H.D.x (randomized Hadamard, unnormalized), so the query is rotated
             the same way, the softmax scale is divided by head_dim and the output is rotated
             back (and divided by head_dim) - exactly what vLLM's int4 path does.
  block_table [num_seqs, max_blocks] int32, seq_lens [num_seqs] (context incl. the verify
  block), cu_seqlens_q [num_seqs + 1] (query_start_loc).

Causal rule inside the verify block: query i of a sequence with q_len queries and seq_len keys
sees key positions p < seq_len - q_len + i + 1.

This file is self-contained (triton + torch only; vLLM's RHT helper is imported lazily for int4)
so that the same text can ship inside vLLM as ``vllm/v1/attention/ops/onecard_wide_verify.py``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

KV_MODES = {"auto": 0, "bf16": 0, "fp16": 0, "int8": 2, "int4": 4}
MAX_QUERY_LEN = 16
_LOG2E = 1.4426950408889634
_SM_COUNT: dict[int, int] = {}


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    # Triton's CPU interpreter mis-multiplies bf16 operands; tests set DOT_F32 there.
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _wide_verify_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    block_table_ptr,
    seq_lens_ptr,
    cu_q_ptr,
    out_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    qk_scale,  # softmax scale * log2(e)
    num_splits,
    page,  # KV page (block) size in tokens
    stride_q_t: tl.int64,
    stride_q_h: tl.int64,
    stride_o_t: tl.int64,
    stride_o_h: tl.int64,
    stride_k_blk: tl.int64,
    stride_k_slot: tl.int64,
    stride_k_head: tl.int64,
    stride_v_blk: tl.int64,
    stride_v_slot: tl.int64,
    stride_v_head: tl.int64,
    stride_ks_blk: tl.int64,
    stride_ks_slot: tl.int64,
    stride_ks_head: tl.int64,
    stride_vs_blk: tl.int64,
    stride_vs_slot: tl.int64,
    stride_vs_head: tl.int64,
    stride_bt: tl.int64,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TILE_N: tl.constexpr,
    KV_MODE: tl.constexpr,
    DIRECT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    qi = rows // GROUP_PAD
    g = rows % GROUP_PAD
    row_ok = (qi < q_len) & (g < GROUP)
    q_tok = (q_start + qi).to(tl.int64)
    q_head = kvh * GROUP + g
    # key p is visible to row r when p < limit[r]
    limit = tl.where(row_ok, ctx_len + qi + 1, 0)

    # this split's key range: per-sequence chunk, a multiple of TILE_N
    chunk = ((seq_len + num_splits - 1) // num_splits + TILE_N - 1) // TILE_N * TILE_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    n_tiles = (tl.maximum(hi - lo, 0) + TILE_N - 1) // TILE_N

    offs_n = tl.arange(0, TILE_N)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    q_row = q_tok[:, None] * stride_q_t + q_head[:, None] * stride_q_h

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    if KV_MODE == 4:
        HALF: tl.constexpr = HEAD_DIM // 2
        offs_h = tl.arange(0, HALF)
        q_e = tl.load(q_ptr + q_row + 2 * offs_h[None, :], mask=row_ok[:, None], other=0.0)
        q_o = tl.load(q_ptr + q_row + 2 * offs_h[None, :] + 1, mask=row_ok[:, None], other=0.0)
        # zero-point correction needs sum(q) of the values the dot really uses
        q_sum = tl.sum(q_e.to(tl.float32), axis=1) + tl.sum(q_o.to(tl.float32), axis=1)
        acc_e = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        for t in range(0, n_tiles):
            pos = lo + t * TILE_N + offs_n
            kv_ok = pos < hi
            blk = tl.load(bt_row + pos // page, mask=kv_ok, other=0).to(tl.int64)
            slot = pos % page
            kt = tl.load(
                k_ptr + blk[None, :] * stride_k_blk + slot[None, :] * stride_k_slot
                + kvh * stride_k_head + offs_h[:, None],
                mask=kv_ok[None, :], other=0,
            )
            kbits = tl.load(
                ks_ptr + blk * stride_ks_blk + slot * stride_ks_slot + kvh * stride_ks_head,
                mask=kv_ok, other=0.0,
            ).to(tl.int32, bitcast=True)
            k_zp = (kbits & 0xF).to(tl.float32)
            k_sc = (kbits & -16).to(tl.float32, bitcast=True)
            k_lo = (kt & 0xF).to(tl.float32).to(q_e.dtype)
            k_hi = ((kt >> 4) & 0xF).to(tl.float32).to(q_e.dtype)
            s = _dot(q_e, k_lo, DOT_F32) + _dot(q_o, k_hi, DOT_F32)
            s = (s - q_sum[:, None] * k_zp[None, :]) * (qk_scale * k_sc[None, :])
            s = tl.where((pos[None, :] < limit[:, None]) & kv_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
            vt = tl.load(
                v_ptr + blk[:, None] * stride_v_blk + slot[:, None] * stride_v_slot
                + kvh * stride_v_head + offs_h[None, :],
                mask=kv_ok[:, None], other=0,
            )
            vbits = tl.load(
                vs_ptr + blk * stride_vs_blk + slot * stride_vs_slot + kvh * stride_vs_head,
                mask=kv_ok, other=0.0,
            ).to(tl.int32, bitcast=True)
            v_zp = (vbits & 0xF).to(tl.float32)
            v_sc = (vbits & -16).to(tl.float32, bitcast=True)
            pv = (p * v_sc[None, :]).to(q_e.dtype)
            pv_zp = tl.sum(pv.to(tl.float32) * v_zp[None, :], axis=1)
            v_lo = (vt & 0xF).to(tl.float32).to(q_e.dtype)
            v_hi = ((vt >> 4) & 0xF).to(tl.float32).to(q_e.dtype)
            acc_e = acc_e * alpha[:, None] + _dot(pv, v_lo, DOT_F32) - pv_zp[:, None]
            acc_o = acc_o * alpha[:, None] + _dot(pv, v_hi, DOT_F32) - pv_zp[:, None]
        if DIRECT:
            inv = tl.where(l_i > 0.0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)
            o_row = q_tok[:, None] * stride_o_t + q_head[:, None] * stride_o_h
            tl.store(out_ptr + o_row + 2 * offs_h[None, :],
                     (acc_e * inv[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
            tl.store(out_ptr + o_row + 2 * offs_h[None, :] + 1,
                     (acc_o * inv[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            ml_idx = (q_tok * NUM_Q_HEADS + q_head) * num_splits + split
            po = ml_idx[:, None] * HEAD_DIM
            tl.store(part_o_ptr + po + 2 * offs_h[None, :], acc_e, mask=row_ok[:, None])
            tl.store(part_o_ptr + po + 2 * offs_h[None, :] + 1, acc_o, mask=row_ok[:, None])
            tl.store(part_m_ptr + ml_idx, m_i, mask=row_ok)
            tl.store(part_l_ptr + ml_idx, l_i, mask=row_ok)
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + q_row + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for t in range(0, n_tiles):
            pos = lo + t * TILE_N + offs_n
            kv_ok = pos < hi
            blk = tl.load(bt_row + pos // page, mask=kv_ok, other=0).to(tl.int64)
            slot = pos % page
            kt = tl.load(
                k_ptr + blk[None, :] * stride_k_blk + slot[None, :] * stride_k_slot
                + kvh * stride_k_head + offs_d[:, None],
                mask=kv_ok[None, :], other=0,
            )
            if KV_MODE == 2:
                k_sc = tl.load(
                    ks_ptr + blk * stride_ks_blk + slot * stride_ks_slot + kvh * stride_ks_head,
                    mask=kv_ok, other=0.0,
                )
                s = _dot(q, kt.to(tl.float32).to(q.dtype), DOT_F32)
                s = s * (qk_scale * k_sc[None, :])
            else:
                s = _dot(q, kt.to(q.dtype), DOT_F32) * qk_scale
            s = tl.where((pos[None, :] < limit[:, None]) & kv_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
            vt = tl.load(
                v_ptr + blk[:, None] * stride_v_blk + slot[:, None] * stride_v_slot
                + kvh * stride_v_head + offs_d[None, :],
                mask=kv_ok[:, None], other=0,
            )
            if KV_MODE == 2:
                v_sc = tl.load(
                    vs_ptr + blk * stride_vs_blk + slot * stride_vs_slot + kvh * stride_vs_head,
                    mask=kv_ok, other=0.0,
                )
                pv = (p * v_sc[None, :]).to(q.dtype)
                acc = acc * alpha[:, None] + _dot(pv, vt.to(tl.float32).to(q.dtype), DOT_F32)
            else:
                acc = acc * alpha[:, None] + _dot(p.to(q.dtype), vt.to(q.dtype), DOT_F32)
        if DIRECT:
            inv = tl.where(l_i > 0.0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)
            o_row = q_tok[:, None] * stride_o_t + q_head[:, None] * stride_o_h
            tl.store(out_ptr + o_row + offs_d[None, :],
                     (acc * inv[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            ml_idx = (q_tok * NUM_Q_HEADS + q_head) * num_splits + split
            tl.store(part_o_ptr + ml_idx[:, None] * HEAD_DIM + offs_d[None, :], acc,
                     mask=row_ok[:, None])
            tl.store(part_m_ptr + ml_idx, m_i, mask=row_ok)
            tl.store(part_l_ptr + ml_idx, l_i, mask=row_ok)


@triton.jit
def _wide_verify_reduce_kernel(
    out_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    num_splits,
    stride_o_t: tl.int64,
    stride_o_h: tl.int64,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    base = (tok * NUM_Q_HEADS + head) * num_splits
    m = tl.load(part_m_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + base + offs_s, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(s_ok, tl.math.exp2(m - m_use), 0.0)
    w = tl.where(l > 0.0, w, 0.0)
    denom = tl.sum(w * l, axis=0)
    o = tl.load(part_o_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_ok[:, None] & (w[:, None] > 0.0), other=0.0)
    acc = tl.sum(o * w[:, None], axis=0)
    res = tl.where(denom > 0.0, acc / tl.maximum(denom, 1e-30), 0.0)
    tl.store(out_ptr + tok * stride_o_t + head * stride_o_h + offs_d,
             res.to(out_ptr.dtype.element_ty))


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 16
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_num_splits(max_seq_len: int, num_seqs: int, num_kv_heads: int, num_sms: int,
                      *, min_chunk: int = 256, max_splits: int = 64,
                      waves: float = 2.0) -> int:
    """Splits per (sequence, kv head): enough programs to fill ``waves`` x the SMs, each split
    at least ``min_chunk`` keys, at most ``max_splits``."""
    if max_seq_len <= min_chunk:
        return 1
    want = math.ceil(waves * num_sms / max(1, num_seqs * num_kv_heads))
    cap = math.ceil(max_seq_len / min_chunk)
    return int(max(1, min(want, cap, max_splits)))


def _kv_mode_id(kv_mode) -> int:
    if isinstance(kv_mode, str):
        if kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode {kv_mode!r} is not valid; valid: {', '.join(KV_MODES)}")
        return KV_MODES[kv_mode]
    mode = int(kv_mode)  # vLLM KVQuantMode is an IntEnum-like: NONE=0, INT8=2, INT4=4
    if mode not in (0, 2, 4):
        raise ValueError(f"kv_mode {kv_mode!r} is not valid; valid: NONE(0), "
                         "INT8_PER_TOKEN_HEAD(2), INT4_PER_TOKEN_HEAD(4)")
    return mode


def wide_verify_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    softmax_scale: float,
    kv_mode="auto",
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    tile_n: int = 32,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_partial_bytes: int = 64 << 20,
) -> torch.Tensor:
    """Causal verify attention over vLLM's paged cache; writes ``out`` [T, Hq, D] and returns it.

    q: [T, Hq, D] (bf16/fp16), T = cu_seqlens_q[-1]; every sequence has 1..16 query tokens and
    ``max_query_len`` bounds them. ``num_splits`` None picks from ``max_seq_len`` (or the cache
    capacity of the block table when None) and the SM count, capped so that the float32 partial
    results stay under ``max_partial_bytes``.
    """
    mode = _kv_mode_id(kv_mode)
    if not 1 <= max_query_len <= MAX_QUERY_LEN:
        raise ValueError(f"max_query_len={max_query_len} is not valid; valid: 1..{MAX_QUERY_LEN}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, page, num_kv_heads, d_store = key_cache.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim={head_dim} is not valid; valid: a power of two >= 16")
    need = head_dim // 2 if mode == 4 else head_dim
    if d_store < need or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError(f"cache last dim {d_store} (stride {key_cache.stride(3)}) cannot hold "
                         f"{need} contiguous elements for kv_mode {kv_mode!r}")
    if mode and (k_scale_cache is None or v_scale_cache is None):
        raise ValueError("int8/int4 KV needs k_scale_cache and v_scale_cache")
    if mode == 0:
        k_scale_cache = v_scale_cache = seq_lens  # unused dummies (never loaded)
        ks_strides = vs_strides = (0, 0, 0)
    else:
        ks_strides, vs_strides = k_scale_cache.stride(), v_scale_cache.stride()
    num_seqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(triton.next_power_of_2(max_query_len), triton.cdiv(16, group_pad))
    if max_seq_len is None:
        max_seq_len = block_table.shape[1] * page
    if num_splits is None:
        num_splits = choose_num_splits(max_seq_len, num_seqs, num_kv_heads, _sm_count(q.device))
        per_split = max(1, num_tokens * num_q_heads * (head_dim + 2) * 4)
        num_splits = min(num_splits, max(1, max_partial_bytes // per_split))
    num_splits = max(1, int(num_splits))
    if num_warps is None:
        num_warps = 8 if block_q * group_pad * head_dim >= 64 * 256 else 4
    if num_stages is None:
        num_stages = 2

    scale = softmax_scale
    q_in, target = q, out
    if mode == 4:
        from vllm.v1.attention.ops.int4_per_token_head import single_rht

        q_in = single_rht(q.float()).to(q.dtype)
        scale = softmax_scale / head_dim
        target = torch.empty(q.shape, dtype=torch.float32, device=q.device)

    direct = num_splits == 1
    if direct:
        part_o = part_m = part_l = target  # unused
    else:
        part_o = torch.empty((num_tokens, num_q_heads, num_splits, head_dim),
                             dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_tokens, num_q_heads, num_splits),
                             dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)

    _wide_verify_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q_in, key_cache, value_cache, k_scale_cache, v_scale_cache,
        block_table, seq_lens, cu_seqlens_q,
        target, part_o, part_m, part_l,
        scale * _LOG2E, num_splits, page,
        q_in.stride(0), q_in.stride(1), target.stride(0), target.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        ks_strides[0], ks_strides[1], ks_strides[2],
        vs_strides[0], vs_strides[1], vs_strides[2],
        block_table.stride(0),
        NUM_Q_HEADS=num_q_heads, GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, TILE_N=tile_n, KV_MODE=mode, DIRECT=direct,
        DOT_F32=q.device.type != "cuda",  # CPU tensors only run under TRITON_INTERPRET
        num_warps=num_warps, num_stages=num_stages,
    )
    if not direct:
        _wide_verify_reduce_kernel[(num_tokens, num_q_heads)](
            target, part_o, part_m, part_l, num_splits,
            target.stride(0), target.stride(1),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim,
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
            num_warps=8 if num_splits * head_dim > 4096 else 4,
        )
    if mode == 4:
        from vllm.v1.attention.ops.int4_per_token_head import single_rht

        out.copy_((single_rht(target, inverse=True) / head_dim).to(out.dtype))
    return out
