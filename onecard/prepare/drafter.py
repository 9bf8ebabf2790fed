"""`onecard prepare drafter [ID|PATH]`: fetch and check the DFlash2 drafter SPEC=dflash2 needs.

What ``./install.sh --drafter [ID|PATH]`` runs. The drafter is used as published (bf16; the
launcher's ``DRAFT_QUANT`` decides at each boot whether vLLM quantizes part of it to FP8 while
loading), so there is nothing to requantize: the steps are

1. **fetch**: the same as ``onecard prepare model`` (``huggingface_hub.snapshot_download`` into
   the Hugging Face cache, resumable, ``HF_HUB_OFFLINE=1`` respected; every file hard-linked, or
   copied, into the destination by atomic rename; a local directory is checked in place, or
   linked/copied to ``--dest``). Default destination: the launcher's ``DRAFT``
   (``models/dflash2-drafter``), so ``SPEC=dflash2 ./start_qwen.sh`` finds it without a knob.
2. **check**: ``config.json`` is a DFlash2 drafter (``onecard.dflash.config``), every tensor the
   config implies is in the safetensors headers with its shape (nothing unknown, nothing
   missing), and, when the target checkpoint is there (``--target``, default the launcher's
   ``MODEL``), the drafter fits it (hidden size, vocabulary, target layers). A second run
   checks again and changes nothing.

Every failure is one line naming what is valid; nothing half-fetched is ever used (the
destination's ``.onecard/prepare.json`` says what was fetched, and a fetch resumes).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from onecard.prepare import model as prep

# The DFlash2 drafter published for Qwen3.8-27B (docs/dflash2.md section 1: its config as quoted;
# re-check the real download's config.json, which this command does).
DEFAULT_DRAFTER_ID = "z-lab/Qwen3.8-27B-DFlash2"
REPO = Path(__file__).resolve().parents[2]


class DrafterError(prep.PrepareError):
    """One line, naming what is valid."""


def launcher_default_draft() -> Path:
    """Where the launcher looks for the drafter without DRAFT= (its knob's default)."""
    from onecard.profiles import KNOBS

    p = Path(KNOBS["DRAFT"].default).expanduser()
    return p if p.is_absolute() else REPO / p


def launcher_default_target() -> Path:
    """The launcher's MODEL without MODEL= (the target a drafter is checked against)."""
    p = Path(prep.launcher_default_model()).expanduser()
    return p if p.is_absolute() else REPO / p


def headers(d: Path) -> dict[str, dict]:
    """{tensor name: header entry} over every *.safetensors of ``d`` (headers only, no torch)."""
    from onecard.memory import tensor_headers

    out = tensor_headers(d)
    if not out:
        raise DrafterError(f"{d}: no *.safetensors; valid: a DFlash2 drafter checkpoint (config.json + "
                           f"model.safetensors), e.g. {DEFAULT_DRAFTER_ID}")
    return out


def check(d: Path, target: Path | None) -> dict:
    """The drafter at ``d`` as the launcher and patch 0080 will read it; returns its summary.
    DrafterError (one line) when it cannot serve SPEC=dflash2."""
    from onecard import memory
    from onecard.dflash.config import DrafterConfig, DrafterConfigError, check_layout

    try:
        cfg = DrafterConfig.load(d)
    except (DrafterConfigError, OSError, ValueError) as e:
        raise DrafterError(f"{d}: {e}") from None
    if cfg.version != 2:
        raise DrafterError(f"{d} is a DFlash (v1) drafter; valid for SPEC=dflash2: a DFlash2DraftModel drafter "
                           f"(e.g. {DEFAULT_DRAFTER_ID})")
    hdr = headers(d)
    try:
        check_layout({name: tuple(meta["shape"]) for name, meta in hdr.items()}, cfg)
    except DrafterConfigError as e:
        raise DrafterError(f"{d}: {e}; valid: the complete checkpoint (re-run to resume a download, or delete "
                           f"{d} and fetch again)") from None
    checked = None
    if target is not None and (target / "config.json").is_file():
        try:
            cfg.check_target(json.loads((target / "config.json").read_text()))
        except DrafterConfigError as e:
            raise DrafterError(f"{d} does not fit the target {target}: {e}") from None
        checked = str(target)
    dtypes = sorted({meta["dtype"] for meta in hdr.values()})
    bf16 = memory.dflash_drafter_vram(d).weight_bytes
    fp8 = memory.dflash_drafter_vram(d, fp8=True).weight_bytes
    return {"dir": str(d), "layers": cfg.num_layers, "block_size": cfg.block_size, "draft_tokens": cfg.draft_tokens,
            "tensors": len(hdr), "dtypes": dtypes, "bytes": bf16, "bytes_fp8": fp8,
            "sliding_window": cfg.sliding_window, "target": checked}


def prepare(source: str, dest: Path | None = None, *, target: Path | None = None, revision: str | None = None,
            log=print) -> dict:
    """Fetch (Hub id or directory) and check; returns check()'s summary. Raises PrepareError."""
    kind, src = prep.classify(source)
    d = Path(dest).expanduser().absolute() if dest else (
        src if kind == "local" else launcher_default_draft().absolute())
    t0 = time.monotonic()
    locks: list = []
    try:
        if kind == "local" and src.resolve() == d.resolve():
            log(f"drafter: {d} (checked in place)")
        else:
            log(f"drafter: {source} -> {d}")
            prep.fetch(source, d, revision, log, locks)
        s = check(d, target)
    finally:
        for f in locks:
            f.close()
    gib = 1 << 30
    log(f"check: DFlash2 drafter, {s['layers']} layers, block {s['block_size']} ({s['draft_tokens']} drafts), "
        f"{s['tensors']} tensors ({', '.join(s['dtypes'])}), {s['bytes'] / gib:.2f} GiB as stored, "
        f"{s['bytes_fp8'] / gib:.2f} GiB with DRAFT_QUANT=fp8; "
        + (f"fits the target {s['target']}" if s["target"] else "no target checkpoint to check it against")
        + f"; {time.monotonic() - t0:.1f} s")
    if d == launcher_default_draft().absolute():
        log("next: CTX=long SPEC=dflash2 ./start_qwen.sh")
    else:
        log(f"next: DRAFT={d} CTX=long SPEC=dflash2 ./start_qwen.sh")
    return s


# --------------------------------------------------------------------------- CLI


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafter", nargs="?", default=DEFAULT_DRAFTER_ID,
                        help=f"Hugging Face id or a local drafter directory (default {DEFAULT_DRAFTER_ID})")
    parser.add_argument("--dest", type=Path, default=None,
                        help="where the drafter goes (default: a local path in place; a Hub id in the launcher's "
                             "DRAFT, models/dflash2-drafter)")
    parser.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) to download")
    parser.add_argument("--target", type=Path, default=None,
                        help="the target checkpoint to check the drafter against (default: the launcher's MODEL, "
                             "models/qwen38-27b, when it is there)")


def run(args) -> int:
    target = args.target if args.target is not None else launcher_default_target()
    if args.target is not None and not (args.target / "config.json").is_file():
        print(f"error: --target {args.target} has no config.json; valid: a prepared target checkpoint directory",
              file=sys.stderr)
        return 2
    try:
        prepare(args.drafter, args.dest, target=target, revision=args.revision)
        return 0
    except prep.PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.filename or ''}: {e.strerror or e}; valid: a writable destination with free disk",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing half-done is used; re-run the same command to resume", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="onecard prepare drafter", description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
