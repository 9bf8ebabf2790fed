#!/usr/bin/env bash
# timeout: 300
# 30-wide-verify: the split-KV verify-attention kernel (onecard/kernels/wide_verify.py) at the
# real geometry (24 q / 4 kv heads, head_dim 256), one call, <= 5 min. Checks (exit status): ours
# == float64 reference for bf16 / int8 / int4 KV at ragged q_len 1..16, pages 16 and 544, 1 / 7 /
# auto splits, and on caches written by vLLM's own int8/int4 reshape kernels (bench part 1 and
# tests/gpu/test_wide_verify_kernel.py). Prints: the device-to-device copy bandwidth, the table
# for q=16 (ctx 8k/32k/72k/128k x bf16/int8/int4 x batch 1/4: ours vs stock us, speedup, KV GB/s,
# % of copy bandwidth), a sweep of the launch knobs at q=16/32k/batch 1 per dtype (tile, stages,
# 1 vs 2 waves of splits; first row = the sm_90 default), q=8 rows while the budget lasts, and
# the table again at the end. JSON: $JOB_OUT/kernel_verify.json. No timed assertions. The stock
# kernel comes from the pristine vLLM copy (STOCK_PYTHONPATH).
set -u
: "${JOB_OUT:=/var/tmp/out/30-wide-verify}"
mkdir -p "$JOB_OUT"
echo "== $(date -u +%FT%TZ) 30-wide-verify; repo ${ONECARD_TREE_REV:-$(git rev-parse --short HEAD 2>/dev/null)}"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
  --format=csv,noheader 2>&1 || true
PP="${STOCK_PYTHONPATH:-${PYTHONPATH:-.}}"
echo "== pytest -m gpu tests/gpu/test_wide_verify_kernel.py (also warms Triton's cache)"
PYTHONPATH="$PP" timeout -k 5 75 python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/gpu/test_wide_verify_kernel.py 2>&1 | tail -n 20
rc_test=${PIPESTATUS[0]}
if [ "${WV_TEST_ONLY:-0}" = 1 ]; then
  # WV_TEST_ONLY=1: the GPU correctness tests alone (~1-2 min), e.g. after a kernel change whose
  # speed is not in question (2026-12-03: split-count compile buckets)
  echo "== bench skipped (WV_TEST_ONLY=1)"; rc=0
else
echo "== bench/kernel_verify.py (table q=16, sweep, q=8 within the budget)"
PYTHONPATH="$PP" timeout -k 5 195 python3 bench/kernel_verify.py --out "$JOB_OUT" \
  --budget-s 140 --q-lens 16,8
rc=$?
fi
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  echo "kernel_verify TIMED OUT (rc=$rc); partial results in $JOB_OUT/kernel_verify.json"
fi
echo "== 30-wide-verify pytest rc=$rc_test, bench rc=$rc (0: correctness held; figures are informational)"
[ $rc -eq 0 ] && [ $rc_test -eq 0 ]
