"""CPU reproduction: vLLM 0.27.1 v1 Scheduler + KVCacheManager, no model execution.

Mimics the GPU suite's residue sweep on the tiny Qwen3.5 hybrid (GDN "mamba" groups +
full attention), --mamba-cache-mode align, prefix caching, block size forced to 208 like
the H200 log ("Setting attention block size to 208 tokens"), with and without
--speculative-config '{"method":"mtp","num_speculative_tokens":3}'.

Pass 1: all prompts submitted at once, run to completion (20 output tokens each) with
fake ModelRunnerOutputs (sampled tokens + fake MTP drafts fed through
Scheduler.update_draft_token_ids, the synchronous-engine path). Pass 2: same prompts
again; prefix-cache hit tokens read from the scheduler's own admission-time stats
(the source of vllm:prefix_cache_hits).

Usage:
  PYTHONPATH=/tmp/prefix-spec/site .venv-test/bin/python docs/results/2026-12-03-prefix-cache-cpu/repro_sched.py \
      [--spec off|mtp] [--lens 512-639] [--accept N] [--block 208] [--verbose]

Needs the sitecustomize of tests/prepare/vllm_cpu_load.py on PYTHONPATH (torchvision stub)
and the tiny model at $MODELS/qwen35-tiny (MODELS defaults to /tmp/helper-models).
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import sys

import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform

platforms._current_platform = CpuPlatform()

import torch  # noqa: E402

from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_kv_cache_configs,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec  # noqa: E402
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402


def parse_lens(s: str) -> list[int]:
    out = []
    for part in s.split(","):
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out



def target_layer_specs(cfg, block: int, kv_dtype, kv_quant_mode, nspec: int):
    """The tiny target's KV cache specs as vLLM builds them: (the full-attention spec, {layer
    name: spec}) with the GDN layers as align-mode MambaSpecs padded to the attention page and
    holding ``nspec`` speculative state blocks (also used by ../2026-12-03-dflash-prefix-cpu)."""
    import torch

    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM as M

    hf = cfg.model_config.hf_text_config
    attn = FullAttentionSpec(block_size=block, num_kv_heads=hf.num_key_value_heads,
                             head_size=hf.head_dim, dtype=kv_dtype, kv_quant_mode=kv_quant_mode)
    shapes = M.get_mamba_state_shape_from_config(cfg)
    dtypes = M.get_mamba_state_dtype_from_config(cfg)
    mamba = MambaSpec(shapes=tuple(shapes), dtypes=dtypes, block_size=block,
                      page_size_padded=attn.page_size_bytes, mamba_cache_mode="align",
                      num_speculative_blocks=nspec)
    assert mamba.page_size_bytes >= sum(
        torch.Size(s).numel() * torch.tensor([], dtype=d).element_size()
        for s, d in zip(shapes, dtypes))
    specs = {}
    for i, t in enumerate(hf.layer_types):
        if t == "full_attention":
            specs[f"language_model.model.layers.{i}.self_attn.attn"] = attn
        else:
            specs[f"language_model.model.layers.{i}.linear_attn"] = mamba
    return attn, specs

def build(spec: str, block: int, max_num_batched_tokens: int | None,
          long_prefill: int | None, prefix_match_unit: int | None, k: int = 3,
          async_sched: bool = True, dtype: str = "bfloat16", kv: str = "auto",
          max_num_seqs: int = 8, kv_mem: int = 1073741824):
    model = os.path.join(os.environ.get("MODELS", "/tmp/helper-models"), "qwen35-tiny")
    kw = dict(model=model, max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs,
              kv_cache_memory_bytes=kv_mem, enable_prefix_caching=True,
              mamba_cache_mode="align", language_model_only=True, dtype=dtype)
    if kv != "auto":
        kw["kv_cache_dtype"] = kv
    if max_num_batched_tokens:
        kw["max_num_batched_tokens"] = max_num_batched_tokens
    if long_prefill:
        kw["long_prefill_token_threshold"] = long_prefill
    if prefix_match_unit:
        kw["prefix_match_unit"] = prefix_match_unit
    if spec == "mtp":
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    kw["async_scheduling"] = async_sched
    cfg = EngineArgs(**kw).create_engine_config()
    cc = cfg.cache_config
    # the CPU platform turns async scheduling off; the H200 server had it on (default)
    cfg.scheduler_config.async_scheduling = async_sched
    # The CPU platform picks other block sizes than the H200 did; recompute the H200's
    # (platforms/interface.py:~904: align mode, attention block raised until one attention
    # page holds one GDN state, kernel alignment 16) -> 208 bf16, 112 fp32, 400 int8.
    hf = cfg.model_config.hf_text_config
    from vllm.v1.kv_cache_interface import get_kv_quant_mode
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    kv_dtype = cfg.model_config.dtype if kv == "auto" else STR_DTYPE_TO_TORCH_DTYPE[kv]
    attn1 = FullAttentionSpec(block_size=1, num_kv_heads=hf.num_key_value_heads,
                              head_size=hf.head_dim, dtype=kv_dtype,
                              kv_quant_mode=get_kv_quant_mode(kv))
    shapes0 = __import__("vllm.model_executor.models.qwen3_5", fromlist=["x"]) \
        .Qwen3_5ForCausalLM.get_mamba_state_shape_from_config(cfg)
    dtypes0 = __import__("vllm.model_executor.models.qwen3_5", fromlist=["x"]) \
        .Qwen3_5ForCausalLM.get_mamba_state_dtype_from_config(cfg)
    mpage = MambaSpec(shapes=tuple(shapes0), dtypes=dtypes0, block_size=-1).page_size_bytes
    auto_block = 16 * -(-mpage // (16 * attn1.page_size_bytes))  # interface.py:904 with a
    # kernel alignment of 16 (FlashAttention / Triton attention on the H200)
    if block <= 0:
        block = auto_block
    cc.block_size = block
    cc.mamba_block_size = block
    nspec = cfg.speculative_config.num_speculative_tokens if cfg.speculative_config else 0
    attn, specs = target_layer_specs(cfg, block, kv_dtype, get_kv_quant_mode(kv), nspec)
    if spec == "mtp":
        # MTP layer: one full-attention layer of the draft (num_hidden_layers + 0).
        specs[f"mtp.layers.{hf.num_hidden_layers}.self_attn.attn"] = attn
    return scheduler_for(cfg, specs, kv_mem)


def scheduler_for(cfg, specs: dict, kv_mem: int):
    """vLLM's own KV cache config, scheduler and block hasher for these layer specs:
    (cfg, kv_cfg, sched, hasher, scheduler block size, hash block size)."""
    kv_cfg = get_kv_cache_configs(cfg, [specs], [kv_mem])[0]
    sbs, hbs = resolve_kv_cache_block_sizes(kv_cfg, cfg)
    cfg.cache_config.num_gpu_blocks = kv_cfg.num_blocks
    Sched = cfg.scheduler_config.get_scheduler_cls()
    sched = Sched(vllm_config=cfg, kv_cache_config=kv_cfg,
                  structured_output_manager=StructuredOutputManager(cfg),
                  block_size=sbs, hash_block_size=hbs, log_stats=True)
    hash_fn = get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(hbs, hash_fn)
    return cfg, kv_cfg, sched, hasher, sbs, hbs


class FakeRunner:
    """Produces sampled tokens and MTP drafts. `accept` = drafts accepted per verify step
    (-1: a deterministic pseudo-random 0..k per step)."""

    def __init__(self, k: int, accept: int, seed: int = 0):
        self.k, self.accept, self.rng = k, accept, random.Random(seed)

    def tok(self):
        return self.rng.randrange(10, 4000)

    def run(self, so, partial: set) -> tuple[ModelRunnerOutput, DraftTokenIds | None]:
        req_ids, sampled = [], []
        draft_ids, drafts = [], []
        for rid, n in so.num_scheduled_tokens.items():
            req_ids.append(rid)
            spec = so.scheduled_spec_decode_tokens.get(rid, [])
            if rid in partial:  # a partial prefill chunk samples nothing
                sampled.append([])
                continue
            if spec:
                a = self.accept if self.accept >= 0 else self.rng.randint(0, len(spec))
                a = min(a, len(spec))
                sampled.append(list(spec[:a]) + [self.tok()])
            else:
                sampled.append([self.tok()])
            if self.k:
                draft_ids.append(rid)
                drafts.append([self.tok() for _ in range(self.k)])
        out = ModelRunnerOutput(req_ids=req_ids,
                                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        return out, (DraftTokenIds(draft_ids, drafts) if self.k else None)


TRACE: dict[str, list] = {}
ASYNC = True
MAX_MODEL_LEN = 2048
REQS: dict = {}


def run_pass(sched, runner, prompts, tag, hasher, max_tokens, verbose):
    global SCHED
    SCHED = sched
    hits = {}
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        r = Request(f"{tag}-{i}", list(p), sp, None, block_hasher=hasher)
        REQS[r.request_id] = r
        sched.add_request(r)
    steps = 0
    agg = [0, 0]
    queue = []  # async: depth-2 batch queue like EngineCore.step_with_batch_queue
    depth = 2 if ASYNC else 1
    while sched.has_requests() or queue:
        if sched.has_requests():
            so = sched.schedule()
            partial = {rid for rid in so.num_scheduled_tokens
                       if sched.requests[rid].is_prefill_chunk}
            # record chunk boundaries (prefill split points) for the trace
            for rid, n in so.num_scheduled_tokens.items():
                req = sched.requests[rid]
                TRACE.setdefault(rid, []).append(
                    (req.num_computed_tokens - n, req.num_computed_tokens,
                     len(so.scheduled_spec_decode_tokens.get(rid, []))))
            queue.insert(0, (so, partial))
            if len(queue) < depth:
                continue
        so, partial = queue.pop()
        steps += 1
        for nr in so.scheduled_new_reqs:
            hits[nr.req_id] = nr.num_computed_tokens
        out, drafts = runner.run(so, partial)
        if ASYNC:
            drafts = None  # async: drafts stay in the worker (scheduler holds -1 placeholders)
        eco = sched.update_from_output(so, out)
        for o in eco.values():
            st = getattr(o, "scheduler_stats", None)
            if st is not None and st.prefix_cache_stats is not None:
                agg[0] += st.prefix_cache_stats.hits
                agg[1] += st.prefix_cache_stats.queries
        if drafts is not None:
            sched.update_draft_token_ids(drafts)
        if steps > 100000:
            raise RuntimeError("no progress")
    return hits, agg, steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="off", choices=["off", "mtp"])
    ap.add_argument("--lens", default="512-639")
    ap.add_argument("--accept", type=int, default=-1)
    ap.add_argument("--block", type=int, default=0, help="0: derive like the H200 did")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv", default="auto", help="auto | int8_per_token_head")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--kv-mem", type=int, default=1073741824)
    ap.add_argument("--max-tokens", type=int, default=20)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="vLLM's default for the API server on an H200 (>=70 GiB)")
    ap.add_argument("--long-prefill", type=int, default=None)
    ap.add_argument("--prefix-match-unit", type=int, default=None)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--sync", action="store_true", help="async_scheduling=False")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--turn2", type=int, default=0,
                    help="pass 2 = pass-1 prompt + its outputs + N new tokens (multi-turn)")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    global ASYNC, MAX_MODEL_LEN
    ASYNC = not a.sync
    MAX_MODEL_LEN = a.max_model_len
    logging.getLogger("vllm").setLevel(logging.WARNING)

    cfg, kv_cfg, sched, hasher, sbs, hbs = build(
        a.spec, a.block, a.max_num_batched_tokens, a.long_prefill, a.prefix_match_unit,
        a.k, not a.sync, a.dtype, a.kv, a.max_num_seqs, a.kv_mem)
    groups = [(type(g.kv_cache_spec).__name__, len(g.layer_names), g.is_eagle_group)
              for g in kv_cfg.kv_cache_groups]
    mgrs = sched.kv_cache_manager.coordinator.single_type_managers
    import vllm as _v
    print("vllm from", os.path.dirname(_v.__file__))
    print(f"spec={a.spec} scheduler.use_eagle={sched.use_eagle} lookahead={sched.num_lookahead_tokens} "
          f"dtype={a.dtype} kv={a.kv} k={a.k} block={sbs} hash_block={hbs} num_blocks={kv_cfg.num_blocks} "
          f"max_num_scheduled_tokens={sched.max_num_scheduled_tokens} "
          f"coordinator={type(sched.kv_cache_manager.coordinator).__name__} "
          f"scheduler={type(sched).__name__}")
    print("groups (spec, n_layers, is_eagle_group):", groups,
          " manager.use_eagle:", [m.use_eagle for m in mgrs])
    lens = parse_lens(a.lens)
    rng = random.Random(1234)
    # distinct prompts: each starts with a distinct first token so no shared prefix
    prompts = [[10 + i] + [rng.randrange(10, 4000) for _ in range(n - 1)]
               for i, n in enumerate(lens)]
    runner = FakeRunner(a.k if a.spec == "mtp" else 0, a.accept)
    h1, s1, st1 = run_pass(sched, runner, prompts, "p1", hasher, a.max_tokens, a.verbose)
    bp = sched.kv_cache_manager.block_pool
    print(f"after pass 1: {len(bp.cached_block_hash_to_block)} cached block entries in a pool "
          f"of {kv_cfg.num_blocks} blocks ({bp.get_num_free_blocks()} free incl. cached)")
    if a.turn2:
        prompts = [list(p) + list(REQS[f"p1-{i}"].output_token_ids)
                   + [rng.randrange(10, 4000) for _ in range(a.turn2)]
                   for i, p in enumerate(prompts)]
    h2, s2, st2 = run_pass(sched, runner, prompts, "p2", hasher, a.max_tokens, a.verbose)
    print(f"pass1: prefix_cache hits={s1[0]} queries={s1[1]} steps={st1}")
    print(f"pass2: prefix_cache hits={s2[0]} queries={s2[1]} steps={st2} "
          f"(sum of per-request admission hits: {sum(h2.values())})")
    by_len = {}
    for i, n in enumerate(lens):
        by_len.setdefault(h2[f"p2-{i}"], []).append(n)
    for hit, ns in sorted(by_len.items()):
        print(f"  pass-2 hit {hit:5d} tokens ({hit / sbs:.2f} blocks): {len(ns)} prompts, "
              f"lengths {min(ns)}..{max(ns)}")
    # Provenance of every pass-2 hit: the GDN state it reuses must have been written by a
    # pass-1 prefill chunk (no draft tokens) that ended exactly at the hit length.
    ok = bad = 0
    for i, n in enumerate(lens):
        h = h2[f"p2-{i}"]
        if h == 0:
            continue
        t1 = TRACE[f"p1-{i}"]
        if any(e == h and sp == 0 and e <= n for (_, e, sp) in t1) and \
                all(sp == 0 for (b, e, sp) in t1 if b < h):
            ok += 1
        else:
            bad += 1
    print(f"pass-2 hits backed by a pass-1 prefill chunk ending exactly at the hit: {ok}, "
          f"not backed: {bad}")
    if a.verbose:
        for i, n in enumerate(lens):
            print(f"  L={n} p1 chunks={[t for t in TRACE[f'p1-{i}'] if t[0] < n][:6]} "
                  f"p2 hit={h2[f'p2-{i}']}")


if __name__ == "__main__":
    main()
