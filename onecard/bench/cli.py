"""`onecard bench ...`: benchmarks with provenance and the fairness contract.

  onecard bench ladder --url http://127.0.0.1:18020 --n 1,2,4,8 --out 256 --reps 2 [--shared]
  onecard bench depth --contexts 1000,8000,32000
  onecard bench prefix-turns --context 8000 --turns 3
  onecard bench needle --contexts 2000,8000 --depths 0.1,0.5,0.9
  onecard bench perplexity --prompts prose
  onecard bench spec --prompts prose,code,copy
  onecard bench run CONFIG.yaml                     (declarative: every run in the file)
  onecard bench suite single|batch [--prefill] [--long] [--size smoke] [--label L]
                                                    (bench/run_benchmarks.sh; + report)
  onecard bench ab --knob ONECARD_X --a 0 --b 1 --boots 2 [--server-cmd "bash start_qwen.sh"]
  onecard bench compare A.json B.json [--knob NAME] (the contract's verdict on a comparison)
  onecard bench report RESULTS_DIR... --md report.md [--plot ladder.png]
  onecard bench reference --tier quick|full ...     (bench/reference.sh: patched vs stock, one table)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .config import api_key_from, default_url

SUBS = ("ladder", "depth", "prefix-turns", "needle", "perplexity", "spec", "run", "suite", "ab",
        "compare", "report", "reference")


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=default_url(),
                   help="server base URL (default %(default)s: $ONECARD_BENCH_URL, else the launcher's PORT)")
    p.add_argument("--model", default=None, help="served model name (default: the first in /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--api-key-env", default="ONECARD_API_KEY",
                   help="environment variable holding the API key (default %(default)s; "
                        "unset: the launcher's VLLM_API_KEY)")
    p.add_argument("--results", default="bench-results", help="result directory (default %(default)s)")
    p.add_argument("--label", default=None)
    p.add_argument("--warmup", type=int, default=1, help="warmup requests discarded (default 1)")
    p.add_argument("--interval", type=float, default=0.25, help="/metrics cadence in s (default 0.25)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="let requests stop at EOS (output lengths then vary; default: fixed lengths)")


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_cmd", metavar="BENCH")
    p = sub.add_parser("ladder", help="concurrency ladder (aggregate + per stream)")
    _server_args(p)
    p.add_argument("--n", type=_ints, default=[1, 2, 4, 8])
    p.add_argument("--out", type=int, default=256, help="output tokens per request")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--prompts", default="prose")
    p.add_argument("--shared", action="store_true", help="all streams use the same prompt")
    p = sub.add_parser("depth", help="decode and TTFT at context depths (salted)")
    _server_args(p)
    p.add_argument("--contexts", type=_ints, default=[1000, 4000])
    p.add_argument("--out", type=int, default=128)
    p = sub.add_parser("prefix-turns", help="same document, K turns, TTFT each")
    _server_args(p)
    p.add_argument("--context", type=int, default=4000)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--out", type=int, default=64)
    p = sub.add_parser("needle", help="passphrase recall at depths")
    _server_args(p)
    p.add_argument("--contexts", type=_ints, default=[2000])
    p.add_argument("--depths", type=_floats, default=[0.1, 0.5, 0.9])
    p.add_argument("--out", type=int, default=24)
    p = sub.add_parser("perplexity", help="teacher-forced perplexity of a prompt set")
    _server_args(p)
    p.add_argument("--prompts", default="prose")
    p = sub.add_parser("spec", help="speculation acceptance per position by prompt class")
    _server_args(p)
    p.add_argument("--prompts", default="prose,code,copy")
    p.add_argument("--out", type=int, default=128)
    p = sub.add_parser("run", help="every run of a YAML/JSON config")
    p.add_argument("config")
    p.add_argument("--results", default=None, help="override out_dir of the config")
    p = sub.add_parser("suite", help="the named suites (single-user / batch), then the report")
    p.add_argument("mode", choices=("single", "batch"))
    p.add_argument("--prefill", action="store_true", help="add the context-depth / TTFT slope axis")
    p.add_argument("--long", action="store_true", help="add 64k-128k depth, long needle, 96k turns")
    p.add_argument("--size", default="default", help="default | smoke (every axis, small: test models)")
    p.add_argument("--label", default=None, help="result label (default: the mode)")
    p.add_argument("--url", default=default_url())
    p.add_argument("--model", default=None)
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--api-key-env", default="ONECARD_API_KEY")
    p.add_argument("--results", default="bench-results")
    p = sub.add_parser("ab", help="boot-per-arm A/B on one env knob, with the boot floor")
    _server_args(p)
    p.add_argument("--knob", required=True)
    p.add_argument("--a", required=True)
    p.add_argument("--b", required=True)
    p.add_argument("--boots", type=int, default=2)
    p.add_argument("--server-cmd", default="bash start_qwen.sh")
    p.add_argument("--n", type=_ints, default=[1])
    p.add_argument("--out", type=int, default=128)
    p.add_argument("--prompts", default="prose")
    p.add_argument("--figure", default="per_stream_decode_tps")
    p.add_argument("--boot-timeout", type=float, default=600)
    p = sub.add_parser("compare", help="the fairness verdict on two result files")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--knob", default=None, help="the one config key allowed to differ")
    p = sub.add_parser("report", help="markdown report from result files/directories")
    p.add_argument("paths", nargs="+")
    p.add_argument("--md", default=None, help="write the markdown here (default: print)")
    p.add_argument("--plot", default=None, help="ladder plot PNG (needs matplotlib)")
    p = sub.add_parser("reference", help="patched vs stock reference run, one table (bench/reference.sh)")
    from .reference import configure as reference_configure
    reference_configure(p)


def _first_model(args) -> str:
    from .client import Client
    key = api_key_from(args.api_key_env)
    try:
        return Client(args.url, "?", api_key=key).get_json("/v1/models")["data"][0]["id"]
    except Exception as exc:  # noqa: BLE001
        raise SystemExit(f"onecard bench: cannot read /v1/models at {args.url} ({exc}); pass --model")


def _target(args):
    from .runner import DEFAULT_SAMPLING, Target
    key = api_key_from(args.api_key_env)
    model = args.model or _first_model(args)
    sampling = dict(DEFAULT_SAMPLING, temperature=args.temperature)
    if args.no_ignore_eos:
        sampling["ignore_eos"] = False
    return Target(url=args.url, model=model, api_key=key, endpoint=args.endpoint,
                  out_dir=args.results, warmup=args.warmup, metrics_interval=args.interval,
                  sampling=sampling, label=args.label, argv=list(sys.argv))


def _done(res: dict) -> int:
    print(f"{res.get('kind')}: {res.get('verdict')} "
          f"{'; '.join(res.get('verdict_reasons') or [])} -> {res.get('path')}")
    return 0 if res.get("verdict") in ("VALID", "RESOLVED") else 1


def run(args: argparse.Namespace) -> int:
    from . import prompts as P
    from . import runner
    cmd = getattr(args, "bench_cmd", None)
    if cmd is None:
        print(f"onecard bench: give a benchmark; valid: {', '.join(SUBS)}", file=sys.stderr)
        return 2
    try:
        if cmd == "ladder":
            return _done(runner.ladder(_target(args), P.load(args.prompts), args.n, args.out, args.reps, args.shared))
        if cmd == "depth":
            return _done(runner.depth(_target(args), args.contexts, args.out))
        if cmd == "prefix-turns":
            return _done(runner.prefix_turns(_target(args), args.context, args.turns, args.out))
        if cmd == "needle":
            return _done(runner.needle(_target(args), args.contexts, args.depths, args.out))
        if cmd == "perplexity":
            return _done(runner.perplexity(_target(args), P.load(args.prompts)))
        if cmd == "spec":
            return _done(runner.spec(_target(args), [P.load(x) for x in args.prompts.split(",")], args.out))
        if cmd == "run":
            from . import config
            cfg = config.load(args.config)
            t = config.target_from(cfg, argv=list(sys.argv), out_dir=args.results)
            rcs = [_done(r) for r in config.execute(cfg, t)]
            return max(rcs) if rcs else 0
        if cmd == "suite":
            from . import config
            from .report import write_report
            model = args.model or _first_model(args)
            cfg = config.suite(args.mode, args.url, model, args.results, args.prefill, args.long,
                               args.endpoint, args.api_key_env, args.size, args.label)
            t = config.target_from(cfg, argv=list(sys.argv))
            results = config.execute(cfg, t)
            rcs = [_done(r) for r in results]
            md = os.path.join(args.results, f"report-{args.mode}.md")
            write_report([r["path"] for r in results if r.get("path")], md,
                         os.path.join(args.results, f"ladder-{args.mode}.png"))
            print(f"report: {md}")
            return max(rcs) if rcs else 0
        if cmd == "ab":
            from .ab import run_ab
            t = _target(args) if args.model else _ab_target(args)
            return _done(run_ab(t, args.server_cmd, args.knob, args.a, args.b, args.boots,
                                P.load(args.prompts), tuple(args.n), args.out, 1, args.figure,
                                args.boot_timeout))
        if cmd == "reference":
            from .reference import run_args
            return run_args(args)
        if cmd == "compare":
            from .fairness import compare
            a, b = (json.loads(open(p, encoding="utf-8").read()) for p in (args.a, args.b))
            v = compare(a, b, knob=args.knob)
            print(f"{v.status}" + "".join(f"\n  - {r}" for r in v.reasons))
            for k, (x, y) in (v.details.get("differs") or {}).items():
                print(f"  differs: {k}: {x!r} -> {y!r}")
            return 0 if v.status == "OK" else 1
        if cmd == "report":
            from .report import write_report, load_results, markdown, plot_ladders
            if args.md:
                text = write_report(args.paths, args.md, args.plot)
            else:
                res = load_results(args.paths)
                text = markdown(res)
                if args.plot:
                    plot_ladders(res, args.plot)
            print(text)
            return 0
    except (ValueError, OSError) as exc:
        print(f"onecard bench {cmd}: {exc}", file=sys.stderr)
        return 2
    print(f"onecard bench: unknown benchmark {cmd!r}; valid: {', '.join(SUBS)}", file=sys.stderr)
    return 2


def _ab_target(args):
    """A/B boots the server itself: the model name cannot be read before the first boot."""
    raise SystemExit("onecard bench ab: pass --model (the server is not up before the first boot)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="onecard bench", description=__doc__.splitlines()[0])
    configure(parser)
    return int(run(parser.parse_args(argv)) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
