"""`onecard prepare drafter` (./install.sh --drafter): fetch the DFlash2 drafter into the
launcher's DRAFT, check its config, tensors and target; idempotent; one-line errors; the
installer step and verify.sh's check."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from onecard import verify
from onecard.prepare import drafter as pd
from onecard.prepare import model as prep

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny Qwen3.5 target and its tiny DFlash2 drafter (onecard's own builders)."""
    from onecard.dflash.tiny_drafter import build_tiny_drafter
    from onecard.prepare.tiny import build_tiny_model

    d = tmp_path_factory.mktemp("pair")
    target = build_tiny_model(d / "qwen35-tiny")
    return target, build_tiny_drafter(target, d / "qwen35-tiny-dflash2")


def tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in sorted(d.rglob("*")) if p.is_file()}


def test_local_drafter_to_dest_checked_then_noop(tmp_path, pair):
    target, drafter = pair
    dest = tmp_path / "dflash2-drafter"
    logs: list[str] = []
    s = pd.prepare(str(drafter), dest, target=target, log=logs.append)
    text = "\n".join(logs)
    assert (dest / "config.json").is_file() and (dest / "model.safetensors").is_file()
    assert s["layers"] == 2 and s["block_size"] == 8 and s["draft_tokens"] == 7 and s["target"] == str(target)
    assert s["dtypes"] == ["BF16"] and s["bytes_fp8"] < s["bytes"]
    assert "check: DFlash2 drafter, 2 layers, block 8 (7 drafts)" in text and f"fits the target {target}" in text
    assert f"next: DRAFT={dest} CTX=long SPEC=dflash2 ./start_qwen.sh" in text
    before = tree(dest)
    logs.clear()
    pd.prepare(str(drafter), dest, target=target, log=logs.append)
    assert tree(dest) == before and "fetch: already done" in "\n".join(logs)
    # in place: checked, nothing written
    src_before = tree(drafter)
    pd.prepare(str(drafter), target=target, log=lambda s: None)
    assert tree(drafter) == src_before


