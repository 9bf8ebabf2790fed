"""scripts/kvarn_fakequant_ppl.py what-if read rules: a recent fp16 window of W tiles (+winW),
S fp16 sink tiles (+sinkS), and their 27B memory cost (fp16_window_cost). CPU, no model."""

from __future__ import annotations

import importlib.util
import math
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kvarn_fakequant_ppl", REPO / "scripts" / "kvarn_fakequant_ppl.py")
F = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(F)


def test_window1_mask_is_the_own_tile_rule():
    for lq, lk, tile in ((300, 300, 128), (1, 257, 128), (7, 40, 16)):
        qpos = torch.arange(lk - lq, lk)
        same = (qpos[:, None] // tile) == (torch.arange(lk)[None, :] // tile)
        assert torch.equal(F.fp16_window_mask(lq, lk, tile, 1), same)


def test_window_mask_covers_own_and_previous_tiles():
    m = F.fp16_window_mask(20, 20, 4, 3)
    row = m[13]  # position 13: tile 3 -> tiles 1, 2, 3 fp16
    assert row[4:16].all() and not row[:4].any() and not row[16:].any()
    assert m[2, :4].all() and not m[2, 4:].any()  # tile 0: only itself (no negative tiles)
    # the last query of a decode step (lq = 1) sees the same row as in a full prefill
    assert torch.equal(F.fp16_window_mask(1, 20, 4, 3)[0], m[19])


def test_parse_config_suffixes():
    q = F.parse_config("kvarn_k4v2_g128+win3+sink2")
    assert (q.name, q.only, q.self_tile, q.window, q.sinks) == ("kvarn_k4v2_g128", None, "fp16", 3, 2)
    q = F.parse_config("kvarn_k4v2_g128:v+selffp16+sink2")
    assert (q.only, q.self_tile, q.window, q.sinks) == ("v", "fp16", 1, 2)
    q = F.parse_config("kvarn_k4v4_g128")
    assert (q.self_tile, q.window, q.sinks) == ("quant", 1, 1)
    for bad in ("int8+win2", "kvarn_k4v2_g128+win0", "kvarn_k4v2_g128+sink", "kvarn_k4v2_g128+foo"):
        with pytest.raises(SystemExit):
            F.parse_config(bad)


def _kv(L=3 * 64 + 5, H=2, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, D, generator=g), torch.randn(L, H, D, generator=g)


def test_sinks_keep_the_first_tiles_fp16():
    k, v = _kv()
    kf, vf, kq1, vq1 = F._fake_kvarn(k, v, F.Quant("kvarn_k4v2_g64"))
    _, _, kq2, vq2 = F._fake_kvarn(k, v, F.Quant("kvarn_k4v2_g64", sinks=2))
    assert torch.equal(kq2[:128], kf[:128]) and torch.equal(vq2[:128], vf[:128])
    assert not torch.allclose(vq1[64:128], vf[64:128], atol=1e-3)  # sinks=1: tile 1 quantized
    assert torch.equal(kq1[128:], kq2[128:]) and torch.equal(vq1[128:], vq2[128:])
    assert torch.equal(kq1[:64], kf[:64]) and torch.equal(kq1[192:], kf[192:])  # sink, partial tile


def _brute(q, kf, vf, kq, vq, tile, window, sinks, scale):
    """float64: query i (position p) reads key j <= p fp16 when j's tile is in
    (T(p) - window, T(p)] or < sinks, else quantized."""
    L, H, D = kf.shape
    out = torch.zeros(L, H, D, dtype=torch.float64)
    for p in range(L):
        kt = torch.arange(p + 1) // tile  # keys 0..p (causal)
        fp = ((kt <= p // tile) & (kt > p // tile - window)) | (kt < sinks)
        k = torch.where(fp[:, None, None], kf[:p + 1], kq[:p + 1]).double()
        v = torch.where(fp[:, None, None], vf[:p + 1], vq[:p + 1]).double()
        s = torch.einsum("hd,jhd->hj", q[p].double(), k) * scale
        out[p] = torch.einsum("hj,jhd->hd", torch.softmax(s, -1), v)
    return out


@pytest.mark.parametrize("window,sinks", [(1, 1), (2, 1), (3, 2)])
def test_attention_hook_follows_the_window_rule(window, sinks):
    k, v = _kv()
    L, H, D = k.shape
    q = torch.randn(L, H, D, generator=torch.Generator().manual_seed(1))
    cfg = F.Quant("kvarn_k4v2_g64", self_tile="fp16", window=window, sinks=sinks)
    F.STATE["q"] = cfg
    mask = torch.full((L, L), -math.inf).triu(1)[None, None]
    scale = D ** -0.5
    got, _ = F.attention(types.SimpleNamespace(num_key_value_groups=1), q.transpose(0, 1)[None],
                         k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale)
    kf, vf, kq, vq = F._fake_kvarn(k, v, cfg)
    ref = _brute(q, kf, vf, kq, vq, 64, window, sinks, scale)
    assert float((got[0].double() - ref).abs().max()) < 1e-4
    F.STATE["q"] = F.Quant("none")


def test_window_cost_on_the_27b():
    from onecard import memory as M
    base = F.fp16_window_cost(1, 1)
    assert base["extra_bytes_per_seq"] == 0 and base["extra_outside_pin"] == 0
    assert base["pool_tokens"] == base["pool_tokens_base"] == M.predict_pool(
        M.QWEN38_27B, M.LONG_KV_MEM, "kvarn_k4v2_g128", 245_760, 3, True).pool_tokens
    tile_bytes = 128 * 16 * 4 * 256 * 2 * 2  # tokens x layers x kv heads x head_dim x K,V x fp16
    c = F.fp16_window_cost(4, 2)
    assert c["extra_tiles_per_seq"] == 4 and c["extra_bytes_per_seq"] == 4 * tile_bytes
    assert c["extra_outside_pin"] == 4 * tile_bytes * 17 // 16 * 2  # + MTP layer, MAX_SEQS 2
    assert c["pool_tokens"] <= base["pool_tokens"] and c["meets_goal"] == (c["pool_tokens"] >= 268_169)
    with pytest.raises(ValueError):
        F.fp16_window_cost(0, 1)


def test_range_what_ifs_shrink_and_pick_the_least_error(monkeypatch):
    from onecard.kvarn import reference as R

    monkeypatch.setattr(R, "quantize_tile", R.quantize_tile)  # restored after the test
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(64, 2, 64, generator=g), torch.randn(64, 2, 64, generator=g)
    pre = R.Preset("k4v2_g64_minmax", 4, 2, 64)  # v_clip 1.0: the min..max writer
    stock = R.quantize_tile(k, v, pre)

    def v_err(qt):
        return float(((R.dequant_tile(qt)[1] - v.double()) ** 2).sum())

    F.shrink_ranges(v_alpha=0.8)
    shrunk = R.quantize_tile(k, v, pre)
    assert torch.equal(shrunk.k_codes, stock.k_codes) and torch.equal(shrunk.k_scale, stock.k_scale)
    assert torch.allclose(shrunk.v_scale.float(), stock.v_scale.float() * 0.8, rtol=2e-3)
    F.shrink_ranges(v_alpha="mse")  # wraps the shrunk one; V is recomputed from the raw rows
    best = R.quantize_tile(k, v, pre)
    # the per-token search's grid holds alpha = 1 and 0.8: never worse than either
    assert v_err(best) <= min(v_err(stock), v_err(shrunk)) * 1.001
    with pytest.raises(SystemExit, match="valid: 0 < ALPHA <= 1, or mse"):
        F.range_arg("--v-range", "1.5")
    assert F.range_arg("--k-range", "mse") == "mse" and F.range_arg("--v-range", "0.5") == 0.5
