"""GPU job 74 (gpu/probe/sampler_cost.py): its contract, and the probe's plumbing on the CPU
(vLLM's TopKTopPSampler.forward_native and apply_top_k_top_p at a small vocabulary; FlashInfer is
reported as not measured, and the JSON is written)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import check_job_contract

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "gpu" / "jobs" / "74-sampler-cost.sh"
PROBE = REPO / "gpu" / "probe" / "sampler_cost.py"


def test_job_contract():
    text = check_job_contract(JOB, r"python3 gpu/probe/sampler_cost\.py")
    assert "unset VLLM_USE_FLASHINFER_SAMPLER" in text


def test_probe_on_the_cpu(tmp_path, vllm_dir):
    out = tmp_path / "sc.json"
    p = subprocess.run([sys.executable, str(PROBE), "--device", "cpu", "--rows", "1,8", "--vocab", "2048",
                        "--json", str(out), "--deadline", "120"], capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    rec = json.loads(out.read_text())
    assert [n["rows"] for n in rec["native"]] == [1, 8]
    assert all(n["native_ms"] > 0 and n["filter_ms"] > 0 for n in rec["native"])
    assert rec["flashinfer"] is None and rec["flashinfer_note"] == "not measured: --device cpu"
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("[sampler]")]
    assert len(lines) == 3 and "forward_native" in lines[0]
