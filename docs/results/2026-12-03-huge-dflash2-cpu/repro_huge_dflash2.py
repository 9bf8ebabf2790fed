"""CPU reproduction: CTX=huge (KVarN kvarn_k4v2_g128) + SPEC=dflash2 + --kv-cache-dtype-skip-layers.

Question (gpu job 63, arm kvarn-d2k7-skipdraft): with KVarN as the main KV cache dtype and the
DFlash2 drafter's layers kept in bf16 by --kv-cache-dtype-skip-layers, does vLLM 0.27.1 (+ the
onecard series + the KVarN patch) get through its KV cache configuration, and with what block
size, pages and pool?

What runs here is vLLM's own code, on the CPU platform, with no model weights:
  1. EngineArgs(...).create_engine_config() with the launcher's arguments (CTX=huge argv from
     `python -m onecard.launch --dry-run`: kvarn_k4v2_g128, prefix caching + mamba align,
     --language-model-only, MAX_SEQS 2, the KV pin, the real dflash2 speculative config with
     the drafter's config.json, --kv-cache-dtype-skip-layers <drafter layers>).
  2. The cache-config state the GPU worker has before Platform.update_block_size_for_backend
     (the CPU platform's check_and_update_config set block 128: put back to the unset default),
     then the base Platform.update_block_size_for_backend (platforms/interface.py: Phase 1
     backend block, Phase 2 _align_hybrid_block_size, Phase 3
     _align_heterogeneous_kv_block_size) on a platform class whose _find_non_ssm_backend
     returns the backend the H200 would find first: KvarnAttentionBackend (the first non-GDN
     layer is the target's full-attention layer 3, a KVarN layer).
  3. One KV cache spec per layer, as GPUModelRunner.get_kv_cache_spec builds them
     (gpu_model_runner.py ~7820): the real (patched) Attention.get_kv_cache_spec on a stand-in
     per attention layer carrying what Attention.__init__ would set (its skip-layer rule is
     re-run here verbatim: extract_layer_index(prefix) in kv_cache_dtype_skip_layers ->
     kv_cache_dtype "auto", kv_cache_torch_dtype from vLLM's kv_cache_dtype_str_to_dtype), the
     real MambaBase.get_kv_cache_spec on a stand-in per GDN layer, then
     spec.indexes_kv_by_block_stride from the layer's backend class (KVARN for KVarN layers;
     FLASH_ATTN's class for bf16 layers when it imports, else TRITON_ATTN's: both NHD ->
     True). Drafter layers: model.layers.{n_target + i}.self_attn.attn
     (qwen3_dflash.py: start_layer_id=target_layer_num), sliding window / causal from vLLM's
     _resolve_layer_attention on the drafter's real HF config.
  4. get_kv_cache_configs (page unification, grouping, _check_enough_kv_cache_memory) and
     get_kv_cache_capacity ("GPU KV cache size: N tokens").

--fix NAME,... applies candidate fixes as monkeypatches before step 2 (see apply_fix and
FINDINGS.md; candidate-fix.diff is the same in diff form). Without --fix: stock code.

Setup (once; MODELS=/tmp/helper-models):
  .venv-test/bin/python -c "from onecard.prepare.tiny import ensure_tiny_model; \
      from onecard.dflash.tiny_drafter import ensure_tiny_drafter; ensure_tiny_drafter(ensure_tiny_model())"
  .venv-test/bin/python docs/results/2026-12-03-huge-dflash2-cpu/make_27b_configs.py   # config.json only
  .venv-test/bin/python -c "import sys; sys.path.insert(0,'tests/prepare'); \
      from vllm_cpu_load import write_sitecustomize; write_sitecustomize('/tmp/helper-hd2/sc')"
  .venv-test/bin/python gpu/jobs/61-kvarn-serve.py setup \
      --src "$(pwd)/.venv-test/lib/python3.11/site-packages/vllm" --site /tmp/helper-hd2/site
Run (from /work/main):
  PYTHONPATH=/tmp/helper-hd2/site:/tmp/helper-hd2/sc:/work/main TRITON_INTERPRET=1 \
      .venv-test/bin/python docs/results/2026-12-03-huge-dflash2-cpu/repro_huge_dflash2.py \
      --model 27b --spec dflash2 [--skip auto|none] [--max-len 245760] [--fix ...]
  (run_all.sh runs the matrix of FINDINGS.md)
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from dataclasses import replace
from types import SimpleNamespace

import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform

platforms._current_platform = CpuPlatform()

import torch  # noqa: E402

from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.platforms.interface import Platform  # noqa: E402
from vllm.v1.core import kv_cache_utils as KCU  # noqa: E402

MODELS = os.environ.get("MODELS", "/tmp/helper-models")
TARGETS = {"tiny": "qwen35-tiny", "27b": "qwen38-27b-geom"}
LONG_KV_MEM = 5_309_988_864  # onecard.memory.LONG_KV_MEM, the CTX=huge pin (launcher dry run)

LOG: list[str] = []


class _Capture(logging.Handler):
    def emit(self, record):
        msg = record.getMessage()
        if any(s in msg for s in ("block size", "Padding mamba", "padding", "KV cache size",
                                  "concurrency")):
            LOG.append(f"[vllm {record.levelname}] {msg}")


# ---------------------------------------------------------------------------------------------
# Candidate fixes (monkeypatches; candidate-fix.diff has them as a diff)
# ---------------------------------------------------------------------------------------------
FIXES = ("phase3-kvarn-page", "skip-block", "kvarn-stride-pad")


def kvarn_bytes_per_token(cache_dtype: str, kv_heads: int, head: int) -> int:
    from vllm.v1.attention.backends.kvarn_attn import bytes_per_token_head

    return kv_heads * bytes_per_token_head(cache_dtype, head)


def apply_fix(fixes: set[str]):
    """phase3-kvarn-page: _align_heterogeneous_kv_block_size computes the primary per-token page
        of a kvarn dtype as kv_heads x bytes_per_token_head (what the KVarN patch already does
        in _align_hybrid_block_size), not FullAttentionSpec(uint8) = 2 x kv_heads x head.
    skip-block: a full-attention skip layer (bf16 while the primary is quantized) gets the
        SW treatment of attention.py: the largest kernel block whose page fits the shared page
        (cache_config.skip_page_size_padded) that also divides the primary block (so the
        scheduler's LCM block stays the primary block), padded up to the shared page.
    kvarn-stride-pad: (the other way round, for comparison only) KVARN reports
        indexes_kv_by_block_stride() True, so unify may pad KVarN pages up to the bf16 drafter's
        page; config only: the KVarN kernels would also have to read pages by the block stride."""
    if "kvarn-stride-pad" in fixes:
        from vllm.v1.attention.backends.kvarn_attn import KvarnAttentionBackend

        KvarnAttentionBackend.indexes_kv_by_block_stride = classmethod(lambda cls: True)
    if "phase3-kvarn-page" in fixes:
        import vllm.v1.kv_cache_interface as KI

        orig = Platform._align_heterogeneous_kv_block_size.__func__

        def align(cls, vllm_config, backend_cls):
            cc = vllm_config.cache_config
            if not cc.cache_dtype.startswith("kvarn_"):
                return orig(cls, vllm_config, backend_cls)
            mc, pc = vllm_config.model_config, vllm_config.parallel_config
            real_fa = KI.FullAttentionSpec

            def fa(**kw):  # only the primary per-token page (dtype uint8) is replaced
                if kw.get("dtype") == torch.uint8 and kw.get("block_size") == 1:
                    return SimpleNamespace(page_size_bytes=kvarn_bytes_per_token(
                        cc.cache_dtype, mc.get_num_kv_heads(pc), mc.get_head_size()))
                return real_fa(**kw)

            KI.FullAttentionSpec = fa
            try:
                return orig(cls, vllm_config, backend_cls)
            finally:
                KI.FullAttentionSpec = real_fa

        Platform._align_heterogeneous_kv_block_size = classmethod(align)


def skip_block_spec(spec, cfg, backend):
    """The 'skip-block' fix for one bf16 full-attention skip layer (see apply_fix)."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    shared = cfg.cache_config.skip_page_size_padded
    if shared is None or not isinstance(spec, FullAttentionSpec) or spec.page_size_bytes <= shared:
        return spec
    per_tok = spec.page_size_bytes // spec.block_size
    B = cfg.cache_config.block_size
    kernel = min(s.base if isinstance(s, MultipleOf) else s
                 for s in backend.get_supported_kernel_block_sizes())
    blk = B
    while blk * per_tok > shared or B % blk:
        blk -= kernel
    assert blk > 0
    from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within

    # for comparison: vLLM's own rule for sliding-window skip layers, applied verbatim
    SW_RULE.append(_largest_kernel_block_within(backend, per_tok, shared, B))
    return replace(spec, block_size=blk, page_size_padded=shared)


SW_RULE: list[int] = []


# ---------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------
def make_cfg(a):
    target = os.path.join(MODELS, TARGETS[a.model])
    drafter = target + "-dflash2"
    kw = dict(model=target, max_model_len=a.max_len, max_num_seqs=a.max_seqs,
              kv_cache_memory_bytes=a.kv_mem, kv_cache_dtype=a.kv, enable_prefix_caching=True,
              mamba_cache_mode="align", language_model_only=True, dtype="bfloat16")
    if a.spec == "dflash2":
        kw["speculative_config"] = {"method": "dflash2", "num_speculative_tokens": a.k,
                                    "model": drafter, "dflash2_lookup": True}
    elif a.spec == "mtp":
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": a.k}
    n_target = json.load(open(os.path.join(target, "config.json")))["text_config"]["num_hidden_layers"]
    if a.skip == "auto" and a.spec == "dflash2":
        n_draft = json.load(open(os.path.join(drafter, "config.json")))["num_hidden_layers"]
        kw["kv_cache_dtype_skip_layers"] = [str(i) for i in range(n_target, n_target + n_draft)]
    elif a.skip not in ("auto", "none"):
        kw["kv_cache_dtype_skip_layers"] = a.skip.split(",")
    return EngineArgs(**kw).create_engine_config()


def backend_for(kv_cache_dtype: str):
    if kv_cache_dtype.startswith("kvarn_"):
        from vllm.v1.attention.backends.kvarn_attn import KvarnAttentionBackend

        return KvarnAttentionBackend, "KVARN"
    try:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        return FlashAttentionBackend, "FLASH_ATTN"
    except Exception:  # noqa: BLE001
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend, "TRITON_ATTN"


def attention_spec(cfg, prefix: str, num_kv_heads: int, head: int, sliding_window, info: list):
    """Attention.__init__'s skip rule (attention.py:298-316) + the real get_kv_cache_spec."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backend import AttentionType

    cc = cfg.cache_config
    kv = cc.cache_dtype
    skip = False
    if cc.kv_cache_dtype_skip_layers:
        if sliding_window is not None and "sliding_window" in cc.kv_cache_dtype_skip_layers:
            skip = True
        if str(extract_layer_index(prefix)) in cc.kv_cache_dtype_skip_layers:
            skip = True
    if skip:
        kv = "auto"
    backend, bname = backend_for(kv)
    stand_in = SimpleNamespace(
        attn_type=AttentionType.DECODER, kv_cache_dtype=kv,
        kv_cache_torch_dtype=kv_cache_dtype_str_to_dtype(kv, cfg.model_config),
        sliding_window=sliding_window, num_kv_heads=num_kv_heads, head_size=head,
        head_size_v=head, attn_backend=backend, layer_name=prefix)
    with set_current_vllm_config(cfg):
        spec = Attention.get_kv_cache_spec(stand_in, cfg)
        spec = replace(spec, indexes_kv_by_block_stride=backend.indexes_kv_by_block_stride())
    info.append((prefix, kv, bname, spec))
    return spec, backend


def layer_specs(cfg, fixes: set[str], info: list) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM as M
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    hf = cfg.model_config.hf_text_config
    specs = {}
    with set_current_vllm_config(cfg):
        shapes = M.get_mamba_state_shape_from_config(cfg)
        dtypes = M.get_mamba_state_dtype_from_config(cfg)
    gdn = SimpleNamespace(get_state_shape=lambda: shapes, get_state_dtype=lambda: dtypes,
                          mamba_type=MambaAttentionBackendEnum.GDN_ATTN)
    for i, t in enumerate(hf.layer_types):
        if t == "full_attention":
            name = f"language_model.model.layers.{i}.self_attn.attn"
            specs[name], _ = attention_spec(cfg, name, hf.num_key_value_heads, hf.head_dim, None, info)
        else:
            specs[f"language_model.model.layers.{i}.linear_attn"] = MambaBase.get_kv_cache_spec(gdn, cfg)
    sc = cfg.speculative_config
    if sc is not None and sc.method == "mtp":
        name = f"mtp.layers.{hf.num_hidden_layers}.self_attn.attn"
        specs[name], _ = attention_spec(cfg, name, hf.num_key_value_heads, hf.head_dim, None, info)
    elif sc is not None:  # dflash2
        from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention

        dhf = sc.draft_model_config.hf_config
        n = cfg.model_config.get_num_layers(cfg.parallel_config)  # qwen3_dflash.py:676
        dhead = getattr(dhf, "head_dim", None) or dhf.hidden_size // dhf.num_attention_heads
        with set_current_vllm_config(cfg):
            for i in range(dhf.num_hidden_layers):
                window, causal = _resolve_layer_attention(dhf, i)
                name = f"model.layers.{n + i}.self_attn.attn"
                spec, backend = attention_spec(cfg, name, dhf.num_key_value_heads, dhead, window, info)
                info[-1] = info[-1] + (f"window={window} causal={causal}",)
                if "skip-block" in fixes and info[-1][1] == "auto":
                    spec = skip_block_spec(spec, cfg, backend)
                    info[-1] = info[-1][:3] + (spec,) + info[-1][4:]
                specs[name] = spec
    return specs


def describe(spec) -> str:
    return (f"{type(spec).__name__}(block={spec.block_size}, "
            f"heads={getattr(spec, 'num_kv_heads', '-')}, head={getattr(spec, 'head_size', '-')}, "
            f"dtype={str(getattr(spec, 'dtype', '-')).replace('torch.', '')}, "
            f"page={spec.page_size_bytes:,}, padded={getattr(spec, 'page_size_padded', None)}, "
            f"stride_pad_ok={getattr(spec, 'indexes_kv_by_block_stride', '-')})")


def where(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in tb if "/vllm/" in f.filename] or tb
    f = frames[-1]
    return f"{f.filename.split('/vllm/', 1)[-1]}:{f.lineno} in {f.name}: {f.line}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(TARGETS), default="27b")
    ap.add_argument("--spec", choices=["off", "mtp", "dflash2"], default="dflash2")
    ap.add_argument("--k", type=int, default=0, help="0: 7 for dflash2 (CTX=huge default), 3 for mtp")
    ap.add_argument("--kv", default="kvarn_k4v2_g128")
    ap.add_argument("--skip", default="auto", help="auto: the drafter's layer indices (dflash2); "
                    "none; or a comma list")
    ap.add_argument("--max-len", type=int, default=245_760)
    ap.add_argument("--max-seqs", type=int, default=2)
    ap.add_argument("--kv-mem", type=int, default=LONG_KV_MEM)
    ap.add_argument("--fix", default="", help="comma list of " + ", ".join(FIXES))
    a = ap.parse_args()
    a.k = a.k or (7 if a.spec == "dflash2" else 3)
    fixes = set(a.fix.split(",")) - {""}
    assert fixes <= set(FIXES), fixes
    logging.getLogger("vllm").setLevel(logging.INFO)
    for h in list(logging.getLogger("vllm").handlers):
        logging.getLogger("vllm").removeHandler(h)
    logging.getLogger("vllm").addHandler(_Capture())
    logging.getLogger("vllm").propagate = False
    apply_fix(fixes)

    cfg = make_cfg(a)
    cc = cfg.cache_config
    print(f"== model={a.model} spec={a.spec} k={a.k} kv={cc.cache_dtype} "
          f"skip_layers={cc.kv_cache_dtype_skip_layers} max_len={a.max_len:,} "
          f"kv_mem={a.kv_mem:,} fix={','.join(sorted(fixes)) or 'none (stock)'}")
    print(f"  mamba_ssm_cache_dtype={cc.mamba_ssm_cache_dtype} mamba_cache_mode={cc.mamba_cache_mode}")
    # The GPU worker's state before update_block_size_for_backend: block size not yet chosen.
    from vllm.config.cache import CacheConfig

    cc.block_size = CacheConfig.DEFAULT_BLOCK_SIZE
    cc.user_specified_block_size = False
    cc.mamba_page_size_padded = None
    cc.skip_page_size_padded = None
    if not cc.user_specified_mamba_block_size:
        cc.mamba_block_size = None

    from vllm.v1.attention.backends.kvarn_attn import KvarnAttentionBackend

    first, _ = backend_for(cc.cache_dtype)  # the target's layer 3 (KVarN unless skipped)

    class GpuLike(Platform):  # the base class's update_block_size_for_backend, as CUDA uses it
        @classmethod
        def _find_non_ssm_backend(cls, vllm_config):
            return first

    phases = {}
    orig2 = Platform._align_hybrid_block_size.__func__
    orig3 = Platform._align_heterogeneous_kv_block_size.__func__

    def p2(cls, c, b):
        orig2(cls, c, b)
        phases["after phase 2"] = (c.cache_config.block_size, c.cache_config.mamba_page_size_padded,
                                   c.cache_config.skip_page_size_padded)

    def p3(cls, c, b):
        phases["phase 3 ran"] = True
        orig3(cls, c, b)

    GpuLike._align_hybrid_block_size = classmethod(p2)
    GpuLike._align_heterogeneous_kv_block_size = classmethod(p3)
    try:
        GpuLike.update_block_size_for_backend(cfg)
    except Exception as e:  # noqa: BLE001
        print(f"  update_block_size_for_backend RAISED {type(e).__name__}: {e}\n    at {where(e)}")
        for l in LOG:
            print("  " + l)
        return 1
    blk2, mpad2, _ = phases.get("after phase 2", (None, None, None))
    print(f"  backend found first: {first.get_name()}; after phase 2: block={blk2} "
          f"mamba_page_size_padded={mpad2}; phase 3 ran: {phases.get('phase 3 ran', False)}")
    print(f"  final: block_size={cc.block_size} mamba_block_size={cc.mamba_block_size} "
          f"mamba_page_size_padded={cc.mamba_page_size_padded} "
          f"skip_page_size_padded={cc.skip_page_size_padded}")
    hf = cfg.model_config.hf_text_config
    real = kvarn_bytes_per_token(cc.cache_dtype, hf.num_key_value_heads, hf.head_dim) \
        if cc.cache_dtype.startswith("kvarn_") else None
    if real:
        print(f"  KVarN real bytes/token/layer = {real} -> real primary page at this block = "
              f"{real * cc.block_size:,}")
    for l in LOG:
        print("  " + l)
    LOG.clear()

    info: list = []
    specs = layer_specs(cfg, fixes, info)
    seen = set()
    for row in info:
        prefix, kv, bname, spec = row[:4]
        key = (kv, bname, describe(spec), row[4:] and row[4])
        if key in seen:
            continue
        seen.add(key)
        n = sum(1 for r in info if r[1] == kv and describe(r[3]) == describe(spec))
        print(f"  attn {prefix} (x{n} like it): kv={kv} backend={bname} {describe(spec)} "
              f"{row[4] if len(row) > 4 else ''}")
    if SW_RULE:
        print(f"  (skip-block: vLLM's sliding-window rule _largest_kernel_block_within would pick "
              f"block {SW_RULE[0]} for the drafter layers)")
    m = next(s for s in specs.values() if type(s).__name__ == "MambaSpec")
    print(f"  gdn x{sum(1 for s in specs.values() if s is m or s == m)}: MambaSpec(block={m.block_size}, "
          f"page={m.page_size_bytes:,}, real state={sum(torch.Size(s).numel() * torch.tensor([], dtype=d).element_size() for s, d in zip(m.shapes, m.dtypes)):,}, "
          f"num_speculative_blocks={m.num_speculative_blocks})")
    try:
        kv_cfg = KCU.get_kv_cache_configs(cfg, [specs], [a.kv_mem])[0]
    except Exception as e:  # noqa: BLE001
        print(f"  get_kv_cache_configs RAISED {type(e).__name__}: {str(e)[:600]}\n    at {where(e)}")
        for l in LOG:
            print("  " + l)
        return 1
    sbs, hbs = KCU.resolve_kv_cache_block_sizes(kv_cfg, cfg)
    tokens, conc = KCU.get_kv_cache_capacity(cfg, kv_cfg)
    print(f"  OK: num_blocks={kv_cfg.num_blocks} 'GPU KV cache size: {tokens:,} tokens' "
          f"concurrency={conc:.3f}x at max_len {a.max_len:,}; scheduler_block={sbs} hash_block={hbs}")
    for g in kv_cfg.kv_cache_groups:
        s = g.kv_cache_spec
        print(f"    group {type(s).__name__:20s} {len(g.layer_names):2d} layers "
              f"{g.layer_names[0]:44s} block={s.block_size} page={s.page_size_bytes:,}")
    # vLLM's own scheduler on this config (does it construct; which coordinator / hit mode)
    from vllm.v1.structured_output import StructuredOutputManager

    cfg.cache_config.num_gpu_blocks = kv_cfg.num_blocks
    try:
        sched = cfg.scheduler_config.get_scheduler_cls()(
            vllm_config=cfg, kv_cache_config=kv_cfg,
            structured_output_manager=StructuredOutputManager(cfg), block_size=sbs,
            hash_block_size=hbs, log_stats=True)
        coord = sched.kv_cache_manager.coordinator
        print(f"    scheduler: {type(sched).__name__} use_eagle={sched.use_eagle} coordinator="
              f"{type(coord).__name__} partial_hash_hits="
              f"{getattr(coord, 'enable_partial_hash_hits', None)} "
              f"mamba_partial_cache_hit={getattr(sched, 'mamba_partial_cache_hit', None)}")
    except Exception as e:  # noqa: BLE001
        print(f"    scheduler RAISED {type(e).__name__}: {str(e)[:300]}\n      at {where(e)}")
    used = sum(t.size for t in kv_cfg.kv_cache_tensors)
    print(f"    tensors: {len(kv_cfg.kv_cache_tensors)} x {kv_cfg.kv_cache_tensors[0].size:,} B = "
          f"{used:,} B of {a.kv_mem:,}")
    for l in LOG:
        print("  " + l)
    return 0


if __name__ == "__main__":
    sys.exit(main())
