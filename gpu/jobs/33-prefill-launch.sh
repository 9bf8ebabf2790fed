#!/usr/bin/env bash
# timeout: 540
# 33-prefill-launch (issues 7 / 11), a TIMING job: run it alone. Patch 0083's ONECARD_PREFILL_LAUNCH
# swept at the kernel level (bench/kernel_prefill.py): vLLM's unified_attention prefill at the
# 27B's attention shape (24 q / 4 kv heads, head_dim 256, pages of 1,552), the last 8,192-token
# chunk of 8k / 32k / 120k prompts, int8 per-token-head and bf16 caches: ms per launch, speedup
# vs vLLM's own launch (BLOCK_M 16), output difference vs stock, shared memory vs the 3090's
# 101,376 bytes (estimate); then a whole 120k prompt (15 chunks) for stock and the fastest
# launch. Needs no server. Then, e2e, pick the winner and run job 62 with
# ARMS62="int8:long:1,int8-pl:long:1:<BLOCK_M:TILE:WARPS:STAGES>" DEPTHS=32768,120000 (TTFT table).
# LAUNCHES overrides the sweep (comma list; 'stock' first). Writes $JOB_OUT/kernel_prefill.json.
# Exit 1 when a launch's output differs from stock by > 2e-2 or fails for another reason than
# not fitting the GPU.
set -u
: "${JOB_OUT:=/var/tmp/out/33-prefill-launch}"
mkdir -p "$JOB_OUT"
echo "== $(date -u +%FT%TZ) 33-prefill-launch; repo ${ONECARD_TREE_REV:-$(git rev-parse --short HEAD 2>/dev/null)}"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
  --format=csv,noheader 2>&1 || true
args=(--out "$JOB_OUT" --budget-s 450)
[ -n "${LAUNCHES:-}" ] && args+=(--launches "$LAUNCHES")
PYTHONPATH="${PYTHONPATH:-.}" timeout -k 10 510 python3 bench/kernel_prefill.py "${args[@]}"
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  echo "kernel_prefill TIMED OUT (rc=$rc); partial results in $JOB_OUT/kernel_prefill.json"
fi
echo "== 33-prefill-launch rc=$rc (0: every launch agreed with stock; timings are informational)"
exit $rc
