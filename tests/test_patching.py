"""The patch machinery: mechanics on a synthetic package, and the CI gates on the real wheel."""
from __future__ import annotations

import base64
import hashlib
import os
import textwrap
from pathlib import Path

import pytest

from onecard import patching
from onecard.patching import APPLIED, DOES_NOT_FIT, NOT_APPLIED, PatchError
from tests.conftest import copy_subset

SERIES = patching.DEFAULT_SERIES


# ---------------------------------------------------------------- a synthetic "vllm" package


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_pkg(root: Path, version: str = "0.27.1") -> Path:
    """site/vllm with three modules and a RECORD, as a wheel install leaves them."""
    files = {
        "vllm/__init__.py": "",
        "vllm/_version.py": f"__version__ = version = '{version}'\n",
        "vllm/a.py": "".join(f"a{i} = {i}\n" for i in range(40)),
        "vllm/b.py": "def f():\n    return 1\n\n\ndef g():\n    return 2\n",
        "vllm/c.py": "x = 1\n",
    }
    site = root / "site"
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    info = site / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "RECORD").write_text(
        "".join(f"{rel},{_digest(text.encode())},{len(text)}\n" for rel, text in files.items())
    )
    return site / "vllm"


HEADER = "What: w\nWhy: y\nTest: t\nUpstream: u\n\n"
P1 = HEADER + textwrap.dedent("""\
    --- a/vllm/a.py
    +++ b/vllm/a.py
    @@ -2,3 +2,3 @@
     a1 = 1
    -a2 = 2
    +a2 = 20
     a3 = 3
    @@ -30,3 +30,4 @@
     a29 = 29
     a30 = 30
     a31 = 31
    +a31b = 31
    """)
P2 = HEADER + textwrap.dedent("""\
    --- a/vllm/a.py
    +++ b/vllm/a.py
    @@ -1,3 +1,3 @@
     a0 = 0
     a1 = 1
    -a2 = 20
    +a2 = 200
    --- a/vllm/b.py
    +++ b/vllm/b.py
    @@ -1,2 +1,2 @@
     def f():
    -    return 1
    +    return 10
    --- /dev/null
    +++ b/vllm/new_mod.py
    @@ -0,0 +1,2 @@
    +# created by the series
    +y = 2
    """)
BROKEN = HEADER + textwrap.dedent("""\
    --- a/vllm/c.py
    +++ b/vllm/c.py
    @@ -1,1 +1,1 @@
    -x = 999
    +x = 2
    """)


def make_series(root: Path, *patches: tuple[str, str]) -> Path:
    pdir = root / "patches"
    pdir.mkdir(exist_ok=True)
    for name, text in patches:
        (pdir / name).write_text(text)
    series = pdir / "series"
    series.write_text("# test series\n" + "".join(f"{name}\n" for name, _ in patches))
    return series


def snapshot(site: Path) -> dict[str, bytes]:
    return {str(p.relative_to(site)): p.read_bytes() for p in sorted(site.rglob("*.py"))}


@pytest.fixture
def pkg(tmp_path):
    vllm = make_pkg(tmp_path)
    series = make_series(tmp_path, ("0001-one.patch", P1), ("0002-two.patch", P2))
    return vllm, series


def states(vllm, series):
    return [s for _, s, _ in patching.status(vllm, series).states]


def test_apply_stacks_patches_in_order_and_is_exact(pkg):
    vllm, series = pkg
    assert states(vllm, series) == [NOT_APPLIED, NOT_APPLIED]
    _, names = patching.apply(vllm, series)
    assert names == ["0001-one.patch", "0002-two.patch"]
    text = (vllm / "a.py").read_text()
    assert "a2 = 200\n" in text and "a31b = 31\n" in text
    assert (vllm / "b.py").read_text().startswith("def f():\n    return 10\n")
    assert (vllm / "new_mod.py").read_text() == "# created by the series\ny = 2\n"
    assert states(vllm, series) == [APPLIED, APPLIED]
    assert patching.audit(vllm, series) == []


