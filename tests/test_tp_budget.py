"""The per-GPU budget at TP>1 (onecard.preflight._tp_vram): each GPU's KV pool is what
GPU_UTIL x card leaves after the terms the TP=1 budget counts beside its pin, each at one GPU's
share as vLLM 0.27.1 splits it: the target's weights as loaded (mtp.* only with SPEC=mtp), the
DFlash2 drafter (linear layers split, fc / convs / selector / norms on every GPU, the K/V copy of
the rank's heads; DRAFT_QUANT=fp8 on each shard), DFLASH_RING=1's rings (the rank's KV heads),
SPEC=mtp's draft_lm_head (vocab rows / TP), KVarN's stage, GDN_DEFER=1's scratch, the reserves.

Before this, CTX=long SPEC=dflash2 TP=2 counted the target's MTP weights and no drafter: 12.33
GiB of KV per GPU (406,585 tokens) where 10.38 GiB (342,360 tokens) is what the GPUs have."""
import json
from math import prod
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from onecard import memory as m
from onecard import plan as P
from onecard.dflash import ring

G = m.QWEN38_27B
TP_ENV = {"TP": "2", "CUDA_VISIBLE_DEVICES": "0,1"}
UTIL_BYTES = int(m.CARD_24G * 0.92)  # GPU_UTIL 0.92 (the default) of the 24 GiB card predict_tp assumes


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    from onecard.profiles import pretend_installed

    with pretend_installed(tmp_path_factory.mktemp("fakevllm")) as d:
        yield d


@pytest.fixture
def plan_tp(features, drafter_27b, tmp_path):
    """A CTX=long TP=2 plan of the 27B layout (no checkpoint on disk) with the published drafter."""
    def make(**env):
        base = {"CTX": "long", "MODEL": str(tmp_path / "models" / "qwen38-27b"), "DRAFT": str(drafter_27b), **TP_ENV}
        return P.make_plan({**base, **env}, tmp_path, "python3")
    return make


def _mtp_share(tp: int) -> int:
    """One GPU's share of the 27B layout's mtp.* tensors."""
    return m.tp_weight_bytes([(n, b) for n, b in m.layout_27b_tensors() if n.startswith("mtp.")], tp).per_gpu


