"""The launcher's KV-pool prediction (onecard.memory.predict_pool, through the preflight's plan)
against vLLM 0.27.1's own layout, computed on the CPU with vLLM's real functions: the KVCacheSpec
dict the GPU runner would collect (FullAttentionSpec per attention layer of target, MTP layer or
DFlash2 drafter, MambaSpec per GDN layer with num_speculative_blocks k, or 0 under GDN_DEFER=1 as
patch 0085 makes the Qwen3.5 GDN layers ask), the block size from
Platform._align_hybrid_block_size (the TRITON_ATTN backend's kernel alignment; the Qwen3.5 state
shape and dtype from vLLM's MambaState*Calculator, as qwen3_5.py's two classmethods call them),
then kv_cache_utils.get_kv_cache_configs (grouping, page unification, num_blocks, the
_check_enough_kv_cache_memory refusal) and get_kv_cache_capacity ("GPU KV cache size: N tokens").
None of those functions is patched by patches/series, so the installed (stock) vLLM is the server's.
At tensor parallel N (the tests at the end) the same functions run on N per-rank spec dicts at the
plan's per-GPU KV bytes; what that cannot reproduce on the CPU is said above those tests.

Measured pools (vLLM's log line) are fixed expectations where a row is the measured configuration:
job 75 (H100, 2026-12-05, the tiny model + tiny DFlash2 drafter, docs/results/2026-12-05-s21),
job 31 (27B geometry, CTX=long d2k7 +/- GDN_DEFER), the H200 session of 2026-12-03 (27B d2k7 /
d2k15, off, mtp) and job 70 (tiny pair, bf16, 3 GiB).

Job 75's two DFlash2 servers were predicted 19 % over (241,956 / 232,886 vs 195,347 / 188,100):
the preflight sized DRAFT=tiny's pool with the MTP layer in the target's bucket (3 attention
layers, group size 3, 2 GDN groups) instead of the tiny drafter's 2 layers of 2 KV heads x 64 in
a bucket of their own (group size 2, 3 GDN groups, 26 instead of 14 blocks per request);
test_job75_old_prediction_was_the_mtp_layout pins that cause."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
ku = pytest.importorskip("vllm.v1.core.kv_cache_utils")
from vllm.model_executor.layers.mamba.mamba_utils import (  # noqa: E402
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.platforms.interface import Platform  # noqa: E402
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE  # noqa: E402
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, get_kv_quant_mode  # noqa: E402
from vllm.config.model import ModelConfig  # noqa: E402
from vllm.config.speculative import SpeculativeConfig  # noqa: E402

from onecard import memory  # noqa: E402
from onecard import plan as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import spec_kv_sweep  # noqa: E402  (job 75's server table)
sys.path.pop(0)

G = memory.QWEN38_27B
INT8 = "int8_per_token_head"
PIN = memory.LONG_KV_MEM  # the 3090 CTX=long pin, 5,309,988,864 B (jobs 31 and the H200 session)


# ----------------------------------------------------------------------------- vLLM's layout

@dataclasses.dataclass
class Layout:
    tokens: int       # "GPU KV cache size: N tokens"
    block: int        # attention block size after _align_hybrid_block_size
    num_blocks: int
    groups: int       # KV cache groups
    gdn_groups: int
    longest: int      # _estimate_max_model_len_from_groups: the longest max_model_len vLLM accepts


class _Qwen35:
    """Qwen3_5ForConditionalGeneration's get_mamba_state_{shape,dtype}_from_config (qwen3_5.py),
    which _align_hybrid_block_size resolves through the model registry (its module needs
    torchvision, not in the CPU env): the same calls into vLLM's calculators."""

    @classmethod
    def get_mamba_state_shape_from_config(cls, vc):
        h, sc = vc.model_config.hf_text_config, vc.speculative_config
        return MambaStateShapeCalculator.gated_delta_net_state_shape(
            vc.parallel_config.tensor_parallel_size, h.linear_num_key_heads, h.linear_num_value_heads,
            h.linear_key_head_dim, h.linear_value_head_dim, h.linear_conv_kernel_dim,
            sc.num_speculative_tokens if sc else 0)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vc):
        c = vc.cache_config
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            vc.model_config.dtype, c.mamba_cache_dtype, c.mamba_ssm_cache_dtype)


def rank_heads(total: int, tp: int) -> int:
    """KV heads per rank by vLLM's own ModelConfig.get_num_kv_heads (max(1, total // tp): the
    expression qwen3_next.py's and qwen3_dflash.py's attention __init__ use too)."""
    return ModelConfig.get_num_kv_heads(NS(use_mla=False, get_total_num_kv_heads=lambda: total),
                                        NS(tensor_parallel_size=tp))


