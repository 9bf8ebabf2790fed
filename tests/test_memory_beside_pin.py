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
    # the weights and DFlash's bf16 K/V copy (5 layers x K and V rows of 8 x 128 x 5120: 100 MiB)
    assert m.fused_kv_copy_bytes(5, 8, 128, 5120) == 100 * m.MiB
    assert est.weight_bytes == m.DFLASH2_27B_PARAMS * 2 + 100 * m.MiB and est.attn_layers == 5
    assert "estimate" in est.source
    (d / "config.json").write_text(json.dumps(small_config(num_hidden_layers=3)))
    cfg = DrafterConfig.load(d)
    copy = m.fused_kv_copy_bytes(3, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size)
    shp = m.dflash_drafter_vram(d)
    assert shp.weight_bytes == m.drafter_param_count(cfg) * 2 + copy and shp.attn_layers == 3
    assert "by config.json" in shp.source and "+ 0.00 bf16 K/V copy" not in shp.source
    save_file({"fc.weight": torch.zeros(32, 64, dtype=torch.bfloat16), "norm.weight": torch.zeros(32)}, d / "model.safetensors")
    hdr = m.dflash_drafter_vram(d)
    assert hdr.weight_bytes == 32 * 64 * 2 + 32 * 4 + copy and hdr.attn_layers == 3 and "headers" in hdr.source


def test_drafter_of_another_shape_gets_its_own_bucket():
    """vLLM 0.27.1 merges attention layers only of one shape (FullAttentionSpec.merge), so the
    published drafter (8 KV heads x 128) is a bucket of its own beside the target's 16 layers
    (4 x 256) and the 48 GDN layers; the group size drops to 5 ("Add 4 padding layers")."""
    base = m.predict_pool(G, 5 * m.GiB, "bf16", 65_536, 7, True, mtp_in_pool=False)
    with_d = m.predict_pool(G, 5 * m.GiB, "bf16", 65_536, 7, True, mtp_in_pool=False, draft_attn_layers=5)
    assert base.group_size == 16 and base.attn_groups == ((1, base.block_size),)
    assert with_d.group_size == 5 and with_d.gdn_groups == 10
    assert with_d.attn_groups == ((4, with_d.block_size), (1, with_d.block_size))
    # bf16: 8 x 128 and 4 x 256 take the same bytes per token, so the pages are equal
    assert with_d.num_blocks == 5 * m.GiB // with_d.page_bytes // 5
    assert m.predict_pool(G, 5 * m.GiB, "bf16", 65_536, 7, True) == m.predict_pool(
        G, 5 * m.GiB, "bf16", 65_536, 7, True, draft_attn_layers=0)  # default unchanged
    # a drafter of the target's own shape joins its bucket (as the MTP layer does)
    same = m.predict_pool(G, 5 * m.GiB, "bf16", 65_536, 7, True, mtp_in_pool=False, draft_attn_layers=5,
                          draft_kv_heads=G.num_kv_heads, draft_head_dim=G.head_dim)
    assert same.group_size == 21 and same.gdn_groups == 3 and same.attn_groups == ((1, same.block_size),)


# H200, 2026-12-03 (docs/measurements.md, eighth session): 27B geometry + the geometry drafter,
# CTX=long (int8 per-token-head KV), the 3090 pin 5,309,988,864 B, prefix caching on.
# (k, max_len, vLLM's "GPU KV cache size", block)
H200_DFLASH2_POOLS = [(7, 65_536, 69_090, 1616), (15, 33_792, 37_046, 1696)]


@pytest.mark.parametrize("k,max_len,pool,block", H200_DFLASH2_POOLS)
def test_dflash2_pool_matches_the_h200(k, max_len, pool, block):
    vram = m.DrafterVRAM(0, m.DFLASH2_27B_LAYERS, "test")
    p = m.predict_pool(G, 5_309_988_864, "int8_per_token_head", max_len, k, True, **vram.pool_kw())
    assert (p.pool_tokens, p.block_size) == (pool, block)
    # int8: the drafter's page (8 x (2 x 128 + 8) B per token) is the larger one; the target's
    # is padded up to it, so both buckets keep one block size
    assert p.page_bytes == block * 8 * (2 * 128 + 8)
    assert p.attn_groups == ((4, block), (1, block))


def test_dflash2_longest_sequence_is_vllms_estimate():
    """vLLM refused MAX_LEN 77,568 for k=7 (the old model's cap) and named 71,104 as the longest
    that fits ("estimated maximum model length"): the preflight now caps there."""
    vram = m.DrafterVRAM(0, m.DFLASH2_27B_LAYERS, "test")
    p = m.predict_pool(G, 5_309_988_864, "int8_per_token_head", 77_568, 7, True, **vram.pool_kw())
    assert p.one_sequence_tokens() == 71_104 < 77_568


def test_drafter_with_a_smaller_page_gets_a_larger_block():
    """The tiny pair (target 2 KV heads x 256, drafter 2 x 64, bf16): the drafter's page is a
    quarter of the target's, so vLLM gives its bucket 4x the block (unify_kv_cache_spec_page_size).
    H200 (job 70, 3 GiB, max-model-len 2048): 193,536 tokens at k=7, 112,320 at k=15."""
    tiny = m.ModelGeometry(num_layers=8, num_full_attention=2, num_kv_heads=2, head_dim=256,
                           linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=128,
                           linear_value_head_dim=128, conv_kernel=4, mtp_layers=1, dtype_bytes=2,
                           ssm_state_bytes=4, num_attention_heads=8)
    vram = m.DrafterVRAM(0, 2, "test", kv_heads=2, head_dim=64)
    for k, pool, block in [(7, 193_536, 208), (15, 112_320, 224)]:
        p = m.predict_pool(tiny, 3 * m.GiB, "bf16", 2048, k, True, **vram.pool_kw())
        assert (p.pool_tokens, p.block_size) == (pool, block)
        assert p.attn_groups == ((1, block), (1, 4 * block))
        assert p.one_sequence_tokens() >= 2048


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
