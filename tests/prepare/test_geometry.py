import json
import math

import pytest
import torch
from safetensors.torch import load_file

from onecard.prepare import geometry, quant, requant, st
from onecard.prepare.tiny import tensor_shapes

SMALL = dict(layers=4, hidden=256, intermediate=512, heads=2, kv_heads=1, linear_key_heads=2,
             linear_value_heads=6, vocab=8192)


def test_27b_plan_shapes_and_size():
    spec = geometry.spec_for("27b")
    shapes = tensor_shapes(spec)
    body = sum(math.prod(s) for n, s in shapes.items() if not n.startswith("model.visual"))
    assert 27.0e9 < body < 27.6e9
    items = {n: (c, s) for n, c, s, _ in geometry.plan(spec)}
    lm = "model.language_model"
    assert items[f"{lm}.embed_tokens.weight"] == ("BF16", [248320, 5120])
    assert items["lm_head.weight"] == ("BF16", [248320, 5120])
    assert items[f"{lm}.layers.0.linear_attn.in_proj_qkv.weight_packed"] == ("I32", [2 * 2048 + 6144, 640])
    assert items[f"{lm}.layers.0.linear_attn.in_proj_a.weight"] == ("BF16", [48, 5120])
    assert items[f"{lm}.layers.0.linear_attn.A_log"][0] == "F32"
    assert items[f"{lm}.layers.3.self_attn.q_proj.weight_scale"] == ("BF16", [2 * 24 * 256, 40])
    assert items[f"{lm}.layers.3.mlp.down_proj.weight_packed"] == ("I32", [5120, 17408 // 8])
    assert items["mtp.fc.weight"] == ("BF16", [5120, 10240])
    assert f"{lm}.layers.63.self_attn.o_proj.weight_packed" in items
    total = sum(math.prod(s) * st.DTYPE_SIZE[c] for c, s in items.values())
    assert 16.5 * 2**30 < total < 18 * 2**30


def test_bad_geometry_and_override():
    with pytest.raises(ValueError, match="valid: 27b"):
        geometry.spec_for("9b")
    with pytest.raises(ValueError, match="multiple of 4"):
        geometry.spec_for("27b", layers=6)


def test_small_build_loads_and_requantizes(tmp_path, monkeypatch):
    monkeypatch.setenv("MODELS", str(tmp_path / "models"))
    out = tmp_path / "geom"
    logs = []
    rep = geometry.build(out, "27b", device="cpu", shard_gb=0.002, log=logs.append, **SMALL)
    assert rep["shards"] > 1 and (out / "tokenizer.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["text_config"]["vocab_size"] == 8192 and cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    # the real model's max context (tiny's writer says 32,768), in the config and the tokenizer
    assert cfg["text_config"]["max_position_embeddings"] == 262144
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 262144
    qc = cfg["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["num_bits"] == 4 and qc["format"] == "pack-quantized"
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    t = {}
    for f in set(idx["weight_map"].values()):
        t.update(load_file(out / f))
    assert set(t) == set(idx["weight_map"]) and idx["metadata"]["total_size"] == rep["bytes"]
    lm = "model.language_model"
    p = f"{lm}.layers.0.mlp.down_proj"
    w = quant.dequantize(t[p + ".weight_packed"], t[p + ".weight_scale"], 4, t[p + ".weight_shape"].tolist())
    assert w.shape == (256, 512) and 0 < w.std() < 1
    for n in (f"{lm}.layers.0.linear_attn.in_proj_b.weight", f"{lm}.layers.0.linear_attn.conv1d.weight",
              f"{lm}.layers.0.input_layernorm.weight", "mtp.fc.weight"):
        assert t[n].dtype == torch.bfloat16
    live = cfg["onecard_geometry"]["live_vocab"]
    assert live < 8192 and t["lm_head.weight"][live:].abs().sum() == 0 and t["lm_head.weight"][:live].abs().sum() > 0
    # deterministic
    out2 = tmp_path / "geom2"
    geometry.build(out2, "27b", device="cpu", shard_gb=0.002, log=logs.append, **SMALL)
    for f in set(idx["weight_map"].values()):
        assert (out / f).read_bytes() == (out2 / f).read_bytes()
    # the requantization steps run on it and leave it consistent
    assert requant.validate(out) == []
    requant.requantize(out, "lm_head", log=logs.append)
    requant.requantize(out, "mtp", log=logs.append)
    assert requant.validate(out) == []
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "re:.*mtp.*" not in qc["ignore"] and "re:.*lm_head$" not in qc["ignore"]
    assert "re:.*in_proj_a$" in qc["ignore"]
