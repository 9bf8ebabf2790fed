"""GPU: speculative decoding (SPEC=mtp, SPEC=dflash2) on quantized KV caches, greedy exactness
against SPEC=off of the same KV dtype, on the tiny model. Driver of gpu/jobs/71-spec-quant-kv.sh
(issue 7) and gpu/jobs/63-kvarn-spec.sh (issue 9). Reuses job 70's machinery
(tests/gpu/test_dflash2.py: launcher plan per server, Server, the 128-residue greedy sweep and
the GPU suite's bf16 near-tie rule, tests/gpu/gpu_suite_lib.judge).

Suites (``--suite``):

  quant  (job 71) CTX=long with KV=int8_per_token_head and KV=int4_per_token_head (the launcher's
         KV knob; TRITON_ATTN), per KV dtype three servers: off, mtp (the profile's k, 3),
         dflash2 DFLASH_TOKENS=7 (the tiny DFlash2 drafter). MAX_LEN 2048. Prompts of
         1,664..1,791 tokens: every residue mod 128, and long enough for a prefix-cache hit
         under speculation on every server (vLLM 0.27.1 drops one block per hit under
         speculation: a hit needs L > 2B; B = 400/416 int8, 768..800 int4; docs/prefix-cache.md).
  kvarn  (job 63) CTX=huge (KVarN kvarn_k4v2_g128, installed into a private view by the job),
         servers off, mtp and d2k7 (SPEC=dflash2 DFLASH_TOKENS=7, the tiny DFlash2 drafter with
         its K/V in rings outside the pool: DFLASH_RING=1, see below). MAX_LEN 4096 (B = 1,024
         on the tiny model: a spec hit needs L > 2,048); prompts of 2,176..2,303 tokens: the
         tiny drafter's window is 64, so its 80-row ring wraps ~30 times per prompt.
  defer  (job 75) GDN_DEFER=1 (patch 0085: one GDN state block per sequence under speculation,
         the accepted tokens committed after rejection): CTX=long, servers off, mtp (stock
         speculation, the control: GDN_DEFER=0 explicitly, the default is 1), mtp-defer, mtp-defer-nopc (PREFIX_CACHE=0: mamba cache mode
         none), d2k7-defer and d2k15-defer (DFLASH_TOKENS=15: 7 drafter rows + 8 lookup
         positions, the widest verify block). MAX_LEN 4096; prompts of 1,984..2,111 tokens, so
         that the 32 decoded tokens of about a third of them cross a GDN cache-block boundary
         (B = 400..416 on the tiny model at int8), the case where the commit stores the
         boundary state for prefix caching.

Every server: the launcher's plan (onecard.plan.make_plan, MODEL=tiny), prefix caching on (+
--mamba-cache-mode align), vLLM's default CUDA graphs, GDN_PREFILL=triton, KV_MEM 1 GiB, MAX_SEQS
16, --seed 0, --logprobs-mode raw_logits, --gpu-memory-utilization = min(0.06, GPU_UTIL /
servers) (GPU_UTIL is the job's share in a `+` group; with a KV pin it is only vLLM's
free-memory bar), plus the plan's child environment (ONECARD_WIDE_VERIFY=1, ...). GDN_DEFER: the
quant and kvarn servers run the launcher's default (auto: 1 with speculation on one GPU since
2026-12-05; their runs before that were stock); the defer suite sets it on every server.

Run: one server boots alone first (``--warm-first``, default the first ``off`` server: it fills
the compile caches the others reuse; ``--warm-first ''`` boots all at once), then the rest at
once. Per-server boot times are printed, with each server's pool (vLLM's "GPU KV cache size")
beside the plan's prediction (log_facts; printed, not judged). Then the greedy sweep: 128 prompts, 32 tokens,
concurrent, every server at once, two passes (the second hits the prefix cache; per-server
prefix-cache hit tokens from /metrics are reported per pass, not judged); each spec server vs
the off server of its KV dtype, token for token with the bf16 near-tie rule. Then per spec
server the /metrics spec-decode counters (drafts, tokens/step: random drafters, plumbing only).

Exit 0 only when every gating server booted and no pair has a real divergence. A server marked
informational (a suite's "info" set: kvarn-d2k7 until the rings have booted on a GPU) does not
gate on its boot, but a real divergence after it booted still fails. CTX=huge + SPEC=dflash2: the DFlash2 drafter's attention
is non-causal and the KVARN backend has none, and keeping the drafter's layers in bf16 in the
pool (``--kv-cache-dtype-skip-layers``) fails at vLLM 0.27.1's KV-cache setup (CPU reproduction:
docs/results/2026-12-03-huge-dflash2-cpu). So the launcher runs kvarn-d2k7 with DFLASH_RING=1
(auto with CTX=huge; the server gets ONECARD_DFLASH_RING=1): the drafter's layers hand vLLM no
KV-cache spec, their K/V live in per-request bf16 rings beside the pool, on FLASH_ATTN
(docs/dflash2-huge.md section 3; not yet run on a GPU).

``--dry-run``: builds the tiny pair, prints every argv, parses each with the vLLM on the path's
own serve parser (the fields that matter as JSON), predicts each server's attention backends
(vLLM's own validate_configuration for target and drafter layers) and self-checks the analysis
(CPU; tests/test_gpu_spec_kv_dry.py). Writes OUT/<suite>.json (atomic), OUT/server-*.log.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import test_dflash2 as d2  # noqa: E402  (job 70's machinery)

REPO = d2.REPO
HOST = d2.HOST
GREEDY_TOKENS = d2.GREEDY_TOKENS
COMMON = {"MODEL": "tiny", "SERVED_NAME": "tiny", "HOST": HOST, "KV_MEM": "1G", "MAX_SEQS": "16",
          "GDN_PREFILL": "triton", "REASONING_PARSER": "none", "TOOLS": "0", "PREFIX_CACHE": "1"}
UTIL_MAX = 0.06   # per server, alone; in a group GPU_UTIL / servers when smaller
UTIL_MIN = 0.02
# Boot budget: the warm-first server gets at most WARM_MAX_S alone (then the rest start anyway);
# boots stop WARM_RESERVE_S / SWEEP_RESERVE_S before the deadline (the sweep of six servers at
# once: ~20-40 s expected, 2 x 128 prompts of <= 2.3k tokens + 32 tokens each).
WARM_MAX_S, WARM_RESERVE_S, SWEEP_RESERVE_S = 240, 160, 60
KV_SHORT = {"int8_per_token_head": "int8", "int4_per_token_head": "int4"}


def knob_overrides(text: str) -> dict:
    """SPEC_KV_KNOBS ('KNOB=VALUE KNOB=VALUE', launcher knobs, e.g. 'KVARN_DRAFT_HOST=1
    KVARN_WINDOW=3') -> {knob: value}, laid over a suite's base knobs for every server of the run.
    Exported ONECARD_* variables cannot do this: the launcher's plan sets them from its knobs.
    The rule and its one-line error: onecard.profiles.knob_overrides (job 61's arms share it)."""
    from onecard.profiles import knob_overrides as parse

    return parse(text.split(), "SPEC_KV_KNOBS word")


def suite(name: str, model: Path | None = None, environ=os.environ) -> dict:
    """The server table of a suite: {"servers": {name: knobs (+ "EXTRA": [words])},
    "base": base knobs (+ SPEC_KV_KNOBS), "pairs": [(spec server, off server)], "base_len",
    "info": set of informational servers, "warm_first"}."""
    st = _suite(name, model)
    st["base"] = {**st["base"], **knob_overrides(environ.get("SPEC_KV_KNOBS", ""))}
    return st


def _suite(name: str, model: Path | None = None) -> dict:
    if name == "quant":
        servers, pairs = {}, []
        for kv, short in KV_SHORT.items():
            servers[f"{short}-off"] = {"KV": kv, "SPEC": "off"}
            servers[f"{short}-mtp"] = {"KV": kv, "SPEC": "mtp"}
            servers[f"{short}-d2k7"] = {"KV": kv, "SPEC": "dflash2", "DFLASH_TOKENS": "7"}
            pairs += [(f"{short}-mtp", f"{short}-off"), (f"{short}-d2k7", f"{short}-off")]
        return {"servers": servers, "pairs": pairs, "info": set(), "warm_first": "int8-off",
                "base": {**COMMON, "CTX": "long", "MAX_LEN": "2048"}, "base_len": 1664}
    if name == "kvarn":
        # kvarn-d2k7: the drafter's K/V in rings outside the KVarN pool (DFLASH_RING=auto is 1 with
        # CTX=huge; in the pool it dies at KV-cache setup on vLLM 0.27.1:
        # docs/results/2026-12-03-huge-dflash2-cpu, docs/dflash2-huge.md)
        servers = {"kvarn-off": {"SPEC": "off"}, "kvarn-mtp": {"SPEC": "mtp"},
                   "kvarn-d2k7": {"SPEC": "dflash2", "DFLASH_TOKENS": "7"}}
        pairs = [("kvarn-mtp", "kvarn-off"), ("kvarn-d2k7", "kvarn-off")]
        # kvarn-d2k7 is informational until its first GPU boot: a failed boot is reported and
        # does not hide kvarn-mtp's verdict; a real divergence after it booted still fails
        return {"servers": servers, "pairs": pairs, "info": {"kvarn-d2k7"},
                "warm_first": "kvarn-off",
                "base": {**COMMON, "CTX": "huge", "MAX_LEN": "4096"}, "base_len": 2176}
    if name == "defer":
        # every server names its GDN_DEFER: the default (auto) is 1 with speculation since
        # 2026-12-05, so the stock control "mtp" pins 0 (and "off", where the knob has no effect)
        on, stock = {"GDN_DEFER": "1"}, {"GDN_DEFER": "0"}
        servers = {"off": {"SPEC": "off", **stock}, "mtp": {"SPEC": "mtp", **stock},
                   "mtp-defer": {"SPEC": "mtp", **on},
                   "mtp-defer-nopc": {"SPEC": "mtp", "PREFIX_CACHE": "0", **on},
                   "d2k7-defer": {"SPEC": "dflash2", "DFLASH_TOKENS": "7", **on},
                   "d2k15-defer": {"SPEC": "dflash2", "DFLASH_TOKENS": "15", **on}}
        pairs = [(n, "off") for n in servers if n != "off"]
        return {"servers": servers, "pairs": pairs, "info": set(), "warm_first": "off",
                "base": {**COMMON, "CTX": "long", "MAX_LEN": "4096"}, "base_len": 1984}
    raise ValueError(f"suite {name!r} is not valid; valid: quant, kvarn, defer")


def gpu_util(n_servers: int, environ=os.environ) -> float:
    """--gpu-memory-utilization per server: UTIL_MAX alone, GPU_UTIL / n in a `+` group."""
    share = environ.get("GPU_UTIL", "")
    util = UTIL_MAX
    if share:
        util = min(util, float(share) / max(1, n_servers))
    return max(UTIL_MIN, int(util * 1000) / 1000)


def extra_words(n_servers: int, environ=os.environ) -> list[str]:
    return ["--seed", "0", "--gpu-memory-utilization", str(gpu_util(n_servers, environ)),
            "--logprobs-mode", "raw_logits"]


def plans(st: dict, model: Path, root: Path, ports: dict | None = None, environ=os.environ) -> dict:
    """{server: (argv, child_env, plan)} through job 70's server_plan (the launcher's plan)."""
    extra = extra_words(len(st["servers"]), environ)
    return {n: d2.server_plan(n, model, (ports or {}).get(n, 0) or d2.free_port(), root,
                              servers=st["servers"], base=st["base"], extra=extra,
                              probabilistic=set())
            for n in st["servers"]}


# ----------------------------------------------------------------------------- pure helpers

def pair_verdict(rec: dict, st: dict) -> list[str]:
    """Failures of a finished record: gating servers not booted, pairs with real divergences,
    pairs never compared although both servers booted."""
    fails = []
    for n in st["servers"]:
        s = rec["servers"].get(n, {})
        if s.get("boot_s") is None and n not in st["info"]:
            fails.append(f"{n} did not boot ({s.get('error', 'no record')})")
    for spec, off in st["pairs"]:
        up = all(rec["servers"].get(x, {}).get("boot_s") is not None for x in (spec, off))
        for rnd in ("pass1", "pass2-cached"):
            r = rec["greedy"].get(f"{spec}-{rnd}")
            if r is None:
                if up:
                    fails.append(f"{spec} vs {off} {rnd}: not compared")
            elif r["bad"]:
                fails.append(f"{spec} vs {off} {rnd}: {len(r['bad'])} real divergences")
    return fails


def diagnose(log_text: str) -> str:
    """A one-line cause for a server that died in boot, from its log."""
    known = [("non-causal attention not supported",
              "an attention backend without non-causal attention (the DFlash2 drafter's block is "
              "non-causal; KVARN has none)"),
             ("No valid attention backend", "no attention backend accepts a layer's configuration"),
             ("CUDA out of memory", "CUDA out of memory"),
             ("less than desired GPU memory utilization", "free GPU memory below the util bar")]
    for needle, why in known:
        if needle in log_text:
            return why
    for line in reversed(log_text.splitlines()):
        if "Error" in line or "error" in line:
            return line.strip()[-300:]
    return "unknown (see the server log)"


_POOL = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_DEFER_ON = "onecard 0085: ONECARD_GDN_DEFER=1"
_DEFER_PLAN = re.compile(r"onecard 0085: GDN commit plan: (\d+) layers in (\d+) KV cache groups")


def log_facts(text: str) -> dict:
    """What a server log says about its pool and patch 0085 (printed, never judged): vLLM's
    "GPU KV cache size" (tokens), whether the deferred GDN commit is on, and its commit plan."""
    pool = _POOL.findall(text)
    plan = _DEFER_PLAN.findall(text)
    return {"pool_tokens": int(pool[-1].replace(",", "")) if pool else None,
            "gdn_defer": _DEFER_ON in text,
            "gdn_commit_plan": {"layers": int(plan[-1][0]), "groups": int(plan[-1][1])} if plan else None}


def self_check() -> dict:
    res = d2.self_check()
    st = suite("quant")
    rec = {"servers": {n: {"boot_s": 1.0} for n in st["servers"]}, "greedy": {}}
    for spec, _ in st["pairs"]:
        for rnd in ("pass1", "pass2-cached"):
            rec["greedy"][f"{spec}-{rnd}"] = {"equal": 128, "near_ties": [], "bad": []}
    res["verdict_clean"] = pair_verdict(rec, st)
    rec["greedy"]["int4-d2k7-pass2-cached"]["bad"] = [{"residue": 3}]
    rec["servers"]["int8-mtp"] = {"boot_s": None, "error": "x"}
    del rec["greedy"]["int8-mtp-pass1"], rec["greedy"]["int8-mtp-pass2-cached"]
    res["verdict_fail"] = pair_verdict(rec, st)
    res["prefix"] = d2.parse_prefix_cache(
        'vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 300.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 120.0\n')
    off = [{"tokens": [1, 2], "top": [[(1, 9.0)], [(2, 8.0), (4, 7.97)]]}] * 2
    res["compare_pass"] = d2.compare_pass(off, [{"tokens": [1, 2]}, {"tokens": [1, 4]}], 1664)
    res["util"] = [gpu_util(6, {}), gpu_util(6, {"GPU_UTIL": "0.267"}), gpu_util(6, {"GPU_UTIL": "0.1"})]
    res["log_facts"] = log_facts(
        "(EngineCore_DP0 pid=1) INFO [kv_cache_utils.py:2235] GPU KV cache size: 93,998 tokens\n"
        "INFO [onecard_gdn_defer_runtime.py:73] onecard 0085: ONECARD_GDN_DEFER=1: Gated-DeltaNet ...\n"
        "INFO [onecard_gdn_defer_runtime.py:162] onecard 0085: GDN commit plan: 48 layers in 10 KV cache "
        "groups, verify scratch 30.6 MiB\n")
    res["diagnose"] = diagnose("ValueError: No valid attention backend found ... "
                               "['non-causal attention not supported']")
    return res


def self_check_ok(res: dict) -> bool:
    cp = res["compare_pass"]
    return (res["equal"] and res["near_tie"] and not res["real_diff"] and not res["not_top2"]
            and res["three_way_tie"] and not res["rank4_3ulps"] and res["residues"] == 128
            and res["verdict_clean"] == []
            and res["verdict_fail"] == ["int8-mtp did not boot (x)",
                                        "int4-d2k7 vs int4-off pass2-cached: 1 real divergences"]
            and res["prefix"] == {"queries": 300.0, "hits": 120.0}
            and cp["equal"] == 1 and len(cp["near_ties"]) == 1 and cp["near_ties"][0]["residue"] == 1
            and res["util"] == [0.06, 0.044, 0.02]
            and res["log_facts"] == {"pool_tokens": 93998, "gdn_defer": True,
                                     "gdn_commit_plan": {"layers": 48, "groups": 10}}
            and res["diagnose"].startswith("an attention backend without non-causal"))


# ----------------------------------------------------------------------------- run

def prefix_cache(srv) -> dict:
    """The server's prefix-cache counters (tokens); NaN when /metrics does not answer."""
    try:
        return d2.parse_prefix_cache(srv.metrics_text())
    except Exception:  # noqa: BLE001 - reported, not judged
        return {"queries": float("nan"), "hits": float("nan")}


def run(suite_name: str, out: Path, deadline_s: float, warm_first: str | None,
        plans_fn=None) -> int:
    """The GPU run (module docstring). plans_fn: plans' stand-in (CPU tests: fake servers)."""
    from onecard.dflash.tiny_drafter import ensure_tiny_drafter
    from onecard.prepare.tiny import ensure_tiny_model

    tag = f"[{suite_name}]"

    def say(msg: str) -> None:
        print(f"{tag} {msg}", flush=True)

    t_start = time.monotonic()
    left = lambda: deadline_s - (time.monotonic() - t_start)  # noqa: E731
    model = ensure_tiny_model()
    ensure_tiny_drafter(model)
    st = suite(suite_name, model)
    if warm_first is None:
        warm_first = st["warm_first"]
    vocab = json.loads((model / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    rec: dict = {"suite": suite_name, "servers": {}, "greedy": {}, "prefix_cache": {},
                 "metrics": {}, "failures": [], "base_len": st["base_len"]}
    (out / "server.pids").unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "2")   # several servers compile at once
    servers: dict[str, d2.Server] = {}
    dead: set[str] = set()
    def save() -> None:   # after the servers stopped: the pair verdicts, then the record
        rec["failures"] += pair_verdict(rec, st)
        for n in st["info"]:
            if rec["servers"].get(n, {}).get("boot_s") is None:
                say(f"informational server {n} did not boot: {rec['servers'].get(n, {}).get('error')}")
        d2.write_json(out / f"{suite_name}.json", rec)

    with d2.recorded(rec, servers, t_start, save, say):
        for name, (argv, child, plan) in (plans_fn or plans)(st, model, out).items():
            port = int(argv[argv.index("--port") + 1])
            servers[name] = d2.Server(name, argv, port, out, child)
            pred = plan.prediction or {}
            rec["servers"][name] = {"argv": argv, "boot_s": None,
                                    "block_size_predicted": pred.get("block_size"),
                                    "pool_tokens_predicted": pred.get("pool_tokens")}

        def start(names):
            for n in names:
                servers[n].start(env)
                say(f"launch {n}")

        def wait(names, reserve, max_s=None):
            """Poll until every named server is healthy or dead, or max_s s have passed (the
            rest keep booting), or only `reserve` s are left (the rest are stopped)."""
            t_wait = time.monotonic()
            pending = [n for n in names if n not in dead and rec["servers"][n]["boot_s"] is None]
            while pending:
                if max_s is not None and time.monotonic() - t_wait > max_s:
                    say(f"boot: {', '.join(pending)} still booting after {max_s} s; starting the rest")
                    return
                for n in list(pending):
                    try:
                        if servers[n].ready():
                            rec["servers"][n]["boot_s"] = round(servers[n].boot_s, 1)
                            facts = log_facts(servers[n].log.read_text(errors="replace"))
                            rec["servers"][n].update(facts)
                            say(f"boot {n}: {servers[n].boot_s:.0f} s; pool {facts['pool_tokens']} tokens "
                                f"(predicted {rec['servers'][n]['pool_tokens_predicted']})"
                                + ("; GDN_DEFER on" if facts["gdn_defer"] else ""))
                            pending.remove(n)
                    except RuntimeError:
                        log = servers[n].log.read_text(errors="replace")
                        why = diagnose(log)
                        rec["servers"][n]["error"] = why
                        say(f"boot {n}: FAILED (rc={servers[n].proc.returncode}) after "
                            f"{time.monotonic() - servers[n].t0:.0f} s: {why}")
                        dead.add(n)
                        pending.remove(n)
                if pending and left() < reserve:
                    for n in pending:
                        rec["servers"][n]["error"] = f"not healthy after {time.monotonic() - servers[n].t0:.0f} s"
                        say(f"boot {n}: not healthy in time ({left():.0f} s left)")
                        servers[n].stop()
                        dead.add(n)
                    return
                time.sleep(1)

        names = list(servers)
        first = [warm_first] if warm_first in servers else []
        if first:
            start(first)
            wait(first, reserve=WARM_RESERVE_S, max_s=WARM_MAX_S)
        rest = [n for n in names if n not in first]
        start(rest)
        wait(names, reserve=SWEEP_RESERVE_S)
        up = [n for n in names if n not in dead]
        say("boot: " + ", ".join(f"{n} {rec['servers'][n]['boot_s']} s" if n in up
                                 else f"{n} FAILED" for n in names))

        specs = sorted({s for s, o in st["pairs"] if s in up and o in up})
        before = {}
        for n in specs:
            try:
                before[n] = servers[n].metrics()
            except Exception:  # noqa: BLE001 - metrics are reported, not judged
                before[n] = d2.parse_metrics("")
        prompts = d2.greedy_prompts(vocab, base_len=st["base_len"])
        t = time.monotonic()
        for rnd in ("pass1", "pass2-cached"):
            if left() < 15:
                say(f"greedy {rnd}: skipped ({left():.0f} s left)")
                break
            pc0 = {n: prefix_cache(servers[n]) for n in up}
            with cf.ThreadPoolExecutor(len(up) or 1) as ex:
                futs = {n: ex.submit(d2.greedy_run, servers[n], prompts) for n in up}
                res = {}
                for n, f in futs.items():
                    try:
                        res[n] = f.result()
                    except Exception as e:  # noqa: BLE001 - the server failed mid-sweep
                        say(f"greedy {rnd} {n}: ERROR {type(e).__name__}: {str(e)[:300]}")
                        rec["failures"].append(f"{n} {rnd}: {type(e).__name__}")
            for n in up:
                pc1 = prefix_cache(servers[n])
                rec["prefix_cache"][f"{n}-{rnd}"] = {k: pc1[k] - pc0[n][k] for k in pc1}
            say(f"prefix cache {rnd} (hit/query tokens): " + ", ".join(
                f"{n} {rec['prefix_cache'][f'{n}-{rnd}']['hits']:.0f}/"
                f"{rec['prefix_cache'][f'{n}-{rnd}']['queries']:.0f}" for n in up))
            for spec, off in st["pairs"]:
                if spec in res and off in res:
                    r = d2.compare_pass(res[off], res[spec], st["base_len"])
                    rec["greedy"][f"{spec}-{rnd}"] = r
                    say(d2.pass_line(spec, off, rnd, r))
        rec["greedy_wall_s"] = round(time.monotonic() - t, 1)
        for n in specs:
            try:
                d = d2.metrics_delta(before[n], servers[n].metrics())
            except Exception as e:  # noqa: BLE001
                say(f"metrics {n}: unavailable ({type(e).__name__})")
                continue
            rec["metrics"][n] = d
            say(f"metrics {n}: drafts {d['drafts']:.0f}, accepted {d['accepted']:.0f}, "
                f"tokens/step {d['tokens_per_step']:.3f}, positions {len(d['per_pos'])}")
        for n in specs:   # patch 0085's commit plan is logged at the first verify step
            facts = log_facts(servers[n].log.read_text(errors="replace"))
            rec["servers"][n].update(facts)
            if facts["gdn_defer"]:
                say(f"gdn defer {n}: commit plan {facts['gdn_commit_plan']}")
    return d2.verdict(rec, say)


# ----------------------------------------------------------------------------- dry run

_PARSER: dict = {}


def parse_argv(argv: list[str]) -> dict:
    """vLLM's own serve parser on one argv (no GPU: DeviceConfig's device inference is skipped);
    the engine arguments that matter, as plain data."""
    import vllm.config.device as device

    device.DeviceConfig.__post_init__ = lambda self: None
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if "parser" not in _PARSER:   # built once: most of a dry run's time
        _PARSER["parser"] = make_arg_parser(FlexibleArgumentParser())
    ns = _PARSER["parser"].parse_args(argv[argv.index("serve") + 1:])
    a = AsyncEngineArgs.from_cli_args(ns)
    return {"kv_cache_dtype": a.kv_cache_dtype,
            "attention_backend": str(a.attention_backend) if a.attention_backend else None,
            "speculative_config": a.speculative_config, "enable_prefix_caching": a.enable_prefix_caching,
            "mamba_cache_mode": a.mamba_cache_mode, "enforce_eager": a.enforce_eager,
            "max_model_len": a.max_model_len, "kv_cache_memory_bytes": a.kv_cache_memory_bytes,
            "gpu_memory_utilization": a.gpu_memory_utilization, "logprobs_mode": a.logprobs_mode,
            "seed": a.seed, "language_model_only": a.language_model_only,
            "kv_cache_dtype_skip_layers": list(a.kv_cache_dtype_skip_layers or []),
            "additional_config": a.additional_config, "host": ns.host, "max_num_seqs": a.max_num_seqs}


def predict_backends(parsed: dict, model: Path, child_env: dict | None = None) -> dict:
    """Which attention backends accept this server's layers (vLLM's own validate_configuration
    of the backends on the path): the target's full-attention layers and, with dflash2, the
    drafter's (non-causal per its config; kv dtype 'auto' when its layers are skipped or live in
    rings outside the pool: ONECARD_DFLASH_RING=1 in ``child_env``)."""
    import torch
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    kv = parsed["kv_cache_dtype"]
    cfg = json.loads((model / "config.json").read_text())
    tcfg = cfg.get("text_config", cfg)
    layers = {"target": (tcfg["head_dim"], kv, False)}
    sc = parsed["speculative_config"] or {}
    if sc.get("method") == "dflash2":
        dcfg = json.loads((Path(sc["model"]) / "config.json").read_text())
        from types import SimpleNamespace

        from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal

        non_causal = dflash_has_any_non_causal(SimpleNamespace(**dcfg))
        skipped = bool(parsed["kv_cache_dtype_skip_layers"])
        in_ring = (child_env or {}).get("ONECARD_DFLASH_RING") == "1"
        layers["drafter"] = (dcfg.get("head_dim"), "auto" if skipped or in_ring else kv, non_causal)
    names = ["TRITON_ATTN", "FLASH_ATTN", "FLASHINFER"]
    if kv.startswith("kvarn"):
        names = ["KVARN", *names]
    if parsed["attention_backend"]:
        names = [parsed["attention_backend"].split(".")[-1]]
    out = {}
    for what, (hd, kvd, nc) in layers.items():
        ok, why = [], {}
        for nm in names:
            try:
                cls = AttentionBackendEnum[nm].get_class()
            except Exception as e:  # noqa: BLE001 - a backend that does not import on CPU
                why[nm] = [f"import: {type(e).__name__}"]
                continue
            r = cls.validate_configuration(
                head_size=hd, dtype=torch.bfloat16, kv_cache_dtype=kvd, block_size=None,
                use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
                use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
                attn_type="decoder", use_non_causal=nc)
            (ok.append(nm) if not r else why.__setitem__(nm, r))
        out[what] = {"head_dim": hd, "kv": kvd, "non_causal": nc, "ok": ok, "rejected": why}
    return out


def dry_run(suite_name: str, out: Path) -> int:
    from onecard.dflash.tiny_drafter import ensure_tiny_drafter
    from onecard.prepare.tiny import ensure_tiny_model

    tag = f"[{suite_name}]"
    model = ensure_tiny_model()
    ensure_tiny_drafter(model)
    st = suite(suite_name, model)
    ok = True
    for name, (argv, child, plan) in plans(st, model, out).items():
        print(f"{tag} argv {name}: {shlex.join(argv)}", flush=True)
        print(f"{tag} child_env {name}: {json.dumps(child, sort_keys=True)}", flush=True)
        print(f"{tag} block {name}: {(plan.prediction or {}).get('block_size')}", flush=True)
        try:
            parsed = parse_argv(argv)
            print(f"{tag} parsed {name}: {json.dumps(parsed, sort_keys=True, default=str)}", flush=True)
        except BaseException as e:  # noqa: BLE001 - argparse exits with SystemExit
            print(f"{tag} parse {name}: FAILED {type(e).__name__}: {e}", flush=True)
            ok = False
            continue
        try:
            pred = predict_backends(parsed, model, child)
            print(f"{tag} backends {name}: {json.dumps(pred, sort_keys=True)}", flush=True)
        except Exception as e:  # noqa: BLE001 - a prediction, not a check
            print(f"{tag} backends {name}: not predicted ({type(e).__name__}: {str(e)[:200]})",
                  flush=True)
    res = self_check()
    print(f"{tag} self-check: {json.dumps(res, default=str)}", flush=True)
    ok = ok and self_check_ok(res)
    print(f"{tag} dry run {'PASS' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=("quant", "kvarn", "defer"), required=True)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("JOB_OUT", "/tmp/spec-kv")))
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds for the whole run")
    ap.add_argument("--warm-first", default=None,
                    help="server booted alone first (default: the suite's off server; '' = none)")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.dry_run:
        return dry_run(a.suite, a.out)
    return run(a.suite, a.out, a.deadline, a.warm_first)


if __name__ == "__main__":
    sys.exit(main())
