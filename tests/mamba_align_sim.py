"""Drive vLLM's own Scheduler / AsyncScheduler and KVCacheManager on the CPU over the 27B's
CTX=fast pool (one full-attention group + 3 GDN groups of 16 layers sharing 111 blocks of 784
tokens, mamba_cache_mode "align", prefix caching) and print one JSON line: the pool's peak
usage, the state blocks each request held per GDN group at its peak, how many requests ran at
once, preemptions and the step each request started and ended. No model runs: every scheduled
step returns one sampled token per decoding request. Used by tests/test_mamba_align_state_patch.py
with the pristine or the patched vLLM first on PYTHONPATH.

  python tests/mamba_align_sim.py --model-dir DIR --prompts 32102,32102 [--async] [--max-tokens 128] [--blocks 111]
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def write_model_dir(d: Path) -> Path:
    """A config-only directory ModelConfig accepts (the scheduler never loads weights)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "rope_theta": 10000.0}))
    return d


def run(model_dir: str, prompts: list[int], async_: bool, max_tokens: int = 128, blocks: int = 111,
        block_size: int = 784, chunk: int = 2048, gdn_groups: int = 3, max_steps: int = 5000) -> dict:
    import torch

    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms.current_platform = CpuPlatform()
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                            MambaSpec)
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    logging.disable(logging.WARNING)
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=65536, dtype="bfloat16")
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=chunk, max_model_len=65536,
                         enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=async_)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=True, mamba_cache_mode="align")
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc)
    vc.cache_config.num_gpu_blocks = blocks
    attn = FullAttentionSpec(block_size=block_size, num_kv_heads=4, head_size=256, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=block_size, shapes=((10, 128, 128),), dtypes=(torch.bfloat16,),
                      mamba_cache_mode="align")
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn" for i in range(16)], attn)]
    groups += [KVCacheGroupSpec([f"model.layers.{g}_{i}.gdn" for i in range(16)], mamba) for g in range(gdn_groups)]
    kcfg = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[KVCacheTensor(size=1, shared_by=[])],
                         kv_cache_groups=groups)
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kcfg, vc)
    sched = (AsyncScheduler if async_ else Scheduler)(
        vllm_config=vc, kv_cache_config=kcfg, structured_output_manager=StructuredOutputManager(vc),
        block_size=sched_bs, hash_block_size=hash_bs, log_stats=True)
    fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    init_none_hash(fn)
    hasher = get_request_block_hasher(hash_bs, fn)
    for i, p in enumerate(prompts):
        toks = [(i * 1000003 + j * 7919) % 30000 + 1 for j in range(p)]  # distinct: no cache hits
        sched.add_request(Request(f"r{i}", toks, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                                  block_hasher=hasher))
    coord, pool = sched.kv_cache_manager.coordinator, sched.kv_cache_manager.block_pool
    preempted = collections.Counter()
    orig = sched._preempt_request

    def preempt(req, *a, **kw):
        preempted[req.request_id] += 1
        return orig(req, *a, **kw)

    sched._preempt_request = preempt
    state_peak: dict[str, int] = collections.defaultdict(int)
    peak_usage, most_running, step = 0.0, 0, 0
    first, done = {}, {}
    pending = collections.deque()
    while sched.requests and step < max_steps:
        step += 1
        so = sched.schedule()
        for r in so.num_scheduled_tokens:
            first.setdefault(r, step)
        peak_usage = max(peak_usage, pool.get_usage())
        most_running = max(most_running, len(sched.running))
        for rid in list(sched.requests):
            held = [sum(1 for b in m.req_to_blocks.get(rid, []) if not b.is_null)
                    for m in coord.single_type_managers[1:]]
            state_peak[rid] = max(state_peak[rid], max(held) if held else 0)
        sampling = {r for r in so.num_scheduled_tokens if not sched.requests[r].is_prefill_chunk}
        pending.append((so, sampling))
        if len(pending) >= (2 if async_ else 1) or so.total_num_scheduled_tokens == 0:
            o, s = pending.popleft()
            ids = list(o.num_scheduled_tokens)
            before = set(sched.requests)
            sched.update_from_output(o, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[123] if r in s else [] for r in ids]))
            for r in before - set(sched.requests):
                done[r] = step
    return {"async": async_, "prompts": prompts, "steps": step, "peak_usage": round(peak_usage, 4),
            "state_blocks_peak": dict(state_peak), "most_running": most_running,
            "preemptions": dict(preempted), "first_step": first, "finished_step": done,
            "unfinished": sorted(sched.requests)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prompts", default="32102")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--async", dest="async_", action="store_true")
    ap.add_argument("--blocks", type=int, default=111, help="num_blocks of the pool (the null block included)")
    a = ap.parse_args()
    print(json.dumps(run(str(write_model_dir(Path(a.model_dir))), [int(x) for x in a.prompts.split(",")],
                         a.async_, a.max_tokens, blocks=a.blocks)))


if __name__ == "__main__":
    main()
