#!/usr/bin/env bash
# timeout: 600
# 71-spec-quant-kv (issue 7): SPEC=mtp and SPEC=dflash2 on int8 and int4 per-token-head KV, on the
# tiny model (+ its tiny DFlash2 drafter). tests/gpu/spec_kv_sweep.py --suite quant boots six
# servers through the launcher's plan: CTX=long with KV=int8_per_token_head and
# KV=int4_per_token_head (TRITON_ATTN, wide verify on), each SPEC=off, SPEC=mtp (k 3) and
# SPEC=dflash2 DFLASH_TOKENS=7; prefix caching on, CUDA graphs, MAX_LEN 2048, KV_MEM 1G,
# MAX_SEQS 16, --gpu-memory-utilization min(0.06, GPU_UTIL/6). int8-off boots alone first (compile
# caches; at most 240 s), then the other five at once; per-server boot times are printed.
# Checks: greedy, 128 prompts of 1,664..1,791 tokens (every residue mod 128; long enough for a
# prefix-cache hit under speculation: B = 400/416 int8, 768..800 int4), 32 tokens, two passes
# (the 2nd hits the prefix cache: hit tokens per server printed), all servers at once; mtp and
# dflash2 == off of the same KV dtype token for token, a divergence allowed only as a bf16
# near-tie (spec token within 2 bf16 ulps of off's top raw logit), identical / near-ties / real
# divergences reported per pair and pass; spec-decode counters from /metrics (printed only).
# Expected wall: 250-520 s (warm caches: boots 60-200 s; sweep ~40 s). Exit 0 only if every
# server booted and no pair has a real divergence.
# Writes $JOB_OUT/{quant.json,run.txt,server-*.log,summary.txt}. CPU dry run:
# python3 tests/gpu/spec_kv_sweep.py --suite quant --dry-run (tests/test_gpu_spec_kv_dry.py).
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/71-spec-quant-kv}"
. gpu/lib/job.sh  # MODELS, $summary, say, kill_leftover_groups
correctness_boots  # outputs only, no timings: no Triton autotuning (gpu/lib/job.sh)
mkdir -p "$MODELS"
job_header
vllm_markers
ensure_tiny_drafter 71-spec-quant-kv   # the tiny model and its DFlash2 drafter
# everything ends inside the 600 s header
run_driver quant 585 python3 tests/gpu/spec_kv_sweep.py --suite quant --out "$JOB_OUT"
job_end $?
