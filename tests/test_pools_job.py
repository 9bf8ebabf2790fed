"""gpu/lib/pools.py (the 40-pools job driver) against a fake launcher on CPU."""
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("pools", ROOT / "gpu" / "lib" / "pools.py")
pools = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pools)

TEXT = {"num_hidden_layers": 8, "full_attention_interval": 4, "num_key_value_heads": 2, "head_dim": 256,
        "hidden_size": 256, "num_attention_heads": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "mtp_num_hidden_layers": 1,
        "mamba_ssm_dtype": "float32"}

FAKE = r'''
import os, sys, time, json
sys.path.insert(0, os.environ["ROOT"])
from onecard import memory
from onecard.plan import make_plan
g = memory.ModelGeometry.from_model_dir(os.environ["MODEL"])
p = make_plan(dict(os.environ), ".", python="python3", geometry=g).prediction
if os.environ.get("FAKE_MODE") == "crash":
    print("Traceback (most recent call last):\nValueError: boom", flush=True); sys.exit(1)
print(f"(EngineCore pid=1) INFO Setting attention block size to {p['block_size']} tokens to ensure", flush=True)
print(f"(EngineCore pid=1) INFO GPU KV cache size: {p['pool_tokens']:,} tokens", flush=True)
print(f"INFO Maximum concurrency for {p['max_len']:,} tokens per request: {p['max_concurrency']:.2f}x", flush=True)
time.sleep(300)
'''


def _setup(tmp_path, monkeypatch, mode="ok"):
    models = tmp_path / "models"
    geom = models / "qwen38-27b-geom"
    geom.mkdir(parents=True)
    (geom / "config.json").write_text(json.dumps({"text_config": TEXT}))
    fake = tmp_path / "fake.py"
    fake.write_text(FAKE)
    monkeypatch.setenv("ROOT", str(ROOT))
    monkeypatch.setenv("FAKE_MODE", mode)
    return models, fake


def test_pools_driver_matches_and_kills(tmp_path, monkeypatch, capsys):
    models, fake = _setup(tmp_path, monkeypatch)
    out = tmp_path / "out"
    rc = pools.main(["--out", str(out), "--models", str(models), "--no-tiny", "--only", "27b-fast", "27b-long",
                     "--launcher", f"{sys.executable} {fake}", "--root", str(tmp_path)])
    text = capsys.readouterr().out
    assert rc == 0, text
    recs = json.loads((out / "pools.json").read_text())
    assert [r["name"] for r in recs] == ["27b-fast", "27b-long"]
    for r in recs:
        assert r["pool_tokens"] == r["prediction"]["pool_tokens"] and r["block_size"] == r["prediction"]["block_size"]
        assert r["seconds"] < 60
    assert "27b-long" in (out / "pools-table.txt").read_text()


def test_pools_driver_reports_crash(tmp_path, monkeypatch, capsys):
    models, fake = _setup(tmp_path, monkeypatch, "crash")
    out = tmp_path / "out"
    rc = pools.main(["--out", str(out), "--models", str(models), "--no-tiny", "--only", "27b-fast",
                     "--launcher", f"{sys.executable} {fake}", "--root", str(tmp_path)])
    assert rc == 1
    rec = json.loads((out / "pools.json").read_text())[0]
    assert rec["pool_tokens"] is None and "boom" in rec["error"]
    assert "FAIL" in capsys.readouterr().out


def test_cases_without_geom(tmp_path):
    names = [c["name"] for c in pools.cases(tmp_path, "/x/tiny")]
    assert names == ["tiny-fast", "tiny-long", "tiny-fast-off-noprefix"]
