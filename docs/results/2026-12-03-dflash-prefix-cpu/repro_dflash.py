"""CPU reproduction of the DFlash2 prefix-cache zero (tests/gpu/test_dflash2.py, H200 2026-12-03).

Drives vLLM 0.27.1's real Scheduler / KVCacheManager / HybridKVCacheCoordinator with fake model
outputs (the pass driver and fake runner of ../2026-12-03-prefix-cache-cpu/repro_sched.py), with
the KV cache config built the way the H200 server built it for
`--speculative-config '{"method":"dflash2","num_speculative_tokens":k,...}'`:

  * EngineArgs(...).create_engine_config() with the real speculative config (method "dflash2",
    served as "dflash", patch 0080) and the real tiny DFlash2 drafter config
    (onecard.dflash.tiny_drafter.build_tiny_drafter);
  * the target's layer specs as repro_sched.py builds them (block forced to the H200's 208/224,
    platforms/interface.py:904), plus one spec per drafter layer computed by vLLM's own code:
    `_resolve_layer_attention(draft_hf_config, i)` (qwen3_dflash.py:86) for the sliding window,
    then the real `Attention.get_kv_cache_spec` (model_executor/layers/attention/attention.py:621)
    on a stand-in carrying the drafter layer's attributes (num_kv_heads, head_size, dtype);
  * get_kv_cache_configs / resolve_kv_cache_block_sizes (the page-size unification, the
    grouping and the scheduler/hash block sizes are vLLM's own);
  * the scheduler's own use_eagle / num_lookahead_tokens (k + 1 for DFlash, scheduler.py:261);
  * every draft rejected (random drafter: acceptance 0.0% in the H200 log).

Shipped test: tests/test_dflash_prefix_patch.py runs this script (stock series vs the series with
patch 0081, which is fix.diff in our words).

--fix=V1,V2 applies candidate fixes as monkeypatches before anything is built (see apply_fix;
--fix=proposed is fix.diff: nodrop + split-lcm; --fix= is stock vLLM 0.27.1).
--trace L prints HybridKVCacheCoordinator.find_longest_cache_hit's candidate lengths per
iteration for the pass-2 request of prompt length L.

Usage (from /work/main; needs a vLLM copy with patches/series applied, for method "dflash2",
and the sitecustomize of ../2026-12-03-prefix-cache-cpu, see FINDINGS.md):
  PYTHONPATH=/tmp/dflash-cpu/patched:/tmp/prefix-spec/site .venv-test/bin/python \
      docs/results/2026-12-03-dflash-prefix-cpu/repro_dflash.py --spec dflash --k 7 [--unbounded] [--fix=proposed] [--trace 1100]
  (run_matrix.sh runs the whole matrix; --spec off|mtp use repro_sched.build for the controls)
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "2026-12-03-prefix-cache-cpu"))

import repro_sched as R  # noqa: E402  (sets the CPU platform)

from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.core import kv_cache_utils as KCU  # noqa: E402
from vllm.v1.kv_cache_interface import KVQuantMode, MambaSpec  # noqa: E402

DRAFTER = os.environ.get("DRAFTER", "/tmp/dflash-cpu/models/qwen35-tiny-dflash2")


# ---------------------------------------------------------------------------------------------
# Candidate fixes, as monkeypatches (fix.diff = nodrop + split-lcm)
# ---------------------------------------------------------------------------------------------
FIX_VARIANTS = ("nodrop", "split-lcm", "pad", "drafter-eagle-only")


def apply_fix(variants: set[str]):
    """Monkeypatched versions of the candidate fixes (fix.diff has the proposed one:
    nodrop + split-lcm).

    nodrop     DFlash: the scheduler does not ask for the EAGLE last-block drop
               (scheduler.py:256-257: use_eagle stays False when use_dflash()); the drafter's
               context K/V at position p is a function of the target's hidden states at p,
               i.e. of tokens 0..p, all inside the hash of the block holding p.
    split-lcm  _mamba_block_aligned_split (scheduler.py:387) aligns GDN states to the
               scheduler block (the LCM of the group block sizes, what hits are aligned to,
               kv_cache_coordinator.py:574-582) instead of cache_config.block_size.
    pad        unify_kv_cache_spec_page_size (kv_cache_utils.py:1113-1116) pads a smaller
               attention page up to the shared page instead of multiplying its block size
               (only with an align-mode Mamba spec present), so every group keeps the
               target's block and the LCM stays the target block.
    drafter-eagle-only  flag only the drafter's KV cache group is_eagle_group (the brief's
               first idea), keeping the drop there and in the GDN split.
    """
    import vllm.v1.core.sched.scheduler as S
    from vllm.config.speculative import SpeculativeConfig

    if "nodrop" in variants:
        orig_init = S.Scheduler.__init__

        def sched_init(self, vllm_config, *a, **kw):
            real = SpeculativeConfig.use_eagle
            # only the scheduler's own use_eagle decision (scheduler.py:256) runs here
            SpeculativeConfig.use_eagle = lambda sc: real(sc) and not sc.use_dflash()
            try:
                orig_init(self, vllm_config, *a, **kw)
            finally:
                SpeculativeConfig.use_eagle = real

        S.Scheduler.__init__ = sched_init  # AsyncScheduler inherits it

    if "split-lcm" in variants:
        orig_split = S.Scheduler._mamba_block_aligned_split

        def split(self, *a, **kw):
            cc = self.cache_config
            saved = cc.block_size
            # fix.diff: the scheduler block (LCM) unless a finer prefix_match_unit turns on
            # the coordinator's partial hits (hash_block_size < cache block)
            if self.hash_block_size >= saved:
                cc.block_size = self.block_size
            try:
                return orig_split(self, *a, **kw)
            finally:
                cc.block_size = saved

        S.Scheduler._mamba_block_aligned_split = split

    if "pad" in variants:
        from dataclasses import replace

        from vllm.v1.kv_cache_interface import AttentionSpec

        orig_unify = KCU.unify_kv_cache_spec_page_size

        def unify(kv_cache_spec):
            page_sizes = {s.page_size_bytes for s in kv_cache_spec.values()}
            align = any(isinstance(s, MambaSpec) and s.mamba_cache_mode == "align"
                        for s in kv_cache_spec.values())
            if len(page_sizes) <= 1 or not align:
                return orig_unify(kv_cache_spec)
            max_page = max(page_sizes)
            out = {}
            for name, s in kv_cache_spec.items():
                if (isinstance(s, AttentionSpec) and not isinstance(s, MambaSpec)
                        and s.page_size_bytes < max_page):
                    # on the H200 the runner sets indexes_kv_by_block_stride=True for
                    # FlashAttention / Triton (NHD, num-blocks-first); the spec built here
                    # has no backend, so it is not checked
                    out[name] = replace(s, page_size_padded=max_page)
                    assert out[name].page_size_bytes == max_page
                else:
                    out[name] = s
            return orig_unify(out)

        KCU.unify_kv_cache_spec_page_size = unify

    if "drafter-eagle-only" in variants:
        orig_groups = KCU.get_kv_cache_groups

        def groups(vllm_config, kv_cache_spec):
            gs = orig_groups(vllm_config, kv_cache_spec)
            sc = vllm_config.speculative_config
            if sc is not None and sc.use_dflash():
                for g in gs:  # the drafter's layers are model.layers.<n_target + i>
                    g.is_eagle_group = g.layer_names[0].startswith("model.layers.")
            return gs

        KCU.get_kv_cache_groups = groups


# ---------------------------------------------------------------------------------------------
# Trace of HybridKVCacheCoordinator.find_longest_cache_hit
# ---------------------------------------------------------------------------------------------
TRACE_LEN = [0]
TRACE_OUT: list[str] = []


def install_trace(coord):
    """Wrap each single-type manager's find_longest_cache_hit to log (group, spec, block,
    max_length, drop, result) while the traced request is looked up."""
    active = [False]
    for sg in coord.attention_groups:
        cls = sg.manager_cls
        if getattr(cls, "_traced", False):
            continue
        orig = cls.find_longest_cache_hit.__func__

        def wrapped(c, *a, _orig=orig, **kw):
            blocks, n = _orig(c, *a, **kw)
            if active[0]:
                spec = kw["kv_cache_spec"]
                TRACE_OUT.append(
                    f"    {c.__name__:28s} groups={kw['kv_cache_group_ids']} "
                    f"block={spec.block_size:4d} max_length={kw['max_length']:5d} "
                    f"drop_eagle_block={kw['drop_eagle_block']!s:5s} "
                    f"alignment={kw['alignment_tokens']} -> {n}")
            return blocks, n

        cls.find_longest_cache_hit = classmethod(wrapped)
        cls._traced = True

    orig_find = coord.find_longest_cache_hit

    def find(block_hashes, max_cache_hit_length):
        on = TRACE_LEN[0] and max_cache_hit_length == TRACE_LEN[0] - 1
        if on:
            active[0] = True
            TRACE_OUT.append(f"  find_longest_cache_hit(max_cache_hit_length="
                             f"{max_cache_hit_length}):")
        try:
            r = orig_find(block_hashes, max_cache_hit_length)
        finally:
            active[0] = False
        if on:
            TRACE_OUT.append(f"  => hit {r[1]} tokens")
            TRACE_LEN[0] = 0  # first lookup of that length only
        return r

    coord.find_longest_cache_hit = find


# ---------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------
def drafter_layer_specs(cfg, block: int, start: int) -> dict:
    """The drafter's attention layers as the GPU runner reports them: vLLM's own
    _resolve_layer_attention (sliding window / causal from the drafter config) and
    Attention.get_kv_cache_spec on a stand-in with the layer's attributes."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention
    from vllm.v1.attention.backend import AttentionType

    hf = cfg.speculative_config.draft_model_config.hf_config
    specs = {}
    with set_current_vllm_config(cfg):
        for i in range(hf.num_hidden_layers):
            window, causal = _resolve_layer_attention(hf, i)
            head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
            stand_in = SimpleNamespace(
                attn_type=AttentionType.DECODER, kv_cache_dtype="auto",
                kv_cache_torch_dtype=cfg.model_config.dtype, sliding_window=window,
                num_kv_heads=hf.num_key_value_heads, head_size=head, head_size_v=head,
                attn_backend=SimpleNamespace(is_mla=lambda: False))
            assert cfg.cache_config.block_size == block
            spec = Attention.get_kv_cache_spec(stand_in, cfg)
            specs[f"model.layers.{start + i}.self_attn.attn"] = spec
            DRAFT_INFO.append((i, window, causal, spec))
    return specs


