#!/usr/bin/env bash
# timeout: 420
# 30-wide-verify: the split-KV verify-attention kernel (onecard/kernels/wide_verify.py) at the
# real geometry (24 q / 4 kv heads, head_dim 256). Checks (exit status): ours == float64
# reference for bf16 / int8 / int4 KV at ragged q_len 1..16, pages 16 and 544, 1 / 7 / auto
# splits, and on caches written by vLLM's own int8/int4 reshape kernels. Prints: stock
# unified_attention vs reference (input sanity), a small launch-config sweep at 32k, the
# device-to-device copy bandwidth, then the table (q 16/8 x ctx 8k/32k/72k/128k x bf16/int8/int4
# x batch 1/4: ours vs stock us, speedup, KV GB/s, % of copy bandwidth). No timed assertions.
# Also runs tests/gpu/test_wide_verify_kernel.py first. The stock kernel comes from the pristine
# vLLM copy (STOCK_PYTHONPATH).
set -u
: "${JOB_OUT:=/var/tmp/out/30-wide-verify}"
mkdir -p "$JOB_OUT"
echo "== $(date -u +%FT%TZ) 30-wide-verify; repo $(git rev-parse --short HEAD 2>/dev/null)"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
  --format=csv,noheader 2>&1 || true
PP="${STOCK_PYTHONPATH:-${PYTHONPATH:-.}}"
echo "== pytest -m gpu tests/gpu/test_wide_verify_kernel.py (also warms Triton's cache)"
PYTHONPATH="$PP" timeout -k 10 150 python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/gpu/test_wide_verify_kernel.py 2>&1 | tail -n 30
rc_test=${PIPESTATUS[0]}
echo "== bench/kernel_verify.py"
PYTHONPATH="$PP" timeout -k 10 300 python3 bench/kernel_verify.py --out "$JOB_OUT" --budget-s 150
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  echo "kernel_verify TIMED OUT (rc=$rc); partial results in $JOB_OUT/kernel_verify.json"
fi
echo "== 30-wide-verify pytest rc=$rc_test, bench rc=$rc (0: correctness held; figures are informational)"
[ $rc -eq 0 ] && [ $rc_test -eq 0 ]
