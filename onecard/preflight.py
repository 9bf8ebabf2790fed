"""Checks on a resolved ServePlan before a multi-minute boot: refuse (PlanError) or cap (with a
reason recorded in the plan). Pure: no GPU, no vllm import.

Checks, in order:
1. TP>1 in EXTRA_ARGS drops the single-card KV_MEM pin (falls back to GPU_UTIL).
2. ``--dtype float16`` with speculation is refused (drafters and GDN state run in bf16).
3. k > 7 (DFlash2 DFLASH_TOKENS 8..15): CUDA-graph sizes capped to multiples of 1+k and
   max_len capped to 65,536.
4. max_len vs the predicted pool: cap max_len to what one sequence can hold, refuse below 4,096.
5. MAX_SEQS vs pool blocks: vLLM raises "max_num_seqs (N) exceeds available Mamba cache blocks"
   when capturing FULL graphs (config/compilation.py); cap MAX_SEQS to num_blocks.
6. Residency note: each resident sequence holds gdn_groups x (1|2 + k) state blocks.
7. KV_MEM=auto: note that gpu_memory_utilization does not reserve CUDA-graph memory.
"""
from __future__ import annotations

from onecard import memory
from onecard.plan import PlanError, ServePlan

MIN_POOL = 4096
K_GRAPH_LIMIT = 7
K_MAX_LEN_CAP = 65_536


def _extra(plan: ServePlan) -> list[str]:
    return list(plan.get("EXTRA_ARGS"))


def _has_flag_value(extra: list[str], flag: str, value: str) -> bool:
    for i, a in enumerate(extra):
        if a == flag and i + 1 < len(extra) and extra[i + 1] == value:
            return True
        if a == f"{flag}={value}":
            return True
    return False


def run_checks(plan: ServePlan, geom: memory.ModelGeometry = memory.QWEN38_27B) -> ServePlan:
    from onecard.plan import tensor_parallel

    import dataclasses

    extra = _extra(plan)
    k = int(plan.get("SPEC_K"))
    if plan.get("SSM_DTYPE") != "auto":
        geom = dataclasses.replace(geom, ssm_state_bytes=4 if plan.get("SSM_DTYPE") == "float32" else 2)
    # 1. TP > 1
    if tensor_parallel(extra) > 1 and plan.get("KV_MEM") != "auto":
        plan.cap("KV_MEM", "auto", "tensor parallel > 1 in EXTRA_ARGS: the single-card pin does not apply")
    # 2. fp16 + speculation
    if k > 0 and (_has_flag_value(extra, "--dtype", "float16") or _has_flag_value(extra, "--dtype", "half")):
        raise PlanError("--dtype float16 with speculation is refused (drafter/GDN state need bf16); "
                        "valid: SPEC=off with float16, or drop --dtype")
    # 3. k > 7
    if k > K_GRAPH_LIMIT:
        seqs = int(plan.get("MAX_SEQS"))
        sizes = [(1 + k) * n for n in (1, 2, 4, 8) if n <= seqs]
        plan.set("CUDAGRAPH_SIZES", sizes, "cap", f"k={k} > {K_GRAPH_LIMIT}: graphs only for verify batches of {1 + k}")
        if int(plan.get("MAX_LEN")) > K_MAX_LEN_CAP:
            plan.cap("MAX_LEN", K_MAX_LEN_CAP, f"k={k} > {K_GRAPH_LIMIT}: verify batches of {1 + k} tokens")
    # 4-6. pool
    kv_mem = plan.get("KV_MEM")
    if kv_mem == "auto":
        plan.notes.append("KV_MEM=auto: gpu_memory_utilization does not reserve CUDA-graph memory; "
                          "pin KV_MEM for a 24 GB card")
        return plan
    prefix = plan.get("PREFIX_CACHE") == "1"
    max_len = int(plan.get("MAX_LEN"))
    pred = memory.predict_pool(geom, int(kv_mem), plan.get("KV"), max_len, k, prefix)
    one_seq = (pred.num_blocks - pred.state_slots_per_seq) * pred.block_size
    if one_seq < MIN_POOL:
        raise PlanError(f"KV_MEM={kv_mem} gives a pool of {max(one_seq, 0):,} tokens (< {MIN_POOL:,}); "
                        f"valid: KV_MEM >= {memory.kv_mem_for_pool(geom, MIN_POOL, plan.get('KV'), MIN_POOL, k, prefix):,}")
    if one_seq < max_len:
        capped = one_seq // 256 * 256 or one_seq
        plan.cap("MAX_LEN", capped, f"predicted pool holds {one_seq:,} tokens for one sequence (< {max_len:,})")
        pred = memory.predict_pool(geom, int(kv_mem), plan.get("KV"), capped, k, prefix)
    if int(plan.get("MAX_SEQS")) > pred.num_blocks:
        plan.cap("MAX_SEQS", pred.num_blocks,
                 f"vLLM refuses max_num_seqs > Mamba cache blocks ({pred.num_blocks}) with FULL graphs")
    plan.prediction = pred.as_dict()
    resident_full = int(pred.max_concurrency)
    resident_short = pred.num_blocks // (pred.state_slots_per_seq + 1)
    if int(plan.get("MAX_SEQS")) > resident_short:
        plan.notes.append(f"MAX_SEQS={plan.get('MAX_SEQS')} > {resident_short}: even short requests beyond "
                          f"{resident_short} wait for GDN state blocks (the pool has {pred.num_blocks} blocks)")
    plan.notes.append(
        f"each resident sequence holds {pred.state_slots_per_seq} GDN state blocks ({pred.gdn_groups} groups x "
        f"{(2 if prefix else 1)}+{k}); MAX_SEQS={plan.get('MAX_SEQS')} admits, the pool decides residency "
        f"({resident_full} sequence(s) at full {pred.max_len:,} context)")
    return plan
