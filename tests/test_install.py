"""onecard.install: steps decide from what is there; offline (--wheelhouse) argv; failures name the fix."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from onecard import install


class Recorder(install.Installer):
    """An Installer whose commands are recorded instead of run."""

    def __init__(self, *a, have=None, fail=None, **k):
        super().__init__(*a, **k)
        self.calls, self._have, self._fail = [], have or {}, fail

    def sh(self, step, cmd, fix, env=None):
        self.calls.append([str(c) for c in cmd])
        if self._fail and self._fail in " ".join(map(str, cmd)):
            raise install.StepFailed(step, "exited 1", fix)

    def installed(self):
        return dict(self._have)


REAL_FREE_GB = install.free_gb


@pytest.fixture(autouse=True)
def _roomy_disk(monkeypatch):
    """Steps judge the disk through install.free_gb; these tests must not depend on the machine's."""
    monkeypatch.setattr(install, "free_gb", lambda path: (path, 100.0))


PINNED = {"vllm": install.VLLM_PIN, "flashinfer-python": install.FLASHINFER_PIN, "huggingface-hub": "1",
          "unidiff": "1", "safetensors": "1", "onecard": "0.1.0"}


def test_packages_already_installed_runs_nothing(tmp_path):
    inst = Recorder(tmp_path / "venv", have=PINNED)
    inst.step_packages()
    assert inst.calls == [] and inst.summary[-1][1] == "already installed"


def test_offline_install_uses_only_the_wheelhouse(tmp_path):
    wh = tmp_path / "wh"
    wh.mkdir()
    inst = Recorder(tmp_path / "venv", wheelhouse=wh, have={})
    inst.step_packages()
    setuptools_call, main_call = inst.calls
    assert "--no-index" in setuptools_call and "setuptools>=68" in setuptools_call
    assert "--no-index" in main_call and "--no-build-isolation" in main_call and str(wh) in main_call
    assert f"vllm=={install.VLLM_PIN}" in main_call


def test_failure_names_step_and_fix(tmp_path, capsys):
    inst = Recorder(tmp_path / "venv", have={}, fail="pip install")
    inst.py.parent.mkdir(parents=True)
    inst.py.write_text("")  # venv "exists"
    rc = inst.run()
    err = capsys.readouterr().err
    assert rc == 1
    assert "stopped at step 'packages'" in err and "fix:" in err


def test_kvarn_requested_but_absent_is_a_clear_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(install, "REPO", tmp_path)  # no kvarn/install.sh there
    inst = Recorder(tmp_path / "venv", kvarn=True)
    with pytest.raises(install.StepFailed, match="not part of this release"):
        inst.step_kvarn()


def test_help_runs_on_the_system_python():
    out = subprocess.run([sys.executable, "-m", "onecard.install", "--help"], capture_output=True, text=True,
                         cwd=Path(install.__file__).parent.parent)
    assert out.returncode == 0 and "--wheelhouse" in out.stdout


def test_too_little_disk_refuses_before_pip(tmp_path, monkeypatch):
    monkeypatch.setattr(install, "free_gb", lambda path: (path, 1.5))
    inst = Recorder(tmp_path / "venv", have={})
    with pytest.raises(install.StepFailed, match=r"only 1\.5 GB free .* need about \d+ GB") as exc:
        inst.step_packages()
    assert inst.calls == [] and "--venv DIR" in exc.value.fix
    monkeypatch.setenv("ONECARD_MIN_FREE_GB", "lots")
    with pytest.raises(install.StepFailed, match="ONECARD_MIN_FREE_GB='lots' is not valid"):
        inst.step_packages()
    monkeypatch.setenv("ONECARD_MIN_FREE_GB", "1")  # the override lowers the check
    inst.step_packages()
    assert any(f"vllm=={install.VLLM_PIN}" in c for c in inst.calls)


def test_free_gb_walks_up_to_an_existing_parent(tmp_path):
    at, free = REAL_FREE_GB(tmp_path / "not" / "yet" / "venv")
    assert at == tmp_path and free > 0


def test_kvarn_installed_before_is_kept_up_to_date(tmp_path, monkeypatch):
    """./install.sh without --kvarn refreshes a KVarN install it finds (idempotent; an update of
    onecard changes the copied files), and leaves a vLLM without KVarN alone."""
    inst = Recorder(tmp_path / "venv")
    monkeypatch.setattr(inst, "kvarn_present", lambda: True)
    inst.step_kvarn()
    assert any(c[-1].endswith("kvarn/install.sh") for c in inst.calls) and inst.summary[-1][1] == "kept up to date"
    other = Recorder(tmp_path / "venv")
    monkeypatch.setattr(other, "kvarn_present", lambda: False)
    other.step_kvarn()
    assert other.calls == [] and other.summary[-1][1] == "skipped"
    assert not Recorder(tmp_path / "nope").kvarn_present()   # no venv python: not installed


def test_next_line_names_a_venv_made_elsewhere(tmp_path, capsys, monkeypatch):
    """./start_qwen.sh and ./verify.sh look in ./venv unless VENV is set: an install with --venv
    DIR must say VENV=DIR in its "next:" line (session 23: the launcher ran the system python3)."""
    for venv, want in ((tmp_path / "venv", f"VENV={tmp_path / 'venv'} "), (install.REPO / "venv", None)):
        inst = Recorder(venv, have=PINNED, verify=False)
        monkeypatch.setattr(inst, "step_python", lambda: None)
        monkeypatch.setattr(inst, "step_venv", lambda: None)
        monkeypatch.setattr(inst, "step_companions", lambda: None)
        monkeypatch.setattr(inst, "step_patches", lambda: None)
        monkeypatch.setattr(inst, "step_kvarn", lambda: None)
        assert inst.run() == 0
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert "next:" in line
        if want:
            assert f"next: {want}CTX=long" in line and f"({want}./start_qwen.sh --dry-run" in line
        else:
            assert "VENV=" not in line


@pytest.mark.parametrize("script", ["start_qwen.sh", "verify.sh"])
def test_scripts_use_venv_and_refuse_a_missing_one(tmp_path, script):
    import os

    venv = tmp_path / "elsewhere"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    args = ["--dry-run"] if script == "start_qwen.sh" else ["--help"]
    r = subprocess.run(["bash", str(install.REPO / script), *args], capture_output=True, text=True, timeout=120,
                       env={**base, "VENV": str(venv), "CTX": "long"})
    assert r.returncode == 0, r.stderr
    if script == "start_qwen.sh":
        assert f"argv: {venv / 'bin' / 'python'} -m vllm" in r.stdout
    r = subprocess.run(["bash", str(install.REPO / script), *args], capture_output=True, text=True, timeout=60,
                       env={**base, "VENV": str(tmp_path / "missing")})
    err = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in err and f"VENV={tmp_path / 'missing'} has no bin/python" in err
    assert not os.path.exists(tmp_path / "missing")
