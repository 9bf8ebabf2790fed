"""The launcher's SPEC=dflash2 parts: the speculative-config fields patch 0080 reads, DRAFT with
MODEL=tiny, the drafter checks at launch, and the tiny builder's --drafter."""
from __future__ import annotations

import importlib.util
import json
import shutil
import re
import types
from pathlib import Path

import pytest

from onecard import plan as P
from onecard import profiles


@pytest.fixture
def installed(tmp_path, monkeypatch):
    d = tmp_path / "fakevllm"
    d.mkdir()
    (d / profiles.FEATURE_MARKERS["dflash2"]).write_text("1")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: types.SimpleNamespace(submodule_search_locations=[str(d)]))
    return d


def _sc(plan) -> dict:
    return json.loads(plan.argv[plan.argv.index("--speculative-config") + 1])


def test_refused_until_the_marker_exists(tmp_path, monkeypatch):
    bare = tmp_path / "barevllm"   # a vLLM without patch 0080's marker
    bare.mkdir()
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: types.SimpleNamespace(submodule_search_locations=[str(bare)]))
    with pytest.raises(P.PlanError, match="is not (installed into|applied to) this vLLM"):
        P.make_plan({"SPEC": "dflash2", "MODEL": "tiny"}, tmp_path, python="python3")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)   # no vLLM at all: said so
    with pytest.raises(P.PlanError, match="no vLLM is installed for"):
        P.make_plan({"SPEC": "dflash2", "MODEL": "tiny"}, tmp_path, python="python3")


def test_tiny_model_gets_the_tiny_drafter(tmp_path, installed, monkeypatch):
    monkeypatch.setenv("MODELS", str(tmp_path / "models"))
    plan = P.make_plan({"SPEC": "dflash2", "MODEL": "tiny", "DFLASH_TOKENS": "15"}, tmp_path,
                       python="python3")
    assert plan.get("DRAFT") == "tiny" and "ensure_tiny_drafter" in plan.values["DRAFT"].reason
    sc = _sc(plan)
    assert sc == {"method": "dflash2", "num_speculative_tokens": 15,
                  "model": str(tmp_path / "models" / "qwen35-tiny-dflash2"), "dflash2_lookup": True}
    # at launch (model path known) the drafter is built beside that model
    built = []
    from onecard.dflash import tiny_drafter

    monkeypatch.setattr(tiny_drafter, "ensure_tiny_drafter",
                        lambda target: built.append(target) or Path(str(target) + "-dflash2"))
    plan = P.make_plan({"SPEC": "dflash2", "MODEL": "tiny"}, tmp_path, python="python3",
                       model_path="/m/qwen35-tiny")
    assert built == [Path("/m/qwen35-tiny")] and _sc(plan)["model"] == "/m/qwen35-tiny-dflash2"


def test_explicit_draft_is_kept_with_tiny(tmp_path, installed):
    d = tmp_path / "dr"
    d.mkdir()
    (d / "config.json").write_text("{}")
    plan = P.make_plan({"SPEC": "dflash2", "MODEL": "tiny", "DRAFT": str(d), "LOOKUP": "0"},
                       tmp_path, python="python3")
    assert _sc(plan)["model"] == str(d) and _sc(plan)["dflash2_lookup"] is False


def test_lookup_default_is_not_an_error_without_dflash2(tmp_path):
    plan = P.make_plan({"SPEC": "mtp"}, tmp_path, python="python3")
    assert "dflash2_lookup" not in " ".join(plan.argv)



