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
             back (and divided by head_dim) - what vLLM's int4 path does, but in our own
             kernels (query: one small butterfly launch, ``_rht_rows_kernel``; output: the same
             fp32 butterfly in the reduce kernel) instead of vLLM's ``single_rht`` around the
             kernel (~15-40 small torch launches).
  block_table [num_seqs, max_blocks] int32, seq_lens [num_seqs] (context incl. the verify
  block), cu_seqlens_q [num_seqs + 1] (query_start_loc).

Causal rule inside the verify block: query i of a sequence with q_len queries and seq_len keys
sees key positions p < seq_len - q_len + i + 1.

This file is self-contained (triton + torch only; vLLM's RHT helper is imported lazily for int4)
so that the same text can ship inside vLLM as ``vllm/v1/attention/ops/onecard_wide_verify.py``.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

KV_MODES = {"auto": 0, "bf16": 0, "fp16": 0, "int8": 2, "int4": 4}
MAX_QUERY_LEN = 16
_LOG2E = 1.4426950408889634
# int8 / int4 tiles loaded as one flat vector of words (FLAT_WORDS in the split kernel) on GPUs
# with Hopper's shared memory when ONECARD_VERIFY_FLAT_WORDS is auto: default_flat_words().
# On since session 28 (H100, q=16, 32k, b1: int8 182 -> 122 us, twice; docs/wide-verify.md)
FLAT_WORDS_HOPPER = True
# int8 Q.K^T (QK_INT8 in the split kernel) on GPUs with Hopper's shared memory when
# ONECARD_VERIFY_QK_INT8 is auto: default_qk_int8(). On since session 33 (H100, end to end)
QK_INT8_HOPPER = True
_SM_COUNT: dict[int, int] = {}


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    # Triton's CPU interpreter mis-multiplies bf16 operands; tests set DOT_F32 there.
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _dot_acc(a, b, acc, DOT_F32: tl.constexpr):
    """acc + a @ b (the second head-dim half of a HEAD_SPLIT dot, accumulated in place)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _round_to_int8(x):
    """float32 in [-127, 127] -> int8, rounding half away from zero (the cast truncates)."""
    return tl.where(x >= 0.0, x + 0.5, x - 0.5).to(tl.int8)


@triton.jit
def _hadamard_vec(x, D: tl.constexpr, LOG2_D: tl.constexpr):
    """Unnormalized Sylvester Walsh-Hadamard transform of a [D] float32 vector: the butterfly
    of vLLM's ``fast_hadamard_transform`` (torch tier: pairs h apart -> (a + b, a - b))."""
    for i in tl.static_range(LOG2_D):  # pairs h = 2^i apart: [D / 2h, 2, h]
        y = tl.permute(tl.reshape(x, (D >> (i + 1), 2, 1 << i)), (0, 2, 1))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (D,))
    return x


