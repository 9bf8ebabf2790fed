# SPDX-License-Identifier: Apache-2.0
"""Deferred commit of Gated DeltaNet (GDN) recurrent states under speculative decoding.

Why
---
When a GDN layer verifies a block of 1 + k speculative tokens per sequence, vLLM's stock kernel
(``fused_sigmoid_gating_delta_rule_update`` with ``inplace_final_state=True``) stores the
recurrent state after *every* token into its own cache block (column t of
``ssm_state_indices``), because it cannot know yet how many of the tokens the rejection sampler
will keep. The next step then starts from column ``num_accepted_tokens - 1``. That costs 1 + k
state blocks per sequence and per layer (each HV x V x K, ~3 MB in fp32 for a 27B-class layer)
and k + 1 full state writes per step.

What we do instead
------------------
Each sequence owns ONE state block (its "running" block, column 0 of ``ssm_state_indices``),
which always holds the last committed state. A step is split in two launches:

* ``gdn_defer_verify`` computes exactly the stock outputs for every token, starting from the
  running block, but stores no state. For every token it instead keeps the small per-token
  inputs of the state update in a per-layer scratch (``DeferScratch``): the key after the
  kernel's l2 normalization (fp32), the raw value row (in v's dtype), the decay gate
  g = -exp(A_log) * softplus(a + dt_bias) (fp32) and the write strength sigmoid(b) (fp32).
  These are a few KB per token instead of a full state.
* ``gdn_defer_commit_all`` runs after the rejection sampler, for every deferring layer of the
  engine in ONE launch. For each verified batch row and layer it reloads the running block and
  replays the delta-rule update over the first ``num_accepted`` tokens from the scratch, using
  the same fp32 operations in the same order as the stock kernel, and writes the result back to
  the running block (with prefix caching also the state at a cache-block boundary crossed by
  the accepted run into that block). A ``CommitPlan`` holds per-layer device tables of
  addresses (state pool, block stride, scratch) and the KV-cache groups' block-table
  addresses; the kernel finds each row's spec sequence from the spec mask, its running (and
  boundary) block ids in its group's block table, and applies the prefix-cache boundary rule
  itself, so the host issues one launch per step and no torch index ops.

The per-layer commit ``gdn_defer_commit`` (block ids given per row), the boundary rule in torch
``boundary()`` and float64 references of both launches are test oracles, kept out of vLLM in
onecard's tests/gdn_defer_oracle.py; the tests hold ``gdn_defer_commit_all`` to them bitwise.

Because the replay performs the identical fp32 arithmetic on identical fp32 operands (the
scratch stores the values the stock kernel had in registers), the committed state equals the
state the stock kernel would have left in column ``num_accepted - 1``; for a bf16 state pool it
is the same bf16 rounding of the same fp32 chain.

Recurrence per value head (h: [V, K] fp32, k_t: [K] normalized key, q_t normalized & scaled):
    h   <- h * exp(g_t)
    v'  <- (v_t - sum_k h[:, k] * k_t[k]) * beta_t
    h   <- h + v' k_t^T
    o_t <- sum_k h[:, k] * q_t[k]

Limits and contracts
--------------------
* varlen only: q, k [1, T, H, K], v [1, T, HV, V], a, b [T, HV] (or [1, T, HV]), cu_seqlens
  [N + 1]. K must fit one block (BK = next_power_of_2(K)), as in the stock kernel.
* The host never reads device tensors (no sync). ``gdn_defer_verify`` checks only the static
  bounds N <= scratch.max_seqs and T <= scratch.max_seqs * scratch.max_tokens; a sequence longer
  than ``scratch.max_tokens`` still gets correct outputs, but its tokens t >= max_tokens are not
  saved, so it must not commit more than ``max_tokens`` tokens (the commit kernel clamps its
  token count to ``max_tokens`` and never reads past a sequence's scratch rows).
* Sequences with 0 tokens or with ``ssm_state_indices[n, 0] <= 0`` are skipped entirely (as the
  stock kernel does): their output rows are left unwritten and their scratch rows are untouched.
* The commit reads scratch rows written by the preceding verify of the same layer; the caller
  guarantees num_accepted[r] <= tokens of row r's spec sequence, that distinct rows use
  distinct running blocks, and that no boundary block is another row's running block.
* State pools are [num_blocks, HV, V, K] with contiguous inner dims and any block stride
  (vLLM's mamba views into padded KV pages); float32 or bfloat16 (fp32 math, cast on load/store).

This file imports only torch and triton so that it can ship verbatim inside vLLM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


class DeferScratch:
    """Per-layer scratch of one verify step: k_hat [S, T, H, K] fp32, v [S, T, HV, V] (v dtype),
    g [S, T, HV] fp32, beta [S, T, HV] fp32.

    Indexed by spec sequence n (0..S-1, the order of cu_seqlens) and token t within it
    (0..T-1), not by flat token offset."""

    def __init__(self, max_seqs: int, max_tokens: int, num_k_heads: int, num_v_heads: int,
                 head_k_dim: int, head_v_dim: int, v_dtype, device):
        if max_seqs < 1 or max_tokens < 1:
            raise ValueError(f"DeferScratch: max_seqs={max_seqs} and max_tokens={max_tokens} must be >= 1")
        if num_k_heads < 1 or num_v_heads % num_k_heads:
            raise ValueError(f"DeferScratch: num_v_heads={num_v_heads} must be a multiple of num_k_heads={num_k_heads}")
        self.max_seqs = int(max_seqs)
        self.max_tokens = int(max_tokens)
        self.num_k_heads = int(num_k_heads)
        self.num_v_heads = int(num_v_heads)
        self.head_k_dim = int(head_k_dim)
        self.head_v_dim = int(head_v_dim)
        s, t = self.max_seqs, self.max_tokens
        f32 = torch.float32
        self.k = torch.zeros(s, t, num_k_heads, head_k_dim, dtype=f32, device=device)
        self.v = torch.zeros(s, t, num_v_heads, head_v_dim, dtype=v_dtype, device=device)
        self.g = torch.zeros(s, t, num_v_heads, dtype=f32, device=device)
        self.beta = torch.zeros(s, t, num_v_heads, dtype=f32, device=device)

    @staticmethod
    def nbytes_for(max_seqs, max_tokens, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
                   v_itemsize) -> int:
        per_token = (num_k_heads * head_k_dim * 4 + num_v_heads * head_v_dim * v_itemsize
                     + num_v_heads * 4 * 2)
        return int(max_seqs) * int(max_tokens) * per_token

    @property
    def nbytes(self) -> int:
        return DeferScratch.nbytes_for(self.max_seqs, self.max_tokens, self.num_k_heads,
                                       self.num_v_heads, self.head_k_dim, self.head_v_dim,
                                       self.v.element_size())


# --------------------------------------------------------------------------------------------
# verify: stock outputs, no state stores, per-token update inputs saved to the scratch
# --------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["MAXT"])
def _gdn_defer_verify_kernel(
    A_log, a, b, dt_bias, q, k, v, o, h0, cu_seqlens, ssm_state_indices,
    s_k, s_v, s_g, s_beta,
    scale, softplus_beta, threshold,
    MAXT,                      # scratch.max_tokens
    stride_h0_blk,             # state pool block stride (elements)
    stride_idx_seq,            # ssm_state_indices row stride
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_QK_L2NORM_IN_KERNEL: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    seq_len = eos - bos
    if seq_len == 0:
        return
    # always the running block (column 0), whatever was accepted last step
    state_idx = tl.load(ssm_state_indices + i_n.to(tl.int64) * stride_idx_seq).to(tl.int64)
    if state_idx <= 0:
        return

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]

    p_q = q + (bos * H + i_h) * K + o_k
    p_k = k + (bos * H + i_h) * K + o_k
    p_v = v + (bos * HV + i_hv) * V + o_v
    p_a = a + bos * HV + i_hv
    p_b = b + bos * HV + i_hv
    p_o = o + (bos * HV + i_hv) * V + o_v

    # scratch rows of sequence i_n, token 0
    row0 = i_n.to(tl.int64) * MAXT
    p_sk = s_k + (row0 * H + i_h) * K + o_k
    p_sv = s_v + (row0 * HV + i_hv) * V + o_v
    p_sg = s_g + row0 * HV + i_hv
    p_sb = s_beta + row0 * HV + i_hv
    save_gate = i_v == 0
    save_key = (i_v == 0) & (i_hv % (HV // H) == 0)

    b_h = tl.zeros([BV, BK], dtype=tl.float32)
    p_h0 = h0 + state_idx * stride_h0_blk + i_hv * V * K + o_v[:, None] * K + o_k[None, :]
    b_h += tl.load(p_h0, mask=mask_h, other=0).to(tl.float32)

    b_A = tl.load(A_log + i_hv).to(tl.float32)
    b_dt = tl.load(dt_bias + i_hv).to(tl.float32)

    for i_t in range(0, seq_len):
        b_q = tl.load(p_q, mask=mask_k, other=0).to(tl.float32)
        b_k = tl.load(p_k, mask=mask_k, other=0).to(tl.float32)
        b_v_raw = tl.load(p_v, mask=mask_v, other=0)
        b_v = b_v_raw.to(tl.float32)
        b_b = tl.load(p_b).to(tl.float32)

        x = tl.load(p_a).to(tl.float32) + b_dt
        softplus_x = tl.where(
            softplus_beta * x <= threshold,
            (1 / softplus_beta) * tl.log(1 + tl.exp(softplus_beta * x)),
            x,
        )
        b_g = -tl.exp(b_A) * softplus_x
        b_beta = tl.sigmoid(b_b.to(tl.float32))

        if USE_QK_L2NORM_IN_KERNEL:
            b_q = b_q * (tl.rsqrt(tl.sum(b_q * b_q) + 1e-6))
            b_k = b_k * (tl.rsqrt(tl.sum(b_k * b_k) + 1e-6))
        b_q = b_q * scale

        if i_t < MAXT:
            tl.store(p_sv, b_v_raw, mask=mask_v)
            if save_gate:
                tl.store(p_sg, b_g)
                tl.store(p_sb, b_beta)
            if save_key:
                tl.store(p_sk, b_k, mask=mask_k)

        b_h *= tl.exp(b_g)
        b_v -= tl.sum(b_h * b_k[None, :], 1)
        b_v *= b_beta
        b_h += b_v[:, None] * b_k[None, :]
        b_o = tl.sum(b_h * b_q[None, :], 1)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)

        p_q += H * K
        p_k += H * K
        p_v += HV * V
        p_o += HV * V
        p_a += HV
        p_b += HV
        p_sk += H * K
        p_sv += HV * V
        p_sg += HV
        p_sb += HV


# --------------------------------------------------------------------------------------------
# commit: replay the accepted tokens from the scratch onto the running block
# --------------------------------------------------------------------------------------------
@triton.jit
def _replay_accepted(state, stride_blk, blk, s_k, s_v, s_g, s_beta, i_n, i_v, i_h, i_hv, n_acc, MAXT,
                     bnd_on, bnd_cnt, bnd_blk,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, HAS_BOUNDARY: tl.constexpr):
    """The commit of one (row, value head, V slice): state[blk] <- the state after the first n_acc
    tokens of spec sequence i_n, replayed from the scratch with the stock kernel's fp32 operations
    in its order; with HAS_BOUNDARY and bnd_on, the state after bnd_cnt tokens also goes to
    state[bnd_blk]. Shared with the per-layer commit kernel of onecard's test oracle
    (tests/gdn_defer_oracle.py), which the tests hold commit_all to bitwise."""
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]
    o_hv = i_hv * V * K + o_v[:, None] * K + o_k[None, :]

    row0 = i_n * MAXT
    p_sk = s_k + (row0 * H + i_h) * K + o_k
    p_sv = s_v + (row0 * HV + i_hv) * V + o_v
    p_sg = s_g + row0 * HV + i_hv
    p_sb = s_beta + row0 * HV + i_hv

    p_h = state + blk * stride_blk + o_hv
    b_h = tl.zeros([BV, BK], dtype=tl.float32)
    b_h += tl.load(p_h, mask=mask_h, other=0).to(tl.float32)

    for i_t in range(0, n_acc):
        b_k = tl.load(p_sk, mask=mask_k, other=0)
        b_v = tl.load(p_sv, mask=mask_v, other=0).to(tl.float32)
        b_g = tl.load(p_sg)
        b_beta = tl.load(p_sb)

        b_h *= tl.exp(b_g)
        b_v -= tl.sum(b_h * b_k[None, :], 1)
        b_v *= b_beta
        b_h += b_v[:, None] * b_k[None, :]

        if HAS_BOUNDARY:
            if bnd_on & (i_t + 1 == bnd_cnt):
                p_b = state + bnd_blk * stride_blk + o_hv
                tl.store(p_b, b_h.to(p_b.dtype.element_ty), mask=mask_h)

        p_sk += H * K
        p_sv += HV * V
        p_sg += HV
        p_sb += HV

    tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=mask_h)


# --------------------------------------------------------------------------------------------
# commit_all: every deferring layer of the engine in ONE launch, block ids looked up in-kernel
# --------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_rows", "MAXS", "MAXT", "block_size", "stride_bt_row"])
def _gdn_defer_commit_all_kernel(
    state_addrs, state_strides,            # int64 [L]: state pool base address, block stride (elements)
    sk_addrs, sv_addrs, sg_addrs, sb_addrs,  # int64 [L]: scratch k / v / g / beta base addresses
    layer_group,                           # int32 [L]: index of the layer's block table
    bt_addrs,                              # int64 [G]: block table base addresses (int32 [rows, cols])
    stride_bt_row,                         # block tables' row stride (elements, equal for all)
    spec_mask, num_accepted, running_col, num_computed, num_scheduled, num_draft,
    num_rows, MAXS, MAXT, block_size,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BLOCK_R: tl.constexpr,
    STATE_DTYPE: tl.constexpr, V_DTYPE: tl.constexpr,
    HAS_COL: tl.constexpr, ALIGN: tl.constexpr,
):
    i_v, i_rh, i_l = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_r, i_hv = i_rh // HV, i_rh % HV
    i_h = i_hv // (HV // H)
    if i_r >= num_rows:
        return
    if tl.load(spec_mask + i_r).to(tl.int32) == 0:
        return
    # spec sequence of the row: the verified rows before it (the order of the verify's cu_seqlens)
    o_r = tl.arange(0, BLOCK_R)
    before = tl.load(spec_mask + o_r, mask=o_r < i_r, other=0).to(tl.int32)
    i_n = tl.sum(before, 0).to(tl.int64)
    if i_n >= MAXS:
        return
    a_raw = tl.load(num_accepted + i_r).to(tl.int64)
    if a_raw <= 0:
        return
    n_acc = tl.minimum(a_raw, MAXT).to(tl.int32)

    if HAS_COL:
        col = tl.load(running_col + i_r).to(tl.int64)
    else:
        col = tl.zeros([], dtype=tl.int64)
    grp = tl.load(layer_group + i_l).to(tl.int64)
    bt = tl.load(bt_addrs + grp).to(tl.pointer_type(tl.int32)) + i_r.to(tl.int64) * stride_bt_row
    # the runtime gathers the running block at the column clamped to >= 0
    blk = tl.load(bt + tl.maximum(col, 0)).to(tl.int64)
    if blk <= 0:
        return

    if ALIGN:
        # boundary() of onecard's test oracle tests/gdn_defer_oracle.py, row by row (keep the two
        # identical). Triton's integer `//` truncates (GPU and interpreter), boundary()'s torch `//`
        # floors: they differ only for new < 0, where aligned <= 0 and dest < 0 either way (no boundary).
        running = (tl.load(num_computed + i_r).to(tl.int64) + tl.load(num_scheduled + i_r).to(tl.int64)
                   - tl.load(num_draft + i_r).to(tl.int64))
        new = running + a_raw - 1
        aligned = (new // block_size) * block_size
        dest = aligned // block_size - 1
        needs = (aligned >= running) & (dest != col) & (dest >= 0)
        bnd_cnt = tl.where(needs, aligned - running + 1, 0).to(tl.int32)
        bnd_blk = tl.load(bt + tl.maximum(dest, 0), mask=needs, other=0).to(tl.int64)
        bnd_on = needs & (bnd_blk > 0) & (bnd_blk != blk)
    else:
        bnd_cnt = 0
        bnd_blk = blk
        bnd_on = False

    state = tl.load(state_addrs + i_l).to(tl.pointer_type(STATE_DTYPE))
    stride_blk = tl.load(state_strides + i_l)
    s_k = tl.load(sk_addrs + i_l).to(tl.pointer_type(tl.float32))
    s_v = tl.load(sv_addrs + i_l).to(tl.pointer_type(V_DTYPE))
    s_g = tl.load(sg_addrs + i_l).to(tl.pointer_type(tl.float32))
    s_beta = tl.load(sb_addrs + i_l).to(tl.pointer_type(tl.float32))

    _replay_accepted(state, stride_blk, blk, s_k, s_v, s_g, s_beta, i_n, i_v, i_h, i_hv, n_acc, MAXT,
                     bnd_on, bnd_cnt, bnd_blk, H, HV, K, V, BK, BV, ALIGN)


# --------------------------------------------------------------------------------------------
# host wrappers (no device reads)
# --------------------------------------------------------------------------------------------
_NUM_WARPS = 4
_NUM_STAGES = 3


def _blocks(K: int, V: int) -> tuple[int, int, int]:
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 32)
    return BK, BV, triton.cdiv(V, BV)


def _check_pool(name: str, pool: torch.Tensor, HV: int, V: int, K: int) -> None:
    if pool.ndim != 4 or tuple(pool.shape[1:]) != (HV, V, K):
        raise ValueError(f"{name}: shape {tuple(pool.shape)} is not [num_blocks, {HV}, {V}, {K}]")
    if pool.stride()[1:] != (V * K, K, 1):
        raise ValueError(f"{name}: inner dims must be contiguous (strides {pool.stride()})")
    if pool.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{name}: dtype {pool.dtype}; valid: float32, bfloat16")


def _check_scratch(scratch: DeferScratch, H: int, HV: int, K: int, V: int) -> None:
    have = (scratch.num_k_heads, scratch.num_v_heads, scratch.head_k_dim, scratch.head_v_dim)
    if have != (H, HV, K, V):
        raise ValueError(f"scratch is (H, HV, K, V)={have}, inputs are {(H, HV, K, V)}")


def gdn_defer_verify(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    scratch: DeferScratch,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    beta: float = 1.0,
    threshold: float = 20.0,
) -> torch.Tensor:
    """Outputs of ``fused_sigmoid_gating_delta_rule_update(..., inplace_final_state=True)``
    (its first return value, [1, T, HV, V] in q's dtype), starting every sequence n from state
    block ``ssm_state_indices[n, 0]`` and storing no state; the per-token update inputs go to
    ``scratch`` for ``gdn_defer_commit_all``. IS_KDA=False only."""
    if cu_seqlens is None:
        raise ValueError("gdn_defer_verify: cu_seqlens is required (varlen inputs only)")
    if k.ndim != 4 or v.ndim != 4 or q.shape != k.shape or k.shape[0] != 1:
        raise ValueError(f"gdn_defer_verify: q, k [1, T, H, K] and v [1, T, HV, V] expected, "
                         f"got q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    _, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"gdn_defer_verify: HV={HV} is not a multiple of H={H}")
    BK, BV, NV = _blocks(K, V)
    if triton.cdiv(K, BK) != 1:
        raise ValueError("gdn_defer_verify: K must fit one block (NK == 1)")
    _check_scratch(scratch, H, HV, K, V)
    if scratch.v.dtype != v.dtype:
        raise ValueError(f"gdn_defer_verify: scratch.v is {scratch.v.dtype}, v is {v.dtype}")
    _check_pool("initial_state", initial_state, HV, V, K)
    N = cu_seqlens.shape[0] - 1
    if N > scratch.max_seqs:
        raise ValueError(f"gdn_defer_verify: {N} sequences exceed scratch.max_seqs={scratch.max_seqs}")
    if T > scratch.max_seqs * scratch.max_tokens:
        raise ValueError(f"gdn_defer_verify: {T} tokens exceed scratch.max_seqs * scratch.max_tokens="
                         f"{scratch.max_seqs * scratch.max_tokens}")
    if scale is None:
        scale = K ** -0.5
    elif not scale > 0:
        raise ValueError(f"gdn_defer_verify: scale={scale} must be positive")
    if ssm_state_indices.ndim not in (1, 2):
        raise ValueError(f"gdn_defer_verify: ssm_state_indices must be [N] or [N, C], got {tuple(ssm_state_indices.shape)}")
    stride_idx_seq = ssm_state_indices.stride(0)

    o = q.new_empty(1, *v.shape)
    if N == 0 or T == 0:
        return o.squeeze(0)
    _gdn_defer_verify_kernel[(NV, N * HV)](
        A_log, a.contiguous(), b.contiguous(), dt_bias, q.contiguous(), k.contiguous(),
        v.contiguous(), o, initial_state, cu_seqlens, ssm_state_indices,
        scratch.k, scratch.v, scratch.g, scratch.beta,
        scale, beta, threshold,
        scratch.max_tokens, initial_state.stride(0), stride_idx_seq,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm_in_kernel,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )
    return o.squeeze(0)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class CommitPlan:
    """Device tables for ``gdn_defer_commit_all``, built once per engine (all addresses are
    stable: the KV-cache views and the persistent block tables never move).

    states[l]: layer l's state pool view [num_blocks, HV, V, K] (inner dims contiguous, any block
    stride; base addresses and strides may differ per layer; one dtype for all: fp32 or bf16).
    scratches[l]: layer l's DeferScratch (all of the same sizes and v dtype).
    groups[l]: index of layer l's block table in ``block_tables``.
    block_tables: one int32 [max_reqs, max_cols] device tensor per KV-cache group (equal
    stride(0), unit column stride), the persistent ones (their full rows: ``max_reqs``, the
    smallest row count, bounds ``num_rows`` and fixes the kernel's BLOCK_R).

    The plan keeps references to every tensor it points to; rebuild it whenever one of them is
    reallocated (a new KV cache, new block tables, new scratches)."""

    def __init__(self, states: list[torch.Tensor], scratches: list[DeferScratch], groups: list[int],
                 block_tables: list[torch.Tensor]):
        L = len(states)
        if L == 0:
            raise ValueError("CommitPlan: no layers (states is empty)")
        if len(scratches) != L or len(groups) != L:
            raise ValueError(f"CommitPlan: {L} states, {len(scratches)} scratches and {len(groups)} groups; "
                             "one of each per layer")
        if len(block_tables) == 0:
            raise ValueError("CommitPlan: no block tables")

        def sizes(sc):
            return (sc.num_k_heads, sc.num_v_heads, sc.head_k_dim, sc.head_v_dim, sc.max_seqs,
                    sc.max_tokens, sc.v.dtype)

        want = sizes(scratches[0])
        for l, sc in enumerate(scratches):
            if sizes(sc) != want:
                raise ValueError(f"CommitPlan: scratches[{l}] (H, HV, K, V, max_seqs, max_tokens, v dtype)="
                                 f"{sizes(sc)} differs from scratches[0]'s {want}")
        H, HV, K, V, max_seqs, max_tokens, v_dtype = want
        if v_dtype not in _TL_DTYPES:
            raise ValueError(f"CommitPlan: scratch v dtype {v_dtype}; valid: {', '.join(map(str, _TL_DTYPES))}")
        device = states[0].device
        for l, st in enumerate(states):
            _check_pool(f"CommitPlan: states[{l}]", st, HV, V, K)
            if st.dtype != states[0].dtype:
                raise ValueError(f"CommitPlan: states[{l}] is {st.dtype}, states[0] is {states[0].dtype}; "
                                 "one state dtype for all layers")
            if st.device != device or scratches[l].k.device != device:
                raise ValueError(f"CommitPlan: states[{l}] or scratches[{l}] is not on {device}")
        for l, g in enumerate(groups):
            if not isinstance(g, int) or not 0 <= g < len(block_tables):
                raise ValueError(f"CommitPlan: groups[{l}]={g!r} is not a block table index "
                                 f"(0..{len(block_tables) - 1})")
        stride0 = block_tables[0].stride(0) if block_tables[0].ndim == 2 else None
        for i, bt in enumerate(block_tables):
            if bt.ndim != 2 or bt.dtype != torch.int32:
                raise ValueError(f"CommitPlan: block_tables[{i}] is {bt.dtype} {tuple(bt.shape)}; "
                                 "int32 [max_reqs, max_cols] expected")
            if bt.stride(1) != 1 or bt.stride(0) != stride0:
                raise ValueError(f"CommitPlan: block_tables[{i}] strides {bt.stride()}; (same row stride "
                                 f"for all tables = {stride0}, 1) expected")
            if bt.device != device:
                raise ValueError(f"CommitPlan: block_tables[{i}] is on {bt.device}, states on {device}")

        self.num_layers = L
        self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim = H, HV, K, V
        self.max_seqs, self.max_tokens = max_seqs, max_tokens
        self.max_reqs = min(int(bt.shape[0]) for bt in block_tables)
        self.block_r = triton.next_power_of_2(max(self.max_reqs, 1))
        self.state_dtype = states[0].dtype
        self.v_dtype = v_dtype
        self.stride_bt_row = int(stride0)

        def i64(xs):
            return torch.tensor(xs, dtype=torch.int64, device=device)

        self.state_addrs = i64([st.data_ptr() for st in states])
        self.state_strides = i64([st.stride(0) for st in states])
        self.sk_addrs = i64([sc.k.data_ptr() for sc in scratches])
        self.sv_addrs = i64([sc.v.data_ptr() for sc in scratches])
        self.sg_addrs = i64([sc.g.data_ptr() for sc in scratches])
        self.sb_addrs = i64([sc.beta.data_ptr() for sc in scratches])
        self.layer_group = torch.tensor(list(groups), dtype=torch.int32, device=device)
        self.bt_addrs = i64([bt.data_ptr() for bt in block_tables])
        # the memory the addresses point to must outlive the plan
        self._keep = (list(states), [(sc.k, sc.v, sc.g, sc.beta) for sc in scratches], list(block_tables))


def gdn_defer_commit_all(
    plan: CommitPlan,
    *,
    spec_mask: torch.Tensor,
    num_accepted: torch.Tensor,
    num_rows: int,
    running_col: torch.Tensor | None = None,
    num_computed: torch.Tensor | None = None,
    num_scheduled: torch.Tensor | None = None,
    num_draft: torch.Tensor | None = None,
    block_size: int = 0,
) -> None:
    """The commit of every layer of ``plan`` in one launch, block ids and the prefix-cache
    boundary looked up on the device. For each layer l and batch row r < num_rows
    with spec_mask[r] (n = number of True in spec_mask[:r] is the row's spec sequence):
    a = num_accepted[r]; col = running_col[r] (0 without it); blk = table(l)[r, max(col, 0)];
    the row is skipped when a <= 0, n >= max_seqs or blk <= 0. With num_computed,
    num_scheduled, num_draft (prefix caching "align", block_size > 0) the state after
    ``count`` tokens also goes to bblk = table(l)[r, dest] by this rule (R = computed +
    scheduled - draft; aligned = ((R + a - 1) // block_size) * block_size; dest = aligned //
    block_size - 1; on when aligned >= R, dest >= 0, dest != col, then count = aligned - R + 1,
    and bblk > 0, bblk != blk; in torch: boundary() of onecard's tests/gdn_defer_oracle.py). All
    per-row tensors: 1-D on the device with >= num_rows entries (spec_mask bool, the others
    any int type); nothing is read on the host."""
    align = (num_computed, num_scheduled, num_draft)
    has_align = num_computed is not None
    if any((t is None) == has_align for t in align):
        raise ValueError("gdn_defer_commit_all: pass num_computed, num_scheduled and num_draft together, or none")
    if has_align and block_size <= 0:
        raise ValueError(f"gdn_defer_commit_all: block_size={block_size} must be > 0 with the boundary counts")
    if spec_mask.dtype != torch.bool:
        raise ValueError(f"gdn_defer_commit_all: spec_mask is {spec_mask.dtype}; bool expected")
    idx = {"spec_mask": spec_mask, "num_accepted": num_accepted}
    if running_col is not None:
        idx["running_col"] = running_col
    if has_align:
        idx.update(num_computed=num_computed, num_scheduled=num_scheduled, num_draft=num_draft)
    for name, t in idx.items():
        if t.ndim != 1 or t.shape[0] < num_rows:
            raise ValueError(f"gdn_defer_commit_all: {name} must be 1-D with >= num_rows={num_rows} entries, "
                             f"got {tuple(t.shape)}")
    if num_rows > plan.max_reqs:
        raise ValueError(f"gdn_defer_commit_all: num_rows={num_rows} exceeds the block tables' "
                         f"{plan.max_reqs} rows")
    if num_rows <= 0:
        return
    HV, V, K, H = plan.num_v_heads, plan.head_v_dim, plan.head_k_dim, plan.num_k_heads
    BK, BV, NV = _blocks(K, V)
    _gdn_defer_commit_all_kernel[(NV, num_rows * HV, plan.num_layers)](
        plan.state_addrs, plan.state_strides,
        plan.sk_addrs, plan.sv_addrs, plan.sg_addrs, plan.sb_addrs,
        plan.layer_group, plan.bt_addrs, plan.stride_bt_row,
        spec_mask, num_accepted,
        running_col if running_col is not None else num_accepted,
        num_computed if has_align else num_accepted,
        num_scheduled if has_align else num_accepted,
        num_draft if has_align else num_accepted,
        num_rows, plan.max_seqs, plan.max_tokens, block_size if has_align else 1,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, BLOCK_R=plan.block_r,
        STATE_DTYPE=_TL_DTYPES[plan.state_dtype], V_DTYPE=_TL_DTYPES[plan.v_dtype],
        HAS_COL=running_col is not None, ALIGN=has_align,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )
