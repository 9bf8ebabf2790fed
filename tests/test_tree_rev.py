"""Provenance on the GPU host: the copied tree's .git can be stale, so the caller's
ONECARD_TREE_REV is what job logs and bench records name."""
import re
from pathlib import Path

from onecard.bench import provenance

ROOT = Path(__file__).resolve().parents[1]


def test_git_info_carries_the_callers_tree_rev(monkeypatch):
    monkeypatch.setenv("ONECARD_TREE_REV", "abc1234")
    assert provenance.git_info()["tree_rev"] == "abc1234"
    monkeypatch.delenv("ONECARD_TREE_REV")
    assert provenance.git_info()["tree_rev"] is None


def test_every_job_names_the_tree_rev_first():
    for job in [*sorted((ROOT / "gpu" / "jobs").glob("*.sh")), ROOT / "gpu" / "lib" / "job.sh"]:
        text = job.read_text()
        for m in re.finditer(r"git rev-parse --short HEAD", text):
            line = text[text.rfind("\n", 0, m.start()) + 1:text.find("\n", m.end())]
            assert "ONECARD_TREE_REV:-" in line, f"{job.name}: {line.strip()}"


def test_run_sh_exports_it():
    text = (ROOT / "gpu" / "run.sh").read_text()
    assert "export ONECARD_TREE_REV" in text and "may be stale" in text


def test_job_header_names_the_script_and_the_callers_tree(tmp_path):
    """gpu/lib/job.sh's job_header / job_end: the jobs' first and last summary lines."""
    import os
    import subprocess

    job = tmp_path / "99-demo.sh"
    job.write_text(f'JOB_OUT={tmp_path}/out; cd {ROOT}; . gpu/lib/job.sh; job_header " (x)"; job_end 3\n')
    out = subprocess.run(["bash", str(job)], capture_output=True, text=True,
                         env=dict(os.environ, ONECARD_TREE_REV="abc1234", MODELS=str(tmp_path / "m")))
    assert out.returncode == 3, out.stderr   # job_end exits with the job's status
    assert re.fullmatch(r"== 99-demo \S+Z commit abc1234 \(x\)\n== 99-demo: FAIL \(rc=3\)\n", out.stdout), out.stdout
    assert (tmp_path / "out" / "summary.txt").read_text() == out.stdout
