"""A tiny random DFlash2-format drafter for the tiny Qwen3.5 test model (onecard.prepare.tiny).

Same format as the published DFlash2 drafters (docs/dflash2.md): ``config.json`` with
``architectures: ["DFlash2DraftModel"]`` and a ``dflash_config`` (block_size, mask_token_id,
target_layer_ids, conv_kernel_size, conv_group_size, selector_rank, selector_top_k), and one
``model.safetensors`` (bf16) with the tensor names of ``onecard.dflash.drafter.tensor_shapes``:
no embed_tokens / lm_head (the drafter uses the target's). Random weights: acceptance is
meaningless, but shapes, loading, the verify path and exactness are all exercised.

Seeded and deterministic (each tensor from its own generator seeded by (seed, name)); written
atomically with ``building_dir``. ``ensure_tiny_drafter()`` builds it once beside the tiny model.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from onecard.dflash.config import ARCH_V2, DrafterConfig
from onecard.prepare.atomic import building_dir


@dataclass(frozen=True)
class TinyDrafterSpec:
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    block_size: int = 8              # anchor + 7 drafts, as the published Qwen3.8-27B drafter
    conv_group_size: int = 16
    selector_rank: int = 32
    selector_top_k: int = 8
    sliding_window: int = 64         # small, so CPU/GPU tests cross the window
    num_target_features: int = 3     # captured target layers
    seed: int = 0


DEFAULT_DRAFTER = TinyDrafterSpec()


def default_target_layers(n_layers: int, count: int) -> list[int]:
    """Evenly spread in 1..n_layers-2: any of 0..n-1 is capturable, the spread mirrors the
    published drafters (first id > 0, last below the final layer)."""
    hi = n_layers - 2
    if count < 1 or hi < 1:
        raise ValueError(f"tiny drafter: cannot pick {count} target layers of {n_layers}")
    if count == 1:
        return [hi]
    ids = sorted({round(1 + i * (hi - 1) / (count - 1)) for i in range(count)})
    if len(ids) != count:
        raise ValueError(f"tiny drafter: {n_layers} target layers too few for {count} features")
    return ids


def make_config(target_config: dict, spec: TinyDrafterSpec = DEFAULT_DRAFTER) -> dict:
    tc = target_config.get("text_config", target_config)
    hidden, vocab = tc["hidden_size"], tc["vocab_size"]
    mask = target_config.get("video_token_id")
    if mask is None:
        raise ValueError("tiny drafter: target config has no video_token_id for the mask token")
    cfg = {
        "architectures": [ARCH_V2],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dflash_config": {
            "block_size": spec.block_size,
            "conv_group_size": spec.conv_group_size,
            "conv_kernel_size": 2,
            # <|video_pad|>: a real row of the target's embedding that text never produces.
            "mask_token_id": mask,
            "selector_rank": spec.selector_rank,
            "selector_top_k": spec.selector_top_k,
            "target_layer_ids": default_target_layers(tc["num_hidden_layers"],
                                                      spec.num_target_features),
        },
        "dtype": "bfloat16",
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": spec.intermediate,
        "is_causal": False,
        "max_position_embeddings": tc.get("max_position_embeddings", 32768),
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "num_target_layers": tc["num_hidden_layers"],
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
        "sliding_window": spec.sliding_window,
        "target_hidden_size": hidden,
        "tie_word_embeddings": False,
        "use_sliding_window": True,
        "vocab_size": vocab,
        "onecard_tiny_drafter": asdict(spec),
    }
    DrafterConfig.from_dict(cfg).check_target(tc)
    return cfg


def make_weights(cfg: DrafterConfig, seed: int) -> dict:
    import torch

    from onecard.dflash.drafter import tensor_shapes

    out = {}
    for name, shape in tensor_shapes(cfg).items():
        digest = hashlib.sha256(f"dflash:{seed}:{name}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        r = torch.randn(shape, generator=g)
        if name.endswith("base_kernel"):
            t = 0.1 * r
            t[:, 0] += 1.0                              # tap 0 ~ identity, tap 1 small
        elif name.endswith("norm.weight"):
            t = 1.0 + 0.05 * r                          # plain RMSNorm weight (Qwen3 style)
        elif "kernel_projection" in name:
            t = 0.02 * r / math.sqrt(shape[1])
        elif "codebook" in name:
            t = r / math.sqrt(shape[1])
        else:
            t = r / math.sqrt(shape[1])
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t = t / math.sqrt(2 * cfg.num_layers)
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


STAMP = "onecard-build.txt"


def build_fingerprint(target_config: dict, spec: TinyDrafterSpec) -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(json.dumps(asdict(spec), sort_keys=True).encode())
    h.update(json.dumps(target_config, sort_keys=True).encode())
    return h.hexdigest()[:16]


def build_tiny_drafter(target_dir: Path, out_dir: Path,
                       spec: TinyDrafterSpec = DEFAULT_DRAFTER) -> Path:
    """Write the drafter for the target checkpoint at ``target_dir`` to ``out_dir``."""
    from safetensors.torch import save_file

    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    cfg_json = make_config(target_config, spec)
    cfg = DrafterConfig.from_dict(cfg_json)
    with building_dir(Path(out_dir)) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
        save_file(make_weights(cfg, spec.seed), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / STAMP).write_text(build_fingerprint(target_config, spec) + "\n")
        (tmp / "README.md").write_text(
            "# onecard tiny DFlash2 drafter (random weights)\n\n"
            f"For the tiny Qwen3.5 model at {Path(target_dir).name}; spec "
            f"{json.dumps(asdict(spec))}.\nServe with SPEC=dflash2 DRAFT=<this dir>. Acceptance "
            "is meaningless (random weights); shapes, loading and exactness are not.\n")
    return Path(out_dir)


def tiny_drafter_dir(target_dir: Path) -> Path:
    target_dir = Path(target_dir)
    return target_dir.with_name(target_dir.name + "-dflash2")


def ensure_tiny_drafter(target_dir: Path | None = None,
                        spec: TinyDrafterSpec = DEFAULT_DRAFTER) -> Path:
    """The drafter beside the tiny model (built once; rebuilt when the builder or target
    changed). ``target_dir`` defaults to ``onecard.prepare.tiny.ensure_tiny_model()``."""
    if target_dir is None:
        from onecard.prepare.tiny import ensure_tiny_model

        target_dir = ensure_tiny_model()
    target_dir = Path(target_dir)
    out = tiny_drafter_dir(target_dir)
    target_config = json.loads((target_dir / "config.json").read_text())
    stamp = out / STAMP
    if (out / "model.safetensors").is_file() and stamp.is_file() \
            and stamp.read_text().strip() == build_fingerprint(target_config, spec):
        return out
    return build_tiny_drafter(target_dir, out, spec)


def main(argv: list[str] | None = None) -> int:
    """``python -m onecard.dflash.tiny_drafter [--target DIR] [--out DIR] [--features N]``."""
    import argparse
    import time

    ap = argparse.ArgumentParser(prog="tiny_drafter", description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=None,
                    help="tiny target checkpoint (default: build/find the default tiny model)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output dir (default: <target>-dflash2, cached by build stamp)")
    ap.add_argument("--features", type=int, default=DEFAULT_DRAFTER.num_target_features,
                    help="captured target layers (default %(default)s)")
    ap.add_argument("--seed", type=int, default=DEFAULT_DRAFTER.seed)
    args = ap.parse_args(argv)
    from dataclasses import replace

    spec = replace(DEFAULT_DRAFTER, num_target_features=args.features, seed=args.seed)
    t0 = time.monotonic()
    if args.out is None:
        out = ensure_tiny_drafter(args.target, spec)
    else:
        target = args.target
        if target is None:
            from onecard.prepare.tiny import ensure_tiny_model

            target = ensure_tiny_model()
        out = build_tiny_drafter(target, args.out, spec)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"tiny drafter: {out}  {size / 2**20:.2f} MiB  in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