@triton.jit
def _rht_rows_kernel(x_ptr, signs_ptr, y_ptr, stride_x_t: tl.int64, stride_x_h: tl.int64,
                     stride_y_t: tl.int64, stride_y_h: tl.int64, HEAD_DIM: tl.constexpr,
                     LOG2_D: tl.constexpr):
    """int4 query rotation, one (token, head) row per program: y = H . (d1 * x) (vLLM's
    ``single_rht``), fp32 butterfly, rounded once to y's dtype. One launch; it replaces the
    ~15-40 small torch launches of ``single_rht(q.float()).to(q.dtype)``."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    x = tl.load(x_ptr + tok * stride_x_t + head * stride_x_h + offs_d).to(tl.float32)
    x = _hadamard_vec(x * tl.load(signs_ptr + offs_d), HEAD_DIM, LOG2_D)
    tl.store(y_ptr + tok * stride_y_t + head * stride_y_h + offs_d,
             x.to(y_ptr.dtype.element_ty))


@triton.jit
def _unpack_words(w, off, KV_MODE: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    """int32 words [N, D / 4 or D / 8] -> float32 [N, D] in element order, exactly.

    int8 (KV_MODE 2): byte j of word i is element 4i + j (two's complement).
    int4 (KV_MODE 4): nibble j of word i is element 8i + j (bits 4j..4j+3); ``off`` [N] is the
    per-token zero point, subtracted here so the result is (nibble - zp).
    No int->float instruction: the byte / nibble is placed in the mantissa of 2^23 (OR with
    0x4B000000) and 2^23 (+128 for the sign flip, +zp) is subtracted - one LOP3 and one FADD per
    element, all values exact in float32 and in bf16.
    """
    if KV_MODE == 2:
        b0 = ((w & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        b1 = (((w >> 8) & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        b2 = (((w >> 16) & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        b3 = (((w >> 24) & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        # join adds a trailing axis; the last axis is the fastest in the reshape below, so
        # [..., i, j] = byte 2i + j
        x = tl.join(tl.join(b0, b2), tl.join(b1, b3))
    else:
        base = (8388608.0 + off)[:, None]
        n0 = ((w & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - base
        n1 = (((w >> 4) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - base
        n2 = (((w >> 8) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - base
        n3 = (((w >> 12) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - base
        n4 = (((w >> 16) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - base
        n5 = (((w >> 20) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - base
        n6 = (((w >> 24) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - base
        n7 = (((w >> 28) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - base
        # [..., i, j, k] = nibble 4i + 2j + k
        x = tl.join(tl.join(tl.join(n0, n4), tl.join(n2, n6)),
                    tl.join(tl.join(n1, n5), tl.join(n3, n7)))
    return tl.reshape(x, (N, D))


@triton.jit(do_not_specialize=["num_splits"])  # one compile for any split count: reduce_launch()
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
    PAGE_TILES: tl.constexpr = False,
    CAUSAL: tl.constexpr = True,
    LAZY_RESCALE: tl.constexpr = False,
    HEAD_SPLIT: tl.constexpr = 1,
    ROW_SPLIT: tl.constexpr = 1,
    FLAT_WORDS: tl.constexpr = False,
    QK_INT8: tl.constexpr = False,
):
    # FLAT_WORDS (int8 / int4 on the PAGE_TILES path): load a tile's K / V words as one flat
    # [TILE_N * WORDS] vector and reshape it in registers. The 2-D [TILE_N, WORDS] load gives each
    # thread words of 4 different keys (one column, rows 4 apart); Triton's pipeliner then stages
    # the tile in shared memory key-fastest (order [0, 1], from the registers' order), so the 32
    # lanes of a warp, one word column each, hit 2 banks: a 16-way conflict on every cp.async
    # store and every LDS of the words (ncu on the H100, session 27: 16.1 M excess shared
    # wavefronts of 25.5 M, L1 72.7 % busy vs DRAM 9.6 %). A flat vector is staged in load order.
    # ROW_SPLIT == 2 (opt-in, bench/kernel_verify.py's sweep; docs/wide-verify.md "row split"):
    # a sequence's verify block in two programs of BLOCK_Q query tokens each (axis 0 = sequence x
    # part), both over the same keys: half the rows, half the accumulator, so that a program
    # fits twice per SM and one program's per-tile wait (copy, unpack, barrier, wgmma) overlaps
    # the other's work. Every query token is still owned by exactly one program.
    # QK_INT8 (int8 KV on the PAGE_TILES path; default_qk_int8: on for Hopper-class GPUs): each
    # query row quantized once to int8 (symmetric, its absmax / 127), and Q.K^T an int8 x int8
    # dot into int32 over the key tile's bytes as stored: no unpack of K, no bf16 copy of it in
    # shared memory, and the int8 tensor rate (2x bf16 on Hopper, 4x on an RTX 3090's fp32
    # accumulate). A second quantization error beside the cache's (docs/wide-verify.md, "int8
    # Q.K^T"). P.V is unchanged.
    seq = tl.program_id(0) // ROW_SPLIT
    part = tl.program_id(0) % ROW_SPLIT
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    qi = part * BLOCK_Q + rows // GROUP_PAD
    g = rows % GROUP_PAD
    row_ok = (qi < q_len) & (g < GROUP)
    q_tok = (q_start + qi).to(tl.int64)
    q_head = kvh * GROUP + g
    # key p is visible to row r when p < limit[r]; non-causal (a DFlash drafter's block): every
    # row of the sequence sees all its seq_len keys
    if CAUSAL:
        limit = tl.where(row_ok, ctx_len + qi + 1, 0)
    else:
        limit = tl.where(row_ok, seq_len, 0)

    # this split's key range: per-sequence chunk, a multiple of TILE_N
    chunk = ((seq_len + num_splits - 1) // num_splits + TILE_N - 1) // TILE_N * TILE_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    n_tiles = (tl.maximum(hi - lo, 0) + TILE_N - 1) // TILE_N
    if ROW_SPLIT > 1:
        # a part past the block's last query token (q_len <= BLOCK_Q) reads no keys; its stores
        # are all masked (row_ok)
        n_tiles = tl.where(part * BLOCK_Q < q_len, n_tiles, 0)

    offs_n = tl.arange(0, TILE_N)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    q_row = q_tok[:, None] * stride_q_t + q_head[:, None] * stride_q_h

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # HEAD_SPLIT == 2 (opt-in, bench/kernel_verify.py's sweep; docs/wide-verify.md): the head
    # dim in two halves of DH. Q.K^T = Q_0.K_0^T + Q_1.K_1^T (two dots into one S), P.V into two
    # [BLOCK_M, DH] accumulators, so a tile's unpacked K / V is [TILE_N, DH] at a time. int8 /
    # int4 words 0..WORDS-1 hold elements 0..DH-1 in both formats (half 1: words WORDS.., DH..).
    # HEAD_SPLIT == 1 (default) is the whole head in one piece: q / acc / offs_d / WORDS as before.
    DH: tl.constexpr = HEAD_DIM // HEAD_SPLIT
    offs_d = tl.arange(0, DH)
    q = tl.load(q_ptr + q_row + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    acc = tl.zeros([BLOCK_M, DH], dtype=tl.float32)
    if HEAD_SPLIT == 2:
        q1 = tl.load(q_ptr + q_row + DH + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        acc1 = tl.zeros([BLOCK_M, DH], dtype=tl.float32)
    if QK_INT8:
        # per row: q ~= q_sc * q8, q8 in -127..127 (round half away from zero); an all-zero row
        # (masked) keeps scale 1 and codes 0
        q_f = q.to(tl.float32)
        q_amax = tl.max(tl.abs(q_f), axis=1)
        if HEAD_SPLIT == 2:
            q1_f = q1.to(tl.float32)
            q_amax = tl.maximum(q_amax, tl.max(tl.abs(q1_f), axis=1))
        q_inv = tl.where(q_amax > 0.0, 127.0 / tl.maximum(q_amax, 1e-30), 0.0)
        q_sc = tl.where(q_amax > 0.0, q_amax / 127.0, 1.0)
        q8 = _round_to_int8(q_f * q_inv[:, None])
        if HEAD_SPLIT == 2:
            q8_1 = _round_to_int8(q1_f * q_inv[:, None])
    # int8 / int4 caches are read as int32 words (rows are 4-byte aligned, not 16: 260 / 132
    # byte rows), 4 bytes / 8 nibbles per word; WORDS per head-dim part
    WORDS: tl.constexpr = (HEAD_DIM // 4 if KV_MODE == 2 else HEAD_DIM // 8) // HEAD_SPLIT
    offs_w = tl.arange(0, WORDS)

    # The block-table entries of tile t + 1 are loaded during tile t (software prefetch), so the
    # K/V addresses of a tile never depend on a load issued in the same iteration and Triton's
    # pipeliner can issue the K/V loads of later tiles while this one computes.
    pos = lo + offs_n
    if PAGE_TILES:
        # int8 / int4 with page % TILE_N == 0 (tiles start at multiples of TILE_N, so a tile
        # lies in one page): one block-table entry and one scalar base address per tile; the
        # per-element offsets are loop invariant int32 (a tile's rows span a few KiB). Per-key
        # block / slot vectors cost a runtime division, a remainder and 64-bit multiplies per
        # row and thread: ~1/3 of the int8 tile loop's SASS (sm_90: 1,016 -> 682 instructions
        # per 16-key tile, docs/wide-verify.md). The K/V words and scales are then read
        # without a mask (the tile's page is this sequence's, so the slots exist; keys past hi
        # are dropped by the score mask and a zero V scale): no per-load predicates
        # (682 -> 603). bf16 keeps the per-key, masked path (it is the measured reference).
        if FLAT_WORDS:
            # the tile's words as one flat vector (row-major), reshaped after the load: see
            # FLAT_WORDS in the signature
            offs_f = tl.arange(0, TILE_N * WORDS)
            k_rows = ((offs_f // WORDS) * stride_k_slot + offs_f % WORDS).to(tl.int32)
            v_rows = ((offs_f // WORDS) * stride_v_slot + offs_f % WORDS).to(tl.int32)
        else:
            k_rows = (offs_n[:, None] * stride_k_slot + offs_w[None, :]).to(tl.int32)
            v_rows = (offs_n[:, None] * stride_v_slot + offs_w[None, :]).to(tl.int32)
        ks_rows = (offs_n * stride_ks_slot).to(tl.int32)
        if QK_INT8:
            # the key tile's bytes [TILE_N, DH] (4 bytes a word): the int8 dot's B operand as
            # stored, rows head_dim-contiguous (K-major, what int8 MMAs take)
            kb_rows = (offs_n[:, None] * (4 * stride_k_slot) + offs_d[None, :]).to(tl.int32)
        vs_rows = (offs_n * stride_vs_slot).to(tl.int32)
        k_head = k_ptr + kvh * stride_k_head
        v_head = v_ptr + kvh * stride_v_head
        ks_head = ks_ptr + kvh * stride_ks_head
        vs_head = vs_ptr + kvh * stride_vs_head
        lim_hi = tl.minimum(limit, hi)  # causal limit and this split's end in one compare
        # page index and slot of the next tile, advanced without a division per tile
        pg = lo // page
        slot_next = lo - pg * page
        blk_next = tl.load(bt_row + pg, mask=lo < hi, other=0)
    else:
        blk_next = tl.load(bt_row + pos // page, mask=pos < hi, other=0)
    for t in range(0, n_tiles):
        kv_ok = pos < hi
        pos_next = pos + TILE_N
        if PAGE_TILES:
            blk = blk_next.to(tl.int64)
            slot0 = slot_next.to(tl.int64)
            slot_next += TILE_N
            wrap = slot_next == page
            pg += wrap.to(tl.int32)
            slot_next = tl.where(wrap, 0, slot_next)
            blk_next = tl.load(bt_row + pg, mask=lo + (t + 1) * TILE_N < hi, other=0)
        else:
            blk = blk_next.to(tl.int64)
            slot = pos % page
            blk_next = tl.load(bt_row + pos_next // page, mask=pos_next < hi, other=0)
        if KV_MODE == 0:
            kt = tl.load(
                k_ptr + blk[None, :] * stride_k_blk + slot[None, :] * stride_k_slot
                + kvh * stride_k_head + offs_d[:, None],
                mask=kv_ok[None, :], other=0.0,
            )
            s = _dot(q, kt.to(q.dtype), DOT_F32)
            if HEAD_SPLIT == 2:
                kt1 = tl.load(
                    k_ptr + blk[None, :] * stride_k_blk + slot[None, :] * stride_k_slot
                    + kvh * stride_k_head + DH + offs_d[:, None],
                    mask=kv_ok[None, :], other=0.0,
                )
                s = _dot_acc(q1, kt1.to(q.dtype), s, DOT_F32)
            s = s * qk_scale
        else:
            if PAGE_TILES:
                if QK_INT8:
                    kb = (k_head + (blk * stride_k_blk + slot0 * stride_k_slot)).to(
                        tl.pointer_type(tl.int8))
                    k8 = tl.load(kb + kb_rows)
                    if HEAD_SPLIT == 2:
                        k8_1 = tl.load(kb + DH + kb_rows)
                else:
                    kw = tl.load(k_head + (blk * stride_k_blk + slot0 * stride_k_slot) + k_rows)
                    if HEAD_SPLIT == 2:
                        kw1 = tl.load(k_head + (blk * stride_k_blk + slot0 * stride_k_slot
                                                + WORDS) + k_rows)
                    if FLAT_WORDS:
                        kw = tl.reshape(kw, (TILE_N, WORDS))
                        if HEAD_SPLIT == 2:
                            kw1 = tl.reshape(kw1, (TILE_N, WORDS))
                k_sc = tl.load(ks_head + (blk * stride_ks_blk + slot0 * stride_ks_slot)
                               + ks_rows)
            else:
                kw = tl.load(
                    k_ptr + blk[:, None] * stride_k_blk + slot[:, None] * stride_k_slot
                    + kvh * stride_k_head + offs_w[None, :],
                    mask=kv_ok[:, None], other=0,
                )
                if HEAD_SPLIT == 2:
                    kw1 = tl.load(
                        k_ptr + blk[:, None] * stride_k_blk + slot[:, None] * stride_k_slot
                        + kvh * stride_k_head + WORDS + offs_w[None, :],
                        mask=kv_ok[:, None], other=0,
                    )
                k_sc = tl.load(
                    ks_ptr + blk * stride_ks_blk + slot * stride_ks_slot + kvh * stride_ks_head,
                    mask=kv_ok, other=0.0,
                )
            if KV_MODE == 4:
                kbits = k_sc.to(tl.int32, bitcast=True)
                k_off = (kbits & 0xF).to(tl.float32)
                k_sc = (kbits & -16).to(tl.float32, bitcast=True)
            else:
                k_off = tl.zeros([TILE_N], dtype=tl.float32)
            if QK_INT8:
                # int32 scores (float32 under the interpreter: exact, |sum| < 2^24), scaled
                # by the query row's and the key's scales
                s = _dot(q8, tl.trans(k8), DOT_F32)
                if HEAD_SPLIT == 2:
                    # two int32 dots summed, not one dot accumulating into the other: Triton
                    # 3.6 (the lent GPU's) refuses an int8 tl.dot with an int32 accumulator
                    # (CompilationError, session 30; Triton 3.9 compiles both)
                    s = s + _dot(q8_1, tl.trans(k8_1), DOT_F32)
                s = s.to(tl.float32) * (q_sc[:, None] * (qk_scale * k_sc[None, :]))
            else:
                k = _unpack_words(kw, k_off, KV_MODE, TILE_N, DH).to(q.dtype)
                # per-token scale: a column scale of the scores, the tile itself is only
                # converted
                s = _dot(q, tl.trans(k), DOT_F32)
                if HEAD_SPLIT == 2:
                    k1 = _unpack_words(kw1, k_off, KV_MODE, TILE_N, DH).to(q.dtype)
                    s = _dot_acc(q1, tl.trans(k1), s, DOT_F32)
                s = s * (qk_scale * k_sc[None, :])
        if PAGE_TILES:
            s = tl.where(pos[None, :] < lim_hi[:, None], s, float("-inf"))
        else:
            s = tl.where((pos[None, :] < limit[:, None]) & kv_ok[None, :], s, float("-inf"))
        m_tile = tl.max(s, axis=1)
        if LAZY_RESCALE:
            # move the running max (and rescale acc / l) only when some row's tile max exceeds
            # it by more than 8 (log2 units): P <= 2^8 in between, the same softmax after the
            # final division. One CTA-wide decision per tile instead of a 128 x 256 multiply.
            grow = tl.where(m_tile > m_i, m_tile - tl.maximum(m_i, -1.0e30), 0.0)  # no inf - inf
            if tl.max(grow, axis=0) > 8.0:
                m_new = tl.maximum(m_i, m_tile)
                alpha = tl.math.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
                acc = acc * alpha[:, None]
                if HEAD_SPLIT == 2:
                    acc1 = acc1 * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            p = tl.math.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
            l_i = l_i + tl.sum(p, axis=1)
        else:
            m_new = tl.maximum(m_i, m_tile)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        if KV_MODE == 0:
            vt = tl.load(
                v_ptr + blk[:, None] * stride_v_blk + slot[:, None] * stride_v_slot
                + kvh * stride_v_head + offs_d[None, :],
                mask=kv_ok[:, None], other=0.0,
            )
            pb = p.to(q.dtype)
            pv = _dot(pb, vt.to(q.dtype), DOT_F32)
            if LAZY_RESCALE:
                acc = acc + pv
            else:
                acc = acc * alpha[:, None] + pv
            if HEAD_SPLIT == 2:
                vt1 = tl.load(
                    v_ptr + blk[:, None] * stride_v_blk + slot[:, None] * stride_v_slot
                    + kvh * stride_v_head + DH + offs_d[None, :],
                    mask=kv_ok[:, None], other=0.0,
                )
                pv1 = _dot(pb, vt1.to(q.dtype), DOT_F32)
                if LAZY_RESCALE:
                    acc1 = acc1 + pv1
                else:
                    acc1 = acc1 * alpha[:, None] + pv1
        else:
            if PAGE_TILES:
                vw = tl.load(v_head + (blk * stride_v_blk + slot0 * stride_v_slot) + v_rows)
                if HEAD_SPLIT == 2:
                    vw1 = tl.load(v_head + (blk * stride_v_blk + slot0 * stride_v_slot + WORDS)
                                  + v_rows)
                if FLAT_WORDS:
                    vw = tl.reshape(vw, (TILE_N, WORDS))
                    if HEAD_SPLIT == 2:
                        vw1 = tl.reshape(vw1, (TILE_N, WORDS))
                v_sc = tl.load(vs_head + (blk * stride_vs_blk + slot0 * stride_vs_slot)
                               + vs_rows)
            else:
                vw = tl.load(
                    v_ptr + blk[:, None] * stride_v_blk + slot[:, None] * stride_v_slot
                    + kvh * stride_v_head + offs_w[None, :],
                    mask=kv_ok[:, None], other=0,
                )
                if HEAD_SPLIT == 2:
                    vw1 = tl.load(
                        v_ptr + blk[:, None] * stride_v_blk + slot[:, None] * stride_v_slot
                        + kvh * stride_v_head + WORDS + offs_w[None, :],
                        mask=kv_ok[:, None], other=0,
                    )
                v_sc = tl.load(
                    vs_ptr + blk * stride_vs_blk + slot * stride_vs_slot + kvh * stride_vs_head,
                    mask=kv_ok, other=0.0,
                )
            if KV_MODE == 4:
                vbits = v_sc.to(tl.int32, bitcast=True)
                v_off = (vbits & 0xF).to(tl.float32)
                v_sc = (vbits & -16).to(tl.float32, bitcast=True)
            else:
                v_off = tl.zeros([TILE_N], dtype=tl.float32)
            v = _unpack_words(vw, v_off, KV_MODE, TILE_N, DH).to(q.dtype)
            # per-token scale folded into P (a row scale of V = a column scale of P)
            if PAGE_TILES:
                # keys past hi were read unmasked (same page, finite codes); their scale may be
                # any float32 (NaN): zero it so that 0 * NaN never reaches the accumulator
                v_sc = tl.where(kv_ok, v_sc, 0.0)
            pb = (p * v_sc[None, :]).to(q.dtype)
            pv = _dot(pb, v, DOT_F32)
            if LAZY_RESCALE:
                acc = acc + pv
            else:
                acc = acc * alpha[:, None] + pv
            if HEAD_SPLIT == 2:
                v1 = _unpack_words(vw1, v_off, KV_MODE, TILE_N, DH).to(q.dtype)
                pv1 = _dot(pb, v1, DOT_F32)
                if LAZY_RESCALE:
                    acc1 = acc1 + pv1
                else:
                    acc1 = acc1 * alpha[:, None] + pv1
        pos = pos_next
    if DIRECT:
        inv = tl.where(l_i > 0.0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)
        o_row = q_tok[:, None] * stride_o_t + q_head[:, None] * stride_o_h
        tl.store(out_ptr + o_row + offs_d[None, :],
                 (acc * inv[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        if HEAD_SPLIT == 2:
            tl.store(out_ptr + o_row + DH + offs_d[None, :],
                     (acc1 * inv[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        ml_idx = (q_tok * NUM_Q_HEADS + q_head) * num_splits + split
        tl.store(part_o_ptr + ml_idx[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None])
        if HEAD_SPLIT == 2:
            tl.store(part_o_ptr + ml_idx[:, None] * HEAD_DIM + DH + offs_d[None, :], acc1,
                     mask=row_ok[:, None])
        tl.store(part_m_ptr + ml_idx, m_i, mask=row_ok)
        tl.store(part_l_ptr + ml_idx, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _wide_verify_reduce_kernel(
    out_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    signs_ptr,  # int4 (RHT_OUT): the RHT sign vector d1 [HEAD_DIM] float32; else a dummy
    num_splits,
    stride_o_t: tl.int64,
    stride_o_h: tl.int64,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    RHT_OUT: tl.constexpr = False,
    LOG2_D: tl.constexpr = 0,
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
    if RHT_OUT:
        # int4: rotate back, D.H.res / head_dim (vLLM's single_rht(x, inverse=True) / d), fp32
        res = (_hadamard_vec(res, HEAD_DIM, LOG2_D) * tl.load(signs_ptr + offs_d)
               * (1.0 / HEAD_DIM))
    tl.store(out_ptr + tok * stride_o_t + head * stride_o_h + offs_d,
             res.to(out_ptr.dtype.element_ty))


def reduce_launch(num_splits: int, head_dim: int) -> tuple[int, int]:
    """(SPLITS_PAD, num_warps) of the reduce kernel: two buckets, 16 and 64 splits (or the next
    power of two above 64 for an explicit larger count), not one per power of two.

    Why: every distinct constexpr / launch value is a separate Triton compile, made at its first
    use. A DFlash drafter's non-causal attention runs outside CUDA graphs with the split count of
    the live context (1..16 on the H200), so each new power of two used to compile a reduce
    kernel during a user's request as the conversation grew; the H200 saw the wide-verify pair
    compile in a DFlash2 server's first requests (2026-12-03, vLLM's JIT monitor). With
    ``num_splits`` not specialized by value (``do_not_specialize``) and these buckets, the split
    kernel has two variants (one split = direct output, or partials) and the reduce kernel one
    per bucket, and the launcher's warm-up (a short and a ~700-token prompt) compiles the ones a
    drafter uses. Masked loads of the unused partial rows cost only their addresses."""
    pad = 16 if num_splits <= 16 else max(64, triton.next_power_of_2(num_splits))
    return pad, (8 if pad * head_dim > 4096 else 4)


DEEP_PIPELINE_SHARED = 200 * 1024   # default_launch's Hopper configs take up to 192 KiB
_BLOCK_SHARED: dict[int, int] = {}


def block_shared(device: torch.device) -> int:
    """Shared memory one block may opt into on ``device``: per multiprocessor less the 1 KiB the
    driver keeps (232,448 B on sm_90 / sm_100, 166,912 on sm_80, 101,376 on sm_86 / sm_89 /
    sm_120); 0 on the CPU (the interpreter). Cached per device."""
    if device.type != "cuda":
        return 0
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _BLOCK_SHARED:
        _BLOCK_SHARED[idx] = torch.cuda.get_device_properties(idx).shared_memory_per_multiprocessor - 1024
    return _BLOCK_SHARED[idx]


def deep_pipeline_shared(device: torch.device) -> bool:
    """True when a block on ``device`` may have Hopper-class shared memory (>= 200 KiB: sm_90 /
    sm_100), the test every Hopper-only default of this file makes (launch, head split, flat words,
    qk_int8). Decided by the shared memory, not the architecture: an RTX 5090 (sm_120) is newer
    than Hopper but has a 3090's 99 KiB, where the deep pipelines (up to 192 KiB) fail."""
    return block_shared(device) >= DEEP_PIPELINE_SHARED


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 16
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_num_splits(max_seq_len: int, num_seqs: int, num_kv_heads: int, num_sms: int,
                      *, min_chunk: int = 256, max_splits: int = 64,
                      waves: float = 1.0) -> int:
    """Splits per (sequence, kv head): as many programs as fit in ``waves`` x the SMs (rounded
    down, never a partial extra wave), each split at least ``min_chunk`` keys, at most
    ``max_splits``. One wave: a program holds a whole SM (its registers / shared memory), so a
    second wave only adds fp32 partials to write and reduce (H200, q=16, 32k: 1 wave 106 us vs
    2 waves 115 us bf16, 342 vs 413 us int4). Rounding up used to leave a nearly empty last
    wave that takes as long as a full one (batch 4 on 132 SMs: 17 splits = 272 programs =
    3 waves of 1/17 of the keys each, vs 8 splits = 128 programs = 1 wave of 1/8)."""
    if max_seq_len <= min_chunk:
        return 1
    want = math.floor(waves * num_sms / max(1, num_seqs * num_kv_heads))
    cap = math.ceil(max_seq_len / min_chunk)
    return int(max(1, min(want, cap, max_splits)))


