"""A tiny random Qwen3.5 hybrid checkpoint in the real layout, for GPU smoke tests.

The checkpoint is what vLLM 0.27.1 loads as ``Qwen3_5ForConditionalGeneration`` (serve it with
``--language-model-only``; no vision weights are written, the vision tower is skipped then):

- ``config.json``: a ``qwen3_5`` config with a ``qwen3_5_text`` ``text_config`` whose
  ``layer_types`` follow the real 3:1 pattern (three Gated DeltaNet layers, then one full
  attention layer), ``mtp_num_hidden_layers: 1`` and a small ``vision_config``;
- ``model.safetensors`` (bf16): ``model.language_model.*``, ``lm_head.weight`` and ``mtp.*``
  (one MTP layer, so ``--speculative-config '{"method":"mtp",...}'`` loads);
- a byte-level BPE tokenizer trained here with the ``tokenizers`` library on Python's own
  documentation text (``pydoc_data.topics``), with Qwen-style special tokens, and a chat
  template with thinking and tool calls (the qwen3_coder XML format).

Everything is derived from ``TinySpec`` and a seed: the same spec on the same Python gives the
same bytes. ``ensure_tiny_model()`` builds it once under the models root and returns its path.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from onecard.prepare.atomic import building_dir

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added tokens that stay visible in decoded text (as in Qwen's tokenizer).
PLAIN_ADDED_TOKENS = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

CHAT_TEMPLATE = (
    "{%- set enable_thinking = enable_thinking if enable_thinking is defined else true -%}\n"
    "{%- if tools -%}\n"
    "{{- '<|im_start|>system\\n' -}}\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif -%}\n"
    "{{- '# Tools\\n\\nYou may call one or more of these functions:\\n<tools>' -}}\n"
    "{%- for tool in tools %}{{ '\\n' + ((tool.function if tool.function is defined else tool) | tojson) }}{% endfor -%}\n"
    "{{- '\\n</tools>\\n\\nTo call a function reply with:\\n<tool_call>\\n<function=NAME>\\n"
    "<parameter=ARGUMENT>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' -}}\n"
    "{%- elif messages[0].role == 'system' -%}\n"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message.role == 'system' -%}\n"
    "{%- if not loop.first %}{{ '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{% endif -%}\n"
    "{%- elif message.role == 'user' -%}\n"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' -}}\n"
    "{%- elif message.role == 'assistant' -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- if message.reasoning_content -%}\n"
    "{{- '<think>\\n' + (message.reasoning_content | trim) + '\\n</think>\\n\\n' -}}\n"
    "{%- endif -%}\n"
    "{{- message.content if message.content else '' -}}\n"
    "{%- for call in (message.tool_calls or []) -%}\n"
    "{%- set fn = call.function if call.function is defined else call -%}\n"
    "{%- if loop.first and message.content %}{{ '\\n' }}{% endif -%}\n"
    "{{- '<tool_call>\\n<function=' + fn.name + '>\\n' -}}\n"
    "{%- if fn.arguments is mapping -%}\n"
    "{%- for key, value in fn.arguments.items() -%}\n"
    "{{- '<parameter=' + key + '>\\n' + (value if value is string else (value | tojson)) + '\\n</parameter>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- elif fn.arguments %}{{ fn.arguments + '\\n' }}{% endif -%}\n"
    "{{- '</function>\\n</tool_call>' + ('' if loop.last else '\\n') -}}\n"
    "{%- endfor -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- elif message.role == 'tool' -%}\n"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}\n"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}\n"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif -%}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- if not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif -%}\n"
    "{%- endif -%}\n"
)


@dataclass(frozen=True)
class TinySpec:
    """Shape of the tiny model; every field is a CLI option of ``onecard prepare tiny``."""

    layers: int = 8                 # multiple of full_attention_interval
    full_attention_interval: int = 4
    hidden: int = 256
    intermediate: int = 768
    heads: int = 8                  # full-attention query heads
    kv_heads: int = 2
    head_dim: int = 256             # multiple of 16 and >= 64 (kernels); real model: 256
    linear_key_heads: int = 2       # GDN key heads (real: 16)
    linear_value_heads: int = 6     # GDN value heads (real: 48; 3x the key heads)
    linear_head_dim: int = 128      # GDN key and value head dim (real: 128)
    conv_kernel: int = 4
    vocab: int = 4096               # tokenizer size (incl. special tokens); model rows padded to 128
    mtp_layers: int = 1
    seed: int = 0

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"tiny model: {msg}")

        if self.layers < 1 or self.full_attention_interval < 1:
            bad("layers and full_attention_interval must be >= 1")
        if self.layers % self.full_attention_interval:
            bad(f"layers ({self.layers}) must be a multiple of full_attention_interval "
                f"({self.full_attention_interval}) so the last layer is full attention")
        if self.head_dim % 16 or self.head_dim < 64:
            bad(f"head_dim {self.head_dim} invalid: must be a multiple of 16 and >= 64")
        if self.heads % self.kv_heads:
            bad(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.linear_value_heads % self.linear_key_heads:
            bad("linear_value_heads must be a multiple of linear_key_heads")
        if self.linear_head_dim % 16 or self.linear_head_dim < 32:
            bad(f"linear_head_dim {self.linear_head_dim} invalid: multiple of 16 and >= 32")
        if self.hidden % 64 or self.hidden < 64:
            bad(f"hidden {self.hidden} invalid: multiple of 64 and >= 64")
        if self.intermediate % 64 or self.intermediate < 64:
            bad(f"intermediate {self.intermediate} invalid: multiple of 64 and >= 64")
        n_added = len(SPECIAL_TOKENS) + len(PLAIN_ADDED_TOKENS) + len(VISION_TOKENS)
        if not 512 <= self.vocab <= 65536:
            bad(f"vocab {self.vocab} invalid: between 512 and 65536 (>{256 + n_added} needed)")
        if self.mtp_layers not in (0, 1, 2):
            bad(f"mtp_layers {self.mtp_layers} invalid: 0, 1 or 2")

    @property
    def padded_vocab(self) -> int:
        return (self.vocab + 127) // 128 * 128

    @property
    def layer_types(self) -> list[str]:
        k = self.full_attention_interval
        return ["full_attention" if (i + 1) % k == 0 else "linear_attention"
                for i in range(self.layers)]

    def key(self) -> str:
        """Short stable id of this spec (part of the default directory name)."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:8]