def vllm_layout(geom: memory.ModelGeometry, kv_mem: int, kv: str, max_len: int, k: int, prefix: bool,
                defer: bool = False, draft: tuple[int, int, int] | None = None,
                mtp: bool | None = None, tp: int = 1) -> Layout:
    """vLLM 0.27.1's pool for a Qwen3.5 hybrid at --kv-cache-memory kv_mem. ``draft``: a DFlash2
    drafter's (layers, KV heads, head dim), its layers full attention in the pool (no MTP layer is
    built then); ``mtp``: the MTP layer in the pool (default: with speculation and no drafter).

    ``tp``: --tensor-parallel-size; ``geom`` and ``draft`` are the whole model's and ``kv_mem`` one
    rank's KV bytes. Each of the ``tp`` workers hands get_kv_cache_configs the same per-rank spec
    dict (layer names are the same on every rank) and the same memory: KV heads per rank by
    rank_heads, the GDN state shape by vLLM's calculator at tensor_parallel_size=tp, the block size
    by _align_hybrid_block_size at that parallel config."""
    from vllm.model_executor.models import ModelRegistry

    cache_dtype = memory.KV_DTYPES[kv].name if kv in memory.KV_DTYPES else kv
    bf16 = torch.bfloat16
    backend = TritonAttentionBackend
    if cache_dtype.startswith("kvarn_"):  # only in a vLLM with kvarn/install.sh applied (a child process)
        from vllm.v1.attention.backends.kvarn_attn import KvarnAttentionBackend as backend, bytes_per_token_head
        from vllm.v1.kv_cache_interface import TQFullAttentionSpec
    kv_dtype = bf16 if cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
    quant = get_kv_quant_mode(cache_dtype)
    mode = "align" if prefix else "none"
    hf = NS(linear_num_key_heads=geom.linear_num_key_heads, linear_num_value_heads=geom.linear_num_value_heads,
            linear_key_head_dim=geom.linear_key_head_dim, linear_value_head_dim=geom.linear_value_head_dim,
            linear_conv_kernel_dim=geom.conv_kernel)
    cc = NS(cache_dtype=cache_dtype, block_size=16, user_specified_block_size=False, mamba_block_size=None,
            user_specified_mamba_block_size=False, mamba_cache_mode=mode, mamba_page_size_padded=None,
            mamba_cache_dtype="auto", mamba_ssm_cache_dtype="float32" if geom.ssm_state_bytes == 4 else "bfloat16",
            enable_prefix_caching=prefix, num_gpu_blocks_override=None, kv_cache_dtype_skip_layers=None,
            prefix_match_unit=None)
    mc = NS(dtype=bf16, use_mla=False, architecture="Qwen3_5ForConditionalGeneration", model_impl="auto",
            convert_type="none", hf_text_config=hf, max_model_len=max_len, original_max_model_len=max_len,
            is_hybrid=True, get_num_kv_heads=lambda pc: rank_heads(geom.num_kv_heads, pc.tensor_parallel_size),
            get_head_size=lambda: geom.head_dim)
    vc = NS(cache_config=cc, model_config=mc, parallel_config=NS(tensor_parallel_size=tp, decode_context_parallel_size=1),
            speculative_config=NS(num_speculative_tokens=k) if k else None, kv_transfer_config=None,
            scheduler_config=NS(disable_hybrid_kv_cache_manager=False), max_in_flight_tokens=None)
    ModelRegistry.resolve_model_cls = lambda arch, model_config: (_Qwen35, arch)  # instance attribute
    try:
        Platform._align_hybrid_block_size(vc, backend)
    finally:
        del ModelRegistry.resolve_model_cls
    if cc.mamba_block_size is None:  # mode none: VllmConfig sets max_model_len (not used for sizing)
        cc.mamba_block_size = max_len
    block = cc.block_size

    def attn(heads: int, head_dim: int, **kw) -> FullAttentionSpec:
        if backend is not TritonAttentionBackend:   # KVarN: the spec its patched Attention layer returns
            return TQFullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head_dim, head_size_v=head_dim,
                                       dtype=kv_dtype, kv_quant_mode=quant,
                                       tq_slot_size=bytes_per_token_head(cache_dtype, head_dim))
        # indexes_kv_by_block_stride: what the GPU runner asks TRITON_ATTN / FLASH_ATTN (NHD: True)
        return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head_dim, dtype=kv_dtype,
                                 kv_quant_mode=quant, indexes_kv_by_block_stride=True, **kw)

    target = attn(rank_heads(geom.num_kv_heads, tp), geom.head_dim)
    gdn = MambaSpec(shapes=tuple(_Qwen35.get_mamba_state_shape_from_config(vc)),
                    dtypes=_Qwen35.get_mamba_state_dtype_from_config(vc), block_size=cc.mamba_block_size,
                    page_size_padded=cc.mamba_page_size_padded, mamba_cache_mode=mode,
                    # patch 0085: a deferring GDN layer asks no per-draft state blocks
                    num_speculative_blocks=0 if defer else k)
    every = geom.num_layers // geom.num_full_attention
    specs = {f"language_model.model.layers.{i}.{'self_attn.attn' if (i + 1) % every == 0 else 'linear_attn'}":
             target if (i + 1) % every == 0 else gdn for i in range(geom.num_layers)}
    if mtp if mtp is not None else (k > 0 and draft is None and geom.mtp_layers > 0):
        for j in range(geom.mtp_layers):
            specs[f"mtp.layers.{geom.num_layers + j}.self_attn.attn"] = target
    if draft:
        n, heads, head_dim = draft
        d = attn(rank_heads(heads, tp), head_dim, non_causal=True)
        for j in range(n):
            specs[f"draft_model.model.layers.{j}.self_attn.attn"] = d
    cfg = ku.get_kv_cache_configs(vc, [specs] * tp, [kv_mem] * tp)[0]   # raises where vLLM refuses max_len
    tokens, _ = ku.get_kv_cache_capacity(vc, cfg)
    mc.max_model_len = 1 << 26  # the search bound of _estimate_max_model_len_from_groups (the tiny pair at TP=2: 8.2M)
    longest = ku._estimate_max_model_len_from_groups(vc, cfg.kv_cache_groups, kv_mem)
    gdn_groups = sum(isinstance(g.kv_cache_spec, MambaSpec) for g in cfg.kv_cache_groups)
    return Layout(tokens, block, cfg.num_blocks, len(cfg.kv_cache_groups), gdn_groups, longest)


