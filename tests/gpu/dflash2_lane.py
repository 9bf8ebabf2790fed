"""GPU: the DFlash2 lookup lane with an agreeing pair (onecard.dflash.agree), against SPEC=off.

The random tiny drafter is rejected at position 0, so verify positions 7..14 (the lookup lane at
DFLASH_TOKENS=15) are never reached. Here target and drafter both always predict one token X
(``ensure_agreeing_pair()``): every draft is accepted and the lane's positions are measured.

Four servers on one GPU, booted at once through the launcher's plan (tests/gpu/test_dflash2.py's
``server_plan`` / ``Server`` with this table; MODEL=<agree model dir>, DRAFT=<agree drafter dir>),
prefix caching on, default CUDA graphs, GDN_PREFILL=triton, --gpu-memory-utilization
GPU_UTIL/4 each (default 0.08), greedy drafting:

  off           SPEC=off
  d2k7          SPEC=dflash2 DFLASH_TOKENS=7            (drafter rows only)
  d2k15         SPEC=dflash2 DFLASH_TOKENS=15           (7 drafter rows + 8 lookup positions)
  d2k15-nolook  SPEC=dflash2 DFLASH_TOKENS=15 LOOKUP=0  (positions 8..15 repeat the last draft)

Requests (greedy, 96 tokens, ignore_eos, token-id prompts): prompts with a run of 40 X after
100 random ordinary tokens, and prompts without X. Checks, one ``[lane]`` line per phase:
1. exactness: every server's output is 96 x X and identical to off's;
2. /metrics deltas: tokens/step = 1 + accepted/drafts per spec server, per-position acceptance;
   pass: d2k15 tokens/step > d2k7 tokens/step + 3, and d2k15 accepted at positions 7..14 > 0.
   d2k15-nolook is reported, not judged: its fill (the last draft repeated) is X here too, so
   in an all-X world it is accepted like the lane (positions 7..14 > 0 are expected, not a bug).

Run: ``python3 tests/gpu/dflash2_lane.py --out DIR`` (gpu/jobs/72-dflash2-lane.sh); ``--dry-run``
builds the pair, prints every argv and self-checks the analysis on synthetic metrics (CPU;
tests/dflash/test_agree_pair.py). Writes OUT/lane.json (atomic) and OUT/server-*.log.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from test_dflash2 import (HOST, Server, boot_all, driver_main, free_port, metrics_delta,  # noqa: E402
                          parse_metrics, recorded, server_plan, verdict, write_json)

SERVERS = {
    "off": {"SPEC": "off"},
    "d2k7": {"SPEC": "dflash2", "DFLASH_TOKENS": "7"},
    "d2k15": {"SPEC": "dflash2", "DFLASH_TOKENS": "15"},
    "d2k15-nolook": {"SPEC": "dflash2", "DFLASH_TOKENS": "15", "LOOKUP": "0"},
}
SPEC_SERVERS = ("d2k7", "d2k15", "d2k15-nolook")
TOKENS = 96
LANE = range(7, 15)          # verify positions past the 7 drafter rows (0-based, /metrics)


def say(msg: str) -> None:
    print(f"[lane] {msg}", flush=True)


def gpu_util() -> str:
    return f"{float(os.environ.get('GPU_UTIL', '0.32')) / 4:.3f}"


def base_knobs(model: Path, draft: Path) -> dict:
    return {"MODEL": str(model), "DRAFT": str(draft), "SERVED_NAME": "tiny", "HOST": HOST,
            "MAX_LEN": "2048", "KV_MEM": "512M", "MAX_SEQS": "32", "GDN_PREFILL": "triton",
            "REASONING_PARSER": "none", "TOOLS": "0", "PREFIX_CACHE": "1"}


def extra_args() -> list[str]:
    # --jit-monitor-verbose: every Triton JIT compile after boot is logged (see test_dflash2.EXTRA)
    return ["--seed", "0", "--gpu-memory-utilization", gpu_util(), "--jit-monitor-verbose"]


def plan(name: str, model: Path, draft: Path, port: int, out: Path):
    base = base_knobs(model, draft)
    if SERVERS[name]["SPEC"] == "off":
        base.pop("DRAFT")            # only a "DRAFT is ignored" note otherwise
    return server_plan(name, model, port, out, servers=SERVERS, base=base, extra=extra_args(),
                       probabilistic=set())


def lane_prompts(vocab: int, x: int, seed: int = 0) -> list[list[int]]:
    """4 prompts = 100 random ordinary tokens + 40 x X, and 4 of 140 random tokens without X."""
    rng = random.Random(seed)

    def ordinary() -> int:
        while True:
            t = rng.randrange(10, vocab - 300)
            if t != x:
                return t
    with_run = [[ordinary() for _ in range(100)] + [x] * 40 for _ in range(4)]
    without = [[ordinary() for _ in range(140)] for _ in range(4)]
    return with_run + without


def analyse(outputs: dict, deltas: dict, x: int) -> dict:
    """outputs: {server: [[ids] per prompt]}; deltas: {spec server: metrics_delta}. Returns
    {"exact": {...}, "tps": {...}, "lane": {...}, "failures": [...]}."""
    res: dict = {"exact": {}, "tps": {}, "lane": {}, "per_pos": {}, "failures": []}
    off = outputs.get("off", [])
    for n, outs in outputs.items():
        all_x = all(len(o) == TOKENS and all(t == x for t in o) for o in outs) and bool(outs)
        same = outs == off
        res["exact"][n] = {"all_x": all_x, "same_as_off": same}
        if not (all_x and same):
            bad = next((i for i, o in enumerate(outs)
                        if i >= len(off) or o != off[i] or len(o) != TOKENS
                        or any(t != x for t in o)), None)
            res["failures"].append(f"exactness {n}: all X {all_x}, same as off {same}"
                                   + (f" (first bad prompt {bad})" if bad is not None else ""))
    for n, d in deltas.items():
        res["tps"][n] = d["tokens_per_step"]
        res["per_pos"][n] = {int(p): v for p, v in d["per_pos"].items()}
        res["lane"][n] = sum(v for p, v in d["per_pos"].items() if int(p) in LANE)
        if not d["drafts"] > 0:
            res["failures"].append(f"metrics {n}: no drafts")
    if "d2k7" in deltas and "d2k15" in deltas:
        t7, t15 = res["tps"]["d2k7"], res["tps"]["d2k15"]
        if not t15 > t7 + 3:
            res["failures"].append(f"d2k15 tokens/step {t15:.3f} not > d2k7 {t7:.3f} + 3")
        if not res["lane"]["d2k15"] > 0:
            res["failures"].append("d2k15: nothing accepted at positions 7..14")
    return res


def self_check() -> dict:
    """analyse() on synthetic metrics pages and outputs (what --dry-run asserts)."""
    def page(drafts: int, per_pos: list[int]) -> str:
        lab = 'engine="0",model_name="tiny"'
        return (f"vllm:spec_decode_num_drafts_total{{{lab}}} {drafts}.0\n"
                f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {sum(per_pos)}.0\n"
                + "".join(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},'
                          f'position="{p}"}} {v}.0\n' for p, v in enumerate(per_pos)))
    x = 267
    good = {n: [[x] * TOKENS] * 3 for n in SERVERS}
    zero = parse_metrics("")
    deltas = {"d2k7": metrics_delta(zero, parse_metrics(page(100, [100] * 7))),
              "d2k15": metrics_delta(zero, parse_metrics(page(100, [100] * 7 + [90] * 8))),
              "d2k15-nolook": metrics_delta(zero, parse_metrics(page(100, [100] * 7 + [0] * 8)))}
    ok = analyse(good, deltas, x)
    flat = dict(deltas, d2k15=deltas["d2k15-nolook"])
    bad_tps = analyse(good, flat, x)
    diverged = dict(good, d2k15=[[x] * TOKENS, [x] * 50 + [5] * 46, [x] * TOKENS])
    bad_out = analyse(diverged, deltas, x)
    return {"ok_failures": ok["failures"], "tps": [round(ok["tps"][n], 3) for n in SPEC_SERVERS],
            "lane": [ok["lane"][n] for n in SPEC_SERVERS],
            "flat_fails": len(bad_tps["failures"]), "diverged_fails": len(bad_out["failures"])}


def dry_ok(res: dict) -> bool:
    return (res["ok_failures"] == [] and res["tps"] == [8.0, 15.2, 8.0]
            and res["lane"] == [0, 720.0, 0] and res["flat_fails"] == 2
            and res["diverged_fails"] == 1)


def run(out: Path, deadline_s: float) -> int:
    from onecard.dflash.agree import ensure_agreeing_pair

    t_start = time.monotonic()
    left = lambda: deadline_s - (time.monotonic() - t_start)  # noqa: E731
    model, draft, x = ensure_agreeing_pair()
    cfg = json.loads((model / "config.json").read_text())
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    info = json.loads((model / "agree.json").read_text())
    say(f"pair: {model.name} + {draft.name}, X={x}, margin {info['margin']} "
        f"({info['margin_bf16_ulps']} bf16 ulps)")
    rec: dict = {"x": x, "agree": info, "servers": {}, "failures": []}
    servers: dict[str, Server] = {}
    with recorded(rec, servers, t_start, lambda: write_json(out / "lane.json", rec), say):
        boot_all(SERVERS, lambda name, port: plan(name, model, draft, port, out), out, rec, servers,
                 left, min_left=30, log=say)

        prompts = lane_prompts(vocab, x)
        before = {n: servers[n].metrics() for n in SPEC_SERVERS}
        outputs = {}
        t = time.monotonic()
        for n, s in servers.items():
            def one(p, s=s):
                c = s.complete(p, max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
                return [int(tok.split(":", 1)[1]) if tok.startswith("token_id:") else -1
                        for tok in c["logprobs"]["tokens"]]
            with cf.ThreadPoolExecutor(len(prompts)) as ex:
                outputs[n] = list(ex.map(one, prompts))
        deltas = {n: metrics_delta(before[n], servers[n].metrics()) for n in SPEC_SERVERS}
        rec["requests_wall_s"] = round(time.monotonic() - t, 1)
        res = analyse(outputs, deltas, x)
        rec.update(outputs={n: [o[:8] for o in v] for n, v in outputs.items()}, metrics=deltas,
                   analysis=res)
        rec["failures"] += res["failures"]
        say("exactness: " + ", ".join(
            f"{n} {'all X' if e['all_x'] else 'NOT all X'}/{'== off' if e['same_as_off'] else '!= off'}"
            for n, e in res["exact"].items()) + f" ({len(prompts)} prompts x {TOKENS} tokens)")
        for n in SPEC_SERVERS:
            d = deltas[n]
            pp = res["per_pos"][n]
            say(f"metrics {n}: tokens/step {res['tps'][n]:.3f} (drafts {d['drafts']:.0f}, "
                f"accepted {d['accepted']:.0f}); per-position acceptance "
                + " ".join(f"{pp.get(p, 0) / d['drafts']:.2f}" if d["drafts"] else "nan"
                           for p in range(max(pp, default=-1) + 1))
                + f"; accepted at positions 7..14: {res['lane'][n]:.0f}")
        say(f"lane: d2k15 {res['tps']['d2k15']:.3f} vs d2k7 {res['tps']['d2k7']:.3f} tokens/step "
            f"(need > +3); d2k15-nolook {res['tps']['d2k15-nolook']:.3f} (fill repeats X: "
            "reported, not judged)")
    return verdict(rec, say)


def dry_run(out: Path) -> int:
    from onecard.dflash.agree import ensure_agreeing_pair

    model, draft, x = ensure_agreeing_pair()
    info = json.loads((model / "agree.json").read_text())
    say(f"pair: {model} + {draft}, X={x}, margin {info['margin']}")
    for name in SERVERS:
        argv = plan(name, model, draft, free_port(), out)[0]
        say(f"argv {name}: {shlex.join(argv)}")
    res = self_check()
    say(f"self-check: {json.dumps(res)}")
    ok = dry_ok(res)
    say("dry run " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    return driver_main(argv, __doc__, "/tmp/dflash2-lane", dry_run, run)


if __name__ == "__main__":
    sys.exit(main())