DEFAULT_SPEC = TinySpec()


# --------------------------------------------------------------------------- tokenizer

def _corpus() -> list[str]:
    """Training text available on any CPython: the pydoc topic texts, else stdlib sources."""
    texts: list[str] = []
    try:
        from pydoc_data.topics import topics  # type: ignore[import-not-found]
        texts = [topics[k] for k in sorted(topics)]
    except Exception:  # pragma: no cover - stripped Pythons
        texts = []
    if sum(len(t) for t in texts) < 100_000:  # pragma: no cover
        import sysconfig
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        for name in ("argparse.py", "collections/__init__.py", "dataclasses.py", "json/decoder.py",
                     "pathlib.py", "textwrap.py", "typing.py", "enum.py", "functools.py"):
            p = stdlib / name
            if p.is_file():
                texts.append(p.read_text(encoding="utf-8", errors="replace"))
    if not texts:  # pragma: no cover
        raise RuntimeError("tiny model: no training text found (pydoc_data and stdlib missing)")
    return texts


def build_tokenizer(vocab: int):
    """Train a byte-level BPE (tokenizers.Tokenizer) with Qwen-style added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # GPT-style split (contractions, letters, single digits, punctuation, whitespace), then bytes.
    split = Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(split, behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    n_added = len(SPECIAL_TOKENS) + len(PLAIN_ADDED_TOKENS) + len(VISION_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - n_added,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    return tok


# --------------------------------------------------------------------------- config

VISION = {
    "model_type": "qwen3_5",
    "deepstack_visual_indexes": [],
    "depth": 1,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 64,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "num_heads": 2,
    "num_position_embeddings": 64,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}

def make_config(spec: TinySpec, token_ids: dict[str, int]) -> dict:
    half_rot = spec.head_dim // 8          # partial_rotary_factor 0.25 -> rotary_dim / 2
    s, rem = divmod(half_rot, 3)
    mrope_section = [s + (rem > 0), s + (rem > 1), s]
    eos = token_ids["<|im_end|>"]
    text_config = {
        "model_type": "qwen3_5_text",
        "architectures": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "bos_token_id": None,
        "eos_token_id": eos,
        "pad_token_id": None,
        "full_attention_interval": spec.full_attention_interval,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate,
        "layer_types": spec.layer_types,
        "linear_conv_kernel_dim": spec.conv_kernel,
        "linear_key_head_dim": spec.linear_head_dim,
        "linear_num_key_heads": spec.linear_key_heads,
        "linear_num_value_heads": spec.linear_value_heads,
        "linear_value_head_dim": spec.linear_head_dim,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 32768,
        "mlp_only_layers": [],
        "mtp_num_hidden_layers": spec.mtp_layers,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": mrope_section,
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": spec.padded_vocab,
    }
    vision_config = dict(VISION, out_hidden_size=spec.hidden)
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "tie_word_embeddings": False,
        "text_config": text_config,
        "vision_config": vision_config,
        "transformers_version": "5.17.0",
        "onecard_tiny": asdict(spec),
    }


# --------------------------------------------------------------------------- weights

def tensor_shapes(spec: TinySpec) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names (HF layout) and shapes, in a stable order."""
    h, i = spec.hidden, spec.intermediate
    kd = spec.linear_key_heads * spec.linear_head_dim
    vd = spec.linear_value_heads * spec.linear_head_dim
    q_out = spec.heads * spec.head_dim
    kv_out = spec.kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {}

    def attn_block(p: str) -> None:
        shapes[f"{p}.self_attn.q_proj.weight"] = (2 * q_out, h)   # query + output gate
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv_out, h)
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv_out, h)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, q_out)
        shapes[f"{p}.self_attn.q_norm.weight"] = (spec.head_dim,)
        shapes[f"{p}.self_attn.k_norm.weight"] = (spec.head_dim,)

    def common(p: str) -> None:
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (i, h)
        shapes[f"{p}.mlp.up_proj.weight"] = (i, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, i)

    lm = "model.language_model"
    shapes[f"{lm}.embed_tokens.weight"] = (spec.padded_vocab, h)
    for n, kind in enumerate(spec.layer_types):
        p = f"{lm}.layers.{n}"
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            shapes[f"{a}.in_proj_qkv.weight"] = (2 * kd + vd, h)
            shapes[f"{a}.in_proj_z.weight"] = (vd, h)
            shapes[f"{a}.in_proj_b.weight"] = (spec.linear_value_heads, h)
            shapes[f"{a}.in_proj_a.weight"] = (spec.linear_value_heads, h)
            shapes[f"{a}.conv1d.weight"] = (2 * kd + vd, 1, spec.conv_kernel)
            shapes[f"{a}.dt_bias"] = (spec.linear_value_heads,)
            shapes[f"{a}.A_log"] = (spec.linear_value_heads,)
            shapes[f"{a}.norm.weight"] = (spec.linear_head_dim,)
            shapes[f"{a}.out_proj.weight"] = (h, vd)
        else:
            attn_block(p)
        common(p)
    shapes[f"{lm}.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (spec.padded_vocab, h)
    if spec.mtp_layers:
        shapes["mtp.fc.weight"] = (h, 2 * h)
        shapes["mtp.pre_fc_norm_embedding.weight"] = (h,)
        shapes["mtp.pre_fc_norm_hidden.weight"] = (h,)
        for n in range(spec.mtp_layers):
            attn_block(f"mtp.layers.{n}")
            common(f"mtp.layers.{n}")
        shapes["mtp.norm.weight"] = (h,)
    # A one-block vision tower (as in vision_config), so the checkpoint is complete.
    v, vi, merged = VISION["hidden_size"], VISION["intermediate_size"], VISION["hidden_size"] * 4
    vp = "model.visual"
    shapes[f"{vp}.patch_embed.proj.weight"] = (v, 3, 2, 16, 16)
    shapes[f"{vp}.patch_embed.proj.bias"] = (v,)
    shapes[f"{vp}.pos_embed.weight"] = (VISION["num_position_embeddings"], v)
    for n in range(VISION["depth"]):
        b = f"{vp}.blocks.{n}"
        for norm in ("norm1", "norm2"):
            shapes[f"{b}.{norm}.weight"] = (v,)
            shapes[f"{b}.{norm}.bias"] = (v,)
        for lin, shape in (("attn.qkv", (3 * v, v)), ("attn.proj", (v, v)),
                           ("mlp.linear_fc1", (vi, v)), ("mlp.linear_fc2", (v, vi))):
            shapes[f"{b}.{lin}.weight"] = shape
            shapes[f"{b}.{lin}.bias"] = (shape[0],)
    shapes[f"{vp}.merger.norm.weight"] = (v,)
    shapes[f"{vp}.merger.norm.bias"] = (v,)
    shapes[f"{vp}.merger.linear_fc1.weight"] = (merged, merged)
    shapes[f"{vp}.merger.linear_fc1.bias"] = (merged,)
    shapes[f"{vp}.merger.linear_fc2.weight"] = (h, merged)
    shapes[f"{vp}.merger.linear_fc2.bias"] = (h,)
    return shapes


def make_weights(spec: TinySpec) -> dict:
    """Random bf16 tensors, each drawn from its own generator seeded by (seed, name).

    Scales keep activations O(1) through the stack (embeddings unit-variance, projections
    1/sqrt(fan_in), residual writers shrunk by depth) and give logits a spread of a few units,
    so greedy decoding is varied rather than one token repeated.
    """
    import math

    import torch

    shapes = tensor_shapes(spec)
    depth_scale = 1.0 / math.sqrt(2.0 * (spec.layers + spec.mtp_layers))
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        digest = hashlib.sha256(f"{spec.seed}:{name}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
        if name.startswith("model.visual.") and len(shape) == 1:
            is_ln_weight = name.endswith(".weight")                    # LayerNorm weight
            t = (1.0 if is_ln_weight else 0.0) + 0.02 * torch.randn(shape, generator=g)
        elif name.startswith("model.visual."):
            fan_in = math.prod(shape[1:])
            t = torch.randn(shape, generator=g) / math.sqrt(fan_in)
        elif name.endswith("A_log"):
            t = torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=g))
        elif name.endswith("dt_bias"):
            t = torch.ones(shape) + 0.1 * torch.randn(shape, generator=g)
        elif leaf == "norm" and ".linear_attn." in name:
            t = torch.ones(shape) + 0.05 * torch.randn(shape, generator=g)   # plain RMSNorm
        elif len(shape) == 1:
            t = 0.05 * torch.randn(shape, generator=g)       # Gemma-style (1 + w) RMSNorm
        elif leaf == "embed_tokens":
            t = torch.randn(shape, generator=g)
        elif leaf == "lm_head":
            t = torch.randn(shape, generator=g) * (3.0 / math.sqrt(shape[1]))
        elif leaf == "conv1d":
            t = torch.randn(shape, generator=g) * (1.0 / math.sqrt(shape[-1]))
        else:
            fan_in = shape[1]
            t = torch.randn(shape, generator=g) / math.sqrt(fan_in)
            if leaf in ("o_proj", "out_proj", "down_proj"):
                t = t * depth_scale
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


