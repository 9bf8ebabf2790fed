"""gpu/probe/trace_summary.py on a fabricated Chrome trace: busy time is the union of the GPU
intervals, per-step figures divide by --steps, kernels land in their buckets, and a directory
without a trace gets a one-line error naming what is valid."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "gpu" / "probe"))
import trace_summary as T  # noqa: E402


def _ev(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


def _trace():
    # two steps of 10 ms: per step a 3 ms GEMM, a 1 ms attention kernel overlapping it by 0.5 ms
    # on another stream, a 0.5 ms GDN kernel, then idle
    evs = []
    for step in range(2):
        t0 = step * 10_000
        evs += [_ev("Marlin<256>", t0, 3000), _ev("_wide_verify_split_kernel", t0 + 2500, 1000),
                _ev("fused_recurrent_gated_delta_rule_fwd_kernel", t0 + 4000, 500)]
    evs.append(_ev("Memcpy DtoH", 14_500, 500, cat="gpu_memcpy"))   # inside step 2's idle time
    evs.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 20_000})  # not GPU
    return {"traceEvents": evs}


def test_summary_busy_idle_and_buckets():
    evs = T.gpu_events(_trace()["traceEvents"])
    s = T.summarize(evs, steps=2)
    assert s["span_ms"] == 15.0                     # 0 .. 15,000 us
    assert s["busy_ms"] == 2 * 4.0 + 0.5            # 0-3.5 and 4-4.5 per step, + the memcpy
    assert s["per_step"]["idle_ms"] == round((15.0 - 8.5) / 2, 3)
    assert s["per_step"]["kernel_sum_ms"] == round((2 * 4.5 + 0.5) / 2, 3)   # overlap counted twice
    assert s["buckets"]["gemm"]["ms_per_step"] == 3.0
    assert s["buckets"]["attention"]["ms_per_step"] == 1.0
    assert s["buckets"]["gdn"]["ms_per_step"] == 0.5
    assert s["kernels"][0]["name"] == "Marlin<256>" and s["kernels"][0]["per_step_count"] == 1.0


def test_kernels_are_told_apart_by_launch_grid():
    evs = [dict(_ev("_wide_verify_split_kernel", 0, 100), args={"grid": [1, 4, 33]}),
           dict(_ev("_wide_verify_split_kernel", 200, 50), args={"grid": [1, 8, 16]}),
           dict(_ev("_wide_verify_split_kernel", 300, 100), args={"grid": [1, 4, 33]})]
    names = {k["name"]: k["total_us"] for k in T.summarize(evs, steps=1)["kernels"]}
    assert names == {"_wide_verify_split_kernel grid=1x4x33": 200.0, "_wide_verify_split_kernel grid=1x8x16": 50.0}


def test_cli_reads_the_busiest_gz_trace_and_writes_json(tmp_path):
    (tmp_path / "frontend.pt.trace.json.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": []}).encode()))
    (tmp_path / "worker.pt.trace.json.gz").write_bytes(gzip.compress(json.dumps(_trace()).encode()))
    out = subprocess.run([sys.executable, str(REPO / "gpu" / "probe" / "trace_summary.py"), str(tmp_path),
                          "--steps", "2", "--json", str(tmp_path / "s.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "worker.pt.trace.json.gz" in out.stdout and "| gemm | 3.000 |" in out.stdout
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == 2


def test_no_trace_is_a_one_line_error(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "gpu" / "probe" / "trace_summary.py"), str(tmp_path),
                          "--steps", "3"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "valid:" in out.stderr


def test_host_side_syncs_launches_and_ops(tmp_path):
    """The host tables: time blocked in CUDA synchronizations per step (by name; async copies
    are not syncs), launches per step, torch ops by calls per step; printed by the CLI."""
    evs = _trace()["traceEvents"]
    for step in range(2):
        t0 = step * 10_000
        evs += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": t0 + 100, "dur": 1500},
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": t0 + 50, "dur": 20},
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t0 + 10, "dur": 30},
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t0 + 20, "dur": 5},
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t0 + 30, "dur": 5},
                {"ph": "X", "cat": "cpu_op", "name": "aten::index", "ts": t0 + 40, "dur": 30}]
    h = T.host_summary(evs, steps=2)
    assert h["sync_ms_per_step"] == 1.5 and [r["name"] for r in h["syncs"]] == ["cudaEventSynchronize"]
    assert h["launches_per_step"] == 3.0
    assert {r["name"]: r["calls_per_step"] for r in h["launches"]} == {"cudaGraphLaunch": 1.0, "cudaLaunchKernel": 2.0}
    ops = {r["name"]: r for r in h["ops"]}
    assert ops["aten::index"]["calls_per_step"] == 1.0 and ops["aten::mm"]["calls_per_step"] == 0.5
    (tmp_path / "worker.pt.trace.json.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": evs}).encode()))
    out = subprocess.run([sys.executable, str(REPO / "gpu" / "probe" / "trace_summary.py"), str(tmp_path),
                          "--steps", "2", "--json", str(tmp_path / "s.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "blocked in CUDA syncs 1.500 ms" in out.stdout and "| cudaEventSynchronize | 1 | 1.500 |" in out.stdout
    assert json.loads((tmp_path / "s.json").read_text())["host"]["launches_per_step"] == 3.0
    assert T.render_host(T.host_summary([], 1)) == "host: no CPU events in the trace"
