"""Preflight step 0: MAX_LEN vs the checkpoint's max context (vLLM 0.27.1 refuses a longer
--max-model-len at config load unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1). A CTX profile default is
capped with a note, an explicit MAX_LEN refused in one line, the env override passes with a warning.
Header-only checkpoints: config.json from the tiny / geometry config writers, no weights."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onecard import memory
from onecard import plan as P
from onecard.prepare import geometry, tiny

ROOT = Path(__file__).resolve().parents[1]
IDS = {t: i for i, t in enumerate(tiny.SPECIAL_TOKENS + tiny.PLAIN_ADDED_TOKENS + tiny.VISION_TOKENS)}


def _model(tmp_path: Path, cfg: dict, name: str = "m") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def tiny_dir(tmp_path):  # max_position_embeddings 32,768 (tiny's config writer)
    return _model(tmp_path, tiny.make_config(tiny.DEFAULT_SPEC, IDS), "tiny")


def geom_27b_cfg():
    return geometry.make_config(geometry.spec_for("27b"), IDS, "27b", 1000)


def mk(env, tmp_path, model: Path):
    env = {"MODEL": str(model), **env}
    return P.make_plan(env, tmp_path, python="python3", geometry=memory.ModelGeometry.from_model_dir(model))


# ------------------------------------------------------------------ how vLLM derives the limit

def test_config_max_len_mirrors_vllm():
    assert memory.config_max_len(tiny.make_config(tiny.DEFAULT_SPEC, IDS)) == (32768, "max_position_embeddings=32768")
    assert memory.config_max_len({"num_hidden_layers": 2}) == (None, "")
    # top level when there is no text_config; the smallest key wins
    assert memory.config_max_len({"max_position_embeddings": 8192, "seq_length": 4096}) == (4096, "seq_length=4096")
    # RoPE scaling: factor multiplies (not for default/llama3), yarn starts from the original length
    rope = {"rope_type": "linear", "factor": 4.0}
    assert memory.config_max_len({"max_position_embeddings": 4096, "rope_parameters": rope})[0] == 16384
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    lim, src = memory.config_max_len({"text_config": {"max_position_embeddings": 262144, "rope_scaling": yarn}})
    assert lim == 131072 and "original_max_position_embeddings=32768" in src and "factor 4" in src
    llama3 = {"rope_type": "llama3", "factor": 8.0}
    assert memory.config_max_len({"max_position_embeddings": 8192, "rope_parameters": llama3})[0] == 8192
    # model_max_length in the config replaces the derived key
    assert memory.config_max_len({"max_position_embeddings": 8192, "model_max_length": 16384})[0] == 16384


def test_geometry_reads_limit_without_changing_equality(tmp_path):
    g = memory.ModelGeometry.from_config(geom_27b_cfg())
    assert g.max_model_len == 262144 and g.max_model_len_source == "max_position_embeddings=262144"
    assert g == memory.QWEN38_27B and memory.QWEN38_27B.max_model_len is None


# ------------------------------------------------------------------ the three cases

def test_profile_default_capped_with_note(tmp_path):
    m = tiny_dir(tmp_path)
    plan = mk({"CTX": "long"}, tmp_path, m)
    v = plan.values["MAX_LEN"]
    assert v.source == "cap" and v.value == 32768
    assert "max_position_embeddings=32768" in v.reason and "CTX=long" in v.reason
    assert plan.argv[plan.argv.index("--max-model-len") + 1] == "32768"
    notes = [n for n in plan.notes if n.startswith("MAX_LEN capped 131,072 -> 32,768")]
    assert len(notes) == 1 and "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in notes[0]
    assert "note: MAX_LEN capped" in P.format_table(plan)
    assert plan.prediction["max_len"] == 32768


def test_explicit_max_len_refused_in_one_line(tmp_path):
    m = tiny_dir(tmp_path)
    for src in ("env", ".env"):
        env = {"CTX": "long"}
        if src == "env":
            env["MAX_LEN"] = "65536"
        else:
            (tmp_path / ".env").write_text("MAX_LEN=65536\n")
        with pytest.raises(P.PlanError) as e:
            mk(env, tmp_path, m)
        msg = str(e.value)
        assert "\n" not in msg and "MAX_LEN=65536" in msg and "max_position_embeddings=32768" in msg
        assert "valid: MAX_LEN <= 32768" in msg and "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in msg
    (tmp_path / ".env").unlink()
    # at or below the limit: untouched, no note
    plan = mk({"CTX": "long", "MAX_LEN": "32768"}, tmp_path, m)
    assert plan.values["MAX_LEN"].source == "env" and plan.get("MAX_LEN") == 32768
    assert not any("max context" in n for n in plan.notes)


@pytest.mark.parametrize("val", ["1", "true", "True"])
def test_env_override_allows_with_warning(tmp_path, val):
    m = tiny_dir(tmp_path)
    for env in ({"CTX": "long"}, {"CTX": "long", "MAX_LEN": "65536"}):
        plan = mk({**env, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": val}, tmp_path, m)
        want = int(env.get("MAX_LEN", 131072))
        assert plan.get("MAX_LEN") == want and plan.values["MAX_LEN"].source != "cap"
        warn = [n for n in plan.notes if n.startswith("WARNING: MAX_LEN=")]
        assert len(warn) == 1 and "max context 32,768" in warn[0]
    # "0" is not an override (vLLM reads 1/true only)
    with pytest.raises(P.PlanError, match="max context"):
        mk({"MAX_LEN": "65536", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "0"}, tmp_path, m)


def test_no_change_without_a_config_or_on_the_27b_config(tmp_path):
    """No model dir (the goldens): no limit known, nothing changes. The 27B-geometry config
    (262,144) leaves every profile and the single-user 256,000 as they were."""
    for ctx in ("fast", "long"):
        bare = P.make_plan({"CTX": ctx}, tmp_path, python="python3")
        m = _model(tmp_path, geom_27b_cfg(), f"g-{ctx}")
        plan = mk({"CTX": ctx}, tmp_path, m)
        assert plan.argv[plan.argv.index("--max-model-len") + 1] == bare.argv[bare.argv.index("--max-model-len") + 1]
        assert plan.prediction == bare.prediction
        assert not any("max context" in n for n in plan.notes)
    su = mk({"CTX": "long", "KV": "int4_per_token_head", "MAX_LEN": "256000", "MAX_SEQS": "1",
             "KV_MEM": str(memory.INT4_KV_MEM), "SSM_DTYPE": "bfloat16"}, tmp_path, m)
    assert su.get("MAX_LEN") == 256000


# ------------------------------------------------------------------ through the launcher (--dry-run)

def _launch(env, cwd, *args):
    full = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-m", "onecard.launch", "--dry-run", *args], env=full, cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def test_launch_dry_run_cap_refuse_override(tmp_path):
    m = tiny_dir(tmp_path)
    r = _launch({"MODEL": str(m), "CTX": "long"}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "note: MAX_LEN capped 131,072 -> 32,768" in r.stdout and "--max-model-len 32768" in r.stdout
    r = _launch({"MODEL": str(m), "CTX": "long", "MAX_LEN": "65536"}, tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "valid: MAX_LEN <= 32768" in lines[0] and "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in lines[0]
    r = _launch({"MODEL": str(m), "CTX": "long", "MAX_LEN": "65536", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "note: WARNING: MAX_LEN=65,536" in r.stdout and "--max-model-len 65536" in r.stdout


def test_launch_reads_model_from_dotenv_and_non_hybrid_configs(tmp_path):
    m = tiny_dir(tmp_path)
    (tmp_path / ".env").write_text(f"MODEL={m}\nCTX=long\n")
    r = _launch({}, tmp_path, "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "MAX_LEN capped 131,072 -> 32,768" in r.stdout
    # a config that is not a Qwen3.5 hybrid: 27B memory model, its own max context still checked
    s = _model(tmp_path, {"model_type": "llama", "max_position_embeddings": 8192}, "smol")
    r = _launch({"MODEL": str(s), "MAX_LEN": "16384"}, tmp_path)
    assert r.returncode == 2 and "max_position_embeddings=8192" in r.stderr and "valid: MAX_LEN <= 8192" in r.stderr


# ------------------------------------------------------------------ the 27B geometry checkpoint

def test_geometry_config_carries_real_max_context():
    cfg = geom_27b_cfg()
    assert cfg["text_config"]["max_position_embeddings"] == geometry.MAX_POSITION_EMBEDDINGS["27b"] == 262144
    assert tiny.make_config(tiny.DEFAULT_SPEC, IDS)["text_config"]["max_position_embeddings"] == 32768
    assert cfg["onecard_geometry"]["live_vocab"] == 1000 and "onecard_tiny" not in cfg


def test_geometry_refresh_updates_old_checkpoint(tmp_path, capsys):
    cfg = geom_27b_cfg()
    cfg["text_config"]["max_position_embeddings"] = 32768
    d = _model(tmp_path, cfg, "qwen38-27b-geom")
    (d / "model.safetensors.index.json").write_text("{}")
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 32768, "eos_token": "<|im_end|>"}))
    assert geometry.main(["--out", str(d)]) == 0
    assert "max_position_embeddings 32768 -> 262144" in capsys.readouterr().out
    assert json.loads((d / "config.json").read_text())["text_config"]["max_position_embeddings"] == 262144
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert tc == {"model_max_length": 262144, "eos_token": "<|im_end|>"}
    assert geometry.refresh_max_context(d) == []
