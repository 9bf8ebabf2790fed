# SPDX-License-Identifier: Apache-2.0
# onecard 0080 (DFlash2): the DFlash2 drafter for Qwen3-style targets.
"""DFlash2 drafter: DFlash (qwen3_dflash.py) plus the two-tap block convolutions around every
sublayer and the candidate selector's parameters (used by v1/spec_decode/dflash2.py).

Checkpoint format (architectures ["DFlash2DraftModel"]): the DFlash tensors plus, per layer,
``{attention,mlp}_conv.base_kernel`` [2, K, H] and ``{attention,mlp}_conv.kernel_projection
.weight`` [2*K*G, H] (G = H / conv_group_size), and ``candidate_selector.hidden_projection
.weight`` [R, H], ``candidate_selector.{predecessor,successor}_codebook`` [V, R].

Per layer: h = LN(x); (c_in, c_out) = base_kernel + kernel_projection(h) (dynamic part shared
by each group of conv_group_size channels); x += conv(attn(conv(h, c_in)), c_out); the same
around the MLP. conv(x, c)_t = sum_j c_{t,j} * x_{t-j}, inside one request's query block only:
the query rows of a request are contiguous (anchor + mask rows), ``block_rows`` per request.

Ring mode (ONECARD_DFLASH_RING=1, docs/dflash2-huge.md §3): every drafter attention layer is
built with the drafter's sliding window, an unquantized cache dtype ("auto": FlashAttention, the
target may be KVarN) and no KV-cache spec, so vLLM's pool leaves it out; the proposer
(v1/spec_decode/dflash2.py) gives it a private ring as its kv_cache. A drafter whose layers are
not all sliding-window is refused.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.v1.spec_decode.dflash2_lane import ring_mode_enabled, ring_window

from .qwen3_dflash import (
    DFlashQwen3DecoderLayer,
    DFlashQwen3ForCausalLM,
    DFlashQwen3Model,
)


@functools.cache
def ring_attention_class(cls: type) -> type:
    """``cls`` (vLLM's Attention) with no KV-cache spec: the runner skips layers whose spec is
    None (gpu_model_runner.get_kv_cache_spec), so the pool and its groups leave them out."""

    def get_kv_cache_spec(self, vllm_config):
        return None

    return type(f"DFlash2Ring{cls.__name__}", (cls,),
                {"get_kv_cache_spec": get_kv_cache_spec, "dflash2_ring": True})


def prepare_ring_drafter(hf_config) -> int:
    """Ring mode: check the drafter slides on every layer and make 0.27.1's per-layer rule
    (qwen3_dflash._resolve_layer_attention) give that window to every layer. Returns it."""
    window = ring_window(hf_config)
    dc = dict(getattr(hf_config, "dflash_config", None) or {})
    dc["use_swa"] = True
    dc["swa_window_size"] = window
    hf_config.dflash_config = dc
    return window


def ring_cache_config(cache_config):
    """A copy of the cache config whose dtype is "auto" (the model dtype, bf16): the drafter's
    attention takes FlashAttention whatever the target's KV cache is (KVarN, int8, fp8)."""
    if cache_config is None:
        return None
    cc = copy.copy(cache_config)
    cc.cache_dtype = "auto"
    cc.calculate_kv_scales = False
    return cc


# dflash2_draft_quant: vLLM's online FP8 of the drafter's linear layers, except the attention
# projections (matched with and without 0.27.1's qkv fusion): DFlashQwen3Model's context K/V
# precompute slices qkv_proj.weight and multiplies with it directly, which only a bf16 weight
# supports. Quantized: fc, o_proj, gate_up_proj, down_proj. The convs' kernel_projection and the
# selector's hidden_projection are built without a quant config and stay bf16 too.
DRAFT_QUANT_KEEP_BF16 = r"re:.*\.self_attn\.(qkv|q|k|v)_proj$"


def dflash2_draft_quant_config(vllm_config: VllmConfig):
    """The drafter's quant config: with dflash2_draft_quant, vLLM's online scheme of that name
    over a bf16 drafter (qkv_proj kept bf16); otherwise 0.27.1's own (get_draft_quant_config).
    Built here because 0.27.1's path cannot reach online quantization for a drafter: the draft
    ModelConfig carries a callable hf_overrides, which get_quant_config refuses."""
    from vllm.model_executor.models.utils import get_draft_quant_config

    spec = vllm_config.speculative_config
    scheme = getattr(spec, "dflash2_draft_quant", None)
    if scheme is None:
        return get_draft_quant_config(vllm_config)
    stored = spec.draft_model_config.quantization
    if stored is not None:
        raise ValueError(
            f"dflash2: dflash2_draft_quant={scheme!r} needs a bf16 drafter, but "
            f"{spec.model} is stored quantized ({stored}); valid: unset dflash2_draft_quant "
            "(DRAFT_QUANT=bf16) for this drafter"
        )
    from vllm.config.quantization import resolve_quantization_config
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig

    args = resolve_quantization_config(scheme, {"ignore": [DRAFT_QUANT_KEEP_BF16]})
    return OnlineQuantizationConfig(args)


def dflash2_query_rows(vllm_config: VllmConfig) -> int:
    """Query rows per request of one drafter pass: the anchor + min(k, block_size - 1)."""
    spec = vllm_config.speculative_config
    dc = getattr(spec.draft_model_config.hf_config, "dflash_config", None) or {}
    k = spec.num_speculative_tokens or (int(dc["block_size"]) - 1)
    return 1 + min(int(k), int(dc["block_size"]) - 1)


def block_conv(x: torch.Tensor, coeff: torch.Tensor, rows: int) -> torch.Tensor:
    """out[t] = sum_j coeff[t, j] * x[t - j], never across a block of ``rows`` rows.

    x: [N, H] (request-major blocks of ``rows`` rows; padding rows at the end are garbage in,
    garbage out); coeff: [N, K, H].
    """
    n, h = x.shape
    out = coeff[:, 0] * x
    taps = coeff.shape[1]
    if taps > 1:
        idx = torch.arange(n, device=x.device) % rows
        for j in range(1, taps):
            shifted = torch.cat([x.new_zeros(j, h), x], 0)[:n]
            keep = (idx >= j).unsqueeze(-1).to(x.dtype)
            out = out + coeff[:, j] * (shifted * keep)
    return out


class DFlash2BlockConv(nn.Module):
    def __init__(
        self, hidden_size: int, kernel: int, group_size: int, dtype: torch.dtype,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(
                f"dflash2: conv_group_size={group_size} does not divide "
                f"hidden_size={hidden_size}"
            )
        self.kernel = kernel
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(
            torch.zeros(2, kernel, hidden_size, dtype=dtype), requires_grad=False
        )
        self.kernel_projection = ReplicatedLinear(
            hidden_size, 2 * kernel * self.groups, bias=False, params_dtype=dtype,
            return_bias=False, prefix=f"{prefix}.kernel_projection",
        )

    def coefficients(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(input-conv, output-conv) coefficients, each [N, K, H], from the sublayer input."""
        n = h.shape[0]
        dyn = self.kernel_projection(h).view(n, 2, self.kernel, self.groups)
        dyn = dyn.repeat_interleave(self.group_size, dim=-1)
        coeff = self.base_kernel.unsqueeze(0).to(dyn.dtype) + dyn
        return coeff[:, 0], coeff[:, 1]


class DFlash2CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, rank: int, vocab_size: int, dtype: torch.dtype,
                 prefix: str = "") -> None:
        super().__init__()
        self.hidden_projection = ReplicatedLinear(
            hidden_size, rank, bias=False, params_dtype=dtype, return_bias=False,
            prefix=f"{prefix}.hidden_projection",
        )
        self.predecessor_codebook = nn.Parameter(
            torch.zeros(vocab_size, rank, dtype=dtype), requires_grad=False
        )
        self.successor_codebook = nn.Parameter(
            torch.zeros(vocab_size, rank, dtype=dtype), requires_grad=False
        )


class DFlash2DecoderLayer(DFlashQwen3DecoderLayer):
    def __init__(self, vllm_config: VllmConfig, *, config, layer_idx: int,
                 cache_config=None, quant_config=None, prefix: str = "") -> None:
        ring = ring_mode_enabled()
        if ring:
            cache_config = ring_cache_config(cache_config)
        super().__init__(vllm_config, config=config, layer_idx=layer_idx,
                         cache_config=cache_config, quant_config=quant_config,
                         prefix=prefix)
        if ring:
            attn = self.self_attn.attn
            attn.__class__ = ring_attention_class(type(attn))
        dc = config.dflash_config
        dtype = vllm_config.model_config.dtype
        h = config.hidden_size
        kernel, group = int(dc["conv_kernel_size"]), int(dc["conv_group_size"])
        self.attention_conv = DFlash2BlockConv(h, kernel, group, dtype,
                                               prefix=f"{prefix}.attention_conv")
        self.mlp_conv = DFlash2BlockConv(h, kernel, group, dtype, prefix=f"{prefix}.mlp_conv")
        self.block_rows = dflash2_query_rows(vllm_config)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.block_rows
        if residual is not None:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        else:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        c_in, c_out = self.attention_conv.coefficients(hidden_states)
        a = self.self_attn(positions=positions,
                           hidden_states=block_conv(hidden_states, c_in, rows))
        a = block_conv(a, c_out, rows)
        hidden_states, residual = self.post_attention_layernorm(a, residual)
        c_in, c_out = self.mlp_conv.coefficients(hidden_states)
        m = self.mlp(block_conv(hidden_states, c_in, rows))
        return block_conv(m, c_out, rows), residual


class DFlash2Qwen3Model(DFlashQwen3Model):
    decoder_layer_cls = DFlash2DecoderLayer
    draft_quant_config = staticmethod(dflash2_draft_quant_config)

    def __init__(self, *, vllm_config: VllmConfig, start_layer_id: int = 0,
                 prefix: str = "") -> None:
        if ring_mode_enabled():
            prepare_ring_drafter(vllm_config.speculative_config.draft_model_config.hf_config)
        super().__init__(vllm_config=vllm_config, start_layer_id=start_layer_id,
                         prefix=prefix)
        dc = self.config.dflash_config
        self.candidate_selector = DFlash2CandidateSelector(
            self.config.hidden_size, int(dc["selector_rank"]), self.config.vocab_size,
            vllm_config.model_config.dtype, prefix=f"{prefix}.candidate_selector",
        )


# Stored name prefixes seen on drafter checkpoints (onecard.dflash.config.PREFIXES): 0.27.1's
# DFlash loader prepends "model." to every name, so a prefixed checkpoint would not load
# ("no module or parameter named 'model'"); they are stripped first.
STORED_PREFIXES = ("model.", "dflash.")


def strip_stored_prefix(name: str) -> str:
    for pre in STORED_PREFIXES:
        if name.startswith(pre):
            return name[len(pre):]
    return name


class DFlash2Qwen3ForCausalLM(DFlashQwen3ForCausalLM):
    model_cls = DFlash2Qwen3Model

    def load_weights(self, weights):
        return super().load_weights((strip_stored_prefix(n), w) for n, w in weights)

    @property
    def candidate_selector(self) -> DFlash2CandidateSelector:
        return self.model.candidate_selector
