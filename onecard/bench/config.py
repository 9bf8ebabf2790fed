"""Declarative run config (YAML or JSON): one server, defaults, a list of runs.

    server:   {url: http://127.0.0.1:18020, model: qwen, endpoint: completions,
               api_key_env: ONECARD_API_KEY}
    out_dir:  bench-results
    label:    fast-profile
    sampling: {temperature: 0.0, ignore_eos: true}
    warmup:   1
    metrics_interval: 0.25
    runs:
      - {kind: ladder, prompts: prose, n: [1, 2, 4, 8], max_tokens: 256, reps: 2}
      - {kind: depth, contexts: [1000, 8000], max_tokens: 128}
      - {kind: prefix_turns, context_tokens: 8000, turns: 3}
      - {kind: needle, contexts: [2000], depths: [0.1, 0.5, 0.9]}
      - {kind: perplexity, prompts: prose}
      - {kind: spec, prompts: [prose, code, copy], max_tokens: 128}
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .runner import DEFAULT_SAMPLING, KINDS, Target

TOP_KEYS = {"server", "out_dir", "label", "sampling", "warmup", "metrics_interval", "runs"}
SERVER_KEYS = {"url", "model", "endpoint", "api_key_env"}
RUN_KEYS = {
    "ladder": {"prompts", "n", "max_tokens", "reps", "shared"},
    "depth": {"contexts", "max_tokens"},
    "prefix_turns": {"context_tokens", "turns", "max_tokens"},
    "needle": {"contexts", "depths", "max_tokens"},
    "perplexity": {"prompts"},
    "spec": {"prompts", "max_tokens"},
}


class ConfigError(ValueError):
    pass


def _load_text(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return json.loads(text)
    import yaml
    return yaml.safe_load(text)


def load(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config {p} not found")
    cfg = _load_text(p)
    validate(cfg, str(p))
    return cfg


def validate(cfg: Any, where: str = "config") -> None:
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: top level must be a mapping with keys {sorted(TOP_KEYS)}")
    bad = set(cfg) - TOP_KEYS
    if bad:
        raise ConfigError(f"{where}: unknown key(s) {sorted(bad)}; valid: {sorted(TOP_KEYS)}")
    srv = cfg.get("server")
    if not isinstance(srv, dict) or "url" not in srv or "model" not in srv:
        raise ConfigError(f"{where}: 'server' must be a mapping with at least url and model")
    bad = set(srv) - SERVER_KEYS
    if bad:
        raise ConfigError(f"{where}: unknown server key(s) {sorted(bad)}; valid: {sorted(SERVER_KEYS)}")
    if srv.get("endpoint", "completions") not in ("completions", "chat"):
        raise ConfigError(f"{where}: server.endpoint {srv['endpoint']!r} invalid; valid: completions, chat")
    runs = cfg.get("runs")
    if not isinstance(runs, list) or not runs:
        raise ConfigError(f"{where}: 'runs' must be a non-empty list")
    for i, r in enumerate(runs):
        if not isinstance(r, dict) or r.get("kind") not in KINDS:
            raise ConfigError(f"{where}: runs[{i}].kind must be one of {', '.join(KINDS)}")
        bad = set(r) - RUN_KEYS[r["kind"]] - {"kind"}
        if bad:
            raise ConfigError(f"{where}: runs[{i}] ({r['kind']}): unknown key(s) {sorted(bad)}; "
                              f"valid: {sorted(RUN_KEYS[r['kind']])}")


def api_key_from(env_name: str | None, environ=None) -> str | None:
    """The API key from the variable ``env_name``; with the default name (ONECARD_API_KEY) unset,
    the launcher's own VLLM_API_KEY, so a bench against ./start_qwen.sh with a key needs no flag."""
    environ = os.environ if environ is None else environ
    if not env_name:
        return None
    key = environ.get(env_name)
    if not key and env_name == "ONECARD_API_KEY":
        key = environ.get("VLLM_API_KEY")
    return key.strip() if key else None


def default_url(environ=None) -> str:
    """$ONECARD_BENCH_URL, else the launcher's server: http://127.0.0.1:$PORT (default 18020)."""
    environ = os.environ if environ is None else environ
    return environ.get("ONECARD_BENCH_URL") or f"http://127.0.0.1:{environ.get('PORT') or 18020}"


def target_from(cfg: dict, argv: list[str] | None = None, out_dir: str | None = None) -> Target:
    srv = cfg["server"]
    key_env = srv.get("api_key_env")
    return Target(url=srv["url"], model=srv["model"], endpoint=srv.get("endpoint", "completions"),
                  api_key=api_key_from(key_env),
                  out_dir=out_dir or cfg.get("out_dir", "bench-results"),
                  warmup=int(cfg.get("warmup", 1)),
                  metrics_interval=float(cfg.get("metrics_interval", 0.25)),
                  sampling=dict(cfg.get("sampling") or DEFAULT_SAMPLING),
                  label=cfg.get("label"), argv=argv)