def test_second_apply_writes_nothing(pkg):
    vllm, series = pkg
    patching.apply(vllm, series)
    before = snapshot(vllm.parent)
    mtimes = {p: p.stat().st_mtime_ns for p in vllm.rglob("*.py")}
    _, names = patching.apply(vllm, series)
    assert names == []
    assert snapshot(vllm.parent) == before
    assert {p: p.stat().st_mtime_ns for p in vllm.rglob("*.py")} == mtimes


def test_revert_restores_the_wheel(pkg):
    vllm, series = pkg
    pristine = snapshot(vllm.parent)
    patching.apply(vllm, series)
    assert patching.revert(vllm, series) == ["0002-two.patch", "0001-one.patch"]
    assert snapshot(vllm.parent) == pristine
    assert not (vllm / "new_mod.py").exists()
    assert patching.revert(vllm, series) == []


def test_broken_patch_means_nothing_is_written(tmp_path):
    vllm = make_pkg(tmp_path)
    series = make_series(tmp_path, ("0001-one.patch", P1), ("0002-two.patch", P2), ("0003-broken.patch", BROKEN))
    pristine = snapshot(vllm.parent)
    with pytest.raises(PatchError, match="0003-broken.patch does not fit.*nothing was written"):
        patching.apply(vllm, series)
    assert snapshot(vllm.parent) == pristine
    assert states(vllm, series) == [NOT_APPLIED, NOT_APPLIED, DOES_NOT_FIT]


def test_failed_write_rolls_back(pkg, monkeypatch):
    vllm, series = pkg
    pristine = snapshot(vllm.parent)
    real_replace = os.replace
    calls = []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real_replace(src, dst)

    monkeypatch.setattr(patching.os, "replace", flaky)
    with pytest.raises(OSError, match="simulated"):
        patching.apply(vllm, series)
    monkeypatch.setattr(patching.os, "replace", real_replace)
    assert snapshot(vllm.parent) == pristine
    assert not list(vllm.glob(".*.tmp"))


def test_dry_run_and_check_write_nothing(pkg):
    vllm, series = pkg
    pristine = snapshot(vllm.parent)
    _, names = patching.apply(vllm, series, dry_run=True)
    assert len(names) == 2
    assert snapshot(vllm.parent) == pristine


def test_new_patch_added_to_an_applied_series(tmp_path):
    vllm = make_pkg(tmp_path)
    series = make_series(tmp_path, ("0001-one.patch", P1))
    patching.apply(vllm, series)
    series = make_series(tmp_path, ("0001-one.patch", P1), ("0002-two.patch", P2))
    assert states(vllm, series) == [APPLIED, NOT_APPLIED]
    _, names = patching.apply(vllm, series)
    assert names == ["0002-two.patch"]
    assert states(vllm, series) == [APPLIED, APPLIED]


P2B = P2.replace("+a2 = 200", "+a2 = 300").replace("+y = 2", "+y = 3")   # P2, changed by an update


def _fresh_v2(tmp_path) -> dict[str, bytes]:
    """What the updated series gives on a fresh wheel."""
    vllm = make_pkg(tmp_path / "fresh")
    patching.apply(vllm, make_series(tmp_path / "fresh", ("0001-one.patch", P1), ("0002-two.patch", P2B)))
    return snapshot(vllm.parent)


@pytest.fixture
def updated(tmp_path, monkeypatch):
    """site with v1 (P1, P2) applied; the series files now say v2 (P1, P2B); no git history."""
    monkeypatch.setattr(patching, "_git_series", lambda series, limit=40: iter(()))
    vllm = make_pkg(tmp_path)
    series = make_series(tmp_path, ("0001-one.patch", P1), ("0002-two.patch", P2))
    patching.apply(vllm, series)
    assert (patching.applied_dir(vllm, series) / "0002-two.patch").read_text() == P2   # the record of v1
    make_series(tmp_path, ("0001-one.patch", P1), ("0002-two.patch", P2B))
    return vllm, series