def test_drafter_checked_at_launch(tmp_path, installed, tiny_pair):
    target, drafter = tiny_pair
    env = {"SPEC": "dflash2", "MODEL": str(target), "DRAFT": str(drafter), "KV_MEM": "8G",
           "MAX_LEN": "4096"}
    P.check_drafter(drafter, 15, target)          # the tiny pair fits, DFLASH_TOKENS 7..15
    plan = P.make_plan({**env, "DFLASH_TOKENS": "15"}, tmp_path, python="python3",
                       check_paths=True)
    assert _sc(plan)["num_speculative_tokens"] == 15
    v1 = tmp_path / "v1"
    v1.mkdir()
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["architectures"] = ["DFlashDraftModel"]
    for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        cfg["dflash_config"].pop(k)
    (v1 / "config.json").write_text(json.dumps(cfg))
    bad_vocab = tmp_path / "badvocab"
    bad_vocab.mkdir()
    cfg2 = json.loads((drafter / "config.json").read_text())
    cfg2["vocab_size"] += 1
    (bad_vocab / "config.json").write_text(json.dumps(cfg2))
    for draft, needle in ((v1, "DFlash (v1) drafter"), (bad_vocab, "vocab_size")):
        with pytest.raises(P.PlanError, match=re.escape(needle)) as e:
            P.make_plan({**env, "DRAFT": str(draft)}, tmp_path, python="python3", check_paths=True)
        assert "\n" not in str(e.value) and "valid" in str(e.value)
    # a drafter without its weights, or with one tensor short, fails at the plan, not in the boot
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy2(drafter / "config.json", bare / "config.json")
    with pytest.raises(P.PlanError, match=r"has no \*\.safetensors; valid: \./install\.sh --drafter"):
        P.make_plan({**env, "DRAFT": str(bare)}, tmp_path, python="python3", check_paths=True)
    from safetensors.torch import load_file, save_file

    cut = tmp_path / "cut"
    shutil.copytree(drafter, cut)
    t = load_file(str(cut / "model.safetensors"))
    t.pop("norm.weight")
    save_file(t, str(cut / "model.safetensors"))
    with pytest.raises(P.PlanError, match=r"1 tensors missing, first norm\.weight; valid: the complete drafter"):
        P.make_plan({**env, "DRAFT": str(cut)}, tmp_path, python="python3", check_paths=True)


def test_tiny_cli_writes_the_drafter(tmp_path, capsys):
    from onecard.prepare import tiny

    assert tiny.main(["--out", str(tmp_path / "qwen35-tiny"), "--drafter"]) == 0
    out = capsys.readouterr().out
    d = tmp_path / "qwen35-tiny-dflash2"
    assert str(d) in out
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and (d / "model.safetensors").is_file()


def test_lookup_lane_knob_reaches_the_server(tmp_path, installed, monkeypatch):
    """LOOKUP_LANE (device by default) goes to the server as ONECARD_DFLASH_LANE, the variable
    patch 0080's proposer reads; with another SPEC it is refused in one line."""
    monkeypatch.setenv("MODELS", str(tmp_path / "models"))
    plan = P.make_plan({"SPEC": "dflash2", "MODEL": "tiny", "DFLASH_TOKENS": "15"}, tmp_path,
                       python="python3")
    assert plan.child_env["ONECARD_DFLASH_LANE"] == "device"
    plan = P.make_plan({"SPEC": "dflash2", "MODEL": "tiny", "LOOKUP_LANE": "host"}, tmp_path,
                       python="python3")
    assert plan.child_env["ONECARD_DFLASH_LANE"] == "host"
    with pytest.raises(P.PlanError, match="LOOKUP_LANE=host needs SPEC=dflash2"):
        P.make_plan({"SPEC": "mtp", "MODEL": "tiny", "LOOKUP_LANE": "host"}, tmp_path,
                    python="python3")
    plan = P.make_plan({"SPEC": "mtp", "MODEL": "tiny"}, tmp_path, python="python3")
    assert "ONECARD_DFLASH_LANE" not in plan.child_env
    # the server's reader accepts exactly the launcher's choices
    src = Path(__file__).resolve().parents[2] / "onecard/dflash/patch_src/dflash2_lane.py"
    spec = importlib.util.spec_from_file_location("onecard_test_lane_modes", src)
    lane = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lane)
    assert tuple(lane.LANE_MODES) == profiles.KNOBS["LOOKUP_LANE"].choices
    assert lane.LANE_ENV == "ONECARD_DFLASH_LANE"
