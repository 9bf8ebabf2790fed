"""The VRAM model against vLLM 0.27.1's sizing rules and the public 3090 figures."""
import json
import struct

import pytest

from onecard import memory as m

G = m.QWEN38_27B
P = m.PUBLIC_3090


def rel(a, b):
    return abs(a - b) / b


def test_public_long_int8_pool_within_2pct():
    p = m.predict_pool(P, m.LONG_KV_MEM, "int8_per_token_head", 131_072, 3, True)
    assert rel(p.pool_tokens, 136_429) < 0.02


def test_public_int4_256k_pool_within_2pct():
    p = m.predict_pool(P, m.INT4_KV_MEM, "int4_per_token_head", 256_000, 3, True)
    assert rel(p.pool_tokens, 266_520) < 0.02


def test_public_fast_range():
    assert rel(m.predict_pool(P, m.FAST_KV_MEM, "bf16", 65_536, 4, True).pool_tokens, 72_992) < 0.02
    assert rel(m.predict_pool(P, m.FAST_DFLASH_KV_MEM, "bf16", 65_536, 7, True).pool_tokens, 68_605) < 0.02


def test_bf16_tokens_per_gib():
    assert rel(m.tokens_per_gib(P, "bf16", 65_536, 4, True), 13_700) < 0.02


def test_pins_are_plausible_for_24gb():
    for pin in (m.LONG_KV_MEM, m.INT4_KV_MEM, m.FAST_KV_MEM):
        assert 4 * m.GiB < pin < 7 * m.GiB and pin % m.MiB == 0


def test_attention_bytes_per_token_layouts():
    # bf16: 2 (K,V) * 4 heads * 256 * 2 bytes
    assert m.attn_bytes_per_token(G, "bf16") == 4096
    # int8: 2*4*256*1 + fp32 K/V scale per token-head (2*4*4)
    assert m.attn_bytes_per_token(G, "int8_per_token_head") == 2048 + 32
    # int4: head_dim//2 bytes per K and V + the same scales
    assert m.attn_bytes_per_token(G, "int4_per_token_head") == 1024 + 32


def test_gdn_state_bytes():
    conv_dim = 128 * 16 * 2 + 128 * 48
    assert m.gdn_state_bytes(G, 0) == conv_dim * 3 * 2 + 48 * 128 * 128 * 4
    assert m.gdn_state_bytes(G, 4) - m.gdn_state_bytes(G, 0) == conv_dim * 4 * 2
    assert m.gdn_state_bytes(P, 0) == conv_dim * 3 * 2 + 48 * 128 * 128 * 2


def test_block_size_unification_matches_vllm_rule():
    # 16 * cdiv(gdn_page, 16 * attn_1_token), and the attention page covers the GDN page
    for kv in ("bf16", "int8_per_token_head", "int4_per_token_head"):
        for k in (0, 3, 7):
            b = m.attention_block_size(G, kv, k)
            assert b % 16 == 0
            page = b * m.attn_bytes_per_token(G, kv)
            assert page >= m.gdn_state_bytes(G, k) > page - 16 * m.attn_bytes_per_token(G, kv)


def test_grouping_and_logged_formula():
    p = m.predict_pool(G, 5 * m.GiB, "bf16", 65_536, 0, False)
    assert p.group_size == 16 and p.gdn_groups == 3 and p.state_slots_per_seq == 3
    assert p.num_blocks == 5 * m.GiB // p.page_bytes // 16
    assert p.pool_tokens == int(p.num_blocks / (m.cdiv(65_536, p.block_size) + 3) * 65_536)
    q = m.predict_pool(G, 5 * m.GiB, "bf16", 65_536, 3, True)  # MTP layer joins: 17 attention layers
    assert q.group_size == 17 and q.state_slots_per_seq == 3 * (2 + 3)


def test_kv_mem_for_pool_is_inverse():
    for pool in (5_000, 100_000, 250_000):
        mem = m.kv_mem_for_pool(G, pool, "int8_per_token_head", 131_072, 3, True)
        assert m.predict_pool(G, mem, "int8_per_token_head", 131_072, 3, True).pool_tokens >= pool
        assert m.predict_pool(G, mem - 64 * m.MiB, "int8_per_token_head", 131_072, 3, True).pool_tokens < pool


def test_max_concurrency_and_kvarn_estimate():
    assert m.max_concurrency(G, 20 * m.GiB, "bf16", 8192) >= 10
    assert m.attn_bytes_per_token(G, "kvarn") < m.attn_bytes_per_token(G, "int4_per_token_head")


def test_unknown_dtype_and_bad_args():
    with pytest.raises(ValueError, match="valid: bf16"):
        m.attn_bytes_per_token(G, "fp4")
    with pytest.raises(ValueError):
        m.predict_pool(G, m.GiB, "bf16", 0)


def test_geometry_from_config_and_nested(tmp_path):
    text = {"num_hidden_layers": 8, "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
            "num_key_value_heads": 2, "head_dim": 256, "hidden_size": 256, "num_attention_heads": 8,
            "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mtp_num_hidden_layers": 1,
            "dtype": "bfloat16", "mamba_ssm_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": text}))
    g = m.ModelGeometry.from_model_dir(tmp_path)
    assert (g.num_layers, g.num_full_attention, g.num_gdn, g.num_kv_heads, g.ssm_state_bytes) == (8, 2, 6, 2, 4)
    p = m.predict_pool(g, m.GiB, "bf16", 4096, 2, True)  # 3 attention (with MTP) vs 6 GDN
    assert p.group_size == 3 and p.gdn_groups == 2
    with pytest.raises(ValueError, match="missing"):
        m.ModelGeometry.from_config({"num_hidden_layers": 4})
    with pytest.raises(ValueError, match="no config.json"):
        m.ModelGeometry.from_model_dir(tmp_path / "nope")


