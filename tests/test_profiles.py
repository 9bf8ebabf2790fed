"""Profiles are data; the single-user README is generated from them."""
from pathlib import Path
import types

from onecard import profiles

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_generated():
    committed = (ROOT / "single-user" / "README.md").read_text()
    assert committed == profiles.render_readme(), "run: python -c 'from onecard.profiles import write_readme; write_readme()'"


def test_every_knob_documented():
    text = profiles.render_readme()
    for name in profiles.KNOBS:
        assert f"`{name}`" in text


def test_profile_defaults():
    assert profiles.CTX_PROFILES["fast"].kv == "bf16" and profiles.CTX_PROFILES["fast"].max_len == 65_536
    assert profiles.CTX_PROFILES["long"].kv == "int8_per_token_head"
    assert profiles.CTX_PROFILES["long"].attention_backend == "TRITON_ATTN"
    assert profiles.CTX_PROFILES["huge"].max_len == 245_760 and profiles.CTX_PROFILES["huge"].needs == "kvarn"
    assert profiles.SPEC_PROFILES["mtp"].k_default == {"fast": 4, "long": 3, "huge": 3}
    assert profiles.SPEC_PROFILES["dflash2"].k_range == (7, 15)
    assert profiles.KNOBS["PORT"].default == "18020"
    assert profiles.KNOBS["TOOL_PARSER"].default == "qwen3_coder"


def test_single_user_exports():
    out = profiles.single_user_exports()
    assert ': "${KV:=int4_per_token_head}"; export KV' in out
    assert "MAX_LEN:=256000" in out and "MAX_SEQS:=1" in out


def test_feature_marker(tmp_path, monkeypatch):
    import importlib.util

    fake = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: fake)
    assert not profiles.kvarn_installed()
    (tmp_path / "kvarn_installed.txt").write_text("1")
    assert profiles.kvarn_installed()
    assert not profiles.feature_installed("dflash2")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert not profiles.kvarn_installed()


def test_write_readme_atomic(tmp_path):
    p = tmp_path / "R.md"
    profiles.write_readme(str(p))
    assert p.read_text() == profiles.render_readme()
    assert not list(tmp_path.glob(".readme.*"))