def _as_words(cache: torch.Tensor) -> torch.Tensor:
    """An int8/uint8 cache view as int32 words (4 bytes each). vLLM's per-token-head caches
    keep a float32 scale after every row, so rows and strides are multiples of 4 bytes."""
    try:
        return cache.view(torch.int32)
    except RuntimeError as exc:
        raise ValueError(f"int8/int4 cache (shape {tuple(cache.shape)}, strides {cache.stride()}, "
                         f"offset {cache.storage_offset()}) cannot be read as 4-byte words; valid:"
                         " rows, strides and offset in multiples of 4 bytes") from exc


def default_launch(mode: int, block_m: int, head_dim: int, device: torch.device) -> tuple:
    """(tile_n, num_warps, num_stages) when the caller gives none.

    Hopper / B200 (sm_90 / sm_100, 227 KiB shared memory per block): >= 3 stages, so the K/V copies of later
    tiles are in flight while tile t computes (with 2 stages Triton issues the next tile's copies
    only after this tile's dots: no overlap). bf16, 128 query rows x 256: Q 64 KiB + 4 x 32 KiB
    K/V stages at tile 32 = 192 KiB, 227 registers, no spills (Triton 3.6). int8 / int4: tile 16
    / 8 warps / 4 stages, the spill-free point (tile-loop SASS per 16 keys: int8 603, int4 662
    instructions; tile 32 still spills 16-24 B inside the loop, tile 64 ~900 B, 4 warps 2.3-6 KB:
    the unpacked K/V tile is live next to the 128 x 256 fp32 accumulator). Tile 16 also divides
    every vLLM page size (multiples of 16; 784 bf16 / 1584 int8 on the 27B), which keeps int8 /
    int4 on the per-tile address path (``PAGE_TILES``); tile 32 would not divide 1584. GPUs with
    less shared memory (sm_80 163 KiB; sm_86 / sm_89 / sm_120, RTX 30 / 40 / 50, 99 KiB; mma.sync keeps Q in registers, so everything spills a little at 128
    rows): bf16 tile 32 / 2 stages as before, 1 stage at 128 query rows x 256 (below); int8 tile 16 / 2 stages (332 B spills vs 644 B at
    tile 32); int4 tile 16 / 1 stage (ptxas caps the pipelined int4 kernel at 128 registers on
    sm_86: ~4 KB spills; unpipelined 255 registers, 160 B). Compiler figures only on sm_86; no
    3090 timing yet. Evidence: docs/wide-verify.md ("int8 / int4 tile loop").
    Kept at 16 after the H200 sweep of 2026-12-04 (q=16, 32k, batch 1, page 64): int8 16 / 8 / 4
    181 us vs 32 / 8 / 3 250 us and 32 / 8 / 2 261 us; int4 tile 32 was ~5 % faster there but
    that row was dominated by the host-side RHT (fixed cost, now in the kernels), and tile 32 /
    64 would leave the PAGE_TILES path at vLLM's 1584-token int8 page. bench/kernel_verify.py's
    sweep times 16 / 32 / 64 at 2-4 stages (and int8 at page 1584): change it only on that.
    """
    big = block_m * head_dim >= 64 * 256
    warps = 8 if big else 4
    if deep_pipeline_shared(device):
        return (32, warps, 4) if mode == 0 else (16, warps, 4)
    if mode == 0 and block_m * head_dim > 64 * 256:
        # 128 query rows x 256 (a verify block of 9..16 tokens, bf16 KV): 2 stages take 104 KiB of
        # shared memory (Triton 3.9, sm_86), over the 99 KiB (101,376 B) a block may have on an
        # RTX 3090 / 4090, where the launch fails; 1 stage takes 88 KiB at the same per-key loop
        # (1,599 vs 1,640 instructions per 32 keys). With 2 stages the copies of the next tile are
        # issued only after this tile's dots (docs/wide-verify.md), so the stage bought little.
        # tests/test_wide_verify_compile.py holds every default under 101,376 B.
        return (32, warps, 1)
    return {0: (32, warps, 2), 2: (16, warps, 2), 4: (16, warps, 1)}[mode]


