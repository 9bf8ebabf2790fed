"""KV pools of CTX=huge (KVarN) + SPEC=dflash2 drafter-KV designs, computed with vLLM 0.27.1's own
KV-cache functions on the CPU (issue #9; docs/dflash2-huge.md).

What runs is vLLM's code: the KV cache spec classes (TQFullAttentionSpec -- what the KVarN patch
returns for a kvarn layer --, FullAttentionSpec, SlidingWindowSpec, MambaSpec with the shapes of
MambaStateShapeCalculator.gated_delta_net_state_shape), then kv_cache_utils.get_kv_cache_groups
(page unification + hybrid grouping), get_kv_cache_config_from_groups, get_kv_cache_capacity ("GPU
KV cache size: N tokens") and _estimate_max_model_len_from_groups (what _check_enough_kv_cache_memory
reports as "estimated maximum model length"). What is NOT vLLM's code here: the per-layer spec
construction (Attention.get_kv_cache_spec / the platform's block-size phases): the target block
comes from onecard.memory.attention_block_size (the Phase-2 rule, H200-verified: 4096 at k=7), and
each design states the drafter spec it would need (a design = a vLLM/KVarN change that makes
get_kv_cache_spec return it). Pristine 0.27.1 suffices (no KVarN install needed).

Usage: .venv-test/bin/python scripts/dflash2_huge_pool.py [--max-len 245760] [--kv-mem N] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from onecard import memory  # noqa: E402

HUGE_MAX_LEN = 245_760  # onecard.profiles CTX_PROFILES["huge"]
KVARN = "kvarn_k4v2_g128"
DRAFT_LAYERS, DRAFT_KV_HEADS, DRAFT_HEAD = 5, 8, 128  # the published 27B DFlash2 drafter
WINDOW = 2048  # DFlash2 sliding window (docs/dflash2.md, quoted config)


def vllm_cfg(max_len: int, max_batched: int, concurrent_batches: int = 1):
    """The VllmConfig fields the 0.27.1 KV functions read (duck-typed, no model needed)."""
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_len),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        cache_config=SimpleNamespace(mamba_cache_mode="align", num_gpu_blocks_override=None),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False,
                                         max_num_batched_tokens=max_batched),
        speculative_config=None, kv_transfer_config=None,
        max_in_flight_tokens=concurrent_batches * max_batched,
    )


def kvarn_bytes_per_token_head(head: int) -> int:
    from onecard.kvarn import format as kvarn_format

    return kvarn_format.bytes_per_token_layer(1, head, kvarn_format.get_preset(KVARN))


@dataclass
class Target:
    geom: memory.ModelGeometry
    k: int  # GDN speculative state blocks (DFLASH_TOKENS)
    block: int
    gdn: object  # MambaSpec (unpadded)
    kvarn: object  # TQFullAttentionSpec at `block`


def target_specs(geom: memory.ModelGeometry, k: int) -> Target:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import KVQuantMode, MambaSpec, TQFullAttentionSpec

    block = memory.attention_block_size(geom, "kvarn", k)
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, geom.linear_num_key_heads, geom.linear_num_value_heads, geom.linear_key_head_dim,
        geom.linear_value_head_dim, geom.conv_kernel, k)
    ssm = torch.float32 if geom.ssm_state_bytes == 4 else torch.bfloat16
    gdn = MambaSpec(block_size=block, shapes=tuple(tuple(s) for s in shapes),
                    dtypes=(torch.bfloat16, ssm), mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                    mamba_cache_mode="align", num_speculative_blocks=k)
    kv = TQFullAttentionSpec(block_size=block, num_kv_heads=geom.num_kv_heads, head_size=geom.head_dim,
                             head_size_v=geom.head_dim, dtype=torch.uint8, kv_quant_mode=KVQuantMode.NONE,
                             tq_slot_size=kvarn_bytes_per_token_head(geom.head_dim))
    assert kv.page_size_bytes >= gdn.page_size_bytes
    return Target(geom, k, block, replace(gdn, page_size_padded=kv.page_size_bytes), kv)


def largest_divisor_block(per_token: int, page: int, primary_block: int, align: int) -> int:
    """Largest multiple of `align` that divides the primary block and whose page fits `page`."""
    b = primary_block
    while b > 0 and (b * per_token > page or primary_block % b):
        b -= align
    assert b > 0
    return b


def drafter_specs(design: str, t: Target) -> dict:
    """The drafter layer specs each design would hand to vLLM (names as qwen3_dflash.py gives them)."""
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVQuantMode, SlidingWindowSpec,
                                            TQFullAttentionSpec)

    page = t.kvarn.page_size_bytes
    n0 = t.geom.num_layers
    names = [f"model.layers.{n0 + i}.self_attn.attn" for i in range(DRAFT_LAYERS)]
    common = dict(num_kv_heads=DRAFT_KV_HEADS, head_size=DRAFT_HEAD, head_size_v=DRAFT_HEAD)
    if design in ("none", "outside-ring", "outside-ring-in-pin"):
        return {}
    if design == "bf16-full-stock":  # --kv-cache-dtype-skip-layers: bf16, block = primary, unpadded
        s = FullAttentionSpec(block_size=t.block, dtype=torch.bfloat16, non_causal=True, **common)
    elif design == "bf16-full-fixed":  # + docs/results/2026-12-03-huge-dflash2-cpu/candidate-fix.diff
        per_tok = FullAttentionSpec(block_size=1, dtype=torch.bfloat16, **common).page_size_bytes
        b = largest_divisor_block(per_tok, page, t.block, 16)
        s = FullAttentionSpec(block_size=b, dtype=torch.bfloat16, non_causal=True, page_size_padded=page,
                              indexes_kv_by_block_stride=True, **common)
    elif design == "swa-stock":  # attention.py:633-667 with skip_page_size_padded = the shared page
        s = SlidingWindowSpec(block_size=16, dtype=torch.bfloat16, sliding_window=WINDOW,
                              page_size_padded=page, indexes_kv_by_block_stride=True, **common)
    elif design in ("swa-divisor", "swa-divisor-g16"):  # SWA block = largest 16-multiple dividing the primary block
        per_tok = SlidingWindowSpec(block_size=1, dtype=torch.bfloat16, sliding_window=WINDOW,
                                    **common).page_size_bytes
        b = largest_divisor_block(per_tok, page, t.block, 16)
        s = SlidingWindowSpec(block_size=b, dtype=torch.bfloat16, sliding_window=WINDOW,
                              page_size_padded=page, indexes_kv_by_block_stride=True, **common)
    elif design == "int8-full":  # int8_per_token_head, full context
        per_tok = FullAttentionSpec(block_size=1, dtype=torch.int8, kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD,
                                    **common).page_size_bytes
        b = largest_divisor_block(per_tok, page, t.block, 16)
        s = FullAttentionSpec(block_size=b, dtype=torch.int8, kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD,
                              non_causal=True, page_size_padded=page, indexes_kv_by_block_stride=True, **common)
    elif design == "kvarn-full":  # drafter in KVarN, block halved to fit the page, page padded
        per_tok = DRAFT_KV_HEADS * kvarn_bytes_per_token_head(DRAFT_HEAD)
        b = largest_divisor_block(per_tok, page, t.block, 128)
        s = TQFullAttentionSpec(block_size=b, dtype=torch.uint8, tq_slot_size=kvarn_bytes_per_token_head(DRAFT_HEAD),
                                page_size_padded=page, indexes_kv_by_block_stride=True, **common)
    elif design == "kvarn-full-stock":  # drafter in KVarN at the primary block (no padding allowed)
        s = TQFullAttentionSpec(block_size=t.block, dtype=torch.uint8,
                                tq_slot_size=kvarn_bytes_per_token_head(DRAFT_HEAD), **common)
    else:
        raise ValueError(design)
    return {n: s for n in names}


DESIGNS = ("none", "bf16-full-stock", "bf16-full-fixed", "swa-stock", "swa-divisor", "swa-divisor-g16",
           "int8-full", "kvarn-full-stock", "kvarn-full", "outside-ring", "outside-ring-in-pin")
RING_ROWS = WINDOW + 16  # a per-request ring: the window + one verify block (1 + up to 15 drafts)


def ring_bytes_per_seq() -> int:
    """bf16 K and V of the drafter's layers for RING_ROWS positions (one request slot)."""
    return DRAFT_LAYERS * RING_ROWS * DRAFT_KV_HEADS * DRAFT_HEAD * 2 * 2


