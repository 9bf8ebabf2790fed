"""A tiny random DFlash2-format drafter for the tiny Qwen3.5 test model (onecard.prepare.tiny).

Same format as the published DFlash2 drafters (docs/dflash2.md): ``config.json`` with
``architectures: ["DFlash2DraftModel"]`` and a ``dflash_config`` (block_size, mask_token_id,
target_layer_ids, conv_kernel_size, conv_group_size, selector_rank, selector_top_k), and one
``model.safetensors`` (bf16) with the tensor names of ``onecard.dflash.drafter.tensor_shapes``:
no embed_tokens / lm_head (the drafter uses the target's). Random weights: acceptance is
meaningless, but shapes, loading, the verify path and exactness are all exercised.

Seeded and deterministic (each tensor from its own generator seeded by (seed, name)); written
atomically with ``building_dir``, one tensor at a time (``onecard.prepare.st.Writer``).
``ensure_tiny_drafter()`` builds it once beside the tiny model.

``--geometry 27b`` (``build_geometry_drafter``): the same writer with the published
z-lab/Qwen3.8-27B-DFlash2 drafter's shapes (``GEOMETRY_27B_DRAFTER``: 5 layers, 32 q / 8 kv heads
x 128, intermediate 17408, block 8, target_layer_ids [5, 19, 33, 47, 61], conv 2 / 16, selector
rank 256 / top-k 16, mask 248070; hidden / vocab from the target: 5120 / 248,320), random bf16
weights drawn on the GPU when CUDA is available (~1.92 B params, 3.58 GiB), for the
27B-geometry checkpoint of ``onecard.prepare.geometry`` ($MODELS/qwen38-27b-geom-dflash2, gpu job 20).
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
    # None: spread over the target (default_target_layers) / the target's <|video_pad|> id /
    # the target's max_position_embeddings
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    max_position_embeddings: int | None = None


DEFAULT_DRAFTER = TinyDrafterSpec()

# The published Qwen3.8-27B DFlash2 drafter (docs/dflash2.md section 1, *quoted* fields;
# tests/dflash/dflash_helpers.PUBLISHED). max_position_embeddings is not quoted: 262144 (the
# target's native context) so the drafter's rotary cache covers any served MAX_LEN (vLLM sizes
# it from the drafter's own config; only eagle/eagle3 drafts get it raised to the target's).
GEOMETRY_27B_DRAFTER = TinyDrafterSpec(
    layers=5, heads=32, kv_heads=8, head_dim=128, intermediate=17408, block_size=8,
    conv_group_size=16, selector_rank=256, selector_top_k=16, sliding_window=2048,
    num_target_features=5, seed=0, target_layer_ids=(5, 19, 33, 47, 61), mask_token_id=248070,
    max_position_embeddings=262144)
GEOMETRY_DRAFTERS = {"27b": GEOMETRY_27B_DRAFTER}


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
    mask = spec.mask_token_id if spec.mask_token_id is not None else target_config.get("video_token_id")
    if mask is None:
        raise ValueError("tiny drafter: target config has no video_token_id for the mask token")
    layer_ids = (list(spec.target_layer_ids) if spec.target_layer_ids is not None
                 else default_target_layers(tc["num_hidden_layers"], spec.num_target_features))
    cfg = {
        "architectures": [ARCH_V2],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dflash_config": {
            "block_size": spec.block_size,
            "conv_group_size": spec.conv_group_size,
            "conv_kernel_size": 2,
            # <|video_pad|>: a real row of the target's embedding that text never produces
            # (or the spec's: the published drafter's 248070).
            "mask_token_id": mask,
            "selector_rank": spec.selector_rank,
            "selector_top_k": spec.selector_top_k,
            "target_layer_ids": layer_ids,
        },
        "dtype": "bfloat16",
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": spec.intermediate,
        "is_causal": False,
        "max_position_embeddings": (spec.max_position_embeddings
                                    or tc.get("max_position_embeddings", 32768)),
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


def iter_weights(cfg: DrafterConfig, seed: int, device: str = "cpu"):
    """(name, bf16 tensor on ``device``) in ``tensor_shapes`` order, one at a time. The numbers
    depend on the device's generator (CPU and CUDA draws differ; each is deterministic)."""
    import torch

    from onecard.dflash.drafter import tensor_shapes

    for name, shape in tensor_shapes(cfg).items():
        digest = hashlib.sha256(f"dflash:{seed}:{name}".encode()).digest()
        g = torch.Generator(device=device).manual_seed(
            int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        r = torch.randn(shape, generator=g, device=device)
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
        yield name, t.to(torch.bfloat16).contiguous()


STAMP = "onecard-build.txt"


def build_fingerprint(target_config: dict, spec: TinyDrafterSpec) -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(json.dumps(asdict(spec), sort_keys=True).encode())
    h.update(json.dumps(target_config, sort_keys=True).encode())
    return h.hexdigest()[:16]


def write_drafter(out_dir: Path, target_config: dict, spec: TinyDrafterSpec, readme: str,
                  device: str = "cpu") -> dict:
    """Write config.json + model.safetensors (streamed, one tensor at a time from ``device``) +
    the build stamp + README.md atomically to ``out_dir``; returns a small report."""
    import time

    from onecard.dflash.drafter import tensor_shapes
    from onecard.prepare import st

    t0 = time.monotonic()
    cfg_json = make_config(target_config, spec)
    cfg = DrafterConfig.from_dict(cfg_json)
    shapes = tensor_shapes(cfg)
    with building_dir(Path(out_dir)) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
        w = st.Writer(tmp / "model.safetensors", [(n, "BF16", list(s)) for n, s in shapes.items()],
                      metadata={"format": "pt"})
        for name, t in iter_weights(cfg, spec.seed, device):
            w.put(name, t)
            del t
        w.finish()
        (tmp / STAMP).write_text(build_fingerprint(target_config, spec) + "\n")
        (tmp / "README.md").write_text(readme)
    return {"path": str(out_dir), "bytes": w.total, "gib": round(w.total / 2**30, 2),
            "params": w.total // 2, "tensors": len(shapes), "device": str(device),
            "seconds": round(time.monotonic() - t0, 1)}


def build_tiny_drafter(target_dir: Path, out_dir: Path,
                       spec: TinyDrafterSpec = DEFAULT_DRAFTER) -> Path:
    """Write the drafter for the target checkpoint at ``target_dir`` to ``out_dir``."""
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    write_drafter(Path(out_dir), target_config, spec,
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


# --------------------------------------------------------------------------- geometry drafter

# Scale-down overrides of the geometry drafter (CPU tests, dry runs); hidden / vocab are the
# target's and only apply without a target checkpoint.
GEOMETRY_OVERRIDES = ("layers", "heads", "kv_heads", "head_dim", "intermediate", "selector_rank",
                      "selector_top_k")


def geometry_drafter_dir(target_dir: Path) -> Path:
    """``<target>-dflash2`` beside the geometry checkpoint (``$MODELS/qwen38-27b-geom-dflash2``)."""
    return tiny_drafter_dir(target_dir)


def geometry_target_config(geometry: str = "27b", target_dir: Path | None = None,
                           hidden: int | None = None, vocab: int | None = None) -> dict:
    """The target config the drafter is built against: ``target_dir/config.json`` when given
    (the checkpoint job 20 built), else the fields a drafter needs from
    ``onecard.prepare.geometry.GEOMETRIES`` (layers, hidden, vocab; hidden / vocab overridable)."""
    if target_dir is not None:
        if hidden is not None or vocab is not None:
            raise ValueError("geometry drafter: --hidden/--vocab are the target's; valid: drop them "
                             "or drop --target")
        return json.loads((Path(target_dir) / "config.json").read_text())
    from onecard.prepare.geometry import GEOMETRIES

    if geometry not in GEOMETRIES:
        raise ValueError(f"unknown geometry {geometry!r}; valid: {', '.join(GEOMETRIES)}")
    g = GEOMETRIES[geometry]
    return {"text_config": {"num_hidden_layers": g["layers"], "hidden_size": hidden or g["hidden"],
                            "vocab_size": vocab or g["vocab"]}}


def geometry_drafter_spec(geometry: str = "27b", target_config: dict | None = None,
                          **overrides) -> TinyDrafterSpec:
    """``GEOMETRY_DRAFTERS[geometry]`` with scale-down overrides (``GEOMETRY_OVERRIDES``, None =
    keep). Against a scaled-down target: a mask id past its vocabulary becomes its last id, and
    target layers it does not have are replaced by ``default_target_layers``."""
    from dataclasses import replace

    if geometry not in GEOMETRY_DRAFTERS:
        raise ValueError(f"unknown geometry {geometry!r}; valid: {', '.join(GEOMETRY_DRAFTERS)}")
    bad = set(overrides) - set(GEOMETRY_OVERRIDES)
    if bad:
        raise ValueError(f"unknown override {sorted(bad)}; valid: {', '.join(GEOMETRY_OVERRIDES)}")
    spec = replace(GEOMETRY_DRAFTERS[geometry],
                   **{k: int(v) for k, v in overrides.items() if v is not None})
    if target_config is not None:
        tc = target_config.get("text_config", target_config)
        vocab, n = tc["vocab_size"], tc["num_hidden_layers"]
        if spec.mask_token_id is not None and spec.mask_token_id >= vocab:
            spec = replace(spec, mask_token_id=vocab - 1)
        if spec.target_layer_ids is not None and spec.target_layer_ids[-1] >= n:
            # a scaled-down target: spread the captured layers over what it has
            spec = replace(spec, target_layer_ids=None,
                           num_target_features=max(1, min(spec.num_target_features, n - 2)))
    return spec


def build_geometry_drafter(out_dir: Path, geometry: str = "27b", *, target_dir: Path | None = None,
                           device: str | None = None, force: bool = False, log=print,
                           hidden: int | None = None, vocab: int | None = None,
                           config_only: bool = False, **overrides) -> dict:
    """The geometry drafter at ``out_dir`` (random bf16 weights drawn on ``device``: cuda when
    available, else cpu). Skipped (report ``skipped: True``) when ``out_dir`` holds a build with
    the same stamp (builder + spec + target config) and not ``force``. ``config_only``: only
    config.json, no weights and no stamp, without torch (launcher dry runs read nothing else)."""
    import time

    t0 = time.monotonic()
    target_config = geometry_target_config(geometry, target_dir, hidden, vocab)
    spec = geometry_drafter_spec(geometry, target_config, **overrides)
    out_dir = Path(out_dir)
    if config_only:
        cfg_json = make_config(target_config, spec)
        with building_dir(out_dir) as tmp:
            (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
        log(f"geometry drafter {geometry}: {out_dir}  config.json only (no weights)")
        return {"path": str(out_dir), "skipped": False, "config_only": True, "bytes": 0,
                "seconds": round(time.monotonic() - t0, 1)}
    stamp = out_dir / STAMP
    if (not force and (out_dir / "model.safetensors").is_file() and stamp.is_file()
            and stamp.read_text().strip() == build_fingerprint(target_config, spec)):
        size = (out_dir / "model.safetensors").stat().st_size
        log(f"geometry drafter exists: {out_dir} (same build stamp; --force rebuilds)")
        return {"path": str(out_dir), "skipped": True, "bytes": size, "gib": round(size / 2**30, 2),
                "seconds": round(time.monotonic() - t0, 1)}
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    tgt = str(target_dir) if target_dir is not None else f"the built-in {geometry} geometry"
    readme = (f"# onecard {geometry}-geometry DFlash2 drafter (random weights)\n\n"
              "The published z-lab/Qwen3.8-27B-DFlash2 drafter's format and shapes (docs/dflash2.md), "
              f"random bf16 weights; target: {tgt}.\nSpec {json.dumps(asdict(spec))}.\n"
              "Serve with SPEC=dflash2 DRAFT=<this dir> MODEL=<the geometry checkpoint>. Acceptance "
              "is ~0 (random weights): for step cost and loading only.\n")
    rep = write_drafter(out_dir, target_config, spec, readme, device)
    rep.update(geometry=geometry, skipped=False, seconds=round(time.monotonic() - t0, 1))
    log(f"geometry drafter {geometry}: {out_dir}  {rep['gib']:.2f} GiB, {rep['params']:,} params, "
        f"{rep['tensors']} tensors, built in {rep['seconds']:.1f} s on {device}")
    return rep


def main(argv: list[str] | None = None) -> int:
    """``python -m onecard.dflash.tiny_drafter [--target DIR] [--out DIR] [--features N]``;
    ``--geometry 27b [--target GEOM_DIR] [--out DIR] [--device cuda|cpu] [--report JSON]
    [--force] [--config-only] [scale-down overrides]``: the geometry drafter (default out: <target>-dflash2, else
    $MODELS/qwen38-27b-geom-dflash2)."""
    import argparse
    import sys
    import time

    ap = argparse.ArgumentParser(prog="tiny_drafter", description=__doc__.splitlines()[0])
    ap.add_argument("--geometry", default=None,
                    help=f"build the geometry drafter instead ({', '.join(GEOMETRY_DRAFTERS)}): the "
                         "published 27B DFlash2 drafter's shapes, random weights")
    ap.add_argument("--device", default=None, help="--geometry: cuda (default when available) or cpu")
    ap.add_argument("--force", action="store_true", help="--geometry: rebuild even when built")
    ap.add_argument("--report", type=Path, default=None, help="--geometry: write the JSON report here")
    ap.add_argument("--config-only", action="store_true",
                    help="--geometry: write only config.json (launcher dry runs; no torch needed)")
    for k in GEOMETRY_OVERRIDES + ("hidden", "vocab"):
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                        help="--geometry scale-down override (testing)")
    ap.add_argument("--target", type=Path, default=None,
                    help="tiny target checkpoint (default: build/find the default tiny model)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output dir (default: <target>-dflash2, cached by build stamp)")
    ap.add_argument("--features", type=int, default=DEFAULT_DRAFTER.num_target_features,
                    help="captured target layers (default %(default)s)")
    ap.add_argument("--seed", type=int, default=DEFAULT_DRAFTER.seed)
    args = ap.parse_args(argv)
    if args.geometry is not None:
        from onecard.prepare.st import atomic_write_text
        from onecard.prepare.tiny import models_root

        out = args.out or (geometry_drafter_dir(args.target) if args.target is not None
                           else models_root() / f"qwen38-{args.geometry}-geom-dflash2")
        try:
            rep = build_geometry_drafter(
                out, args.geometry, target_dir=args.target, device=args.device, force=args.force,
                hidden=args.hidden, vocab=args.vocab, config_only=args.config_only,
                **{k: getattr(args, k) for k in GEOMETRY_OVERRIDES})
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.report:
            atomic_write_text(args.report, json.dumps(rep, indent=2) + "\n")
        return 0
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
