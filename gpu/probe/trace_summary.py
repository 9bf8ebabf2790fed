"""Where a served engine step's GPU time goes: a summary of a vLLM torch-profiler trace.

Job 31's profiled arm (ARMS field 6 = ``prof``) boots the server with vLLM's torch profiler
(``--profiler-config.*``: delay_iterations / max_iterations, no stacks), resends an already
measured prompt (prefix cache: the prefill is short) between ``/start_profile`` and
``/stop_profile``, and calls this on the trace directory. Question it answers (2026-12-03, #8): a
DFlash2 k=7 step at 8k cost 22.6 ms vs 11.5 ms for a plain step, ~7 ms more than the kernel
timings predicted; is that time in kernels (which ones) or in gaps between them (host-bound)?

Prints, for the trace's GPU activity (kernels, memcpy, memset): the span from first start to last
end, the busy time (union of the intervals), busy %, and per step (``--steps``, the profiled
engine iterations) the span, busy and idle milliseconds; then the kernels by total time, one row per
(name, launch grid) (count per step, ms per step, share) and the same by bucket (attention / GDN / GEMM / mamba state / spec &
sampling / other; name patterns below). ``--json`` writes every figure. A trace is Chrome-trace
JSON (``*.json`` or ``*.json.gz``, torch.profiler's tensorboard handler); every file under the
directory is read and the busiest one (the worker's) is summarized.

Host side of the same trace (2026-12-04: a DFlash2 k=7 step was 18.4 ms with the GPU busy 14.1 ms,
so the host made the GPU wait; vLLM's own table, sorted by CUDA time and cut at 100 rows, drops
the CPU-only rows): per step, the time the host spent blocked in CUDA synchronizations
(``cudaEventSynchronize``, ``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, blocking
``cudaMemcpy``) by name, the launches (kernels, CUDA graphs), and the torch ops by calls per step
with their inclusive milliseconds (``cpu_op`` events; nested ops count in their parents too).

  python3 gpu/probe/trace_summary.py DIR --steps 24 [--top 25] [--json out.json]
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver")
SYNC_RE = re.compile(r"^(cuda|cu)(Event|Stream|Device|Ctx)Synchronize$|^cudaMemcpy$|^cuMemcpyDtoH")
LAUNCH_RE = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel(Ex)?|cudaGraphLaunch|cuGraphLaunch|"
                       r"cudaLaunchKernelExC)$")
# first match wins; lower-case kernel names
BUCKETS = (
    ("attention", r"wide_verify|unified_attention|flash|fmha|attn|paged|reshape_and_cache"),
    ("gdn", r"gated_delta|fused_recurrent|chunk_|fla_|causal_conv|conv1d|l2norm|gdn|solve_tril|"
            r"recompute_w_u|fused_gdn"),
    ("mamba state", r"mamba|precopy|postprocess"),
    ("gemm", r"marlin|gemm|gemv|gptq|cutlass|sm90_xmma|sm80_xmma|ampere|hopper|matmul|cublas|"
             r"wgmma|splitk|machete|awq|nvjet"),
    ("spec & sampling", r"rejection|eagle|dflash|topk|top_k|sort|argmax|sample|selector|"
                        r"radix|softmax_kernel|expand|lookup"),
)


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data.get("traceEvents", data) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict)]


def gpu_events(events: list[dict]) -> list[dict]:
    return [e for e in events
            if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "dur" in e and "ts" in e]


def bucket(name: str) -> str:
    low = name.lower()
    for label, pat in BUCKETS:
        if re.search(pat, low):
            return label
    return "other"


def busy_us(evs: list[dict]) -> float:
    """Union length of the [ts, ts + dur) intervals (concurrent streams count once)."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in evs)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def summarize(evs: list[dict], steps: int, top: int = 25) -> dict:
    if not evs:
        raise ValueError("no GPU activity in the trace (kernel / gpu_memcpy / gpu_memset events)")
    steps = max(1, int(steps))
    start = min(float(e["ts"]) for e in evs)
    end = max(float(e["ts"]) + float(e["dur"]) for e in evs)
    span, busy = end - start, busy_us(evs)
    by_name: dict[str, list[float]] = {}
    for e in evs:
        # the launch grid tells apart one kernel's uses (the target's verify attention has 4 KV
        # heads in grid axis 1, a DFlash2 drafter's 8): torch.profiler puts it in args["grid"]
        grid = (e.get("args") or {}).get("grid")
        key = str(e.get("name", "?")) + (f" grid={'x'.join(str(g) for g in grid)}"
                                         if isinstance(grid, list) and grid else "")
        rec = by_name.setdefault(key, [0.0, 0])
        rec[0] += float(e["dur"])
        rec[1] += 1
    total = sum(v[0] for v in by_name.values())
    kernels = [{"name": n, "bucket": bucket(n), "total_us": round(t, 1), "count": c,
                "per_step_count": round(c / steps, 2), "ms_per_step": round(t / steps / 1e3, 4),
                "share": round(t / total, 4) if total else 0.0}
               for n, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])]
    buckets: dict[str, float] = {}
    for k in kernels:
        buckets[k["bucket"]] = buckets.get(k["bucket"], 0.0) + k["total_us"]
    return {
        "steps": steps, "events": len(evs), "span_ms": round(span / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3), "busy_pct": round(100.0 * busy / span, 1) if span else 0.0,
        "per_step": {"span_ms": round(span / steps / 1e3, 3), "busy_ms": round(busy / steps / 1e3, 3),
                     "idle_ms": round((span - busy) / steps / 1e3, 3),
                     "kernel_sum_ms": round(total / steps / 1e3, 3)},
        "buckets": {b: {"ms_per_step": round(t / steps / 1e3, 3), "share": round(t / total, 4) if total else 0.0}
                    for b, t in sorted(buckets.items(), key=lambda kv: -kv[1])},
        "kernels": kernels[:top], "kernel_names": len(kernels),
    }