DRAFT_INFO: list = []


def build_dflash(k: int, block: int, kv_mem: int, max_num_seqs: int,
                 max_num_batched_tokens: int, async_sched: bool, drafter: str):
    model = os.path.join(os.environ.get("MODELS", "/tmp/helper-models"), "qwen35-tiny")
    kw = dict(model=model, max_model_len=R.MAX_MODEL_LEN, max_num_seqs=max_num_seqs,
              kv_cache_memory_bytes=kv_mem, enable_prefix_caching=True,
              mamba_cache_mode="align", language_model_only=True, dtype="bfloat16",
              max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_sched,
              speculative_config={"method": "dflash2", "num_speculative_tokens": k,
                                  "model": drafter, "dflash2_lookup": True})
    cfg = EngineArgs(**kw).create_engine_config()
    cfg.scheduler_config.async_scheduling = async_sched
    cc = cfg.cache_config
    hf = cfg.model_config.hf_text_config
    cc.block_size = block
    cc.mamba_block_size = block
    nspec = cfg.speculative_config.num_speculative_tokens
    _, specs = R.target_layer_specs(cfg, block, cfg.model_config.dtype, KVQuantMode.NONE, nspec)
    specs.update(drafter_layer_specs(cfg, block, hf.num_hidden_layers))
    return R.scheduler_for(cfg, specs, kv_mem)


