"""What the KV pin does not cover: the DFlash2 drafter (weights + its KV layers in the pool),
patch 0012's draft_lm_head, KVarN's fp16 stage; memory.vram_budget."""
import json
import sys
from math import prod
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from onecard import memory as m
from onecard.dflash.config import DrafterConfig

sys.path.insert(0, str(Path(__file__).parent / "dflash"))
from dflash_helpers import PUBLISHED, small_config  # noqa: E402

G = m.QWEN38_27B


def test_published_drafter_estimate_is_its_config_shape():
    cfg = DrafterConfig.from_dict(PUBLISHED)
    from onecard.dflash.drafter import tensor_shapes

    n = sum(prod(s) for s in tensor_shapes(cfg).values())
    assert m.drafter_param_count(cfg) == n == m.DFLASH2_27B_PARAMS
    assert cfg.num_layers == m.DFLASH2_27B_LAYERS
    assert 3.5 < n * 2 / m.GiB < 3.7  # "~3.7 GB bf16" as reported (3.85 GB = 3.58 GiB)
    small = DrafterConfig.from_dict(small_config())
    assert m.drafter_param_count(small) == sum(prod(s) for s in tensor_shapes(small).values())


def test_dflash_drafter_vram_sources(tmp_path):
    d = tmp_path / "dr"
    d.mkdir()
    (d / "config.json").write_text("{}")
    est = m.dflash_drafter_vram(d)
    assert est.weight_bytes == m.DFLASH2_27B_PARAMS * 2 and est.attn_layers == 5 and "estimate" in est.source
    (d / "config.json").write_text(json.dumps(small_config(num_hidden_layers=3)))
    cfg = DrafterConfig.load(d)
    shp = m.dflash_drafter_vram(d)
    assert shp.weight_bytes == m.drafter_param_count(cfg) * 2 and shp.attn_layers == 3 and "config shape" in shp.source
    save_file({"fc.weight": torch.zeros(32, 64, dtype=torch.bfloat16), "norm.weight": torch.zeros(32)}, d / "model.safetensors")
    hdr = m.dflash_drafter_vram(d)
    assert hdr.weight_bytes == 32 * 64 * 2 + 32 * 4 and hdr.attn_layers == 3 and "headers" in hdr.source


def test_drafter_layers_join_the_full_attention_group():
    base = m.predict_pool(G, 5 * m.GiB, "bf16", 65_536, 7, True, mtp_in_pool=False)
    with_d = m.predict_pool(G, 5 * m.GiB, "bf16", 65_536, 7, True, mtp_in_pool=False, draft_attn_layers=5)
    assert base.group_size == 16 and with_d.group_size == 21 and with_d.gdn_groups == 3
    assert with_d.num_blocks == 5 * m.GiB // with_d.page_bytes // 21
    assert m.predict_pool(G, 5 * m.GiB, "bf16", 65_536, 7, True) == m.predict_pool(
        G, 5 * m.GiB, "bf16", 65_536, 7, True, draft_attn_layers=0)  # default unchanged


def make_model(d: Path, vocab=1024, hidden=256, head="int8", draft_ids=None):
    d.mkdir(parents=True, exist_ok=True)
    t = {"model.language_model.norm.weight": torch.zeros(hidden, dtype=torch.bfloat16),
         "mtp.fc.weight": torch.zeros(hidden, 2 * hidden, dtype=torch.bfloat16),
         "model.visual.blocks.0.weight": torch.zeros(64, 64, dtype=torch.bfloat16)}
    if head == "int8":
        t["lm_head.weight_packed"] = torch.zeros(vocab, hidden // 4, dtype=torch.int32)
        t["lm_head.weight_scale"] = torch.zeros(vocab, hidden // 128, dtype=torch.bfloat16)
        t["lm_head.weight_shape"] = torch.tensor([vocab, hidden])
    else:
        t["lm_head.weight"] = torch.zeros(vocab, hidden, dtype=torch.bfloat16)
    save_file(t, d / "model.safetensors")
    if draft_ids:
        (d / "draft_vocab.json").write_text(json.dumps({"ids": list(range(draft_ids)), "size": draft_ids}))
    return d


@pytest.mark.parametrize("head,per_row", [("int8", 256 + 2 * 2), ("bf16", 256 * 2)])
def test_draft_lm_head_bytes(tmp_path, head, per_row):
    d = make_model(tmp_path / head, head=head, draft_ids=100)
    n, why = m.draft_lm_head_bytes(d)
    assert n == 100 * per_row and "100 draft ids" in why
    assert m.draft_lm_head_bytes(d, "0") == (0, "ONECARD_DRAFT_VOCAB=0")
    assert m.draft_lm_head_bytes(d, "1")[0] == n
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"ids": list(range(10))}))
    assert m.draft_lm_head_bytes(d, str(other))[0] == 10 * per_row
    (d / "draft_vocab.json").unlink()
    assert m.draft_lm_head_bytes(d) == (0, "no draft_vocab.json")


def test_target_weights_skip_vision_and_mtp_unless_spec_mtp(tmp_path):
    d = make_model(tmp_path / "m", vocab=1024, hidden=256)
    body = 256 * 2 + 1024 * 64 * 4 + 1024 * 2 * 2 + 2 * 8
    mtp = 256 * 512 * 2
    assert m.target_weight_bytes(d, "mtp", m.QWEN38_27B) == (body + mtp, "checkpoint headers")
    assert m.target_weight_bytes(d, "dflash2", m.QWEN38_27B)[0] == body
    assert m.target_weight_bytes(tmp_path / "none", "off", m.QWEN38_27B)[1].startswith("27B layout")
    assert m.target_weight_bytes(tmp_path / "none", "off", m.ModelGeometry(num_layers=4, num_full_attention=1))[0] is None


def test_vram_budget_terms():
    b = m.vram_budget(5 * m.GiB, 14 * m.GiB, drafter_weights=3 * m.GiB, kvarn_stage=m.MiB)
    assert b["total"] == 22 * m.GiB + m.MiB + m.RESERVES and b["fits"] is False
    assert b["kv_max"] == m.CARD_24G - (b["total"] - 5 * m.GiB)
    assert m.vram_budget(4 * m.GiB, 14 * m.GiB)["fits"] is True