def host_summary(events: list[dict], steps: int, top: int = 25) -> dict:
    """Per step: host time blocked in CUDA synchronizations (by name), launches (by name), and
    the torch ops by calls (inclusive ms). Empty figures when the trace has no host events."""
    steps = max(1, int(steps))
    per: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in HOST_CATS or "dur" not in e:
            continue
        rec = per.setdefault((str(e["cat"]), str(e.get("name", "?"))), [0.0, 0])
        rec[0] += float(e["dur"])
        rec[1] += 1

    def rows(pred):
        out = [{"name": n, "calls_per_step": round(c / steps, 2), "ms_per_step": round(t / steps / 1e3, 4)}
               for (cat, n), (t, c) in per.items() if pred(cat, n)]
        return sorted(out, key=lambda r: (-r["ms_per_step"], r["name"]))

    syncs = rows(lambda cat, n: cat != "cpu_op" and SYNC_RE.search(n) is not None)
    launches = rows(lambda cat, n: cat != "cpu_op" and LAUNCH_RE.search(n) is not None)
    ops = sorted(rows(lambda cat, n: cat == "cpu_op"), key=lambda r: (-r["calls_per_step"], r["name"]))
    return {"sync_ms_per_step": round(sum(r["ms_per_step"] for r in syncs), 4), "syncs": syncs,
            "launches_per_step": round(sum(r["calls_per_step"] for r in launches), 2),
            "launches": launches, "ops": ops[:top], "op_names": len(ops)}


def pick_trace(root: Path) -> tuple[Path, list[dict]]:
    files = sorted(p for p in root.rglob("*") if p.is_file()
                   and (p.name.endswith(".json") or p.name.endswith(".json.gz")))
    if not files:
        raise FileNotFoundError(f"no trace under {root}; valid: a directory holding *.json or "
                                "*.json.gz Chrome traces (vLLM's torch_profiler_dir)")
    best = None
    for p in files:
        try:
            events = load_events(p)
        except (OSError, ValueError, EOFError):
            continue
        evs = gpu_events(events)
        if best is None or len(evs) > len(best[1]):
            best = (p, evs, events)
    if best is None or not best[1]:
        raise ValueError(f"no trace under {root} holds GPU activity (kernel events)")
    return best


def render_host(h: dict) -> str:
    if not h["syncs"] and not h["launches"] and not h["ops"]:
        return "host: no CPU events in the trace"
    lines = [f"host per step: blocked in CUDA syncs {h['sync_ms_per_step']:.3f} ms, "
             f"{h['launches_per_step']:g} launches",
             "| host sync | calls/step | ms/step |", "|---|---|---|"]
    lines += [f"| {r['name']} | {r['calls_per_step']:g} | {r['ms_per_step']:.3f} |" for r in h["syncs"]]
    lines += ["| launch | calls/step | ms/step |", "|---|---|---|"]
    lines += [f"| {r['name']} | {r['calls_per_step']:g} | {r['ms_per_step']:.3f} |" for r in h["launches"]]
    lines += ["| torch op (by calls) | calls/step | inclusive ms/step |", "|---|---|---|"]
    lines += [f"| {r['name'][:80]} | {r['calls_per_step']:g} | {r['ms_per_step']:.3f} |" for r in h["ops"]]
    return "\n".join(lines)


def render(path: Path, s: dict) -> str:
    ps = s["per_step"]
    lines = [f"trace {path.name}: {s['events']} GPU events over {s['span_ms']:.1f} ms, "
             f"{s['steps']} steps",
             f"per step: span {ps['span_ms']:.2f} ms, GPU busy {ps['busy_ms']:.2f} ms "
             f"({s['busy_pct']:.1f} %), idle {ps['idle_ms']:.2f} ms, kernel sum {ps['kernel_sum_ms']:.2f} ms",
             "| bucket | ms/step | share |", "|---|---|---|"]
    lines += [f"| {b} | {v['ms_per_step']:.3f} | {100 * v['share']:.1f} % |" for b, v in s["buckets"].items()]
    lines += ["| kernel | bucket | per step | ms/step | share |", "|---|---|---|---|---|"]
    lines += [f"| {k['name'][:110]} | {k['bucket']} | {k['per_step_count']:g} | {k['ms_per_step']:.3f} | "
              f"{100 * k['share']:.1f} % |" for k in s["kernels"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="vLLM's torch_profiler_dir (or a trace file's directory)")
    ap.add_argument("--steps", type=int, required=True, help="engine iterations the trace holds")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    try:
        path, evs, events = pick_trace(a.dir)
        s = summarize(evs, a.steps, a.top)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s["host"] = host_summary(events, a.steps, a.top)
    print(render(path, s))
    print(render_host(s["host"]))
    if a.json:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
        from jobutil import write_json

        write_json(a.json, {"trace": str(path), **s})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
