"""The tiny DFlash2-format drafter for the tiny Qwen3.5 model: format, determinism, caching."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from onecard.dflash import drafter, select, tiny_drafter
from onecard.dflash.config import DrafterConfig
from onecard.prepare import tiny

SMALL = tiny.TinySpec(layers=4, hidden=64, intermediate=128, heads=2, kv_heads=1, head_dim=64,
                      linear_key_heads=1, linear_value_heads=3, linear_head_dim=32, vocab=600)
SPEC = tiny_drafter.TinyDrafterSpec(heads=2, kv_heads=1, head_dim=32, intermediate=128,
                                    selector_rank=8, num_target_features=2)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return tiny.build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", SMALL)


@pytest.fixture(scope="module")
def built(target) -> Path:
    return tiny_drafter.ensure_tiny_drafter(target, SPEC)


def test_format(built, target):
    raw = json.loads((built / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    tcfg = json.loads((target / "config.json").read_text())
    dc = raw["dflash_config"]
    assert dc["mask_token_id"] == tcfg["video_token_id"]
    assert set(dc) == {"block_size", "conv_group_size", "conv_kernel_size", "mask_token_id",
                       "selector_rank", "selector_top_k", "target_layer_ids"}
    cfg = DrafterConfig.from_dict(raw)
    cfg.check_target(tcfg)
    assert cfg.draft_tokens == 7 and cfg.target_layer_ids == (1, 2)
    from safetensors import safe_open

    with safe_open(str(built / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in names)
    assert names == set(drafter.tensor_shapes(cfg))
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)


def test_same_bytes_twice_and_seed(built, target, tmp_path):
    again = tiny_drafter.build_tiny_drafter(target, tmp_path / "again", SPEC)
    for name in ("config.json", "model.safetensors"):
        assert (built / name).read_bytes() == (again / name).read_bytes()
    from dataclasses import replace

    other = tiny_drafter.build_tiny_drafter(target, tmp_path / "seed1", replace(SPEC, seed=1))
    assert (other / "model.safetensors").read_bytes() != (built / "model.safetensors").read_bytes()


def test_cached_and_rebuilt_on_stamp_change(built, target):
    mtime = (built / "model.safetensors").stat().st_mtime_ns
    assert tiny_drafter.ensure_tiny_drafter(target, SPEC) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == mtime
    (built / tiny_drafter.STAMP).write_text("stale\n")
    tiny_drafter.ensure_tiny_drafter(target, SPEC)
    assert (built / tiny_drafter.STAMP).read_text().strip() != "stale"
    assert not [p for p in built.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_drafts_with_the_tiny_target(built, target):
    """Load the drafter, run it on the tiny target's embed/lm_head in float64, draft a block."""
    from safetensors.torch import load_file

    cfg = DrafterConfig.load(built)
    w = drafter.load_weights(built, cfg, dtype=torch.float64)
    tw = load_file(str(target / "model.safetensors"))
    embed = tw["model.language_model.embed_tokens.weight"].double()
    lm_head = tw["lm_head.weight"].double()
    th = torch.randn(12, cfg.fc_in, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    p = drafter.forward(cfg, w, target_hidden=th, block_ids=drafter.block_ids_for(cfg, 7),
                        block_start=12, embed=embed, lm_head=lm_head)
    prop = select.draft_from_pass(cfg, w, p.hidden, p.logits, 7)
    assert prop.tokens.shape == (7,) and int(prop.tokens.max()) < cfg.vocab_size


def test_target_layer_pick():
    assert tiny_drafter.default_target_layers(8, 3) == [1, 4, 6]
    assert tiny_drafter.default_target_layers(64, 5)[-1] == 62
    with pytest.raises(ValueError):
        tiny_drafter.default_target_layers(4, 3)


def test_cli(target, tmp_path, capsys):
    assert tiny_drafter.main(["--target", str(target), "--out", str(tmp_path / "d"),
                              "--features", "2"]) == 0
    assert "tiny drafter:" in capsys.readouterr().out
    assert DrafterConfig.load(tmp_path / "d").version == 2


def test_default_tiny_model_and_drafter(tmp_path):
    """The pair the GPU suite serves: default tiny Qwen3.5 + default drafter."""
    m = tiny.ensure_tiny_model(tmp_path)
    d = tiny_drafter.ensure_tiny_drafter(m)
    assert d == m.with_name(m.name + "-dflash2")
    cfg = DrafterConfig.load(d)
    tcfg = json.loads((m / "config.json").read_text())
    cfg.check_target(tcfg)
    assert cfg.target_layer_ids == (1, 4, 6) and cfg.mask_token_id == tcfg["video_token_id"]
    assert cfg.block_size == 8 and cfg.selector_top_k == 8
