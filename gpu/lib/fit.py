"""GPU job 41: what one server of each CTX x SPEC profile really holds on the GPU, against 24 GiB.

onecard's memory model (onecard/memory.py ``vram_budget``, docs/profiles.md) predicts every
SPEC=dflash2 profile at 25.2-25.6 GiB with its reserves (CUDA graphs 0.75 + activations 1.25 + CUDA
context 0.5 GiB, all ESTIMATES) and 23.2-23.6 GiB without, with the drafter as stored (bf16); the
24 GiB plans therefore load its fc, o_proj and MLP in FP8 (DRAFT_QUANT=auto: 23.8-24.2 GiB with the
reserves). This driver measures the real footprint on the H200 with the 3090's plan.

Each case boots ``python3 -m onecard.launch`` (the real plan, preflight and argv) with
MODEL=<27B-geometry checkpoint, job 20>, CARD_GIB=24 (the plan is exactly a 3090's: its KV_MEM pin,
MAX_LEN caps, MAX_SEQS), CTX/SPEC of the case, DRAFT=<geometry drafter> for SPEC=dflash2, vLLM's
default CUDA graphs (no --enforce-eager: graphs are part of the footprint), GDN_PREFILL=triton, a
port of its own and GPU_UTIL=--gpu-util (0.10: with a KV_MEM pin vLLM only checks that this
fraction of the GPU is free at boot, so several servers boot side by side; onecard/profiles.py).

  long-dflash2  CTX=long SPEC=dflash2 (the headline: `CTX=long SPEC=dflash2 ./start_qwen.sh`; on a
                24 GiB card DRAFT_QUANT=auto gives the drafter FP8 fc/o_proj/MLP)
  long-dflash2-bf16  the same with DRAFT_QUANT=bf16 (the drafter as stored)
  fast-dflash2  CTX=fast SPEC=dflash2
  long-mtp      CTX=long SPEC=mtp
  long-off      CTX=long SPEC=off
  huge-dflash2  CTX=huge SPEC=dflash2 (KVarN: the job installs it into a private site first)
  huge-mtp      CTX=huge SPEC=mtp     (KVarN)

Footprint: vLLM's engine runs in a child process (EngineCore), so a thread polls
``nvidia-smi --query-compute-apps=pid,used_memory`` every --poll s and sums used_memory over every
process in the server's session (each server is started in a session of its own); the per-case
maximum is kept per phase: boot (until /health answers), prefill (one request of MAX_LEN x
--prompt-frac token ids, chunked by vLLM, + 64 greedy tokens), decode (MAX_SEQS requests of 128
ids + 64 greedy tokens at once: the largest decode batch). vLLM's own lines are read from the
server log (LOG_PATTERNS: the 0.27.1 strings, tests/test_fit_job.py checks them against vLLM's
source). A tiny process (PROBE_CODE: torch.zeros(1) on the GPU) gives the H200's bare CUDA context.

Per case: H200 peak MiB; the plan's predicted total and its "certain" part
(``python3 -m onecard.launch --json`` with the same environment: prediction.vram); the
difference; the reserves as measured (peak - the predicted non-reserve terms); a 3090 ESTIMATE =
peak - processes x (H200 context - --ctx-3090-mib, onecard.memory.CUDA_CONTEXT: itself an
estimate); and the same for the prepared 27B (int8 lm_head/embed/MTP, what users serve):
less the memory model's weight difference between this checkpoint and the prepared layout (the
same plan with no checkpoint: docs/profiles.md's). Verdict: that estimate against 24 GiB = 24,576
MiB, fits / does NOT fit, with the margin. A verdict is a figure, never a failure.

Exit 0 when every case booted and its workload ran (measured); 1 otherwise; 2 for bad cases.

    python3 gpu/lib/fit.py --out DIR [--cases "long-dflash2 long-off"] [--deadline S]
    python3 gpu/lib/fit.py --dry-run      # CPU: the plans, argv, workload, boot waves + self-check
    python3 gpu/lib/fit.py --self-check   # CPU: canned nvidia-smi output and vLLM log lines
    python3 gpu/lib/fit.py --check-cases  # FIT_CASES (or --cases) valid? one line, exit 0 / 2
Writes OUT/fit.json (atomic), OUT/fit-table.txt, OUT/fit-samples.csv, OUT/server-CASE.log and
OUT/server.pids (the job's leftover cleanup).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from jobutil import free_port, stop, write_json  # noqa: E402  (gpu/lib/jobutil.py)

MiB = 1 << 20
CARD_MIB = 24 * 1024                 # the 3090's 24 GiB
CASES = {
    "long-dflash2": {"CTX": "long", "SPEC": "dflash2"},
    # the headline with the drafter as stored: DRAFT_QUANT=auto picks fp8 on a 24 GiB card
    "long-dflash2-bf16": {"CTX": "long", "SPEC": "dflash2", "DRAFT_QUANT": "bf16"},
    "fast-dflash2": {"CTX": "fast", "SPEC": "dflash2"},
    "long-mtp": {"CTX": "long", "SPEC": "mtp"},
    "long-off": {"CTX": "long", "SPEC": "off"},
    "huge-dflash2": {"CTX": "huge", "SPEC": "dflash2"},
    "huge-mtp": {"CTX": "huge", "SPEC": "mtp"},
    # the headline with torch's expandable segments (less fragmentation; compatible with vLLM
    # without a KV connector): a candidate for the launcher's environment
    "long-dflash2-es": {"CTX": "long", "SPEC": "dflash2", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    # the headline with the target's embed_tokens in pinned host memory (patch 0013)
    "long-dflash2-eh": {"CTX": "long", "SPEC": "dflash2", "EMBED_HOST": "1"},
    # the headline on stock vLLM's GDN states (one per draft position): the plain cases run the
    # product's default GDN_DEFER=auto (1 with speculation on one GPU, patch 0085: the deferred GDN
    # commit, MAX_LEN 90,368 at the same pin plus a 32 MB verify scratch; 93,696 before the plans
    # capped where one sequence runs without preemption); this one pins GDN_DEFER=0 (MAX_LEN 67,840,
    # no scratch; 70,912 before), the footprint before the default flipped
    "long-dflash2-gd0": {"CTX": "long", "SPEC": "dflash2", "GDN_DEFER": "0"},
    # the headline with the drafter's K/V in rings beside the pool (DFLASH_RING=1, the CTX=huge
    # default): the pool is the target's alone, so MAX_LEN 131,072 at the same pin (+0.15 GiB rings)
    "long-dflash2-ring": {"CTX": "long", "SPEC": "dflash2", "DFLASH_RING": "1"},
}
DEFAULT_CASES = ("long-dflash2", "fast-dflash2", "long-mtp", "long-off")
SERVED = "geom"
OUT_TOKENS = 64                      # generated per request
BATCH_PROMPT = 128                   # prompt ids of each decode-batch request
PHASES = ("boot", "prefill", "decode")
PRODUCT_KEYS = ("KV_MEM", "MAX_LEN", "MAX_SEQS", "KV", "SPEC_K", "DRAFT_QUANT")   # what sizes the server beside its weights
KEEP_FREE_MIB = 256                  # what the suggested KV pin leaves free on a 24 GiB card
GPU_SLACK_MIB = 4096                 # kept free of the scheduler's reservations
H200_EXTRA_MIB = 2048                # reserved per server beyond its predicted total (H200 context etc.)
MIN_START_S = 150                    # a case starts only with this much of the deadline left
BOOT_KEEP_S = 45                     # a boot gives up when less than this is left (for the workload)
STOP_KEEP_S = 40                     # requests end this long before the deadline (stopping a server: <= 25 s)

RE_ERRLINE = re.compile(r"(\w*(Error|Exception)\b.*:|CUDA out of memory)")

# vLLM 0.27.1's own lines (v1/worker/gpu_worker.py, v1/worker/gpu_model_runner.py,
# v1/worker/gpu/model_runner.py, v1/core/kv_cache_utils.py, utils/mem_utils.py) and patch 0080's.
# With the KV_MEM pin vLLM skips its memory profiling: "Initial free memory ... reserved" is
# logged, "Available KV cache memory", the profiling summary (debug level) and the "Free memory on
# device ... Actual usage" line are not (parsed when present).
LOG_PATTERNS = {
    "model_loading": re.compile(r"Model loading took ([\d.]+) GiB(?: memory)? and ([\d.]+) seconds"),
    "kv_reserved": re.compile(r"Initial free memory (-?[\d.]+) GiB, reserved ([\d.]+) GiB memory for KV Cache "
                              r"as specified by kv_cache_memory_bytes"),
    "available_kv": re.compile(r"Available KV cache memory: (-?[\d.]+) GiB"),
    "kv_tokens": re.compile(r"GPU KV cache size: ([\d,]+) tokens"),
    "max_concurrency": re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x"),
    "graph_capture": re.compile(r"Graph capturing finished in (\d+) secs, took (-?[\d.]+) GiB"),
    "graph_estimate": re.compile(r"Estimated CUDA graph memory: ([\d.]+) GiB total"),
    "graph_pool": re.compile(r"CUDA graph pool memory: (-?[\d.]+) GiB \(actual\), ([\d.]+) GiB \(estimated\)"),
    "profiling": re.compile(r"Memory profiling takes ([\d.]+) seconds\. Total non KV cache memory: (-?[\d.]+)GiB; "
                            r"torch peak memory increase: (-?[\d.]+)GiB; total consumed \(from mem_get_info\): "
                            r"(-?[\d.]+)GiB; weights memory: (-?[\d.]+)GiB"),
    "usage": re.compile(r"Actual usage is (-?[\d.]+) GiB for consumed memory \(weights \+ non-torch\), "
                        r"(-?[\d.]+) GiB for peak activation, and (-?[\d.]+) GiB for CUDAGraph memory"),
    "dflash2_ring": re.compile(r"DFlash2 ring mode: (\d+) ring tensors .*?, ([\d.]+) MiB beside the KV pool"),
    "dflash2_lane": re.compile(r"DFlash2 lookup lane on the device: ([\d.]+) MiB of token history"),
}
# where each pattern's text is in vLLM 0.27.1 (relative to the vllm package) or a patch: fragments
# that must appear there verbatim (tests/test_fit_job.py)
LOG_SOURCES = {
    "model_loading": ("v1/worker/gpu_model_runner.py", ["Model loading took %s GiB memory and %.6f seconds"]),
    "kv_reserved": ("v1/worker/gpu_worker.py", ['f"Initial free memory {format_gib(self.init_snapshot.free_memory)} "',
                                                'f"GiB, reserved {format_gib(kv_cache_memory_bytes)} GiB memory for "',
                                                '"KV Cache as specified by kv_cache_memory_bytes config and "']),
    "available_kv": ("v1/worker/gpu_worker.py", ['"Available KV cache memory: %s GiB"']),
    "kv_tokens": ("v1/core/kv_cache_utils.py", ['"GPU KV cache size: %s tokens"']),
    "max_concurrency": ("v1/core/kv_cache_utils.py", ['"Maximum concurrency for %s tokens per request: %.2fx"']),
    "graph_capture": ("v1/worker/gpu_model_runner.py", ['"Graph capturing finished in %.0f secs, took %.2f GiB"']),
    "graph_estimate": ("v1/worker/gpu_model_runner.py", ['"Estimated CUDA graph memory: %.2f GiB total"']),
    "graph_pool": ("v1/worker/gpu_worker.py", ['"CUDA graph pool memory: %s GiB (actual), %s GiB (estimated), "']),
    "profiling": ("utils/mem_utils.py", ['f"Memory profiling takes {self.profile_time:.2f} seconds. "',
                                         'f"Total non KV cache memory: "', 'f"torch peak memory increase: "',
                                         'f"total consumed (from mem_get_info): "',
                                         'f"weights memory: {format_gib(self.weights_memory)}GiB."']),
    "usage": ("v1/worker/gpu_worker.py", ['f"Actual usage is {format_gib(self.total_consumed)} "',
                                          'f"GiB for consumed memory (weights + non-torch), "',
                                          'f"GiB for CUDAGraph memory. Replace gpu_memory_utilization "']),
    "dflash2_ring": ("patch:0080-dflash2.patch", ['"DFlash2 ring mode: %d ring tensors %s, %.1f MiB beside the KV pool"']),
    "dflash2_lane": ("patch:0080-dflash2.patch", ['"DFlash2 lookup lane on the device: %.2f MiB of token history"']),
}

# The bare CUDA context of this GPU: a process that only touches the GPU, measured by nvidia-smi
# (its own pid's used_memory), then again after a bf16 matmul (cuBLAS handle and workspace).
PROBE_CODE = r"""
import json, os, subprocess, sys, time
import torch
smi = sys.argv[1] if len(sys.argv) > 1 else "nvidia-smi"
def used():
    time.sleep(1.0)
    out = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=20).stdout
    for line in out.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) >= 2 and f[0] == str(os.getpid()):
            try:
                return int(float(f[1]))
            except ValueError:
                return None
    return None
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
ctx = used()
a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
(a @ a).float().sum().item()
blas = used()
p = torch.cuda.get_device_properties(0)
print(json.dumps({"pid": os.getpid(), "context_mib": ctx, "context_cublas_mib": blas, "device": p.name,
                  "total_mib": p.total_memory // 2**20, "torch": torch.__version__,
                  "torch_reserved_mib": torch.cuda.memory_reserved() / 2**20}))
