"""The reference performance run: patched vs stock vLLM on one GPU, one command, one table.

Each arm is the same launcher (``python -m onecard.launch``: env knobs -> plan -> ``vllm serve``)
with its own PYTHONPATH: ``patched`` = the installed, patched vLLM; ``stock`` = the pristine copy
first on the path. Every boot uses the CTX profile's 3090 ``KV_MEM`` pin (a 24 GB card's pool,
emulated on any larger GPU) and the same knobs, so the two arms differ only in the patch series.

Per boot the existing benchmarks of :mod:`onecard.bench.runner` run (ladder, depth,
prefix_turns, spec), each writing its own result JSON with provenance and a fairness verdict;
this module reads figures out of them, compares arms with :func:`fairness.compare` (declared
knob ``patch_series``; across >= 2 boots per arm with :func:`fairness.ab_verdict`), puts each
decode figure against the bandwidth roofline (:mod:`onecard.bench.roofline`) and writes one JSON
(rewritten atomically after every step) and one markdown table. A boot that fails or a server
that dies leaves its rows saying so; nothing measured before is lost.

Tiers (``TIERS``): ``quick`` (one boot per arm, essential rows, <= 6 min on a warm machine; the
mtp boots run only if the budget still fits them), ``lease`` (every row the issue asks for, one
boot per arm, sized for one 30-minute GPU lease: ~17-20 min warm; the tail is dropped by the
budget) and ``full`` (all rows, 2 boots per arm).
Random-weight checkpoints never stop on their own: requests use fixed max_tokens + ignore_eos.

The boots run from one schedule (:meth:`Reference.schedule`), printed with an estimated duration
before the first boot (``BOOT_*_S`` / ``*_TPS`` constants: H200 figures of docs/measurements.md),
in this order: the SPEC=off boots of both arms (CTX=tier.ctx: decode, prefill, prefix rows; then
the plain-step boots of each other verify CTX), the SPEC boots per method, and last the pool-only
boots of the CTX profiles no other boot covers. Boots the launcher refuses for an arm (the plan
is made with the arm's own vLLM: stock 0.27.1 has no DFlash2 and no KVarN) become skipped rows and
cost no time; every boot after the first SPEC=off ones runs only while the budget still fits it.
SPEC=dflash2 boots take ``DRAFT`` from ``--draft`` (default ``<model>-dflash2``, which job 20
builds) and ``DRAFT_QUANT=fp8`` (what a 24 GiB card's plan picks; an arm's env may set it); the patched arm's CTX=huge boots take ``--kvarn-pythonpath`` when given (a vLLM view with
KVarN installed, as jobs 61/62 make).

    python -m onecard.bench.reference --tier quick --model $MODELS/qwen38-27b-geom --md docs/performance.md
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import fairness, prompts as P, provenance, roofline
from .results import ResultFile, atomic_write_text
from .runner import DEFAULT_SAMPLING, Target, build_context
from .server import ServerProcess

RE_POOL = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
RE_CONC = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
RE_BLOCK = re.compile(r"Setting attention block size to (\d+) tokens")
RE_ERRLINE = re.compile(r"(\w*(Error|Exception)\b.*:|CUDA out of memory)")
ARM_KNOB = "patch_series"  # the one config key allowed to differ between stock and patched
SPEC_KNOB = "SPEC"
SERVED = "ref"


@dataclass(frozen=True)
class Tier:
    name: str
    decode: tuple[tuple[int, tuple[int, ...]], ...]  # (prompt tokens, concurrency levels)
    decode_tokens: int
    reps: int
    prefill: tuple[int, ...]
    verify_context: int | None  # None: no speculation rows
    verify_tokens: int
    spec: tuple[str, ...]  # SPEC values for the verify boots (mtp, dflash2)
    prefix_context: int | None
    prefix_tokens: int
    pool_ctx: tuple[str, ...]  # extra CTX profiles booted only for their pool
    boots: int
    budget_s: float
    essential: tuple[str, ...]  # row keys that must come out in every arm
    ctx: str = "fast"
    prefill_tokens: int = 8
    doc: str = ""
    verify_ctx: tuple[str, ...] = ()  # CTX profiles of the verify rows (default: ctx)
    patched_only: tuple[str, ...] = ()  # essential rows the stock arm cannot run (DFlash2, KVarN)

    @property
    def vctxs(self) -> tuple[str, ...]:
        return self.verify_ctx or (self.ctx,)


# Sizes are real tokens (calibrated to the checkpoint's tokenizer, see calibrate()). The "64k"
# rows use 60,000: the largest round size that fits CTX=fast's max_len 65,536 with the output
# and the second turn's question; the table shows the measured prompt_tokens from usage.
TIERS: dict[str, Tier] = {
    "quick": Tier(
        "quick", decode=((1000, (1, 4)),), decode_tokens=128, reps=1, prefill=(16000,),
        verify_context=1000, verify_tokens=96, spec=("mtp",), prefix_context=16000, prefix_tokens=16,
        pool_ctx=(), boots=1, budget_s=360.0,
        essential=("pool fast/off", "decode 1k C1", "decode 1k C4", "prefill 16k", "prefix 16k turn2/turn1"),
        doc="one boot per arm (CTX=fast, SPEC=off): pools, C1+C4 decode at 1k, prefill 16k, prefix "
            "2 turns at 16k; SPEC=mtp boots (verify vs plain at 1k) only if the 6-minute budget fits"),
    "full": Tier(
        "full", decode=((1000, (1, 2, 4, 8)), (32000, (1, 2, 4, 8))), decode_tokens=256, reps=2,
        prefill=(1000, 16000, 60000), verify_context=1000, verify_tokens=128, spec=("mtp", "dflash2"),
        prefix_context=60000, prefix_tokens=16, pool_ctx=("huge",), boots=2, budget_s=3600.0,
        verify_ctx=("fast", "long"),
        essential=("pool fast/off", "decode 1k C1", "decode 1k C4", "decode 32k C1", "prefill 16k",
                   "prefill 60k", "prefix 60k turn2/turn1", "verify mtp/plain"),
        doc="2 boots per arm (boot floor measured): C1/C2/C4/C8 at 1k and 32k, prefill 1k/16k/60k, "
            "SPEC=mtp and dflash2 verify on CTX=fast and CTX=long (TRITON_ATTN: where the wide-verify patch "
            "acts), prefix 2 turns at 60k, pools of every CTX profile"),
    # One 30-minute GPU lease (~27 min after the machine start): every row of issue 11, one boot
    # per arm, so the arm ratios are UNRESOLVED unless a difference exceeds what one boot resolves.
    # Verify runs on CTX=long, not fast: there the wide-verify patch acts (TRITON_ATTN), and on
    # fast the DFlash2 drafter's KV layers cap MAX_LEN at ~43k, which the common pin would impose
    # on the 60k prefill/prefix boots too. The CTX=long plain-step boots give the long pool; only
    # huge gets a pool-only boot (patched: KVarN is ours; the stock plan is refused, no time spent).
    # Warm estimate ~1,150-1,200 s for all 8 boots: budget_s 1050 keeps the lease and drops the
    # tail (dflash2, then the huge pool) when the boots run slow; --budget-s 1250 runs all of it
    # (not inside gpu/jobs/80-reference.sh, whose driver limit for this tier is 1150 s).
    "lease": Tier(
        "lease", decode=((1000, (1, 2, 4, 8)), (32000, (1, 2, 4, 8))), decode_tokens=128, reps=1,
        prefill=(1000, 16000, 60000), verify_context=1000, verify_tokens=128, spec=("mtp", "dflash2"),
        prefix_context=60000, prefix_tokens=16, pool_ctx=("huge", "long"), boots=1, budget_s=1050.0,
        verify_ctx=("long",),
        essential=("pool fast/off", "pool long/off", "pool huge/off",
                   *(f"decode {s} C{n}" for s in ("1k", "32k") for n in (1, 2, 4, 8)),
                   "prefill 1k", "prefill 16k", "prefill 60k", "prefix 60k turn2/turn1",
                   "verify mtp/plain long", "verify dflash2/plain long"),
        patched_only=("pool huge/off", "verify dflash2/plain long"),
        doc="one boot per arm, every row of issue 11, for one 30-minute GPU lease (budget 1,050 s; "
            "~1,150-1,200 s warm for all of it in session 25, less since 32k C4/C8 are not run where "
            "the pool cannot hold them): CTX=fast SPEC=off per arm (pools, C1/C2/C4/C8 at 1k "
            "and 32k, prefill 1k/16k/60k, prefix 2 turns at 60k); CTX=long plain step per arm (long "
            "pool); SPEC=mtp verify on CTX=long per arm; SPEC=dflash2 verify on CTX=long (patched only: "
            "stock 0.27.1 has no DFlash2); the CTX=huge pool (patched only: KVarN). Later boots run only "
            "while the budget fits them, in that order"),
}

# Duration estimates for the printed schedule (H200, docs/measurements.md): a 27B-geometry boot
# through the launcher took 187 s on a cold machine, 117 s warm; decode C1 ~97 tok/s, prefill
# ~11,400 tok/s at 16k (less at 60k). A pool-only boot stops at vLLM's pool line, before the
# CUDA-graph capture and the API server.
BOOT_COLD_S = 190.0
BOOT_WARM_S = 120.0
POOL_BOOT_FRACTION = 0.8
STOP_S = 5.0
PREFILL_TPS = 10_000.0
DECODE_TPS = 85.0
REQUEST_OVERHEAD_S = 1.0  # per measured window: /metrics sampler start + stop


@dataclass
class Arm:
    name: str  # stock | patched
    pythonpath: str | None
    env: dict[str, str] = field(default_factory=dict)
    skip_reason: str | None = None


@dataclass
class RefConfig:
    model: str
    tier: Tier
    out_dir: Path
    arms: list[Arm]
    md: Path | None = None
    server_cmd: str | None = None  # bash command; default: this python -m onecard.launch
    port: int | None = None
    bandwidth_gbs: float | None = None  # skip the measurement (tests)
    boot_timeout: float = 600.0
    budget_s: float | None = None
    base_env: dict[str, str] = field(default_factory=dict)
    draft: str | None = None  # DRAFT of the SPEC=dflash2 boots (None: <model>-dflash2 when it exists)
    kvarn_pythonpath: str | None = None  # the patched arm's PYTHONPATH for CTX=huge (a view with KVarN)
    argv: list[str] = field(default_factory=lambda: list(sys.argv))
    root: Path = Path(__file__).resolve().parents[2]
    log: Callable[[str], None] = lambda s: print(s, flush=True)


def _k(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 else str(n)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ASSUMED_CHARS_PER_TOKEN = 4.0  # what runner.build_context assumes


def calibrate(model_dir: str | Path) -> dict:
    """Characters per token of the checkpoint's own tokenizer on the haystack text, so a row
    named "16k" sends about 16k tokens (the 27B-geometry checkpoint borrows the tiny model's
    small-vocabulary tokenizer: ~2.6 chars/token, not 4). Falls back to 4 when the tokenizer
    cannot be read; the table shows the measured prompt tokens either way."""
    text = build_context(4000)
    try:
        from tokenizers import Tokenizer
        n = len(Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).encode(text).ids)
        return {"chars_per_token": len(text) / n, "source": f"tokenizer.json of the checkpoint ({n} tokens)"}
    except Exception as e:  # noqa: BLE001
        return {"chars_per_token": ASSUMED_CHARS_PER_TOKEN, "source": f"assumed ({type(e).__name__}: {str(e)[:80]})"}


def est(tokens: int, cal: dict | None) -> int:
    """The build_context size that yields about ``tokens`` real tokens."""
    cpt = (cal or {}).get("chars_per_token") or ASSUMED_CHARS_PER_TOKEN
    return max(1, round(tokens * cpt / ASSUMED_CHARS_PER_TOKEN))


def haystack_set(tokens: int, cal: dict | None = None) -> P.PromptSet:
    """A one-prompt set of about ``tokens`` tokens (deterministic text: same hash every run)."""
    text = build_context(est(tokens, cal)) + "\n\nContinue the story above:"
    return P.PromptSet(id=f"haystack-{_k(tokens)}", path="<onecard.bench.runner.build_context>",
                       prompts=(text,), ids=(f"haystack-{tokens}",))


def pool_levels(ns: list[int], ctx: int, out_tokens: int, pool: int | None) -> tuple[list[int], dict[int, str]]:
    """The concurrency levels worth running at ``ctx``-token prompts, and why the others are not:
    a level whose streams' KV cannot all be resident in the boot's pool (n x (prompt + output) >
    pool tokens; the prompts are salted, so nothing is shared) never decodes n streams together —
    vLLM queues the rest, and the level would spend n prefills to show that (CTX=fast's 80,827
    tokens hold two 32k streams: C4 and C8 took ~65 s an arm in session 26 for a "2 of N"
    footnote). The prompt counts as 98 % of ``ctx`` (calibrated sizes land within ~1 %), so a
    skipped level is one that certainly cannot fit; C1 always runs."""
    if not pool:
        return ns, {}
    need = int(ctx * 0.98) + out_tokens
    fits = max(1, pool // need)
    run = [n for n in ns if n == 1 or n <= fits]
    return run, {n: (f"the KV pool ({pool:,} tokens) holds {fits} stream(s) of ~{_k(ctx)} + {out_tokens} tokens, "
                     f"so {n} never decode together (not run)") for n in ns if n not in run}


def parse_boot_log(text: str) -> dict:
    m, c, b = RE_POOL.search(text), RE_CONC.search(text), RE_BLOCK.findall(text)
    return {"pool_tokens": int(m.group(1).replace(",", "")) if m else None,
            "max_concurrency": float(c.group(2)) if c else None,
            "block_size": int(b[-1]) if b else None}


def vllm_dir(pythonpath: str | None) -> Path | None:
    """The vllm package a child with this PYTHONPATH imports first (None: not on the path, so
    the child finds the same one as this process)."""
    for entry in (pythonpath or "").split(os.pathsep):
        if entry and (Path(entry) / "vllm" / "__init__.py").is_file():
            return Path(entry) / "vllm"
    return None


class _arm_features:
    """While planning for an arm: ``profiles.feature_installed`` answers for the vLLM that arm's
    launcher child will import (its PYTHONPATH), not for this process's, so a method the arm's
    vLLM lacks (stock: DFlash2, KVarN) is a plan refusal here instead of a failed boot there."""

    def __init__(self, pythonpath: str | None):
        self.dir = vllm_dir(pythonpath)

    def __enter__(self):
        from onecard import profiles
        self.orig = profiles.feature_installed
        if self.dir is not None:
            d, markers = self.dir, profiles.FEATURE_MARKERS
            profiles.feature_installed = lambda name: (d / markers[name]).is_file()
        return self

    def __exit__(self, *exc):
        from onecard import profiles
        profiles.feature_installed = self.orig
        return False


def boot_error(text: str, fallback: str) -> str:
    errs = [ln.strip() for ln in text.splitlines() if RE_ERRLINE.search(ln)]
    return (errs[-1] if errs else fallback)[:300]


# ------------------------------------------------------------------------------------ the run
class Reference:
    def __init__(self, cfg: RefConfig):
        self.cfg = cfg
        self.t0 = time.monotonic()
        self.budget = cfg.budget_s if cfg.budget_s is not None else cfg.tier.budget_s
        self.port = cfg.port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.max_boot_s = 0.0
        self.boots: list[dict] = []  # every boot, in order, with its results (paths + figures)
        self.skipped: list[dict] = []
        self.results: dict[str, dict] = {}  # result path -> result dict
        self.doc: dict[str, Any] = {}
        self.rf: ResultFile | None = None

    # -- helpers ------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def fits(self, what: str, est_s: float) -> bool:
        left = self.budget - self.elapsed()
        if est_s <= left:
            return True
        self.skip(what, f"budget: {left:.0f} s left of {self.budget:.0f} s, needs ~{est_s:.0f} s")
        return False

    def skip(self, what: str, reason: str) -> None:
        self.skipped.append({"what": what, "reason": reason})
        self.cfg.log(f"[reference] skip {what}: {reason}")
        self.save()

    def env_for(self, arm: Arm, ctx: str, spec: str) -> dict[str, str]:
        env = {"MODEL": self.cfg.model, "CTX": ctx, "SPEC": spec, "GDN_PREFILL": "triton",
               "HOST": "127.0.0.1", "PORT": str(self.port), "TOOLS": "0", "SERVED_NAME": SERVED,
               "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "EXTRA_ARGS": "--seed 0",
               # the rows warm up themselves; the launcher's own warm-up (onecard/warmup.py) would
               # run beside the first measured request
               "WARMUP": "0",
               **self.cfg.base_env, **arm.env}
        if arm.pythonpath is not None:
            env["PYTHONPATH"] = arm.pythonpath
        if ctx == "huge" and arm.name == "patched" and self.cfg.kvarn_pythonpath:
            env["PYTHONPATH"] = self.cfg.kvarn_pythonpath
        if spec == "dflash2" and "DRAFT" not in env:
            draft = self.cfg.draft or f"{self.cfg.model.rstrip('/')}-dflash2"
            if self.cfg.draft or (Path(draft) / "config.json").is_file():
                env["DRAFT"] = draft
        if spec == "dflash2" and "DRAFT_QUANT" not in env:
            # what DRAFT_QUANT=auto picks on a 24 GiB card (every dflash2 plan there); on the lent
            # GPU auto would keep bf16, nvidia-smi reporting 141 GiB. Part of the SPEC=dflash2
            # boot (the argv's speculative config records it), not of the compared server config
            env["DRAFT_QUANT"] = "fp8"
        if arm.name == "stock" and "GDN_DEFER" not in env:
            # stock 0.27.1 has no patch 0085: it keeps a GDN state per draft position whatever the
            # launcher's default (GDN_DEFER=auto: 1 with speculation on one GPU) would plan, so its
            # plan (pool, the MAX_LEN the pool holds) is made as stock sizes it
            env["GDN_DEFER"] = "0"
        return env

    def plan(self, env: dict) -> dict:
        """The launcher's plan for this env, in-process (prediction + argv), with the features of
        the vLLM on env's PYTHONPATH (:class:`_arm_features`); PlanError -> error."""
        from onecard import memory
        from onecard.plan import PlanError, make_plan
        try:
            geom = memory.ModelGeometry.from_model_dir(self.cfg.model)
        except ValueError:
            geom = None
        try:
            with _arm_features(env.get("PYTHONPATH")):
                p = make_plan(env, self.cfg.root, python="python3", geometry=geom)
        except PlanError as e:
            return {"error": str(e)}
        vals = {k: v.value for k, v in p.values.items()}
        return {"prediction": p.prediction, "argv": p.argv,
                "server_config": {k: vals.get(k) for k in ("CTX", "KV", "KV_MEM", "MAX_LEN", "MAX_SEQS",
                                                          "PREFIX_CACHE", "SSM_DTYPE", "SPEC")},
                "spec_k": vals.get("SPEC_K")}

    # -- boots ----------------------------------------------------------------------------
    def boot(self, arm: Arm, ctx: str, spec: str, idx: int, pool_only: bool,
             steps: Callable[[Target, dict], None] | None, extra_env: dict | None = None) -> dict:
        name = f"{arm.name}-{ctx}-{spec}-b{idx}"
        rec: dict[str, Any] = {"name": name, "arm": arm.name, "ctx": ctx, "spec": spec, "boot": idx,
                               "pool_only": pool_only, "results": {}, "ok": False}
        self.boots.append(rec)
        env = {**self.env_for(arm, ctx, spec), **(extra_env or {})}
        rec["plan"] = self.plan({**os.environ, **env})  # exactly what the launcher child will read
        if "error" in rec["plan"]:
            rec["skipped"] = f"the launcher refuses this plan: {rec['plan']['error']}"
            self.skip(name, rec["skipped"])
            return rec
        rec["server_env"] = {k: v for k, v in env.items() if k in provenance.KNOB_NAMES or k in
                             ("GDN_PREFILL", "TOOLS", "SERVED_NAME", "EXTRA_ARGS", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")}
        cmd = self.cfg.server_cmd or f"exec {shlex.quote(sys.executable)} -m onecard.launch"
        log_path = self.cfg.out_dir / f"server-{name}.log"
        rec["log"] = str(log_path)
        self.cfg.log(f"[reference] {self.elapsed():.0f}s boot {name}")
        srv = self._srv = ServerProcess(cmd, env=env, log_path=log_path)
        t0 = time.monotonic()
        try:
            srv.start()
            if pool_only:
                self._wait_pool(srv, log_path)
            else:
                rec["boot_s"] = srv.wait_healthy(self.url, self.cfg.boot_timeout)
                self.max_boot_s = max(self.max_boot_s, rec["boot_s"])
            rec.update(parse_boot_log(log_path.read_text(errors="replace")))
            rec["ok"] = True
            self.save()
            if steps is not None:
                t = self._target(arm, rec, name)
                steps(t, rec)
        except Exception as exc:  # noqa: BLE001 - a failed boot is a row, not a crash
            text = log_path.read_text(errors="replace") if log_path.exists() else ""
            errline = boot_error(text, "")
            rec.setdefault("error", f"{type(exc).__name__}: {exc}" + (f"; server log: {errline}" if errline else ""))
            rec.update({k: v for k, v in parse_boot_log(text).items() if v is not None})
            self.cfg.log(f"[reference] {name}: {rec['error']}")
        finally:
            srv.stop()
            rec["wall_s"] = round(time.monotonic() - t0, 1)
            self.save()
        return rec

    def _wait_pool(self, srv: ServerProcess, log_path: Path) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.cfg.boot_timeout:
            text = log_path.read_text(errors="replace") if log_path.exists() else ""
            if RE_POOL.search(text) and RE_CONC.search(text):
                return
            if srv.proc is not None and srv.proc.poll() is not None:
                raise RuntimeError(f"server exited with {srv.proc.returncode} before logging its pool")
            time.sleep(0.5)
        raise TimeoutError(f"no pool line after {self.cfg.boot_timeout:.0f} s")

    def _target(self, arm: Arm, rec: dict, label: str) -> Target:
        over: dict[str, Any] = {"arm": arm.name, "server_launch": {"argv": rec["plan"]["argv"],
                                                                  "env": rec.get("server_env"),
                                                                  "pythonpath": arm.pythonpath}}
        if arm.name == "stock":
            over["patch_series"] = {"hash": None, "source": "stock arm: pristine vLLM first on PYTHONPATH, "
                                                            "no patch applied", "series": None}
        return Target(url=self.url, model=SERVED, out_dir=str(self.cfg.out_dir / arm.name),
                      sampling=dict(DEFAULT_SAMPLING), label=label, argv=self.cfg.argv,
                      server_config=rec["plan"]["server_config"], provenance_overrides=over,
                      log=lambda s: self.cfg.log(f"  {label}: {s}"))

    def keep(self, rec: dict, key: str, res: dict) -> None:
        rec["results"][key] = {"path": res.get("path"), "verdict": res.get("verdict"),
                               "reasons": res.get("verdict_reasons")}
        if res.get("path"):
            self.results[res["path"]] = res
        self.save()
        proc = getattr(getattr(self, "_srv", None), "proc", None)
        if proc is not None and proc.poll() is not None:  # the rest of this boot cannot run
            raise RuntimeError(f"server died during '{key}' (exit {proc.returncode})")

    # -- steps ------------------------------------------------------------------------------
    def plain_steps(self, t: Target, rec: dict) -> None:
        from . import runner
        tier, cal = self.cfg.tier, self.doc.get("calibration")
        for ctx, ns in tier.decode:
            run_ns, cannot = pool_levels(list(ns), ctx, tier.decode_tokens, rec.get("pool_tokens"))
            if cannot:
                # str keys: the record goes through JSON (a rebuild reads it back)
                rec.setdefault("decode_unfit", {})[f"decode {_k(ctx)}"] = {str(k): v for k, v in cannot.items()}
                self.cfg.log(f"[reference] {rec.get('name', '')}: decode {_k(ctx)} C{', C'.join(map(str, cannot))} "
                             f"not run: {next(iter(cannot.values()))}")
            self.keep(rec, f"decode {_k(ctx)}", runner.ladder(t, haystack_set(ctx, cal), run_ns, tier.decode_tokens,
                                                              tier.reps))
        if tier.prefill:
            self.keep(rec, "prefill", runner.depth(t, [est(n, cal) for n in tier.prefill], tier.prefill_tokens))
        if tier.prefix_context:
            self.keep(rec, "prefix", runner.prefix_turns(t, est(tier.prefix_context, cal), 2, tier.prefix_tokens))
        if tier.verify_context and tier.spec and tier.ctx in tier.vctxs:
            self.verify_step(t, rec)

    def verify_step(self, t: Target, rec: dict) -> None:
        from . import runner
        tier = self.cfg.tier
        self.keep(rec, "verify", runner.spec(t, [haystack_set(tier.verify_context, self.doc.get("calibration"))],
                                             tier.verify_tokens))

    # -- the whole run ----------------------------------------------------------------------
    def run(self) -> dict:
        cfg, tier = self.cfg, self.cfg.tier
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        self.doc = {"kind": "reference", "label": f"reference-{tier.name}", "tier": dataclasses.asdict(tier),
                    "model": cfg.model, "argv": cfg.argv, "date": provenance.utc_now(),
                    "provenance": provenance.build(argv=cfg.argv, prompt_set=None, sampling=dict(DEFAULT_SAMPLING),
                                                   warmup={"policy": "per benchmark: 1 salted request discarded"}),
                    "arms": [dataclasses.asdict(a) for a in cfg.arms], "url": self.url}
        self.rf = ResultFile(cfg.out_dir, "reference", self.doc, label=tier.name)
        self.doc["path"] = str(self.rf.path)
        try:
            self._measure()
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (job timeout): the table of what was measured
            self.doc["error"] = "interrupted (SIGINT/SIGTERM)"
        except Exception as exc:  # noqa: BLE001 - keep what was measured
            self.doc["error"] = f"{type(exc).__name__}: {exc}"
        self.build()
        missing = self.doc["missing"]
        if self.doc.get("error"):
            self.rf.abort(f"aborted: {self.doc['error']}")
        else:
            self.rf.finish("VALID" if not missing else "INCOMPLETE",
                           [f"missing: {m}" for m in missing] or ["every essential row measured in every arm"])
        if cfg.md:
            atomic_write_text(cfg.md, markdown(self.doc))
        return self.doc

    def _measure(self) -> None:
        cfg, tier = self.cfg, self.cfg.tier
        arms = []
        for a in cfg.arms:
            if a.skip_reason:
                self.skip(f"arm {a.name}", a.skip_reason)
            else:
                arms.append(a)
        if cfg.bandwidth_gbs is not None:
            self.doc["bandwidth"] = {"gbps_read_plus_write": cfg.bandwidth_gbs, "method": "given (--bandwidth-gbs)"}
        else:
            self.doc["bandwidth"] = measure_bandwidth(arms[0].pythonpath if arms else None)
        self.cfg.log(f"[reference] copy bandwidth: {self.doc['bandwidth']}")
        self.doc["calibration"] = calibrate(cfg.model)
        self.cfg.log(f"[reference] chars/token: {self.doc['calibration']}")
        try:
            self.doc["step_bytes"] = roofline.step_bytes(cfg.model).as_dict()
        except (ValueError, OSError) as e:
            self.doc["step_bytes"] = {"error": str(e)}
        self.save()
        plan = self.schedule(arms)
        self.doc["schedule"] = [{k: v for k, v in b.items() if k != "arm"} | {"arm": b["arm"].name} for b in plan]
        for line in schedule_text(plan, self.budget, tier):
            self.cfg.log(f"[reference] {line}")
        self.save()
        for b in plan:
            arm, what = b["arm"], b["what"]
            if b["refused"]:  # a row saying why; costs no time, so no budget check
                self.boot(arm, b["ctx"], b["spec"], b["idx"], b["pool_only"], None, b["env"])
                continue
            if b["pool_only"]:
                cover = next((x for x in self.boots if x["arm"] == arm.name and x["ctx"] == b["ctx"]
                              and x["spec"] == "off" and not x.get("skipped")), None)
                if cover is not None:
                    self.cfg.log(f"[reference] {what}: pool from {cover['name']}, no pool-only boot")
                    continue
            if b["margin"] is not None and not self.fits(what, self.max_boot_s + b["margin"]):
                continue
            steps = {"plain": self.plain_steps, "verify": self.verify_step, "pool": None}[b["steps"]]
            self.boot(arm, b["ctx"], b["spec"], b["idx"], b["pool_only"], steps, b["env"])

    def schedule(self, arms: list[Arm]) -> list[dict]:
        """Every boot of the run in order, with the extra env (MAX_LEN pins), the plan's refusal
        (if any), the budget margin it needs beyond the longest boot so far (None: always runs)
        and an estimated duration. Order: SPEC=off of tier.ctx (all rows) for each boot index and
        arm; per other verify CTX its plain-step boots; per verify CTX and method the SPEC boots;
        then pool-only boots of pool_ctx profiles that no planned boot of the arm covers."""
        tier = self.cfg.tier
        if not arms:
            return []
        vctxs = tier.vctxs if tier.verify_context else ()
        specs = ("off", *tier.spec) if tier.verify_context else ("off",)
        # one MAX_LEN per CTX across the SPEC values that boot on it (a verify step and its plain
        # step must match); tier.ctx's SPEC=off boots pin only when verify rows run there too
        pin = {c: self.common_max_len(arms, c, specs if c in vctxs else ("off",)) for c in {tier.ctx, *vctxs}}
        out: list[dict] = []

        def add(arm, ctx, spec, idx, pool_only, steps, margin, what):
            env = dict(pin.get(ctx) or {}) if not pool_only else {}
            p = self.plan({**os.environ, **self.env_for(arm, ctx, spec), **env})
            out.append({"arm": arm, "ctx": ctx, "spec": spec, "idx": idx, "pool_only": pool_only, "steps": steps,
                        "margin": margin, "what": what, "env": env, "refused": p.get("error"),
                        "pool_tokens": (p.get("prediction") or {}).get("pool_tokens"),
                        "max_len": (p.get("server_config") or {}).get("MAX_LEN")})

        for b in range(tier.boots):
            for arm in arms:
                add(arm, tier.ctx, "off", b, False, "plain", None if b == 0 else 60, f"boot {b + 1} of {arm.name}")
        for vctx in vctxs:
            if vctx != tier.ctx:  # the plain step of another profile needs its own plain boot
                for b in range(tier.boots):
                    for arm in arms:
                        add(arm, vctx, "off", b, False, "verify", 20, f"{arm.name} CTX={vctx} SPEC=off boot {b + 1}")
        for spec in tier.spec:  # method by method (mtp before dflash2), each on every verify CTX
            for vctx in vctxs:
                for b in range(tier.boots):
                    for arm in arms:
                        # a verify boot = a boot + one short spec run (~10 s) + the stop
                        add(arm, vctx, spec, b, False, "verify", 20, f"{arm.name} CTX={vctx} SPEC={spec} boot {b + 1}")
        for ctx in tier.pool_ctx:
            for arm in arms:
                if any(x["arm"] is arm and x["ctx"] == ctx and x["spec"] == "off" and not x["refused"] for x in out):
                    continue  # that boot logs the pool: no pool-only boot
                add(arm, ctx, "off", 0, True, "pool", 10, f"{arm.name} CTX={ctx} pool boot")
        for x in out:
            x["est_s"] = 0.0 if x["refused"] else round(estimate_s(x, tier), 1)
        return out

    def common_max_len(self, arms: list[Arm], ctx: str, specs: tuple[str, ...]) -> dict:
        """The preflight caps MAX_LEN when a method's state slots shrink the pool (CTX=long with MTP on a
        float32-state checkpoint); a verify step and its plain step must then run at the same MAX_LEN,
        or the contract calls the comparison CONFOUNDED. Every arm's plan counts (the stock arm's
        SPEC=mtp pool is stock's: GDN_DEFER=0, env_for). Returns {"MAX_LEN": min} when the plans differ."""
        lens = {}
        for spec in specs:
            for arm in arms:
                p = self.plan({**os.environ, **self.env_for(arm, ctx, spec)})
                if "error" not in p:
                    got = p["server_config"].get("MAX_LEN")
                    lens[spec] = got if spec not in lens else min(lens[spec], got)
        if len(set(lens.values())) <= 1:
            return {}
        low = min(lens.values())
        self.doc.setdefault("pinned", []).append(
            {"ctx": ctx, "MAX_LEN": low, "why": f"plans differ by SPEC {lens}: every CTX={ctx} boot runs at the smallest"})
        return {"MAX_LEN": str(low)}

    def save(self) -> None:
        if self.rf is None:
            return
        self.doc["boots"] = self.boots
        self.doc["skipped"] = self.skipped
        self.doc["elapsed_s"] = round(self.elapsed(), 1)
        self.rf.save()

    # -- the table ----------------------------------------------------------------------------
    def build(self) -> None:
        self.doc["rows"] = rows = build_rows(self.boots, self.results, self.doc, self.cfg.tier)
        self.doc["goals"] = goals(rows, self.cfg.tier)
        self.doc["missing"] = missing_rows(rows, self.cfg.tier, [a.name for a in self.cfg.arms])
        self.save()


def missing_rows(rows: list[dict], tier: Tier, arm_names: list[str]) -> list[str]:
    """Essential rows without a value, per arm; the stock arm is not asked for the rows only the
    patched tree can run (tier.patched_only: DFlash2, KVarN)."""
    missing = []
    for key in tier.essential:
        row = next((r for r in rows if r["key"] == key), None)
        for arm in arm_names:
            if arm == "stock" and key in tier.patched_only:
                continue
            cell = (row or {}).get("arms", {}).get(arm) or {}
            if row is None or (cell.get("value") is None and not cell.get("measured")):
                why = cell.get("note") or "not measured"
                missing.append(f"{key} [{arm}]: {why}")
    return missing


def estimate_s(b: dict, tier: Tier) -> float:
    """Seconds one scheduled boot should take on a warm machine: boot (a pool-only boot stops at
    its pool line; schedule_text adds the cold first boot's extra) + its requests (prompt tokens
    at PREFILL_TPS, output tokens at DECODE_TPS per stream, more waves when the pool holds fewer
    streams) + the stop."""
    boot = BOOT_WARM_S
    if b["pool_only"]:
        return boot * POOL_BOOT_FRACTION + STOP_S
    pool = b.get("pool_tokens") or 0

    def req(prompt: int, out: int, n: int = 1) -> float:
        per_wave = max(1, pool // (prompt + out)) if pool else n
        waves = -(-n // min(n, per_wave))
        return n * prompt / PREFILL_TPS + waves * out / DECODE_TPS

    work = 0.0
    if b["steps"] == "plain":
        for ctx, ns in tier.decode:
            run_ns = pool_levels(list(ns), ctx, tier.decode_tokens, pool or None)[0]  # plain_steps skips the rest
            work += req(ctx, 16) + sum(tier.reps * (req(ctx, tier.decode_tokens, n) + REQUEST_OVERHEAD_S)
                                       for n in run_ns)
        if tier.prefill:
            work += sum(req(n, tier.prefill_tokens) + REQUEST_OVERHEAD_S for n in tier.prefill) + 1.0
        if tier.prefix_context:
            work += req(tier.prefix_context, tier.prefix_tokens) + req(0, tier.prefix_tokens) + 2 * REQUEST_OVERHEAD_S + 1.0
    if tier.verify_context and (b["steps"] == "verify" or (b["steps"] == "plain" and tier.ctx in tier.vctxs)):
        work += req(tier.verify_context, 16) + req(tier.verify_context, tier.verify_tokens) + REQUEST_OVERHEAD_S
    return boot + work + STOP_S


def schedule_text(plan: list[dict], budget: float, tier: Tier) -> list[str]:
    """The schedule as printed before the first boot: each boot, its estimate, the running total
    and whether the budget is expected to fit it (the driver decides at run time)."""
    lines = [f"schedule, tier {tier.name} (budget {budget:.0f} s; estimates: boot {BOOT_WARM_S:.0f} s warm, "
             f"{BOOT_COLD_S:.0f} s cold first, pool-only x{POOL_BOOT_FRACTION}, prefill {PREFILL_TPS:,.0f} tok/s, "
             f"decode {DECODE_TPS:.0f} tok/s per stream):"]
    total = 0.0
    for i, b in enumerate(plan, 1):
        name = f"{b['arm'].name}-{b['ctx']}-{b['spec']}-b{b['idx']}"
        kind = {"plain": "SPEC=off rows", "verify": "verify step", "pool": "pool only"}[b["steps"]]
        if b["refused"]:
            lines.append(f"  {i:2}. {name:<26} {kind:<13} refused by the plan, no boot: {b['refused'][:110]}")
            continue
        total += b["est_s"]
        late = b["margin"] is not None and total > budget
        lines.append(f"  {i:2}. {name:<26} {kind:<13} ~{b['est_s']:4.0f} s  (total ~{total:5.0f} s)"
                     + (f"  MAX_LEN={b['env']['MAX_LEN']}" if b["env"].get("MAX_LEN") else "")
                     + ("  over budget: likely skipped" if late else ""))
    first = next((b for b in plan if not b["refused"]), None)
    cold = total + (BOOT_COLD_S - BOOT_WARM_S if first else 0)
    lines.append(f"  estimated {total:.0f} s warm, {cold:.0f} s with a cold first boot (+ copy bandwidth "
                 f"and calibration, ~15 s); budget {budget:.0f} s")
    return lines


def _moved(p: str, ran_as: str | None, now: str | Path) -> Path | None:
    """A result file named in a reference JSON: where it was written, else at the same place
    relative to the reference JSON after the directory was copied elsewhere (e.g. a lent GPU's
    /var/tmp/out/80-reference/results into docs/results/...), else None."""
    if Path(p).is_file():
        return Path(p)
    if ran_as:
        try:
            rel = Path(p).relative_to(Path(ran_as).parent)
        except ValueError:
            return None
        f = Path(now).parent / rel
        return f if f.is_file() else None
    return None


def rebuild(path: str | Path, md: str | Path | None = None) -> dict:
    """The table again from a reference JSON and the result files it names, e.g. after the
    driver was killed (SIGKILL) before it could write its table. The run's verdict is kept."""
    import json as _json
    doc = _json.loads(Path(path).read_text(encoding="utf-8"))
    if doc.get("kind") != "reference":
        raise ValueError(f"{path} is not a reference result (kind {doc.get('kind')!r}); valid: reference-*.json")
    results = {}
    for b in doc.get("boots", []):
        for v in (b.get("results") or {}).values():
            p = v.get("path")
            f = _moved(p, doc.get("path"), path) if p else None
            if f is not None:
                try:
                    results[str(f)] = _json.loads(f.read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    continue
                v["path"] = str(f)  # where it is now: the rows and the provenance lines read it there
    tier = Tier(**{k: (tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v)
                   for k, v in doc["tier"].items()})
    doc["rows"] = rows = build_rows(doc.get("boots", []), results, doc, tier)
    doc["goals"] = goals(rows, tier)
    doc["missing"] = missing_rows(rows, tier, [a["name"] for a in doc.get("arms", [])])
    doc["rebuilt"] = provenance.utc_now()
    if md:
        atomic_write_text(md, markdown(doc))
    return doc


def measure_bandwidth(pythonpath: str | None) -> dict:
    """Copy bandwidth in a child process (the GPU is free again before the first boot)."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    try:
        out = subprocess.run([sys.executable, "-m", "onecard.bench.roofline"], env=env, capture_output=True,
                             text=True, timeout=300)
        if out.returncode == 0:
            return json.loads(out.stdout.strip().splitlines()[-1])
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError, IndexError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


# ------------------------------------------------------------------------------------ figures
def _res(results: dict, boot: dict, key: str) -> dict | None:
    p = (boot.get("results") or {}).get(key, {}).get("path")
    return results.get(p) if p else None


def _valid(r: dict | None) -> bool:
    return bool(r) and r.get("verdict") == "VALID"


def _why(r: dict | None, boot: dict) -> str:
    if boot.get("skipped"):
        return f"skipped: {boot['skipped']}"
    if boot.get("error"):
        return f"server failed: {boot['error']}"
    if r is None:
        return "not run"
    return f"{r.get('verdict')}: {'; '.join(r.get('verdict_reasons') or [])}"[:240]


def _level(r: dict, n: int) -> dict | None:
    """The ladder level of n concurrent requests in a result, or None."""
    return next((x for x in (r.get("data") or {}).get("levels", []) if x["n"] == n), None)


def _point(r: dict, ctx: int) -> dict | None:
    """The depth point of context ``ctx`` in a result, or None."""
    return next((x for x in (r.get("data") or {}).get("points", []) if x["context"] == ctx), None)


def fig_decode(r: dict, n: int) -> float | None:
    lv = _level(r, n)
    if lv is None:
        return None
    if n == 1:
        return lv.get("per_stream_decode_tps")
    # C>1: the rate while all n streams decode (runner.decode_window); results written before
    # the window existed (2026-12-05, session 26) carry only the wall-time aggregate
    return lv["decode_window_tps"] if "decode_window_tps" in lv else lv.get("aggregate_tps")


def _point_kv_peak(r: dict, ctx: int) -> float | None:
    return ((_point(r, ctx) or {}).get("kv") or {}).get("peak")


def _preemptions(r: dict) -> float:
    """vllm:num_preemptions over one benchmark result (its /metrics sampler's counter delta)."""
    return float((((r or {}).get("metrics") or {}).get("counters") or {}).get("preemptions") or 0)


def decode_overlap(r: dict, n: int) -> tuple[int, float | None] | None:
    """(the most streams that decoded at once in any rep of level n, vLLM's waiting-queue peak)
    from a ladder result; None when the level or the field is missing. Fewer than n means vLLM
    queued requests (KV blocks) and the level's aggregate is not an n-stream decode rate."""
    reps = (_level(r, n) or {}).get("reps") or []
    got = [rep.get("max_streams_decoding") for rep in reps if rep.get("max_streams_decoding") is not None]
    if not got:
        return None
    waits = [((((rep.get("metrics") or {}).get("gauges") or {}).get("waiting") or {}).get("peak")) for rep in reps]
    waits = [w for w in waits if w is not None]
    return max(got), (max(waits) if waits else None)


def fig_prefill(r: dict, ctx: int) -> float | None:
    pt = _point(r, ctx)
    return pt.get("prefill_tps") if pt and pt.get("ok") else None


def _ladder_prompt_tokens(r: dict) -> int | None:
    for lv in (r.get("data") or {}).get("levels", []):
        for rep in lv.get("reps", []):
            for q in rep.get("requests", []):
                if q.get("prompt_tokens"):
                    return q["prompt_tokens"]
    return None


def fig_prompt_tokens(r: dict, ctx: int) -> int | None:
    pt = _point(r, ctx)
    return pt.get("prompt_tokens") if pt else None


def fig_step_ms(r: dict) -> float | None:
    """ms per engine step at C1: tokens per step (server spec counters; 1 without drafts) /
    decode tok/s. Under speculation a step is one verify (target forward + k drafts)."""
    c = ((r.get("data") or {}).get("classes") or [{}])[0]
    tps = c.get("decode_tps")
    if not tps:
        return None
    per_step = ((c.get("spec") or {}).get("tokens_per_step")) or 1.0
    return 1000.0 * per_step / tps


def fig_turn(r: dict, turn: int) -> float | None:
    t = (r.get("data") or {}).get("turns") or []
    return t[turn - 1].get("ttft") if len(t) >= turn and t[turn - 1].get("ok") else None


def fig_turn_ratio(r: dict) -> float | None:
    a, b = fig_turn(r, 1), fig_turn(r, 2)
    return b / a if a and b is not None else None


def _cell(boots: list[dict], results: dict, arm: str, spec: str, key: str, fn, ctx: str | None = None) -> dict:
    """Per-boot figures of one arm (VALID results only) and the mean."""
    per, res, notes = [], [], []
    for b in boots:
        if b["arm"] != arm or b["spec"] != spec or b["pool_only"] or (ctx and b["ctx"] != ctx):
            continue
        r = _res(results, b, key)
        v = fn(r) if _valid(r) else None
        if v is None:
            notes.append(_why(r, b) if not _valid(r) else "figure missing in the result")
        else:
            per.append(v)
        if r is not None:
            res.append(r)
    val = sum(per) / len(per) if per else None
    return {"value": val, "per_boot": per, "results": [r.get("path") for r in res],
            "note": None if per else (notes[0] if notes else "no boot"), "_res": res}


def _compare(cells: dict[str, dict], knob: str, base: str, other: str) -> dict:
    a, b = cells.get(base) or {}, cells.get(other) or {}
    ra, rb = a.get("_res") or [], b.get("_res") or []
    if not ra or not rb:
        return {"status": "MISSING", "reasons": [f"no {base if not ra else other} result"]}
    cmps = [fairness.compare(x, y, knob=knob) for x, y in zip(ra, rb)]
    bad = next((v for v in cmps if v.status in ("REFUSED", "CONFOUNDED")), None)
    if bad is not None:
        return {"status": bad.status, "reasons": bad.reasons}
    if len(a["per_boot"]) >= 2 and len(b["per_boot"]) >= 2:
        v = fairness.ab_verdict(a["per_boot"], b["per_boot"], knob, cmps)
        return {"status": v.status, "reasons": v.reasons, "floor": v.details.get("floor")}
    return {"status": cmps[0].status, "reasons": cmps[0].reasons}


def build_rows(boots: list[dict], results: dict, doc: dict, tier: Tier) -> list[dict]:
    arms = [a["name"] for a in doc.get("arms", [])]
    bw = (doc.get("bandwidth") or {}).get("gbps_read_plus_write")
    sb = doc.get("step_bytes") or {}
    sbytes = roofline.StepBytes(**sb) if sb and "error" not in sb else None
    rows: list[dict] = []

    def add(key, metric, unit, higher, spec, rkey, fn, roof=None, compare_arms=True, extra=None, ctx=tier.ctx):
        cells = {a: _cell(boots, results, a, spec, rkey, fn, ctx) for a in arms}
        row = {"key": key, "metric": metric, "unit": unit, "higher_is_better": higher, "arms": cells,
               "roofline": roof, **(extra or {})}
        if compare_arms and "stock" in cells and "patched" in cells:
            row["verdict"] = _compare(cells, ARM_KNOB, "stock", "patched")
            s, p = cells["stock"]["value"], cells["patched"]["value"]
            ok = row["verdict"]["status"] in ("OK", "UNRESOLVED", "RESOLVED")
            row["ratio"] = (p / s) if ok and s and p is not None else None
        if roof:
            for c in cells.values():
                v = c["value"]
                c["pct_roofline"] = (100.0 * v / roof if higher else 100.0 * roof / v) if v else None
        rows.append(row)
        return row

    def flag_preempted(row, where, hit=lambda r: True):
        """Footnote a cell whose benchmark counted vLLM preemptions, where ``hit(result)`` says
        this row's figure can hold them (the sampler counts per benchmark, not per point)."""
        for c in row["arms"].values():
            n = max((_preemptions(r) for r in c["_res"] if hit(r)), default=0)
            if n and c["value"] is not None:
                c["flag"] = (f"vllm:num_preemptions rose by {n:g} during {where}: the figure includes "
                             f"the preempted work done again")

    # pools: one row per (CTX, SPEC) booted, vLLM's figure against the plan's prediction
    seen = []
    for b in boots:
        if (b["ctx"], b["spec"]) not in seen:
            seen.append((b["ctx"], b["spec"]))
    for ctx, spec in seen:
        cells = {}
        for a in arms:
            bs = [b for b in boots if b["arm"] == a and b["ctx"] == ctx and b["spec"] == spec]
            got = next((b for b in bs if b.get("pool_tokens") is not None), None)
            pred = next(((b.get("plan") or {}).get("prediction") or {} for b in bs if b.get("plan")), {})
            cfgs = [json.dumps((b.get("plan") or {}).get("server_config"), sort_keys=True) for b in bs]
            v = got.get("pool_tokens") if got else None
            pv = pred.get("pool_tokens")
            cells[a] = {"value": v, "predicted": pv, "block_size": got.get("block_size") if got else None,
                        "dev_pct": (100.0 * (v - pv) / pv) if v and pv else None, "configs": cfgs,
                        "skipped": bool(bs) and all(b.get("skipped") for b in bs),
                        "note": None if v else (_why(None, bs[0]) if bs and (bs[0].get("error") or bs[0].get("skipped"))
                                                else "no pool line")}
        row = {"key": f"pool {ctx}/{spec}", "metric": f"KV pool tokens, CTX={ctx} SPEC={spec} (boot log vs "
               f"onecard.memory)", "unit": "tokens", "higher_is_better": True, "arms": cells, "roofline": None}
        if "stock" in cells and "patched" in cells and all(c["value"] is None for c in cells.values()):
            row["verdict"] = {"status": "MISSING", "reasons": ["no pool in either arm"]}
        elif "stock" in cells and "patched" in cells:
            same = cells["stock"]["configs"] and cells["stock"]["configs"][:1] == cells["patched"]["configs"][:1]
            row["verdict"] = ({"status": "OK", "reasons": ["same plan values (KV_MEM pin, KV dtype, max_len, "
                                                           "prefix cache, SPEC)"]} if same else
                              {"status": "REFUSED", "reasons": ["the arms' plans differ"]})
            s, p = cells["stock"]["value"], cells["patched"]["value"]
            row["ratio"] = p / s if same and s and p is not None else None
        rows.append(row)

    def roof_decode(ctx, n):
        if not (bw and sbytes):
            return None
        return roofline.tok_s(sbytes.decode(n, ctx), bw) * (n if n > 1 else 1)

    cal = doc.get("calibration")
    for ctx, ns in tier.decode:
        for n in ns:
            what = "per-stream decode tok/s" if n == 1 else f"aggregate tok/s while {n} streams decode together"
            row = add(f"decode {_k(ctx)} C{n}", f"no-spec {what}, ~{_k(ctx)} prompt, {tier.decode_tokens} tokens",
                      "tok/s", True, "off", f"decode {_k(ctx)}", lambda r, n=n: fig_decode(r, n), roof_decode(ctx, n))
            toks = [_ladder_prompt_tokens(r) for c in row["arms"].values() for r in c["_res"]]
            row["prompt_tokens"] = next((t for t in toks if t), None)
            if n > 1:
                for a, c in row["arms"].items():
                    unfit = next((((b.get("decode_unfit") or {}).get(f"decode {_k(ctx)}") or {}).get(str(n))
                                  for b in boots if b["arm"] == a and b["spec"] == "off" and not b["pool_only"]
                                  and b["ctx"] == tier.ctx and b.get("decode_unfit")), None)
                    if unfit and c.get("value") is None:
                        c["note"], c["measured"], c["pct_roofline"] = unfit, True, None
                        continue
                    ov = [o for o in (decode_overlap(r, n) for r in c["_res"]) if o]
                    windowed = any("decode_window_tps" in (_level(r, n) or {}) for r in c["_res"])
                    if ov and min(m for m, _ in ov) < n:
                        m, w = min(ov)
                        queued = (f"at most {m} of {n} streams decoded at once: vLLM kept the others waiting "
                                  f"(waiting peak {'?' if w is None else int(w)}), "
                                  + (f"so there is no rate of {n} streams decoding together (the KV pool or the "
                                     f"scheduler held them back)" if windowed else
                                     f"so this aggregate includes their queueing and prefill and is not the "
                                     f"decode rate of {n} concurrent streams (no % of roofline)"))
                        c["pct_roofline"] = None
                        if windowed and c.get("value") is None:
                            # measured: vLLM could not run n of these streams together (a fact about
                            # the plan, e.g. a pool of 80k tokens holds two 32k streams), not missing
                            c["note"], c["measured"] = queued, True
                        else:
                            c["flag"] = queued + (f"; {c['flag']}" if c.get("flag") else "")
                    elif windowed and c.get("value") is None and c["_res"]:
                        why = next((rep["decode_window"]["why"] for r in c["_res"]
                                    for rep in ((_level(r, n) or {}).get("reps") or [])
                                    if (rep.get("decode_window") or {}).get("why")), None)
                        if why:
                            c["note"] = f"no window in which all {n} streams decoded: {why}"
    for ctx in tier.prefill:
        e = est(ctx, cal)
        row = add(f"prefill {_k(ctx)}", f"prefill tok/s (prompt tokens / TTFT, salted), ~{_k(ctx)} prompt",
                  "tok/s", True, "off", "prefill", lambda r, c=e: fig_prefill(r, c))
        toks = [fig_prompt_tokens(r, e) for c in row["arms"].values() for r in c["_res"]]
        row["prompt_tokens"] = next((t for t in toks if t), None)
        flag_preempted(row, "the prefill sweep, whose point at this size filled the KV pool (kv peak >= 0.99)",
                       lambda r, c=e: (_point_kv_peak(r, c) or 0) >= 0.99)
    if tier.prefix_context:
        pc = _k(tier.prefix_context)
        row = add(f"prefix {pc} turn1", f"TTFT turn 1 (cold), ~{pc} document", "s", False, "off", "prefix",
                  lambda r: fig_turn(r, 1))
        toks = [((r.get("data") or {}).get("turns") or [{}])[0].get("prompt_tokens")
                for c in row["arms"].values() for r in c["_res"]]
        row["prompt_tokens"] = next((t for t in toks if t), None)
        flag_preempted(row, "the two turns (turn 1, the cold prefill, is where the pool fills)")
        add(f"prefix {pc} turn2", f"TTFT turn 2 (prefix cache), ~{pc} document", "s", False, "off", "prefix",
            lambda r: fig_turn(r, 2))
        ratio = add(f"prefix {pc} turn2/turn1", "TTFT ratio turn 2 / turn 1", "ratio", False, "off", "prefix",
                    fig_turn_ratio)
        flag_preempted(ratio, "the two turns (turn 1, the cold prefill, is where the pool fills)")
    for vctx in (tier.vctxs if tier.verify_context else ()):
        vc, sfx = _k(tier.verify_context), ("" if vctx == tier.ctx else f" {vctx}")
        plain_roof = (1000.0 * sbytes.decode(1, tier.verify_context) / (bw * 1e9)) if bw and sbytes else None
        plain = add(f"step plain{sfx}", f"ms per plain decode step (CTX={vctx}, SPEC=off), C1, ~{vc} prompt", "ms",
                    False, "off", "verify", fig_step_ms, plain_roof, ctx=vctx)
        for spec in tier.spec:
            plans = [b["plan"] for b in boots if b["spec"] == spec and b["ctx"] == vctx and b.get("plan")]
            k = next((x for x in (p.get("spec_k") for p in plans) if x), None)
            roof = None
            if bw and sbytes and k and spec == "dflash2":
                # one drafter pass per step: the plan's drafter bytes (DRAFT_QUANT applied) + lm_head once
                dw = next((x for x in (((p.get("prediction") or {}).get("vram") or {}).get("drafter_weights")
                                       for p in plans) if x), None)
                roof = 1000.0 * sbytes.verify_block(1, tier.verify_context, dw) / (bw * 1e9) if dw else None
            elif bw and sbytes and k:
                roof = 1000.0 * sbytes.verify(1, tier.verify_context, k) / (bw * 1e9)
            v = add(f"step {spec}{sfx}", f"ms per verify step (CTX={vctx}, SPEC={spec}, k={k}), C1, ~{vc} prompt",
                    "ms", False, spec, "verify", fig_step_ms, roof, ctx=vctx)
            if not any(b["spec"] == spec and b["ctx"] == vctx for b in boots):
                for c in v["arms"].values():
                    c["note"] = "not booted (see skipped)"
            # within each arm: verify / plain, the SPEC knob declared
            cells = {}
            for a in arms:
                pv, vv = plain["arms"][a]["value"], v["arms"][a]["value"]
                verdict = _compare({"plain": plain["arms"][a], "spec": v["arms"][a]}, SPEC_KNOB, "plain", "spec")
                ok = verdict["status"] in ("OK", "UNRESOLVED", "RESOLVED")
                why = v["arms"][a].get("note") if vv is None else None  # e.g. the plan's refusal for this arm
                cells[a] = {"value": vv / pv if ok and pv and vv else None, "verdict": verdict,
                            "note": None if ok else (why or f"{verdict['status']}: {'; '.join(verdict['reasons'])}")[:240]}
            row = {"key": f"verify {spec}/plain{sfx}", "metric": f"verify step / plain step (CTX={vctx}, SPEC={spec} vs off)",
                   "unit": "ratio", "higher_is_better": False, "arms": cells, "roofline": None}
            s, p = cells.get("stock", {}).get("value"), cells.get("patched", {}).get("value")
            row["ratio"] = p / s if s and p is not None else None
            row["verdict"] = {"status": "DERIVED", "reasons": ["ratio of two per-arm ratios; see the step rows"]}
            rows.append(row)
    for r in rows:
        for c in r["arms"].values():
            c.pop("_res", None)
    return rows


GOALS = (
    ("decode C1 >= 80% of roofline", "decode", "pct_roofline", lambda v: v >= 80.0, "{:.1f} %"),
    ("verify step <= 1.3x plain", "verify", "value", lambda v: v <= 1.3, "{:.2f}x"),
    ("prefix turn 2 <= 2.5% of turn 1", "prefix", "value", lambda v: v <= 0.025, "{:.2%}"),
)


def goals(rows: list[dict], tier: Tier) -> list[dict]:
    """The issue's goals, read on the patched arm (stock beside it)."""
    out = []
    by = {r["key"]: r for r in rows}
    prefix_key = f"prefix {_k(tier.prefix_context)} turn2/turn1" if tier.prefix_context else None
    decode_key = f"decode {_k(tier.decode[0][0])} C1" if tier.decode else None
    goal_rows = []
    for name, key, field_, test, fmt in GOALS:
        if key == "verify":  # one goal row per verify CTX and method that has a row
            goal_rows += [(name, r["key"], field_, test, fmt) for r in rows if r["key"].startswith("verify ")]
        else:
            goal_rows.append((name, {"decode": decode_key, "prefix": prefix_key}.get(key, key), field_, test, fmt))
    for name, key, field_, test, fmt in goal_rows:
        row = by.get(key or "")
        g = {"goal": name, "row": key}
        for arm in ("patched", "stock"):
            c = (row or {}).get("arms", {}).get(arm) or {}
            v = c.get(field_)
            g[arm] = {"value": v, "shown": fmt.format(v) if v is not None else None,
                      "status": ("PASS" if test(v) else "MISS") if v is not None else "NOT MEASURED",
                      "note": c.get("note")}
        out.append(g)
    pools = [r for r in rows if r["key"].startswith("pool ")]
    g = {"goal": "pools within 1% of the memory model", "row": "pool *"}
    for arm in ("patched", "stock"):
        devs = [(r["key"], (r["arms"].get(arm) or {}).get("dev_pct")) for r in pools
                if not (r["arms"].get(arm) or {}).get("skipped")]
        got = [d for _, d in devs if d is not None]
        g[arm] = {"value": max(got, key=abs) if got else None,
                  "shown": ", ".join(f"{k[5:]} {d:+.2f} %" for k, d in devs if d is not None) or None,
                  "status": ("PASS" if all(abs(d) <= 1.0 for d in got) and len(got) == len(devs) else "MISS")
                  if got else "NOT MEASURED", "note": None}
    out.append(g)
    return out


# ------------------------------------------------------------------------------------ markdown
def _f(v, unit: str = "") -> str:
    if v is None:
        return "—"
    if unit == "tokens":
        return f"{int(v):,}"
    if unit == "ratio":
        return f"{v:.3f}"
    if unit == "s":
        return f"{v:.3f}"
    if unit == "ms":
        return f"{v:.2f}"
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def _esc(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def markdown(doc: dict) -> str:
    tier = doc.get("tier") or {}
    prov = doc.get("provenance") or {}
    arms = [a["name"] for a in doc.get("arms", [])]
    bw = doc.get("bandwidth") or {}
    sb = doc.get("step_bytes") or {}
    res_prov = _first_result_prov(doc)
    gpus = ", ".join(g.get("name", "?") for g in (prov.get("gpu") or {}).get("gpus", [])) or "no GPU seen"
    L = ["# Reference performance: patched vs stock vLLM", "",
         "<!-- generated by bench/reference.sh (onecard.bench.reference); do not edit by hand -->", "",
         f"Tier **{tier.get('name')}**: {tier.get('doc')}. Run verdict: **{doc.get('verdict')}**"
         + (f" — {'; '.join(doc.get('verdict_reasons') or [])}" if doc.get("verdict") != "VALID" else "") + ".", "",
         "## Provenance", "",
         f"- date: {doc.get('date')} · elapsed {doc.get('elapsed_s')} s · model `{doc.get('model')}`",
         f"- {_commit_text(prov.get('git') or {})} · vLLM "
         f"{(res_prov or {}).get('vllm_version') or prov.get('vllm_version')} ("
         f"{(res_prov or {}).get('vllm_version_source') or prov.get('vllm_version_source')}) · patch series "
         f"`{str((prov.get('patch_series') or {}).get('hash'))[:16]}` (patched arm; stock: none)",
         f"- GPU: {gpus} · driver {(prov.get('gpu') or {}).get('driver')} · copy bandwidth "
         f"{_f(bw.get('gbps_read_plus_write'))} GB/s ({bw.get('method') or bw.get('error')}, "
         f"{bw.get('device_name', '')})",
         f"- argv: `{' '.join(doc.get('argv') or [])}`",
         f"- env knobs (client): `{json.dumps(prov.get('env_knobs') or {})}`",
         f"- arms: " + "; ".join(f"**{a['name']}** PYTHONPATH=`{a.get('pythonpath')}`"
                                 + (f" (skipped: {a['skip_reason']})" if a.get("skip_reason") else "")
                                 for a in doc.get("arms", [])),
         f"- server (launcher plan, each boot): `{_launch_argv(doc)}`",
         f"- prompts: {_prompt_ids(doc)} · sampling `{json.dumps((res_prov or {}).get('sampling') or prov.get('sampling'))}`"
         f" with fixed max_tokens (random weights never stop) · tokens from "
         f"`{(res_prov or {}).get('token_count_source') or prov.get('token_count_source')}` · warmup: "
         f"{((res_prov or {}).get('warmup') or {}).get('policy') or (prov.get('warmup') or {}).get('policy')}",
         f"- roofline bytes per step (safetensors headers): weights {_gib(sb.get('weights'))} (no vision, "
         f"no MTP, no embedding table), MTP {_gib(sb.get('mtp'))}, lm_head {_gib(sb.get('lm_head'))}, KV "
         f"{sb.get('attn_bytes_per_token')} B/token, GDN state r+w {_gib(sb.get('gdn_state_bytes'))} per stream",
         f"- prompt sizes: {(doc.get('calibration') or {}).get('chars_per_token', 0):.2f} chars/token "
         f"({(doc.get('calibration') or {}).get('source')}); row names are target tokens, `(N tok)` the measured ones",
         f"- result JSON: `{Path(str(doc.get('path') or '')).name}`"
         + (f" · this table rebuilt from it and its result files at {doc['rebuilt']} (`bench/reference.sh "
            f"--rebuild`: rows, roofline and footnotes by the code of that time; the figures are the run's)"
            if doc.get("rebuilt") else ""), "",
         "## Table", "",
         "| row | unit | " + " | ".join(arms) + " | patched/stock | comparison | roofline | % roofline "
         + " / ".join(arms) + " |",
         "|---|---|" + "---|" * len(arms) + "---|---|---|---|"]
    notes = []
    for r in doc.get("rows", []):
        cells = []
        for a in arms:
            c = r["arms"].get(a) or {}
            s = _f(c.get("value"), r["unit"])
            if c.get("value") is None and c.get("note"):
                notes.append(f"`{r['key']}` [{a}]: {c['note']}")
                s += f" [{len(notes)}]"
            elif c.get("flag"):
                notes.append(f"`{r['key']}` [{a}]: {c['flag']}")
                s += f" [{len(notes)}]"
            if r["key"].startswith("pool ") and c.get("predicted"):
                s += f" (model {c['predicted']:,}, {_f(c.get('dev_pct'))} %)"
            if len(c.get("per_boot") or []) > 1:
                s += " (" + ", ".join(_f(x, r["unit"]) for x in c["per_boot"]) + ")"
            cells.append(s)
        v = r.get("verdict") or {}
        comp = v.get("status", "—")
        if v.get("status") == "UNRESOLVED" and not v.get("floor"):
            comp += " (1 boot/arm)"
        elif v.get("status") not in (None, "OK", "DERIVED", "MISSING"):
            comp += f": {_esc('; '.join(v.get('reasons') or []))[:160]}"
        pct = " / ".join(_f((r["arms"].get(a) or {}).get("pct_roofline")) for a in arms) if r.get("roofline") else "—"
        L.append(f"| {r['key']}{' (' + format(r['prompt_tokens'], ',') + ' tok)' if r.get('prompt_tokens') else ''} "
                 f"| {r['unit']} | " + " | ".join(_esc(c) for c in cells) + f" | {_f(r.get('ratio'), 'ratio')} | "
                 f"{comp} | {_f(r.get('roofline'), r['unit'])} | {pct} |")
    L += [""]
    if notes:
        L += [f"[{i}] {_esc(n)}  " for i, n in enumerate(notes, 1)] + [""]
    L += ["## Goals (patched arm; stock beside it)", "", "| goal | patched | stock |", "|---|---|---|"]
    for g in doc.get("goals", []):
        L.append(f"| {g['goal']} (`{g['row']}`) | " + " | ".join(
            f"**{g[a]['status']}** {g[a]['shown'] or ''}" for a in ("patched", "stock")) + " |")
    L += [""]
    if doc.get("pinned"):
        L += ["## Pinned", ""] + [f"- MAX_LEN={p['MAX_LEN']:,} for CTX={p['ctx']}: {p['why']}"
                                  for p in doc["pinned"]] + [""]
    if doc.get("skipped"):
        L += ["## Skipped", ""] + [f"- {s['what']}: {s['reason']}" for s in doc["skipped"]] + [""]
    booted = [b for b in doc.get("boots", []) if not b.get("skipped")]
    if booted:
        L += ["## Boots", "", "| boot | healthy after s | wall s (boot + runs + stop) | pool tokens | block | result |",
              "|---|---|---|---|---|---|"]
        for b in booted:
            L.append(f"| {b['name']} | {_f(b.get('boot_s'))} | {_f(b.get('wall_s'))} | {_f(b.get('pool_tokens'), 'tokens')} "
                     f"| {b.get('block_size') or '—'} | {'ok' if b.get('ok') and not b.get('error') else 'FAILED'} |")
        L += [""]
    failed = [b for b in doc.get("boots", []) if b.get("error")]
    if failed:
        L += ["## Failed boots", ""] + [f"- {b['name']}: {_esc(b['error'])} (log `{Path(b.get('log') or '').name}`)"
                                        for b in failed] + [""]
    L += ["## How to read it", "",
          "- Every figure comes from a result JSON of `onecard.bench.runner` whose verdict is VALID "
          "(fairness contract, `onecard/bench/fairness.py`); an INVALID or missing one shows `—` and a note.",
          "- `comparison` is the contract's verdict on stock vs patched with `patch_series` as the declared knob: "
          "UNRESOLVED with one boot per arm (the boot-to-boot floor is unknown, so a ratio near 1 is noise); "
          "with >= 2 boots per arm RESOLVED/UNRESOLVED against 2x the floor. REFUSED/CONFOUNDED: no ratio.",
          "- roofline = bytes one step must read / measured copy bandwidth (`onecard/bench/roofline.py`); "
          "for C>1 the aggregate. Prefill is compute-bound: no roofline. Step rows: % = roofline ms / measured ms.",
          "- C>1 decode rows: the aggregate rate while all C streams decode at once (from the last stream's "
          "first token to the first stream's last; each stream's `usage.completion_tokens` apportioned by its "
          "chunks' arrival times in that window), so the streams' prefills are not in it; `—` when vLLM never "
          "ran all C together. Results written before 2026-12-05 (session 26) carry only the wall-time "
          "aggregate (tokens / wall from the first request's start, prefills included), which a rebuild shows. "
          "A level whose C streams cannot all be resident in the boot's KV pool (C x (prompt + output) > pool "
          "tokens) is not run and says so (since session 26).",
          "- ms per step = 1000 x tokens per step (server spec counters, 1 without drafts) / decode tok/s at C1.",
          "- The SPEC=mtp verify roofline adds k x (MTP module + lm_head): the drafter's k passes each compute "
          "logits (the full bf16 lm_head each time, an upper bound: a prepared model's int8 lm_head and draft "
          "vocabulary read less). The SPEC=dflash2 roofline adds one drafter pass (the plan's drafter bytes, "
          "DRAFT_QUANT applied) and one lm_head read over the block's rows.",
          "- A C>1 decode row with a footnote saying fewer streams decoded at once than requested measured "
          "queued requests: its aggregate is not a concurrent decode rate and gets no % of roofline.",
          "- Pools: vLLM's `GPU KV cache size` line from each boot's log against `onecard.memory`'s prediction for "
          "the same plan (KV_MEM pinned as on a 3090, so the pool does not depend on the larger GPU).",
          ""]
    return "\n".join(L)


def _commit_text(git: dict) -> str:
    """The tree that ran: ONECARD_TREE_REV when gpu/run.sh set it (a lent machine's copy of the
    working tree keeps a stale .git, so its HEAD and dirty flag are not what ran), else git's HEAD."""
    commit, rev = git.get("commit"), git.get("tree_rev")
    if rev and not (commit or "").startswith(rev):
        return f"tree `{rev}` (ONECARD_TREE_REV; the machine's stale git HEAD: `{str(commit)[:12]}`)"
    return f"commit `{commit}`" + (" (dirty)" if git.get("dirty") else "")


def _gib(b) -> str:
    return "—" if b is None else f"{b / 2**30:.2f} GiB"


def _first_result_prov(doc: dict) -> dict | None:
    for b in doc.get("boots", []):
        for v in (b.get("results") or {}).values():
            p = v.get("path")
            if p and Path(p).is_file():
                try:
                    return json.loads(Path(p).read_text()).get("provenance")
                except (OSError, json.JSONDecodeError):
                    continue
    return None


def _launch_argv(doc: dict) -> str:
    for b in doc.get("boots", []):
        argv = (b.get("plan") or {}).get("argv")
        if argv:
            return " ".join(argv[1:]) if argv else ""
    return "—"


def _prompt_ids(doc: dict) -> str:
    seen = {}
    for b in doc.get("boots", []):
        for v in (b.get("results") or {}).values():
            p = v.get("path")
            if p and Path(p).is_file():
                try:
                    ps = (json.loads(Path(p).read_text()).get("provenance") or {}).get("prompt_set") or {}
                except (OSError, json.JSONDecodeError):
                    continue
                if ps.get("id"):
                    seen[ps["id"]] = str(ps.get("hash"))[:12]
    return ", ".join(f"`{k}` ({v})" for k, v in seen.items()) or "—"


# ------------------------------------------------------------------------------------ CLI
def _arm(text: str) -> tuple[str, str]:
    name, sep, pp = text.partition("=")
    if not sep or name not in ("stock", "patched"):
        raise argparse.ArgumentTypeError(f"--arm {text!r} invalid; valid: stock=PYTHONPATH or patched=PYTHONPATH")
    return name, pp


def configure(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tier", default="quick", help=f"valid: {', '.join(TIERS)} (default quick)")
    ap.add_argument("--model", default=os.path.join(os.environ.get("MODELS", "/var/tmp/models"), "qwen38-27b-geom"),
                    help="checkpoint directory (default $MODELS/qwen38-27b-geom)")
    ap.add_argument("--out", default="bench-results/reference", help="result directory")
    ap.add_argument("--md", default="docs/performance.md", help="markdown table (default %(default)s; '' = none)")
    ap.add_argument("--arm", type=_arm, action="append", default=[],
                    help="stock=PYTHONPATH / patched=PYTHONPATH (default: $STOCK_PYTHONPATH / $PYTHONPATH)")
    ap.add_argument("--server-cmd", default=None, help="bash command starting a server from the env knobs "
                    "(default: this python -m onecard.launch)")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="skip the copy measurement, use this")
    ap.add_argument("--boot-timeout", type=float, default=600.0)
    ap.add_argument("--budget-s", type=float, default=None, help="wall budget (default: the tier's)")
    ap.add_argument("--rebuild", default=None, metavar="REFERENCE_JSON",
                    help="no run: write the table again from a reference JSON and its result files")
    ap.add_argument("--verify-ctx", default=None,
                    help="CTX profiles of the verify rows, comma-separated (default: the tier's; e.g. fast,long)")
    ap.add_argument("--draft", default=None, help="DRAFT of the SPEC=dflash2 boots (default: <model>-dflash2 "
                    "when it has a config.json, as job 20 builds it)")
    ap.add_argument("--kvarn-pythonpath", default=os.environ.get("KVARN_PYTHONPATH"),
                    help="PYTHONPATH of the patched arm's CTX=huge boots: a vLLM with KVarN installed "
                    "(default $KVARN_PYTHONPATH; else the patched arm's own)")


def from_args(a: argparse.Namespace) -> RefConfig:
    if a.tier not in TIERS:
        raise ValueError(f"--tier {a.tier!r} invalid; valid: {', '.join(TIERS)}")
    mdir = Path(a.model)
    if not (mdir / "config.json").is_file() or not any(mdir.glob("*.safetensors")):
        raise ValueError(f"--model {a.model}: not a checkpoint (needs config.json and *.safetensors); valid: "
                         "a built checkpoint, e.g. $MODELS/qwen38-27b-geom (gpu/jobs/20-geometry.sh builds it)")
    tier = TIERS[a.tier]
    if a.verify_ctx:
        from onecard.profiles import CTX_PROFILES
        vc = tuple(x.strip() for x in a.verify_ctx.split(",") if x.strip())
        bad = [x for x in vc if x not in CTX_PROFILES]
        if bad or not vc:
            raise ValueError(f"--verify-ctx {a.verify_ctx!r} invalid; valid: comma-separated {', '.join(CTX_PROFILES)}")
        def vkeys(keys: tuple[str, ...], ctxs: tuple[str, ...]) -> tuple[str, ...]:
            # the tier's essential verify rows, named for the chosen CTX profiles instead
            specs = [sp for sp in tier.spec if any(k.startswith(f"verify {sp}/plain") for k in keys)]
            new = [f"verify {sp}/plain{'' if c == tier.ctx else ' ' + c}" for sp in specs for c in ctxs]
            return tuple(k for k in keys if not k.startswith("verify ")) + tuple(new)
        po = vkeys(tier.patched_only, vc) if any(k.startswith("verify ") for k in tier.patched_only) else tier.patched_only
        tier = dataclasses.replace(tier, verify_ctx=vc, essential=vkeys(tier.essential, vc), patched_only=po)
    given = dict(a.arm)
    arms = []
    for name, env in (("patched", "PYTHONPATH"), ("stock", "STOCK_PYTHONPATH")):
        pp = given.get(name, os.environ.get(env))
        reason = None if pp is not None else f"${env} not set and no --arm {name}=PYTHONPATH"
        arms.append(Arm(name, pp, skip_reason=reason))
    return RefConfig(model=str(mdir), tier=tier, out_dir=Path(a.out), arms=arms,
                     md=Path(a.md) if a.md else None, server_cmd=a.server_cmd, port=a.port,
                     bandwidth_gbs=a.bandwidth_gbs, boot_timeout=a.boot_timeout, budget_s=a.budget_s,
                     draft=getattr(a, "draft", None), kvarn_pythonpath=getattr(a, "kvarn_pythonpath", None) or None,
                     argv=list(sys.argv))


def summary(doc: dict) -> str:
    lines = [f"reference {doc['tier']['name']}: {doc.get('verdict')} in {doc.get('elapsed_s')} s -> {doc.get('path')}"]
    for r in doc.get("rows", []):
        vals = " ".join(f"{a}={_f((r['arms'].get(a) or {}).get('value'), r['unit'])}" for a in r["arms"])
        lines.append(f"  {r['key']:<24} {vals}  p/s={_f(r.get('ratio'), 'ratio')}  "
                     f"{(r.get('verdict') or {}).get('status', '')}")
    for g in doc.get("goals", []):
        lines.append(f"  goal {g['goal']}: patched {g['patched']['status']} {g['patched']['shown'] or ''}")
    for m in doc.get("missing", []):
        lines.append(f"  MISSING {m}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/reference.sh", description=__doc__.splitlines()[0])
    configure(ap)
    try:
        return run_args(ap.parse_args(argv))
    except ValueError as e:
        print(f"reference: {e}", file=sys.stderr)
        return 2


def run_args(a: argparse.Namespace) -> int:
    """Run from parsed options (bench/reference.sh and `onecard bench reference`); bad input
    raises ValueError with one line."""
    if a.rebuild:
        if not Path(a.rebuild).is_file():
            raise ValueError(f"--rebuild {a.rebuild}: no such file; valid: a reference-*.json of an earlier run")
        doc = rebuild(a.rebuild, a.md or None)
        print(summary(doc))
        return 0 if doc.get("verdict") == "VALID" else 1
    cfg = from_args(a)
    import signal

    def _term(signum, frame):  # a job timeout sends SIGTERM: stop the server, keep the table
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _term)
    doc = Reference(cfg).run()
    print(summary(doc))
    if cfg.md:
        print(f"markdown: {cfg.md}")
    return 0 if doc.get("verdict") == "VALID" else 1


if __name__ == "__main__":
    raise SystemExit(main())