def assert_same(pred: memory.PoolPrediction, lay: Layout) -> None:
    got = (pred.pool_tokens, pred.block_size, pred.num_blocks, pred.gdn_groups,
           pred.gdn_groups + sum(g for g, _ in pred.attn_groups), pred.one_sequence_tokens())
    assert got == (lay.tokens, lay.block, lay.num_blocks, lay.gdn_groups, lay.groups, lay.longest)


# ----------------------------------------------------------------------------- the models

def _tiny_configs() -> tuple[dict, dict]:
    """The tiny target's and its tiny DFlash2 drafter's config.json, as scripts/make_tiny_model.py
    and ensure_tiny_drafter write them (token ids: placeholders, only the mask id reads one)."""
    from onecard.dflash.tiny_drafter import make_config as drafter_config
    from onecard.prepare.tiny import DEFAULT_SPEC, make_config

    ids = {t: i for i, t in enumerate(["<|im_end|>", "<|image_pad|>", "<|video_pad|>",
                                       "<|vision_start|>", "<|vision_end|>"])}
    target = make_config(DEFAULT_SPEC, ids)
    return target, drafter_config(target)


def _draft_shape(cfg: dict) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) as vLLM's DFlash drafter reads its config.json."""
    return (cfg["num_hidden_layers"], cfg["num_key_value_heads"],
            cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


@pytest.fixture(scope="module")
def tiny():
    target, drafter = _tiny_configs()
    return memory.ModelGeometry.from_config(target), _draft_shape(drafter)


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    from onecard.profiles import pretend_installed

    with pretend_installed(tmp_path_factory.mktemp("fakevllm")) as d:
        yield d


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("root")


def _plan_layout(plan, geom, draft):
    """vLLM's layout at the plan's final values (MAX_LEN after caps, KV_MEM, k, prefix, GDN_DEFER;
    at TP>1 the per-GPU KV bytes the plan predicted from GPU_UTIL, on every rank). DFLASH_RING=1:
    the drafter's layers hand vLLM no KV-cache spec, and no MTP layer is built."""
    k = int(plan.get("SPEC_K"))
    tp = int(plan.get("TP")) if "TP" in plan.values else 1
    kv_mem = int(plan.prediction["kv_bytes_per_gpu"]) if tp > 1 else int(plan.get("KV_MEM"))
    ring = plan.get("DFLASH_RING") == "1"
    return vllm_layout(geom, kv_mem, plan.get("KV"), int(plan.get("MAX_LEN")), k,
                       plan.get("PREFIX_CACHE") == "1", plan.get("GDN_DEFER") == "1" and k > 0,
                       draft if plan.get("SPEC") == "dflash2" and not ring else None,
                       mtp=False if ring else None, tp=tp)


def _pred(plan) -> memory.PoolPrediction:
    d = dict(plan.prediction)
    fields = {f.name for f in dataclasses.fields(memory.PoolPrediction)}
    d["attn_groups"] = tuple(tuple(x) for x in d["attn_groups"])
    return memory.PoolPrediction(**{k: v for k, v in d.items() if k in fields})


# ----------------------------------------------------------------------------- job 75 (tiny)

JOB75 = {"off": 310_814, "mtp": 167_740, "mtp-defer": 234_837, "mtp-defer-nopc": 270_966,
         "d2k7-defer": 195_347, "d2k15-defer": 188_100}


@pytest.mark.parametrize("server", sorted(JOB75))
def test_job75_pools(server, tiny, features, root):
    """Each job-75 server through the launcher's plan (MODEL=tiny, DRAFT=tiny, the suite's knobs):
    prediction == vLLM's layout == the pool the H100 logged."""
    geom, draft = tiny
    st = spec_kv_sweep.suite("defer", environ={})
    env = {"GDN_DEFER": "0", **st["base"], **st["servers"][server], "PORT": "8000"}
    plan = P.make_plan(env, root, "python3", None, geom)
    lay = _plan_layout(plan, geom, draft)
    assert_same(_pred(plan), lay)
    assert lay.tokens == plan.prediction["pool_tokens"] == JOB75[server]


@pytest.mark.parametrize("k,old,real", [(7, 241_956, 195_347), (15, 232_886, 188_100)])
def test_job75_old_prediction_was_the_mtp_layout(tiny, k, old, real):
    """The cause: job 75's predictions were vLLM's pool for the MTP layer (the target's 2 x 256)
    in the target's bucket, not for the tiny drafter's 2 layers of 2 x 64: group size 3 instead of
    2, so 2 GDN groups instead of 3 and 14 blocks per request instead of 26."""
    geom, draft = tiny
    assert draft == (2, 2, 64) and (geom.num_kv_heads, geom.head_dim) == (2, 256)
    as_mtp = vllm_layout(geom, memory.GiB, INT8, 4096, k, True, defer=True, mtp=True)
    assert as_mtp.tokens == old == memory.predict_pool(geom, memory.GiB, INT8, 4096, k, True, gdn_defer=True).pool_tokens
    real_lay = vllm_layout(geom, memory.GiB, INT8, 4096, k, True, defer=True, draft=draft)
    assert real_lay.tokens == real and (as_mtp.gdn_groups, real_lay.gdn_groups) == (2, 3)


# ----------------------------------------------------------------------------- 27B, measured

@pytest.mark.parametrize("knobs,pool,max_len,plan_len", [
    ({"SPEC": "off", "GDN_DEFER": "0"}, 146_915, 131_072, 131_072),       # H200 2026-12-03
    ({"SPEC": "mtp", "GDN_DEFER": "0"}, 124_928, 124_928, 118_784),       # H200 2026-12-03 (capped)
    ({"SPEC": "dflash2", "GDN_DEFER": "0"}, 71_140, 70_912, 67_840),      # job 31 d2k7 (capped)
    ({"SPEC": "dflash2", "GDN_DEFER": "1"}, 93_998, 93_696, 90_368),      # job 31 d2k7-gd (capped)
])
def test_27b_ctx_long_measured(knobs, pool, max_len, plan_len, features, drafter_27b, root):
    """CTX=long at the 3090 pin through the plan (no checkpoint: the 27B layout; DRAFT: the
    published drafter's config). The GPU measured each pool at ``max_len``, the cap of its time;
    since 2026-12-05 the plan caps MAX_LEN where one sequence also runs without preemption
    (``plan_len``: PoolPrediction.one_sequence_tokens(chunk=...)), and predicts vLLM's pool there."""
    env = {"CTX": "long", "MODEL": str(root / "models" / "qwen38-27b"), "DRAFT": str(drafter_27b), **knobs}
    plan = P.make_plan(env, root, "python3")
    assert int(plan.get("KV_MEM")) == PIN and int(plan.get("MAX_LEN")) == plan_len
    assert_same(_pred(plan), _plan_layout(plan, G, (5, 8, 128)))
    k, defer, d2 = int(plan.get("SPEC_K")), knobs["GDN_DEFER"] == "1", knobs["SPEC"] == "dflash2"
    kw = memory.DrafterVRAM(0, memory.DFLASH2_27B_LAYERS, "test").pool_kw() if d2 else {}
    lay = vllm_layout(G, PIN, INT8, max_len, k, True, defer and k > 0, (5, 8, 128) if d2 else None)
    assert_same(memory.predict_pool(G, PIN, INT8, max_len, k, True, gdn_defer=defer and k > 0, **kw), lay)
    assert lay.tokens == pool


@pytest.mark.parametrize("k,max_len,pool", [(7, 65_536, 69_090), (15, 33_792, 37_046)])
def test_27b_dflash2_h200(k, max_len, pool):
    """H200, 2026-12-03: the geometry drafter at the 3090 pin, MAX_LEN given."""
    kw = memory.DrafterVRAM(0, memory.DFLASH2_27B_LAYERS, "test").pool_kw()
    lay = vllm_layout(G, PIN, INT8, max_len, k, True, draft=(5, 8, 128))
    assert_same(memory.predict_pool(G, PIN, INT8, max_len, k, True, **kw), lay)
    assert lay.tokens == pool


@pytest.mark.parametrize("k,pool", [(7, 193_536), (15, 112_320)])
def test_tiny_dflash2_job70(k, pool, tiny):
    """Job 70 (H200): the tiny pair, bf16 KV, 3 GiB, max-model-len 2048, prefix caching."""
    geom, draft = tiny
    kw = memory.DrafterVRAM(0, draft[0], "test", kv_heads=draft[1], head_dim=draft[2]).pool_kw()
    lay = vllm_layout(geom, 3 * memory.GiB, "bf16", 2048, k, True, draft=draft)
    assert_same(memory.predict_pool(geom, 3 * memory.GiB, "bf16", 2048, k, True, **kw), lay)
    assert lay.tokens == pool


# ----------------------------------------------------------------------------- the table

SPECS = [("off", {"SPEC": "off"}), ("mtp", {"SPEC": "mtp"}),
         ("d2k7", {"SPEC": "dflash2", "DFLASH_TOKENS": "7"}), ("d2k15", {"SPEC": "dflash2", "DFLASH_TOKENS": "15"})]
TABLE = [(f"{s}-{kv}-pc{pc}-defer{d}", {**knobs, "KV": kv, "PREFIX_CACHE": pc, "GDN_DEFER": d})
         for s, knobs in SPECS for kv in ("bf16", INT8) for pc in ("0", "1")
         for d in (("0",) if s == "off" else ("0", "1"))]


@pytest.mark.parametrize("name,knobs", TABLE, ids=[n for n, _ in TABLE])
def test_27b_table(name, knobs, features, drafter_27b, root):
    """The 27B geometry at the 3090 CTX=long pin, every SPEC x KV x prefix caching x GDN_DEFER: the
    plan's prediction (after its MAX_LEN cap) is vLLM's pool, and its longest sequence is vLLM's
    estimate (so vLLM accepts the capped MAX_LEN: get_kv_cache_configs raises otherwise)."""
    env = {"CTX": "long", "MODEL": str(root / "models" / "qwen38-27b"), "DRAFT": str(drafter_27b),
           "KV_MEM": str(PIN), **knobs}
    plan = P.make_plan(env, root, "python3")
    assert_same(_pred(plan), _plan_layout(plan, G, (5, 8, 128)))


@pytest.mark.parametrize("name,knobs", [(n, kn) for n, kn in TABLE if "-pc1-" in n],
                         ids=[n for n, _ in TABLE if "-pc1-" in n])
def test_tiny_table(name, knobs, tiny, features, root):
    """The tiny model at job 75's knobs (1 GiB, MAX_LEN 4096) for every SPEC x KV x GDN_DEFER."""
    geom, draft = tiny
    env = {**spec_kv_sweep.COMMON, "CTX": "long", "MAX_LEN": "4096", **knobs, "PORT": "8000"}
    plan = P.make_plan(env, root, "python3", None, geom)
    assert_same(_pred(plan), _plan_layout(plan, geom, draft))


def test_tiny_drafter_shape_is_what_the_plan_uses(tiny):
    """The preflight's DRAFT=tiny record (onecard.dflash.tiny_drafter.DEFAULT_DRAFTER) is the shape
    of the drafter config ensure_tiny_drafter writes."""
    from onecard.dflash.tiny_drafter import DEFAULT_DRAFTER as t

    assert (t.layers, t.kv_heads, t.head_dim) == tiny[1]
    assert json.loads(json.dumps(_tiny_configs()[1]))["num_key_value_heads"] == t.kv_heads


# ----------------------------------------------------------------------------- tensor parallel
#
# At --tensor-parallel-size N every rank holds the same layers with 1/N of the KV and GDN heads
# (the DFlash2 drafter runs at the target's TP: SpeculativeConfig._verify_and_get_draft_tp), and
# get_kv_cache_configs lays the pool out from the N per-rank spec dicts. The plan sizes each rank's
# pool from GPU_UTIL (memory.predict_tp); vLLM's layout below is computed at that per-rank figure.
# What the CPU cannot reproduce, and so is not checked here: the per-rank KV bytes themselves
# (vLLM profiles each rank's free memory; the plan's kv_bytes_per_gpu is an estimate from 3090
# reserves and the per-GPU weights, drafter included: tests/test_tp_budget.py); the per-rank head counts
# come from ModelConfig.get_num_kv_heads (the expression the attention layers' __init__ use), not
# from instantiating the models (that needs an initialised TP group); nothing here has booted
# SPEC=dflash2 at TP>1 on GPUs.

TP_ENV = {"TP": "2", "CUDA_VISIBLE_DEVICES": "0,1"}
TP_TABLE = [(f"{s}-{kv}-pc{pc}-defer{d}", {**knobs, "KV": kv, "PREFIX_CACHE": pc, "GDN_DEFER": d})
            for s, knobs in SPECS for kv in ("bf16", INT8) for pc in ("0", "1")
            for d in (("0",) if s == "off" else ("0", "1"))]


def test_drafter_runs_at_the_target_tp_and_rank_heads():
    """The launcher's --speculative-config names no draft_tensor_parallel_size, so vLLM runs the
    drafter at the target's TP; memory.rank_kv_heads is vLLM's per-rank KV heads (replicated, one
    a rank, below TP) and refuses exactly where the attention layers' assert would fail."""
    assert SpeculativeConfig._verify_and_get_draft_tp(NS(tensor_parallel_size=2), None, NS(model_type="qwen3")) == 2
    for total in (1, 2, 3, 4, 8, 16):
        for tp in (1, 2, 4, 8):
            ok = total % tp == 0 if total >= tp else tp % total == 0
            if ok:
                assert memory.rank_kv_heads(total, tp) == rank_heads(total, tp), (total, tp)
            else:
                with pytest.raises(ValueError, match=f"TP={tp} does not split the {total}"):
                    memory.rank_kv_heads(total, tp)


@pytest.mark.parametrize("name,knobs", TP_TABLE, ids=[n for n, _ in TP_TABLE])
def test_27b_tp2_table(name, knobs, features, drafter_27b, root):
    """The 27B geometry at CTX=long TP=2 (the pool from GPU_UTIL on each 24 GiB card), every SPEC x
    KV x prefix caching x GDN_DEFER (an explicit 1; auto is 0 at TP>1): the plan's per-rank
    prediction is vLLM's layout from the per-rank specs (SPEC=dflash2: the drafter's 5 layers of 4
    KV heads x 128 per rank in a bucket of their own, group size 5, no MTP layer)."""
    env = {"CTX": "long", "MODEL": str(root / "models" / "qwen38-27b"), "DRAFT": str(drafter_27b),
           **TP_ENV, **knobs}
    plan = P.make_plan(env, root, "python3")
    assert plan.get("TP") == 2 and plan.prediction["tp"] == 2
    pred = _pred(plan)
    assert_same(pred, _plan_layout(plan, G, (5, 8, 128)))
    if knobs["SPEC"] == "dflash2":
        assert pred.group_size == 5 and pred.attn_groups == ((4, pred.block_size), (1, pred.block_size))


def test_27b_tp2_gdn_defer_auto_is_0(features, drafter_27b, root):
    """GDN_DEFER=auto at TP>1 is 0 (not yet run on two GPUs), and that plan too is vLLM's layout."""
    env = {"CTX": "long", "SPEC": "dflash2", "MODEL": str(root / "models" / "qwen38-27b"),
           "DRAFT": str(drafter_27b), **TP_ENV}
    plan = P.make_plan(env, root, "python3")
    assert plan.get("GDN_DEFER") == "0" and plan.values["GDN_DEFER"].source == "profile"
    assert_same(_pred(plan), _plan_layout(plan, G, (5, 8, 128)))
    assert any(n.startswith("GDN_DEFER=1 (available, not yet run on two GPUs) would hold 20 instead of 90 ")
               for n in plan.notes)


@pytest.mark.parametrize("defer,old,new", [("0", 468_973, 342_360), ("1", 579_397, 397_483)])
def test_27b_tp2_dflash2_old_prediction_was_the_mtp_layout(defer, old, new, features, drafter_27b, root):
    """The bug this pins: at TP>1 predict_tp was given no drafter, so CTX=long SPEC=dflash2 TP=2 was
    predicted as vLLM's pool with the MTP layer in the target's bucket (17 attention layers, group
    size 17, 3 GDN groups) instead of the drafter's 5 layers (group size 5, 10 GDN groups): 37 % /
    46 % over vLLM's pool at GDN_DEFER 0 / 1. (Figures at the plan's per-GPU KV bytes, 10.38 / 10.37
    GiB since the TP budget counts the drafter's weights and no MTP weights, tests/test_tp_budget.py;
    at the earlier 12.33 / 12.32 GiB they read 556,755 -> 406,585 and 688,128 -> 472,164.)"""
    env = {"CTX": "long", "SPEC": "dflash2", "GDN_DEFER": defer, "MODEL": str(root / "models" / "qwen38-27b"),
           "DRAFT": str(drafter_27b), **TP_ENV}
    plan = P.make_plan(env, root, "python3")
    kv_gpu, max_len = plan.prediction["kv_bytes_per_gpu"], int(plan.get("MAX_LEN"))
    d = defer == "1"
    as_mtp = vllm_layout(G, kv_gpu, INT8, max_len, 7, True, defer=d, mtp=True, tp=2)
    bare = memory.predict_tp(G, 2, None, INT8, max_len, 7, True, kv_bytes_per_gpu=kv_gpu, gdn_defer=d).pool
    assert as_mtp.tokens == bare.pool_tokens == old and (as_mtp.gdn_groups, bare.group_size) == (3, 17)
    real = vllm_layout(G, kv_gpu, INT8, max_len, 7, True, defer=d, draft=(5, 8, 128), tp=2)
    assert real.tokens == plan.prediction["pool_tokens"] == new and real.gdn_groups == 10


def test_27b_tp2_dflash_ring(features, drafter_27b, root):
    """DFLASH_RING=1 at TP=2: the drafter's layers stay out of the pool (and no MTP layer), as at TP=1."""
    env = {"CTX": "long", "SPEC": "dflash2", "DFLASH_RING": "1", "MODEL": str(root / "models" / "qwen38-27b"),
           "DRAFT": str(drafter_27b), **TP_ENV}
    plan = P.make_plan(env, root, "python3")
    pred = _pred(plan)
    assert_same(pred, _plan_layout(plan, G, (5, 8, 128)))
    assert pred.group_size == 16 and len(pred.attn_groups) == 1


@pytest.mark.parametrize("kv_heads,ok", [(1, True), (2, True), (3, False)])
def test_27b_tp2_drafter_kv_heads(kv_heads, ok, features, drafter_27b, root, tmp_path):
    """A drafter of 1 KV head at TP=2 is replicated (one head a rank, as vLLM does); 3 heads (of 24
    query heads) do not split over 2 ranks (vLLM's assert at model init): refused by the plan."""
    d = tmp_path / "drafter"
    d.mkdir()
    cfg = json.loads((drafter_27b / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": kv_heads,
                                               "num_attention_heads": 24 if kv_heads == 3 else 32}))
    env = {"CTX": "long", "SPEC": "dflash2", "MODEL": str(root / "models" / "qwen38-27b"), "DRAFT": str(d), **TP_ENV}
    if not ok:
        with pytest.raises(P.PlanError, match=r"TP=2 does not split the 3 KV heads of the DFlash2 drafter"):
            P.make_plan(env, root, "python3")
        return
    plan = P.make_plan(env, root, "python3")
    assert_same(_pred(plan), _plan_layout(plan, G, (5, kv_heads, 128)))