"""

# `python3 -m onecard.launch --json` with every optional feature 'installed' (the CPU dry run and
# tests: the pristine CPU vLLM lacks patch 0080's and KVarN's markers;
# onecard.profiles.pretend_installed). Nothing outside the process changes.
PRETEND_LAUNCH = r"""
import sys, tempfile
from onecard.profiles import pretend_installed
from onecard.launch import main
with tempfile.TemporaryDirectory(prefix="fit-pretend-") as d, pretend_installed(d):
    rc = main(sys.argv[1:])
sys.exit(rc)
"""

H200_NOTES = (
    "Measured on an NVIDIA H200, not on a 3090. What differs: the CUDA context and the modules "
    "loaded into it (sm_90 vs sm_86 kernels, FA2's PTX JIT on sm_90), cuBLAS/cuBLASLt workspaces, "
    "and the torch caching allocator, which never runs short on a 140 GiB GPU (on a 24 GiB card it "
    "frees cached blocks and retries before an out-of-memory error): the H200 peak is an upper bound "
    "of the allocator's reservations. The 3090 column is an ESTIMATE: the H200 peak with each GPU "
    "process's H200 context swapped for a 3090 context estimate.",
    "vLLM's 'Graph capturing finished ... took X GiB' is a device-wide free-memory difference: with "
    "servers booting side by side it also counts the others' allocations (marked 'shared' above); "
    "the per-process peak is what this job judges.",
)


class CaseError(ValueError):
    """A bad FIT_CASES (one line naming what is valid)."""


def say(msg: str) -> None:
    print(f"[fit] {msg}", flush=True)


# ----------------------------------------------------------------------------- pure parts

CAP_SUFFIX = "-cap"   # "<case>-cap": that case with its torch caching allocator capped (FIT_TORCH_CAP, else auto)


def case_base(name: str) -> str:
    """The CASES entry of a case name ("long-dflash2-cap" -> "long-dflash2")."""
    return name[:-len(CAP_SUFFIX)] if name.endswith(CAP_SUFFIX) and name[:-len(CAP_SUFFIX)] in CASES else name


def parse_cases(text: str | None) -> list[str]:
    """FIT_CASES (space- or comma-separated case names; None: the default) -> the cases, in order,
    each once. A case name may end in -cap (the same server with its torch allocator capped, so
    a capped and an uncapped server of one profile run side by side). A bad name or an empty
    list: CaseError, one line naming every valid case."""
    words = (" ".join(DEFAULT_CASES) if text is None else text).replace(",", " ").split()
    valid = (f"valid: {' '.join(CASES)}, each also with {CAP_SUFFIX} (space- or comma-separated; default: "
             f"{' '.join(DEFAULT_CASES)})")
    if not words:
        raise CaseError(f"FIT_CASES is empty; {valid}")
    bad = [w for w in words if case_base(w) not in CASES]
    if bad:
        what = "is not a case" if len(bad) == 1 else "are not cases"
        raise CaseError(f"FIT_CASES: {', '.join(repr(b) for b in bad)} {what}; {valid}")
    return list(dict.fromkeys(words))


def needs_kvarn(cases: list[str]) -> bool:
    return any(CASES[case_base(c)]["CTX"] == "huge" for c in cases)


def parse_compute_apps(text: str) -> list[tuple[int, int | None]]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`` ->
    [(pid, MiB or None when nvidia-smi says [N/A])]; lines that are not "pid, value" are skipped."""
    rows = []
    for line in text.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) < 2 or not f[0].isdigit():
            continue
        try:
            mib = int(float(f[1]))
        except ValueError:
            mib = None
        rows.append((int(f[0]), mib))
    return rows