def execute(cfg: dict, target: Target) -> list[dict]:
    """Run every entry of ``runs`` in order; returns the result dicts (each already on disk)."""
    from . import prompts as P
    from . import runner
    results = []
    for r in cfg["runs"]:
        kind = r["kind"]
        if kind == "ladder":
            res = runner.ladder(target, P.load(r.get("prompts", "prose")), list(r.get("n", [1, 2, 4, 8])),
                                int(r.get("max_tokens", 256)), int(r.get("reps", 2)), bool(r.get("shared", False)))
        elif kind == "depth":
            res = runner.depth(target, list(r.get("contexts", [1000, 4000])), int(r.get("max_tokens", 128)))
        elif kind == "prefix_turns":
            res = runner.prefix_turns(target, int(r.get("context_tokens", 4000)), int(r.get("turns", 3)),
                                      int(r.get("max_tokens", 64)))
        elif kind == "needle":
            res = runner.needle(target, list(r.get("contexts", [2000])), list(r.get("depths", [0.1, 0.5, 0.9])),
                                int(r.get("max_tokens", 24)))
        elif kind == "perplexity":
            res = runner.perplexity(target, P.load(r.get("prompts", "prose")))
        else:
            names = r.get("prompts", ["prose", "code", "copy"])
            names = [names] if isinstance(names, str) else names
            res = runner.spec(target, [P.load(n) for n in names], int(r.get("max_tokens", 128)))
        results.append(res)
    return results


SIZES = ("default", "smoke")


def suite(mode: str, url: str, model: str, out_dir: str, prefill: bool = False, long: bool = False,
          endpoint: str = "completions", api_key_env: str | None = "ONECARD_API_KEY",
          size: str = "default", label: str | None = None) -> dict:
    """The named suites of bench/run_benchmarks.sh, as a config (validated like a file).

    ``size="smoke"``: every axis of the single-user suite at sizes a small test model answers in
    about a minute and that fit an 8,192-token context (SmolLM2's) even with a small-vocabulary
    tokenizer (~2.6 chars/token: 4,000 estimated tokens ~ 6,200 real ones); not with --long."""
    if mode not in ("single", "batch"):
        raise ConfigError(f"suite {mode!r} invalid; valid: single, batch")
    if size not in SIZES:
        raise ConfigError(f"suite size {size!r} invalid; valid: {', '.join(SIZES)}")
    if size == "smoke" and (mode != "single" or long):
        raise ConfigError("suite size smoke is the single-user suite without --long; valid: single [--prefill] --size smoke")
    runs: list[dict] = []
    if size == "smoke":
        runs += [
            {"kind": "ladder", "prompts": "prose", "n": [1, 2, 4, 8], "max_tokens": 64, "reps": 1},
            {"kind": "ladder", "prompts": "code", "n": [1], "max_tokens": 64, "reps": 1},
            {"kind": "spec", "prompts": ["prose", "code", "copy"], "max_tokens": 64},
            {"kind": "perplexity", "prompts": "prose"},
            {"kind": "prefix_turns", "context_tokens": 2000, "turns": 3, "max_tokens": 16},
            {"kind": "needle", "contexts": [2000], "depths": [0.1, 0.5, 0.9]},
        ]
        if prefill:
            runs.append({"kind": "depth", "contexts": [256, 1024, 4000], "max_tokens": 32})
    elif mode == "single":
        runs += [
            {"kind": "ladder", "prompts": "prose", "n": [1, 2, 4, 8], "max_tokens": 256, "reps": 2},
            {"kind": "ladder", "prompts": "code", "n": [1], "max_tokens": 256, "reps": 2},
            {"kind": "spec", "prompts": ["prose", "code", "copy"], "max_tokens": 128},
            {"kind": "perplexity", "prompts": "prose"},
            {"kind": "prefix_turns", "context_tokens": 8000, "turns": 3, "max_tokens": 64},
            {"kind": "needle", "contexts": [4000], "depths": [0.1, 0.5, 0.9]},
        ]
    else:
        runs += [
            {"kind": "ladder", "prompts": "chat", "n": [1, 2, 4, 8, 16, 32], "max_tokens": 256, "reps": 1},
            {"kind": "ladder", "prompts": "prose", "n": [8, 16], "max_tokens": 256, "reps": 1, "shared": True},
        ]
    if prefill and size == "default":
        runs.append({"kind": "depth", "contexts": [1000, 4000, 16000, 32000], "max_tokens": 64})
    if long:
        runs += [
            {"kind": "depth", "contexts": [65536, 131072], "max_tokens": 128},
            {"kind": "needle", "contexts": [32000, 96000], "depths": [0.1, 0.5, 0.9]},
            {"kind": "prefix_turns", "context_tokens": 96000, "turns": 2, "max_tokens": 64},
        ]
    cfg = {"server": {"url": url, "model": model, "endpoint": endpoint,
                      **({"api_key_env": api_key_env} if api_key_env else {})},
           "out_dir": out_dir, "label": label or mode, "runs": runs}
    validate(cfg, f"suite {mode}")
    return cfg
