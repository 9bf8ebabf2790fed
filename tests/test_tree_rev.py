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
    for job in sorted((ROOT / "gpu" / "jobs").glob("*.sh")):
        text = job.read_text()
        for m in re.finditer(r"git rev-parse --short HEAD", text):
            line = text[text.rfind("\n", 0, m.start()) + 1:text.find("\n", m.end())]
            assert "ONECARD_TREE_REV:-" in line, f"{job.name}: {line.strip()}"


def test_run_sh_exports_it():
    text = (ROOT / "gpu" / "run.sh").read_text()
    assert "export ONECARD_TREE_REV" in text and "may be stale" in text
