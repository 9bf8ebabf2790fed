"""The ``--geometry 27b`` test checkpoint: Qwen3.8-27B shapes, random weights, W4A16 body.

Shapes (``GEOMETRY_27B``): 64 layers in the 3:1 Gated DeltaNet / full-attention pattern, hidden
5120, MLP intermediate 17408, 24 query / 4 KV heads of 256 (query projection doubled for the
output gate), GDN 16 key / 48 value heads of 128, conv kernel 4, vocab 248,320, one MTP layer.
Tensor names and the config come from :mod:`onecard.prepare.tiny` (same architecture), so the
two test models never disagree on the layout. Unlike tiny (32,768), the config carries the real
model's max context, ``max_position_embeddings`` 262,144 (``MAX_POSITION_EMBEDDINGS``), so every CTX
profile boots on it; an existing checkpoint built with 32,768 is updated in place by the CLI.

Packed like the public AutoRound checkpoint: compressed-tensors ``pack-quantized``, int4,
symmetric, group 128, one config group targeting ``Linear``. What stays bf16, and why (from
vLLM 0.27.1's qwen3_5 / qwen_gdn_linear_attn loaders):

- ``embed_tokens`` and ``lm_head`` (the requantization steps exist to shrink them);
- norms, ``A_log``, ``dt_bias`` (parameters, not linear layers);
- ``linear_attn.conv1d`` (a ColumnParallelLinear created without a quant config; a
  ``re:.*conv1d$`` ignore entry keeps that explicit);
- ``linear_attn.in_proj_a`` / ``in_proj_b`` (fused to ``in_proj_ba``, 2 x 48 rows: too narrow for
  the Marlin W4A16 kernels; ignored);
- the MTP module (bf16 in the published checkpoint; ``quant_mtp.py`` requantizes it);
- the (one-block) vision tower; serve with ``--language-model-only``.

Quantized tensors are drawn directly as int4 codes on the device (uniform over [-8, 7]) with
per-group scales sized for 1/sqrt(fan_in) weights, so nothing is quantized on the host. Rows of
``lm_head`` beyond the tokenizer's size are zero, so greedy decoding only emits ids the (tiny,
borrowed) tokenizer can decode; ``config.json`` keeps vocab_size 248,320.

The checkpoint is written streaming: shards of ``--shard-gb`` (default 5), one tensor at a
time from the device to the file, into a temp directory renamed into place at the end.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import shutil
import sys
import time
from pathlib import Path

from onecard.prepare.atomic import building_dir

from onecard.prepare import quant, st

GEOMETRY_27B = dict(
    layers=64, full_attention_interval=4, hidden=5120, intermediate=17408, heads=24, kv_heads=4,
    head_dim=256, linear_key_heads=16, linear_value_heads=48, linear_head_dim=128, conv_kernel=4,
    vocab=248320, mtp_layers=1, seed=0,
)
GEOMETRIES = {"27b": GEOMETRY_27B}
# The real model's max context (text_config.max_position_embeddings, and the tokenizer's
# model_max_length): Qwen3.5/3.6-27B-class configs say 262,144, which the CTX=huge (245,760) and
# single-user (256,000) profiles need; vLLM refuses a longer --max-model-len than the config's
# (without VLLM_ALLOW_LONG_MAX_MODEL_LEN). tiny's config writer keeps its own 32,768.
MAX_POSITION_EMBEDDINGS = {"27b": 262_144}
IGNORE = ["re:.*lm_head$", "re:.*embed_tokens$", "re:.*visual.*", "re:.*mtp.*",
          "re:.*in_proj_a$", "re:.*in_proj_b$", "re:.*in_proj_ba$", "re:.*conv1d$"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
QUANTIZED_LEAVES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                              "in_proj_qkv", "in_proj_z", "out_proj"})


def spec_for(geometry: str, **overrides):
    """A TinySpec-shaped spec (not validated against tiny's small-model limits)."""
    from onecard.prepare.tiny import TinySpec

    if geometry not in GEOMETRIES:
        raise ValueError(f"unknown geometry {geometry!r}; valid: {', '.join(GEOMETRIES)}")
    fields = dict(GEOMETRIES[geometry])
    for k, v in overrides.items():
        if v is not None:
            if k not in fields:
                raise ValueError(f"unknown override {k!r}; valid: {', '.join(fields)}")
            fields[k] = int(v)
    spec = TinySpec(**fields)
    if spec.layers % spec.full_attention_interval:
        raise ValueError(f"layers ({spec.layers}) must be a multiple of {spec.full_attention_interval}")
    if spec.heads % spec.kv_heads or spec.linear_value_heads % spec.linear_key_heads:
        raise ValueError("heads must be a multiple of kv_heads, GDN value heads of key heads")
    if spec.vocab % 128:
        raise ValueError(f"vocab {spec.vocab} must be a multiple of 128")
    return spec


def is_quantized(name: str, shape) -> bool:
    """Body Linear weights packed W4A16 (see the module docstring for what stays bf16)."""
    if not name.endswith(".weight") or len(shape) != 2:
        return False
    if not name.startswith("model.language_model.layers."):
        return False
    return name[: -len(".weight")].rsplit(".", 1)[-1] in QUANTIZED_LEAVES


def plan(spec) -> list[tuple[str, str, list[int], str]]:
    """Output tensors: (name, dtype code, shape, source name) in write order."""
    from onecard.prepare.tiny import tensor_shapes

    out = []
    for name, shape in tensor_shapes(spec).items():
        if is_quantized(name, shape):
            rows, cols = shape
            if cols % quant.GROUP_SIZE:
                raise ValueError(f"{name}: input dim {cols} not a multiple of {quant.GROUP_SIZE}")
            mod = name[: -len(".weight")]
            out += [(mod + ".weight_packed", "I32", [rows, quant.packed_cols(cols, 4)], name),
                    (mod + ".weight_scale", "BF16", [rows, cols // quant.GROUP_SIZE], name),
                    (mod + ".weight_shape", "I64", [2], name)]
        else:
            code = "F32" if name.endswith("A_log") else "BF16"
            out.append((name, code, list(shape), name))
    return out


def quantization_config() -> dict:
    return {
        "config_groups": {"group_0": quant.config_group(["Linear"], 4)},
        "format": "pack-quantized",
        "ignore": list(IGNORE),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "provider": "onecard-geometry",
    }


def make_config(spec, ids: dict[str, int], geometry: str, live_vocab: int) -> dict:
    """config.json: tiny's config writer at this geometry's shapes, W4A16 quantization config,
    the real model's max context."""
    from onecard.prepare import tiny

    config = tiny.make_config(spec, ids)
    config.pop("onecard_tiny", None)
    config["dtype"] = "bfloat16"
    config["text_config"]["vocab_size"] = spec.padded_vocab
    config["text_config"]["max_position_embeddings"] = MAX_POSITION_EMBEDDINGS[geometry]
    config["quantization_config"] = quantization_config()
    config["onecard_geometry"] = {"geometry": geometry, "spec": dataclasses.asdict(spec), "live_vocab": live_vocab,
                                  "note": "random weights; lm_head rows >= live_vocab are zero"}
    return config


def _set_tokenizer_max_length(model_dir: Path, n: int) -> bool:
    """tokenizer_config.json's model_max_length := n (the borrowed tiny tokenizer says 32,768).
    True when the file changed."""
    p = model_dir / "tokenizer_config.json"
    if not p.is_file():
        return False
    cfg = json.loads(p.read_text())
    if cfg.get("model_max_length") == n:
        return False
    cfg["model_max_length"] = n
    st.atomic_write_text(p, json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return True


def refresh_max_context(model_dir: Path, geometry: str = "27b") -> list[str]:
    """An existing checkpoint built before MAX_POSITION_EMBEDDINGS (it said 32,768): set its
    config's (and tokenizer's) max context in place instead of rebuilding ~17 GiB. What changed."""
    model_dir = Path(model_dir)
    if geometry not in MAX_POSITION_EMBEDDINGS:
        raise ValueError(f"unknown geometry {geometry!r}; valid: {', '.join(MAX_POSITION_EMBEDDINGS)}")
    n = MAX_POSITION_EMBEDDINGS[geometry]
    changed = []
    p = model_dir / "config.json"
    cfg = json.loads(p.read_text())
    text = cfg.get("text_config", cfg)
    old = text.get("max_position_embeddings")
    if old != n:
        text["max_position_embeddings"] = n
        st.atomic_write_text(p, json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        changed.append(f"config.json max_position_embeddings {old} -> {n}")
    if _set_tokenizer_max_length(model_dir, n):
        changed.append(f"tokenizer_config.json model_max_length -> {n}")
    return changed


def _gen(name: str, seed: int, device):
    import torch

    d = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(d[:8], "little") & ((1 << 63) - 1))


def make_tensor(name: str, code: str, shape: list[int], src: str, spec, device, live_vocab: int):
    """One output tensor, generated on ``device``."""
    import torch

    g = _gen(src, spec.seed, device)
    depth_scale = 1.0 / math.sqrt(2.0 * (spec.layers + spec.mtp_layers))
    leaf = src.rsplit(".", 2)[-2] if src.endswith(".weight") else src.rsplit(".", 1)[-1]
    if name.endswith(".weight_shape"):
        return None  # filled by the caller (needs the source shape)
    if name.endswith(".weight_packed"):
        rows, pcols = shape
        q = torch.randint(-8, 8, (rows, pcols * 8), generator=g, device=device, dtype=torch.int8)
        return quant.pack(q, 4)
    if name.endswith(".weight_scale"):
        rows, groups = shape
        fan_in = groups * quant.GROUP_SIZE
        std_q = math.sqrt(((16 ** 2) - 1) / 12.0)  # uniform over 16 codes
        s = 1.0 / (math.sqrt(fan_in) * std_q)
        if leaf in ("o_proj", "out_proj", "down_proj"):
            s *= depth_scale
        t = s * (1.0 + 0.1 * torch.rand((rows, groups), generator=g, device=device))
        return t.to(torch.bfloat16)
    randn = lambda: torch.randn(shape, generator=g, device=device)  # noqa: E731
    if name.startswith("model.visual.") and len(shape) == 1:
        t = (1.0 if name.endswith(".weight") else 0.0) + 0.02 * randn()
    elif name.startswith("model.visual."):
        t = randn() / math.sqrt(math.prod(shape[1:]))
    elif name.endswith("A_log"):
        t = torch.log(torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=g))
    elif name.endswith("dt_bias"):
        t = 1.0 + 0.1 * randn()
    elif leaf == "norm" and ".linear_attn." in name:
        t = 1.0 + 0.05 * randn()
    elif len(shape) == 1:
        t = 0.05 * randn()
    elif leaf == "embed_tokens":
        t = randn()
    elif leaf == "lm_head":
        t = randn() * (3.0 / math.sqrt(shape[1]))
        t[live_vocab:] = 0
    elif leaf == "conv1d":
        t = randn() / math.sqrt(shape[-1])
    else:
        t = randn() / math.sqrt(shape[1])
        if leaf in ("o_proj", "out_proj", "down_proj"):
            t = t * depth_scale
    return t.to(st.torch_dtype(code))


def _tokenizer_dir(tokenizer: Path | None, root: Path | None) -> Path:
    if tokenizer is not None:
        return Path(tokenizer)
    from onecard.prepare.tiny import ensure_tiny_model

    return ensure_tiny_model(root)


def build(out_dir, geometry: str = "27b", *, tokenizer: Path | None = None, root: Path | None = None,
          device: str | None = None, shard_gb: float = 5.0, force: bool = False, log=print, **overrides) -> dict:
    """Write the checkpoint to ``out_dir`` (temp dir beside it, renamed at the end)."""
    import torch
    from tokenizers import Tokenizer

    from onecard.prepare import tiny

    spec = spec_for(geometry, **overrides)
    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        raise FileExistsError(f"{out_dir} exists (use --force to rebuild)")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.monotonic()
    tok_dir = _tokenizer_dir(tokenizer, root)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in tiny.SPECIAL_TOKENS + tiny.PLAIN_ADDED_TOKENS + tiny.VISION_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer in {tok_dir} lacks {missing}; valid: a onecard tiny-model tokenizer")
    live_vocab = min(tok.get_vocab_size(with_added_tokens=True), spec.padded_vocab)
    config = make_config(spec, ids, geometry, live_vocab)
    items = plan(spec)
    limit = int(shard_gb * 2**30)
    shards: list[list] = [[]]
    size = 0
    for it in items:
        n = math.prod(it[2]) * st.DTYPE_SIZE[it[1]]
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += n
    total = 0
    weight_map = {}
    with building_dir(out_dir) as tmp:
        for f in TOKENIZER_FILES:
            if (tok_dir / f).is_file():
                shutil.copy2(tok_dir / f, tmp / f)
        _set_tokenizer_max_length(tmp, MAX_POSITION_EMBEDDINGS[geometry])
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        shapes = tiny.tensor_shapes(spec)
        n_sh = len(shards)
        for i, group in enumerate(shards):
            fn = f"model-{i + 1:05d}-of-{n_sh:05d}.safetensors"
            w = st.Writer(tmp / fn, [(n, c, s) for n, c, s, _ in group], metadata={"format": "pt"})
            for name, code, shape, src in group:
                if name.endswith(".weight_shape"):
                    t = torch.tensor(list(shapes[src]), dtype=torch.int64)
                else:
                    t = make_tensor(name, code, shape, src, spec, device, live_vocab)
                w.put(name, t)
                weight_map[name] = fn
                del t
            w.finish()
            total += w.total
            log(f"  {fn}: {len(group)} tensors, {w.total / 2**30:.2f} GiB, {time.monotonic() - t0:.1f} s")
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        (tmp / "README.md").write_text(
            f"# onecard {geometry}-geometry test checkpoint (random weights)\n\n"
            "Built by onecard.prepare.geometry. W4A16 body (compressed-tensors pack-quantized, group 128,\n"
            "symmetric), bf16 embed/lm_head/MTP. Serve with --language-model-only. Output is noise.\n")
    secs = time.monotonic() - t0
    rep = {"path": str(out_dir), "geometry": geometry, "bytes": total, "gib": round(total / 2**30, 2),
           "seconds": round(secs, 1), "shards": len(shards), "tensors": len(weight_map), "device": str(device),
           "live_vocab": live_vocab}
    log(f"geometry {geometry}: {out_dir}  {total / 2**30:.2f} GiB in {len(shards)} shard(s), "
        f"{len(weight_map)} tensors, built in {secs:.1f} s on {device}")
    return rep


# --------------------------------------------------------------------------- CLI

OVERRIDES = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "linear_key_heads",
             "linear_value_heads", "linear_head_dim", "vocab", "mtp_layers", "seed")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometry", default="27b", help=f"valid: {', '.join(GEOMETRIES)}")
    parser.add_argument("--out", type=Path, default=None, help="output dir (default <models root>/qwen38-27b-geom)")
    parser.add_argument("--root", type=Path, default=None, help="models root (default $MODELS or <repo>/models)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="dir with tokenizer.json (default: the tiny model's, built if missing)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--shard-gb", type=float, default=5.0)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    for k in OVERRIDES:
        parser.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                            help="scale-down override (testing)")


def run(args) -> int:
    from onecard.prepare.tiny import models_root

    try:
        out = args.out or (models_root(args.root) / f"qwen38-{args.geometry}-geom")
        if out.exists() and not args.force and (out / "model.safetensors.index.json").is_file():
            fixed = refresh_max_context(out, args.geometry)
            print(f"geometry model exists: {out} (use --force to rebuild)"
                  + (f"; updated {', '.join(fixed)}" if fixed else ""))
            return 0
        rep = build(out, args.geometry, tokenizer=args.tokenizer, root=args.root, device=args.device,
                    shard_gb=args.shard_gb, force=out.exists(), **{k: getattr(args, k) for k in OVERRIDES})
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.report:
        st.atomic_write_text(args.report, json.dumps(rep, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make_geometry_model", description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))