def _env_setting(name: str, values: dict):
    """A kernel knob from the server's environment, read once at import: auto / unset -> None (the
    GPU's default decides), a key of ``values`` -> its value; anything else is one line naming the
    valid values (raised at import in the server)."""
    raw = os.environ.get(name, "auto").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in values:
        return values[raw]
    raise ValueError(f"{name}={raw!r} is not valid; valid: auto, {', '.join(values)}")


def _row_split_setting() -> int | None:
    """ONECARD_VERIFY_ROW_SPLIT (the launcher's VERIFY_ROW_SPLIT): auto (default) -> None,
    :func:`default_row_split` decides; 1 / 2 -> that row split for every verify block of 9..16
    tokens (128 query rows), an A/B for a server (job 31 arms)."""
    return _env_setting("ONECARD_VERIFY_ROW_SPLIT", {"1": 1, "2": 2})


_ROW_SPLIT_SETTING = _row_split_setting()


def default_row_split(mode: int, block_m: int, head_dim: int, device: torch.device) -> int:
    """``row_split`` when the caller gives none: ONECARD_VERIFY_ROW_SPLIT's 1 / 2 for a verify block
    of 128 query rows (9..16 tokens with 6 query heads per KV head), else 1. ``auto`` is 1 on every
    GPU: measured slower on an H100 (session 27, q=16, 32k, b1: int8 243 vs 183 us, bf16 108 vs
    81 us; the two programs share the SM's shared-memory pipe, which the int8 words' bank
    conflicts already saturate: docs/wide-verify.md "bank conflicts"); smaller blocks keep one
    program (half of a 64-row block is the 32 rows that a decode or a short verify block already
    pads to)."""
    if block_m * head_dim > 64 * 256 and _ROW_SPLIT_SETTING is not None:
        return _ROW_SPLIT_SETTING
    return 1