def test_broken_drafters_are_one_line(tmp_path, pair):
    from safetensors.torch import load_file, save_file

    target, drafter = pair
    # a tensor missing (an interrupted copy by hand)
    cut = tmp_path / "cut"
    shutil.copytree(drafter, cut)
    t = load_file(str(cut / "model.safetensors"))
    t.pop("layers.1.mlp.down_proj.weight")
    save_file(t, str(cut / "model.safetensors"))
    with pytest.raises(pd.DrafterError, match=r"1 tensors missing, first layers\.1\.mlp\.down_proj\.weight; "
                                              r"valid: the complete checkpoint") as e:
        pd.check(cut, None)
    assert "\n" not in str(e.value)
    # a DFlash v1 config
    v1 = tmp_path / "v1"
    shutil.copytree(drafter, v1)
    cfg = json.loads((v1 / "config.json").read_text())
    cfg["architectures"] = ["DFlashDraftModel"]
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        cfg["dflash_config"].pop(key)
    (v1 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(pd.DrafterError, match="valid for SPEC=dflash2: a DFlash2DraftModel drafter"):
        pd.check(v1, None)
    # no weights
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy2(drafter / "config.json", bare / "config.json")
    with pytest.raises(pd.DrafterError, match=r"no \*\.safetensors; valid: a DFlash2 drafter checkpoint"):
        pd.check(bare, None)
    # another target (hidden size)
    other = tmp_path / "other-target"
    other.mkdir()
    tc = json.loads((target / "config.json").read_text())
    (tc.get("text_config") or tc)["hidden_size"] = 512
    (other / "config.json").write_text(json.dumps(tc))
    with pytest.raises(pd.DrafterError, match=f"does not fit the target {other}"):
        pd.check(drafter, other)


def test_hub_id_lands_in_the_launchers_draft(tmp_path, monkeypatch, pair):
    import huggingface_hub

    _, drafter = pair
    calls = []

    def fake_snapshot_download(repo_id, *, revision=None, ignore_patterns=None, **kw):
        calls.append(repo_id)
        snap = tmp_path / "hf" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "abc123"
        if not snap.exists():
            shutil.copytree(drafter, snap)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    draft = tmp_path / "models" / "dflash2-drafter"
    monkeypatch.setattr(pd, "launcher_default_draft", lambda: draft)
    logs: list[str] = []
    pd.prepare(pd.DEFAULT_DRAFTER_ID, log=logs.append)
    assert calls == [pd.DEFAULT_DRAFTER_ID] and (draft / "model.safetensors").is_file()
    assert prep.read_state(draft)["source"] == pd.DEFAULT_DRAFTER_ID
    assert "next: CTX=long SPEC=dflash2 ./start_qwen.sh" in logs
    assert "no target checkpoint to check it against" in "\n".join(logs)


def test_cli_errors_exit_2_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert pd.main([str(tmp_path / "nope"), "--target", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --target {tmp_path} has no config.json; valid: a prepared target checkpoint directory"]
    assert pd.main(["not a model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "valid: a local checkpoint directory or OWNER/NAME" in err[0]


def test_install_drafter_step(tmp_path, pair):
    from onecard import install

    target, drafter = pair
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(f'#!/bin/sh\nPYTHONPATH="{REPO}" exec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    inst = install.Installer(venv, verify=False, drafter=str(drafter))
    inst.model_dir = target
    inst.step_drafter()
    assert inst.summary[-1][:2] == ("drafter", "prepared") and inst.drafter_dir == drafter
    bad = install.Installer(venv, verify=False, drafter=str(tmp_path / "missing"))
    with pytest.raises(install.StepFailed) as e:
        bad.step_drafter()
    assert e.value.step == "drafter"
    skipped = install.Installer(venv, verify=False)
    skipped.step_drafter()
    assert skipped.summary[-1][:2] == ("drafter", "skipped")


def test_install_flag_defaults_to_the_published_drafter(monkeypatch):
    from onecard import install

    seen = {}
    monkeypatch.setattr(install.Installer, "run", lambda self: seen.update(drafter=self.drafter) or 0)
    assert install.main(["--drafter"]) == 0 and seen["drafter"] == pd.DEFAULT_DRAFTER_ID
    assert install.main(["--drafter", "/some/dir"]) == 0 and seen["drafter"] == "/some/dir"
    monkeypatch.delenv("INSTALL_DRAFTER", raising=False)
    assert install.main([]) == 0 and seen["drafter"] is None


def test_verify_checks_the_drafter(tmp_path, monkeypatch, pair):
    target, drafter = pair
    monkeypatch.setenv("MODEL", str(target))
    monkeypatch.setenv("DRAFT", str(tmp_path / "none"))
    r = verify.check_drafter({})
    assert r.status == verify.WARN and "./install.sh --drafter" in r.detail
    monkeypatch.setenv("DRAFT", str(drafter))
    r = verify.check_drafter({})
    assert r.status == verify.PASS and "DFlash2, 2 layers" in r.detail and f"fits {target}" in r.detail
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy2(drafter / "config.json", bare / "config.json")
    monkeypatch.setenv("DRAFT", str(bare))
    r = verify.check_drafter({})
    assert r.status == verify.FAIL and "no *.safetensors" in r.detail


def test_prefixed_names_and_vocab_maps_pass(tmp_path, pair):
    """Names stored under "model." (patch 0080's model strips it: 0.27.1's DFlash loader alone
    would refuse them) and the draft-vocabulary maps d2t / t2d (mapped or skipped by vLLM) pass
    the check; anything else unknown does not."""
    import torch
    from safetensors.torch import load_file, save_file

    _, drafter = pair
    t = load_file(str(drafter / "model.safetensors"))
    pre = tmp_path / "prefixed"
    pre.mkdir()
    shutil.copy2(drafter / "config.json", pre / "config.json")
    save_file({**{"model." + k: v for k, v in t.items()}, "t2d": torch.ones(8, dtype=torch.bool)},
              str(pre / "model.safetensors"))
    assert pd.check(pre, None)["layers"] == 2
    save_file({**t, "extra.weight": torch.zeros(2)}, str(pre / "model.safetensors"))
    with pytest.raises(pd.DrafterError, match=r"unknown tensor extra\.weight"):
        pd.check(pre, None)
