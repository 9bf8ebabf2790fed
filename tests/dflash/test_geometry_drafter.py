"""The 27B-geometry DFlash2 drafter (random weights, the published drafter's format and shapes):
its full config against the published one and onecard.memory's count, and scaled-down builds
(never the 3.6 GiB one on CPU): names/shapes, determinism, the skip-if-present stamp, the CLI."""
from __future__ import annotations

import json

import pytest
import torch

from onecard import memory
from onecard.dflash import drafter, tiny_drafter
from onecard.dflash.config import DrafterConfig

from dflash_helpers import PUBLISHED, TARGET_27B

# hidden / vocab are the target's: scaled down together with the drafter's own sizes
SMALL = dict(hidden=256, vocab=4096, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=512,
             selector_rank=16)


def _full_config() -> dict:
    tc = tiny_drafter.geometry_target_config("27b")
    return tiny_drafter.make_config(tc, tiny_drafter.geometry_drafter_spec("27b", tc))


def test_full_config_is_the_published_one():
    cfg = _full_config()
    for key, want in PUBLISHED.items():
        assert cfg[key] == want, key
    assert cfg["is_causal"] is False and cfg["max_position_embeddings"] >= 131072
    c = DrafterConfig.from_dict(cfg)
    c.check_target(TARGET_27B)
    assert c.draft_tokens == 7 and c.fc_in == 5 * 5120 and c.conv_groups == 320


def test_full_param_count_is_the_published_count():
    c = DrafterConfig.from_dict(_full_config())
    assert memory.drafter_param_count(c) == memory.DFLASH2_27B_PARAMS == 1_924_404_480
    shapes = drafter.tensor_shapes(c)
    assert sum(torch.Size(s).numel() for s in shapes.values()) == memory.DFLASH2_27B_PARAMS
    assert shapes["fc.weight"] == (5120, 25600)
    assert shapes["candidate_selector.predecessor_codebook"] == (248320, 256)
    assert shapes["layers.4.mlp.down_proj.weight"] == (5120, 17408)
    assert shapes["layers.0.attention_conv.kernel_projection.weight"] == (2 * 2 * 320, 5120)


def test_target_from_checkpoint_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {**TARGET_27B, "max_position_embeddings": 262144}}))
    tc = tiny_drafter.geometry_target_config("27b", tmp_path)
    assert tiny_drafter.geometry_drafter_spec("27b", tc) == tiny_drafter.GEOMETRY_27B_DRAFTER
    with pytest.raises(ValueError, match="target's"):
        tiny_drafter.geometry_target_config("27b", tmp_path, hidden=256)
    with pytest.raises(ValueError, match="valid: 27b"):
        tiny_drafter.geometry_target_config("9b")
    with pytest.raises(ValueError, match="valid: layers"):
        tiny_drafter.geometry_drafter_spec("27b", None, hidden=3)


def test_scaled_down_build(tmp_path):
    logs = []
    out = tmp_path / "qwen38-27b-geom-dflash2"
    rep = tiny_drafter.build_geometry_drafter(out, "27b", device="cpu", log=logs.append, **SMALL)
    assert not rep["skipped"] and rep["device"] == "cpu"
    raw = json.loads((out / "config.json").read_text())
    cfg = DrafterConfig.from_dict(raw)
    # the published format, scaled: same block / conv / top-k / target layers, mask inside vocab
    dc = raw["dflash_config"]
    assert dc["target_layer_ids"] == [5, 19, 33, 47, 61] and dc["block_size"] == 8
    assert dc["selector_top_k"] == 16 and dc["conv_group_size"] == 16 and dc["mask_token_id"] == 4095
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_layers, cfg.selector_rank) == (256, 4096, 2, 16)
    cfg.check_target({"num_hidden_layers": 64, "hidden_size": 256, "vocab_size": 4096})
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        got = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in got)
    assert got == drafter.tensor_shapes(cfg)
    assert rep["params"] == memory.drafter_param_count(cfg) == sum(torch.Size(s).numel() for s in got.values())
    w = drafter.load_weights(out, cfg, dtype=torch.float32)
    assert 0.5 < float(w["norm.weight"].mean()) < 1.5 and float(w["fc.weight"].std()) > 0
    # deterministic bytes; a present build with the same stamp is skipped, --force rebuilds
    again = tiny_drafter.build_geometry_drafter(tmp_path / "again", "27b", device="cpu", log=logs.append, **SMALL)
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "again" / "model.safetensors").read_bytes()
    assert (out / "config.json").read_bytes() == (tmp_path / "again" / "config.json").read_bytes()
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert tiny_drafter.build_geometry_drafter(out, "27b", device="cpu", log=logs.append, **SMALL)["skipped"]
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    assert not tiny_drafter.build_geometry_drafter(out, "27b", device="cpu", force=True, log=logs.append,
                                                   **SMALL)["skipped"]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert any("exists" in ln for ln in logs) and again["tensors"] == len(got)


def test_scaled_down_target_checkpoint(tmp_path):
    """Against a scaled-down target (fewer layers than 62): captured layers spread over it."""
    t = tmp_path / "geom"
    t.mkdir()
    (t / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 4, "hidden_size": 128,
                                                               "vocab_size": 1024}}))
    rep = tiny_drafter.build_geometry_drafter(tiny_drafter.geometry_drafter_dir(t), "27b", target_dir=t,
                                              device="cpu", log=lambda *_: None, layers=1, heads=2, kv_heads=1,
                                              head_dim=32, intermediate=64, selector_rank=4)
    cfg = DrafterConfig.load(rep["path"])
    assert rep["path"].endswith("geom-dflash2") and cfg.target_layer_ids == (1, 2)
    cfg.check_target(json.loads((t / "config.json").read_text()))


def test_cli(tmp_path, capsys):
    args = ["--geometry", "27b", "--out", str(tmp_path / "d"), "--device", "cpu",
            "--report", str(tmp_path / "r.json")] + [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    assert tiny_drafter.main(args) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["skipped"] is False and rep["tensors"] == 3 + 2 * 15 + 3 and rep["bytes"] == 2 * rep["params"]
    assert "geometry drafter 27b" in capsys.readouterr().out
    assert tiny_drafter.main(args) == 0
    assert json.loads((tmp_path / "r.json").read_text())["skipped"] is True
    assert tiny_drafter.main(["--geometry", "9b", "--out", str(tmp_path / "x")]) == 2


def test_config_only(tmp_path):
    """What job 31's dry run writes: the full geometry config, no weights, no stamp."""
    rep = tiny_drafter.build_geometry_drafter(tmp_path / "d", "27b", config_only=True, log=lambda *_: None)
    assert rep["config_only"] and sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json"]
    assert json.loads((tmp_path / "d" / "config.json").read_text()) == json.loads(json.dumps(_full_config()))