def _write_st(path, tensors):
    header, off = {}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * off)


def test_weight_bytes_from_headers(tmp_path):
    _write_st(tmp_path / "a.safetensors", {"x": ("BF16", [4, 8], 64), "mtp.y": ("F32", [2], 8)})
    _write_st(tmp_path / "b.safetensors", {"z": ("I8", [10], 10)})
    assert m.weight_bytes(tmp_path) == 82
    assert m.weight_bytes(tmp_path, skip_prefixes=("mtp.",)) == 74
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        m.weight_bytes(tmp_path / "empty")


def test_weight_bytes_with_safetensors_library(tmp_path):
    np = pytest.importorskip("numpy")
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((3, 5), dtype=np.float16)}, str(tmp_path / "model.safetensors"))
    assert m.weight_bytes(tmp_path) == 30


def test_bad_safetensors(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"abc")
    with pytest.raises(ValueError, match="too short"):
        m.weight_bytes(tmp_path)


def test_kv_mem_from_util():
    assert m.kv_mem_from_util(24 * m.GiB, 0.9, 15 * m.GiB) > 0
    assert m.kv_mem_from_util(24 * m.GiB, 0.5, 15 * m.GiB) == 0


# ------------------------------------------------------------------ tensor parallel (issue 10)

def test_tp_sizes_and_rank_geometry():
    g = m.QWEN38_27B
    assert m.tp_sizes_for(g) == [1, 2, 4]  # 4 KV heads: 8 would replicate KV heads; refused
    assert m.tp_check(g, 2) is None and "valid for this model: TP=1|2|4" in m.tp_check(g, 8)
    r = m.rank_geometry(g, 2)
    assert (r.num_kv_heads, r.linear_num_key_heads, r.linear_num_value_heads, r.num_attention_heads) == (2, 8, 24, 12)
    with pytest.raises(ValueError, match="valid for this model"):
        m.rank_geometry(g, 8)


@pytest.mark.parametrize("kv,max_len,k", [("bf16", 65_536, 4), ("int8_per_token_head", 131_072, 3)])
def test_tp2_pool_halves_pages_keeps_block(kv, max_len, k):
    """vLLM splits KV heads and GDN heads by TP: each rank's page is half, the block size stays,
    and the same per-GPU bytes hold (about) twice the tokens."""
    g = m.QWEN38_27B
    one = m.predict_pool(g, 5 * m.GiB, kv, max_len, k, True)
    two = m.predict_pool(m.rank_geometry(g, 2), 5 * m.GiB, kv, max_len, k, True)
    assert two.block_size == one.block_size and two.page_bytes * 2 == one.page_bytes
    assert 1.99 < two.pool_tokens / one.pool_tokens < 2.02
    assert m.gdn_state_bytes(m.rank_geometry(g, 2), k) * 2 == m.gdn_state_bytes(g, k)


def test_tp_weight_split_27b_layout():
    t = m.layout_27b_tensors()
    w1, w2 = m.tp_weight_bytes(t, 1), m.tp_weight_bytes(t, 2)
    assert w1.total == w2.total == w1.per_gpu
    assert w2.per_gpu == m.cdiv(w2.sharded, 2) + m.cdiv(w2.vocab, 2) + w2.replicated
    assert 13 * m.GiB < w1.total < 16 * m.GiB  # W4A16 body + int8 embed/lm_head/MTP
    assert w1.replicated < 2 * m.MiB  # only RMSNorm weights (+ weight_shape) are copied to every GPU
    assert m.tp_weight_bytes(m.layout_27b_tensors(2), 1).total - w1.total > 2 * m.GiB  # bf16 heads
    assert not any(n.startswith("model.visual.") for n, _ in t if m._tp_class(n) != "skip")


def test_predict_tp_from_util_and_from_logged_kv():
    g = m.QWEN38_27B
    w = m.tp_weight_bytes(m.layout_27b_tensors(), 2)
    p = m.predict_tp(g, 2, w, "bf16", 65_536, 4, True, gpu_util=0.92)
    assert p.kv_bytes_per_gpu == m.kv_mem_from_util(m.CARD_24G, 0.92, w.per_gpu)
    d = p.as_dict()
    assert d["kv_bytes_total"] == 2 * d["kv_bytes_per_gpu"] and d["pool_tokens"] == p.pool.pool_tokens
    q = m.predict_tp(g, 2, w, "bf16", 65_536, 4, True, kv_bytes_per_gpu=5 * m.GiB)
    assert q.pool.pool_tokens == m.predict_pool(m.rank_geometry(g, 2), 5 * m.GiB, "bf16", 65_536, 4, True).pool_tokens


def test_from_config_reads_attention_heads():
    cfg = {"text_config": {"num_hidden_layers": 8, "num_key_value_heads": 2, "hidden_size": 256,
                           "num_attention_heads": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
                           "linear_key_head_dim": 128, "linear_value_head_dim": 128}}
    g = m.ModelGeometry.from_config(cfg)
    assert g.num_attention_heads == 8 and m.tp_sizes_for(g) == [1, 2]
