"""The VRAM model: how vLLM 0.27.1 sizes the KV pool of a hybrid (attention + GDN) model.

Pure functions, no torch, no vLLM, no GPU. Everything below mirrors the 0.27.1 source:

* Attention page (``vllm/v1/kv_cache_interface.py``, ``AttentionSpec``): per token per layer
  ``2 * kv_heads * head_dim' * elem`` with ``head_dim' = head_dim // 2`` for
  ``int4_per_token_head`` (uint8, two nibbles a byte) and ``elem = 1`` for
  ``int8_per_token_head`` (int8); both per-token-head modes add ``2 * kv_heads * 4`` bytes
  of float32 scales (one K and one V scale per token per head), carved from the same pool.
* GDN state page (``mamba_utils.gated_delta_net_state_shape``): conv state
  ``(2*16*128 + 48*128) x (conv_kernel - 1 + k)`` plus temporal state ``48 x 128 x 128``,
  both in the model dtype unless ``--mamba-ssm-cache-dtype`` says otherwise; ``k`` is the
  number of speculative tokens (the conv window grows with k).
* Page unification (``platforms/interface.py::_align_hybrid_block_size``): the attention block
  size becomes ``16 * cdiv(gdn_page, 16 * attn_bytes_1_token)`` (16 = the kernel alignment of
  FLASH_ATTN / TRITON_ATTN) and the GDN page is padded up to the attention page.
* Grouping (``kv_cache_utils._get_kv_cache_groups_uniform_page_size``): 16 full-attention
  layers (+1 when the MTP drafter's attention layer shares the pool) and 48 GDN layers;
  group size = the smaller count, so GDN layers form ``cdiv(48, group)`` groups.
  ``num_blocks = kv_mem // page // group_size``.
* The logged figure (``get_kv_cache_configs``: "GPU KV cache size: N tokens") is
  ``int(num_blocks / blocks_per_request * max_model_len)`` where blocks_per_request sums
  ``cdiv(max_len, block)`` for attention and ``(1 + k)`` (mode none) or ``(2 + k)``
  (mode align, i.e. prefix caching) per GDN group. So the pool figure depends on max_len.
  With GDN_DEFER=1 (a onecard patch, ONECARD_GDN_DEFER) the ``+ k`` per-draft states are not kept:
  ``1`` or ``2`` per GDN group (``predict_pool(gdn_defer=True)``); its verify scratch sits outside
  the pool (``gdn_defer_scratch_bytes``).

GDN recurrent-state dtype: vLLM's Qwen3.5 hook (models/config.py) sets
``mamba_ssm_cache_dtype`` from the checkpoint's ``mamba_ssm_dtype`` (float32 in Qwen3.5
configs), so ``QWEN38_27B`` uses a 4-byte state and ``ModelGeometry.from_config`` reads it.
The public 3090 figures, however, fit a bf16 state (``PUBLIC_3090``): with it all three agree
(136,429 / 266,520 within one block, 13,734 tok/GiB vs ~13,700), with fp32 the per-GiB figure
would read ~12,500 (-9%). So the public runs most likely had a bf16 SSM state, and their pins
are inferred under that geometry. Booting the same pin on a float32-state checkpoint gives a
smaller pool; the plan predicts that from the checkpoint's own config.

KV_MEM pins inferred (the public runs publish pool sizes, not pins). Each is the smallest whole
MiB whose predicted pool under ``PUBLIC_3090`` with MTP and prefix caching is >= the figure:
* long (int8_per_token_head, 131,072, MTP k=3): ``LONG_KV_MEM`` (136,429 tokens).
* single-user int4 (256,000, MTP k=3, one seat): ``INT4_KV_MEM`` (266,520 tokens).
* fast (bf16, 65,536, MTP k=4): ``FAST_KV_MEM`` from the top of the 68,605-72,992 range;
  ``FAST_DFLASH_KV_MEM`` (k=7) from its bottom (the wider conv window of k=7 costs blocks).
The bf16 per-GiB figure is not a pure 16-layer count (16,384 tok/GiB): the MTP layer's KV, the
GDN blocks each request holds and the block rounding take ~16% of it.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

GiB = 1024**3
MiB = 1024**2
KERNEL_BLOCK_ALIGN = 16  # FLASH_ATTN and TRITON_ATTN: MultipleOf(16)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ModelGeometry:
    """What the KV model needs from a Qwen3.5-style hybrid config."""

    num_layers: int = 64
    num_full_attention: int = 16
    num_kv_heads: int = 4
    head_dim: int = 256
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 48
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    conv_kernel: int = 4
    mtp_layers: int = 1
    dtype_bytes: int = 2  # bf16 weights/activations (and the GDN conv state)
    ssm_state_bytes: int = 4  # GDN recurrent state: config mamba_ssm_dtype (Qwen3.5: float32)
    num_attention_heads: int = 24  # query heads (tensor parallel must divide them too)
    # The longest max_model_len vLLM accepts for this checkpoint without
    # VLLM_ALLOW_LONG_MAX_MODEL_LEN (config_max_len); None: not known (the built-in geometry, or
    # a config naming no length). Not part of the KV model, so not compared.
    max_model_len: int | None = field(default=None, compare=False)
    max_model_len_source: str = field(default="", compare=False)  # e.g. "max_position_embeddings=32768"

    @property
    def num_gdn(self) -> int:
        return self.num_layers - self.num_full_attention

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelGeometry":
        """Read a HF config.json dict (top level or nested ``text_config``)."""
        text = cfg.get("text_config", cfg)
        limit, limit_src = config_max_len(cfg)
        try:
            n = int(text["num_hidden_layers"])
            types = text.get("layer_types")
            if types:
                full = sum(1 for t in types[:n] if t == "full_attention")
            else:
                full = n // int(text.get("full_attention_interval", 4))
            dt = str(text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
            ssm = str(text.get("mamba_ssm_dtype") or dt)
            return cls(
                num_layers=n,
                num_full_attention=full,
                num_kv_heads=int(text["num_key_value_heads"]),
                head_dim=int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]),
                linear_num_key_heads=int(text["linear_num_key_heads"]),
                linear_num_value_heads=int(text["linear_num_value_heads"]),
                linear_key_head_dim=int(text["linear_key_head_dim"]),
                linear_value_head_dim=int(text["linear_value_head_dim"]),
                conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
                mtp_layers=int(text.get("mtp_num_hidden_layers", 0)),
                dtype_bytes=4 if "32" in dt else 2,
                ssm_state_bytes=4 if "32" in ssm else 2,
                num_attention_heads=int(text.get("num_attention_heads") or cls.num_attention_heads),
                max_model_len=limit,
                max_model_len_source=limit_src,
            )
        except KeyError as e:
            raise ValueError(f"config is not a Qwen3.5 hybrid config: missing {e.args[0]!r}") from None

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike) -> "ModelGeometry":
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ValueError(f"no config.json in {path}")
        return cls.from_config(json.loads(p.read_text()))


# The keys vLLM 0.27.1 reads for a model's length (transformers_utils/model_arch_config_convertor.py,
# derive_max_model_len_and_key): the smallest of these in the text config wins.
MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")


def config_max_len(cfg: dict) -> tuple[int | None, str]:
    """(the longest --max-model-len vLLM 0.27.1 accepts without VLLM_ALLOW_LONG_MAX_MODEL_LEN, which
    config field says so); (None, "") when the config names no length (vLLM then uses the
    transformers class default, not modelled here).

    Mirrors config/model.py ``_get_and_verify_max_len`` for a generative model: the smallest of
    ``MAX_LEN_KEYS`` in the text config (``text_config`` when present, else the top level), replaced
    by ``model_max_length`` when the config sets it; times the RoPE scaling ``factor`` of
    ``rope_parameters`` (legacy ``rope_scaling``) unless the rope type is default/su/longrope/llama3
    (no factor) or the model is Gemma3, with ``yarn`` starting from ``original_max_position_embeddings``;
    a user length above that is still accepted up to ``model_max_length``. tokenizer_config.json's
    ``model_max_length`` is read by vLLM only for pooling models, so not here."""
    text = cfg.get("text_config") or cfg
    derived, key = float("inf"), None
    for k in MAX_LEN_KEYS:
        v = text.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < derived:
            derived, key = v, k
    mml = text.get("model_max_length")
    if isinstance(mml, (int, float)) and not isinstance(mml, bool) and mml:
        derived, key = mml, "model_max_length"
    if key is None:
        return None, ""
    src = f"{key}={int(derived)}"
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if isinstance(rope, dict) and rope and "gemma3" not in str(text.get("model_type", "")):
        nested = all(isinstance(v, dict) for v in rope.values())
        factor = 1.0
        for rp in (rope.values() if nested else [rope]):
            rtype = rp.get("rope_type") or rp.get("type") or "default"
            if rtype not in ("su", "longrope", "llama3"):
                factor = rp.get("factor", factor)
                if rtype == "yarn" and rp.get("original_max_position_embeddings"):
                    derived = rp["original_max_position_embeddings"]
                    src = f"original_max_position_embeddings={int(derived)}"
        factor = 1.0 if factor is None else float(factor)
        if factor != 1.0:
            derived *= factor
            src += f" x rope factor {factor:g}"
    limit = int(derived)
    if isinstance(mml, (int, float)) and not isinstance(mml, bool) and mml > limit:
        limit, src = int(mml), f"model_max_length={int(mml)}"
    return limit, src


QWEN38_27B = ModelGeometry()
# The geometry the public 3090 figures fit: GDN recurrent state in bf16 (see module docstring).
PUBLIC_3090 = ModelGeometry(ssm_state_bytes=2)


@dataclass(frozen=True)
class KVDtype:
    """Byte layout of one token of one attention layer's K+V for a --kv-cache-dtype."""

    name: str  # the value passed to --kv-cache-dtype (kvarn_* dtypes come from the kvarn patch)
    elem_bytes: int
    head_divisor: int  # int4 packs two values a byte
    scale_bytes_per_head: int  # K and V scales per token per head, budgeted in the pool
    note: str

    def bytes_per_token_layer(self, num_kv_heads: int, head_dim: int) -> int:
        return num_kv_heads * (2 * (head_dim // self.head_divisor) * self.elem_bytes + self.scale_bytes_per_head)


KV_DTYPES: dict[str, KVDtype] = {
    "bf16": KVDtype("auto", 2, 1, 0, "model dtype (bf16), no scales"),
    "fp8": KVDtype("fp8", 1, 1, 0, "fp8 e4m3, per-tensor scale"),
    "int8_per_token_head": KVDtype("int8_per_token_head", 1, 1, 8, "int8 + fp32 K/V scale per token-head"),
    "int4_per_token_head": KVDtype("int4_per_token_head", 1, 2, 8, "uint8 2xint4 (RHT, asym zp) + fp32 K/V scale per token-head"),
    # KVarN (issue 9): 4-bit K, 2-bit V in tiles of 128 tokens with fp16 scales, zero points
    # and normalizers; bytes per token come from onecard.kvarn.format (attn_bytes_per_token).
    # The fp16 stage (kvarn.stage: 3 * MAX_SEQS + 4 slots of one tile per layer) is outside
    # this per-token figure (~5 MiB per layer at MAX_SEQS 2, taken from outside the KV pin).
    "kvarn": KVDtype("kvarn_k4v2_g128", 1, 1, 0, "KVarN k4v2_g128 (onecard.kvarn.format)"),
}


def kvarn_preset(kv: str):
    """The KVarN preset (onecard.kvarn.format.Preset) of a plan's KV: "kvarn" is the default
    preset, "kvarn_<preset>" names one; None for every other KV."""
    if kv != "kvarn" and not kv.startswith("kvarn_"):
        return None
    from onecard.kvarn import format as kvarn_format

    return kvarn_format.get_preset(kv if kv != "kvarn" else None)


def kv_cache_dtype_arg(kv: str) -> str | None:
    """The --kv-cache-dtype value of a plan's KV ("kvarn" is the default preset's dtype, a
    "kvarn_<preset>" is passed as it is once the preset is known); None for the model's dtype."""
    if (p := kvarn_preset(kv)) is not None:
        return "kvarn_" + p.name
    d = KV_DTYPES.get(kv)
    return None if d is None or d.name == "auto" else d.name


def attn_bytes_per_token(geom: ModelGeometry, kv: str) -> int:
    """Bytes one token occupies in ONE attention layer."""
    if (p := kvarn_preset(kv)) is not None:
        from onecard.kvarn import format as kvarn_format

        return kvarn_format.bytes_per_token_layer(geom.num_kv_heads, geom.head_dim, p)
    if kv not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {kv!r}; valid: {', '.join(KV_DTYPES)}")
    return KV_DTYPES[kv].bytes_per_token_layer(geom.num_kv_heads, geom.head_dim)


def kvarn_stage_bytes(geom: ModelGeometry, kv: str, max_seqs: int, attn_layers: int | None = None,
                      window: int | None = None, sinks: int | None = None) -> int:
    """VRAM of the KVarN fp16 stage outside the KV pin: per attention layer (+1 for MTP by
    default) ``stage.default_num_slots(max_seqs, window, sinks)`` slots of one tile of K and V
    (``7 * max_seqs + 4`` at the default fp16 window 3 + two sink tiles, ``5 * max_seqs + 4`` at
    window 2 and one sink tile, ``3 * max_seqs + 4`` at window 1 and one sink)."""
    from onecard.kvarn import format as kvarn_format
    from onecard.kvarn.stage import default_num_slots

    window = kvarn_format.DEFAULT_WINDOW if window is None else int(window)
    sinks = kvarn_format.DEFAULT_SINKS if sinks is None else int(sinks)

    p = kvarn_format.get_preset(kv if kv != "kvarn" else None)
    layers = attn_layers if attn_layers is not None else geom.num_full_attention + geom.mtp_layers
    slot = p.tile * geom.num_kv_heads * geom.head_dim * 2 * 2
    return layers * default_num_slots(max_seqs, window, sinks) * slot


def kvarn_prefill_scratch_bytes(geom: ModelGeometry) -> int:
    """VRAM of the KVarN prefill path outside the KV pin, once per process (layers run one
    after another): the fp16 K/V window (16k keys) + the fp16 queries and fp32 state of one
    2048-query group (onecard.kvarn.format.prefill_scratch_bytes; ~136 MiB for the 27B)."""
    from onecard.kvarn import format as kvarn_format

    return kvarn_format.prefill_scratch_bytes(geom.num_attention_heads, geom.num_kv_heads, geom.head_dim)


def kvarn_reserve_bytes(geom: ModelGeometry, kv: str, max_seqs: int, attn_layers: int | None = None,
                        window: int | None = None, sinks: int | None = None) -> int:
    """Everything KVarN takes outside the KV pin: the fp16 stage (per layer and slot; layers as
    kvarn_stage_bytes) + the prefill scratch (once per process)."""
    return (kvarn_stage_bytes(geom, kv, max_seqs, attn_layers, window, sinks)
            + kvarn_prefill_scratch_bytes(geom))


def gdn_state_bytes(geom: ModelGeometry, num_spec: int = 0, ssm_state_bytes: int | None = None) -> int:
    """One GDN layer's state page (conv + recurrent) for one sequence slot."""
    conv_dim = geom.linear_key_head_dim * geom.linear_num_key_heads * 2 + geom.linear_value_head_dim * geom.linear_num_value_heads
    conv = conv_dim * (geom.conv_kernel - 1 + num_spec) * geom.dtype_bytes
    ssm = geom.linear_num_value_heads * geom.linear_value_head_dim * geom.linear_key_head_dim
    return conv + ssm * (ssm_state_bytes or geom.ssm_state_bytes)


def attention_block_size(geom: ModelGeometry, kv: str, num_spec: int = 0, ssm_state_bytes: int | None = None) -> int:
    """Tokens per attention block after vLLM raises it so one page holds a GDN state."""
    per_tok = attn_bytes_per_token(geom, kv)
    align = KERNEL_BLOCK_ALIGN
    if (p := kvarn_preset(kv)) is not None:
        # a page = whole tiles; the KVARN backend asks vLLM for multiples of 128 (its largest
        # tile) for every preset (kvarn/vllm/kvarn_attn.py PAGE_ALIGN)
        align = max(128, p.tile)
    return align * cdiv(gdn_state_bytes(geom, num_spec, ssm_state_bytes), align * per_tok)


# The published 27B DFlash2 drafter's shape (see dflash_drafter_vram below): parameters, attention
# layers and their KV heads x head size.
DFLASH2_27B_PARAMS = 1_924_404_480
DFLASH2_27B_LAYERS = 5
DFLASH2_27B_KV_HEADS = 8
DFLASH2_27B_HEAD_DIM = 128
# ... and what DRAFT_QUANT=fp8 quantizes of it (drafter_fp8_linears): hidden, query heads x head
# size, MLP width, the fc's input (5 target layers x hidden)
DFLASH2_27B_HIDDEN = 5120
DFLASH2_27B_Q_WIDTH = 32 * 128
DFLASH2_27B_INTERMEDIATE = 17408
DFLASH2_27B_FC_IN = 5 * 5120
DFLASH2_27B_VOCAB = 248_320


@dataclass
class PoolPrediction:
    kv: str
    max_len: int
    num_spec: int
    prefix_cache: bool
    kv_mem_bytes: int
    block_size: int
    page_bytes: int
    group_size: int
    gdn_groups: int
    num_blocks: int
    blocks_per_request: int
    pool_tokens: int  # what vLLM logs as "GPU KV cache size: N tokens"
    max_concurrency: float  # "Maximum concurrency for max_len tokens per request"
    state_slots_per_seq: int = field(default=0)
    # (KV-cache groups, tokens per block) per attention bucket: one sequence of L tokens takes
    # groups x cdiv(L, block) blocks of each
    attn_groups: tuple[tuple[int, int], ...] = field(default=())

    def as_dict(self) -> dict:
        return asdict(self)

    def one_sequence_tokens(self, chunk: int | None = None, lookahead: int = 0) -> int:
        """The longest sequence the pool holds alone: what vLLM's start-up check
        (_check_enough_kv_cache_memory) allows as max_model_len, at block granularity.

        ``chunk`` (the prefill chunk, --max-num-batched-tokens): the longest that also RUNS alone
        without vLLM preempting it, under async scheduling (vLLM's default). Three terms the start-up
        check leaves out (vLLM 0.27.1's own AsyncScheduler / KVCacheManager on the CPU, 2026-12-05,
        tests/test_memory_running.py): the block pool's null block; one more state block per GDN group
        while a step is in flight (the previous, the current and the next state: 3, not 2, when a
        block fits in one chunk); and ``lookahead`` slots (the speculative tokens a step reserves:
        k for MTP, k + 1 for DFlash2) past the sequence's last token."""
        free = self.num_blocks - self.state_slots_per_seq
        if chunk is not None:
            free -= 1 + (self.gdn_groups if self.block_size <= chunk else 0)
        groups = self.attn_groups or ((1, self.block_size),)
        if free <= 0:
            return 0
        per_step = sum(g for g, _ in groups)  # blocks per block_size step when all blocks are equal
        if all(b == self.block_size for _, b in groups):
            return max(free // per_step * self.block_size - lookahead, 0)
        lo, hi = 0, free * max(b for _, b in groups)
        while lo < hi:  # largest L with sum g * cdiv(L + lookahead, b) <= free
            mid = (lo + hi + 1) // 2
            if sum(g * cdiv(mid + lookahead, b) for g, b in groups) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo


def predict_pool(
    geom: ModelGeometry,
    kv_mem_bytes: int,
    kv: str,
    max_len: int,
    num_spec: int = 0,
    prefix_cache: bool = False,
    mtp_in_pool: bool | None = None,
    ssm_state_bytes: int | None = None,
    draft_attn_layers: int = 0,
    draft_kv_heads: int = DFLASH2_27B_KV_HEADS,
    draft_head_dim: int = DFLASH2_27B_HEAD_DIM,
    gdn_defer: bool = False,
) -> PoolPrediction:
    """Predict the pool vLLM 0.27.1 builds from ``kv_mem_bytes`` (the --kv-cache-memory pin).
    ``draft_attn_layers``: a separate drafter's attention layers sharing the pool (DFlash2:
    dflash_drafter_vram), with ``draft_kv_heads`` x ``draft_head_dim`` per layer (the published
    27B drafter's 8 x 128 by default).

    ``gdn_defer`` (GDN_DEFER=1, ONECARD_GDN_DEFER): the verify step keeps no GDN state per draft
    position (the accepted state is committed after the rejection sampler), so a sequence holds
    ``(2 if prefix_cache else 1)`` state blocks per GDN group instead of ``+ num_spec`` more. The
    block size is unchanged (the conv state keeps its ``+ num_spec`` width); the verify scratch it
    needs instead lives outside the pool (gdn_defer_scratch_bytes).

    How vLLM lays the pool out (v1/core/kv_cache_utils.py, 0.27.1): layers are bucketed by
    attention spec; FullAttentionSpec.merge requires equal KV heads and head size, so the MTP
    layer (the target's own shape) joins the target's attention bucket while a drafter of
    another shape (8 x 128 against 4 x 256) forms a bucket of its own. One group size for all
    buckets (``_get_kv_cache_groups_uniform_page_size``): the smallest bucket, or the largest when
    it is < 1.5x the smallest; every bucket is padded to whole groups ("Add N padding layers").
    Pages are unified to the largest (unify_kv_cache_spec_page_size): a smaller attention page
    that divides it gets a larger block, otherwise it is padded, as the GDN page is. Measured on
    the H200 (2026-12-03, 27B geometry, int8 KV, DFlash2 k=7 / k=15): 69,090 / 37,046 tokens,
    predicted exactly; the earlier model (drafter layers in the target's bucket) said 72,282
    and let a MAX_LEN through that vLLM refused."""
    if max_len <= 0 or kv_mem_bytes < 0:
        raise ValueError("max_len must be > 0 and kv_mem_bytes >= 0")
    if mtp_in_pool is None:
        mtp_in_pool = num_spec > 0 and geom.mtp_layers > 0
    block = attention_block_size(geom, kv, num_spec, ssm_state_bytes)
    target_page = block * attn_bytes_per_token(geom, kv)
    n_target = geom.num_full_attention + (geom.mtp_layers if mtp_in_pool else 0)
    n_gdn = geom.num_gdn
    # (layers, page bytes at the common block size) per attention bucket
    buckets = [(n_target, target_page)]
    if draft_attn_layers > 0:
        if (draft_kv_heads, draft_head_dim) == (geom.num_kv_heads, geom.head_dim):
            buckets = [(n_target + draft_attn_layers, target_page)]
        else:
            dgeom = replace(geom, num_kv_heads=draft_kv_heads, head_dim=draft_head_dim)
            buckets.append((draft_attn_layers, block * attn_bytes_per_token(dgeom, kv)))
    sizes = [n for n, _ in buckets] + [n_gdn]
    small, large = min(sizes), max(sizes)
    group = large if large < small * 1.5 else small
    page = max(pg for _, pg in buckets)
    gdn_groups = cdiv(n_gdn, group)
    attn_groups = []
    for n, pg in buckets:
        # a page that divides the largest gets a proportionally larger block; else it is padded
        attn_groups.append((cdiv(n, group), block * (page // pg) if page % pg == 0 else block))
    attn_blocks = sum(g * cdiv(max_len, blk) for g, blk in attn_groups)
    num_blocks = max(int(kv_mem_bytes // page // group), 0)
    per_gdn_group = gdn_state_blocks_per_group(num_spec, prefix_cache, gdn_defer)
    bpr = attn_blocks + gdn_groups * per_gdn_group
    conc = num_blocks / bpr
    return PoolPrediction(
        kv=kv, max_len=max_len, num_spec=num_spec, prefix_cache=prefix_cache, kv_mem_bytes=kv_mem_bytes,
        block_size=block, page_bytes=page, group_size=group, gdn_groups=gdn_groups, num_blocks=num_blocks,
        blocks_per_request=bpr, pool_tokens=int(conc * max_len), max_concurrency=conc,
        state_slots_per_seq=gdn_groups * per_gdn_group, attn_groups=tuple(attn_groups),
    )


def gdn_state_blocks_per_group(num_spec: int = 0, prefix_cache: bool = False, gdn_defer: bool = False) -> int:
    """GDN state blocks one resident sequence holds in each GDN KV-cache group: 1 (mode none) or
    2 (mode align, prefix caching), + one per draft position unless ``gdn_defer`` (GDN_DEFER=1)."""
    return (2 if prefix_cache else 1) + (0 if gdn_defer else num_spec)


def gdn_defer_scratch_bytes(geom: ModelGeometry, max_seqs: int, num_spec: int, tp: int = 1) -> int:
    """VRAM of GDN_DEFER=1's verify scratch outside the KV pool, on one GPU (the patch allocates it
    per GDN layer): ``max_seqs x (1 + num_spec)`` positions of ``H*K*4 + HV*V*dtype_bytes + HV*4*2``
    bytes (H, K: GDN key heads and head size; HV, V: value heads and head size; the heads divided by
    ``tp`` like the rest of a rank's geometry), times the GDN layers. 0 without speculation. The
    27B at MAX_SEQS 4, k 7: 32 x 48 x 20,864 B = 32,047,104 B (32.0 MB)."""
    if num_spec <= 0:
        return 0
    g = rank_geometry(geom, tp) if tp > 1 else geom
    per_pos = (g.linear_num_key_heads * g.linear_key_head_dim * 4
               + g.linear_num_value_heads * g.linear_value_head_dim * g.dtype_bytes
               + g.linear_num_value_heads * 4 * 2)
    return g.num_gdn * max_seqs * (1 + num_spec) * per_pos


def kv_mem_for_pool(geom: ModelGeometry, pool_tokens: int, kv: str, max_len: int, num_spec: int = 0,
                    prefix_cache: bool = False, granularity: int = MiB, gdn_defer: bool = False,
                    **pool_kw) -> int:
    """Smallest KV_MEM (multiple of ``granularity``) whose predicted pool is >= pool_tokens.
    ``pool_kw``: predict_pool's other keywords (a DFlash2 drafter's layers: DrafterVRAM.pool_kw)."""
    probe = predict_pool(geom, GiB, kv, max_len, num_spec, prefix_cache, gdn_defer=gdn_defer, **pool_kw)
    per_block = probe.page_bytes * probe.group_size
    blocks = cdiv(pool_tokens * probe.blocks_per_request, max_len)
    while int(blocks / probe.blocks_per_request * max_len) < pool_tokens:
        blocks += 1
    return cdiv(blocks * per_block, granularity) * granularity


def tokens_per_gib(geom: ModelGeometry, kv: str, max_len: int, num_spec: int = 0, prefix_cache: bool = False,
                   gdn_defer: bool = False) -> float:
    p = predict_pool(geom, 8 * GiB, kv, max_len, num_spec, prefix_cache, gdn_defer=gdn_defer)
    return p.pool_tokens / 8


def max_concurrency(geom: ModelGeometry, kv_mem_bytes: int, kv: str, max_len: int, num_spec: int = 0,
                    prefix_cache: bool = False, gdn_defer: bool = False) -> int:
    """Whole sequences of max_len that fit at once."""
    return int(predict_pool(geom, kv_mem_bytes, kv, max_len, num_spec, prefix_cache,
                            gdn_defer=gdn_defer).max_concurrency)


# ---------------------------------------------------------------- weights and the rest of VRAM

_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def safetensors_header(path: str | os.PathLike) -> dict:
    """The JSON header of one .safetensors file (8-byte little-endian length + JSON)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * MiB:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        try:
            return json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: bad safetensors header: {e}") from None


def tensor_headers(model_dir: str | os.PathLike) -> dict[str, dict]:
    """{tensor name: header entry} over every *.safetensors of a checkpoint (headers only; {}
    when it has none)."""
    out: dict[str, dict] = {}
    for fp in sorted(Path(model_dir).glob("*.safetensors")):
        out.update((n, m) for n, m in safetensors_header(fp).items() if n != "__metadata__")
    return out


def weight_bytes(model_dir: str | os.PathLike, skip_prefixes: tuple[str, ...] = ()) -> int:
    """Total tensor bytes over every *.safetensors file of a checkpoint (headers only)."""
    return sum(b for n, b in checkpoint_tensors(model_dir) if not n.startswith(skip_prefixes))


# Reserves on a 24 GB card (measured on 3090s publicly; used only to estimate GPU_UTIL mode)
CUDA_GRAPH_RESERVE = int(0.75 * GiB)  # FULL_AND_PIECEWISE graphs up to 8..32 tokens
ACTIVATION_HEADROOM = int(1.25 * GiB)  # profile-run peak (prefill chunk 2048 + sampler)
CUDA_CONTEXT = int(0.5 * GiB)


def kv_mem_from_util(total_bytes: int, gpu_util: float, weights: int, graph_reserve: int = CUDA_GRAPH_RESERVE,
                     activation: int = ACTIVATION_HEADROOM, context: int = CUDA_CONTEXT) -> int:
    """KV bytes gpu_memory_utilization would leave; vLLM does NOT subtract graph memory itself,
    so we do (that is why the profiles pin --kv-cache-memory instead)."""
    return max(int(total_bytes * gpu_util) - weights - activation - context - graph_reserve, 0)


# Inferred 3090 pins (see module docstring); profiles.py references these.
LONG_KV_MEM = kv_mem_for_pool(PUBLIC_3090, 136_429, "int8_per_token_head", 131_072, 3, True)
INT4_KV_MEM = kv_mem_for_pool(PUBLIC_3090, 266_520, "int4_per_token_head", 256_000, 3, True)
FAST_KV_MEM = kv_mem_for_pool(PUBLIC_3090, 72_992, "bf16", 65_536, 4, True)
FAST_DFLASH_KV_MEM = kv_mem_for_pool(PUBLIC_3090, 68_605, "bf16", 65_536, 7, True)


# ---------------------------------------------------------------- tensor parallel (issue 10)
#
# vLLM 0.27.1 splits this model by heads at --tensor-parallel-size N (N GPUs of one host):
# * full attention (models/qwen3_next.py Qwen3NextAttention): query heads and KV heads divided
#   by N (it asserts num_heads % N == 0 and, with N <= kv heads, kv_heads % N == 0);
# * GDN (mamba_utils.gated_delta_net_state_shape, gdn/qwen_gdn_linear_attn.py): key heads, value
#   heads, the conv state and A_log/dt_bias divided by N (``divide`` asserts exact division);
# * MLP, o_proj/out_proj (row parallel), in_proj_* and conv1d (column parallel), mtp.fc: / N;
# * embed_tokens / lm_head: vocab-parallel (rows / N); RMSNorm weights: replicated.
# So each rank's KV page and GDN state page are exactly 1/N of the single-GPU ones: the block
# size stays, the per-rank pool bytes buy N times the blocks, and the pool in tokens (what vLLM
# logs; every rank holds a 1/N slice of every token) is predicted by predict_pool on
# rank_geometry(). vLLM takes the smallest per-rank block count (kv_cache_utils).
# A DFlash2 drafter runs at the target's TP (SpeculativeConfig._verify_and_get_draft_tp): each rank
# holds all its attention layers with their KV heads split the same way (rank_pool_kw; below TP
# they are replicated, one a rank), so its bucket and the group size are the TP=1 ones; its
# weights per GPU: dflash_drafter_vram(tp=N) (drafter_rank_tensor says what is split and what not).
# The pool each GPU gets from GPU_UTIL: card x util less the one-GPU budget's terms at one GPU's
# share (onecard.preflight._tp_vram; the target's weights by target_tp_weights).

TP_SIZES = (1, 2, 4, 8)


def tp_sizes_for(geom: ModelGeometry, sizes: tuple[int, ...] = TP_SIZES) -> list[int]:
    """The tensor-parallel sizes this geometry splits evenly (attention + KV + GDN heads)."""
    heads = (geom.num_attention_heads, geom.num_kv_heads, geom.linear_num_key_heads, geom.linear_num_value_heads)
    return [n for n in sizes if all(h % n == 0 for h in heads)]


def tp_check(geom: ModelGeometry, tp: int) -> str | None:
    """None if ``tp`` divides every head count, else one line naming the culprit and the valid sizes."""
    for what, h in (("KV heads", geom.num_kv_heads), ("GDN key heads", geom.linear_num_key_heads),
                    ("GDN value heads", geom.linear_num_value_heads), ("attention heads", geom.num_attention_heads)):
        if h % tp:
            valid = "|".join(map(str, tp_sizes_for(geom)))
            return (f"TP={tp} does not divide the model's {h} {what} ({geom.num_kv_heads} KV, "
                    f"{geom.linear_num_key_heads}/{geom.linear_num_value_heads} GDN key/value heads); "
                    f"valid for this model: TP={valid}")
    return None


def rank_kv_heads(total: int, tp: int, what: str = "KV heads") -> int:
    """KV heads one rank holds at tensor parallel ``tp``, as vLLM 0.27.1's attention layers split
    them (qwen3_next.py Qwen3NextAttention, qwen3_dflash.py's DFlash attention; the same rule as
    ModelConfig.get_num_kv_heads): ``total // tp`` when ``total >= tp`` (which must divide), else
    replicated, one per rank (``tp`` must then be a multiple of ``total``). ValueError (one line)
    where vLLM's assert would fail at model init."""
    if total >= tp and total % tp or total < tp and tp % total:
        raise ValueError(f"TP={tp} does not split the {total} {what}: vLLM 0.27.1 needs {total} % TP == 0, "
                         f"or TP a multiple of {total} (replicated)")
    return max(1, total // tp)


def rank_pool_kw(pool_kw: dict, tp: int) -> dict:
    """predict_pool's drafter keywords (DrafterVRAM.pool_kw) for one rank at tensor parallel
    ``tp``: the drafter runs at the target's TP (vLLM 0.27.1), so its attention layers' KV heads
    are split by rank_kv_heads (8 -> 4 per rank at TP=2 for the 27B drafter; the tiny drafter's 2
    -> 1); its layer count, head size, ``mtp_in_pool`` and ``gdn_defer`` stay. Without drafter
    layers in the pool (none, or DFLASH_RING=1) nothing changes."""
    kw = dict(pool_kw)
    if tp > 1 and kw.get("draft_attn_layers", 0) > 0:
        kw["draft_kv_heads"] = rank_kv_heads(kw.get("draft_kv_heads", DFLASH2_27B_KV_HEADS), tp,
                                             "KV heads of the DFlash2 drafter")
    return kw


def rank_geometry(geom: ModelGeometry, tp: int) -> ModelGeometry:
    """What one rank holds at tensor parallel ``tp``: every head count divided by tp."""
    import dataclasses

    err = tp_check(geom, tp)
    if err:
        raise ValueError(err)
    return dataclasses.replace(
        geom, num_kv_heads=geom.num_kv_heads // tp, linear_num_key_heads=geom.linear_num_key_heads // tp,
        linear_num_value_heads=geom.linear_num_value_heads // tp, num_attention_heads=geom.num_attention_heads // tp)


def _tp_class(name: str) -> str:
    """'skip' (vision tower: --language-model-only), 'vocab' (vocab-parallel rows), 'replicated'
    (RMSNorm weights, also the MTP module's pre_fc_norm_embedding / pre_fc_norm_hidden; the
    compressed-tensors weight_shape) or 'sharded' (split by heads / columns)."""
    if name.startswith(("model.visual.", "visual.")) or ".visual." in name:
        return "skip"
    if "embed_tokens." in name or name.startswith("lm_head.") or ".lm_head." in name:
        return "vocab"
    if name.endswith(".weight_shape") or (name.endswith(".weight") and "norm" in name.rsplit(".", 2)[-2]):
        return "replicated"
    return "sharded"


@dataclass
class TPWeights:
    tp: int
    sharded: int
    vocab: int
    replicated: int
    source: str

    @property
    def per_gpu(self) -> int:
        return cdiv(self.sharded, self.tp) + cdiv(self.vocab, self.tp) + self.replicated

    @property
    def total(self) -> int:
        return self.sharded + self.vocab + self.replicated


def tp_weight_bytes(tensors, tp: int, source: str = "") -> TPWeights:
    """Per-GPU weight bytes from (name, bytes) pairs (a checkpoint's tensors), every tensor
    counted (target_tp_weights keeps only what the served plan loads)."""
    acc = {"sharded": 0, "vocab": 0, "replicated": 0, "skip": 0}
    for name, nbytes in tensors:
        acc[_tp_class(name)] += int(nbytes)
    return TPWeights(tp, acc["sharded"], acc["vocab"], acc["replicated"], source)


def target_tp_weights(tensors: list[tuple[str, int]], tp: int, source: str, spec_method: str | None,
                      embed_host: bool = False) -> TPWeights:
    """The target's weights per GPU at tensor parallel ``tp`` by the same rule as target_weights
    (one GPU): mtp.* only with SPEC=mtp (vLLM builds the MTP module for no other method), without
    the target's embed_tokens with EMBED_HOST=1 (patch 0013 moves each rank's vocab shard of it to
    pinned host memory), the vision tower skipped (tp_weight_bytes' 'skip')."""
    return tp_weight_bytes([(n, b) for n, b in tensors if _target_on_gpu(n, spec_method, embed_host)], tp, source)


def checkpoint_tensors(model_dir: str | os.PathLike) -> list[tuple[str, int]]:
    """(name, bytes) of every tensor of a checkpoint, from the safetensors headers only."""
    if not any(Path(model_dir).glob("*.safetensors")):
        raise ValueError(f"no *.safetensors in {model_dir}")
    return [(n, m["data_offsets"][1] - m["data_offsets"][0]) for n, m in tensor_headers(model_dir).items()]


def layout_27b_tensors(head_bytes: int = 1) -> list[tuple[str, int]]:
    """The prepared Qwen3.8-27B's tensors without the checkpoint: the 27B-geometry layout
    (onecard.prepare.geometry: W4A16 body, group 128) with lm_head / embed_tokens / MTP at
    ``head_bytes`` per element plus one fp32 scale per row (install.sh's int8 requantization;
    2 = the bf16 tensors as published). An estimate for --dry-run; a checkpoint on disk is read."""
    from math import prod

    from onecard.prepare.geometry import plan as geometry_plan
    from onecard.prepare.geometry import spec_for

    out = []
    for name, code, shape, _src in geometry_plan(spec_for("27b")):
        n = prod(shape) * _DTYPE_BYTES[code]
        requant = (name.startswith("lm_head.") or "embed_tokens." in name or name.startswith("mtp.layers.")
                   or name.startswith("mtp.fc."))
        if head_bytes != 2 and requant and len(shape) == 2 and code == "BF16":
            n = prod(shape) * head_bytes + shape[0] * 4
        out.append((name, n))
    return out


@dataclass
class TPPrediction:
    tp: int
    card_bytes: int
    gpu_util: float
    weights: TPWeights
    kv_bytes_per_gpu: int
    pool: PoolPrediction  # tokens: what vLLM logs; every rank holds 1/tp of each token

    def as_dict(self) -> dict:
        return {"tp": self.tp, "card_bytes": self.card_bytes, "gpu_util": self.gpu_util,
                "weights_per_gpu": self.weights.per_gpu, "weights_total": self.weights.total,
                "weights_source": self.weights.source, "kv_bytes_per_gpu": self.kv_bytes_per_gpu,
                "kv_bytes_total": self.kv_bytes_per_gpu * self.tp, **self.pool.as_dict()}


CARD_24G = 24 * GiB  # the card this distribution targets (RTX 3090: 24,576 MiB)


def predict_tp(geom: ModelGeometry, tp: int, weights: TPWeights, kv: str, max_len: int, num_spec: int = 0,
               prefix_cache: bool = False, gpu_util: float = 0.92, card_bytes: int = CARD_24G,
               kv_bytes_per_gpu: int | None = None, gdn_defer: bool = False, **pool_kw) -> TPPrediction:
    """Pool at tensor parallel ``tp`` when it is sized from gpu_memory_utilization: per GPU,
    ``card * util - weights/GPU - activation - CUDA context - graph reserve`` (kv_mem_from_util;
    the reserves are the single-card 3090 figures, per rank), or ``kv_bytes_per_gpu`` when known
    (vLLM logs it: "Available KV cache memory: X GiB").

    ``pool_kw``: predict_pool's other keywords at the whole model's shape, as at TP=1 (a DFlash2
    drafter's layers: DrafterVRAM.pool_kw, ``mtp_in_pool``); a rank holds the drafter's layers
    with their KV heads split like the target's (rank_pool_kw), in the layout predict_pool
    describes (the drafter's own bucket, group size = its layer count)."""
    if kv_bytes_per_gpu is None:
        kv_bytes_per_gpu = kv_mem_from_util(card_bytes, gpu_util, weights.per_gpu)
    pool = predict_pool(rank_geometry(geom, tp), kv_bytes_per_gpu, kv, max_len, num_spec, prefix_cache,
                        gdn_defer=gdn_defer, **rank_pool_kw(pool_kw, tp))
    return TPPrediction(tp, card_bytes, gpu_util, weights, kv_bytes_per_gpu, pool)


# ---------------------------------------------------------------- what the KV pin does not cover
#
# With a KV_MEM pin vLLM carves exactly that many bytes for the KV pool; everything else must fit
# beside it on the card: the target's weights, a drafter's weights, the draft head of patch 0012,
# KVarN's fp16 stage, the DFlash2 drafter's K/V rings (DFLASH_RING=1), the activation/graph/context
# reserves. ``vram_budget`` adds them up; the preflight compares the sum with a 24 GiB card (it
# never refuses on it: --dry-run does not know the card, and the reserves are estimates).

# The published 27B DFlash2 drafter (z-lab/Qwen3.8-27B-DFlash2, config quoted in docs/dflash2.md
# and tests/dflash/dflash_helpers.PUBLISHED): hidden 5120, 5 layers (32 q / 8 kv heads x 128,
# intermediate 17408), fc from 5 target layers, conv kernel 2 / group 16, selector rank 256,
# vocab 248,320. drafter_param_count of that config = 1,924,404,480 parameters; bf16 =
# 3,848,808,960 bytes (3.58 GiB, the "~3.7 GB bf16" reported). Used when DRAFT has neither
# safetensors nor a config that parses (e.g. --dry-run without the drafter on disk).


def drafter_param_count(cfg) -> int:
    """Parameters of a DFlash/DFlash2 drafter from its parsed config
    (``onecard.dflash.config.DrafterConfig``): its checkpoint's tensors (``tensor_shapes``)."""
    from onecard.dflash.config import tensor_shapes

    return sum(math.prod(shape) for shape in tensor_shapes(cfg).values())


# DRAFT_QUANT=fp8 (patch 0080's dflash2_draft_quant="fp8_per_block"): vLLM's online FP8 of the
# drafter's fc, o_proj and MLP while it loads; qkv_proj (read directly by DFlash's context K/V
# precompute), the convs' kernel_projection, the selector and the norms stay bf16. On the GPU a
# quantized weight is one byte per element plus Marlin's scales (the 3090's FP8 GEMM, W8A16):
# prepare_fp8_layer_for_marlin turns the 128 x 128 block scales into one bf16 per output row for
# each 128-wide group of the input.
DRAFT_FP8_TENSOR = re.compile(r"(?:^|\.)(?:fc|layers\.\d+\.(?:self_attn\.o_proj|mlp\.(?:gate|up|down|gate_up)_proj))\.weight$")
FP8_BLOCK = 128


def fp8_block_bytes(out_features: int, in_features: int) -> int:
    """GPU bytes of one weight [out, in] under fp8_per_block on Marlin: FP8 values + bf16 scales."""
    return out_features * in_features + -(-in_features // FP8_BLOCK) * out_features * 2


def drafter_fp8_linears(hidden: int, q_width: int, intermediate: int, fc_in: int,
                        layers: int) -> list[tuple[int, int]]:
    """(out, in) of every weight DRAFT_QUANT=fp8 quantizes: the fc, then per layer o_proj and the
    MLP's gate, up and down (checkpoint tensors; vLLM fuses gate and up, same bytes)."""
    per_layer = [(hidden, q_width), (intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]
    return [(hidden, fc_in)] + per_layer * layers


def fp8_saving(linears: list[tuple[int, int]], elem_bytes: int = 2) -> int:
    """Bytes DRAFT_QUANT=fp8 saves on these weights, stored with ``elem_bytes`` per element."""
    return sum(o * i * elem_bytes - fp8_block_bytes(o, i) for o, i in linears)


def fused_kv_copy_bytes(layers: int, kv_heads: int, head_dim: int, hidden: int) -> int:
    """0.27.1's DFlash keeps a bf16 copy of every layer's K and V projection rows, concatenated,
    for its context K/V precompute (qwen3_dflash.py _build_context_kv_buffers: torch.cat of the
    qkv_proj.weight slices): 100 MiB for the 27B drafter, beside its weights in either mode."""
    return layers * 2 * kv_heads * head_dim * hidden * 2


def _kv_copy_words(n: int) -> str:
    """The K/V copy in a drafter's source words, in the VRAM note's GiB (named once it shows)."""
    return f" + {n / GiB:.2f} bf16 K/V copy" if n >= GiB // 100 else ""


def _header_fp8_saving(draft_dir: Path) -> int:
    """fp8_saving over the drafter's safetensors headers (the tensors DRAFT_FP8_TENSOR names)."""
    saved = 0
    for name, meta in tensor_headers(draft_dir).items():
        if DRAFT_FP8_TENSOR.search(name) and len(meta["shape"]) == 2:
            start, end = meta["data_offsets"]
            saved += (end - start) - fp8_block_bytes(*meta["shape"])
    return saved


# The DFlash2 drafter per GPU at tensor parallel N. vLLM 0.27.1 runs it at the target's TP
# (SpeculativeConfig._verify_and_get_draft_tp) and builds it as (qwen3_dflash.py + patch 0080's
# qwen3_dflash2.py):
# * per layer: qkv_proj QKVParallelLinear (query heads / N; KV heads by rank_kv_heads, replicated
#   one a rank below N), o_proj RowParallelLinear (input / N), the MLP (Qwen3MLP) gate_up
#   MergedColumnParallelLinear (output / N) and down_proj RowParallelLinear (input / N);
#   input/post_attention_layernorm, q_norm, k_norm RMSNorm: on every GPU;
# * fc ReplicatedLinear (5 x hidden -> hidden, 0.24 GiB bf16 for the 27B drafter): whole on every GPU;
# * the DFlash2 convs (base_kernel nn.Parameter, kernel_projection ReplicatedLinear) and the
#   candidate selector (hidden_projection ReplicatedLinear, two [vocab, rank] codebooks as
#   nn.Parameter, 0.24 GiB for the 27B drafter): whole on every GPU;
# * hidden_norm / norm RMSNorm, mask_embedding, d2t: whole on every GPU;
# * embed_tokens VocabParallelEmbedding, lm_head ParallelLMHead: rows / N, and only when the
#   checkpoint ships them: without them (the published drafters) the proposer shares the target's
#   (llm_base_proposer._maybe_share_embeddings / _maybe_share_lm_head), already in its weights;
# * the bf16 K/V copy of _build_context_kv_buffers: torch.cat of each layer's
#   qkv_proj.weight[q_size:], the rank's own KV rows (fused_kv_copy_bytes at rank_kv_heads).
# DRAFT_QUANT=fp8 quantizes each rank's shard (fp8_block_bytes at the rank's [out, in]).
# A tensor this list does not name (and k/v without the drafter's KV head count) is counted whole.
_DRAFTER_COLUMN = re.compile(r"(?:^|\.)layers\.\d+\.(?:self_attn\.q_proj|mlp\.(?:gate|up|gate_up)_proj)\.(?:weight|bias)$")
_DRAFTER_KV = re.compile(r"(?:^|\.)layers\.\d+\.self_attn\.[kv]_proj\.(?:weight|bias)$")
_DRAFTER_ROW = re.compile(r"(?:^|\.)layers\.\d+\.(?:self_attn\.o_proj|mlp\.down_proj)\.weight$")
_DRAFTER_SINK = re.compile(r"(?:^|\.)layers\.\d+\.self_attn\.attention_sink_bias$")
_DRAFTER_VOCAB = re.compile(r"^(?:(?:model|dflash)\.)?(?:embed_tokens|lm_head)\.")


def drafter_rank_tensor(name: str, shape: tuple[int, ...], nbytes: int, tp: int,
                        kv_heads: int | None) -> tuple[int, tuple[int, ...]]:
    """(bytes, shape) one GPU holds of the drafter tensor ``name`` (as stored, prefix or not) at
    tensor parallel ``tp`` (the list above); ``kv_heads``: the drafter's KV heads (None: unknown,
    k/v counted whole)."""
    shape = tuple(int(x) for x in shape)
    if tp <= 1:
        return nbytes, shape
    if _DRAFTER_COLUMN.search(name) or _DRAFTER_SINK.search(name) or _DRAFTER_VOCAB.search(name):
        return cdiv(nbytes, tp), (cdiv(shape[0], tp),) + shape[1:]
    if _DRAFTER_KV.search(name) and kv_heads:
        rank = rank_kv_heads(kv_heads, tp, "KV heads of the DFlash2 drafter")
        return nbytes * rank // kv_heads, (shape[0] * rank // kv_heads,) + shape[1:]
    if _DRAFTER_ROW.search(name) and len(shape) == 2:
        return cdiv(nbytes, tp), (shape[0], cdiv(shape[1], tp))
    return nbytes, shape


def _drafter_bytes(tensors, tp: int, kv_heads: int | None, fp8: bool) -> int:
    """One GPU's bytes of the drafter's tensors [(name, shape, bytes)] at tensor parallel ``tp``,
    less DRAFT_QUANT=fp8's saving on each rank's shard of the tensors DRAFT_FP8_TENSOR names."""
    total = 0
    for name, shape, nbytes in tensors:
        rank_bytes, rank_shape = drafter_rank_tensor(name, shape, nbytes, tp, kv_heads)
        if fp8 and DRAFT_FP8_TENSOR.search(name) and len(rank_shape) == 2:
            rank_bytes = fp8_block_bytes(*rank_shape)
        total += rank_bytes
    return total


def published_27b_drafter_config():
    """The published 27B DFlash2 drafter's config (the DFLASH2_27B_* figures; drafter_param_count
    of it = DFLASH2_27B_PARAMS), for a DRAFT with neither safetensors nor a config that parses."""
    from onecard.dflash.config import DrafterConfig

    return DrafterConfig(
        version=2, hidden_size=DFLASH2_27B_HIDDEN, num_layers=DFLASH2_27B_LAYERS,
        num_heads=DFLASH2_27B_Q_WIDTH // DFLASH2_27B_HEAD_DIM, num_kv_heads=DFLASH2_27B_KV_HEADS,
        head_dim=DFLASH2_27B_HEAD_DIM, intermediate_size=DFLASH2_27B_INTERMEDIATE, rms_norm_eps=1e-6,
        rope_theta=1e7, vocab_size=DFLASH2_27B_VOCAB, block_size=8, mask_token_id=248070,
        target_layer_ids=(5, 19, 33, 47, 61), target_hidden_size=DFLASH2_27B_HIDDEN,
        layer_types=("sliding_attention",) * DFLASH2_27B_LAYERS, sliding_window=2048,
        conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)


@dataclass
class DrafterVRAM:
    weight_bytes: int  # on one GPU (at tensor parallel N: that GPU's share, dflash_drafter_vram's tp)
    attn_layers: int  # attention layers whose KV lives in the same pool (the pin); 0 in ring mode
    # (DFLASH_RING=1: their K/V sit in rings beside the pin, sized by dflash2_ring_bytes from the
    # plan's ring geometry, not from this record)
    source: str
    kv_heads: int = DFLASH2_27B_KV_HEADS  # per drafter attention layer (its KV page)
    head_dim: int = DFLASH2_27B_HEAD_DIM

    def pool_kw(self) -> dict:
        """predict_pool's keywords for a pool shared with this drafter (no MTP layer is built)."""
        return {"mtp_in_pool": False, "draft_attn_layers": self.attn_layers,
                "draft_kv_heads": self.kv_heads, "draft_head_dim": self.head_dim}


def dflash_drafter_vram(draft_dir: str | os.PathLike | None, ring: bool = False, fp8: bool = False,
                        tp: int = 1) -> DrafterVRAM:
    """The DFlash2 drafter's weights and KV layers: safetensors headers of DRAFT when it has them
    (as the target's), else its config's shape in bf16, else the published 27B drafter.

    ``fp8`` (DRAFT_QUANT=fp8): less what FP8 saves on its fc, o_proj and MLP (fp8_saving).
    Both include ``fused_kv_copy_bytes``: the bf16 copy of every layer's K/V projection rows that
    0.27.1's DFlash keeps for its context precompute.

    ``tp`` (TP>1): the bytes one GPU holds when vLLM runs the drafter at the target's tensor
    parallel size (drafter_rank_tensor: linear layers split, fc / convs / selector / norms whole
    on every GPU; the K/V copy of the rank's KV heads).

    ``ring`` (DFLASH_RING=1, docs/dflash2-huge.md section 3): the drafter's layers hand vLLM no
    KV-cache spec, so none of them shares the pool (``attn_layers`` 0); their K/V take
    ``dflash2_ring_bytes`` beside the pin instead.

    KV layers: vLLM 0.27.1 builds every drafter layer as an attention layer with its own KV cache
    in the same pool as the target's. FullAttentionSpec.merge requires equal KV heads and head
    size, so a drafter of another shape (the 27B pair: 8 KV heads x 128 against 4 x 256) gets a
    KV-cache bucket of its own, and the group size drops to its layer count (5 for the 27B pair:
    the target's 16 attention layers take 4 groups, the 48 GDN layers 10; predict_pool). The
    top-level ``use_sliding_window`` of the published config is not honoured by 0.27.1
    (docs/dflash2.md), so they hold KV for the whole context."""
    from onecard.dflash.config import DrafterConfig, DrafterConfigError, tensor_shapes

    cfg, why = None, "no DRAFT"
    d = Path(draft_dir) if draft_dir not in (None, "") else None
    if d is not None:
        try:
            cfg = DrafterConfig.load(d)
        except (DrafterConfigError, OSError, ValueError):
            why = "DRAFT has no DFlash2 config that parses"
    layers = 0 if ring else cfg.num_layers if cfg else DFLASH2_27B_LAYERS
    shape = {"kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim} if cfg else {}
    q8 = ", fc/o_proj/MLP in FP8 (DRAFT_QUANT=fp8)" if fp8 else ""
    per_gpu = (f", per GPU at TP={tp} (q/k/v, o_proj, MLP split; fc, convs, selector, norms on every GPU)"
               if tp > 1 else "")

    def kv_copy(c) -> int:
        return fused_kv_copy_bytes(c.num_layers, rank_kv_heads(c.num_kv_heads, tp, "KV heads of the DFlash2 drafter"),
                                   c.head_dim, c.hidden_size)

    if d is not None and d.is_dir() and any(d.glob("*.safetensors")):
        # (weights without a config that parses: no shape to size the copy by; the launcher refuses them)
        copy = kv_copy(cfg) if cfg else 0
        tensors = [(n, tuple(m["shape"]), m["data_offsets"][1] - m["data_offsets"][0])
                   for n, m in tensor_headers(d).items()]
        return DrafterVRAM(_drafter_bytes(tensors, tp, cfg.num_kv_heads if cfg else None, fp8) + copy, layers,
                           f"weights from safetensors headers{q8}{_kv_copy_words(copy)}{per_gpu}", **shape)
    src = "weights bf16 by config.json" if cfg is not None else "estimate: the published 27B DFlash2 drafter, weights bf16"
    c = cfg if cfg is not None else published_27b_drafter_config()
    copy = kv_copy(c)
    tensors = [(n, s, math.prod(s) * 2) for n, s in tensor_shapes(c).items()]
    return DrafterVRAM(_drafter_bytes(tensors, tp, c.num_kv_heads, fp8) + copy, layers,
                       f"{src}{q8}{_kv_copy_words(copy)}{per_gpu}" + ("" if cfg is not None else f" ({why})"),
                       **shape)


@dataclass(frozen=True)
class RingDrafter:
    """What sizes the DFlash2 drafter's K/V rings (DFLASH_RING=1): its attention layers, sliding
    window and per-layer KV heads x head size."""

    layers: int
    window: int
    kv_heads: int
    head_dim: int
    source: str


def ring_drafter(cfg, raw: dict, source: str) -> RingDrafter:
    """The ring geometry of a parsed drafter config (``onecard.dflash.config.DrafterConfig``) and
    its raw config.json (the window by the server's rule, ``onecard.dflash.ring.window_from_config``).
    Raises ValueError (one line) when a layer is full attention: a ring holds only the window."""
    from onecard.dflash import ring

    return RingDrafter(cfg.num_layers, ring.window_from_config(raw), cfg.num_kv_heads, cfg.head_dim, source)


def dflash2_ring_bytes(drafter: RingDrafter, max_seqs: int, k_max: int, tp: int = 1) -> int:
    """VRAM of the drafter's K/V rings beside the KV pin (DFLASH_RING=1): every drafter layer's bf16
    ring of ``max_seqs`` request slots of window + k_max + 1 rows (onecard.dflash.ring; 84,869,120 B
    for the published 27B drafter at MAX_SEQS 2, DFLASH_TOKENS 7). On one GPU at tensor parallel
    ``tp``: patch 0080's DFlash2Proposer.initialize_attn_backend shapes each ring by the attention
    layer's own num_kv_heads, the rank's (rank_kv_heads; half the bytes at TP=2 for 8 KV heads)."""
    from onecard.dflash import ring

    heads = rank_kv_heads(drafter.kv_heads, tp, "KV heads of the DFlash2 drafter")   # all of them at TP=1
    return ring.ring_bytes(drafter.layers, max_seqs, drafter.window, k_max, heads, drafter.head_dim)


def draft_vocab_file(model_dir: str | os.PathLike, draft_vocab_env: str | None) -> Path | None:
    """The draft vocabulary patch 0012 loads, as it decides: ONECARD_DRAFT_VOCAB unset/'' or '1'
    = MODEL/draft_vocab.json when present, '0' = none, anything else = that path."""
    v = (draft_vocab_env or "").strip()
    if v == "0":
        return None
    p = Path(v) if v not in ("", "1") else Path(model_dir) / "draft_vocab.json"
    return p if p.is_file() else None


def draft_lm_head_bytes(model_dir: str | os.PathLike, draft_vocab_env: str | None = None) -> tuple[int, str]:
    """Bytes of patch 0012's ``draft_lm_head`` (SPEC=mtp): draft ids x lm_head's bytes per row, in
    lm_head's own format (bf16, or int8/int4 + group scales once requantized), read from the
    checkpoint headers. (0, why) when there is no draft vocabulary or no lm_head on disk."""
    f = draft_vocab_file(model_dir, draft_vocab_env)
    if f is None:
        why = "ONECARD_DRAFT_VOCAB=0" if (draft_vocab_env or "").strip() == "0" else "no draft_vocab.json"
        return 0, why
    try:
        data = json.loads(f.read_text())
        ids = len(data["ids"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0, f"{f} unreadable (the server refuses it at boot)"
    files = sorted(Path(model_dir).glob("*.safetensors"))
    heads: dict[str, dict] = {"lm_head": {}, "embed": {}}
    for fp in files:
        for name, meta in safetensors_header(fp).items():
            if name == "__metadata__" or name.endswith(".weight_shape"):
                continue
            kind = ("lm_head" if name.startswith("lm_head.") or ".lm_head." in name
                    else "embed" if "embed_tokens." in name else None)
            if kind:
                heads[kind][name] = meta
    head = heads["lm_head"] or heads["embed"]  # tied: the draft rows are embed_tokens' rows
    rows = [int(m["shape"][0]) for n, m in head.items() if n.endswith((".weight", ".weight_packed"))]
    if not rows or rows[0] <= 0:
        return 0, "no lm_head in the checkpoint"
    nbytes = sum(m["data_offsets"][1] - m["data_offsets"][0] for m in head.values())
    per_row = nbytes / rows[0]
    return int(ids * per_row), f"{ids:,} draft ids x {per_row:,.0f} B per lm_head row ({f.name})"


def is_target_embed(name: str) -> bool:
    """The target's own embed_tokens tensors (not an MTP module's): what EMBED_HOST=1 keeps in host
    memory (patch 0013)."""
    return "embed_tokens." in name and not name.startswith("mtp.")


TARGET_LAYOUT_SOURCE = "27B layout, int8 lm_head/embed/MTP"


def target_tensors(model_dir: str | os.PathLike | None,
                   geom: "ModelGeometry") -> tuple[list[tuple[str, int]] | None, str]:
    """(name, bytes) of the target's tensors and where they came from: the checkpoint's headers
    when MODEL is on disk, else the prepared 27B layout when the geometry is the 27B one, else
    (None, why)."""
    import dataclasses

    d = Path(model_dir) if model_dir not in (None, "") else None
    if d is not None and d.is_dir() and any(d.glob("*.safetensors")):
        return checkpoint_tensors(d), "checkpoint headers"
    if dataclasses.replace(geom, ssm_state_bytes=QWEN38_27B.ssm_state_bytes) == QWEN38_27B:
        return layout_27b_tensors(), TARGET_LAYOUT_SOURCE
    return None, "unknown (no checkpoint, not the 27B geometry)"


def target_embed_bytes(tensors: list[tuple[str, int]] | None) -> int:
    """The target's embed_tokens bytes among target_tensors' (what EMBED_HOST=1 moves off the
    GPU); 0 when they are unknown."""
    return sum(b for n, b in tensors or () if is_target_embed(n) and _tp_class(n) != "skip")


def _target_on_gpu(name: str, spec_method: str | None, embed_host: bool) -> bool:
    """Whether the target's tensor ``name`` is loaded onto the GPU (the vision tower aside, which
    _tp_class skips): mtp.* only with SPEC=mtp, the target's embed_tokens not with EMBED_HOST=1."""
    return (spec_method == "mtp" or not name.startswith("mtp.")) and not (embed_host and is_target_embed(name))


def target_weights(tensors: list[tuple[str, int]] | None, source: str, spec_method: str | None,
                   embed_host: bool = False) -> tuple[int | None, str]:
    """The target's weights on one GPU from target_tensors' answer: the vision tower skipped
    (--language-model-only), mtp.* only with SPEC=mtp (the only mode that builds the MTP
    module), and with ``embed_host`` (EMBED_HOST=1) without the target's embed_tokens (pinned
    host memory)."""
    if tensors is None:
        return None, source
    total = sum(b for n, b in tensors if _tp_class(n) != "skip" and _target_on_gpu(n, spec_method, embed_host))
    if embed_host:
        source = ("27B layout, int8 lm_head/MTP, embed in host memory" if source == TARGET_LAYOUT_SOURCE
                  else source + ", embed_tokens in host memory")
    return total, source


def target_weight_bytes(model_dir: str | os.PathLike | None, spec_method: str | None,
                        geom: "ModelGeometry", embed_host: bool = False) -> tuple[int | None, str]:
    """The target's weights on one GPU: target_weights over target_tensors (the checkpoint's
    headers, else the prepared 27B layout)."""
    return target_weights(*target_tensors(model_dir, geom), spec_method, embed_host)


RESERVES = CUDA_GRAPH_RESERVE + ACTIVATION_HEADROOM + CUDA_CONTEXT
PREFILL_CHUNK = 2048   # the launcher's default --max-num-batched-tokens (ACTIVATION_HEADROOM's chunk)


# Reserves as measured for the profiles job 41 ran at the launcher's own prefill chunk (H100 80GB,
# 2026-12-05, session 24; docs/measurements.md): each server's peak (nvidia-smi, its processes)
# less every predicted term but the reserves, with the H100's bare CUDA context (612 MiB) swapped
# for CUDA_CONTEXT; its torch caching allocator capped at a 24 GiB card's share, W4A16 / FP8 GEMMs
# on Marlin (a 3090's kernels), a MAX_LEN/2 prefill and a MAX_SEQS batch after boot. The estimate
# RESERVES is 2,560 MiB. Keyed by what sizes them: (CTX, SPEC, SPEC_K, MAX_SEQS, GDN_DEFER,
# PREFILL_CHUNK, DRAFT_QUANT, DFLASH_RING); one GPU only. (Session 19's 1.1-1.9 GiB above RESERVES was measured
# at vLLM's 8,192-token H200 chunk, where reserves() counts 3.75 GiB more; at 2,048 it is gone.)
RESERVES_MEASURED = {
    ("long", "dflash2", 7, 4, "1", 2048, "fp8", "0"): 2519 * MiB,
    ("huge", "dflash2", 7, 2, "1", 2048, "fp8", "1"): 1983 * MiB,
    ("long", "dflash2", 7, 4, "0", 2048, "fp8", "0"): 2257 * MiB,
}
RESERVES_MEASURED_WHERE = "measured for this profile: H100, job 41, 2026-12-05, 3090 context estimated"


def reserves(prefill_chunk: int = PREFILL_CHUNK) -> int:
    """The estimated reserves at a prefill chunk (PREFILL_CHUNK): the activation headroom grows
    linearly with a chunk above 2048 tokens (a prefill step's activations are per token); a
    smaller chunk keeps the 2048 figure (the sampler and CUDA graphs do not shrink with it)."""
    extra = ACTIVATION_HEADROOM * max(0, prefill_chunk - PREFILL_CHUNK) // PREFILL_CHUNK
    return RESERVES + extra


def dflash2_lane_bytes(max_seqs: int, max_len: int, k: int) -> int:
    """VRAM of the DFlash2 lookup lane on the device (LOOKUP_LANE=device, DFLASH_TOKENS > 7, LOOKUP=1):
    patch 0080's DeviceLane, one int32 token-history row per request slot plus a scratch row, each
    max_len + k + 2 tokens rounded up to 16, and an int64 length per row. Allocated at the first
    dummy run, beside the KV pin (2.8 MiB at CTX=huge's MAX_SEQS 2)."""
    width = -(-(max_len + k + 2) // 16) * 16
    return (max_seqs + 1) * (width * 4 + 8)


def vram_budget(kv_pin: int, target_weights: int, drafter_weights: int = 0, draft_lm_head: int = 0,
                kvarn_stage: int = 0, reserves: int = RESERVES, card_bytes: int = CARD_24G,
                dflash2_ring_bytes: int = 0, dflash2_lane_bytes: int = 0, gdn_defer_scratch: int = 0) -> dict:
    """Everything one GPU holds at a KV_MEM pin, term by term, and whether it fits ``card_bytes``.
    ``kv_max`` is the largest pin that would fit beside the other terms. ``gdn_defer_scratch``:
    GDN_DEFER=1's verify scratch (gdn_defer_scratch_bytes)."""
    terms = {"weights": target_weights, "drafter_weights": drafter_weights, "draft_lm_head": draft_lm_head,
             "kvarn_stage": kvarn_stage, "dflash2_ring_bytes": dflash2_ring_bytes,
             "dflash2_lane_bytes": dflash2_lane_bytes, "gdn_defer_scratch": gdn_defer_scratch,
             "reserves": reserves, "kv_pin": kv_pin}
    total = sum(terms.values())
    return {**terms, "total": total, "card_bytes": card_bytes, "fits": total <= card_bytes,
            "kv_max": max(card_bytes - (total - kv_pin), 0)}