def test_changed_patch_is_updated_from_the_kept_record(updated, tmp_path, capsys):
    """A git pull changed a patch: apply unwinds the texts it kept at the last apply (checked
    against the wheel's RECORD), then applies the whole new series in one write."""
    vllm, series = updated
    assert DOES_NOT_FIT in states(vllm, series)   # P2's new text neither unwinds nor applies
    assert "an older version of the series is applied (2 patches" in patching.status(vllm, series).lines()[-1]
    report, names = patching.apply(vllm, series)
    assert report.replaced == ["0001-one.patch", "0002-two.patch"] and names == report.replaced
    assert report.replaced_from == f"vllm/{patching.APPLIED_DIR}/patches"
    want = _fresh_v2(tmp_path)
    assert snapshot(vllm.parent) == {k: v for k, v in want.items()}
    assert states(vllm, series) == [APPLIED, APPLIED] and patching.audit(vllm, series) == []
    assert (patching.applied_dir(vllm, series) / "0002-two.patch").read_text() == P2B
    assert sorted(x.name for x in (vllm / patching.APPLIED_DIR).iterdir()) == ["patches"]   # no .tmp / .old left
    # the CLI says what it did
    import argparse

    args = argparse.Namespace(action="apply", vllm_dir=str(vllm), series=str(series), dry_run=False, also_series=[])
    assert patching.run(args) == 0 and "already applied" in capsys.readouterr().out


def test_update_without_record_or_history_is_refused_and_writes_nothing(updated):
    vllm, series = updated
    import shutil

    shutil.rmtree(patching.applied_dir(vllm, series))
    before = snapshot(vllm.parent)
    with pytest.raises(PatchError, match="does not fit.*nothing was written"):
        patching.apply(vllm, series)
    assert snapshot(vllm.parent) == before


def test_record_that_does_not_unwind_to_the_wheel_is_not_used(updated):
    """A hand edit outside every hunk: the old series still unwinds, but not to the wheel's bytes."""
    vllm, series = updated
    with open(vllm / "b.py", "a") as fh:
        fh.write("# hand edit\n")
    before = snapshot(vllm.parent)
    with pytest.raises(PatchError, match="does not fit"):
        patching.apply(vllm, series)
    assert snapshot(vllm.parent) == before


def test_dry_run_update_and_revert_of_an_older_series(updated, tmp_path):
    vllm, series = updated
    before = snapshot(vllm.parent)
    report, _ = patching.apply(vllm, series, dry_run=True)
    assert report.replaced and snapshot(vllm.parent) == before
    assert patching.revert(vllm, series) == ["0002-two.patch", "0001-one.patch"]
    assert snapshot(vllm.parent) == snapshot(make_pkg(tmp_path / "wheel").parent)
    assert not (vllm / patching.APPLIED_DIR).exists()


def test_update_finds_the_older_series_in_git_history(tmp_path, monkeypatch):
    """An install from before the record existed: the older series comes from the checkout's git
    history (newest first; a version that does not unwind to the wheel is skipped)."""
    import shutil
    import subprocess

    repo = tmp_path / "repo"

    def git(*a):
        subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True,
                       env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                            "GIT_COMMITTER_EMAIL": "t@t"})

    repo.mkdir()
    git("init", "-q")
    for i, text in enumerate((P2, P2.replace("+a2 = 200", "+a2 = 250"), P2B)):   # v1, a v1.5 never applied, v2
        series = make_series(repo, ("0001-one.patch", P1), ("0002-two.patch", text))
        git("add", "-A")
        git("commit", "-qm", f"v{i}")
    monkeypatch.setattr(patching, "REPO", repo)
    vllm = make_pkg(tmp_path / "inst")
    v1 = make_series(tmp_path / "inst", ("0001-one.patch", P1), ("0002-two.patch", P2))
    patching.apply(vllm, v1)
    shutil.rmtree(patching.applied_dir(vllm, v1))   # installed before the record existed
    report, _ = patching.apply(vllm, series)
    assert report.replaced_from.startswith("git ") and report.replaced == ["0001-one.patch", "0002-two.patch"]
    assert snapshot(vllm.parent) == _fresh_v2(tmp_path)


def test_hand_edit_is_caught_by_audit(pkg):
    vllm, series = pkg
    patching.apply(vllm, series)
    (vllm / "c.py").write_text("x = 1  # edited by hand\n")
    problems = patching.audit(vllm, series)
    assert problems == ["vllm/c.py: differs from the wheel"]


