"""Helpers for the DFlash2 CPU tests: the published config, small configs, float64 weights."""
from __future__ import annotations

# Architecture fields of the published z-lab Qwen3.8-27B DFlash2 drafter (docs/dflash2.md).
PUBLISHED = {
    "architectures": ["DFlash2DraftModel"],
    "dflash_config": {"block_size": 8, "conv_group_size": 16, "conv_kernel_size": 2,
                      "mask_token_id": 248070, "selector_rank": 256, "selector_top_k": 16,
                      "target_layer_ids": [5, 19, 33, 47, 61]},
    "head_dim": 128, "hidden_size": 5120, "intermediate_size": 17408, "num_attention_heads": 32,
    "num_hidden_layers": 5, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"}, "sliding_window": 2048,
    "use_sliding_window": True, "vocab_size": 248320,
}

# The target (Qwen3.8-27B text config, the fields the drafter is checked against).
TARGET_27B = {"num_hidden_layers": 64, "hidden_size": 5120, "vocab_size": 248320}


def small_config(**over) -> dict:
    """A tiny DFlash2 config (hidden 32, vocab 48) for float64 forward tests."""
    cfg = {
        "architectures": ["DFlash2DraftModel"],
        "dflash_config": {"block_size": 5, "conv_group_size": 8, "conv_kernel_size": 2,
                          "mask_token_id": 47, "selector_rank": 6, "selector_top_k": 4,
                          "target_layer_ids": [1, 3]},
        "head_dim": 16, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "sliding_window": 6, "use_sliding_window": True, "vocab_size": 48,
    }
    for k, v in over.items():
        if k == "dflash_config":
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    return cfg


def random_weights(cfg, seed: int = 0):
    """float64 weights of the right shapes (norms ~1, projections 1/sqrt(fan_in))."""
    import math

    import torch

    from onecard.dflash.drafter import tensor_shapes

    g = torch.Generator().manual_seed(seed)
    w = {}
    for name, shape in tensor_shapes(cfg).items():
        r = torch.randn(shape, generator=g, dtype=torch.float64)
        if name.endswith("norm.weight"):
            w[name] = 1 + 0.1 * r
        elif name.endswith("base_kernel"):
            w[name] = 0.3 * r + torch.tensor([1.0, 0.0], dtype=torch.float64)[None, :, None]
        else:
            w[name] = r / math.sqrt(shape[-1])
    return w