def proc_session(pid: int, proc_root: str = "/proc") -> int | None:
    """The session id of pid (/proc/PID/stat, the 6th field; the command name in parentheses may
    hold spaces), None when the process is gone."""
    try:
        text = Path(proc_root, str(pid), "stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    try:
        return int(fields[3])     # state ppid pgrp session ...
    except (IndexError, ValueError):
        return None


def sum_by_session(rows: list[tuple[int, int | None]], sessions, sid_of) -> dict[int, dict]:
    """Sum nvidia-smi's per-process MiB per session: {sid: {"mib", "pids", "na"}} for every sid in
    ``sessions`` (0 MiB, no pids when none of its processes holds GPU memory). ``sid_of(pid)``:
    the process's session (None: gone or unknown); "na": processes of the session whose
    used_memory nvidia-smi did not give."""
    out = {sid: {"mib": 0, "pids": [], "na": 0} for sid in sessions}
    for pid, mib in rows:
        sid = sid_of(pid)
        if sid not in out:
            continue
        out[sid]["pids"].append(pid)
        if mib is None:
            out[sid]["na"] += 1
        else:
            out[sid]["mib"] += mib
    return out


def parse_vllm_log(text: str) -> dict:
    """vLLM's memory lines in a server log (LOG_PATTERNS) as numbers; keys only for lines found.
    graph_capture_gib: every "Graph capturing finished" (one per capturing process)."""
    r: dict = {}

    def first(key):
        return LOG_PATTERNS[key].search(text)
    if m := first("model_loading"):
        r["model_loading_gib"], r["model_loading_s"] = float(m.group(1)), float(m.group(2))
    if m := first("kv_reserved"):
        r["initial_free_gib"], r["kv_reserved_gib"] = float(m.group(1)), float(m.group(2))
    if m := first("available_kv"):
        r["available_kv_gib"] = float(m.group(1))
    if m := first("kv_tokens"):
        r["kv_tokens"] = int(m.group(1).replace(",", ""))
    if m := first("max_concurrency"):
        r["max_concurrency"] = float(m.group(2))
    caps = LOG_PATTERNS["graph_capture"].findall(text)
    if caps:
        r["graph_capture_s"] = [int(s) for s, _ in caps]
        r["graph_capture_gib"] = [float(g) for _, g in caps]
    if m := first("graph_estimate"):
        r["graph_estimate_gib"] = float(m.group(1))
    if m := first("graph_pool"):
        r["graph_pool_gib"], r["graph_pool_estimated_gib"] = float(m.group(1)), float(m.group(2))
    if m := first("profiling"):
        r["profiling"] = dict(zip(("seconds", "non_kv_gib", "torch_peak_increase_gib", "total_consumed_gib",
                                   "weights_gib"), map(float, m.groups())))
    if m := first("usage"):
        r["usage"] = dict(zip(("consumed_gib", "peak_activation_gib", "cudagraph_gib"), map(float, m.groups())))
    if m := first("dflash2_ring"):
        r["dflash2_ring_mib"] = float(m.group(2))
    if m := first("dflash2_lane"):
        r["dflash2_lane_mib"] = float(m.group(1))
    if re.search(r"CUDA out of memory|OutOfMemoryError", text):
        r["oom"] = True
    return r


def verdict(mib: float | None, card_mib: int = CARD_MIB) -> tuple[bool | None, float | None, str]:
    """(fits, margin MiB (card - mib; < 0 over), words) of a footprint against the card."""
    if mib is None:
        return None, None, "-"
    margin = card_mib - mib
    if margin >= 0:
        return True, margin, f"fits, {margin:,.0f} MiB spare"
    return False, margin, f"does NOT fit, {-margin:,.0f} MiB over"


def layout_excess_mib(rec: dict) -> float | None:
    """This checkpoint's predicted total over the prepared 27B layout's, MiB (the geometry
    checkpoint's bf16 embed / lm_head); None when either plan has no total."""
    plan = rec.get("plan") or {}
    total, prepared = (plan.get("vram") or {}).get("total"), (plan.get("prepared_vram") or {}).get("total")
    return None if total is None or prepared is None else (total - prepared) / MiB


def derive(rec: dict, ctx_h200_mib: float | None, ctx_3090_mib: float, card_mib: int = CARD_MIB) -> dict:
    """A case's figures from its measurement (rec["peak_mib"], rec["procs"]) and plans
    (rec["plan"]["vram"], rec["plan"]["prepared_vram"]: onecard.preflight's budgets, bytes):
    predicted / certain / reserves (MiB), measured - predicted, the reserves as measured, the
    3090 estimates (this checkpoint, and the prepared 27B layout) and the verdict on the latter."""
    mib = lambda b: None if b is None else b / MiB  # noqa: E731
    plan = rec.get("plan") or {}
    vram, prep = plan.get("vram") or {}, plan.get("prepared_vram") or {}
    peak, procs = rec.get("peak_mib"), rec.get("procs") or 0
    d: dict = {"predicted_mib": mib(vram.get("total")), "certain_mib": mib(vram.get("certain")),
               "reserves_est_mib": mib(vram.get("reserves")), "prepared_predicted_mib": mib(prep.get("total")),
               "prepared_certain_mib": mib(prep.get("certain")), "ctx_h200_mib": ctx_h200_mib,
               "ctx_3090_mib": ctx_3090_mib, "procs": procs}
    if not peak:
        d.update(diff_mib=None, reserves_measured_mib=None, est_3090_mib=None, layout_diff_mib=None,
                 est_prepared_mib=None)
    else:
        pred = d["predicted_mib"]
        d["diff_mib"] = None if pred is None else peak - pred
        d["reserves_measured_mib"] = (None if pred is None or d["reserves_est_mib"] is None
                                      else peak - (pred - d["reserves_est_mib"]))
        d["est_3090_mib"] = None if ctx_h200_mib is None else peak - procs * (ctx_h200_mib - ctx_3090_mib)
        d["layout_diff_mib"] = layout_excess_mib(rec)
        d["est_prepared_mib"] = (None if d["est_3090_mib"] is None or d["layout_diff_mib"] is None
                                 else d["est_3090_mib"] - d["layout_diff_mib"])
    # the KV pin that would leave KEEP_FREE_MIB of a 24 GiB card free by the prepared-27B estimate
    # (a pin scales the KV pool alone: the rest of the footprint does not move with it)
    pin = (plan.get("values") or {}).get("KV_MEM")
    d["kv_pin_mib"] = pin / MiB if isinstance(pin, int) else None
    d["kv_pin_fit_mib"] = (None if d["kv_pin_mib"] is None or d.get("est_prepared_mib") is None
                           else d["kv_pin_mib"] + (card_mib - KEEP_FREE_MIB - d["est_prepared_mib"]))
    for key, src in (("verdict_3090", "est_3090_mib"), ("verdict", "est_prepared_mib")):
        fits, margin, words = verdict(d[src], card_mib)
        d[key] = {"fits": fits, "margin_mib": margin, "text": words}
    fits, margin, words = verdict(d["predicted_mib"], card_mib)
    d["verdict_predicted"] = {"fits": fits, "margin_mib": margin, "text": words}
    return d


def _n(x, signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+,.0f}" if signed else f"{x:,.0f}"


def render_table(recs: list[dict], top: dict) -> str:
    """The job's table (fit-table.txt): one row per case, then the phases, vLLM's lines and notes."""
    probe = top.get("context") or {}
    head = (f"{'case':<17} {'MAX_LEN':>8} {'seqs':>4} | {'H200 peak MiB (procs)':>21} | {'predicted (certain)':>19} | "
            f"{'meas-pred':>9} | {'reserves meas/est':>17} | {'3090 est.':>9} | {'prepared 27B est.':>17} | "
            f"24 GiB = {CARD_MIB:,} MiB (prepared 27B est.)")
    lines = [f"41-fit: GPU memory of one server per profile, {top.get('model_note', '27B geometry')}, "
             f"3090 plan (CARD_GIB=24: KV_MEM pin, MAX_LEN caps, MAX_SEQS), CUDA graphs on, "
             f"measured on {probe.get('device') or 'the GPU'} (nvidia-smi per process, summed per server session)",
             head, "-" * len(head)]
    for r in recs:
        d = r.get("derived") or {}
        v = (r.get("plan") or {}).get("values") or {}
        peak = f"{_n(r.get('peak_mib'))} ({r.get('procs') or 0})" if r.get("peak_mib") else "-"
        pred = f"{_n(d.get('predicted_mib'))} ({_n(d.get('certain_mib'))})"
        res = f"{_n(d.get('reserves_measured_mib'))}/{_n(d.get('reserves_est_mib'))}"
        row = (f"{r['name']:<17} {_n(v.get('MAX_LEN')):>8} {str(v.get('MAX_SEQS', '-')):>4} | {peak:>21} | {pred:>19} | "
               f"{_n(d.get('diff_mib'), True):>9} | {res:>17} | {_n(d.get('est_3090_mib')):>9} | "
               f"{_n(d.get('est_prepared_mib')):>17} | ")
        if not r.get("measured"):
            row += f"NOT MEASURED: {(r.get('error') or 'no figure')[:200]}"
        else:
            row += (d.get("verdict") or {}).get("text", "-")
        lines.append(row)
    lines.append("")
    lines.append("Per phase, H200 peak MiB (processes): boot = launch until /health; prefill = one request of "
                 "MAX_LEN x prompt-frac ids + 64 tokens; decode = MAX_SEQS requests of 128 ids + 64 tokens at once.")
    for r in recs:
        ph = r.get("phases") or {}
        w = r.get("workload") or {}
        parts = [f"{p} {_n((ph.get(p) or {}).get('peak_mib'))} ({(ph.get(p) or {}).get('procs', 0)})" for p in PHASES]
        lines.append(f"  {r['name']:<17} " + ", ".join(parts)
                     + (f"; boot {r['boot_s']:.0f} s" if r.get("boot_s") is not None else "")
                     + (f"; prefill {w['prefill_tokens']:,} ids in {w['prefill_s']:.1f} s"
                        if w.get("prefill_s") is not None else "")
                     + (f"; decode {w['batch']} x {OUT_TOKENS} tokens in {w['batch_s']:.1f} s"
                        if w.get("batch_s") is not None else "")
                     + (f"; vLLM preemptions {w['preemptions']:g}" if w.get("preemptions") is not None else ""))
    lines.append("vLLM's own lines (server logs):")
    for r in recs:
        lg = r.get("vllm_log") or {}
        bits = []
        if "model_loading_gib" in lg:
            bits.append(f"Model loading took {lg['model_loading_gib']} GiB")
        if "kv_reserved_gib" in lg:
            bits.append(f"KV reserved {lg['kv_reserved_gib']} GiB (initial free {lg['initial_free_gib']} GiB)")
        if "available_kv_gib" in lg:
            bits.append(f"Available KV cache memory {lg['available_kv_gib']} GiB")
        if "kv_tokens" in lg:
            bits.append(f"GPU KV cache size {lg['kv_tokens']:,} tokens")
        if "graph_capture_gib" in lg:
            shared = " shared" if r.get("boot_neighbours") else ""
            bits.append("graphs took " + "/".join(f"{g}" for g in lg["graph_capture_gib"]) + f" GiB{shared}")
        if "dflash2_ring_mib" in lg:
            bits.append(f"DFlash2 rings {lg['dflash2_ring_mib']} MiB")
        if "dflash2_lane_mib" in lg:
            bits.append(f"lookup lane {lg['dflash2_lane_mib']} MiB")
        if "usage" in lg:
            u = lg["usage"]
            bits.append(f"consumed {u['consumed_gib']} / activation {u['peak_activation_gib']} / "
                        f"graphs {u['cudagraph_gib']} GiB")
        if lg.get("oom"):
            bits.append("CUDA OUT OF MEMORY in the log")
        lines.append(f"  {r['name']:<17} " + ("; ".join(bits) or "-"))
    lines.append(f"KV_MEM that would leave {KEEP_FREE_MIB} MiB of 24 GiB free, by the prepared-27B estimate (the pin "
                 "moves the KV pool alone; an ESTIMATE until a 24 GB card runs it):")
    for r in recs:
        d = r.get("derived") or {}
        if r.get("measured") and d.get("kv_pin_fit_mib") is not None:
            lines.append(f"  {r['name']:<17} KV_MEM {d['kv_pin_mib']:,.0f} MiB -> {d['kv_pin_fit_mib']:,.0f} MiB "
                         f"({d['kv_pin_fit_mib'] - d['kv_pin_mib']:+,.0f}): KV_MEM={int(d['kv_pin_fit_mib']) // 64 * 64}M")
        else:
            lines.append(f"  {r['name']:<17} -")
    lines.append("torch's caching allocator (the engine process, onecard_torch_mem; cap = FIT_TORCH_CAP or a -cap "
                 "case's auto cap: what a 24 GiB card leaves torch for the prepared 27B layout): peak allocated / peak "
                 "reserved MiB, retries (cache flushes the cap forced), OOMs; beside torch = H200 peak - peak reserved "
                 "(context, kernel modules, handles). A capped case that ran its workload fits a 24 GiB card if the "
                 "3090's context and modules fit the share left beside the cap; the spare under the cap is about how "
                 "much more KV_MEM it would have held:")
    for r in recs:
        t = r.get("torch") or {}
        if not t:
            lines.append(f"  {r['name']:<17} -")
            continue
        beside = r.get("peak_mib") - t["reserved_peak_mib"] if r.get("peak_mib") and r.get("procs") == 1 else None
        cap = r.get("torch_cap_mib")
        spare = (f"; {cap - t['reserved_peak_mib']:,.0f} MiB spare under the cap" if cap and r.get("measured")
                 and t.get("reserved_peak_mib") is not None else "")
        lines.append(f"  {r['name']:<17} cap {_n(cap)}; allocated {_n(t.get('allocated_peak_mib'))} / "
                     f"reserved {_n(t.get('reserved_peak_mib'))} MiB; retries {t.get('alloc_retries')}, OOMs "
                     f"{t.get('ooms')}; beside torch {_n(beside)} MiB ({t.get('processes')} process(es) wrote stats)"
                     + spare)
    ctx = probe.get("context_mib")
    lines.append(f"H200 bare CUDA context (torch.zeros(1) process, nvidia-smi): {_n(ctx)} MiB; after a bf16 matmul "
                 f"(cuBLAS): {_n(probe.get('context_cublas_mib'))} MiB. 3090 context: {_n(top.get('ctx_3090_mib'))} MiB "
                 f"per process, an ESTIMATE ({top.get('ctx_3090_source', '')}; never measured on a 3090).")
    lines.append("3090 est. = H200 peak - procs x (H200 context - 3090 context estimate): an ESTIMATE. prepared 27B est. = "
                 "3090 est. - (predicted for this checkpoint - predicted for the prepared 27B layout, int8 lm_head/embed/MTP: "
                 "docs/profiles.md's plan); reserves meas = H200 peak - the predicted terms other than the reserves "
                 "(weights, drafter, KVarN stage, rings, lane, KV pin), against the estimated reserves.")
    lines.extend(H200_NOTES)
    for n in top.get("notes", []):
        lines.append(n)
    return "\n".join(lines)


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    """n ordinary token ids (1000 .. min(vocab, 150000)), seeded: no special ids, no prefix hits."""
    rng = random.Random(seed)
    hi = max(1001, min(int(vocab), 150_000) - 1)
    return [rng.randrange(1000, hi) for _ in range(n)]


def workload_sizes(max_len: int, max_seqs: int, frac: float) -> dict:
    """The long request's prompt (MAX_LEN x frac, leaving room for the generated tokens) and the batch."""
    prefill = max(1, min(int(max_len * frac), max_len - OUT_TOKENS - 16))
    return {"prefill_tokens": prefill, "batch": max(1, int(max_seqs))}


def boot_waves(reserve_mib: list[tuple[str, float]], budget_mib: float) -> list[list[str]]:
    """Which cases boot together when each starts as soon as the reservations of those running fit
    the budget (in order; a wave ends when the next does not fit; a case alone always starts)."""
    waves, cur, used = [], [], 0.0
    for name, need in reserve_mib:
        if cur and used + need > budget_mib:
            waves.append(cur)
            cur, used = [], 0.0
        cur.append(name)
        used += need
    if cur:
        waves.append(cur)
    return waves


# ----------------------------------------------------------------------------- the sampler

class Sampler(threading.Thread):
    """Polls ``query()`` (nvidia-smi's per-process memory) every ``poll_s`` and keeps, per watched
    server (label -> session id), the largest sum over its session's processes, overall and per
    phase. ``sid_of``: pid -> session (cached per pid: /proc/PID/stat)."""

    def __init__(self, poll_s: float, query, sid_of=proc_session, samples_path: Path | None = None):
        super().__init__(daemon=True)
        self.poll_s, self.query = poll_s, query
        self._sid_of, self._sid_cache = sid_of, {}
        self.lock = threading.Lock()
        self.groups: dict[str, int] = {}        # label -> sid
        self.phase: dict[str, str] = {}
        self.stats: dict[str, dict] = {}
        self.ticks, self.errors, self.last_error = 0, 0, ""
        self._halt = threading.Event()
        self._t0 = time.monotonic()
        self._csv = open(samples_path, "w") if samples_path else None
        if self._csv:
            self._csv.write("t_s,case,phase,mib,procs\n")

    def sid_of(self, pid: int):
        if pid not in self._sid_cache:
            sid = self._sid_of(pid)
            if sid is None:
                return None
            self._sid_cache[pid] = sid
        return self._sid_cache[pid]

    def watch(self, label: str, sid: int, phase: str = "boot") -> None:
        with self.lock:
            self.groups[label], self.phase[label] = sid, phase
            self.stats.setdefault(label, {"peak_mib": 0, "procs": 0, "pids": [], "samples": 0, "na": 0,
                                          "neighbours": 0, "phases": {}})

    def set_phase(self, label: str, phase: str) -> None:
        with self.lock:
            self.phase[label] = phase

    def forget(self, label: str) -> None:
        with self.lock:
            self.groups.pop(label, None)

    def tick(self) -> None:
        try:
            text = self.query()
        except Exception as e:  # noqa: BLE001 - counted and reported, never fatal
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"[:300]
            return
        rows = parse_compute_apps(text)
        t = time.monotonic() - self._t0
        with self.lock:
            by_sid = sum_by_session(rows, set(self.groups.values()), self.sid_of)
            self.ticks += 1
            for label, sid in self.groups.items():
                s, g, phase = self.stats[label], by_sid[sid], self.phase[label]
                s["samples"] += 1
                s["na"] = max(s["na"], g["na"])
                if phase == "boot":
                    s["neighbours"] = max(s["neighbours"], len(self.groups) - 1)
                p = s["phases"].setdefault(phase, {"peak_mib": 0, "procs": 0})
                if g["mib"] > p["peak_mib"]:
                    p["peak_mib"], p["procs"] = g["mib"], len(g["pids"])
                if g["mib"] > s["peak_mib"]:
                    s["peak_mib"], s["procs"], s["pids"], s["peak_phase"] = g["mib"], len(g["pids"]), sorted(g["pids"]), phase
                if self._csv:
                    self._csv.write(f"{t:.1f},{label},{phase},{g['mib']},{len(g['pids'])}\n")

    def run(self) -> None:
        while not self._halt.is_set():
            t0 = time.monotonic()
            self.tick()
            self._halt.wait(max(0.0, self.poll_s - (time.monotonic() - t0)))

    def halt(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=30)
        if self._csv:
            self._csv.close()
            self._csv = None


def smi_query(smi: str = "nvidia-smi"):
    def query() -> str:
        return subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20, check=True).stdout
    return query


