"""`onecard launch` / `python -m onecard.launch`: env knobs -> plan -> preflight -> exec vllm serve.

``--dry-run`` prints the plan table and the exact argv and exits 0; ``--json`` prints the plan as
JSON. Neither imports vllm (CTX=huge imports torch, for the KVarN stage geometry of the memory model). The API key reaches the child only through its environment.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="print the plan and argv, do not start")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON, do not start")
    parser.add_argument("--root", default=os.environ.get("ONECARD_ROOT", "."),
                        help="directory holding .env and api_key.txt (default: current directory)")


def _secret(name: str) -> bool:
    return any(w in name for w in ("KEY", "TOKEN", "SECRET", "PASSWORD"))


def _python() -> str:
    return sys.executable or "python3"


def _tiny_model_path() -> str:
    from onecard.prepare.tiny import ensure_tiny_model  # lazy: another module builds it

    return str(ensure_tiny_model())


def warmup_url(plan) -> str:
    """Where the warm-up reaches the server: its HOST, with a wildcard bind reached on loopback."""
    host = str(plan.get("HOST"))
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{plan.get('PORT')}"


def run(args: argparse.Namespace) -> int:
    from onecard import memory
    from onecard.plan import PlanError, format_table, make_plan, read_dotenv

    from onecard import profiles

    if not (args.dry_run or args.json) and not profiles.vllm_importable():
        # before MODEL=tiny is built and before any plan: the exec would end in ModuleNotFoundError
        print(f"onecard launch: {profiles.no_vllm_message()}", file=sys.stderr)
        return 2
    try:
        env = dict(os.environ)
        # MODEL as the plan resolves it (environment over .env), so the preflight sees its config
        model = env.get("MODEL") or read_dotenv(Path(args.root) / ".env").get("MODEL", "")
        model_path = None
        geom = None
        if model == "tiny" and not (args.dry_run or args.json):
            model_path = _tiny_model_path()
        probe = model_path or model
        if probe and probe != "tiny" and (Path(probe) / "config.json").is_file():
            try:
                geom = memory.ModelGeometry.from_model_dir(probe)
            except ValueError as e:
                print(f"onecard launch: note: {e}; using the 27B geometry for the memory model", file=sys.stderr)
                # still check MAX_LEN against the checkpoint's own max context (preflight step 0)
                try:
                    limit, src = memory.config_max_len(json.loads((Path(probe) / "config.json").read_text()))
                except (ValueError, AttributeError):  # not JSON, or not a JSON object
                    limit, src = None, ""
                if limit is not None:
                    geom = dataclasses.replace(memory.QWEN38_27B, max_model_len=limit, max_model_len_source=src)
        plan = make_plan(env, args.root, _python(), model_path, geom,
                         check_paths=not (args.dry_run or args.json))
    except PlanError as e:
        print(f"onecard launch: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_json(), indent=2, default=str))
        return 0
    print(format_table(plan))
    print("argv: " + shlex.join(plan.argv))
    if plan.child_env:
        # values shown except secrets (the API key, tokens)
        from onecard.plan import OOM_HINT_ENV

        shown = {k: "***" if _secret(k) else "(this plan in one line, logged after an out-of-memory error)"
                 if k == OOM_HINT_ENV else v for k, v in plan.child_env.items()}
        print("child env: " + ", ".join(f"{k}={v}" for k, v in sorted(shown.items())))
    if args.dry_run:
        return 0
    sys.stdout.flush()
    child_env = {**os.environ, **plan.child_env}
    if plan.get("WARMUP") == "1":
        from onecard.warmup import fork_warmup

        fork_warmup(warmup_url(plan), str(plan.get("SERVED_NAME")), plan.api_key,
                    chunk=int(plan.get("PREFILL_CHUNK")))
    os.execvpe(plan.argv[0], plan.argv, child_env)
    return 1  # not reached


def main(argv: list[str] | None = None) -> int:
    from onecard.profiles import KNOBS

    parser = argparse.ArgumentParser(
        prog="onecard launch", description=__doc__.splitlines()[0],
        epilog=("Configuration is by environment variables (or .env), e.g. CTX=long SPEC=dflash2 ./start_qwen.sh. "
                f"Knobs: {', '.join(KNOBS)}. Each knob's values and default: single-user/README.md "
                "(or --dry-run, which prints them with where each value came from)."))
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
