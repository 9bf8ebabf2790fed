# SPDX-License-Identifier: Apache-2.0
"""Triton kernels of the KVarN cache (format: onecard.kvarn.format; reference beside them in
onecard.kvarn.reference).

(a) ``kvarn_pack_tiles``: one full tile of the fp16 stage (rotated rows, ring half
    ``tile % 2``) -> normalize, quantize, pack into its paged block; tile 0 is also copied to the
    stage's sink rows. Program = (job, kv head).
(b) ``kvarn_attention``: split-KV causal decode / verify attention (q_len 1..16, GQA) over the
    packed tiles plus the fp16 sink tile and tail, structured like onecard.kernels.wide_verify:
    program (sequence, kv head, split) reads its share of the packed tiles [1, packed) once for
    all q_len x group query rows; program split == num_splits reads the fp16 rows (sink tile
    and ring tail); a second kernel merges all parts by log-sum-exp. The query is rotated once
    (q . k = (q Hn) . (k Hn)); packed K/V are dequantized in registers in sub-tiles of SUB_N
    tokens; the output is un-rotated once.
(c) ``kvarn_prefill``: one request's prefill chunk. Per group of up to 2048 queries the keys it
    sees are dequantized once, window by window, into a bounded fp16 scratch (dequant kernel:
    packed tiles in registers, sink / tail fp16 rows copied); a flash kernel (BLOCK_M queries x
    one q head per program, causal) runs over each window and carries an fp32 online-softmax
    state to the next (the log-sum-exp merge). Memory: format.prefill_scratch_bytes.

Self-contained (torch, triton and the sibling ``format`` module) so kvarn/install.sh can copy
this package into vLLM. Triton kept basic (3.6 on the GPU host).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .format import (EPS, FP16_WINDOWS, PREFILL_QUERY_GROUP, PREFILL_WINDOW_TOKENS, Preset,
                     get_preset)

try:  # inside vLLM (kvarn/install.sh): patch 0070's copy of onecard/kernels/wide_verify.py
    from ..onecard_wide_verify import block_shared as _block_shared
except ImportError:  # onecard's own tree
    from ..kernels.wide_verify import block_shared as _block_shared

MAX_QUERY_LEN = 16
_LOG2E = 1.4426950408889634
_SM_COUNT: dict[int, int] = {}
_H: dict = {}


def _hadamard(d: int, device) -> torch.Tensor:
    key = (d, str(device))
    if key not in _H:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _H[key] = (h / math.sqrt(d)).to(dtype=torch.float32, device=device)
    return _H[key]


def _byte_storage(cache: torch.Tensor) -> torch.Tensor:
    """The cache's whole storage as a flat uint8 tensor (no host-to-device copy: safe while a
    CUDA graph is being captured)."""
    return torch.empty(0, dtype=torch.uint8, device=cache.device).set_(cache.untyped_storage())


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    # Triton's CPU interpreter mis-multiplies 16-bit operands; CPU tensors set DOT_F32.
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


# ------------------------------------------------------------------------------------------------
# (a) pack one full tile
# ------------------------------------------------------------------------------------------------


@triton.jit
def _kvarn_pack_kernel(
    stage_k_ptr, stage_v_ptr, cache_u8_ptr, cache_f16_ptr,
    src_row_ptr, sink_row_ptr, block_ptr,
    stride_s_row: tl.int64, stride_s_head: tl.int64,
    stride_c_blk: tl.int64, stride_c_head: tl.int64,
    eps,
    HEAD_DIM: tl.constexpr, TILE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    OFF_KC: tl.constexpr, OFF_VC: tl.constexpr, OFF_KSC: tl.constexpr, OFF_KMN: tl.constexpr,
    OFF_KN: tl.constexpr, OFF_VSC: tl.constexpr, OFF_VMN: tl.constexpr, OFF_VG: tl.constexpr,
    V_CLIP: tl.constexpr = 1.0,
):
    # stage_* are fp16 rows [R, Hkv, D]: job j packs rows [src_row[j], src_row[j] + TILE) into
    # block block[j]; when sink_row[j] >= 0 the rows are also copied to [sink_row[j], + TILE).
    # A job with block < 0 is padding (a CUDA-graph decode plan of fixed size): it does nothing.
    job = tl.program_id(0)
    kvh = tl.program_id(1)
    blk = tl.load(block_ptr + job).to(tl.int64)
    if blk < 0:
        return
    row0 = tl.load(src_row_ptr + job).to(tl.int64)
    sink0 = tl.load(sink_row_ptr + job).to(tl.int64)
    offs_t = tl.arange(0, TILE)
    offs_d = tl.arange(0, HEAD_DIM)
    src = (row0 + offs_t)[:, None] * stride_s_row + kvh * stride_s_head + offs_d[None, :]
    k16 = tl.load(stage_k_ptr + src)
    v16 = tl.load(stage_v_ptr + src)
    if sink0 >= 0:  # the first tile stays readable in fp16 (sink rows)
        sink = (sink0 + offs_t)[:, None] * stride_s_row + kvh * stride_s_head + offs_d[None, :]
        tl.store(stage_k_ptr + sink, k16)
        tl.store(stage_v_ptr + sink, v16)
    base = blk * stride_c_blk + kvh * stride_c_head  # bytes
    base16 = base // 2
    KMAX: tl.constexpr = (1 << K_BITS) - 1
    VMAX: tl.constexpr = (1 << V_BITS) - 1
    # K: per-token RMS normalizer, per-channel asymmetric rounding over the tile
    r = k16.to(tl.float32)
    kn = tl.maximum(tl.sqrt(tl.sum(r * r, axis=1) / HEAD_DIM), eps).to(tl.float16)
    u = r / kn.to(tl.float32)[:, None]
    lo = tl.min(u, axis=0)
    hi = tl.max(u, axis=0)
    kmn = lo.to(tl.float16)
    ksc = tl.maximum((hi - lo) / KMAX, eps).to(tl.float16)
    kc = tl.floor((u - kmn.to(tl.float32)[None, :]) / ksc.to(tl.float32)[None, :] + 0.5)
    kc = tl.minimum(tl.maximum(kc, 0.0), KMAX).to(tl.int32)
    # V: per-channel RMS normalizer over the tile, per-token asymmetric rounding
    r = v16.to(tl.float32)
    vg = tl.maximum(tl.sqrt(tl.sum(r * r, axis=0) / TILE), eps).to(tl.float16)
    w = r / vg.to(tl.float32)[None, :]
    lo = tl.min(w, axis=1)
    hi = tl.max(w, axis=1)
    if V_CLIP != 1.0:  # the range mid +- V_CLIP * (hi - lo) / 2 (reference.quantize_tile)
        half = (hi - lo) * (0.5 * V_CLIP)
        lo = (hi + lo) * 0.5 - half
        rng = 2.0 * half
    else:
        rng = hi - lo
    vmn = lo.to(tl.float16)
    vsc = tl.maximum(rng / VMAX, eps).to(tl.float16)
    vc = tl.floor((w - vmn.to(tl.float32)[:, None]) / vsc.to(tl.float32)[:, None] + 0.5)
    vc = tl.minimum(tl.maximum(vc, 0.0), VMAX).to(tl.int32)
    # pack: PER codes a byte, code j of a byte at bit j * BITS
    KPER: tl.constexpr = 8 // K_BITS
    VPER: tl.constexpr = 8 // V_BITS
    kshift = (tl.arange(0, KPER) * K_BITS)[None, None, :]
    kb = tl.sum(tl.reshape(kc, [TILE, HEAD_DIM // KPER, KPER]) << kshift, axis=2)
    vshift = (tl.arange(0, VPER) * V_BITS)[None, None, :]
    vb = tl.sum(tl.reshape(vc, [TILE, HEAD_DIM // VPER, VPER]) << vshift, axis=2)
    kcol = tl.arange(0, HEAD_DIM // KPER)
    vcol = tl.arange(0, HEAD_DIM // VPER)
    tl.store(cache_u8_ptr + base + OFF_KC + offs_t[:, None] * (HEAD_DIM // KPER) + kcol[None, :],
             kb.to(tl.uint8))
    tl.store(cache_u8_ptr + base + OFF_VC + offs_t[:, None] * (HEAD_DIM // VPER) + vcol[None, :],
             vb.to(tl.uint8))
    tl.store(cache_f16_ptr + base16 + OFF_KSC // 2 + offs_d, ksc)
    tl.store(cache_f16_ptr + base16 + OFF_KMN // 2 + offs_d, kmn)
    tl.store(cache_f16_ptr + base16 + OFF_KN // 2 + offs_t, kn)
    tl.store(cache_f16_ptr + base16 + OFF_VSC // 2 + offs_t, vsc)
    tl.store(cache_f16_ptr + base16 + OFF_VMN // 2 + offs_t, vmn)
    tl.store(cache_f16_ptr + base16 + OFF_VG // 2 + offs_d, vg)


def _layout_consts(layout) -> dict:
    return dict(OFF_KC=layout.k_codes, OFF_VC=layout.v_codes, OFF_KSC=layout.k_scale,
                OFF_KMN=layout.k_min, OFF_KN=layout.k_norm, OFF_VSC=layout.v_scale,
                OFF_VMN=layout.v_min, OFF_VG=layout.v_norm)


def _check_cache(cache: torch.Tensor, layout, num_kv_heads: int) -> None:
    if (cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[1] != num_kv_heads
            or cache.shape[2] < layout.block_bytes or cache.stride(2) != 1
            or cache.stride(0) % 2 or cache.stride(1) % 2 or cache.storage_offset() % 2):
        raise ValueError(f"KVarN cache must be uint8 [num_blocks, {num_kv_heads}, >= "
                         f"{layout.block_bytes}] with even strides; got {tuple(cache.shape)} "
                         f"{cache.dtype} strides {cache.stride()}")


def kvarn_pack_tiles(stage_k: torch.Tensor, stage_v: torch.Tensor, cache: torch.Tensor, *,
                     slots: torch.Tensor, tiles: torch.Tensor, blocks: torch.Tensor,
                     preset: str | Preset | None = None) -> None:
    """Pack full tiles: job j reads ring half ``tiles[j] % 2`` of ``stage_*[slots[j]]`` and
    writes block ``blocks[j]`` of ``cache`` ([nb, Hkv, block_bytes] uint8); tile 0 is also
    copied to rows [0, tile) of the stage. stage_*: [num_slots, 3 * tile, Hkv, D] fp16."""
    p = get_preset(preset)
    n_slots, rows, nkv, d = stage_k.shape
    if rows != 3 * p.tile or stage_v.shape != stage_k.shape or stage_k.dtype != torch.float16 \
            or stage_k.stride() != stage_v.stride() or stage_k.stride(3) != 1 \
            or stage_k.stride(0) != rows * stage_k.stride(1):
        raise ValueError(f"stage must be fp16 [slots, {3 * p.tile}, Hkv, D] (same strides for K "
                         f"and V); got {tuple(stage_k.shape)} {stage_k.dtype}")
    T = p.tile
    slots64, tiles64 = slots.long(), tiles.long()
    src = (slots64 * 3 * T + T + (tiles64 % 2) * T).to(torch.int32)
    sink = torch.where(tiles64 == 0, slots64 * 3 * T, -1).to(torch.int32)
    kvarn_pack_rows(stage_k.flatten(0, 1), stage_v.flatten(0, 1), cache, src_rows=src,
                    sink_rows=sink, blocks=blocks, preset=p)


def kvarn_pack_rows(rows_k: torch.Tensor, rows_v: torch.Tensor, cache: torch.Tensor, *,
                    src_rows: torch.Tensor, blocks: torch.Tensor, sink_rows: torch.Tensor | None = None,
                    preset: str | Preset | None = None) -> None:
    """Pack full tiles from fp16 rotated rows ``rows_*`` [R, Hkv, D]: job j reads rows
    [src_rows[j], src_rows[j] + tile) and writes block ``blocks[j]`` of ``cache``; where
    ``sink_rows[j] >= 0`` the same rows are copied to [sink_rows[j], + tile) (the fp16 sink).
    A job with ``blocks[j] < 0`` is skipped (padding of a fixed-size CUDA-graph plan)."""
    p = get_preset(preset)
    if rows_k.dim() != 3 or rows_v.shape != rows_k.shape or rows_k.dtype != torch.float16 \
            or rows_v.dtype != torch.float16 or rows_k.stride() != rows_v.stride() \
            or rows_k.stride(2) != 1:
        raise ValueError(f"rows must be fp16 [R, Hkv, D] with equal K/V strides; got "
                         f"{tuple(rows_k.shape)} {rows_k.dtype} / {tuple(rows_v.shape)} {rows_v.dtype}")
    _, nkv, d = rows_k.shape
    layout = p.layout(d)
    _check_cache(cache, layout, nkv)
    n = src_rows.shape[0]
    if n == 0:
        return
    if sink_rows is None:
        sink_rows = torch.full_like(src_rows, -1)
    storage = _byte_storage(cache)
    c16 = storage.view(torch.float16)
    # byte offsets relative to the storage start
    _kvarn_pack_kernel[(n, nkv)](
        rows_k, rows_v, storage[cache.storage_offset():], c16[cache.storage_offset() // 2:],
        src_rows, sink_rows, blocks,
        rows_k.stride(0), rows_k.stride(1),
        cache.stride(0), cache.stride(1), EPS,
        HEAD_DIM=d, TILE=p.tile, K_BITS=p.k_bits, V_BITS=p.v_bits, **_layout_consts(layout),
        V_CLIP=float(p.v_clip), num_warps=8 if p.tile * d >= 128 * 128 else 4,
    )


# ------------------------------------------------------------------------------------------------
# (b) split-KV decode / verify attention
# ------------------------------------------------------------------------------------------------


@triton.jit
def _online_update(s, m_i, l_i):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@triton.jit
def _kvarn_attn_split_kernel(
    q_ptr, cache_u8_ptr, cache_f16_ptr, stage_k_ptr, stage_v_ptr,
    block_table_ptr, seq_lens_ptr, cu_q_ptr, packed_ptr, sink_row_ptr, tail_row_ptr, prev_row_ptr,
    part_o_ptr, part_m_ptr, part_l_ptr,
    qk_scale, num_splits, tiles_per_page, ring,
    stride_q_t: tl.int64, stride_q_h: tl.int64,
    stride_c_blk: tl.int64, stride_c_head: tl.int64,
    stride_s_row: tl.int64, stride_s_head: tl.int64,
    stride_bt: tl.int64,
    stride_sk_seq, stride_sk_j, stride_pv_seq, stride_pv_j,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr, SUB_N: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    OFF_KC: tl.constexpr, OFF_VC: tl.constexpr, OFF_KSC: tl.constexpr, OFF_KMN: tl.constexpr,
    OFF_KN: tl.constexpr, OFF_VSC: tl.constexpr, OFF_VMN: tl.constexpr, OFF_VG: tl.constexpr,
    DOT_F32: tl.constexpr, N_SINK_COLS: tl.constexpr = 1, N_PREV_COLS: tl.constexpr = 1,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    parts = num_splits + 1

    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    packed = tl.load(packed_ptr + seq)
    tail0_row = tl.load(tail_row_ptr + seq).to(tl.int64)
    # sink tiles 0 .. n_sink - 1 from rows sink_row[seq, j] (a prefix of entries >= 0, only
    # tiles < packed); tiles packed .. packed + n_prev - 1 from rows prev_row[seq, j]
    sk_row = sink_row_ptr + seq.to(tl.int64) * stride_sk_seq
    pv_row = prev_row_ptr + seq.to(tl.int64) * stride_pv_seq
    n_sink = packed * 0
    for j in tl.static_range(N_SINK_COLS):
        n_sink += ((tl.load(sk_row + j * stride_sk_j) >= 0) & (n_sink == j)).to(n_sink.dtype)
    n_sink = tl.minimum(n_sink, packed)
    n_prev = packed * 0
    for j in tl.static_range(N_PREV_COLS):
        n_prev += ((tl.load(pv_row + j * stride_pv_j) >= 0) & (n_prev == j)).to(n_prev.dtype)
    ctx_len = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    qi = rows // GROUP_PAD
    g = rows % GROUP_PAD
    row_ok = (qi < q_len) & (g < GROUP)
    q_tok = (q_start + qi).to(tl.int64)
    q_head = kvh * GROUP + g
    limit = tl.where(row_ok, ctx_len + qi + 1, 0)  # key p visible to a row when p < limit

    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, SUB_N)
    q = tl.load(q_ptr + q_tok[:, None] * stride_q_t + q_head[:, None] * stride_q_h + offs_d[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float16)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    KPER: tl.constexpr = 8 // K_BITS
    VPER: tl.constexpr = 8 // V_BITS
    KMASK: tl.constexpr = (1 << K_BITS) - 1
    VMASK: tl.constexpr = (1 << V_BITS) - 1
    k_byte = offs_d // KPER
    k_shift = (offs_d % KPER) * K_BITS
    v_byte = offs_d // VPER
    v_shift = (offs_d % VPER) * V_BITS

    # ---- packed tiles [first, packed): split s < num_splits takes a contiguous share
    first = n_sink
    n_pk = tl.maximum(packed - first, 0)
    chunk = (n_pk + num_splits - 1) // num_splits
    t_lo = first + split * chunk
    t_hi = tl.minimum(t_lo + chunk, packed)
    t_hi = tl.where(split < num_splits, t_hi, t_lo)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for t in range(t_lo, t_hi):
        page = tl.load(bt_row + t // tiles_per_page).to(tl.int64)
        blk = page * tiles_per_page + t % tiles_per_page
        base = blk * stride_c_blk + kvh * stride_c_head
        base16 = base // 2
        ksc = tl.load(cache_f16_ptr + base16 + OFF_KSC // 2 + offs_d).to(tl.float32)
        kmn = tl.load(cache_f16_ptr + base16 + OFF_KMN // 2 + offs_d).to(tl.float32)
        vg = tl.load(cache_f16_ptr + base16 + OFF_VG // 2 + offs_d).to(tl.float32)
        for c in tl.static_range(TILE // SUB_N):
            tok = c * SUB_N + offs_n
            pos = t * TILE + tok
            # K^T [D, SUB_N], dequantized (rotated space): kn[t] * (code * ksc[c] + kmn[c])
            kbyte = tl.load(cache_u8_ptr + base + OFF_KC + tok[None, :] * (HEAD_DIM // KPER)
                            + k_byte[:, None]).to(tl.int32)
            kcode = ((kbyte >> k_shift[:, None]) & KMASK).to(tl.float32)
            kn = tl.load(cache_f16_ptr + base16 + OFF_KN // 2 + tok).to(tl.float32)
            kd = ((kcode * ksc[:, None] + kmn[:, None]) * kn[None, :]).to(tl.float16)
            s = _dot(q, kd, DOT_F32) * qk_scale
            s = tl.where(pos[None, :] < limit[:, None], s, float("-inf"))
            p, alpha, m_i, l_i = _online_update(s, m_i, l_i)
            # V [SUB_N, D]: vg[c] * (code * vsc[t] + vmn[t])
            vbyte = tl.load(cache_u8_ptr + base + OFF_VC + tok[:, None] * (HEAD_DIM // VPER)
                            + v_byte[None, :]).to(tl.int32)
            vcode = ((vbyte >> v_shift[None, :]) & VMASK).to(tl.float32)
            vsc = tl.load(cache_f16_ptr + base16 + OFF_VSC // 2 + tok).to(tl.float32)
            vmn = tl.load(cache_f16_ptr + base16 + OFF_VMN // 2 + tok).to(tl.float32)
            vd = (vg[None, :] * (vcode * vsc[:, None] + vmn[:, None])).to(tl.float16)
            acc = acc * alpha[:, None] + _dot(p.to(tl.float16), vd, DOT_F32)

    # ---- fp16 rows (program split == num_splits): the sink tiles j < n_sink from rows
    # sink_row[seq, j] + p % TILE, then the tail from packed * TILE: tile packed + j < packed +
    # n_prev (the own tile's previous tiles of its fp16 window) from rows prev_row[seq, j] +
    # p % ring, the rest (the own tile) from rows tail0_row + p % ring
    n_sink_ch = n_sink * (TILE // SUB_N)
    tail0 = packed * TILE
    n_chunks = n_sink_ch + (tl.maximum(seq_len - tail0, 0) + SUB_N - 1) // SUB_N
    n_chunks = tl.where(split == num_splits, n_chunks, 0)
    srow = stage_k_ptr + kvh * stride_s_head
    vrow = stage_v_ptr + kvh * stride_s_head
    for i in range(0, n_chunks):
        is_sink = i < n_sink_ch
        pos = tl.where(is_sink, i * SUB_N, tail0 + (i - n_sink_ch) * SUB_N) + offs_n
        tt = pos // TILE
        s_base = tl.load(sk_row + tl.minimum(tt, N_SINK_COLS - 1) * stride_sk_j).to(tl.int64)
        j_prev = tl.minimum(tl.maximum(tt - packed, 0), N_PREV_COLS - 1)
        p_base = tl.load(pv_row + j_prev * stride_pv_j).to(tl.int64)
        row = tl.where(is_sink, s_base + pos % TILE,
                       tl.where(tt - packed < n_prev, p_base, tail0_row) + pos % ring).to(tl.int64)
        ok = pos < seq_len
        kt = tl.load(srow + row[None, :] * stride_s_row + offs_d[:, None], mask=ok[None, :], other=0.0)
        s = _dot(q, kt, DOT_F32) * qk_scale
        s = tl.where((pos[None, :] < limit[:, None]) & ok[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = _online_update(s, m_i, l_i)
        vt = tl.load(vrow + row[:, None] * stride_s_row + offs_d[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(tl.float16), vt, DOT_F32)

    ml_idx = (q_tok * NUM_Q_HEADS + q_head) * parts + split
    tl.store(part_o_ptr + ml_idx[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
    tl.store(part_m_ptr + ml_idx, m_i, mask=row_ok)
    tl.store(part_l_ptr + ml_idx, l_i, mask=row_ok)


@triton.jit
def _kvarn_reduce_kernel(
    out_ptr, part_o_ptr, part_m_ptr, part_l_ptr, parts,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PARTS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, PARTS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < parts
    base = (tok * NUM_Q_HEADS + head) * parts
    m = tl.load(part_m_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + base + offs_s, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(s_ok & (l > 0.0), tl.math.exp2(m - m_use), 0.0)
    denom = tl.sum(w * l, axis=0)
    o = tl.load(part_o_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_ok[:, None] & (w[:, None] > 0.0), other=0.0)
    res = tl.where(denom > 0.0, tl.sum(o * w[:, None], axis=0) / tl.maximum(denom, 1e-30), 0.0)
    tl.store(out_ptr + (tok * NUM_Q_HEADS + head) * HEAD_DIM + offs_d, res)


def _check_block_shared(rows: int, d: int, max_query_len: int, device: torch.device) -> None:
    """128 query rows x 256 (a verify of 9..16 tokens at 6 query heads per KV head) take
    WIDE_VERIFY_SHARED bytes of shared memory (Triton 3.9, sm_86): more than an RTX 3090 / 4090
    block may have, where Triton's launch would fail with OutOfResources. One line instead; the
    launcher refuses DFLASH_TOKENS > 7 with CTX=huge on such a card before the boot (plan.py)."""
    if device.type != "cuda" or rows * d <= 64 * 256:
        return
    have = _block_shared(device)
    if have < WIDE_VERIFY_SHARED:
        raise ValueError(f"KVarN verify of {max_query_len} query tokens needs {WIDE_VERIFY_SHARED:,} B of shared "
                         f"memory per block; this GPU has {have:,}; valid: verify blocks of at most 8 tokens "
                         f"(DFLASH_TOKENS <= 7 with CTX=huge)")


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 16
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_num_splits(max_packed_tiles: int, num_seqs: int, num_kv_heads: int, num_sms: int,
                      *, min_tiles: int = 2, max_splits: int = 64, waves: float = 2.0) -> int:
    """Splits of the packed tiles per (sequence, kv head): ~``waves`` x the SMs, each split at
    least ``min_tiles`` tiles, at most ``max_splits`` (the fp16 part is one more program)."""
    n = max(max_packed_tiles - 1, 0)
    if n <= min_tiles:
        return 1
    want = math.ceil(waves * num_sms / max(1, num_seqs * num_kv_heads))
    return int(max(1, min(want, math.ceil(n / min_tiles), max_splits)))


def kvarn_attention(
    q: torch.Tensor, cache: torch.Tensor, stage_k: torch.Tensor, stage_v: torch.Tensor,
    out: torch.Tensor, *, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
    packed_tiles: torch.Tensor, stage_slot: torch.Tensor, block_table: torch.Tensor,
    max_query_len: int, softmax_scale: float, preset: str | Preset | None = None,
    tiles_per_page: int = 1, **kw,
) -> torch.Tensor:
    """Causal decode/verify attention over a KVarN cache; writes ``out`` [T, Hq, D] (model space)
    and returns it.

    q [T, Hq, D] (any float dtype), T = cu_seqlens_q[-1], each sequence 1..16 query tokens (its
    last q_len positions). Sequence s has ``seq_lens[s]`` keys: tiles [0, packed_tiles[s]) are
    packed (tile 0 read from the stage's sink rows), positions from packed * tile on are in the
    stage ring of slot ``stage_slot[s]`` (at most 2 tiles). ``block_table`` [num_seqs, pages]
    lists pages of ``tiles_per_page`` consecutive blocks of ``cache``. Stage: [slots, 3 * tile,
    Hkv, D] fp16 (rows [0, tile) sink, rows tile + p % (2 * tile) the ring).
    """
    p = get_preset(preset)
    T = p.tile
    nkv = stage_k.shape[2]
    if stage_k.dim() != 4 or stage_k.shape[1] != 3 * T or stage_k.shape[3] != q.shape[-1] \
            or stage_k.stride() != stage_v.stride() or stage_k.dtype != torch.float16 \
            or stage_k.stride(3) != 1 or stage_k.stride(0) != 3 * T * stage_k.stride(1):
        raise ValueError(f"stage must be fp16 [slots, {3 * T}, {nkv}, {q.shape[-1]}] with equal "
                         f"K/V strides")
    base = stage_slot.long() * 3 * T
    return kvarn_attention_rows(
        q, cache, stage_k.flatten(0, 1), stage_v.flatten(0, 1), out, cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens, packed_tiles=packed_tiles, sink_rows=base.to(torch.int32),
        tail_rows=(base + T).to(torch.int32), ring=2 * T, block_table=block_table,
        max_query_len=max_query_len, softmax_scale=softmax_scale, preset=p,
        tiles_per_page=tiles_per_page, **kw)


WIDE_VERIFY_SHARED = 155_648   # kvarn_attention_rows at 9..16 query tokens (128 rows x 256), sm_86


def kvarn_attention_rows(
    q: torch.Tensor, cache: torch.Tensor, rows_k: torch.Tensor, rows_v: torch.Tensor,
    out: torch.Tensor, *, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
    packed_tiles: torch.Tensor, sink_rows: torch.Tensor, tail_rows: torch.Tensor, ring: int,
    block_table: torch.Tensor, max_query_len: int, softmax_scale: float,
    preset: str | Preset | None = None, tiles_per_page: int = 1,
    prev_rows: torch.Tensor | None = None,
    max_packed_tiles: int | None = None, num_splits: int | None = None,
    sub_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    max_partial_bytes: int = 64 << 20,
) -> torch.Tensor:
    """The same attention with the fp16 rows addressed directly: ``rows_*`` [R, Hkv, D] fp16
    (rotated). ``sink_rows`` / ``prev_rows``: [S] (one column) or [S, n] int32, any strides.
    Sequence s reads tiles [first, packed_tiles[s]) from the cache (a packed tile may extend
    past seq_len: the causal mask hides the rest), first = the number of leading entries of
    ``sink_rows[s]`` that are >= 0 (at most packed_tiles[s]): tile j < first is read from rows
    [sink_rows[s, j], + tile) (the fp16 sink tiles). Positions [packed * tile, seq_len) are
    rows ``tail_rows[s] + p % ring``, except that tile ``packed + j`` for each of the leading
    entries of ``prev_rows[s]`` that are >= 0 is rows ``prev_rows[s, j] + p % ring`` (the own
    tile's previous tiles of its fp16 window, each kept in its own stage slot)."""
    p = get_preset(preset)
    T = p.tile
    if not 1 <= max_query_len <= MAX_QUERY_LEN:
        raise ValueError(f"max_query_len={max_query_len} is not valid; valid: 1..{MAX_QUERY_LEN}")
    num_tokens, num_q_heads, d = q.shape
    if rows_k.dim() != 3 or rows_k.shape[2] != d or rows_k.stride() != rows_v.stride() \
            or rows_k.dtype != torch.float16 or rows_v.dtype != torch.float16 or rows_k.stride(2) != 1:
        raise ValueError(f"fp16 rows must be [R, Hkv, {d}] fp16 with equal K/V strides; got "
                         f"{tuple(rows_k.shape)} {rows_k.dtype}")
    nkv = rows_k.shape[1]
    layout = p.layout(d)
    _check_cache(cache, layout, nkv)
    if num_q_heads % nkv:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {nkv} kv heads")
    if sub_n is None:
        sub_n = min(T, 32 if q.device.type == "cuda" else 64)
    if T % sub_n:
        raise ValueError(f"sub_n {sub_n} must divide the tile {T}")
    num_seqs = seq_lens.shape[0]
    group = num_q_heads // nkv
    group_pad = triton.next_power_of_2(group)
    block_q = max(triton.next_power_of_2(max_query_len), triton.cdiv(16, group_pad))
    if num_splits is None:
        if max_packed_tiles is None:
            max_packed_tiles = block_table.shape[1] * tiles_per_page
        num_splits = choose_num_splits(max_packed_tiles, num_seqs, nkv, _sm_count(q.device))
        per_split = max(1, num_tokens * num_q_heads * (d + 2) * 4)
        num_splits = min(num_splits, max(1, max_partial_bytes // per_split - 1))
    num_splits = max(1, int(num_splits))
    parts = num_splits + 1
    if num_warps is None:
        num_warps = 8 if block_q * group_pad * d >= 64 * 256 else 4
    if num_stages is None:
        num_stages = 2
    _check_block_shared(block_q * group_pad, d, max_query_len, q.device)

    if prev_rows is None:
        prev_rows = torch.full_like(tail_rows, -1)
    sink_rows = sink_rows[:, None] if sink_rows.dim() == 1 else sink_rows
    prev_rows = prev_rows[:, None] if prev_rows.dim() == 1 else prev_rows
    if sink_rows.shape[0] != num_seqs or prev_rows.shape[0] != num_seqs:
        raise ValueError(f"sink_rows / prev_rows must have {num_seqs} rows; got "
                         f"{tuple(sink_rows.shape)} / {tuple(prev_rows.shape)}")
    hn = _hadamard(d, q.device)
    q_rot = (q.float().reshape(-1, d) @ hn).reshape(q.shape)  # q . k == (q Hn) . (k Hn)
    part_o = torch.empty((num_tokens, num_q_heads, parts, d), dtype=torch.float32, device=q.device)
    part_m = torch.empty((num_tokens, num_q_heads, parts), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    storage = _byte_storage(cache)
    c16 = storage.view(torch.float16)
    _kvarn_attn_split_kernel[(num_seqs, nkv, parts)](
        q_rot, storage[cache.storage_offset():], c16[cache.storage_offset() // 2:],
        rows_k, rows_v, block_table, seq_lens, cu_seqlens_q, packed_tiles, sink_rows, tail_rows,
        prev_rows, part_o, part_m, part_l,
        softmax_scale * _LOG2E, num_splits, tiles_per_page, ring,
        q_rot.stride(0), q_rot.stride(1), cache.stride(0), cache.stride(1),
        rows_k.stride(0), rows_k.stride(1), block_table.stride(0),
        sink_rows.stride(0), sink_rows.stride(1), prev_rows.stride(0), prev_rows.stride(1),
        NUM_Q_HEADS=num_q_heads, GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        HEAD_DIM=d, TILE=T, SUB_N=sub_n, K_BITS=p.k_bits, V_BITS=p.v_bits,
        **_layout_consts(layout), DOT_F32=q.device.type != "cuda",
        N_SINK_COLS=sink_rows.shape[1], N_PREV_COLS=prev_rows.shape[1],
        num_warps=num_warps, num_stages=num_stages,
    )
    o_rot = torch.empty((num_tokens, num_q_heads, d), dtype=torch.float32, device=q.device)
    _kvarn_reduce_kernel[(num_tokens, num_q_heads)](
        o_rot, part_o, part_m, part_l, parts,
        NUM_Q_HEADS=num_q_heads, HEAD_DIM=d, PARTS_PAD=max(2, triton.next_power_of_2(parts)),
        num_warps=8 if parts * d > 4096 else 4,
    )
    out.copy_((o_rot.reshape(-1, d) @ hn).reshape(out.shape))  # un-rotate once
    return out


# ------------------------------------------------------------------------------------------------
# (c) prefill: dequantize the prefix once per chunk into a bounded fp16 window, flash attention
# ------------------------------------------------------------------------------------------------

# PREFILL_WINDOW_TOKENS, PREFILL_QUERY_GROUP and prefill_scratch_bytes live in .format (the
# memory model reads them without torch).


@triton.jit
def _kvarn_dequant_kernel(
    cache_u8_ptr, cache_f16_ptr, rows_k_ptr, rows_v_ptr, out_k_ptr, out_v_ptr, bt_ptr,
    t0, seq_len, packed, sink0, sink1, n_sink, tail0, ring, tiles_per_page,
    stride_c_blk: tl.int64, stride_c_head: tl.int64,
    stride_r_row: tl.int64, stride_r_head: tl.int64,
    stride_o_row: tl.int64, stride_o_head: tl.int64,
    HEAD_DIM: tl.constexpr, TILE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    OFF_KC: tl.constexpr, OFF_VC: tl.constexpr, OFF_KSC: tl.constexpr, OFF_KMN: tl.constexpr,
    OFF_KN: tl.constexpr, OFF_VSC: tl.constexpr, OFF_VMN: tl.constexpr, OFF_VG: tl.constexpr,
):
    # program (j, kv head): tile t = t0 + j of the sequence -> fp16 rotated rows [j * TILE, + TILE)
    # of out_*: from the sink rows (t < n_sink: tile 0 at sink0, tile 1 at sink1), dequantized
    # from its packed block (t < packed), or from the fp16 tail rows tail0 + p % ring (zeros past
    # seq_len).
    j = tl.program_id(0)
    kvh = tl.program_id(1)
    t = t0 + j
    offs_t = tl.arange(0, TILE)
    offs_d = tl.arange(0, HEAD_DIM)
    pos = t * TILE + offs_t
    dst = (j * TILE + offs_t).to(tl.int64)[:, None] * stride_o_row + kvh * stride_o_head + offs_d[None, :]
    if t < packed:
        if t < n_sink:
            src = (tl.where(t == 0, sink0, sink1) + offs_t).to(tl.int64)[:, None] * stride_r_row + kvh * stride_r_head + offs_d[None, :]
            tl.store(out_k_ptr + dst, tl.load(rows_k_ptr + src))
            tl.store(out_v_ptr + dst, tl.load(rows_v_ptr + src))
        else:
            KPER: tl.constexpr = 8 // K_BITS
            VPER: tl.constexpr = 8 // V_BITS
            page = tl.load(bt_ptr + t // tiles_per_page).to(tl.int64)
            blk = page * tiles_per_page + t % tiles_per_page
            base = blk * stride_c_blk + kvh * stride_c_head
            base16 = base // 2
            ksc = tl.load(cache_f16_ptr + base16 + OFF_KSC // 2 + offs_d).to(tl.float32)
            kmn = tl.load(cache_f16_ptr + base16 + OFF_KMN // 2 + offs_d).to(tl.float32)
            vg = tl.load(cache_f16_ptr + base16 + OFF_VG // 2 + offs_d).to(tl.float32)
            kn = tl.load(cache_f16_ptr + base16 + OFF_KN // 2 + offs_t).to(tl.float32)
            vsc = tl.load(cache_f16_ptr + base16 + OFF_VSC // 2 + offs_t).to(tl.float32)
            vmn = tl.load(cache_f16_ptr + base16 + OFF_VMN // 2 + offs_t).to(tl.float32)
            kbyte = tl.load(cache_u8_ptr + base + OFF_KC + offs_t[:, None] * (HEAD_DIM // KPER)
                            + (offs_d // KPER)[None, :]).to(tl.int32)
            kcode = ((kbyte >> ((offs_d % KPER) * K_BITS)[None, :]) & ((1 << K_BITS) - 1)).to(tl.float32)
            tl.store(out_k_ptr + dst, ((kcode * ksc[None, :] + kmn[None, :]) * kn[:, None]).to(tl.float16))
            vbyte = tl.load(cache_u8_ptr + base + OFF_VC + offs_t[:, None] * (HEAD_DIM // VPER)
                            + (offs_d // VPER)[None, :]).to(tl.int32)
            vcode = ((vbyte >> ((offs_d % VPER) * V_BITS)[None, :]) & ((1 << V_BITS) - 1)).to(tl.float32)
            tl.store(out_v_ptr + dst, (vg[None, :] * (vcode * vsc[:, None] + vmn[:, None])).to(tl.float16))
    else:
        ok = pos < seq_len
        src = (tail0 + pos % ring).to(tl.int64)[:, None] * stride_r_row + kvh * stride_r_head + offs_d[None, :]
        tl.store(out_k_ptr + dst, tl.load(rows_k_ptr + src, mask=ok[:, None], other=0.0))
        tl.store(out_v_ptr + dst, tl.load(rows_v_ptr + src, mask=ok[:, None], other=0.0))


@triton.jit
def _prefill_block_state(q_ptr, acc_ptr, m_ptr, l_ptr, mb, h, n_q,
                         stride_q_t, stride_q_h, stride_a_t, stride_a_h,
                         NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                         FIRST: tl.constexpr):
    """Both prefill passes' start for one (query block mb, q head h): the block's rows and mask,
    its queries in fp16, the acc / (m, l) offsets, and the running state: fresh when FIRST, else
    the state the previous window or pass stored (unnormalized fp32 acc, log2 max m, sum l)."""
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < n_q
    q = tl.load(q_ptr + offs_m.to(tl.int64)[:, None] * stride_q_t + h * stride_q_h + offs_d[None, :],
                mask=m_ok[:, None], other=0.0).to(tl.float16)
    a_off = offs_m.to(tl.int64)[:, None] * stride_a_t + h * stride_a_h + offs_d[None, :]
    ml_off = offs_m.to(tl.int64) * NUM_Q_HEADS + h
    if FIRST:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    else:
        m_i = tl.load(m_ptr + ml_off, mask=m_ok, other=float("-inf"))
        l_i = tl.load(l_ptr + ml_off, mask=m_ok, other=0.0)
        acc = tl.load(acc_ptr + a_off, mask=m_ok[:, None], other=0.0)
    return offs_m, m_ok, q, a_off, ml_off, m_i, l_i, acc


@triton.jit
def _kvarn_prefill_kernel(
    q_ptr, k_ptr, v_ptr, acc_ptr, m_ptr, l_ptr,
    n_q, q_pos0, w0, w_len, fp_lo, win1, qk_scale,
    stride_q_t: tl.int64, stride_q_h: tl.int64,
    stride_k_row: tl.int64, stride_k_head: tl.int64,
    stride_a_t: tl.int64, stride_a_h: tl.int64,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE: tl.constexpr,
    FIRST: tl.constexpr, DOT_F32: tl.constexpr,
):
    # pass 1, program (query block, q head): BLOCK_M queries (positions q_pos0 + i) against the
    # window's keys (positions w0 + j, j < w_len; scratch rows j, quantized tiles and the fp16
    # sink) of tiles BEFORE each query's fp16 window: tiles >= max(own - win1, fp_lo) are pass
    # 2's. The running state (unnormalized fp32 acc, log2 max m, sum l) is carried across
    # windows in acc/m/l.
    mb = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    offs_m, m_ok, q, a_off, ml_off, m_i, l_i, acc = _prefill_block_state(
        q_ptr, acc_ptr, m_ptr, l_ptr, mb, h, n_q, stride_q_t, stride_q_h, stride_a_t, stride_a_h,
        NUM_Q_HEADS, HEAD_DIM, BLOCK_M, FIRST)
    qlo = tl.maximum((q_pos0 + offs_m) // TILE - win1, fp_lo)  # a row's first fp16 tile
    # keys of this window that some row of the block reads quantized: before the last row's
    # first fp16 tile
    last_q = tl.minimum((mb + 1) * BLOCK_M, n_q) - 1
    hi = tl.minimum(w_len, tl.maximum((q_pos0 + last_q) // TILE - win1, fp_lo) * TILE - w0)
    kbase = k_ptr + kvh * stride_k_head
    vbase = v_ptr + kvh * stride_k_head
    for j0 in range(0, hi, BLOCK_N):
        cols = j0 + offs_n
        c_ok = cols < hi
        kt = tl.load(kbase + cols.to(tl.int64)[None, :] * stride_k_row + offs_d[:, None],
                     mask=c_ok[None, :], other=0.0)
        s = _dot(q, kt, DOT_F32) * qk_scale
        s = tl.where((((w0 + cols) // TILE)[None, :] < qlo[:, None]) & c_ok[None, :], s,
                     float("-inf"))
        p, alpha, m_i, l_i = _online_update(s, m_i, l_i)
        vt = tl.load(vbase + cols.to(tl.int64)[:, None] * stride_k_row + offs_d[None, :],
                     mask=c_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(tl.float16), vt, DOT_F32)
    tl.store(acc_ptr + a_off, acc, mask=m_ok[:, None])
    tl.store(m_ptr + ml_off, m_i, mask=m_ok)
    tl.store(l_ptr + ml_off, l_i, mask=m_ok)


@triton.jit
def _kvarn_prefill_own_kernel(
    q_ptr, nk_ptr, nv_ptr, rk_ptr, rv_ptr, acc_ptr, m_ptr, l_ptr,
    n_q, q_pos0, ctx, rows_lim, tail0, prev0, prev1, ring, fp_lo, win1, qk_scale,
    stride_q_t: tl.int64, stride_q_h: tl.int64,
    stride_n_row: tl.int64, stride_n_head: tl.int64,
    stride_r_row: tl.int64, stride_r_head: tl.int64,
    stride_a_t: tl.int64, stride_a_h: tl.int64,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE: tl.constexpr,
    FIRST: tl.constexpr, HAS_NEW: tl.constexpr, DOT_F32: tl.constexpr,
):
    # pass 2, program (query block, q head): each query's fp16 window, tiles
    # [max(own - win1, fp_lo), own], causal: positions >= ctx from this step's rotated rows nk/nv
    # (row p - ctx; HAS_NEW), positions < rows_lim (before ctx, or all when not HAS_NEW) from
    # the fp16 rows of tiles before ctx's (tile fp_lo from prev0 + p % ring, fp_lo + 1 from
    # prev1 + p % ring) or tail0 + p % ring (ctx's tile begun in an earlier step). Merges into the pass-1 state (unless FIRST) and
    # stores acc / l.
    mb = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    offs_m, m_ok, q, a_off, ml_off, m_i, l_i, acc = _prefill_block_state(
        q_ptr, acc_ptr, m_ptr, l_ptr, mb, h, n_q, stride_q_t, stride_q_h, stride_a_t, stride_a_h,
        NUM_Q_HEADS, HEAD_DIM, BLOCK_M, FIRST)
    qpos = q_pos0 + offs_m
    qlo = tl.maximum(qpos // TILE - win1, fp_lo)
    last_q = tl.minimum((mb + 1) * BLOCK_M, n_q) - 1
    lo = tl.maximum((q_pos0 + mb * BLOCK_M) // TILE - win1, fp_lo) * TILE
    hi = q_pos0 + last_q + 1
    tail_base = tl.maximum(tail0, 0)
    prev_end = ctx // TILE * TILE
    for j0 in range(lo, hi, BLOCK_N):
        cols = j0 + offs_n
        c_ok = cols < hi
        from_new = c_ok & (cols >= ctx)
        from_rows = c_ok & (cols < rows_lim)
        nrow = tl.maximum(cols - ctx, 0).to(tl.int64)
        prev_base = tl.maximum(tl.where(cols // TILE == fp_lo, prev0, prev1), 0)
        rrow = (tl.where(cols < prev_end, prev_base, tail_base) + cols % ring).to(tl.int64)
        n_off = nrow * stride_n_row + kvh * stride_n_head
        r_off = rrow * stride_r_row + kvh * stride_r_head
        kt = tl.load(rk_ptr + r_off[None, :] + offs_d[:, None], mask=from_rows[None, :], other=0.0)
        if HAS_NEW:
            kt += tl.load(nk_ptr + n_off[None, :] + offs_d[:, None], mask=from_new[None, :], other=0.0)
        s = _dot(q, kt, DOT_F32) * qk_scale
        vis = (c_ok[None, :] & (cols[None, :] <= qpos[:, None])
               & ((cols // TILE)[None, :] >= qlo[:, None]))
        s = tl.where(vis, s, float("-inf"))
        p, alpha, m_i, l_i = _online_update(s, m_i, l_i)
        vt = tl.load(rv_ptr + r_off[:, None] + offs_d[None, :], mask=from_rows[:, None], other=0.0)
        if HAS_NEW:
            vt += tl.load(nv_ptr + n_off[:, None] + offs_d[None, :], mask=from_new[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(tl.float16), vt, DOT_F32)
    o = tl.where(l_i[:, None] > 0.0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    tl.store(acc_ptr + a_off, o, mask=m_ok[:, None])


def _prefix(rows) -> list[int]:
    """The leading entries >= 0 of ``rows`` (the live sink tiles)."""
    out = []
    for r in rows:
        if int(r) < 0:
            break
        out.append(int(r))
    return out


def prefill_launch(head_dim: int, shared: int | None) -> tuple[int, int, int]:
    """(block_m, block_n, num_stages) of kvarn_prefill's kernels when the caller gives
    none; ``shared``: the shared memory a block may have on the GPU (_block_shared), None on the
    CPU interpreter (small blocks). On a GPU, 64 query rows per program and 32 keys per step at
    head_dim 256 (64 below it). Under 200 KiB (an RTX 3090 / 4090 / 5090 block may have 99 KiB =
    101,376 B): 16 keys per step at head_dim 256, because the own-chunk kernel took 102,400 B at 64
    / 32 / 2 stages (Triton 3.9, sm_86; 67,584 B at 16 keys, the window kernel 51,200 B), so its
    launch, and every CTX=huge prefill with it, failed there (session 23; tests/test_kvarn_compile.py
    holds every default under the limit)."""
    if shared is None:
        block_m, block_n = 32, 32
    else:
        block_m = 64
        block_n = 32 if head_dim >= 256 else 64
        if shared < 200 * 1024 and head_dim >= 256:
            block_n = 16
    return block_m, block_n, 2 if head_dim >= 256 else 3


def kvarn_prefill(
    q: torch.Tensor, cache: torch.Tensor, rows_k: torch.Tensor, rows_v: torch.Tensor,
    out: torch.Tensor, *, block_table_row: torch.Tensor, ctx_len: int, seq_len: int,
    packed_tiles: int, tail_row: int, ring: int, softmax_scale: float, sink_row: int = -1,
    new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None,
    preset: str | Preset | None = None, tiles_per_page: int = 1,
    fp16_window: int = 1, prev_row: int = -1, sink_rows=None, prev_rows=None,
    window_tokens: int = PREFILL_WINDOW_TOKENS, query_group: int = PREFILL_QUERY_GROUP,
    block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of one request's prefill chunk over a KVarN cache; writes ``out``
    [n, Hq, D] (model space), n = seq_len - ctx_len, and returns it.

    The chunk's queries are positions [ctx_len, seq_len). The read rule (one for all paths,
    ``reference.own_tile_attention_f64``): a query at position p reads its fp16 WINDOW, the
    ``fp16_window`` tiles ending with its own tile p // tile, in fp16 and every earlier tile as the
    cache holds it: tiles [0, packed_tiles) packed in the blocks of ``block_table_row`` (pages of
    ``tiles_per_page`` tiles; packed_tiles >= the last query's tile), the sink tiles j (0, and 1
    with two sinks) from fp16 rows [sink_rows[j], + tile) (``sink_rows``: the live ones, a prefix;
    ``sink_row`` >= 0 is the one-sink form). Window fp16 rows: positions >= ctx_len from
    ``new_k`` / ``new_v`` [n, Hkv, D] (this step's rotated rows, row p - ctx_len); earlier ones
    from rows of ``rows_*``: ctx_len's tile (begun in an earlier step) at ``tail_row + p % ring``,
    the tiles before it that the window reads (``fp16_window`` >= 2) at ``prev_rows[j] + p % ring``
    (ascending, the last one tile ctx_len // tile - 1; ``prev_row`` >= 0 is the one-tile form).
    A tile before ctx_len's without rows (its slot is gone) is read packed by every query, and
    so is every tile before it. Without ``new_k`` all window rows come from ``rows_*``
    (prev_row, else tail_row, for the tile before ctx_len's).

    Pass 1, per group of ``query_group`` queries (one group for chunks up to that size): the
    tiles before the group's last query's fp16 window are dequantized ONCE, window by window
    (``window_tokens`` keys, a multiple of the tile), into an fp16 scratch; a flash kernel
    (BLOCK_M queries x one q head per program) runs over each window, each row masked to the
    tiles before its own fp16 window, carrying an fp32 online-softmax state (the log-sum-exp
    merge). Pass 2: a flash kernel over each row's fp16 window merges and normalizes. Memory:
    ``prefill_scratch_bytes`` (the fresh rows are the caller's)."""
    p = get_preset(preset)
    T = p.tile
    n, hq, d = q.shape
    if n != seq_len - ctx_len or n <= 0:
        raise ValueError(f"q has {n} tokens; valid: seq_len - ctx_len = {seq_len - ctx_len} > 0")
    if rows_k.dim() != 3 or rows_k.shape[2] != d or rows_k.stride() != rows_v.stride() \
            or rows_k.dtype != torch.float16 or rows_v.dtype != torch.float16 or rows_k.stride(2) != 1:
        raise ValueError(f"fp16 rows must be [R, Hkv, {d}] fp16 with equal K/V strides; got "
                         f"{tuple(rows_k.shape)} {rows_k.dtype}")
    nkv = rows_k.shape[1]
    has_new = new_k is not None
    if has_new and (new_v is None or new_k.shape != (n, nkv, d) or new_v.shape != new_k.shape
                    or new_k.dtype != torch.float16 or new_v.dtype != torch.float16
                    or new_k.stride() != new_v.stride() or new_k.stride(2) != 1):
        raise ValueError(f"new_k / new_v must be fp16 [{n}, {nkv}, {d}] with equal strides; got "
                         f"{None if new_k is None else tuple(new_k.shape)}")
    layout = p.layout(d)
    _check_cache(cache, layout, nkv)
    if hq % nkv:
        raise ValueError(f"{hq} query heads is not a multiple of {nkv} kv heads")
    if not (seq_len - 1) // T <= packed_tiles <= -(-seq_len // T) or (not has_new and tail_row < 0):
        raise ValueError(f"packed_tiles {packed_tiles} / tail_row {tail_row} are not valid for "
                         f"seq_len {seq_len}; valid: tiles before the last query's tile packed, "
                         f"own-tile rows in new_k or at tail_row")
    if window_tokens < T or window_tokens % T:
        raise ValueError(f"window_tokens {window_tokens} is not valid; valid: a multiple of {T}")
    if fp16_window not in FP16_WINDOWS:
        raise ValueError(f"fp16_window {fp16_window} is not valid; valid: "
                         f"{', '.join(map(str, FP16_WINDOWS))}")
    sinks = _prefix(sink_rows if sink_rows is not None else [sink_row])
    prevs = list(prev_rows) if prev_rows is not None else [prev_row]
    while prevs and prevs[0] < 0:  # ascending; keep the live suffix before ctx's tile
        prevs.pop(0)
    if any(r < 0 for r in prevs) or len(sinks) > 2 or len(prevs) > 2:
        raise ValueError(f"sink_rows {sink_rows} / prev_rows {prev_rows} are not valid; valid: "
                         f"at most 2 each, live sinks a prefix, live previous tiles a suffix")
    win1 = fp16_window - 1
    if not has_new and not prevs and win1:
        prevs = [tail_row]  # one ring holds the fp16 window (reference.make_case's stage)
    prevs = prevs[len(prevs) - min(len(prevs), win1, ctx_len // T):]
    # the chunk's lowest fp16 tile: ctx's own, or the earliest staged one before it
    fp_lo = ctx_len // T - len(prevs)
    prev0, prev1 = (prevs + [-1, -1])[:2]
    sink0, sink1 = (sinks + [-1, -1])[:2]
    cuda = q.device.type == "cuda"
    d_m, d_n, d_s = prefill_launch(d, _block_shared(q.device) if cuda else None)
    block_m = d_m if block_m is None else block_m
    block_n = d_n if block_n is None else block_n
    num_warps = (8 if block_m * d >= 64 * 256 else 4) if num_warps is None else num_warps
    num_stages = d_s if num_stages is None else num_stages
    query_group = max(1, int(query_group))
    hn = _hadamard(d, q.device)
    rows_per = max(1, 4096 // hq)  # rotate / un-rotate in slices (bounded fp32 temporaries)
    storage = _byte_storage(cache)
    c16 = storage.view(torch.float16)
    cache_u8, cache_f16 = storage[cache.storage_offset():], c16[cache.storage_offset() // 2:]
    consts = _layout_consts(layout)
    scale = softmax_scale * _LOG2E
    # tiles any query reads from the cache (before its fp16 window)
    n_tiles_max = max((seq_len - 1) // T - win1, fp_lo)
    w_tiles = max(1, min(window_tokens // T, n_tiles_max))
    sk = torch.empty((w_tiles * T if n_tiles_max else 0, nkv, d), dtype=torch.float16, device=q.device)
    sv = torch.empty_like(sk)
    g_n = min(n, query_group)
    q_rot = torch.empty((g_n, hq, d), dtype=torch.float16, device=q.device)
    acc = torch.empty((g_n, hq, d), dtype=torch.float32, device=q.device)
    m_st = torch.empty((g_n, hq), dtype=torch.float32, device=q.device)
    l_st = torch.empty_like(m_st)
    nk, nv = (new_k, new_v) if has_new else (rows_k, rows_v)
    for g0 in range(0, n, query_group):
        gn = min(n, g0 + query_group) - g0
        for r0 in range(0, gn, rows_per):
            r1 = min(gn, r0 + rows_per)
            q_rot[r0:r1] = (q[g0 + r0:g0 + r1].float().reshape(-1, d) @ hn).view(r1 - r0, hq, d)
        n_tiles = max((ctx_len + g0 + gn - 1) // T - win1, fp_lo)  # before the last query's fp16 window
        windows = list(range(0, n_tiles, w_tiles))
        for wi, t0 in enumerate(windows):
            nt = min(n_tiles, t0 + w_tiles) - t0
            _kvarn_dequant_kernel[(nt, nkv)](
                cache_u8, cache_f16, rows_k, rows_v, sk, sv, block_table_row,
                t0, seq_len, packed_tiles, sink0, sink1, len(sinks), tail_row, ring, tiles_per_page,
                cache.stride(0), cache.stride(1), rows_k.stride(0), rows_k.stride(1),
                sk.stride(0), sk.stride(1),
                HEAD_DIM=d, TILE=T, K_BITS=p.k_bits, V_BITS=p.v_bits, **consts,
                num_warps=8 if T * d >= 128 * 128 else 4,
            )
            _kvarn_prefill_kernel[(triton.cdiv(gn, block_m), hq)](
                q_rot, sk, sv, acc, m_st, l_st,
                gn, ctx_len + g0, t0 * T, nt * T, fp_lo, win1, scale,
                q_rot.stride(0), q_rot.stride(1), sk.stride(0), sk.stride(1),
                acc.stride(0), acc.stride(1),
                NUM_Q_HEADS=hq, GROUP=hq // nkv, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
                TILE=T, FIRST=wi == 0, DOT_F32=not cuda,
                num_warps=num_warps, num_stages=num_stages,
            )
        _kvarn_prefill_own_kernel[(triton.cdiv(gn, block_m), hq)](
            q_rot, nk, nv, rows_k, rows_v, acc, m_st, l_st,
            gn, ctx_len + g0, ctx_len,
            (ctx_len if has_new else seq_len) if tail_row >= 0 or prevs else 0,
            tail_row, prev0, prev1, ring, fp_lo, win1, scale,
            q_rot.stride(0), q_rot.stride(1), nk.stride(0), nk.stride(1),
            rows_k.stride(0), rows_k.stride(1), acc.stride(0), acc.stride(1),
            NUM_Q_HEADS=hq, GROUP=hq // nkv, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
            TILE=T, FIRST=not windows, HAS_NEW=has_new, DOT_F32=not cuda,
            num_warps=num_warps, num_stages=num_stages,
        )
        for r0 in range(0, gn, rows_per):  # un-rotate once
            r1 = min(gn, r0 + rows_per)
            out[g0 + r0:g0 + r1] = (acc[r0:r1].reshape(-1, d) @ hn).view(r1 - r0, hq, d)
    return out
