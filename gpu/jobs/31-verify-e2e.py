#!/usr/bin/env python3
"""Job 31's client side: ms per engine step at C1 on a running server, per prompt depth.

For each depth: one request (random token ids, ignore_eos, max_tokens OUT) streamed with
onecard.bench's client, greedy by default; --temperature T > 0 sends sampled requests instead
(temperature T, a fixed per-request seed --seed, default 31: the same seed on every request of the
run, so a run is reproducible; top_p / top_k only when --top-p / --top-k are given, else the
server's defaults). The JSON records the temperature at the top and on every row (``sampled``:
true/false), so greedy and sampled figures are never mixed up. /metrics scraped right before and
after each request (onecard.bench.metrics, parsed with prometheus_client). Per request:
  decode_s      = delta vllm:request_decode_time_seconds_sum (first token -> last, engine side)
  steps         = delta vllm:spec_decode_num_drafts_total with speculation (one draft per verify
                  step at C1), else delta generation tokens - 1 (the first token is the prefill's)
  server ms/step = 1000 * decode_s / steps;  client ms/step = 1000 * (t_last - t_first) /
                  (chunks - 1) (one stream event per engine step at C1)
A depth whose prompt + OUT exceeds the server's max_model_len (/v1/models) is recorded as a
skipped row (``skipped``: why), not measured and not a problem.
With --profile-depth N (the server booted with vLLM's torch profiler, job 31's ``prof`` arms):
after the depths, the N-token prompt is sent again (a prefix-cache hit: short prefill) with
--profile-tokens out between POST /start_profile and /stop_profile; the server's profiler config
decides which iterations are recorded (delay_iterations / max_iterations); the request's figures
go to the JSON's ``profile`` entry; gpu/probe/trace_summary.py reads the trace.
Writes one JSON (provenance + rows) atomically; prints one line per depth.
Repeats of a greedy prompt must give the same text (a problem if not); a sampled arm's
``repeat_texts_equal`` is informative only.
Exit 0 when every request finished with usage.completion_tokens == OUT and the counters moved
(steps > 0; with --spec, drafts > 0); 1 otherwise; 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from onecard.bench import metrics, provenance  # noqa: E402
from onecard.bench.client import Client  # noqa: E402
from jobutil import write_json  # noqa: E402  (gpu/lib/jobutil.py)

DECODE_SUM = "vllm:request_decode_time_seconds_sum"
ITER_COUNT = "vllm:iteration_tokens_total_count"


def prompt_ids(n: int, seed: int = 31, lo: int = 1000, hi: int = 100_000) -> list[int]:
    """n token ids, the same list for every arm (the shorter depths are prefixes of the longer)."""
    rng = random.Random(seed)
    return [rng.randrange(lo, hi) for _ in range(n)]


def gap_stats(times: list[float]) -> dict:
    """Median and largest gap between content chunks, and how many gaps exceed 3x the median:
    a mean per step moves by ~3 ms with one 150 ms stall among 47 steps, the median does not."""
    gaps = sorted(1000 * (b - a) for a, b in zip(times, times[1:]))
    if not gaps:
        return {"client_gap_ms_p50": None, "client_gap_ms_max": None, "client_stalls": None}
    p50 = statistics.median(gaps)
    return {"client_gap_ms_p50": p50, "client_gap_ms_max": gaps[-1],
            "client_stalls": sum(1 for g in gaps if g > 3 * p50)}


def sampling_params(temperature: float, top_p: float | None = None, top_k: int | None = None,
                    seed: int = 31) -> dict:
    """The request fields: greedy (temperature 0) exactly as before, ``{"temperature": 0.0,
    "ignore_eos": True}``; sampled adds the fixed ``seed`` and top_p / top_k only when given (else
    the server's defaults). A value that is not valid raises ValueError with a one-line message
    naming what is valid (the job's shell checks the same rules before any boot)."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"--temperature {temperature!r} is not valid; valid: a number >= 0 (0 = greedy, e.g. 0.7)")
    if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ValueError(f"--top-p {top_p!r} is not valid; valid: 0 < top_p <= 1 (leave it out for the server's default)")
    if top_k is not None and not (top_k == -1 or top_k >= 1):
        raise ValueError(f"--top-k {top_k!r} is not valid; valid: -1 (all) or an integer >= 1 "
                         "(leave it out for the server's default)")
    if seed < 0:
        raise ValueError(f"--seed {seed!r} is not valid; valid: an integer >= 0")
    if temperature == 0:
        if top_p is not None or top_k is not None:
            raise ValueError("--top-p / --top-k are not valid with --temperature 0; valid: only with a "
                             "temperature > 0 (sampled requests)")
        return {"temperature": 0.0, "ignore_eos": True}
    s = {"temperature": float(temperature), "ignore_eos": True, "seed": int(seed)}
    if top_p is not None:
        s["top_p"] = float(top_p)
    if top_k is not None:
        s["top_k"] = int(top_k)
    return s


def median_repeat(reps: list[dict], greedy: bool = True) -> dict:
    """The repeat with the median server ms/step (the lower middle one for an even count), with
    every repeat's figure, and whether the repeats' texts agree (a problem if not, for greedy
    requests only: a sampled run's texts are informative)."""
    ok = [r for r in reps if r.get("server_ms_per_step") is not None and not r["problems"]]
    pick = sorted(ok, key=lambda r: r["server_ms_per_step"])[(len(ok) - 1) // 2] if ok else reps[0]
    row = dict(pick)
    row["server_ms_per_step_repeats"] = [r.get("server_ms_per_step") for r in reps]
    row["client_ms_per_step_repeats"] = [r.get("client_ms_per_step") for r in reps]
    texts = {r.get("text") for r in reps}
    row["repeat_texts_equal"] = len(texts) == 1
    row["problems"] = [p for r in reps for p in r["problems"]]
    if len(texts) > 1 and greedy:
        row["problems"].append("greedy texts differ between repeats of one prompt")
    return row


def step_row(before: metrics.Snapshot, after: metrics.Snapshot, res, out_tokens: int,
             spec: bool) -> dict:
    d = {k: after.get(v) - before.get(v) for k, v in metrics.COUNTERS.items()}
    decode_s = after.get(DECODE_SUM) - before.get(DECODE_SUM) if DECODE_SUM in after.values else None
    gen = res.completion_tokens
    steps = d["spec_drafts"] if spec else ((gen or 0) - 1)
    row = {
        "ok": bool(res.ok), "error": res.error, "completion_tokens": gen, "text": res.text,
        "prompt_tokens": res.prompt_tokens, "chunks": res.chunks,
        "ttft_s": res.ttft, "client_decode_s": (res.t_last - res.t_first) if res.t_first and res.t_last else None,
        "server_decode_s": decode_s, "steps": steps,
        "spec_drafts": d["spec_drafts"], "spec_accepted": d["spec_accepted"],
        "generation_tokens_delta": d["generation_tokens"],
        "engine_iterations_delta": (after.get(ITER_COUNT) - before.get(ITER_COUNT)) if ITER_COUNT in after.values else None,
    }
    row["server_ms_per_step"] = 1000 * decode_s / steps if decode_s is not None and steps > 0 else None
    row["client_ms_per_step"] = (1000 * row["client_decode_s"] / (res.chunks - 1)
                                 if row["client_decode_s"] and res.chunks > 1 else None)
    row["tokens_per_step"] = (gen - 1) / steps if gen and steps > 0 else None
    row.update(gap_stats(res.chunk_times))
    problems = []
    if not res.ok:
        problems.append(f"request failed: {res.error}")
    if gen != out_tokens:
        problems.append(f"completion_tokens {gen} != {out_tokens}")
    if steps <= 0:
        problems.append("no decode steps counted")
    if spec and d["spec_drafts"] <= 0:
        problems.append("spec_decode_num_drafts did not move (speculation off?)")
    if decode_s is None:
        problems.append(f"{DECODE_SUM} missing from /metrics")
    row["problems"] = problems
    return row


def profile_request(a, c: Client, ids: list[int], sampling: dict) -> dict:
    """POST /start_profile, one streamed request, POST /stop_profile (the trace is written then:
    up to minutes). Never raises: what failed is in the returned dict's ``error``."""
    import httpx

    rec: dict = {"depth": len(ids), "out_tokens": a.profile_tokens}
    try:
        with httpx.Client(base_url=a.url, timeout=300.0) as h:
            h.post("/start_profile").raise_for_status()
            res = c.stream(ids, a.profile_tokens, sampling, keep_text=False)
            rec.update(ok=res.ok, error=res.error)
            t = time.perf_counter()
            h.post("/stop_profile").raise_for_status()
            rec["stop_s"] = round(time.perf_counter() - t, 1)
    except Exception as e:  # noqa: BLE001 - a profile is extra; the step figures stand without it
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    return rec


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True, help="served model name")
    ap.add_argument("--label", required=True, help="arm label, e.g. mtp-wide1")
    ap.add_argument("--spec", action="store_true", help="the server speculates (count verify steps)")
    ap.add_argument("--depths", default="8192,32768", help="prompt tokens, comma separated")
    ap.add_argument("--out-tokens", type=int, default=48)
    ap.add_argument("--warmup-tokens", type=int, default=1024)
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--repeats", type=int, default=3,
                    help="requests per depth (from the 2nd on they hit the prefix cache); the row kept is "
                         "the one with the median server ms/step, every repeat's figure is listed")
    ap.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    ap.add_argument("--profile-depth", type=int, default=0,
                    help="after the depths, one profiled request of this many prompt tokens")
    ap.add_argument("--profile-tokens", type=int, default=40)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="request temperature: 0 (default) = greedy, as before; > 0 = sampled requests "
                         "with a fixed --seed (job 31's TEMPERATURE / an arm's TEMPERATURE= field)")
    ap.add_argument("--seed", type=int, default=31, help="per-request seed of sampled requests (default 31)")
    ap.add_argument("--top-p", type=float, default=None, help="sampled requests only; default: the server's")
    ap.add_argument("--top-k", type=int, default=None, help="sampled requests only; default: the server's")
    a = ap.parse_args(argv)
    try:
        depths = [int(x) for x in a.depths.split(",") if x]
    except ValueError:
        print(f"--depths {a.depths!r} is not valid; valid: comma-separated token counts, e.g. 8192,32768", file=sys.stderr)
        return 2
    if a.repeats < 1:
        print(f"--repeats {a.repeats} is not valid; valid: 1 or more", file=sys.stderr)
        return 2
    if not depths or min(depths) < 16 or a.out_tokens < 3:
        print("--depths must be >= 16 tokens each and --out-tokens >= 3; valid: e.g. --depths 8192 --out-tokens 48",
              file=sys.stderr)
        return 2
    try:
        sampling = sampling_params(a.temperature, a.top_p, a.top_k, a.seed)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    sampled = sampling["temperature"] > 0
    # every row and the record say which requests made them; the printed lines mark sampled rows
    mode = {"temperature": sampling["temperature"], "sampled": sampled}
    tag = f" [sampled T={sampling['temperature']:g} seed {a.seed}]" if sampled else ""
    c = Client(a.url, a.model, timeout=a.timeout)
    ids = prompt_ids(max(depths + [a.warmup_tokens]))
    t0 = time.perf_counter()
    warm = c.stream(prompt_ids(a.warmup_tokens, seed=7), 16, sampling, keep_text=False)
    warmup = {"policy": f"one request, {a.warmup_tokens} prompt tokens, 16 out", "ok": warm.ok,
              "error": warm.error, "s": round(time.perf_counter() - t0, 2)}
    info = c.server_info()
    max_len = info.get("max_model_len")
    rows = []
    for n in depths:
        if isinstance(max_len, int) and n + a.out_tokens > max_len:
            # e.g. 72k on a dflash2 server: the drafter's KV layers share the pinned pool, so the
            # plan caps MAX_LEN lower than for SPEC=off/mtp
            rows.append({"label": a.label, "depth": n, **mode,
                         "skipped": f"depth + out > max_model_len {max_len}", "problems": []})
            print(f"{a.label + tag:<14} depth {n:>6}: skipped (> max_model_len {max_len})", flush=True)
            continue
        reps = []
        for _ in range(a.repeats):
            before = metrics.scrape(a.url)
            res = c.stream(ids[:n], a.out_tokens, sampling, keep_text=True, keep_times=True)
            time.sleep(0.3)  # let the engine publish the request's final stats
            after = metrics.scrape(a.url)
            reps.append(step_row(before, after, res, a.out_tokens, a.spec))
        row = {"label": a.label, "depth": n, **mode, **median_repeat(reps, greedy=not sampled)}
        rows.append(row)
        f = lambda x, nd=2: "-" if x is None else f"{x:.{nd}f}"  # noqa: E731
        print(f"{a.label + tag:<14} depth {n:>6}: server {f(row['server_ms_per_step'])} ms/step, client "
              f"{f(row['client_ms_per_step'])} ms/step, {row['steps']} steps, tokens/step "
              f"{f(row['tokens_per_step'])}, ttft {f(row['ttft_s'])} s, gap p50 "
              f"{f(row['client_gap_ms_p50'])} / max {f(row['client_gap_ms_max'])} ms, "
              f"{row['client_stalls']} gaps > 3x p50; repeats "
              f"{', '.join(f(x) for x in row['server_ms_per_step_repeats'])} ms/step"
              + (f"  PROBLEMS: {'; '.join(row['problems'])}" if row["problems"] else ""), flush=True)
    profile = None
    if a.profile_depth:
        profile = profile_request(a, c, ids[:a.profile_depth], sampling)
        print(f"{a.label + tag:<14} profile depth {a.profile_depth}: {profile}", flush=True)
    c.close()
    record = {
        "kind": "verify_e2e",
        "label": a.label,
        "spec": a.spec,
        **mode,
        "seed": a.seed if sampled else None,
        "provenance": provenance.build(
            prompt_set={"id": "random-token-ids-seed31", "depths": depths},
            sampling=sampling, token_count_source="usage.completion_tokens + server counters",
            warmup=warmup, server=info, max_tokens=a.out_tokens),
        "rows": rows,
        "profile": profile,
    }
    write_json(a.json, record)
    measured = [r for r in rows if not r.get("skipped")]
    return 0 if measured and all(not r["problems"] for r in rows) and warm.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