def ideal(L: int, B: int, eagle: bool) -> int:
    """docs/prefix-cache.md: floor((L-1)/B)*B, minus one block under EAGLE, 0 when the GDN
    state is not where the hit lands (prompt of exactly n*B tokens)."""
    from_fa = (L - 1) // B * B
    state = L - L % B - (B if eagle else 0)
    hit = from_fa - (B if eagle else 0)
    return hit if hit == state and hit > 0 else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="dflash", choices=["off", "mtp", "dflash"])
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--block", type=int, default=0,
                    help="0: 208 for off/k=7, 224 for k=15 as on the H200 (dflash); "
                         "derived like the H200 for off/mtp")
    ap.add_argument("--lens", default="1024-1151")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--kv-mem", type=int, default=3 << 30)
    ap.add_argument("--unbounded", action="store_true",
                    help="a pool large enough that nothing is ever evicted (100 GiB)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--accept", type=int, default=0, help="drafts accepted per step (0: random)")
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--fix", default="", help="comma list of " + ", ".join(FIX_VARIANTS)
                    + "; 'proposed' = nodrop,split-lcm (fix.diff)")
    ap.add_argument("--trace", type=int, default=0, help="prompt length to trace in pass 2")
    ap.add_argument("--drafter", default=DRAFTER)
    ap.add_argument("--max-model-len", type=int, default=2048)
    a = ap.parse_args()
    R.ASYNC = not a.sync
    R.MAX_MODEL_LEN = a.max_model_len
    logging.getLogger("vllm").setLevel(logging.WARNING)
    fix = set(a.fix.replace("proposed", "nodrop,split-lcm").split(",")) - {""}
    assert fix <= set(FIX_VARIANTS), fix
    if fix:
        apply_fix(fix)
    kv_mem = (100 << 30) if a.unbounded else a.kv_mem
    if a.spec == "dflash":
        block = a.block or (224 if a.k >= 15 else 208)
        cfg, kv_cfg, sched, hasher, sbs, hbs = build_dflash(
            a.k, block, kv_mem, a.max_num_seqs, a.max_num_batched_tokens, not a.sync,
            a.drafter)
    else:
        cfg, kv_cfg, sched, hasher, sbs, hbs = R.build(
            a.spec, a.block, a.max_num_batched_tokens, None, None, a.k, not a.sync,
            "bfloat16", "auto", a.max_num_seqs, kv_mem)
    coord = sched.kv_cache_manager.coordinator
    mgrs = coord.single_type_managers
    print(f"spec={a.spec} k={a.k} fix={','.join(sorted(fix)) or 'none'} "
          f"kv_mem={kv_mem} async={not a.sync}")
    for i, win, causal, sp in DRAFT_INFO:
        print(f"  drafter layer {i}: sliding_window={win} causal={causal} -> "
              f"{type(sp).__name__}(block={sp.block_size}, kv_heads={sp.num_kv_heads}, "
              f"head={sp.head_size}, page={sp.page_size_bytes})")
    num_tokens, conc = KCU.get_kv_cache_capacity(cfg, kv_cfg)
    print(f"  scheduler.use_eagle={sched.use_eagle} num_lookahead_tokens="
          f"{sched.num_lookahead_tokens} cache_config.block_size={cfg.cache_config.block_size} "
          f"scheduler_block_size={sbs} hash_block_size={hbs} num_blocks={kv_cfg.num_blocks} "
          f"'GPU KV cache size: {num_tokens:,} tokens' concurrency={conc:.2f}x "
          f"max_num_scheduled_tokens={sched.max_num_scheduled_tokens}")
    print("  groups (spec, layers, block, page, is_eagle_group, manager.use_eagle):")
    for g, m in zip(kv_cfg.kv_cache_groups, mgrs):
        s = g.kv_cache_spec
        print(f"    {type(s).__name__:18s} {len(g.layer_names)} layers {g.layer_names[0]:45s} "
              f"block={s.block_size} page={s.page_size_bytes} is_eagle_group={g.is_eagle_group} "
              f"use_eagle={m.use_eagle}")
    print(f"  coordinator={type(coord).__name__} eagle_group_ids={sorted(coord.eagle_group_ids)} "
          f"partial_hash_hits={getattr(coord, 'enable_partial_hash_hits', None)} "
          f"scheduler.mamba_partial_cache_hit={sched.mamba_partial_cache_hit}")
    if a.trace and hasattr(coord, "attention_groups"):
        install_trace(coord)

    lens = R.parse_lens(a.lens)
    rng = random.Random(1234)
    prompts = [[10 + i] + [rng.randrange(10, 4000) for _ in range(n - 1)]
               for i, n in enumerate(lens)]
    runner = R.FakeRunner(a.k if a.spec != "off" else 0, a.accept)
    h1, s1, st1 = R.run_pass(sched, runner, prompts, "p1", hasher, a.max_tokens, False)
    bp = sched.kv_cache_manager.block_pool
    print(f"  after pass 1: {len(bp.cached_block_hash_to_block)} cached block entries, pool "
          f"{kv_cfg.num_blocks} blocks")
    TRACE_LEN[0] = a.trace
    h2, s2, st2 = R.run_pass(sched, runner, prompts, "p2", hasher, a.max_tokens, False)
    B = cfg.cache_config.block_size
    pred = sum(ideal(n, B, a.spec != "off") for n in lens)
    print(f"pass1: hits={s1[0]} queries={s1[1]} steps={st1}")
    print(f"pass2: prefix_cache hits={s2[0]} queries={s2[1]} steps={st2} "
          f"(docs/prefix-cache.md ideal at block {B}: {pred})")
    by_len = {}
    for i, n in enumerate(lens):
        by_len.setdefault(h2[f"p2-{i}"], []).append(n)
    for hit, ns in sorted(by_len.items()):
        print(f"  pass-2 hit {hit:5d} tokens: {len(ns):3d} prompts, lengths {min(ns)}..{max(ns)}")
    for i, n in enumerate(lens):
        if n == a.trace:
            chunks = [t for t in R.TRACE[f"p1-{i}"] if t[0] < n][:4]
            print(f"trace L={n}: pass-1 chunks (start, end, n_spec) {chunks}")
            print("\n".join(TRACE_OUT))


if __name__ == "__main__":
    main()