@pytest.fixture(scope="module")
def tiny_on_disk(tmp_path_factory):
    """The tiny checkpoint and its tiny DFlash2 drafter on disk (MODEL=tiny has no weights to size
    a TP>1 pool from GPU_UTIL, so the plan gets the built directories)."""
    from onecard.dflash.tiny_drafter import build_tiny_drafter
    from onecard.prepare.tiny import build_tiny_model

    base = tmp_path_factory.mktemp("tinytp")
    model = build_tiny_model(base / "tiny")
    return model, build_tiny_drafter(model, base / "tiny-drafter")


@pytest.mark.parametrize("k", ["7", "15"])
@pytest.mark.parametrize("kv", ["bf16", INT8])
@pytest.mark.parametrize("defer", ["0", "1"])
def test_tiny_tp2_dflash2(k, kv, defer, tiny, tiny_on_disk, features, root):
    """The tiny pair at TP=2 (job 75's knobs, MAX_LEN 4096): per rank 1 KV head x 256 for the target
    and the drafter's 2 x 64 split to 1 x 64, GDN 1 key / 3 value heads; the plan's per-rank pool
    is vLLM's."""
    geom, draft = tiny
    model, drafter = tiny_on_disk
    env = {**spec_kv_sweep.COMMON, "MODEL": str(model), "DRAFT": str(drafter), "CTX": "long", "MAX_LEN": "4096",
           "SPEC": "dflash2", "DFLASH_TOKENS": k, "KV": kv, "GDN_DEFER": defer, "PORT": "8000", **TP_ENV}
    env.pop("KV_MEM")
    plan = P.make_plan(env, root, "python3", None, geom)
    pred = _pred(plan)
    assert_same(pred, _plan_layout(plan, geom, draft))
    assert pred.group_size == 2 and len(pred.attn_groups) == 2


