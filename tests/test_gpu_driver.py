"""gpu/run.sh and gpu/wait.sh on the CPU: a fake site with only the files the series touches,
fake jobs; checks ordering, timeouts, failures not stopping the run, packing into $OUT, detach."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from onecard import patching
from tests.conftest import REPO, copy_subset


@pytest.fixture
def env(vllm_dir, tmp_path):
    touched = {p for patch in patching.read_series(patching.DEFAULT_SERIES) for p in patch.paths}
    site = tmp_path / "site"
    copy_subset(vllm_dir, touched, site)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "10-ok.sh").write_text('# timeout: 30\necho "ok job, out=$JOB_OUT"; echo data > "$JOB_OUT/r.txt"\n')
    (jobs / "20-fail.sh").write_text("# timeout: 30\necho failing; exit 3\n")
    (jobs / "30-slow.sh").write_text("# timeout: 1\nsleep 30\n")
    out = tmp_path / "OUT"
    out.mkdir()
    bindir = Path(sys.executable).parent
    return {
        **os.environ,
        "SITE": str(site), "STOCK": str(tmp_path / "stock"), "OUTROOT": str(tmp_path / "outroot"),
        "JOBS_DIR": str(jobs), "OUT": str(out), "MODELS": str(tmp_path / "models"),
        "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
        "GPU_NO_FA2_PREJIT": "1",   # test_fa2_prejit_runs_beside_the_jobs turns it on
    }


def run(args, env, timeout=120):
    return subprocess.run(["bash", str(REPO / "gpu" / "run.sh"), *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_runs_jobs_in_the_given_order_and_packs(env):
    out = run(["30", "10"], env)
    assert out.returncode == 0, out.stderr
    summary = (Path(env["OUT"]) / "summary.txt").read_text().splitlines()
    assert [l.split()[0] for l in summary] == ["30-slow", "10-ok"]
    assert "rc=124" in summary[0] and "rc=0" in summary[1]
    with tarfile.open(Path(env["OUT"]) / "results.tgz") as tar:
        names = tar.getnames()
    assert "./10-ok/r.txt" in names and "./10-ok/log.txt" in names
    # the site is patched, the stock copy pristine
    assert patching.status(Path(env["SITE"]) / "vllm").all_applied
    assert all(s == patching.NOT_APPLIED for _, s, _ in patching.status(Path(env["STOCK"]) / "vllm").states)


def test_a_failing_job_does_not_stop_the_run(env):
    out = run([], env)
    summary = (Path(env["OUT"]) / "summary.txt").read_text()
    assert "20-fail" in summary and "rc=3" in summary and "30-slow" in summary


def test_detach_then_wait(env):
    out = run(["--detach", "10"], env, timeout=30)
    assert out.returncode == 0 and "detached" in out.stdout
    deadline = time.monotonic() + 90
    while not (Path(env["OUTROOT"]) / "DONE").exists() and time.monotonic() < deadline:
        time.sleep(1)
    waited = subprocess.run(["bash", str(REPO / "gpu" / "wait.sh"), "5"], env=env, capture_output=True, text=True)
    assert "driver finished" in waited.stdout
    assert (Path(env["OUT"]) / "results.tgz").is_file()


def test_a_plus_group_runs_its_jobs_at_the_same_time_with_a_gpu_share(env):
    jobs = Path(env["JOBS_DIR"])
    # each job waits for the other's marker: only concurrent execution lets both finish in time
    for me, other in (("41-a", "42-b"), ("42-b", "41-a")):
        (jobs / f"{me}.sh").write_text(
            "# timeout: 20\n"
            'echo "share=$GPU_SHARED util=$GPU_UTIL"; touch "$JOB_OUT/../started-' + me + '"\n'
            'for i in $(seq 100); do [ -f "$JOB_OUT/../started-' + other + '" ] && exit 0; sleep 0.1; done; exit 9\n')
    out = run(["10", "41+42"], env)
    assert out.returncode == 0, out.stderr
    summary = (Path(env["OUT"]) / "summary.txt").read_text().splitlines()
    assert summary[0].split()[0] == "10-ok" and "shared" not in summary[0]
    group = {l.split()[0]: l for l in summary[1:]}
    assert set(group) == {"41-a", "42-b"}
    assert all("rc=0" in l and "shared GPU, 2 jobs" in l for l in group.values())
    log = (Path(env["OUTROOT"]) / "41-a" / "log.txt").read_text()
    assert "share=2 util=0.4" in log


def test_fa2_prejit_runs_beside_the_jobs(env):
    """The pre-JIT starts before the jobs, a lone job waits for it, and its failure (no GPU here)
    neither stops the run nor hides the jobs' results."""
    env = {**env, "GPU_NO_FA2_PREJIT": "0", "CUDA_CACHE_PATH": str(Path(env["OUTROOT"]) / "jit")}
    out = run(["10"], env, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "FA2 pre-JIT started" in out.stdout
    started = out.stdout.index("FA2 pre-JIT started")
    finished = out.stdout.index("FA2 pre-JIT finished")
    assert started < finished < out.stdout.index("job 10-ok")     # a lone job waits for it
    log = (Path(env["OUTROOT"]) / "fa2-prejit.log").read_text()
    assert "6 workers" in log and "CUDA_CACHE_MAXSIZE=4294967296" in log
    assert "rc=0" in (Path(env["OUT"]) / "summary.txt").read_text()


def test_a_no_wait_job_runs_beside_the_prejit_and_74_prebuilds_flashinfer(env):
    """A job headed `# prejit: no-wait` (job 20: it builds checkpoints) starts before the pre-JIT
    has finished; a timing job after it still waits. Naming job 74 also starts FlashInfer's
    sampling pre-build (it fails here, no GPU, without stopping anything)."""
    jobs = Path(env["JOBS_DIR"])
    (jobs / "05-build.sh").write_text("#!/usr/bin/env bash\n# timeout: 30\n# prejit: no-wait\necho built\n")
    (jobs / "74-timing.sh").write_text("# timeout: 30\necho timed\n")
    env = {**env, "GPU_NO_FA2_PREJIT": "0", "CUDA_CACHE_PATH": str(Path(env["OUTROOT"]) / "jit")}
    out = run(["05", "74"], env, timeout=240)
    assert out.returncode == 0, out.stderr
    s = out.stdout
    assert "FlashInfer sampling pre-build started" in s
    assert s.index("job 05-build") < s.index("FA2 pre-JIT finished") < s.index("job 74-timing")
    assert s.index("FlashInfer pre-build finished") < s.index("job 74-timing")
    assert (REPO / "gpu" / "jobs" / "20-geometry.sh").read_text().splitlines()[2].startswith("# prejit: no-wait")
