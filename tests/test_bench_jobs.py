"""GPU jobs 50 (bench smoke) and 80 (reference run) dry-run end to end on the CPU: the fake
OpenAI server stands in for vLLM, everything else (the job script, bench/run_benchmarks.sh,
bench/reference.sh, the launcher's plan, the checks, the report) is what the GPU runs."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _env(tmp_path, **kw):
    # GIT_DIR nowhere: no commit recorded, so a commit by someone else during the run cannot make
    # the arms' configs differ (the contract would rightly call that CONFOUNDED)
    return {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
            "JOB_OUT": str(tmp_path / "out"), "MODELS": str(tmp_path / "models"),
            "GIT_DIR": str(tmp_path / "no-git"), **kw}


def test_job_50_dry_run_runs_every_axis_on_both_models(tmp_path):
    pytest.importorskip("matplotlib")
    r = subprocess.run(["bash", "gpu/jobs/50-bench-smoke.sh"], cwd=REPO, capture_output=True, text=True,
                       env=_env(tmp_path, BENCH_SMOKE_FAKE="1"), timeout=300)
    out = tmp_path / "out"
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    for label in ("smol", "tiny-mtp"):
        for kind in ("ladder", "depth", "prefix_turns", "needle", "perplexity", "spec"):
            assert f"OK   {label} {kind}: VALID" in summary, (label, kind)
    assert (out / "ladder.png").stat().st_size > 1000
    report = (out / "report.md").read_text()
    assert "ladder-smol-" in report and "ladder-tiny-mtp-" in report and "![ladder](ladder.png)" in report
    assert summary.rstrip().endswith("PASS")


def test_job_80_dry_run_writes_the_table(tmp_path):
    from test_bench_reference import write_geometry_checkpoint
    write_geometry_checkpoint(tmp_path / "models" / "qwen38-27b-geom")
    pp = f"{REPO}{os.pathsep}{REPO / 'tests'}"
    r = subprocess.run(["bash", "gpu/jobs/80-reference.sh"], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=_env(tmp_path, STOCK_PYTHONPATH=pp, FAKE_VLLM_LOG="1", REF_BANDWIDTH="4000",
                                REF_BUDGET_S="800",
                                REF_SERVER_CMD=f"exec {sys.executable} tests/fake_openai_server.py"))
    out = tmp_path / "out"
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    # a larger REF_BUDGET_S moves the driver limit (budget + 100 s) and reaches the driver
    assert "driver limit 900s (tier quick)" in (out / "summary.txt").read_text()
    assert "budget 800 s" in (out / "reference.txt").read_text()
    md = (out / "performance.md").read_text()
    assert "| decode 1k C1 (" in md and "| prefix 16k turn2/turn1 |" in md and "## Goals" in md
    doc = json.loads(next((out / "results").glob("reference-quick-*.json")).read_text())
    assert doc["verdict"] == "VALID" and {b["arm"] for b in doc["boots"]} == {"patched", "stock"}
    assert "80-reference: rc=0" in (out / "summary.txt").read_text()


def test_job_80_refuses_a_budget_that_is_not_whole_seconds(tmp_path):
    from test_bench_reference import write_geometry_checkpoint
    write_geometry_checkpoint(tmp_path / "models" / "qwen38-27b-geom")
    r = subprocess.run(["bash", "gpu/jobs/80-reference.sh"], cwd=REPO, capture_output=True, text=True,
                       env=_env(tmp_path, REF_BUDGET_S="20m"), timeout=60)
    assert r.returncode == 2 and "REF_BUDGET_S=20m invalid; valid: whole seconds" in r.stdout


def test_job_80_without_checkpoint_says_which_job_builds_it(tmp_path):
    r = subprocess.run(["bash", "gpu/jobs/80-reference.sh"], cwd=REPO, capture_output=True, text=True,
                       env=_env(tmp_path), timeout=60)
    assert r.returncode == 1 and "20-geometry" in r.stdout
    assert shutil.which("bash")
