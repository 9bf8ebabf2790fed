"""Test oracles for patch 0085's deferred GDN commit (onecard/kernels/gdn_defer*.py); not shipped.

Production runs ``gdn_defer_verify`` and the one-launch ``gdn_defer_commit_all``. The tests hold
those against second formulations that live here, so that none of them ships into vLLM:

* ``gdn_defer_commit``: the per-layer commit (its own Triton kernel, the running and boundary
  block ids given per row). Its kernel calls the same ``_replay_accepted`` helper as
  ``_gdn_defer_commit_all_kernel`` (imported from onecard.kernels.gdn_defer: a ``@triton.jit``
  function is callable from a kernel of any module that has it in its globals), so commit_all
  must equal it bitwise.
* ``boundary``: the prefix-cache boundary rule that ``_gdn_defer_commit_all_kernel`` applies
  row by row in its ``ALIGN`` branch, in torch (the two must stay identical).
* float64 references of the verify and of the commit (host loops).

Import it only after Triton's interpreter is decided (tests/interpret.py): it imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecard.kernels.gdn_defer import (  # noqa: F401  (_replay_accepted: called by the kernel below)
    _NUM_STAGES,
    _NUM_WARPS,
    DeferScratch,
    _blocks,
    _check_pool,
    _replay_accepted,
)
from onecard.kernels.gdn_defer_runtime import AlignInputs


# --------------------------------------------------------------------------------------------
# per-layer commit: replay the accepted tokens from the scratch onto the running block
# --------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_rows", "MAXS", "MAXT"])
def _gdn_defer_commit_kernel(
    state, s_k, s_v, s_g, s_beta,
    row_to_spec, num_accepted, running_block, boundary_count, boundary_block,
    num_rows, MAXS, MAXT,
    stride_blk,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_BOUNDARY: tl.constexpr,
):
    i_v, i_rh = tl.program_id(0), tl.program_id(1)
    i_r, i_hv = i_rh // HV, i_rh % HV
    i_h = i_hv // (HV // H)
    if i_r >= num_rows:
        return
    i_n = tl.load(row_to_spec + i_r).to(tl.int64)
    if (i_n < 0) | (i_n >= MAXS):
        return
    blk = tl.load(running_block + i_r).to(tl.int64)
    if blk <= 0:
        return
    n_acc = tl.minimum(tl.load(num_accepted + i_r).to(tl.int32), MAXT)
    if n_acc <= 0:
        return
    if HAS_BOUNDARY:
        bnd_cnt = tl.load(boundary_count + i_r).to(tl.int32)
        bnd_blk = tl.load(boundary_block + i_r).to(tl.int64)
        bnd_on = (bnd_blk > 0) & (bnd_blk != blk)
    else:
        bnd_cnt = 0
        bnd_blk = blk
        bnd_on = False

    _replay_accepted(state, stride_blk, blk, s_k, s_v, s_g, s_beta, i_n, i_v, i_h, i_hv, n_acc, MAXT,
                     bnd_on, bnd_cnt, bnd_blk, H, HV, K, V, BK, BV, HAS_BOUNDARY)


def gdn_defer_commit(
    state: torch.Tensor,
    scratch: DeferScratch,
    *,
    row_to_spec: torch.Tensor,
    num_accepted: torch.Tensor,
    running_block: torch.Tensor,
    num_rows: int,
    boundary_count: torch.Tensor | None = None,
    boundary_block: torch.Tensor | None = None,
) -> None:
    """For each row r < num_rows with n = row_to_spec[r] >= 0 and blk = running_block[r] > 0:
    state[blk] <- the state after the first num_accepted[r] tokens of spec sequence n, replayed
    from ``scratch`` (filled by the preceding ``gdn_defer_verify``) on top of state[blk]. With
    boundary_count/boundary_block, the state after boundary_count[r] tokens is also stored into
    state[boundary_block[r]] when 1 <= boundary_count[r] <= num_accepted[r] and
    boundary_block[r] > 0 and != blk. All index tensors: int32 [>= num_rows], on the device."""
    HV, V, K = scratch.num_v_heads, scratch.head_v_dim, scratch.head_k_dim
    H = scratch.num_k_heads
    _check_pool("state", state, HV, V, K)
    if (boundary_count is None) != (boundary_block is None):
        raise ValueError("gdn_defer_commit: pass both boundary_count and boundary_block, or neither")
    idx = {"row_to_spec": row_to_spec, "num_accepted": num_accepted, "running_block": running_block}
    if boundary_count is not None:
        idx.update(boundary_count=boundary_count, boundary_block=boundary_block)
    for name, t in idx.items():
        if t.ndim != 1 or t.shape[0] < num_rows:
            raise ValueError(f"gdn_defer_commit: {name} must be 1-D with >= num_rows={num_rows} entries, got {tuple(t.shape)}")
    if num_rows <= 0:
        return
    BK, BV, NV = _blocks(K, V)
    has_bnd = boundary_count is not None
    _gdn_defer_commit_kernel[(NV, num_rows * HV)](
        state, scratch.k, scratch.v, scratch.g, scratch.beta,
        row_to_spec, num_accepted, running_block,
        boundary_count if has_bnd else row_to_spec, boundary_block if has_bnd else row_to_spec,
        num_rows, scratch.max_seqs, scratch.max_tokens,
        state.stride(0),
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        HAS_BOUNDARY=has_bnd,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )


# --------------------------------------------------------------------------------------------
# the prefix-cache boundary rule of _gdn_defer_commit_all_kernel's ALIGN branch, in torch
# --------------------------------------------------------------------------------------------
def boundary(a: torch.Tensor, al: AlignInputs, num_reqs: int):
    """The rule gdn_defer_commit_all applies in its kernel, in torch (the tests hold the two
    equal). Per row: how many of the accepted tokens reach the first cache-block boundary inside the
    step's accepted run (0: none) and that block's column, by the rule of vLLM's fused mamba
    postprocess (v1/worker/mamba_utils.py): the state after exactly ``aligned`` tokens goes to
    column ``aligned // block_size - 1``. Rows whose boundary column is the running column
    get 0 (the final state is the boundary state)."""
    n = num_reqs
    running = al.num_computed[:n] + al.num_scheduled[:n] - al.num_draft[:n]  # tokens in the base state + 1
    new = running + a[:n] - 1
    aligned = (new // al.block_size) * al.block_size
    dest = aligned // al.block_size - 1
    src = al.state_idx[:n]
    needs = (aligned >= running) & (dest != src) & (dest >= 0)
    count = torch.where(needs, aligned - running + 1, torch.zeros_like(aligned)).to(torch.int32)
    col = torch.where(needs, dest, src).to(torch.int64)
    return count, col, needs


# --------------------------------------------------------------------------------------------
# float64 torch references (host loops)
# --------------------------------------------------------------------------------------------
def _ref_l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _ref_step(h, k_t, v_t, g_t, beta_t):
    """One delta-rule step in float64. h [HV, V, K], k_t [HV, K], v_t [HV, V], g_t/beta_t [HV]."""
    h = h * torch.exp(g_t)[:, None, None]
    vn = (v_t - torch.einsum("hvk,hk->hv", h, k_t)) * beta_t[:, None]
    return h + vn[:, :, None] * k_t[:, None, :]


def gdn_defer_reference_verify(
    A_log, a, b, dt_bias, q, k, v, *, initial_state, cu_seqlens, ssm_state_indices,
    scratch: DeferScratch | None = None, scale=None, use_qk_l2norm_in_kernel=True, beta=1.0,
    threshold=20.0, return_states: bool = False,
):
    """float64 reference of ``gdn_defer_verify``: returns o [1, T, HV, V] float64 (NaN rows for
    skipped sequences) and fills ``scratch`` (when given) the way the kernel does. With
    ``return_states``: (o, states), states[n] = float64 [T_n, HV, V, K], the state after each
    token (what the stock kernel stores in column t), or None for a skipped sequence."""
    _, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    g_rep = HV // H
    if scale is None:
        scale = K ** -0.5
    f64 = torch.float64
    qd, kd, vd = q[0].to(f64), k[0].to(f64), v[0].to(f64)
    ad, bd = a.reshape(T, HV).to(f64), b.reshape(T, HV).to(f64)
    x = ad + dt_bias.to(f64)
    sp = torch.where(beta * x <= threshold, (1.0 / beta) * torch.log(1 + torch.exp(beta * x)), x)
    gd = -torch.exp(A_log.to(f64)) * sp                        # [T, HV]
    betad = torch.sigmoid(bd)                                  # [T, HV]
    if use_qk_l2norm_in_kernel:
        qd, kd = _ref_l2norm(qd), _ref_l2norm(kd)
    qd = qd * scale
    o = torch.full((1, T, HV, V), float("nan"), dtype=f64)
    cu = [int(c) for c in cu_seqlens.tolist()]
    idx = ssm_state_indices.reshape(len(cu) - 1, -1)[:, 0].tolist()
    states = []
    for n in range(len(cu) - 1):
        bos, eos = cu[n], cu[n + 1]
        if eos == bos or idx[n] <= 0:
            states.append(None)
            continue
        h = initial_state[idx[n]].to(f64).cpu()
        hs = []
        for t in range(eos - bos):
            tok = bos + t
            k_t = kd[tok].repeat_interleave(g_rep, 0)
            h = _ref_step(h, k_t, vd[tok], gd[tok], betad[tok])
            o[0, tok] = torch.einsum("hvk,hk->hv", h, qd[tok].repeat_interleave(g_rep, 0))
            hs.append(h)
            if scratch is not None and t < scratch.max_tokens:
                scratch.k[n, t] = kd[tok].to(scratch.k.dtype)
                scratch.v[n, t] = v[0, tok].to(scratch.v.dtype)
                scratch.g[n, t] = gd[tok].to(torch.float32)
                scratch.beta[n, t] = betad[tok].to(torch.float32)
        states.append(torch.stack(hs))
    return (o, states) if return_states else o


def gdn_defer_reference_commit(
    state, scratch: DeferScratch, *, row_to_spec, num_accepted, running_block, num_rows: int,
    boundary_count=None, boundary_block=None,
) -> None:
    """float64 reference of ``gdn_defer_commit`` (reads the scratch, writes ``state`` in its dtype)."""
    g_rep = scratch.num_v_heads // scratch.num_k_heads
    f64 = torch.float64
    rows = row_to_spec.tolist()
    accs = num_accepted.tolist()
    blks = running_block.tolist()
    bcs = boundary_count.tolist() if boundary_count is not None else None
    bbs = boundary_block.tolist() if boundary_block is not None else None
    for r in range(num_rows):
        n, blk = rows[r], blks[r]
        if n < 0 or n >= scratch.max_seqs or blk <= 0:
            continue
        n_acc = min(accs[r], scratch.max_tokens)
        if n_acc <= 0:
            continue
        h = state[blk].to(f64)
        for t in range(n_acc):
            k_t = scratch.k[n, t].to(f64).repeat_interleave(g_rep, 0)
            h = _ref_step(h, k_t, scratch.v[n, t].to(f64), scratch.g[n, t].to(f64),
                          scratch.beta[n, t].to(f64))
            if bcs is not None and t + 1 == bcs[r] and bbs[r] > 0 and bbs[r] != blk:
                state[bbs[r]] = h.to(state.dtype)
        state[blk] = h.to(state.dtype)
