"""The `onecard` command: one sub-command per module, imported only when used.

Each module named in COMMANDS exposes ``configure(parser)`` (add its arguments) and
``run(args) -> int`` (the exit status). Importing a module must stay cheap: vLLM and torch
are imported inside ``run`` where needed, so `onecard --help` works on a bare machine.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "patches": ("onecard.patching", "apply / check / revert / status of the vLLM patch series"),
    "verify": ("onecard.verify", "check the installation (--no-server) or a running server"),
    "launch": ("onecard.launch", "plan, preflight and exec `vllm serve` from env knobs"),
    "prepare": ("onecard.prepare.cli", "model preparation: requantize, draft vocab, test models"),
    "bench": ("onecard.bench.cli", "benchmarks with provenance"),
    "service": ("onecard.service", "run the server as a systemd user service (install / uninstall / status)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="onecard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"onecard: unknown command {argv[0]!r}; valid: {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    cmd_parser = argparse.ArgumentParser(prog=f"onecard {name}", description=COMMANDS[name][1])
    module.configure(cmd_parser)
    args = cmd_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
