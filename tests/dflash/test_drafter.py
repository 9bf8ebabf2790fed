"""The torch drafter forward: shapes, determinism, attention layout, the DFlash2 convolution."""
from __future__ import annotations

import json

import pytest
import torch
from dflash_helpers import random_weights, small_config

from onecard.dflash import drafter
from onecard.dflash.config import DrafterConfig, DrafterConfigError

D = torch.float64


def setup(cfg_json=None, seed=0, ctx=9):
    cfg = DrafterConfig.from_dict(cfg_json or small_config())
    w = random_weights(cfg, seed)
    g = torch.Generator().manual_seed(100 + seed)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=D)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=D)
    th = torch.randn(ctx, cfg.fc_in, generator=g, dtype=D)
    return cfg, w, embed, lm_head, th


def run(cfg, w, embed, lm_head, th, anchor=3, rows=None, start=None):
    return drafter.forward(cfg, w, target_hidden=th, block_ids=drafter.block_ids_for(cfg, anchor, rows),
                           block_start=th.shape[0] if start is None else start, embed=embed,
                           lm_head=lm_head)


def test_shapes_and_determinism():
    cfg, w, e, lm, th = setup()
    a = run(cfg, w, e, lm, th)
    b = run(cfg, w, e, lm, th)
    assert a.hidden.shape == (cfg.block_size, cfg.hidden_size)
    assert a.logits.shape == (cfg.block_size - 1, cfg.vocab_size)
    assert torch.equal(a.hidden, b.hidden) and torch.equal(a.logits, b.logits)
    assert a.hidden.dtype == D and torch.isfinite(a.logits).all()


def test_block_ids_layout():
    cfg = DrafterConfig.from_dict(small_config())
    assert drafter.block_ids_for(cfg, 9).tolist() == [9] + [cfg.mask_token_id] * (cfg.block_size - 1)


def test_block_is_non_causal():
    """Row 1 sees row 2: changing a later block token changes an earlier row's output."""
    cfg, w, e, lm, th = setup()
    ids = drafter.block_ids_for(cfg, 3)
    a = drafter.forward(cfg, w, target_hidden=th, block_ids=ids, block_start=9, embed=e, lm_head=lm)
    ids2 = ids.clone()
    ids2[-1] = 11
    b = drafter.forward(cfg, w, target_hidden=th, block_ids=ids2, block_start=9, embed=e, lm_head=lm)
    assert not torch.allclose(a.hidden[1], b.hidden[1])


def test_sliding_window_hides_old_context():
    """Context keys with q_pos - k_pos >= window are invisible to every row (all layers slide)."""
    cfg, w, e, lm, th = setup(ctx=20)          # window 6; rows at positions 20..24
    base = run(cfg, w, e, lm, th)
    old = th.clone()
    old[:20 - cfg.sliding_window + 1] += 5.0   # positions 0..14: 20 - 14 = 6 >= window
    assert torch.equal(run(cfg, w, e, lm, old).hidden, base.hidden)
    recent = th.clone()
    recent[-1] += 5.0
    assert not torch.allclose(run(cfg, w, e, lm, recent).hidden, base.hidden)


def test_full_attention_sees_all_context():
    cfg, w, e, lm, th = setup(small_config(use_sliding_window=False, sliding_window=None), ctx=20)
    base = run(cfg, w, e, lm, th)
    old = th.clone()
    old[0] += 5.0
    assert not torch.allclose(run(cfg, w, e, lm, old).hidden, base.hidden)


def test_context_features_enter_through_fc_and_hidden_norm():
    cfg, w, e, lm, th = setup()
    ctx = drafter.context_features(cfg, w, th)
    assert ctx.shape == (th.shape[0], cfg.hidden_size)
    # hidden_norm is an RMSNorm: scaling the captured features does not change the context.
    assert torch.allclose(drafter.context_features(cfg, w, 3.0 * th), ctx, atol=1e-9)


