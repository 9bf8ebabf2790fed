#!/usr/bin/env bash
# timeout: 600
# 75-gdn-defer (issue 8, patch 0085): GDN_DEFER=1 keeps one GDN state block per sequence under
# speculation and commits the accepted tokens after rejection (first run: PASS on an H100,
# 2026-12-05; since then the default with speculation on one GPU, GDN_DEFER=auto -> 1).
# tests/gpu/spec_kv_sweep.py --suite defer boots six servers through the launcher's plan on the
# tiny model (+ its tiny DFlash2 drafter), each with its GDN_DEFER set explicitly: CTX=long (int8
# KV), SPEC=off; SPEC=mtp stock (GDN_DEFER=0, the control); SPEC=mtp GDN_DEFER=1 with prefix
# caching (mamba cache mode align) and without (none); SPEC=dflash2 GDN_DEFER=1 at DFLASH_TOKENS
# 7 and 15. MAX_LEN 4096, KV_MEM 1G, MAX_SEQS 16, CUDA graphs, GDN_PREFILL=triton. off boots
# alone first (compile caches; at most 240 s), then the other five at once; per-server boot
# times are printed.
# Checks: greedy, 128 prompts of 1,984..2,111 tokens (every residue mod 128; the 32 decoded
# tokens of about a third of them cross a GDN cache-block boundary), two passes (the 2nd hits the
# prefix cache), all servers at once; every spec server == off token for token, a divergence
# allowed only as a bf16 near-tie, identical / near-ties / real divergences reported per pair and
# pass; spec-decode counters from /metrics (printed only). At boot each server's pool (vLLM's
# "GPU KV cache size") is printed beside the plan's prediction: the defer servers' pools are
# larger at the same KV_MEM (printed, not judged); their logs also carry "onecard 0085:
# ONECARD_GDN_DEFER=1: ..." (at load) and "GDN commit plan: N layers in G KV cache groups" (at
# the first verify step; printed after the sweep).
# Expected wall: 250-560 s. Exit 0 only if every server booted and no pair has a real
# divergence. Writes $JOB_OUT/{defer.json,run.txt,server-*.log,summary.txt}. CPU dry run:
# python3 tests/gpu/spec_kv_sweep.py --suite defer --dry-run (tests/test_gpu_spec_kv_dry.py).
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/75-gdn-defer}"
. gpu/lib/job.sh  # MODELS, $summary, say, kill_leftover_groups
correctness_boots  # outputs only, no timings: no Triton autotuning (gpu/lib/job.sh)
mkdir -p "$MODELS"
job_header
vllm_markers
ensure_tiny_drafter 75-gdn-defer   # the tiny model and its DFlash2 drafter
# everything ends inside the 600 s header
run_driver defer 585 python3 tests/gpu/spec_kv_sweep.py --suite defer --out "$JOB_OUT"
job_end $?
