"""`onecard launch`: --dry-run / --json never import vllm or torch; exec hands the key via env."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from onecard import launch

ROOT = Path(__file__).resolve().parents[1]


def _run(args, env, cwd):
    code = ("import sys, runpy; sys.argv=['onecard.launch', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('onecard.launch', run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    bad=[m for m in ('vllm','torch') if m in sys.modules]\n"
            "    print('IMPORTED', bad, file=sys.stderr); raise\n")
    full = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", code, *args], env=full, cwd=cwd, capture_output=True, text=True, timeout=60)


def test_dry_run_no_heavy_imports(tmp_path):
    r = _run(["--dry-run"], {"CTX": "long"}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "IMPORTED []" in r.stderr
    assert "argv: " in r.stdout and "--kv-cache-dtype int8_per_token_head" in r.stdout
    assert "source" in r.stdout and "profile" in r.stdout


def test_json(tmp_path):
    r = _run(["--json"], {"CTX": "fast", "HOST": "0.0.0.0", "VLLM_API_KEY": "topsecret"}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "IMPORTED []" in r.stderr and "topsecret" not in r.stdout
    data = json.loads(r.stdout)
    assert data["values"]["CTX"] == {"value": "fast", "source": "env", "reason": ""}
    assert data["api_key_set"] is True and data["argv"][1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]


def test_bad_input_exit_2_one_line(tmp_path):
    r = _run(["--dry-run"], {"CTX": "nope"}, tmp_path)
    assert r.returncode == 2 and r.stderr.count("onecard launch:") == 1
    assert "fast|long|huge" in r.stderr


def test_root_flag_reads_dotenv(tmp_path):
    (tmp_path / ".env").write_text("CTX=long\n")
    r = _run(["--dry-run", "--root", str(tmp_path)], {}, ROOT)
    assert "int8_per_token_head" in r.stdout


def test_exec_passes_key_by_env(tmp_path, monkeypatch, capsys):
    calls = {}
    monkeypatch.setattr(os, "execvpe", lambda f, a, e: calls.update(f=f, a=a, e=e))
    monkeypatch.setenv("HOST", "0.0.0.0")
    monkeypatch.setenv("VLLM_API_KEY", "k3y")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.setenv("MODEL", str(tmp_path / "m"))
    rc = launch.run(SimpleNamespace(dry_run=False, json=False, root=str(tmp_path)))
    assert rc == 1 and calls["e"]["VLLM_API_KEY"] == "k3y"
    assert "k3y" not in " ".join(calls["a"]) and "k3y" not in capsys.readouterr().out


def test_tiny_model_resolved_lazily(tmp_path, monkeypatch):
    import json as _j

    tiny = tmp_path / "tiny"
    tiny.mkdir()
    text = {"num_hidden_layers": 8, "full_attention_interval": 4, "num_key_value_heads": 2, "head_dim": 256,
            "hidden_size": 256, "num_attention_heads": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "mtp_num_hidden_layers": 1}
    (tiny / "config.json").write_text(_j.dumps({"text_config": text}))
    monkeypatch.setattr(launch, "_tiny_model_path", lambda: str(tiny))
    calls = {}
    monkeypatch.setattr(os, "execvpe", lambda f, a, e: calls.update(a=a))
    for k, v in {"MODEL": "tiny", "MAX_LEN": "4096", "KV_MEM": "256M"}.items():
        monkeypatch.setenv(k, v)
    assert launch.run(SimpleNamespace(dry_run=False, json=False, root=str(tmp_path))) == 1
    assert calls["a"][4] == str(tiny)


def test_start_qwen_sh_and_alternative(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "start_qwen.sh"), "--dry-run"], capture_output=True, text=True,
                       env={"PATH": os.path.dirname(sys.executable) + ":" + os.environ["PATH"], "CTX": "long"}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "int8_per_token_head" in r.stdout
    r = subprocess.run(["bash", str(ROOT / "single-user" / "alternative.sh"), "--dry-run"], capture_output=True, text=True,
                       env={"PATH": os.path.dirname(sys.executable) + ":" + os.environ["PATH"]}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--kv-cache-dtype int4_per_token_head" in r.stdout and "--max-model-len 256000" in r.stdout
    assert "--max-num-seqs 1" in r.stdout


def test_cli_registry():
    from onecard.cli import COMMANDS

    assert COMMANDS["launch"][0] == "onecard.launch"


def test_real_launch_without_vllm_refuses_before_anything(tmp_path, monkeypatch, capsys):
    """No vLLM for this Python: one line naming VENV, exit 2 (the unit's no-restart code), before
    MODEL=tiny is built, the warm-up forked or anything exec'd; a dry run still prints the plan."""
    import importlib.util

    from onecard import launch

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.setattr(launch, "_tiny_model_path", lambda: pytest.fail("built the tiny model"))
    monkeypatch.setattr(os, "execvpe", lambda *a: pytest.fail("exec'd"))
    monkeypatch.setenv("MODEL", "tiny")
    assert launch.run(SimpleNamespace(dry_run=False, json=False, root=str(tmp_path))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("onecard launch: no vLLM is installed for") and "VENV=DIR" in err and "\n" not in err
    assert launch.run(SimpleNamespace(dry_run=True, json=False, root=str(tmp_path))) == 0
