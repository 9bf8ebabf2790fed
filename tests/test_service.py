"""`onecard service`: the systemd user unit that runs ./start_qwen.sh (written, idempotent,
validated, removed), with systemctl faked on PATH; and install.sh --service's step."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onecard import service

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """XDG_CONFIG_HOME in tmp_path and a systemctl that logs its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "systemctl.log"
    fake = bin_dir / "systemctl"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n[ "$2" = is-active ] && echo active\nexit 0\n')
    fake.chmod(0o755)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def test_install_writes_the_unit_once_and_reloads(home):
    out = io.StringIO()
    env = service.parse_env(["CTX=long", "SPEC=dflash2", "CUDA_VISIBLE_DEVICES=1", "VENV=/opt/onecard-venv"])
    assert service.install("onecard", env, out=out) == 0
    unit = home / "config" / "systemd" / "user" / "onecard.service"
    text = unit.read_text()
    assert f"ExecStart={REPO / 'start_qwen.sh'}" in text and f"WorkingDirectory={REPO}" in text
    assert 'Environment="CTX=long"' in text and 'Environment="SPEC=dflash2"' in text
    assert 'Environment="CUDA_VISIBLE_DEVICES=1"' in text   # which GPU: not a knob, passed through
    assert 'Environment="VENV=/opt/onecard-venv"' in text    # read by start_qwen.sh (install --venv DIR)
    assert "RestartPreventExitStatus=2" in text and "Restart=on-failure" in text and "WantedBy=default.target" in text
    assert "written" in out.getvalue() and "systemctl --user enable --now onecard" in out.getvalue()
    assert (home / "systemctl.log").read_text().splitlines() == ["--user daemon-reload"]
    out = io.StringIO()
    service.install("onecard", env, out=out)           # the same again: nothing written, no reload
    assert "unchanged" in out.getvalue() and len((home / "systemctl.log").read_text().splitlines()) == 1
    assert not list(unit.parent.glob("*.tmp"))


def test_dry_run_writes_nothing_and_uninstall_removes(home):
    out = io.StringIO()
    service.install("onecard", {}, dry_run=True, out=out)
    unit = home / "config" / "systemd" / "user" / "onecard.service"
    assert "would write" in out.getvalue() and not unit.exists()
    service.install("onecard", {})
    assert service.status("onecard", out=io.StringIO()) == 0
    out = io.StringIO()
    assert service.uninstall("onecard", out=out) == 0 and not unit.exists() and "removed" in out.getvalue()
    assert "--user disable --now onecard.service" in (home / "systemctl.log").read_text()
    assert service.status("onecard", out=io.StringIO()) == 1
    assert "nothing to do" in (lambda o: (service.uninstall("onecard", out=o), o.getvalue())[1])(io.StringIO())


@pytest.mark.parametrize("args,msg", [
    (["install", "--env", "VLLM_API_KEY=sk-1"], "a secret does not go into a unit file"),
    (["install", "--env", "CTXX=long"], "is not valid; valid: KNOB=VALUE with KNOB one of CTX, SPEC"),
    (["install", "--env", "CTX="], "is not valid; valid: KNOB=VALUE"),
    (["install", "--env", "EXTRA_ARGS=--seed $X"], "may not contain a newline, quote, backslash, % or $"),
    (["install", "--name", "../evil"], "--name '../evil' is not valid"),
    (["status", "--env", "CTX=long"], "--env is for install"),
])
def test_bad_arguments_are_one_line_and_write_nothing(home, capsys, args, msg):
    from onecard import cli

    assert cli.main(["service", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err
    assert not (home / "config").exists()


def test_onecard_service_cli_and_install_flag(home):
    r = subprocess.run([sys.executable, "-m", "onecard", "service", "install", "--dry-run", "--env", "CTX=long"],
                       capture_output=True, text=True, cwd=REPO, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0 and 'Environment="CTX=long"' in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "onecard.install", "--help"], capture_output=True, text=True, cwd=REPO,
                       timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "--service" in r.stdout


def test_install_step_passes_model_and_drafter_placed_elsewhere(tmp_path):
    from onecard.install import Installer

    from onecard.install import REPO as CHECKOUT

    assert Installer(CHECKOUT / "venv", service=True).service_env() == []   # the default venv
    inst = Installer(tmp_path / "venv", service=True)
    assert inst.service_env() == [f"VENV={tmp_path / 'venv'}"]   # start_qwen.sh reads VENV
    inst.model_dir, inst.drafter_dir = tmp_path / "m", tmp_path / "d"
    assert inst.service_env() == [f"VENV={tmp_path / 'venv'}", f"MODEL={tmp_path / 'm'}", f"DRAFT={tmp_path / 'd'}"]
    calls = []
    inst.sh = lambda step, cmd, fix, env=None: calls.append([str(c) for c in cmd])
    inst.step_service()
    assert calls[0][1:5] == ["-m", "onecard", "service", "install"] and f"MODEL={tmp_path / 'm'}" in calls[0]
    assert inst.summary[-1][:2] == ("service", "written")
    Installer(tmp_path / "venv").step_service()


def test_the_shipped_example_unit_is_what_install_writes():
    """single-user/onecard.service (DESIGN.md's layout) is render_unit for a checkout at ~/onecard:
    the example and the command cannot drift."""
    shipped = (REPO / "single-user" / "onecard.service").read_text()
    assert shipped == service.render_unit(service.EXAMPLE_REPO, {}), \
        "regenerate: python -c 'from onecard.service import *; open(\"single-user/onecard.service\", \"w\").write(render_unit(EXAMPLE_REPO, {}))'"
    assert "ExecStart=%h/onecard/start_qwen.sh" in shipped