def gpu_memory(smi: str = "nvidia-smi") -> dict:
    """name, total / used / free MiB of the first GPU (nvidia-smi), {} when it cannot say."""
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total,memory.used,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout.splitlines()[0]
        name, total, used, free = [x.strip() for x in out.split(",")[:4]]
        return {"name": name, "total_mib": int(float(total)), "used_mib": int(float(used)), "free_mib": int(float(free))}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {}


# ----------------------------------------------------------------------------- plans

# The GEMM kernels: vLLM 0.27.1 picks Machete (CUTLASS, sm_90 only) for W4A16 on the H200 and Marlin
# on a 3090 (sm_86): model_executor/kernels/linear/mixed_precision/machete.py can_implement; for the
# FP8 drafter (DRAFT_QUANT=fp8, which the 24 GiB plans pick) a block-scaled W8A8 kernel here, Marlin's
# W8A16 there. Their weights take the same bytes, their workspaces and scales do not; "marlin" runs
# the 3090's kernels here (onecard.profiles.AMPERE_GEMM_ENV).
GEMM_CHOICES = ("marlin", "vllm")
GEMM_NOTES = {
    "marlin": "W4A16 and FP8 GEMMs on Marlin, the kernels vLLM picks on a 3090 (onecard.profiles.AMPERE_GEMM_ENV; "
              "on the H200 vLLM would pick Machete and a W8A8 FP8 kernel; FIT_GEMM=vllm keeps those)",
    "vllm": "GEMMs on vLLM's choice for the H200 (Machete; W8A8 FP8); a 3090 runs Marlin (FIT_GEMM=marlin)",
}


