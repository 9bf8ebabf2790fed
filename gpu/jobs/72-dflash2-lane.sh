#!/usr/bin/env bash
# timeout: 480
# The DFlash2 lookup lane measured end to end (patch 0080): tests/gpu/dflash2_lane.py builds an
# "agreeing pair" (onecard.dflash.agree: a tiny Qwen3.5 target and a tiny DFlash2 drafter that
# both always predict one ordinary token X, so every draft is accepted and verify positions
# 7..14 are reached) and boots four servers at once through the launcher's plan, MODEL=<agree
# dir> DRAFT=<agree drafter>: off; dflash2 DFLASH_TOKENS=7; DFLASH_TOKENS=15 (lookup on);
# DFLASH_TOKENS=15 LOOKUP=0. Prefix caching on, default CUDA graphs, GDN_PREFILL=triton,
# --gpu-memory-utilization GPU_UTIL/4 each (default 0.08).
# Checks: 8 prompts (4 with a run of 40 X, 4 without), greedy 96 tokens: every server's output
# is all X and == off's; /metrics tokens/step (1 + accepted/drafts) d2k15 > d2k7 + 3 and d2k15
# accepted at positions 7..14 > 0. d2k15-nolook is reported only (its fill repeats X: accepted).
# Expected: d2k7 ~8, d2k15 and d2k15-nolook ~13-16 tokens/step; boots 45-200 s, checks ~10 s.
# Before the servers: pytest -m gpu tests/gpu/test_dflash2_lane_kernel.py (the device lane's Triton
# match == torch at up to 245,760 tokens, us per match printed; lane-kernel.txt).
# Writes $JOB_OUT/{run.txt,lane.json,lane-kernel.txt,server-*.log,summary.txt,build.txt}. Exit 0 only if every
# check held. CPU dry run: python3 tests/gpu/dflash2_lane.py --dry-run
# (tests/dflash/test_agree_pair.py).
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/72-dflash2-lane}"
. gpu/lib/job.sh  # MODELS, $summary, say, kill_leftover_groups
correctness_boots  # outputs only, no timings: no Triton autotuning (gpu/lib/job.sh)
mkdir -p "$MODELS"
job_header
vllm_markers
# the device lane's kernel at serving sizes first (ONECARD_DFLASH_LANE=device, the default): Triton
# == torch, rows == the host lane, us per match printed; <= 60 s, a failure fails the job
timeout -k 5 60 "${PY:-python3}" -m pytest -m gpu -q -s -p no:cacheprovider -o addopts="" \
    tests/gpu/test_dflash2_lane_kernel.py > "$JOB_OUT/lane-kernel.txt" 2>&1
rc_kernel=$?
grep -E "^\[lane-kernel\]|passed|failed" "$JOB_OUT/lane-kernel.txt" | tee -a "$summary"
[ $rc_kernel -eq 0 ] || { tail -20 "$JOB_OUT/lane-kernel.txt" | tee -a "$summary"; say "lane kernel test FAILED rc=$rc_kernel"; }
# the tiny model and the agreeing pair (CPU, cached in $MODELS)
timeout 120 "${PY:-python3}" -m onecard.dflash.agree > "$JOB_OUT/build.txt" 2>&1
rc=$?
tail -1 "$JOB_OUT/build.txt" | tee -a "$summary"
if [ $rc -ne 0 ]; then say "agreeing pair build FAILED rc=$rc"; say "== 72-dflash2-lane: FAIL"; exit 1; fi
# everything ends inside the 480 s header
run_driver lane 465 python3 tests/gpu/dflash2_lane.py --out "$JOB_OUT"
rc=$?
[ $rc_kernel -eq 0 ] || rc=1
job_end $rc