def _flat_words_setting() -> bool | None:
    """ONECARD_VERIFY_FLAT_WORDS (the launcher's VERIFY_FLAT_WORDS): auto (default) -> None,
    :func:`default_flat_words` decides; 0 / 1 -> that load for every int8 / int4 launch (an A/B
    for a server, e.g. on a 3090 where it is not timed)."""
    return _env_setting("ONECARD_VERIFY_FLAT_WORDS", {"0": False, "1": True})


_FLAT_WORDS_SETTING = _flat_words_setting()


def _qk_int8_setting() -> bool | None:
    """ONECARD_VERIFY_QK_INT8 (the launcher's VERIFY_QK_INT8): auto (default) -> None (the GPU's
    default, :func:`default_qk_int8`); 0 -> off; 1 -> ``qk_int8`` for every int8 launch that can take
    it (the PAGE_TILES path)."""
    return _env_setting("ONECARD_VERIFY_QK_INT8", {"0": False, "1": True})


_QK_INT8_SETTING = _qk_int8_setting()


def default_qk_int8(mode: int, page_tiles: bool, device: torch.device | None = None) -> bool:
    """``qk_int8`` when the caller gives none, for an int8 launch whose tiles lie in one page (int4 /
    bf16 and page-straddling tiles never take it): ONECARD_VERIFY_QK_INT8's 0 / 1 if set, else
    ``QK_INT8_HOPPER`` (True) on a GPU with Hopper's shared memory and False elsewhere. Why on there
    (session 33, the lent H100, docs/measurements.md): 27B geometry, CTX=long, C1 greedy, ms per
    step at 32k / 72k: SPEC=off 12.49 / 14.10 -> 12.18 / 13.43, SPEC=mtp 16.37 / 17.67 -> 14.70 /
    16.20, the same greedy text in all four; the kernel alone 22-27 % faster (session 30). On
    SmolLM2, every position scored as decode reads the cache (bench/qk_int8_quality.py, 4,052
    tokens): perplexity vs bf16 KV int8 +0.04 %, int8 + qk_int8 -0.14 %; mean |delta log-prob|
    0.059 and 0.062, against 0.047 for a change of attention arithmetic alone.
    It stays off on sm_8x: no 3090 has timed it (its compile: docs/wide-verify.md)."""
    if mode != 2 or not page_tiles:
        return False
    if _QK_INT8_SETTING is not None:
        return _QK_INT8_SETTING
    return device is not None and QK_INT8_HOPPER and deep_pipeline_shared(device)