def _drafter_27b_per_gpu(tp: int) -> int:
    """The published drafter at TP by hand from its shapes (bf16): what vLLM splits / N, what it
    replicates whole, the K/V copy of the rank's heads."""
    h, L, q, kv, inter, fc_in, vocab, rank, groups = 5120, 5, 32 * 128, 8 * 128, 17408, 5 * 5120, 248_320, 256, 5120 // 16
    split = L * (q * h + 2 * kv * h + h * q + 3 * inter * h)                   # qkv, o_proj, gate/up/down
    whole = (h * fc_in + 2 * h                                                 # fc, hidden_norm, norm
             + L * (2 * h + 2 * 128 + 2 * (2 * 2 * h + 2 * 2 * groups * h))   # norms, 2 convs a layer
             + rank * h + 2 * vocab * rank)                                    # selector
    copy = L * 2 * (8 // tp) * 128 * h * 2
    return split * 2 // tp + whole * 2 + copy


def test_drafter_per_gpu_share_27b():
    assert m.dflash_drafter_vram(None).weight_bytes == m.DFLASH2_27B_PARAMS * 2 + 100 * m.MiB  # TP=1 unchanged
    assert m.drafter_param_count(m.published_27b_drafter_config()) == m.DFLASH2_27B_PARAMS
    for tp in (1, 2, 4):
        assert m.dflash_drafter_vram(None, tp=tp).weight_bytes == _drafter_27b_per_gpu(tp), tp
    two = m.dflash_drafter_vram(None, tp=2)
    # fc (0.24 GiB), the selector's codebooks (0.24 GiB) and the convs' projections (0.12 GiB) are
    # whole on each GPU: 0.30 GiB more than half the drafter
    assert 2.14 * m.GiB < two.weight_bytes < 2.15 * m.GiB
    assert 0.30 * m.GiB < two.weight_bytes - m.dflash_drafter_vram(None).weight_bytes // 2 < 0.31 * m.GiB
    assert "per GPU at TP=2" in two.source


def test_drafter_rank_tensor_rules():
    t = m.drafter_rank_tensor
    assert t("model.layers.0.self_attn.q_proj.weight", (4096, 5120), 100, 2, 8) == (50, (2048, 5120))
    assert t("layers.0.self_attn.k_proj.weight", (1024, 5120), 100, 2, 8) == (50, (512, 5120))
    assert t("layers.0.self_attn.k_proj.weight", (128, 5120), 100, 2, 1) == (100, (128, 5120))  # 1 head: replicated
    assert t("layers.0.self_attn.v_proj.weight", (1024, 5120), 100, 2, None) == (100, (1024, 5120))  # unknown: whole
    assert t("layers.0.self_attn.o_proj.weight", (5120, 4096), 100, 2, 8) == (50, (5120, 2048))
    assert t("layers.1.mlp.down_proj.weight", (5120, 17408), 100, 2, 8) == (50, (5120, 8704))
    assert t("layers.1.mlp.gate_proj.weight", (17408, 5120), 100, 2, 8) == (50, (8704, 5120))
    assert t("lm_head.weight", (1000, 64), 100, 4, 8) == (25, (250, 64))
    for whole in ("fc.weight", "norm.weight", "hidden_norm.weight", "layers.0.input_layernorm.weight",
                  "layers.0.self_attn.k_norm.weight", "layers.0.attention_conv.base_kernel",
                  "layers.0.mlp_conv.kernel_projection.weight", "candidate_selector.hidden_projection.weight",
                  "candidate_selector.successor_codebook", "d2t", "something.new"):
        assert t(whole, (10, 20), 400, 2, 8) == (400, (10, 20)), whole
    assert t("layers.0.self_attn.q_proj.weight", (4096, 5120), 100, 1, 8) == (100, (4096, 5120))


def test_drafter_headers_and_config_agree_at_tp(tmp_path):
    """The headers path splits the drafter's stored tensors as the config path splits its shapes."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "dflash"))
    from dflash_helpers import small_config

    from onecard.dflash.config import DrafterConfig, tensor_shapes

    d = tmp_path / "dr"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(small_config()))
    by_cfg = [m.dflash_drafter_vram(d, tp=tp, fp8=fp8).weight_bytes for tp in (1, 2) for fp8 in (False, True)]
    shapes = tensor_shapes(DrafterConfig.load(d))
    save_file({"model." + n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}, d / "model.safetensors")
    by_hdr = [m.dflash_drafter_vram(d, tp=tp, fp8=fp8).weight_bytes for tp in (1, 2) for fp8 in (False, True)]
    assert by_hdr == by_cfg
    assert by_cfg[2] < by_cfg[0] and by_cfg[3] < by_cfg[2]
    assert sum(prod(s) for s in shapes.values()) * 2 < by_cfg[0]  # + the K/V copy


def test_spec_off_mtp_dflash2_at_tp2(plan_tp):
    """KV per GPU = card x util - (what the GPU holds beside its pool), term by term."""
    pools = {}
    for spec in ("off", "mtp", "dflash2"):
        plan = plan_tp(SPEC=spec)
        p, v = plan.prediction, plan.prediction["vram"]
        assert v["per_gpu"] and v["kv_pin"] == p["kv_bytes_per_gpu"] and v["fits"]
        beside = v["total"] - v["kv_pin"]
        assert beside == (v["weights"] + v["drafter_weights"] + v["draft_lm_head"] + v["kvarn_stage"]
                          + v["dflash2_ring_bytes"] + v["dflash2_lane_bytes"] + v["gdn_defer_scratch"] + v["reserves"])
        assert p["kv_bytes_per_gpu"] == UTIL_BYTES - beside
        assert v["weights"] == p["weights_per_gpu"] and v["reserves"] == m.RESERVES
        assert any(n.startswith(f"TP=2: per GPU, GPU_UTIL 0.92 x 24 GiB = 22.08 GiB: target weights") for n in plan.notes)
        pools[spec] = plan
    off, mtp, dfl = (pools[s].prediction for s in ("off", "mtp", "dflash2"))
    # SPEC=off / mtp: the target alone (no draft_vocab.json for the layout), the same as kv_mem_from_util
    assert off["kv_bytes_per_gpu"] == m.kv_mem_from_util(m.CARD_24G, 0.92, off["weights_per_gpu"])
    assert mtp["kv_bytes_per_gpu"] == m.kv_mem_from_util(m.CARD_24G, 0.92, mtp["weights_per_gpu"])
    assert off["vram"]["drafter_weights"] == mtp["vram"]["drafter_weights"] == 0
    # SPEC=dflash2: the drafter's share (config.json of the published shape) and no MTP weights
    assert dfl["vram"]["drafter_weights"] == _drafter_27b_per_gpu(2)
    assert off["kv_bytes_per_gpu"] - dfl["kv_bytes_per_gpu"] == _drafter_27b_per_gpu(2)  # GDN_DEFER=0 at TP>1
    assert 1.9 * m.GiB < mtp["kv_bytes_per_gpu"] - dfl["kv_bytes_per_gpu"] < 2.0 * m.GiB
    # the figures (27B layout, 24 GiB cards): CTX=long SPEC=dflash2 TP=2 was 12.33 GiB / 406,585 tokens
    assert (dfl["kv_bytes_per_gpu"], dfl["pool_tokens"]) == (11_150_596_689, 342_360)
    assert (mtp["kv_bytes_per_gpu"], mtp["pool_tokens"]) == (13_240_238_161, 631_285)


def test_mtp_weights_only_with_spec_mtp(plan_tp):
    w = {s: plan_tp(SPEC=s).prediction["weights_per_gpu"] for s in ("off", "mtp", "dflash2")}
    assert w["off"] == w["dflash2"] and w["mtp"] - w["off"] == _mtp_share(2) > 0.19 * m.GiB
    # the same rule as one GPU's target_weights
    t = m.layout_27b_tensors()
    for spec in ("off", "mtp", "dflash2"):
        assert m.target_tp_weights(t, 1, "", spec).per_gpu == m.target_weights(t, "", spec)[0]
    # the MTP module's pre-fc norms are RMSNorms: on every GPU
    assert m._tp_class("mtp.pre_fc_norm_embedding.weight") == m._tp_class("mtp.norm.weight") == "replicated"


def test_draft_quant_fp8_saving_per_gpu(plan_tp):
    """fp8 quantizes each rank's shard: the replicated fc saves whole on every GPU, o_proj / MLP their half."""
    bf16, fp8 = plan_tp(SPEC="dflash2", DRAFT_QUANT="bf16"), plan_tp(SPEC="dflash2", DRAFT_QUANT="fp8")
    saved = bf16.prediction["vram"]["drafter_weights"] - fp8.prediction["vram"]["drafter_weights"]
    h, q, inter = 5120, 32 * 128, 17408
    rank = [(h, 5 * h)] + [(h, q // 2), (inter // 2, h), (inter // 2, h), (h, inter // 2)] * 5
    assert saved == m.fp8_saving(rank)
    assert fp8.prediction["kv_bytes_per_gpu"] - bf16.prediction["kv_bytes_per_gpu"] == saved
    whole = m.dflash_drafter_vram(None).weight_bytes - m.dflash_drafter_vram(None, fp8=True).weight_bytes
    assert whole / 2 < saved < whole
    assert "FP8" in fp8.prediction["vram"]["sources"]["drafter_weights"]


def test_dflash_ring_per_gpu(plan_tp):
    """DFLASH_RING=1: each GPU's rings hold the rank's 4 of the drafter's 8 KV heads."""
    plan = plan_tp(SPEC="dflash2", DFLASH_RING="1")
    seqs, k = int(plan.get("MAX_SEQS")), int(plan.get("SPEC_K"))
    want = ring.ring_bytes(5, seqs, 2048, k, 4, 128)
    assert want * 2 == ring.ring_bytes(5, seqs, 2048, k, 8, 128)
    v = plan.prediction["vram"]
    assert v["dflash2_ring_bytes"] == plan.prediction["dflash2_ring_bytes"] == want > 0
    no_ring = plan_tp(SPEC="dflash2")
    # the drafter's weights are the same with and without rings; its layers leave the pool
    assert v["drafter_weights"] == no_ring.prediction["vram"]["drafter_weights"]
    assert plan.prediction["kv_bytes_per_gpu"] == no_ring.prediction["kv_bytes_per_gpu"] - want
    assert any("DFlash2 drafter K/V rings" in n for n in plan.notes if n.startswith("TP=2: per GPU"))


def test_gdn_defer_scratch_and_kvarn_stage_per_gpu(plan_tp):
    plan = plan_tp(SPEC="dflash2", GDN_DEFER="1")
    v = plan.prediction["vram"]
    assert v["gdn_defer_scratch"] == plan.prediction["gdn_defer_scratch_bytes"] == m.gdn_defer_scratch_bytes(G, 4, 7, 2)
    huge = plan_tp(CTX="huge", SPEC="mtp")
    seqs = int(huge.get("MAX_SEQS"))
    stage = huge.prediction["vram"]["kvarn_stage"]
    assert stage == m.kvarn_reserve_bytes(m.rank_geometry(G, 2), "kvarn", seqs, G.num_full_attention + G.mtp_layers,
                                          int(huge.get("KVARN_WINDOW")), int(huge.get("KVARN_SINKS")))
    assert 0 < stage < m.kvarn_reserve_bytes(G, "kvarn", seqs, G.num_full_attention + G.mtp_layers,
                                             int(huge.get("KVARN_WINDOW")), int(huge.get("KVARN_SINKS")))


def _checkpoint(d: Path, draft_ids: int | None) -> Path:
    d.mkdir(parents=True)
    t = {"model.language_model.layers.0.mlp.up_proj.weight": torch.zeros(64, 64, dtype=torch.bfloat16),
         "model.language_model.embed_tokens.weight": torch.zeros(1000, 64, dtype=torch.bfloat16),
         "lm_head.weight": torch.zeros(1000, 64, dtype=torch.bfloat16),
         "model.language_model.norm.weight": torch.zeros(64, dtype=torch.bfloat16),
         "mtp.fc.weight": torch.zeros(64, 128, dtype=torch.bfloat16)}
    save_file(t, d / "model.safetensors")
    if draft_ids:
        (d / "draft_vocab.json").write_text(json.dumps({"ids": list(range(draft_ids))}))
    return d


def test_draft_lm_head_and_embed_host_per_gpu(tmp_path, monkeypatch):
    """SPEC=mtp's draft_lm_head (patch 0012: a ParallelLMHead) holds 1/TP of its rows per GPU;
    mtp.* only with SPEC=mtp; EMBED_HOST=1 takes each rank's embed_tokens shard off the GPU."""
    monkeypatch.setattr(P, "in_wsl", lambda: False)
    model = _checkpoint(tmp_path / "m", draft_ids=250)
    body = 64 * 64 * 2 // 2 + 1000 * 64 * 2 // 2 * 2 + 64 * 2  # up_proj / 2, embed + lm_head / 2, norm whole
    mtp = P.make_plan({"CTX": "fast", "SPEC": "mtp", "MODEL": str(model), **TP_ENV}, tmp_path, "python3")
    v = mtp.prediction["vram"]
    assert v["weights"] == body + 64 * 128 * 2 // 2
    assert v["draft_lm_head"] == 250 * 64 * 2 // 2
    assert mtp.prediction["kv_bytes_per_gpu"] == UTIL_BYTES - v["weights"] - v["draft_lm_head"] - m.RESERVES
    off = P.make_plan({"CTX": "fast", "SPEC": "off", "MODEL": str(model), **TP_ENV}, tmp_path, "python3")
    assert off.prediction["vram"]["weights"] == body and off.prediction["vram"]["draft_lm_head"] == 0
    no_vocab = P.make_plan({"CTX": "fast", "SPEC": "mtp", "MODEL": str(model), "ONECARD_DRAFT_VOCAB": "0", **TP_ENV},
                           tmp_path, "python3")
    assert no_vocab.prediction["vram"]["draft_lm_head"] == 0
    host = P.make_plan({"CTX": "fast", "SPEC": "off", "EMBED_HOST": "1", "MODEL": str(model), **TP_ENV}, tmp_path,
                       "python3")
    assert host.prediction["vram"]["weights"] == body - 1000 * 64 * 2 // 2
    assert "embed_tokens in host memory" in host.prediction["weights_source"]