def test_version_mismatch_is_named(tmp_path):
    vllm = make_pkg(tmp_path, version="0.28.0")
    (vllm / "a.py").write_text("completely = 'different'\n")
    series = make_series(tmp_path, ("0001-one.patch", P1))
    report = patching.status(vllm, series)
    (name, state, detail), = report.states
    assert state == DOES_NOT_FIT and "written for vllm 0.27.1" in detail
    assert report.version == "0.28.0"


@pytest.mark.parametrize(
    "series_text, message",
    [
        ("0009-missing.patch\n", "lists 0009-missing.patch, which does not exist"),
        ("0001-one.patch\n0001-one.patch\n", "listed twice"),
    ],
)
def test_series_errors_are_one_line(tmp_path, series_text, message):
    series = make_series(tmp_path, ("0001-one.patch", P1))
    series.write_text(series_text)
    with pytest.raises(PatchError, match=message) as info:
        patching.read_series(series)
    assert "\n" not in str(info.value)


def test_lint_finds_unlisted_and_headerless(tmp_path):
    series = make_series(tmp_path, ("0001-one.patch", P1))
    (series.parent / "0002-stray.patch").write_text(P2)
    (series.parent / "0001-one.patch").write_text(P1.replace("Upstream: u\n", ""))
    problems = patching.lint_series(series)
    assert any("0002-stray.patch is in" in p for p in problems)
    assert any("lacks Upstream:" in p for p in problems)


def test_path_outside_package_refused(tmp_path):
    evil = HEADER + "--- a/../etc/x\n+++ b/../etc/x\n@@ -1 +1 @@\n-a\n+b\n"
    series = make_series(tmp_path, ("0001-evil.patch", evil))
    with pytest.raises(PatchError, match="outside the vllm package"):
        patching.read_series(series)


def test_cli_apply_twice_and_status(pkg, capsys):
    from onecard.cli import main

    vllm, series = pkg
    args = ["--vllm-dir", str(vllm), "--series", str(series)]
    assert main(["patches", "status", *args]) == 1
    assert main(["patches", "apply", *args]) == 0
    assert "applied 2 of 2" in capsys.readouterr().out
    assert main(["patches", "apply", *args]) == 0
    assert "already applied" in capsys.readouterr().out
    assert main(["patches", "status", *args]) == 0
    assert main(["patches", "audit", *args]) == 0
    assert main(["patches", "status", "--vllm-dir", "/nonexistent", "--series", str(series)]) == 2
    assert "not a vllm package directory" in capsys.readouterr().err


# ---------------------------------------------------------------- the CI gates, on the real wheel


def test_gate_series_and_files_agree():
    assert patching.lint_series(SERIES) == []


def test_gate_pinned_wheel_is_pristine(vllm_dir):
    assert patching.vllm_version(vllm_dir) == "0.27.1", "the test environment must hold the pinned vLLM"
    report = patching.status(vllm_dir, SERIES)
    assert all(s == NOT_APPLIED for _, s, _ in report.states), report.lines()


def test_gate_each_patch_applies_in_order_once(vllm_dir, tmp_path):
    patches = patching.read_series(SERIES)
    touched = {p for patch in patches for p in patch.paths}
    copy = copy_subset(vllm_dir, touched, tmp_path)
    for i in range(1, len(patches) + 1):  # every prefix of the series applies in order
        prefix = tmp_path / f"series-{i}"
        prefix.write_text("".join(f"{p.name}\n" for p in patches[:i]))
        for p in patches[:i]:
            (tmp_path / p.name).write_bytes(p.path.read_bytes())
        _, names = patching.apply(copy, prefix)
        assert names == [patches[i - 1].name]
    report = patching.status(copy, SERIES)
    assert report.all_applied
    _, names = patching.apply(copy, SERIES)
    assert names == [], "a second apply must be refused as already applied"


def test_gate_installed_equals_wheel_plus_series(patched_site):
    vllm = patched_site / "vllm"
    assert patching.status(vllm, SERIES).all_applied
    assert patching.audit(vllm, SERIES) == []
