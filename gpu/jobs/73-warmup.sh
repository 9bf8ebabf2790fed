#!/usr/bin/env bash
# timeout: 420
# The launcher's boot warm-up (WARMUP=1, onecard/warmup.py) on a bare Triton cache:
# tests/gpu/warmup_check.py starts two tiny SPEC=dflash2 DFLASH_TOKENS=7 servers through
# `python3 -m onecard.launch` (the warm-up is forked there), each with an empty TRITON_CACHE_DIR
# of its own, WARMUP=1 ("warm") and WARMUP=0 ("cold"), and times greedy + sampled requests on each
# (first and second round), the warm arm's after its "onecard warm-up:" line. Figures only (the
# cold first request was 3.21 s on 2026-12-03, job 70); fails only when a server does not boot, a
# request fails, or the warm-up line is missing or reports failures.
# Expected wall: boots 60-200 s (empty Triton caches: every kernel compiles), requests ~20 s.
# Writes $JOB_OUT/{run.txt,warmup.json,server-*.log,summary.txt}. CPU dry run:
# python3 tests/gpu/warmup_check.py --dry-run (tests/dflash/test_gpu_warmup_dry.py).
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/73-warmup}"
. gpu/lib/job.sh  # MODELS, $summary, say, kill_leftover_groups
correctness_boots  # no Triton autotuning: the first-use compiles are what this job looks at
mkdir -p "$MODELS"
job_header
vllm_markers
ensure_tiny_drafter 73-warmup   # the tiny model and its DFlash2 drafter
run_driver warmup 405 python3 tests/gpu/warmup_check.py --out "$JOB_OUT"
job_end $?
