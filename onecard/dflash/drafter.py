"""The DFlash / DFlash2 drafter forward in plain torch: one request, one block, no cache.

This is the reference the vLLM model class is checked against (docs/dflash2.md, "Drafter
forward"). It is written for reading and for float64 tests, not for speed.

One pass drafts ``block_size - 1`` tokens. Inputs:

- ``target_hidden`` [C, len(target_layer_ids) * target_hidden]: for each context position
  (every token before the anchor), the OUTPUTS of the target decoder layers in
  ``target_layer_ids``, concatenated in that order;
- ``block_ids`` [B]: the anchor token (the last token the target emitted, not yet run through
  the target) followed by ``B - 1`` copies of ``mask_token_id``;
- ``block_start``: the anchor's position (= C when the context is the whole sequence);
- the target's ``embed`` and ``lm_head`` matrices (the drafter has neither of its own).

Per layer (Qwen3-style pre-norm block, plain ``w * x / rms`` RMSNorm)::

    h = input_layernorm(x); [v2: h = conv_in(h)]; a = attn(h); [v2: a = conv_out(a)]; x += a
    h = post_attention_layernorm(x); [v2: h = conv_in(h)]; m = mlp(h); [v2: m = conv_out(m)]; x += m

Attention: queries are the B block rows; keys/values are the context features
``hidden_norm(fc(target_hidden))`` projected by this layer's k_proj/v_proj (k_norm, RoPE at the
context positions) followed by the block rows' own keys/values. Inside the block attention is
non-causal (every row sees every row); a sliding layer hides keys with ``q_pos - k_pos >= window``.
The output is ``norm(x)``; logits of rows 1..B-1 are ``lm_head`` of those rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from onecard.dflash.config import PREFIXES, SLIDING, DrafterConfig, check_layout, tensor_shapes  # noqa: F401


# --------------------------------------------------------------------------- checkpoint layout

# tensor_shapes / PREFIXES / check_layout live in onecard.dflash.config (no torch there: the
# memory model and `onecard prepare drafter` check safetensors headers with them).


def load_weights(path: str | Path, cfg: DrafterConfig, *, dtype: torch.dtype | None = None
                 ) -> dict[str, torch.Tensor]:
    """Read ``*.safetensors`` of a drafter dir; check names and shapes (one-line errors).

    Extra ``embed_tokens`` / ``lm_head`` tensors are allowed and kept (some drafters ship them);
    any other unknown tensor is an error, so a format we do not implement is not half-loaded.
    """
    from safetensors.torch import load_file

    from onecard.dflash.config import DrafterConfigError

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise DrafterConfigError(f"dflash drafter: no *.safetensors in {path}")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw.update(load_file(str(f)))
    keys = check_layout({name: tuple(t.shape) for name, t in raw.items()}, cfg)
    return {keys[name]: (t.to(dtype) if dtype is not None else t) for name, t in raw.items() if name in keys}


# --------------------------------------------------------------------------- pieces

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding over the whole head dim. x: [T, heads, d]; pos: [T]."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]                      # [T, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def block_conv(x: torch.Tensor, coeff: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv over the block rows: out[t] = sum_j coeff[t, j] * x[t - j].

    x: [B, H]; coeff: [B, K, H]. Rows before the block are zero (the conv never crosses a
    block boundary, and is stateless across drafter passes).
    """
    out = torch.zeros_like(x)
    for j in range(coeff.shape[1]):
        shifted = x if j == 0 else torch.cat([x.new_zeros(j, x.shape[1]), x[:-j]], 0)
        out = out + coeff[:, j] * shifted
    return out


