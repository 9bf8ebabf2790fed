"""Profiles are data; the single-user README is generated from them."""
from pathlib import Path
import types
import pytest

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


def test_kvarn_stale_marker_names_what_changed(tmp_path, monkeypatch):
    """The marker records a hash per copied KVarN file: after an update of onecard the launcher
    must not serve CTX=huge with the old copy (the plan refuses with the files that changed)."""
    import importlib.util

    from onecard import plan as P
    from onecard.kvarn.installer import marker_text

    fake = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: fake)
    assert profiles.feature_stale("kvarn") == ""          # not installed: nothing to say
    marker = tmp_path / "kvarn_installed.txt"
    marker.write_text(marker_text())
    assert profiles.feature_stale("kvarn") == ""          # current
    old = marker_text().replace(marker_text().splitlines()[2].split()[0], "0" * 16)
    marker.write_text(old)
    changed = marker_text().splitlines()[2].split()[-1].rsplit("/", 1)[-1]
    assert profiles.feature_stale("kvarn") == changed
    with pytest.raises(P.PlanError, match=f"older than this checkout \\({changed} changed\\); run kvarn/install.sh") as e:
        P.make_plan({"CTX": "huge", "SPEC": "mtp"}, tmp_path, "python3", "models/x", check_paths=False)
    assert "\n" not in str(e.value)
    assert profiles.feature_stale("dflash2") == ""
