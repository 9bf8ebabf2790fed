#!/usr/bin/env bash
# timeout: 240
# 60-kvarn-kernels: the KVarN (issue 9) Triton kernels (onecard/kvarn/kernels.py) at the real
# geometry (24 q / 4 kv heads, head_dim 256). Checks (exit status): the pack kernel vs the torch
# reference for k4v2_g128 / k4v4_g128 / k4v2_g64 (parameters within an fp16 ulp, codes exact
# off rounding ties, sink copy, untouched blocks), and split-KV decode/verify attention vs the
# float64 reference on the dequantized K/V (ragged q_len 1..16, lagging packs, pages of 1 and 16
# tiles, 1 / 7 / auto splits); prints the error vs unquantized K/V. Then the timing table
# (informational): KVarN k4v2_g128 vs our wide-verify kernel on bf16 / int8 caches at
# 8k / 32k / 128k, q 1 and 16, batch 1 (+ q 16 at 128k with 16-tile pages), and the pack
# kernel's us per tile. JSON in $JOB_OUT/kernel_kvarn.json. Needs no vLLM.
set -u
: "${JOB_OUT:=/var/tmp/out/60-kvarn-kernels}"
mkdir -p "$JOB_OUT"
echo "== $(date -u +%FT%TZ) 60-kvarn-kernels; repo ${ONECARD_TREE_REV:-$(git rev-parse --short HEAD 2>/dev/null)}"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
  --format=csv,noheader 2>&1 || true
PYTHONPATH="${PYTHONPATH:-.}" timeout -k 10 220 python3 bench/kernel_kvarn.py --out "$JOB_OUT" --budget-s 140
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  echo "kernel_kvarn TIMED OUT (rc=$rc); partial results in $JOB_OUT/kernel_kvarn.json"
fi
echo "== 60-kvarn-kernels rc=$rc (0: correctness held; timings are informational)"
exit $rc