# --------------------------------------------------------------------------- writing

def _write_tokenizer_files(tok, dst: Path) -> dict[str, int]:
    tok.save(str(dst / "tokenizer.json"), pretty=False)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + PLAIN_ADDED_TOKENS + VISION_TOKENS}
    added = {}
    for t in SPECIAL_TOKENS + PLAIN_ADDED_TOKENS + VISION_TOKENS:
        added[str(ids[t])] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": t not in PLAIN_ADDED_TOKENS,
        }
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    (dst / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n")
    (dst / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2) + "\n")
    return ids


def build_tiny_model(out_dir: Path, spec: TinySpec = DEFAULT_SPEC, *, force: bool = False) -> Path:
    """Write the checkpoint to ``out_dir`` atomically (temp dir beside it, then rename)."""
    from safetensors.torch import save_file

    spec.validate()
    out_dir = Path(out_dir)
    if out_dir.exists():
        if not force:
            raise FileExistsError(f"tiny model: {out_dir} exists (use force=True / --force)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with building_dir(out_dir) as tmp:
        tok = build_tokenizer(spec.vocab)
        ids = _write_tokenizer_files(tok, tmp)
        config = make_config(spec, ids)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        gen = {"bos_token_id": None, "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
               "pad_token_id": ids["<|endoftext|>"]}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
        weights = make_weights(spec)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / STAMP).write_text(build_fingerprint(spec) + "\n")
        (tmp / "README.md").write_text(
            "# onecard tiny Qwen3.5 test model (random weights)\n\n"
            f"Built by onecard.prepare.tiny with spec {json.dumps(asdict(spec))}.\n"
            "Serve text-only: `--language-model-only`. Not a language model: output is noise.\n")
    return out_dir


