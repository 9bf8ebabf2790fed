"""Parse and validate a DFlash / DFlash2 drafter ``config.json`` (format facts: docs/dflash2.md).

Every problem raises ``DrafterConfigError`` with one line: what is wrong and what is valid.
``DrafterConfig.from_dict`` checks the drafter on its own; ``check_target`` checks it against the
target model's text config (layer count, hidden size, vocabulary).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCH_V1 = "DFlashDraftModel"
ARCH_V2 = "DFlash2DraftModel"
ARCHITECTURES = {ARCH_V1: 1, ARCH_V2: 2}
SLIDING, FULL = "sliding_attention", "full_attention"
# Keys only a DFlash2 drafter has (in ``dflash_config``).
V2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


class DrafterConfigError(ValueError):
    """A drafter config that cannot be served; the message is one line."""


def _bad(msg: str) -> DrafterConfigError:
    return DrafterConfigError(f"dflash drafter config: {msg}")


def _int(d: dict, key: str, where: str, lo: int = 1, hi: int | None = None) -> int:
    if key not in d:
        raise _bad(f"{where}{key} missing; valid: an integer >= {lo}")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise _bad(f"{where}{key}={v!r} invalid; valid: an integer {rng}")
    return v


@dataclass(frozen=True)
class DrafterConfig:
    version: int                    # 1 = DFlash, 2 = DFlash2 (conv + selector)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    block_size: int                 # rows of one drafter pass: anchor + (block_size - 1) masks
    mask_token_id: int
    target_layer_ids: tuple[int, ...]   # 0-based target decoder layers whose OUTPUT is captured
    target_hidden_size: int
    layer_types: tuple[str, ...]    # per drafter layer: sliding_attention | full_attention
    sliding_window: int | None
    conv_kernel_size: int = 0       # DFlash2 only
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    # ------------------------------------------------------------------ derived
    @property
    def draft_tokens(self) -> int:
        """Tokens one drafter pass proposes (the anchor row predicts nothing)."""
        return self.block_size - 1

    @property
    def has_selector(self) -> bool:
        return self.version == 2

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size if self.version == 2 else 0

    @property
    def fc_in(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden_size

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "DrafterConfig":
        if not isinstance(cfg, dict):
            raise _bad("config is not a JSON object")
        archs = cfg.get("architectures")
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise _bad(f"architectures={archs!r} invalid; valid: [\"{ARCH_V2}\"] or [\"{ARCH_V1}\"]")
        version = ARCHITECTURES[archs[0]]
        dc = cfg.get("dflash_config")
        if not isinstance(dc, dict):
            raise _bad("dflash_config missing; valid: an object with block_size, mask_token_id, "
                       "target_layer_ids")
        if cfg.get("is_causal", False):
            raise _bad("is_causal=true invalid; valid: false (the draft block is non-causal)")
        if dc.get("causal", False):
            raise _bad("dflash_config.causal=true invalid; valid: false or absent")

        hidden = _int(cfg, "hidden_size", "")
        layers = _int(cfg, "num_hidden_layers", "")
        heads = _int(cfg, "num_attention_heads", "")
        kv_heads = _int(cfg, "num_key_value_heads", "")
        if heads % kv_heads:
            raise _bad(f"num_attention_heads={heads} not a multiple of num_key_value_heads={kv_heads}")
        head_dim = cfg.get("head_dim", hidden // heads)
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
            raise _bad(f"head_dim={head_dim!r} invalid; valid: an even integer >= 2")
        inter = _int(cfg, "intermediate_size", "")
        vocab = _int(cfg, "vocab_size", "")
        eps = cfg.get("rms_norm_eps", 1e-6)
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
            raise _bad(f"rms_norm_eps={eps!r} invalid; valid: a number in (0, 1)")
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta"))
        if theta is None:
            raise _bad("rope theta missing; valid: rope_parameters.rope_theta (or rope_theta) > 0")
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
            raise _bad(f"rope_theta={theta!r} invalid; valid: a number > 0")
        rtype = rope.get("rope_type", "default")
        if rtype != "default":
            raise _bad(f"rope_parameters.rope_type={rtype!r} unsupported; valid: default")

        block = _int(dc, "block_size", "dflash_config.", lo=2, hi=64)
        mask = _int(dc, "mask_token_id", "dflash_config.", lo=0)
        if mask >= vocab:
            raise _bad(f"dflash_config.mask_token_id={mask} outside vocab_size={vocab}; "
                       f"valid: 0..{vocab - 1}")
        tl = dc.get("target_layer_ids")
        if (not isinstance(tl, list) or not tl
                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in tl)):
            raise _bad(f"dflash_config.target_layer_ids={tl!r} invalid; valid: a non-empty list "
                       "of 0-based target layer indices")
        if sorted(set(tl)) != list(tl):
            raise _bad(f"dflash_config.target_layer_ids={tl} invalid; valid: strictly increasing")
        t_hidden = cfg.get("target_hidden_size") or hidden
        if not isinstance(t_hidden, int) or isinstance(t_hidden, bool) or t_hidden < 1:
            raise _bad(f"target_hidden_size={t_hidden!r} invalid; valid: an integer >= 1")

        # attention layout: layer_types wins; else use_sliding_window puts every layer on the window
        lt = cfg.get("layer_types")
        window = cfg.get("sliding_window")
        if lt is None:
            lt = [SLIDING if cfg.get("use_sliding_window", False) else FULL] * layers
        if not isinstance(lt, list) or len(lt) != layers or any(t not in (SLIDING, FULL) for t in lt):
            raise _bad(f"layer_types={lt!r} invalid; valid: {layers} entries of "
                       f"{SLIDING}|{FULL}")
        if SLIDING in lt:
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise _bad(f"sliding_window={window!r} invalid with sliding layers; valid: an "
                           "integer >= 1")
        else:
            window = None

        extra: dict[str, int] = {}
        if version == 2:
            for k in V2_KEYS:
                extra[k] = _int(dc, k, "dflash_config.")
            if extra["conv_kernel_size"] != 2:
                raise _bad(f"dflash_config.conv_kernel_size={extra['conv_kernel_size']} "
                           "unsupported; valid: 2 (the two-tap block convolution)")
            if hidden % extra["conv_group_size"]:
                raise _bad(f"dflash_config.conv_group_size={extra['conv_group_size']} does not "
                           f"divide hidden_size={hidden}")
            if extra["selector_top_k"] > vocab:
                raise _bad(f"dflash_config.selector_top_k={extra['selector_top_k']} > "
                           f"vocab_size={vocab}")
        else:
            present = [k for k in V2_KEYS if k in dc]
            if present:
                raise _bad(f"{ARCH_V1} with DFlash2 keys {present}; valid: architectures "
                           f"[\"{ARCH_V2}\"]")

        return cls(version=version, hidden_size=hidden, num_layers=layers, num_heads=heads,
                   num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=inter,
                   rms_norm_eps=float(eps), rope_theta=float(theta), vocab_size=vocab,
                   block_size=block, mask_token_id=mask, target_layer_ids=tuple(tl),
                   target_hidden_size=t_hidden, layer_types=tuple(lt), sliding_window=window,
                   **extra)

    @classmethod
    def load(cls, path: str | Path) -> "DrafterConfig":
        """From a drafter directory (or its config.json)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            raw = json.loads(p.read_text())
        except FileNotFoundError:
            raise _bad(f"{p} not found; valid: a drafter directory with config.json") from None
        except json.JSONDecodeError as e:
            raise _bad(f"{p} is not JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(raw)

    # ------------------------------------------------------------------ target checks
    def check_target(self, text_config: dict[str, Any]) -> None:
        """Check against the target's text config (``text_config`` of Qwen3_5 configs)."""
        tc = text_config.get("text_config", text_config)
        n = tc.get("num_hidden_layers")
        if isinstance(n, int) and self.target_layer_ids[-1] >= n:
            # id = the OUTPUT of decoder layer id; vLLM asks the target for aux layer id + 1
            # (Qwen3.5/Qwen3-Next record aux j after layer j - 1 runs, j = 1..n).
            raise _bad(f"dflash_config.target_layer_ids={list(self.target_layer_ids)} reaches "
                       f"layer {self.target_layer_ids[-1]}; valid with a {n}-layer target: "
                       f"0..{n - 1}")
        h = tc.get("hidden_size")
        if isinstance(h, int) and h != self.target_hidden_size:
            raise _bad(f"target_hidden_size={self.target_hidden_size} but the target's "
                       f"hidden_size={h}; valid: {h}")
        if isinstance(h, int) and h != self.hidden_size:
            raise _bad(f"hidden_size={self.hidden_size} but the target's hidden_size={h}: the "
                       "drafter embeds with the target's embed_tokens; valid: equal sizes")
        v = tc.get("vocab_size")
        if isinstance(v, int) and v != self.vocab_size:
            raise _bad(f"vocab_size={self.vocab_size} but the target's vocab_size={v}; valid: {v}")

    def check_tokens(self, dflash_tokens: int) -> int:
        """Lookup-lane width for a verify block of ``dflash_tokens`` drafts (>= 0)."""
        if dflash_tokens < self.draft_tokens:
            raise _bad(f"DFLASH_TOKENS={dflash_tokens} < the drafter's {self.draft_tokens} draft "
                       f"tokens (block_size {self.block_size}); valid: >= {self.draft_tokens}")
        return dflash_tokens - self.draft_tokens


# --------------------------------------------------------------------------- checkpoint layout

def tensor_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Tensor names (as stored, no prefix) and shapes of a drafter checkpoint."""
    h, hd = cfg.hidden_size, cfg.head_dim
    s: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.fc_in),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        s[p + "input_layernorm.weight"] = (h,)
        s[p + "post_attention_layernorm.weight"] = (h,)
        s[p + "self_attn.q_proj.weight"] = (cfg.num_heads * hd, h)
        s[p + "self_attn.k_proj.weight"] = (cfg.num_kv_heads * hd, h)
        s[p + "self_attn.v_proj.weight"] = (cfg.num_kv_heads * hd, h)
        s[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * hd)
        s[p + "self_attn.q_norm.weight"] = (hd,)
        s[p + "self_attn.k_norm.weight"] = (hd,)
        s[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        s[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        s[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
        if cfg.version == 2:
            k, g = cfg.conv_kernel_size, cfg.conv_groups
            for conv in ("attention_conv", "mlp_conv"):
                s[f"{p}{conv}.base_kernel"] = (2, k, h)
                s[f"{p}{conv}.kernel_projection.weight"] = (2 * k * g, h)
    if cfg.version == 2:
        r = cfg.selector_rank
        s["candidate_selector.hidden_projection.weight"] = (r, h)
        s["candidate_selector.predecessor_codebook"] = (cfg.vocab_size, r)
        s["candidate_selector.successor_codebook"] = (cfg.vocab_size, r)
    return s


# Stored prefixes seen on drafter checkpoints; stripped on load.
PREFIXES = ("model.", "dflash.")


def check_layout(shapes: dict[str, tuple[int, ...]], cfg: DrafterConfig) -> dict[str, str]:
    """A checkpoint's tensors ({stored name: shape}, from the tensors or their safetensors
    headers) against ``tensor_shapes(cfg)``: {stored name: name without prefix}. Stored prefixes
    (``PREFIXES``) are stripped, as the reference loader and patch 0080's model do. Extra
    ``embed_tokens`` / ``lm_head`` tensors are allowed (some drafters ship them), and so are the
    draft-vocabulary maps ``d2t`` / ``t2d`` (0.27.1's DFlash loader maps or skips them; they are
    not in the result); any other unknown tensor, a wrong shape or a missing tensor is a
    DrafterConfigError (one line), so a format we do not implement is not half-loaded."""
    want = tensor_shapes(cfg)
    keys: dict[str, str] = {}
    for name, shape in shapes.items():
        if name.split(".")[-1] in ("d2t", "t2d"):
            continue
        key = name
        for pre in PREFIXES:
            if key.startswith(pre):
                key = key[len(pre):]
        if key in want:
            if tuple(shape) != want[key]:
                raise DrafterConfigError(f"dflash drafter: {name} has shape {tuple(shape)}; "
                                         f"the config needs {want[key]}")
        elif key.split(".")[0] not in ("embed_tokens", "lm_head"):
            raise DrafterConfigError(f"dflash drafter: unknown tensor {name} (not in the "
                                     f"DFlash{'2' if cfg.version == 2 else ''} layout)")
        keys[name] = key
    missing = sorted(set(want) - set(keys.values()))
    if missing:
        raise DrafterConfigError(f"dflash drafter: {len(missing)} tensors missing, first "
                                 f"{missing[0]}")
    return keys