def test_anchor_conditions_all_rows():
    cfg, w, e, lm, th = setup()
    a, b = run(cfg, w, e, lm, th, anchor=3), run(cfg, w, e, lm, th, anchor=4)
    assert all(not torch.allclose(a.hidden[i], b.hidden[i]) for i in range(cfg.block_size))


def test_block_conv_is_block_local():
    x = torch.arange(12, dtype=D).view(3, 4)
    coeff = torch.ones(3, 2, 4, dtype=D)
    coeff[:, 1] = 0.5
    out = drafter.block_conv(x, coeff)
    assert torch.equal(out[0], x[0])                       # row 0: no predecessor (zero pad)
    assert torch.equal(out[1], x[1] + 0.5 * x[0])
    assert torch.equal(out[2], x[2] + 0.5 * x[1])


def test_identity_conv_reduces_to_dflash_v1():
    """With base kernel (1, 0) and no dynamic part, DFlash2's backbone is DFlash's."""
    cfg2, w, e, lm, th = setup()
    for k in list(w):
        if k.endswith("base_kernel"):
            w[k] = torch.zeros_like(w[k])
            w[k][:, 0] = 1.0
        elif "kernel_projection" in k:
            w[k] = torch.zeros_like(w[k])
    v1 = small_config(architectures=["DFlashDraftModel"])
    keep = ("block_size", "mask_token_id", "target_layer_ids")
    v1["dflash_config"] = {k: v1["dflash_config"][k] for k in keep}
    cfg1 = DrafterConfig.from_dict(v1)
    a = run(cfg2, w, e, lm, th)
    b = run(cfg1, w, e, lm, th)
    assert torch.allclose(a.hidden, b.hidden, atol=1e-12)


def test_dynamic_kernel_is_shared_per_group():
    cfg, w, e, lm, th = setup()
    h = torch.randn(cfg.block_size, cfg.hidden_size, dtype=D)
    c_in, c_out = drafter.conv_coefficients(w, "layers.0.attention_conv", h, cfg)
    base = w["layers.0.attention_conv.base_kernel"]
    dyn_in = c_in - base[0]
    gs = cfg.conv_group_size
    for g in range(cfg.conv_groups):
        grp = dyn_in[..., g * gs:(g + 1) * gs]
        assert torch.allclose(grp, grp[..., :1].expand_as(grp))
    assert c_in.shape == c_out.shape == (cfg.block_size, 2, cfg.hidden_size)


def test_shorter_block_and_bad_inputs():
    cfg, w, e, lm, th = setup()
    p = run(cfg, w, e, lm, th, rows=3)
    assert p.logits.shape == (2, cfg.vocab_size)
    with pytest.raises(ValueError, match="valid: 2.."):
        run(cfg, w, e, lm, th, rows=cfg.block_size + 1)
    with pytest.raises(ValueError, match="precede"):
        run(cfg, w, e, lm, th, start=3)
    with pytest.raises(ValueError, match="target_hidden"):
        run(cfg, w, e, lm, th[:, :-1])


def test_load_weights_checks_names_and_shapes(tmp_path):
    from safetensors.torch import save_file

    cfg = DrafterConfig.from_dict(small_config())
    w = {k: v.float() for k, v in random_weights(cfg).items()}
    (tmp_path / "config.json").write_text(json.dumps(small_config()))
    save_file({"model." + k: v for k, v in w.items()}, str(tmp_path / "model.safetensors"))
    got = drafter.load_weights(tmp_path, cfg, dtype=D)
    assert set(got) == set(w) and got["fc.weight"].dtype == D
    bad = dict(w)
    bad["norm.weight"] = torch.zeros(3)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(DrafterConfigError, match="norm.weight has shape"):
        drafter.load_weights(tmp_path, cfg)
    extra = dict(w)
    extra["layers.0.mystery.weight"] = torch.zeros(3)
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(DrafterConfigError, match="unknown tensor layers.0.mystery"):
        drafter.load_weights(tmp_path, cfg)
    del w["candidate_selector.successor_codebook"]
    save_file(w, str(tmp_path / "model.safetensors"))
    with pytest.raises(DrafterConfigError, match="missing"):
        drafter.load_weights(tmp_path, cfg)