# ----------------------------------------------------------------------------- CTX=huge (KVarN)

# Measured "GPU KV cache size" (27B geometry, H200, 3090 pin): off 358,107 and stock-GDN MTP
# 296,827 (docs/measurements.md, sessions 3, 11, 14, 17). GDN_DEFER=auto (1 with SPEC=mtp, the
# default since session 22) is not yet run with KVarN: its row is the CPU layout only.
HUGE = [("huge-off", {"SPEC": "off"}, 358_107), ("huge-mtp-gd0", {"SPEC": "mtp", "GDN_DEFER": "0"}, 296_827),
        ("huge-mtp", {"SPEC": "mtp"}, None), ("huge-mtp-pc0", {"SPEC": "mtp", "PREFIX_CACHE": "0"}, None),
        ("huge-k4v4-mtp", {"SPEC": "mtp", "KVARN_PRESET": "k4v4_g128"}, None)]

_HUGE_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import test_pool_vs_vllm as T
from onecard import memory
out = {}
for name, (kv_mem, kv, max_len, k, prefix, defer) in json.loads(sys.argv[2]).items():
    out[name] = T.dataclasses.asdict(T.vllm_layout(memory.QWEN38_27B, kv_mem, kv, max_len, k, prefix, defer))
print("JSON" + json.dumps(out))
"""


def test_27b_ctx_huge_kvarn(vllm_dir, tmp_path, features, root):
    """CTX=huge: the plan's pool against vLLM's own functions in a vLLM with KVarN installed
    (kvarn/install.sh into a view: TQFullAttentionSpec pages, KVARN's block-size alignment), for
    SPEC=off / mtp with and without GDN_DEFER, and the measured pools where a row was measured."""
    import os
    import subprocess

    from onecard import patching
    from onecard.kvarn import installer as kin

    also = tuple({p for patch in patching.read_series(kin.SERIES) for p in patch.paths} | set(kin.sources())
                 | {kin.MARKER})
    site = patching.overlay(vllm_dir, tmp_path / "site", also=also)
    assert kin.main(["--vllm-dir", str(site / "vllm")]) == 0
    plans, args = {}, {}
    for name, knobs, _ in HUGE:
        plan = P.make_plan({"CTX": "huge", "MODEL": str(root / "models" / "qwen38-27b"), **knobs}, root, "python3")
        k = int(plan.get("SPEC_K"))
        plans[name] = plan
        args[name] = (int(plan.get("KV_MEM")), plan.get("KV"), int(plan.get("MAX_LEN")), k,
                      plan.get("PREFIX_CACHE") == "1", plan.get("GDN_DEFER") == "1" and k > 0)
    repo = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", _HUGE_CHILD, str(repo / "tests"), json.dumps(args)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": f"{site}:{repo}"})
    line = [x for x in r.stdout.splitlines() if x.startswith("JSON")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    got = json.loads(line[0][4:])
    for name, _, measured in HUGE:
        lay = Layout(**got[name])
        assert_same(_pred(plans[name]), lay)
        if measured is not None:
            assert lay.tokens == measured
    # GDN_DEFER's gain at the huge pin, as the profile table says (docs/profiles.md)
    assert got["huge-mtp"]["tokens"] == 336_112 and got["huge-mtp-gd0"]["tokens"] == 296_827