def conv_coefficients(w: dict[str, torch.Tensor], name: str, h: torch.Tensor,
                      cfg: DrafterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(input-conv, output-conv) coefficients [B, K, H] from the sublayer input ``h``.

    base_kernel [2, K, H] is shared by all positions; kernel_projection(h) gives, per row, a
    dynamic part [2, K, G] shared by the ``conv_group_size`` channels of each group.
    """
    b = h.shape[0]
    k, g = cfg.conv_kernel_size, cfg.conv_groups
    dyn = (h @ w[f"{name}.kernel_projection.weight"].T).view(b, 2, k, g)
    dyn = dyn.repeat_interleave(cfg.conv_group_size, dim=-1)                  # [B, 2, K, H]
    coeff = w[f"{name}.base_kernel"][None] + dyn
    return coeff[:, 0], coeff[:, 1]


def attention(cfg: DrafterConfig, w: dict[str, torch.Tensor], i: int, h: torch.Tensor,
              ctx: torch.Tensor, ctx_pos: torch.Tensor, blk_pos: torch.Tensor) -> torch.Tensor:
    p = f"layers.{i}.self_attn."
    hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    eps = cfg.rms_norm_eps
    q = rms_norm((h @ w[p + "q_proj.weight"].T).view(-1, nh, hd), w[p + "q_norm.weight"], eps)
    kv_in = torch.cat([ctx, h], 0)
    kv_pos = torch.cat([ctx_pos, blk_pos], 0)
    k = rms_norm((kv_in @ w[p + "k_proj.weight"].T).view(-1, nkv, hd), w[p + "k_norm.weight"], eps)
    v = (kv_in @ w[p + "v_proj.weight"].T).view(-1, nkv, hd)
    q, k = rope(q, blk_pos, cfg.rope_theta), rope(k, kv_pos, cfg.rope_theta)
    rep = nh // nkv
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    visible = torch.ones(len(blk_pos), len(kv_pos), dtype=torch.bool)
    if cfg.layer_types[i] == SLIDING:
        visible &= (blk_pos[:, None] - kv_pos[None, :]) < cfg.sliding_window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(blk_pos), nh * hd)
    return out @ w[p + "o_proj.weight"].T


def mlp(w: dict[str, torch.Tensor], i: int, h: torch.Tensor) -> torch.Tensor:
    p = f"layers.{i}.mlp."
    gate = torch.nn.functional.silu(h @ w[p + "gate_proj.weight"].T)
    return (gate * (h @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T


# --------------------------------------------------------------------------- forward

@dataclass
class DraftPass:
    hidden: torch.Tensor   # [B, H] final-normed rows (row 0 = anchor)
    logits: torch.Tensor   # [B - 1, V] unary logits of the mask rows (positions start+1..)


def context_features(cfg: DrafterConfig, w: dict[str, torch.Tensor],
                     target_hidden: torch.Tensor) -> torch.Tensor:
    """hidden_norm(fc(concat of captured target layers)) — what vLLM turns into context K/V."""
    return rms_norm(target_hidden @ w["fc.weight"].T, w["hidden_norm.weight"], cfg.rms_norm_eps)


def forward(cfg: DrafterConfig, w: dict[str, torch.Tensor], *, target_hidden: torch.Tensor,
            block_ids: torch.Tensor, block_start: int, embed: torch.Tensor,
            lm_head: torch.Tensor, context_positions: torch.Tensor | None = None) -> DraftPass:
    """One drafter pass for one request (see the module docstring)."""
    b = block_ids.shape[0]
    if b < 2 or b > cfg.block_size:
        raise ValueError(f"block of {b} rows; valid: 2..{cfg.block_size}")
    if target_hidden.ndim != 2 or target_hidden.shape[1] != cfg.fc_in:
        raise ValueError(f"target_hidden {tuple(target_hidden.shape)}; valid: [C, {cfg.fc_in}]")
    c = target_hidden.shape[0]
    ctx_pos = (torch.arange(c) if context_positions is None else context_positions).long()
    if c and int(ctx_pos.max()) >= block_start:
        raise ValueError("context positions must precede the block")
    blk_pos = block_start + torch.arange(b)
    eps = cfg.rms_norm_eps
    ctx = context_features(cfg, w, target_hidden)
    x = embed[block_ids]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        if cfg.version == 2:
            c_in, c_out = conv_coefficients(w, p + "attention_conv", h, cfg)
            h = block_conv(h, c_in)
        a = attention(cfg, w, i, h, ctx, ctx_pos, blk_pos)
        x = x + (block_conv(a, c_out) if cfg.version == 2 else a)
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        if cfg.version == 2:
            c_in, c_out = conv_coefficients(w, p + "mlp_conv", h, cfg)
            h = block_conv(h, c_in)
        m = mlp(w, i, h)
        x = x + (block_conv(m, c_out) if cfg.version == 2 else m)
    hidden = rms_norm(x, w["norm.weight"], eps)
    return DraftPass(hidden=hidden, logits=hidden[1:] @ lm_head.T)


def block_ids_for(cfg: DrafterConfig, anchor: int, rows: int | None = None) -> torch.Tensor:
    """[anchor, mask, mask, ...] of ``rows`` (default block_size) rows."""
    rows = cfg.block_size if rows is None else rows
    ids = torch.full((rows,), cfg.mask_token_id, dtype=torch.long)
    ids[0] = anchor
    return ids
