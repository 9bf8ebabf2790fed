"""Probe: what a missing FlashInfer costs a sampled request, per engine step (#8's "flashinfer
missing -> a loud warning with the measured cost").

vLLM 0.27.1 samples a step's plain / bonus tokens with ``TopKTopPSampler``: ``forward_cuda``
(FlashInfer's top-k/top-p kernels) when FlashInfer is usable, the request sets top-k or top-p
and carries no per-request seed; ``forward_native`` (``apply_top_k_top_p`` + softmax + the
exponential-race draw) otherwise. The rejection sampler's own top-k/top-p over the verify rows
(``apply_top_k_top_p``) never uses FlashInfer, and greedy requests use neither, so the cost of a
missing FlashInfer is ``forward_native - forward_cuda`` at rows = running sampled requests.

Times, at the 27B vocabulary (248,320) and Qwen3's sampling defaults (temperature folded in,
top_k 20, top_p 0.95), each row count in --rows: ``forward_native``; ``apply_top_k_top_p`` alone
(the rejection sampler's filter, for scale: rows = requests x (1 + k)); ``forward_cuda`` in a
child process with a time limit (FlashInfer may JIT-compile its sampling module with nvcc at the
first call: minutes on a bare machine), reported as not measured when it does not finish.
Median of ``triton.testing.do_bench`` (CUDA) or of a wall-clock loop (``--device cpu``, a plumbing
check only: tests/test_sampler_cost_probe.py). Prints one ``[sampler]`` line per figure and
writes --json atomically. No timed assertions.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
from jobutil import write_json  # noqa: E402  (gpu/lib/jobutil.py: atomic JSON)

VOCAB = 248_320
TOP_K, TOP_P = 20, 0.95


def say(msg: str) -> None:
    print(f"[sampler] {msg}", flush=True)


def _bench(fn, device: str) -> float:
    """Median milliseconds of fn()."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    fn()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def _inputs(rows: int, vocab: int, device: str):
    import torch

    g = torch.Generator(device=device).manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=g, device=device, dtype=torch.float32) * 3.0
    k = torch.full((rows,), TOP_K, dtype=torch.int64, device=device)
    p = torch.full((rows,), TOP_P, dtype=torch.float32, device=device)
    return logits, k, p


def time_native(rows: int, vocab: int, device: str) -> dict:
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler, apply_top_k_top_p

    sampler = TopKTopPSampler()
    logits, k, p = _inputs(rows, vocab, device)
    native = _bench(lambda: sampler.forward_native(logits.clone(), {}, k, p), device)
    clone = _bench(lambda: logits.clone(), device)
    filt = _bench(lambda: apply_top_k_top_p(logits.clone(), k, p), device)
    return {"rows": rows, "native_ms": round(native - clone, 4), "filter_ms": round(filt - clone, 4),
            "clone_ms": round(clone, 4)}


def _flashinfer_first_call(rows: int, vocab: int):
    """forward_cuda once (its first call may JIT-build FlashInfer's sampling module): the sampler,
    its inputs and the call's seconds."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    sampler = TopKTopPSampler()
    logits, k, p = _inputs(rows, vocab, "cuda")
    t = time.perf_counter()
    sampler.forward_cuda(logits.clone(), {}, k, p)
    torch.cuda.synchronize()
    return sampler, logits, k, p, time.perf_counter() - t


def time_flashinfer(rows: int, vocab: int) -> dict:
    """In this process (the child): forward_cuda, first call (JIT) timed apart."""
    sampler, logits, k, p, first = _flashinfer_first_call(rows, vocab)
    fi = _bench(lambda: sampler.forward_cuda(logits.clone(), {}, k, p), "cuda")
    clone = _bench(lambda: logits.clone(), "cuda")
    return {"rows": rows, "flashinfer_ms": round(fi - clone, 4), "first_call_s": round(first, 1)}


def prebuild() -> int:
    """Only FlashInfer's first call (its sampling module's JIT build), untimed beyond a line:
    gpu/run.sh runs this beside the FA2 pre-JIT so that job 74 later times warm kernels."""
    first = _flashinfer_first_call(1, 1024)[-1]
    say(f"FlashInfer sampling pre-build: first call {first:.1f} s")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,32", help="sampled rows per step (comma list)")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--flashinfer-timeout", type=float, default=240.0,
                    help="seconds for the FlashInfer child (its first call may JIT-compile)")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--deadline", type=float, default=None, help="seconds this run may take (gpu/lib/job.sh)")
    ap.add_argument("--flashinfer-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prebuild", action="store_true",
                    help="only make FlashInfer's first call (JIT build) and exit (gpu/run.sh)")
    a = ap.parse_args(argv)
    if a.prebuild:
        return prebuild()
    rows = [int(r) for r in a.rows.split(",") if r.strip()]
    if a.flashinfer_child:
        print(json.dumps([time_flashinfer(r, a.vocab) for r in rows]), flush=True)
        return 0
    t0 = time.monotonic()
    rec: dict = {"vocab": a.vocab, "top_k": TOP_K, "top_p": TOP_P, "device": a.device, "native": [],
                 "flashinfer": None, "flashinfer_note": ""}
    try:
        import torch

        if a.device == "cuda":
            rec["gpu"] = torch.cuda.get_device_name()
            # the GPU idles at 345 MHz: one untimed pass first, so the first row's figure is not
            # taken while the clocks ramp (2026-12-03: rows 1/4/8/32 read 0.33/0.73/0.46/0.57 ms)
            time_native(max(rows), a.vocab, a.device)
        for r in rows:
            rec["native"].append(time_native(r, a.vocab, a.device))
            n = rec["native"][-1]
            say(f"rows {r}: forward_native {n['native_ms']:.3f} ms (apply_top_k_top_p alone {n['filter_ms']:.3f} ms)")
        if a.device != "cuda":
            rec["flashinfer_note"] = "not measured: --device cpu"
        else:
            limit = a.flashinfer_timeout
            if a.deadline is not None:
                limit = min(limit, a.deadline - (time.monotonic() - t0) - 5)
            if limit < 10:
                rec["flashinfer_note"] = "not measured: no time left"
            else:
                try:
                    p = subprocess.run([sys.executable, __file__, "--flashinfer-child", "--rows", a.rows,
                                        "--vocab", str(a.vocab)], capture_output=True, text=True, timeout=limit)
                    if p.returncode == 0:
                        rec["flashinfer"] = json.loads(p.stdout.strip().splitlines()[-1])
                    else:
                        rec["flashinfer_note"] = "not measured: " + (p.stderr.strip().splitlines() or ["?"])[-1][:300]
                except subprocess.TimeoutExpired:
                    rec["flashinfer_note"] = f"not measured: the FlashInfer child ran past {limit:.0f} s (JIT?)"
        for f in rec["flashinfer"] or []:
            n = next(x for x in rec["native"] if x["rows"] == f["rows"])
            say(f"rows {f['rows']}: forward_cuda (FlashInfer) {f['flashinfer_ms']:.3f} ms (first call "
                f"{f['first_call_s']} s); a missing FlashInfer costs {n['native_ms'] - f['flashinfer_ms']:+.3f} ms "
                f"per step")
        if rec["flashinfer_note"]:
            say(f"FlashInfer {rec['flashinfer_note']}")
    finally:
        rec["wall_s"] = round(time.monotonic() - t0, 1)
        if a.json:
            write_json(a.json, rec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
