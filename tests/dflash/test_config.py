"""Drafter config parsing and validation: published facts parse, every bad value is one line."""
from __future__ import annotations

import json

import pytest

from onecard import profiles
from onecard.dflash.config import DrafterConfig, DrafterConfigError

from dflash_helpers import TARGET_27B, small_config


def test_published_config_parses(published):
    c = DrafterConfig.from_dict(published)
    assert c.version == 2 and c.has_selector
    assert c.target_layer_ids == (5, 19, 33, 47, 61)
    assert (c.block_size, c.draft_tokens, c.mask_token_id) == (8, 7, 248070)
    assert (c.selector_top_k, c.selector_rank, c.conv_kernel_size, c.conv_group_size) == (16, 256, 2, 16)
    assert c.layer_types == ("sliding_attention",) * 5 and c.sliding_window == 2048
    assert c.fc_in == 5 * 5120 and c.conv_groups == 320 and c.rope_theta == 1e7
    c.check_target(TARGET_27B)
    c.check_target({"text_config": TARGET_27B})


def test_launcher_range_matches_the_drafter(published):
    """SPEC=dflash2's DFLASH_TOKENS range starts at the drafter's draft count (7)."""
    c = DrafterConfig.from_dict(published)
    lo, hi = profiles.SPEC_PROFILES["dflash2"].k_range
    assert lo == c.draft_tokens
    assert c.check_tokens(lo) == 0 and c.check_tokens(hi) == hi - c.draft_tokens
    with pytest.raises(DrafterConfigError, match="DFLASH_TOKENS=6"):
        c.check_tokens(6)


def test_dflash_v1_config():
    cfg = small_config(architectures=["DFlashDraftModel"])
    cfg["dflash_config"] = {"block_size": 16, "mask_token_id": 3, "target_layer_ids": [1]}
    c = DrafterConfig.from_dict(cfg)
    assert c.version == 1 and not c.has_selector and c.conv_groups == 0


def _mut(path: str, value):
    cfg = small_config()
    node = cfg
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[k]
    if value is KeyError:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return cfg


BAD = [
    ("architectures", ["Qwen3ForCausalLM"], "architectures"),
    ("architectures", "DFlash2DraftModel", "architectures"),
    ("dflash_config", KeyError, "dflash_config missing"),
    ("dflash_config.block_size", 1, "block_size=1"),
    ("dflash_config.block_size", KeyError, "block_size missing"),
    ("dflash_config.mask_token_id", 48, "mask_token_id=48 outside"),
    ("dflash_config.target_layer_ids", [], "target_layer_ids"),
    ("dflash_config.target_layer_ids", [3, 1], "strictly increasing"),
    ("dflash_config.target_layer_ids", [1, "2"], "target_layer_ids"),
    ("dflash_config.selector_top_k", KeyError, "selector_top_k missing"),
    ("dflash_config.selector_top_k", 49, "selector_top_k=49"),
    ("dflash_config.conv_kernel_size", 3, "conv_kernel_size=3"),
    ("dflash_config.conv_group_size", 5, "conv_group_size=5"),
    ("dflash_config.causal", True, "causal=true"),
    ("is_causal", True, "is_causal=true"),
    ("hidden_size", 0, "hidden_size=0"),
    ("num_key_value_heads", 3, "num_key_value_heads=3"),
    ("head_dim", 15, "head_dim=15"),
    ("rope_parameters", {"rope_type": "default"}, "rope theta missing"),
    ("rope_parameters", {"rope_theta": 1e4, "rope_type": "yarn"}, "rope_type='yarn'"),
    ("sliding_window", None, "sliding_window=None"),
    ("layer_types", ["full_attention"], "layer_types"),
    ("rms_norm_eps", True, "rms_norm_eps"),
    ("vocab_size", -1, "vocab_size=-1"),
]


@pytest.mark.parametrize("path,value,needle", BAD, ids=[f"{p}={v!r}" for p, v, _ in BAD])
def test_bad_values_one_line(path, value, needle):
    with pytest.raises(DrafterConfigError) as e:
        DrafterConfig.from_dict(_mut(path, value))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("dflash drafter config: ")
    assert needle in msg


def test_v1_with_v2_keys_rejected():
    cfg = small_config(architectures=["DFlashDraftModel"])
    with pytest.raises(DrafterConfigError, match="DFlash2 keys"):
        DrafterConfig.from_dict(cfg)


def test_layer_types_win_over_use_sliding_window():
    c = DrafterConfig.from_dict(small_config(layer_types=["full_attention", "sliding_attention"]))
    assert c.layer_types == ("full_attention", "sliding_attention") and c.sliding_window == 6
    c = DrafterConfig.from_dict(small_config(use_sliding_window=False, sliding_window=None))
    assert c.layer_types == ("full_attention",) * 2 and c.sliding_window is None


@pytest.mark.parametrize("target,needle", [
    ({"num_hidden_layers": 3, "hidden_size": 32, "vocab_size": 48}, "valid with a 3-layer target: 0..2"),
    ({"num_hidden_layers": 8, "hidden_size": 64, "vocab_size": 48}, "hidden_size=64"),
    ({"num_hidden_layers": 8, "hidden_size": 32, "vocab_size": 64}, "vocab_size=48"),
])
def test_target_mismatch(target, needle):
    DrafterConfig.from_dict(small_config()).check_target(dict(target, num_hidden_layers=4,
                                                             hidden_size=32, vocab_size=48))
    c = DrafterConfig.from_dict(small_config())
    with pytest.raises(DrafterConfigError) as e:
        c.check_target(target)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_load_errors(tmp_path):
    with pytest.raises(DrafterConfigError, match="not found"):
        DrafterConfig.load(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(DrafterConfigError, match="is not JSON"):
        DrafterConfig.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(small_config()))
    assert DrafterConfig.load(tmp_path).hidden_size == 32
    assert DrafterConfig.load(tmp_path / "config.json") == DrafterConfig.load(tmp_path)