def gemm_env(gemm: str) -> dict:
    from onecard.profiles import AMPERE_GEMM_ENV

    if gemm not in GEMM_CHOICES:
        raise CaseError(f"FIT_GEMM={gemm!r} is not valid; valid: {' | '.join(GEMM_CHOICES)}")
    return dict(AMPERE_GEMM_ENV) if gemm == "marlin" else {}


def case_env(name: str, model: str, draft: str, port: int, gpu_util: str) -> dict:
    """The launcher knobs of one case (everything else: the profile's defaults)."""
    c = CASES[case_base(name)]
    # VRAM_CHECK=0: the geometry checkpoint's bf16 embed / lm_head (+2.4 GiB over the prepared 27B)
    # put a dflash2 plan's certain part over 24 GiB, and the preflight would lower the profile's pin
    # (or refuse): not the plan a user's prepared checkpoint gets. With it the profile's pin stays;
    # plan_case checks that pin, MAX_LEN and MAX_SEQS equal the prepared layout's plan.
    env = {"MODEL": str(model), "CTX": c["CTX"], "SPEC": c["SPEC"], "CARD_GIB": "24", "VRAM_CHECK": "0",
           "GDN_PREFILL": "triton",
           "GPU_UTIL": str(gpu_util), "PORT": str(port), "HOST": "127.0.0.1", "SERVED_NAME": SERVED, "WARMUP": "0",
           "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    if c["SPEC"] == "dflash2":
        env["DRAFT"] = str(draft)
    env.update({k: v for k, v in c.items() if k not in ("CTX", "SPEC")})  # a case's own knobs
    return env


def base_environ(environ=None) -> dict:
    """The caller's environment without any launcher knob (a job runner's GPU_UTIL, a stray
    MAX_LEN or KV_MEM must not change the plan), this repo first on PYTHONPATH."""
    from onecard.profiles import KNOBS

    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in KNOBS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def launcher_json(env: dict, pretend: bool = False) -> dict:
    """``python3 -m onecard.launch --json`` under env; a refused plan raises RuntimeError (its line)."""
    cmd = [sys.executable, "-c", PRETEND_LAUNCH, "--json"] if pretend else [sys.executable, "-m", "onecard.launch", "--json"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=str(REPO))
    if p.returncode != 0:
        raise RuntimeError((p.stderr.strip().splitlines() or [f"rc={p.returncode}"])[-1][:400])
    return json.loads(p.stdout)


def plan_case(name: str, model: str, draft: str, gpu_util: str, port: int, no_ckpt: str, pretend: bool,
              base: dict) -> dict:
    """The launcher's plan of one case, twice: for MODEL (the prediction this job checks) and with
    no checkpoint at all (the prepared 27B layout, docs/profiles.md's plan)."""
    env = case_env(name, model, draft, port, gpu_util)
    plan = launcher_json({**base, **env}, pretend)
    prep = launcher_json({**base, **env, "MODEL": no_ckpt}, pretend)
    def values_of(p):
        values = {k: v["value"] for k, v in p["values"].items()}
        for k in ("MAX_LEN", "MAX_SEQS", "KV_MEM"):
            try:
                values[k] = int(values[k])
            except (KeyError, TypeError, ValueError):
                pass
        return values
    values, pvalues = values_of(plan), values_of(prep)
    differ = {k: [values.get(k), pvalues.get(k)] for k in PRODUCT_KEYS if values.get(k) != pvalues.get(k)}
    return {"env": env, "argv": plan["argv"], "values": values, "product_differs": differ,
            "vram": (plan.get("prediction") or {}).get("vram"),
            "prepared_vram": (prep.get("prediction") or {}).get("vram"),
            "notes": [n for n in plan.get("notes", []) if n.startswith(("VRAM", "MAX_LEN", "DFLASH_RING", "KV_MEM", "DRAFT_QUANT"))]}


def product_note(rec: dict) -> str:
    """'' when the case's plan sizes the server as the prepared 27B's plan does, else one line."""
    d = (rec.get("plan") or {}).get("product_differs") or {}
    if not d:
        return ""
    return (f"{rec['name']}: the plan for this checkpoint differs from the prepared 27B's (docs/profiles.md): "
            + ", ".join(f"{k} {a} vs {b}" for k, (a, b) in d.items()) + "; the figures are not the product's plan")


def vocab_size(model: str) -> int:
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
        return int(cfg.get("text_config", cfg)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 150_000


# ----------------------------------------------------------------------------- one case on the GPU

def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def complete(url: str, prompt: list[int], max_tokens: int, timeout: float) -> dict:
    body = json.dumps({"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=max(5.0, timeout)) as r:
        return json.loads(r.read())


def log_error(text: str) -> str:
    errs = [ln.strip() for ln in text.splitlines() if RE_ERRLINE.search(ln)]
    tail = [ln.strip() for ln in text.splitlines() if ln.strip()][-1:] or [""]
    return (errs[-1] if errs else tail[0])[:300]


def preemptions(url: str) -> float | None:
    """vllm:num_preemptions_total of a server since it started (its /metrics), None when unreadable:
    with FIT_PROMPT_FRAC=1 a prompt of MAX_LEN must run without one (the plans cap MAX_LEN where one
    sequence runs without preemption, onecard.memory.PoolPrediction.one_sequence_tokens(chunk=...))."""
    try:
        from onecard.bench.metrics import COUNTERS, scrape
        return scrape(url).get(COUNTERS["preemptions"])
    except Exception:  # noqa: BLE001 - a figure the summary may lack, never a failed case
        return None


def run_case(rec: dict, launcher: list[str], base: dict, out: Path, sampler: Sampler, left, frac: float,
             vocab: int) -> None:
    """Boot one case through the launcher (a session of its own), wait for /health, run the
    workload, stop it; fills rec (boot_s, workload, measured, error, vllm_log)."""
    name, env = rec["name"], {**rec["plan"]["env"]}
    url = f"http://127.0.0.1:{env['PORT']}"
    log_path = out / f"server-{name}.log"
    log_path.write_text(f"# {shlex.join(launcher)} with " + " ".join(f"{k}={v}" for k, v in env.items()) + "\n\n")
    t0 = time.monotonic()
    proc = None
    try:
        with open(log_path, "a") as log:
            proc = subprocess.Popen(launcher, env={**base, **env}, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=str(REPO), start_new_session=True)
        with open(out / "server.pids", "a") as pids:
            pids.write(f"{proc.pid}\n")
        sampler.watch(name, proc.pid, "boot")
        rec["pid"] = proc.pid
        while not http_ok(url + "/health"):
            if proc.poll() is not None:
                raise RuntimeError(f"server exited rc={proc.returncode} during boot: "
                                   + log_error(log_path.read_text(errors="replace")))
            if left() < BOOT_KEEP_S:
                raise RuntimeError(f"not healthy after {time.monotonic() - t0:.0f} s (deadline)")
            time.sleep(1)
        rec["boot_s"] = round(time.monotonic() - t0, 1)
        say(f"{name}: healthy after {rec['boot_s']:.0f} s")
        sizes = workload_sizes(int(rec["plan"]["values"]["MAX_LEN"]), int(rec["plan"]["values"]["MAX_SEQS"]), frac)
        w = rec["workload"] = dict(sizes)
        sampler.set_phase(name, "prefill")
        t = time.monotonic()
        r = complete(url, prompt_ids(sizes["prefill_tokens"], vocab, seed=41), OUT_TOKENS, left() - STOP_KEEP_S)
        w["prefill_s"] = round(time.monotonic() - t, 1)
        w["prefill_completion_tokens"] = (r.get("usage") or {}).get("completion_tokens")
        w["prefill_prompt_tokens"] = (r.get("usage") or {}).get("prompt_tokens")
        sampler.set_phase(name, "decode")
        t = time.monotonic()
        prompts = [prompt_ids(BATCH_PROMPT, vocab, seed=1000 + i) for i in range(sizes["batch"])]
        with cf.ThreadPoolExecutor(sizes["batch"]) as ex:
            outs = list(ex.map(lambda p: complete(url, p, OUT_TOKENS, left() - STOP_KEEP_S), prompts))
        w["batch_s"] = round(time.monotonic() - t, 1)
        w["batch_completion_tokens"] = [(o.get("usage") or {}).get("completion_tokens") for o in outs]
        w["preemptions"] = preemptions(url)
        time.sleep(max(1.0, 2 * sampler.poll_s))      # a last sample or two after the batch
        rec["measured"] = True
    except Exception as e:  # noqa: BLE001 - a case's failure is recorded, the others go on
        rec["error"] = f"{type(e).__name__}: {e}"[:500]
        say(f"{name}: {rec['error']}")
    finally:
        sampler.forget(name)
        if proc is not None:
            stop(proc)
        rec["wall_s"] = round(time.monotonic() - t0, 1)
        try:
            rec["vllm_log"] = parse_vllm_log(log_path.read_text(errors="replace"))
        except OSError:
            rec["vllm_log"] = {}


def parse_torch_cap(text: str | None) -> str | int | None:
    """FIT_TORCH_CAP: off (default) | auto | a number of MiB -> None | "auto" | int; else CaseError (one line)."""
    t = (text or "off").strip().lower()
    if t in ("", "off", "0"):
        return None
    if t == "auto":
        return "auto"
    try:
        v = int(t)
    except ValueError:
        v = 0
    if v < 1024:
        raise CaseError(f"FIT_TORCH_CAP={text!r} is not valid; valid: off | auto | a number of MiB >= 1024")
    return v


def torch_cap_mib(rec: dict, cap, ctx_3090_mib: float, nontorch_mib: float, card_mib: int = CARD_MIB) -> int | None:
    """The torch caching allocator's cap of one case's server (onecard_torch_mem, MiB), or None.
    FIT_TORCH_CAP (``cap``) for every case; a "-cap" case without it: auto.
    auto: what a 24 GiB card leaves torch (card - the 3090 context estimate - nontorch_mib for
    what loads beside torch: kernel modules, cuBLAS handles), plus this checkpoint's predicted
    excess over the prepared 27B layout (the geometry checkpoint's bf16 embed / lm_head), so the
    cap judges the prepared layout."""
    if cap is None and str(rec.get("name", "")).endswith(CAP_SUFFIX):
        cap = "auto"
    if cap is None:
        return None
    if cap != "auto":
        return int(cap)
    return int(card_mib - ctx_3090_mib - nontorch_mib + (layout_excess_mib(rec) or 0.0))


def cap_applied(log_path: Path) -> bool:
    """The server's log shows onecard_torch_mem's cap line (written when CUDA initialized)."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return False
    return re.search(r"onecard-torch-mem: pid \d+: torch caching allocator capped at", text) is not None


def cap_source(cap) -> str:
    return "auto, a -cap case" if cap is None else f"FIT_TORCH_CAP={cap}"


def read_torch_stats(stats_dir: Path) -> dict:
    """onecard_torch_mem's per-process files of one server -> the process with the largest reserved
    peak (the engine core) and how many processes wrote one ({} when none)."""
    recs = []
    for f in sorted(Path(stats_dir).glob("torch-*.json")):
        try:
            recs.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    if not recs:
        return {}
    top = max(recs, key=lambda r: r.get("reserved_peak_mib") or 0)
    return {**top, "processes": len(recs)}


def run_probe(probe_cmd: list[str], timeout: float = 120) -> dict:
    try:
        p = subprocess.run(probe_cmd, capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    return {"error": f"rc={p.returncode}: " + (p.stderr.strip().splitlines() or [""])[-1][:300]}


# ----------------------------------------------------------------------------- run / dry run

def ctx_3090(a) -> tuple[float, str]:
    if a.ctx_3090_mib is not None:
        return float(a.ctx_3090_mib), "FIT_CTX_3090_MIB / --ctx-3090-mib"
    from onecard import memory

    return memory.CUDA_CONTEXT / MiB, "onecard.memory.CUDA_CONTEXT"


def make_plans(cases: list[str], a, base: dict, out: Path) -> list[dict]:
    """Every case's plans (in parallel; each is a launcher process); a refused plan is the case's error."""
    no_ckpt = str(out / "no-checkpoint" / "qwen38-27b")     # never created: the prepared 27B layout
    recs = [{"name": c, "measured": False} for c in cases]
    ports = {c: free_port() for c in cases}

    def one(rec):
        try:
            rec["plan"] = plan_case(rec["name"], a.model, a.draft, a.gpu_util, ports[rec["name"]], no_ckpt,
                                    a.pretend_installed, base)
        except Exception as e:  # noqa: BLE001 - a refused plan is a result
            rec["error"] = f"plan: {e}"
    with cf.ThreadPoolExecutor(min(4, len(recs))) as ex:
        list(ex.map(one, recs))
    return recs


def reservation_mib(rec: dict) -> float:
    vram = (rec.get("plan") or {}).get("vram") or {}
    return (vram["total"] / MiB if vram.get("total") else 30 * 1024) + H200_EXTRA_MIB


def plan_lines(rec: dict, frac: float) -> list[str]:
    p = rec["plan"]
    v, vram, prep = p["values"], p.get("vram") or {}, p.get("prepared_vram") or {}
    g = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB = {b / MiB:,.0f} MiB"  # noqa: E731
    s = workload_sizes(int(v["MAX_LEN"]), int(v["MAX_SEQS"]), frac)
    return [f"case {rec['name']}: CTX={v.get('CTX')} SPEC={v.get('SPEC')} KV={v.get('KV')} MAX_LEN {int(v['MAX_LEN']):,} "
            f"MAX_SEQS {v['MAX_SEQS']} KV_MEM {int(v['KV_MEM']) / 2**30:.2f} GiB",
            f"  predicted {g(vram.get('total'))} (certain {g(vram.get('certain'))}); prepared 27B layout "
            f"{g(prep.get('total'))} (certain {g(prep.get('certain'))})",
            f"  workload: 1 request of {s['prefill_tokens']:,} prompt ids + {OUT_TOKENS} tokens, then {s['batch']} x "
            f"({BATCH_PROMPT} + {OUT_TOKENS}) at once, greedy",
            f"  argv: {shlex.join(p['argv'])}"]


def run(a, cases: list[str]) -> int:
    out = a.out
    t_start = time.monotonic()
    left = lambda: a.deadline - (time.monotonic() - t_start)  # noqa: E731
    (out / "server.pids").unlink(missing_ok=True)
    base = base_environ()
    base.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "4")
    if a.force_first_config:
        base["VLLM_TRITON_FORCE_FIRST_CONFIG"] = "1"
    base.update(gemm_env(a.gemm))
    ctx_mib, ctx_src = ctx_3090(a)
    gpu = gpu_memory(a.nvidia_smi)
    top: dict = {"cases": [], "gpu_start": gpu, "ctx_3090_mib": ctx_mib, "ctx_3090_source": ctx_src,
                 "card_mib": CARD_MIB, "model": a.model, "draft": a.draft, "gpu_util": a.gpu_util,
                 "prompt_frac": a.prompt_frac, "poll_s": a.poll, "notes": [], "failures": [],
                 "model_note": ("27B geometry, random W4A16 (bf16 embed/lm_head)" if Path(a.model).name == "qwen38-27b-geom"
                                else f"MODEL={a.model}")}
    top["gemm"] = a.gemm
    top["notes"].append(GEMM_NOTES[a.gemm])
    if a.force_first_config:
        top["notes"].append("VLLM_TRITON_FORCE_FIRST_CONFIG=1 (FIT_FORCE_FIRST_CONFIG): no Triton autotuning, so "
                            "no autotuner benchmark buffers: the product autotunes")
    say(f"GPU: {gpu or 'nvidia-smi did not answer'}; cases: {' '.join(cases)}; deadline {a.deadline:.0f} s")
    probe: dict = {}
    probe_cmd = shlex.split(a.probe_cmd) if a.probe_cmd else [sys.executable, "-c", PROBE_CODE, a.nvidia_smi]
    probe_t = threading.Thread(target=lambda: probe.update(run_probe(probe_cmd)), daemon=True)
    probe_t.start()
    recs = make_plans(cases, a, base, out)
    top["torch_cap"] = a.torch_cap
    for r in recs:
        if "plan" in r:
            # the torch caching allocator, watched always and capped with FIT_TORCH_CAP
            # (gpu/lib/stackdump/onecard_torch_mem.py, on the servers' PYTHONPATH through gpu/run.sh)
            r["plan"]["env"]["ONECARD_TORCH_STATS_DIR"] = str(out / "torch-stats" / r["name"])
            cap = torch_cap_mib(r, a.torch_cap, ctx_mib, a.nontorch_mib)
            if cap:
                r["plan"]["env"]["ONECARD_TORCH_CAP_MIB"] = str(cap)
                r["torch_cap_mib"] = cap
                say(f"case {r['name']}: torch caching allocator capped at {cap:,} MiB ({cap_source(a.torch_cap)})")
            for line in plan_lines(r, a.prompt_frac):   # the argv into run.txt only, not the summary
                print(line, flush=True) if line.startswith("  argv:") else say(line)
            if note := product_note(r):
                say("WARNING " + note)
                top["notes"].append("WARNING " + note)
        else:
            say(f"{r['name']}: {r['error']}")
    sampler = Sampler(a.poll, smi_query(a.nvidia_smi), samples_path=out / "fit-samples.csv")
    sampler.start()
    budget = (gpu.get("free_mib") or 140_000) - GPU_SLACK_MIB
    launcher = shlex.split(a.launcher)
    vocab = vocab_size(a.model)
    try:
        pending = [r for r in recs if "plan" in r]
        running: dict[str, tuple[threading.Thread, float]] = {}
        while pending or running:
            for n in [n for n, (t, _) in running.items() if not t.is_alive()]:
                running.pop(n)
            while pending:
                need = reservation_mib(pending[0])
                held = sum(mib for _, mib in running.values())
                if running and held + need > budget:
                    break
                r = pending.pop(0)
                if left() < MIN_START_S:
                    r["error"] = f"not started: {left():.0f} s left of the deadline (< {MIN_START_S} s)"
                    say(f"{r['name']}: {r['error']}")
                    continue
                t = threading.Thread(target=run_case, args=(r, launcher, base, out, sampler, left, a.prompt_frac, vocab),
                                     daemon=True)
                t.start()
                running[r["name"]] = (t, need)
                say(f"[{time.monotonic() - t_start:.0f}s] launch {r['name']} (reserving {need:,.0f} MiB; "
                    f"{held + need:,.0f} of {budget:,.0f} MiB with {len(running) - 1} other server(s))")
            time.sleep(0.5)
    finally:
        sampler.halt()
        probe_t.join(timeout=max(5.0, left()))
    top["context"] = probe
    if probe.get("context_mib") is None:
        top["failures"].append(f"H200 context probe: {probe.get('error') or 'its pid is not in nvidia-smi compute-apps'}")
    top["sampler"] = {"ticks": sampler.ticks, "errors": sampler.errors, "last_error": sampler.last_error}
    for r in recs:
        s = sampler.stats.get(r["name"], {})
        r["peak_mib"], r["procs"], r["pids"] = s.get("peak_mib", 0), s.get("procs", 0), s.get("pids", [])
        r["peak_phase"], r["phases"] = s.get("peak_phase"), s.get("phases", {})
        r["boot_neighbours"], r["samples"] = s.get("neighbours", 0), s.get("samples", 0)
        if s.get("na"):
            r.setdefault("notes", []).append(f"nvidia-smi gave no used_memory for {s['na']} process(es)")
        if r.get("measured") and not r["peak_mib"]:
            r["measured"] = False
            r["error"] = (f"no GPU memory seen for the server's session in {r['samples']} samples "
                          f"(nvidia-smi errors {sampler.errors}: {sampler.last_error or '-'})")
        r["torch"] = read_torch_stats(out / "torch-stats" / r["name"])
        if r.get("torch_cap_mib") and r.get("measured") and not cap_applied(out / f"server-{r['name']}.log"):
            r["measured"] = False
            r["error"] = ("the torch cap was not applied (no 'onecard-torch-mem: ... capped at' line in its log: "
                          "gpu/lib/stackdump not first on the server's PYTHONPATH?): not a capped measurement")
        r["derived"] = derive(r, probe.get("context_mib"), ctx_mib)
        if not r.get("measured"):
            top["failures"].append(f"{r['name']}: {r.get('error') or 'not measured'}")
    top["cases"] = recs
    top["wall_s"] = round(time.monotonic() - t_start, 1)
    write_json(out / "fit.json", top, indent=1, default=str)
    text = render_table(recs, top)
    (out / "fit-table.txt").write_text(text + "\n")
    print(text, flush=True)
    for r in recs:
        d = r["derived"]
        if r.get("measured"):
            say(f"{r['name']}: H200 peak {_n(r['peak_mib'])} MiB ({r['procs']} processes, in {r.get('peak_phase')}); "
                f"predicted {_n(d['predicted_mib'])} (certain {_n(d['certain_mib'])}), measured - predicted "
                f"{_n(d['diff_mib'], True)} MiB; 3090 estimate {_n(d['est_3090_mib'])} MiB, prepared 27B "
                f"{_n(d['est_prepared_mib'])} MiB: {d['verdict']['text']} (24 GiB = {CARD_MIB:,} MiB; an ESTIMATE)")
        else:
            say(f"{r['name']}: NOT MEASURED: {r.get('error')}")
    ok = not top["failures"]
    say(("PASS" if ok else "FAIL") + f" in {top['wall_s']} s: {len([r for r in recs if r.get('measured')])} of "
        f"{len(recs)} cases measured" + ("" if ok else "; " + "; ".join(top["failures"])))
    return 0 if ok else 1


CANNED_SMI = """12001, 18234
12002, 9200
13001, 412
14001, [N/A]
99999, 30000
"""
CANNED_LOG = """(APIServer pid=12001) INFO 12-05 10:00:01 [api_server.py:1] vLLM API server version 0.27.1
(EngineCore_DP0 pid=12002) INFO 12-05 10:00:40 [gpu_model_runner.py:5406] Model loading took 20.6 GiB memory and 31.512345 seconds
(EngineCore_DP0 pid=12002) INFO 12-05 10:01:50 [gpu_worker.py:491] Initial free memory 118.4 GiB, reserved 4.95 GiB memory for KV Cache as specified by kv_cache_memory_bytes config and skipped memory profiling. This does not respect the gpu_memory_utilization config.
(EngineCore_DP0 pid=12002) INFO 12-05 10:01:51 [kv_cache_utils.py:2235] GPU KV cache size: 71,140 tokens
(EngineCore_DP0 pid=12002) INFO 12-05 10:01:51 [kv_cache_utils.py:2237] Maximum concurrency for 70,912 tokens per request: 1.00x
(EngineCore_DP0 pid=12002) INFO 12-05 10:02:30 [gpu_model_runner.py:6914] Graph capturing finished in 12 secs, took 0.17 GiB
(EngineCore_DP0 pid=12002) INFO 12-05 10:02:31 [dflash2.py:889] DFlash2 ring mode: 5 ring tensors (2, 98, 16, 8, 128), 24.5 MiB beside the KV pool
(EngineCore_DP0 pid=12002) INFO 12-05 10:02:31 [dflash2.py:647] DFlash2 lookup lane on the device: 2.80 MiB of token history
"""


def self_check() -> dict:
    """The pure parts on canned data: nvidia-smi rows summed per session, vLLM's lines parsed,
    derive + verdict, the sampler over a fake query, the table, bad FIT_CASES refused."""
    sessions = {12001: 12001, 12002: 12001, 13001: 13001, 14001: 13001, 99999: 1}
    sums = sum_by_session(parse_compute_apps(CANNED_SMI), {12001, 13001, 777}, sessions.get)
    log = parse_vllm_log(CANNED_LOG)
    rec = {"name": "long-dflash2", "measured": True, "peak_mib": 27434, "procs": 2,
           "plan": {"values": {"MAX_LEN": 70912, "MAX_SEQS": 4},
                    "vram": {"total": 29_000 * MiB, "certain": 26_952 * MiB, "reserves": 2560 * MiB},
                    "prepared_vram": {"total": 26_200 * MiB}}}
    rec["derived"] = d = derive(rec, 540.0, 512.0)
    over = derive({**rec, "peak_mib": 28_000}, 540.0, 512.0)
    smp = Sampler(0.01, lambda: CANNED_SMI, sid_of=sessions.get)
    smp.watch("a", 12001)
    smp.tick()
    smp.set_phase("a", "decode")
    smp.tick()
    table = render_table([rec], {"context": {"context_mib": 540.0, "device": "NVIDIA H200"}, "ctx_3090_mib": 512})
    try:
        parse_cases("long-dflash2 bogus")
        refused = ""
    except CaseError as e:
        refused = str(e)
    return {"sums": {sid: (v["mib"], sorted(v["pids"]), v["na"]) for sid, v in sorted(sums.items())},
            "log": log, "derived": {k: d[k] for k in ("diff_mib", "reserves_measured_mib", "est_3090_mib",
                                                     "layout_diff_mib", "est_prepared_mib")},
            "verdict": d["verdict"]["text"], "verdict_over": over["verdict"]["text"],
            "sampler": {k: smp.stats["a"][k] for k in ("peak_mib", "procs", "pids")} | {
                "phases": sorted(smp.stats["a"]["phases"])},
            "table_row": next((ln for ln in table.splitlines() if ln.startswith("long-dflash2")), ""),
            "refused": refused, "waves": boot_waves([("a", 30_000), ("b", 30_000), ("c", 30_000), ("d", 30_000),
                                                     ("e", 30_000)], 136_000)}


def self_check_ok(r: dict) -> bool:
    return (r["sums"] == {777: (0, [], 0), 12001: (27434, [12001, 12002], 0), 13001: (412, [13001, 14001], 1)}
            and r["log"] == {"model_loading_gib": 20.6, "model_loading_s": 31.512345, "initial_free_gib": 118.4,
                             "kv_reserved_gib": 4.95, "kv_tokens": 71140, "max_concurrency": 1.0,
                             "graph_capture_s": [12], "graph_capture_gib": [0.17], "dflash2_ring_mib": 24.5,
                             "dflash2_lane_mib": 2.8}
            and r["derived"] == {"diff_mib": -1566.0, "reserves_measured_mib": 994.0, "est_3090_mib": 27378.0,
                                 "layout_diff_mib": 2800.0, "est_prepared_mib": 24578.0}
            and r["verdict"] == "does NOT fit, 2 MiB over" and r["verdict_over"] == "does NOT fit, 568 MiB over"
            and r["sampler"] == {"peak_mib": 27434, "procs": 2, "pids": [12001, 12002], "phases": ["boot", "decode"]}
            and "27,434 (2)" in r["table_row"] and "does NOT fit, 2 MiB over" in r["table_row"]
            and r["refused"].startswith("FIT_CASES: 'bogus' is not a case; valid: long-dflash2 long-dflash2-bf16 fast-dflash2")
            and r["waves"] == [["a", "b", "c", "d"], ["e"]])


def dry_run(a, cases: list[str]) -> int:
    out = a.out
    a.pretend_installed = True
    if not (Path(a.model) / "config.json").is_file():
        say(f"(dry run: no checkpoint at {a.model}: planned with the prepared 27B layout, like docs/profiles.md; "
            "on the GPU host job 20 builds it)")
    if any(CASES[case_base(c)]["SPEC"] == "dflash2" for c in cases) and not (Path(a.draft) / "config.json").is_file():
        from onecard.dflash.tiny_drafter import build_geometry_drafter

        a.draft = str(out / "dry-drafter")
        build_geometry_drafter(Path(a.draft), config_only=True, log=lambda *x, **k: None)
        say(f"(dry run: the geometry drafter's config.json only, at {a.draft})")
    say("(dry run: patch 0080 and KVarN planned as if installed)")
    say(f"(servers: {GEMM_NOTES[a.gemm]})")
    base = base_environ()
    recs = make_plans(cases, a, base, out)
    ok = True
    for r in recs:
        if "plan" not in r:
            say(f"{r['name']}: {r['error']}")
            ok = False
            continue
        for line in plan_lines(r, a.prompt_frac):
            say(line)
        if cap := torch_cap_mib(r, a.torch_cap, ctx_3090(a)[0], a.nontorch_mib):
            say(f"  torch caching allocator capped at {cap:,} MiB ({cap_source(a.torch_cap)})")
        if note := product_note(r):
            say("FAIL " + note)
            ok = False
        argv = r["plan"]["argv"]
        util = argv[argv.index("--gpu-memory-utilization") + 1] if "--gpu-memory-utilization" in argv else None
        if "--enforce-eager" in argv or "--kv-cache-memory-bytes" not in argv or util != a.gpu_util:
            say(f"{r['name']}: argv check FAILED (want CUDA graphs, a KV_MEM pin, --gpu-memory-utilization {a.gpu_util})")
            ok = False
    gpu_mib = 143_771        # an H200's memory.total (nvidia-smi, 2026-10-29)
    waves = boot_waves([(r["name"], reservation_mib(r)) for r in recs if "plan" in r], gpu_mib - GPU_SLACK_MIB)
    say(f"boot waves on an empty H200 ({gpu_mib:,} MiB - {GPU_SLACK_MIB:,} slack): "
        + " then ".join("[" + " ".join(w) + "]" for w in waves)
        + " (each reserving its predicted total + " + f"{H200_EXTRA_MIB:,} MiB; a later wave starts as servers stop)")
    res = self_check()
    good = self_check_ok(res)
    say("self-check: " + ("PASS" if good else "FAIL " + json.dumps(res, default=str)))
    ok &= good
    say("dry run " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    env = os.environ
    models = Path(env.get("MODELS", "/var/tmp/models"))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(env.get("JOB_OUT", "/tmp/fit")))
    ap.add_argument("--cases", default=env.get("FIT_CASES"), help=f"default: {' '.join(DEFAULT_CASES)}")
    ap.add_argument("--model", default=env.get("FIT_MODEL", str(models / "qwen38-27b-geom")))
    ap.add_argument("--draft", default=env.get("FIT_DRAFT", str(models / "qwen38-27b-geom-dflash2")))
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds for the whole run")
    ap.add_argument("--gpu-util", default=env.get("FIT_GPU_UTIL", "0.1"),
                    help="GPU_UTIL of every server: with the KV_MEM pin only vLLM's free-memory bar at boot")
    ap.add_argument("--poll", type=float, default=float(env.get("FIT_POLL_S", "0.5")), help="nvidia-smi every S s")
    ap.add_argument("--prompt-frac", type=float, default=float(env.get("FIT_PROMPT_FRAC", "0.5")),
                    help="the long request's prompt, as a fraction of MAX_LEN")
    ap.add_argument("--ctx-3090-mib", type=float,
                    default=float(env["FIT_CTX_3090_MIB"]) if env.get("FIT_CTX_3090_MIB") else None,
                    help="a 3090's CUDA context per process (default onecard.memory.CUDA_CONTEXT)")
    ap.add_argument("--force-first-config", action="store_true", default=env.get("FIT_FORCE_FIRST_CONFIG") == "1",
                    help="VLLM_TRITON_FORCE_FIRST_CONFIG=1 for the servers (faster boots; no autotuner buffers)")
    ap.add_argument("--gemm", default=env.get("FIT_GEMM", "marlin"),
                    help="marlin (default: the 3090's W4A16 kernel) | vllm (Machete on the H200)")
    ap.add_argument("--torch-cap", default=env.get("FIT_TORCH_CAP", "off"),
                    help="off | auto | MiB: cap each server's torch caching allocator (auto: what a 24 GiB card "
                         "leaves it for the prepared 27B layout)")
    ap.add_argument("--nontorch-mib", type=float, default=float(env.get("FIT_NONTORCH_MIB", "256")),
                    help="auto cap: MiB left beside torch and the CUDA context (kernel modules, handles)")
    ap.add_argument("--launcher", default=f"{sys.executable} -m onecard.launch")
    ap.add_argument("--nvidia-smi", default=env.get("FIT_NVIDIA_SMI", "nvidia-smi"))
    ap.add_argument("--probe-cmd", default=None, help="the context probe's command (default: PROBE_CODE)")
    ap.add_argument("--pretend-installed", action="store_true",
                    help="plan as if patch 0080 and KVarN were installed (CPU tests; the dry run always does)")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--self-check", action="store_true")
    ap.add_argument("--check-cases", action="store_true")
    a = ap.parse_args(argv)
    try:
        cases = parse_cases(a.cases)
        gemm_env(a.gemm)
        a.torch_cap = parse_torch_cap(a.torch_cap)
    except CaseError as e:
        print(f"41-fit: {e}", flush=True)
        return 2
    if a.check_cases:
        say(f"cases: {' '.join(cases)}" + (" (KVarN: installed into a private site first)" if needs_kvarn(cases) else ""))
        return 0
    if a.self_check:
        res = self_check()
        ok = self_check_ok(res)
        say("self-check: " + json.dumps(res, default=str))
        say("self-check " + ("PASS" if ok else "FAIL"))
        return 0 if ok else 1
    try:
        util = float(a.gpu_util)
    except ValueError:
        util = -1.0
    if not 0.10 <= util <= 0.99:
        print(f"41-fit: FIT_GPU_UTIL={a.gpu_util!r} is not valid; valid: 0.10..0.99 (the launcher's GPU_UTIL range)")
        return 2
    a.gpu_util = str(util)
    a.out.mkdir(parents=True, exist_ok=True)
    return dry_run(a, cases) if a.dry_run else run(a, cases)


if __name__ == "__main__":
    raise SystemExit(main())