def models_root(root: Path | None = None) -> Path:
    """``root``, else ``$MODELS``, else ``$ONECARD_HOME/models``, else ``<repo>/models``."""
    if root is not None:
        return Path(root)
    if os.environ.get("MODELS"):
        return Path(os.environ["MODELS"])
    if os.environ.get("ONECARD_HOME"):
        return Path(os.environ["ONECARD_HOME"]) / "models"
    return Path(__file__).resolve().parents[2] / "models"


def tiny_model_dir(root: Path | None = None, spec: TinySpec = DEFAULT_SPEC) -> Path:
    name = "qwen35-tiny" if spec == DEFAULT_SPEC else f"qwen35-tiny-{spec.key()}"
    return models_root(root) / name


STAMP = "onecard-build.txt"


def build_fingerprint(spec: TinySpec) -> str:
    """Identifies what a build contains: this builder's source and the spec."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(json.dumps(asdict(spec), sort_keys=True).encode())
    return h.hexdigest()[:16]


def ensure_tiny_model(root: Path | None = None, spec: TinySpec = DEFAULT_SPEC) -> Path:
    """Path of the tiny model under the models root, building it when missing or built by
    another version of this builder (the stamp file records which)."""
    path = tiny_model_dir(root, spec)
    stamp = path / STAMP
    if (path / "model.safetensors").is_file() and stamp.is_file() \
            and stamp.read_text().strip() == build_fingerprint(spec):
        return path
    return build_tiny_model(path, spec, force=path.exists())


# --------------------------------------------------------------------------- CLI

def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: <models root>/qwen35-tiny[-<spec id>])")
    parser.add_argument("--root", type=Path, default=None,
                        help="models root (default: $MODELS, $ONECARD_HOME/models, <repo>/models)")
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    parser.add_argument("--drafter", action="store_true",
                        help="also write the tiny DFlash2 drafter beside the model (<out>-dflash2)")
    for f in fields(TinySpec):
        opt = "--" + f.name.replace("_", "-")
        parser.add_argument(opt, type=int, default=f.default, help=f"(default {f.default})")


def run(args: argparse.Namespace) -> int:
    import sys

    spec = TinySpec(**{f.name: getattr(args, f.name) for f in fields(TinySpec)})
    try:
        spec.validate()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out or tiny_model_dir(args.root, spec)
    if out.exists() and not args.force and (out / "model.safetensors").is_file():
        print(f"tiny model exists: {out} (use --force to rebuild)")
    else:
        t0 = time.monotonic()
        build_tiny_model(out, spec, force=out.exists())
        size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
        print(f"tiny model: {out}  {size / 2**20:.1f} MiB  built in {time.monotonic() - t0:.1f} s")
    if getattr(args, "drafter", False):
        from onecard.dflash.tiny_drafter import ensure_tiny_drafter

        draft = ensure_tiny_drafter(out)  # DFlash2 format, rebuilt when the target changed
        print(f"tiny DFlash2 drafter: {draft}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make_tiny_model", description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))