def default_flat_words(mode: int, device: torch.device) -> bool:
    """``flat_words`` when the caller gives none (int8 / int4; bf16 never reads words):
    ONECARD_VERIFY_FLAT_WORDS's 0 / 1 if set, else ``FLAT_WORDS_HOPPER`` (True) on a GPU with
    Hopper's shared memory and False elsewhere. Why (docs/wide-verify.md "bank conflicts"): the 2-D
    words load makes Triton stage a tile key-fastest in shared memory, a 16-way bank conflict on
    every cp.async store and LDS of the words (ncu on the H100, session 27); the flat load stages it
    in load order (ncu, session 28: 0 excess wavefronts, was 16.1 M of 25.5 M). Measured on the
    lent H100 twice (session 28, q=16, page 64, 16 / 8 / 4): int8 32k b1 182.2 / 182.2 -> 122.0 /
    122.4 us, b4 656.9 / 647.2 -> 431.0 / 425.6 us, 131k b1 634.8 / 646.1 -> 424.6 / 421.1 us; int4
    whole head 152 -> 125 us, int4 head_split 2 (its Hopper default, no conflict) unchanged (120.1
    vs 120.4 us); end to end DFlash2 k15 at 32k 20.13 -> 18.28 ms per step, the same text. On sm_86
    the flat launch spills a little more (int8 16 / 8 / 2: 224 -> 284 B) and no 3090 has timed
    either, so it stays off there (VERIFY_FLAT_WORDS=1 is the A/B)."""
    if mode == 0:
        return False
    if _FLAT_WORDS_SETTING is not None:
        return _FLAT_WORDS_SETTING
    return FLAT_WORDS_HOPPER and deep_pipeline_shared(device)