def groups_with_size(specs: dict, group_size: int):
    """vLLM's grouping (_get_kv_cache_groups_uniform_page_size) with the group size forced (the
    stock rule takes the smallest bucket, 5 drafter layers): buckets by equal spec, each split
    into cdiv(n, group_size) groups of layers[i::num_groups], pages unified by vLLM first."""
    from vllm.v1.core import kv_cache_utils as KCU

    specs = KCU.unify_kv_cache_spec_page_size(dict(specs))
    buckets: dict = {}
    for name, s in specs.items():
        buckets.setdefault(s, []).append(name)
    grouped = []
    for layers in buckets.values():
        n = -(-len(layers) // group_size)
        grouped += [layers[i::n] for i in range(n)]
    return KCU.create_kv_cache_group_specs(specs, grouped)


def pool(design: str, geom: memory.ModelGeometry, k: int, kv_mem: int, max_len: int,
         max_batched: int = 2048, concurrent_batches: int = 2, max_seqs: int = 2) -> dict:
    """vLLM's grouping, pool and capacity for one design. 'none' with k: the target alone."""
    from vllm.v1.core import kv_cache_utils as KCU

    t = target_specs(geom, k)
    specs = {}
    for i in range(geom.num_layers):
        if (i + 1) % 4 == 0:  # Qwen3.5 full_attention_interval 4: layers 3, 7, ...
            specs[f"language_model.model.layers.{i}.self_attn.attn"] = t.kvarn
        else:
            specs[f"language_model.model.layers.{i}.linear_attn"] = t.gdn
    specs.update(drafter_specs(design, t))
    cfg = vllm_cfg(max_len, max_batched, concurrent_batches)
    if design == "outside-ring-in-pin":  # the rings come out of the KV pin
        kv_mem -= max_seqs * ring_bytes_per_seq()
    out = {"design": design, "k": k, "max_len": max_len, "target_block": t.block,
           "page": t.kvarn.page_size_bytes}
    try:
        groups = (groups_with_size(specs, geom.num_full_attention) if design.endswith("-g16")
                  else KCU.get_kv_cache_groups(cfg, dict(specs)))
    except NotImplementedError as e:
        out["error"] = f"NotImplementedError: {str(e)[:90]}"
        return out
    kvc = KCU.get_kv_cache_config_from_groups(cfg, groups, kv_mem)
    tokens, conc = KCU.get_kv_cache_capacity(cfg, kvc)
    need = KCU._max_memory_usage_bytes_from_groups(cfg, groups)
    fits = need <= kv_mem
    est = None if fits else KCU._estimate_max_model_len_from_groups(cfg, groups, kv_mem)
    desc = {}
    for g in groups:
        s = g.kv_cache_spec
        key = f"{type(s).__name__}(block={s.block_size})"
        desc[key] = desc.get(key, 0) + 1
    out.update(groups=desc, group_size=max(len(g.layer_names) for g in groups), num_blocks=kvc.num_blocks,
               blocks_per_request=sum(-(-g.kv_cache_spec.max_memory_usage_bytes(cfg) // g.kv_cache_spec.page_size_bytes)
                                      for g in groups),
               pool_tokens=tokens, concurrency=round(conc, 3), fits_max_len=fits, est_max_len=est)
    if est:  # vLLM's own pool at the length it would accept
        cfg2 = vllm_cfg(est, max_batched, concurrent_batches)
        kvc2 = KCU.get_kv_cache_config_from_groups(cfg2, groups, kv_mem)
        out["pool_at_est"] = KCU.get_kv_cache_capacity(cfg2, kvc2)[0]
    if design.startswith("outside-ring"):  # the drafter's K/V outside the pool: one ring per request slot
        out["ring_bytes"] = max_seqs * ring_bytes_per_seq()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-len", type=int, default=HUGE_MAX_LEN)
    ap.add_argument("--kv-mem", type=int, default=memory.LONG_KV_MEM, help="the CTX=huge KV pin")
    ap.add_argument("--k", type=int, default=7, help="DFLASH_TOKENS (GDN speculative state blocks)")
    ap.add_argument("--ssm-bytes", type=int, default=4, help="GDN recurrent state bytes (27B geometry: fp32)")
    ap.add_argument("--max-batched", type=int, default=2048,
                    help="max_num_batched_tokens (vLLM's default on a <70 GiB GPU: 2048)")
    ap.add_argument("--batches", type=int, default=2, help="max_concurrent_batches (async scheduling: 2)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    geom = replace(memory.ModelGeometry(), ssm_state_bytes=a.ssm_bytes)
    rows = [pool("none", geom, 0, a.kv_mem, a.max_len, a.max_batched, a.batches) | {"design": "control SPEC=off (k=0)"}]
    rows += [pool(d, geom, a.k, a.kv_mem, a.max_len, a.max_batched, a.batches) for d in DESIGNS]
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"KV pin {a.kv_mem:,} B, MAX_LEN {a.max_len:,}, k={a.k}, GDN ssm {a.ssm_bytes} B, "
          f"max_num_batched_tokens {a.max_batched} x {a.batches} batches in flight")
    for r in rows:
        if "error" in r:
            print(f"{r['design']:24s} {r['error']}")
            continue
        extra = "" if r["fits_max_len"] else f"  DOES NOT FIT: vLLM max len {r['est_max_len']:,}, pool there {r['pool_at_est']:,}"
        print(f"{r['design']:24s} pool {r['pool_tokens']:>9,} tokens  blocks {r['num_blocks']:>4} "
              f"per-req {r['blocks_per_request']:>4} group_size {r['group_size']:>2} {r['groups']}{extra}"
              + (f"  (+ rings {r['ring_bytes']:,} B)" if "ring_bytes" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