def default_head_split(mode: int, block_m: int, head_dim: int, device: torch.device) -> int:
    """``head_split`` when the caller gives none: 2 for int4 KV at 128 query rows x 256 (a verify
    block of 9..16 tokens) on a GPU with Hopper's shared memory, else 1.

    Measured twice on the lent H100 (bench/kernel_verify.py sweep, q=16, 32k, batch 1, page 64,
    tile 16 / 8 warps / 4 stages): 120.2 vs 150.8 us (2026-12-05, session 24) and 122.6 vs 153.1 us
    (session 25), -20 % both times; the half-width unpacked K / V tile takes the int4 kernel from
    244 to 218 registers on sm_90. Most of that -20 % was the words' bank conflict (int4's
    half-tile is one word per thread, staged without it; docs/wide-verify.md "bank conflicts"):
    with flat words (session 28) int4 whole head is 124.9 us against head_split 2's 120.1, still
    4 % behind, so int4 keeps 2. Not the default elsewhere: int8 gained 4 % (173.5 vs 180.7 us) and
    with flat words 5-7 % (115.3 vs 122.4 us at 32k b1, 408.3 vs 425.6 at b4, 396.0 vs 421.1 at
    131k; session 28, twice), bf16 5 % (75.4 vs 79.3 us), each under the 10 % a default moves on;
    q <= 8 (64 rows) and the sm_8x launches (1 stage, 99 KiB of shared memory) were not timed
    with it."""
    if mode == 4 and block_m * head_dim > 64 * 256 and head_dim >= 32 and deep_pipeline_shared(device):
        return 2
    return 1


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
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_partial_bytes: int = 64 << 20,
    causal: bool = True,
    lazy_rescale: bool = False,
    head_split: int | None = None,
    row_split: int | None = None,
    flat_words: bool | None = None,
    qk_int8: bool | None = None,
) -> torch.Tensor:
    """Verify attention over vLLM's paged cache; writes ``out`` [T, Hq, D] and returns it.
    ``causal`` (default): query i of a sequence sees keys p < seq_len - q_len + i + 1; False: every
    query sees all seq_len keys (a DFlash drafter's non-causal block of 1 + k rows).
    ``lazy_rescale`` (off by default; an A/B option of bench/kernel_verify.py's sweep): rescale the
    accumulator only when a running max grows by more than 2^8 (docs/wide-verify.md).
    ``head_split`` (None: :func:`default_head_split`, 2 for int4 verify blocks on Hopper-class GPUs,
    else 1; 1 or 2 for any kv_mode): the head dim in two halves, two Q.K^T dots summed and two P.V
    accumulators of head_dim / 2, so that a tile's unpacked K / V is half as wide in registers
    (docs/wide-verify.md, "head split").
    ``flat_words`` (None: :func:`default_flat_words`): int8 / int4 tiles loaded as one flat vector
    of words, so that they are staged in shared memory without bank conflicts (docs/wide-verify.md,
    "bank conflicts").
    ``qk_int8`` (None: :func:`default_qk_int8`, on for int8 page-tile launches on Hopper-class GPUs;
    True: int8 KV with page a multiple of tile_n only): Q.K^T as an int8 dot of the query, quantized
    per row, with the key tile's bytes as stored (docs/wide-verify.md, "int8 Q.K^T").
    ``row_split`` (None: :func:`default_row_split`; 1 or 2): each sequence's query tokens in
    ``row_split`` programs of half the rows over the same keys (twice the programs, each small
    enough to share an SM with another); the launch's tile / stages then default to those of the
    smaller block, the warps to 4.

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
    if row_split is not None and row_split not in (1, 2):
        raise ValueError(f"row_split={row_split} is not valid; valid: 1, 2")
    if head_split is not None and (head_split not in (1, 2) or head_dim // head_split < 16):
        raise ValueError(f"head_split={head_split} is not valid for head_dim {head_dim}; "
                         "valid: 1, 2 (head_dim / head_split >= 16)")
    if mode and (k_scale_cache is None or v_scale_cache is None):
        raise ValueError("int8/int4 KV needs k_scale_cache and v_scale_cache")
    if mode == 0:
        k_scale_cache = v_scale_cache = seq_lens  # unused dummies (never loaded)
        ks_strides = vs_strides = (0, 0, 0)
    else:
        ks_strides, vs_strides = k_scale_cache.stride(), v_scale_cache.stride()
        key_cache, value_cache = _as_words(key_cache), _as_words(value_cache)
    num_seqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(triton.next_power_of_2(max_query_len), triton.cdiv(16, group_pad))
    if row_split is None:
        row_split = default_row_split(mode, block_q * group_pad, head_dim, q.device)
    if row_split > 1:
        # each program takes block_q / row_split query tokens (at least 16 rows for the dots)
        block_q = max(block_q // row_split, triton.cdiv(16, group_pad))
    if max_seq_len is None:
        max_seq_len = block_table.shape[1] * page
    if num_splits is None:
        num_splits = choose_num_splits(max_seq_len, num_seqs, num_kv_heads, _sm_count(q.device))
        per_split = max(1, num_tokens * num_q_heads * (head_dim + 2) * 4)
        num_splits = min(num_splits, max(1, max_partial_bytes // per_split))
    num_splits = max(1, int(num_splits))
    d_tile, d_warps, d_stages = default_launch(mode, block_q * group_pad, head_dim, q.device)
    if head_split is None:
        head_split = default_head_split(mode, block_q * group_pad, head_dim, q.device)
    tile_n = d_tile if tile_n is None else tile_n
    if row_split > 1:
        # one warpgroup, and stages whose shared memory lets two programs share an SM (sm_90,
        # q=16: int8 / int4 tile 16 x 3 stages 64 KiB, bf16 tile 32 x 2 stages 96 KiB; 255
        # registers x 128 threads = half the register file)
        d_warps, d_stages = 4, min(d_stages, 2 if mode == 0 else 3)
    num_warps = d_warps if num_warps is None else num_warps
    num_stages = d_stages if num_stages is None else num_stages

    scale = softmax_scale
    q_in, target = q, out
    signs = seq_lens  # unused dummy unless int4
    if mode == 4:
        # The randomized Hadamard transform (RHT) of the query and its inverse on the output run
        # in our kernels: the query in one small launch (_rht_rows_kernel), the output in the
        # reduce kernel (so int4 always takes the partials + reduce path, also with one split).
        # Before, vLLM's single_rht ran around the kernel: q.float(), signs, hadacore (or a
        # torch butterfly), casts, an fp32 output buffer, the inverse, a copy: ~15-40 small
        # launches, a fixed ~220 us per call in the H200 table (int4 8k: 280 us at batch 1 and
        # batch 4 alike vs int8 62 us; docs/wide-verify.md). Only vLLM's cached sign vector is
        # read here (the tensor single_rht itself uses; no launch, no copy once cached).
        from vllm.v1.attention.ops.int4_per_token_head import _get_rht_signs

        signs = _get_rht_signs(head_dim, 0, q.device)
        if signs.dtype != torch.float32:
            signs = signs.float()
        scale = softmax_scale / head_dim
        q_in = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        _rht_rows_kernel[(num_tokens, num_q_heads)](
            q, signs, q_in, q.stride(0), q.stride(1), q_in.stride(0), q_in.stride(1),
            HEAD_DIM=head_dim, LOG2_D=head_dim.bit_length() - 1,
            num_warps=1 if head_dim <= 256 else 4)

    direct = num_splits == 1 and mode != 4
    if direct:
        part_o = part_m = part_l = target  # unused
    else:
        part_o = torch.empty((num_tokens, num_q_heads, num_splits, head_dim),
                             dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_tokens, num_q_heads, num_splits),
                             dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)

    page_tiles = mode != 0 and page % tile_n == 0
    if qk_int8 is None:
        qk_int8 = default_qk_int8(mode, page_tiles, q.device)
    elif qk_int8 and not (mode == 2 and page_tiles):
        raise ValueError(f"qk_int8 is not valid for kv_mode {kv_mode!r} with page {page} and tile_n "
                         f"{tile_n}; valid: int8 KV with page a multiple of tile_n")
    _wide_verify_split_kernel[(num_seqs * row_split, num_kv_heads, num_splits)](
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
        PAGE_TILES=page_tiles, CAUSAL=bool(causal),
        LAZY_RESCALE=bool(lazy_rescale), HEAD_SPLIT=int(head_split), ROW_SPLIT=int(row_split),
        # only the PAGE_TILES path reads words tile by tile: no other launch compiles a flat variant
        FLAT_WORDS=page_tiles and bool(default_flat_words(mode, q.device) if flat_words is None
                                       else flat_words),
        QK_INT8=bool(qk_int8),
        num_warps=num_warps, num_stages=num_stages,
    )
    if not direct:
        splits_pad, reduce_warps = reduce_launch(num_splits, head_dim)
        _wide_verify_reduce_kernel[(num_tokens, num_q_heads)](
            target, part_o, part_m, part_l, signs, num_splits,
            target.stride(0), target.stride(1),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, SPLITS_PAD=splits_pad,
            RHT_OUT=mode == 4, LOG2_D=head_dim.bit_length() - 1,
            num_warps=reduce_warps,
        )
    return out
