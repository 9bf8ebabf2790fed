#!/usr/bin/env bash
# Runs repro_sched.py over the H200 sweep configurations, stock vLLM 0.27.1 and patched.
# Usage: docs/results/2026-12-03-prefix-cache-cpu/run_matrix.sh [stock|patched|keep|all]   (from /work/main)
# Needs: /tmp/prefix-spec/site (sitecustomize, see FINDINGS.md) and, for patched/keep,
# /tmp/prefix-spec/patched/vllm (a copy of the venv's vllm with fix.diff [+ the opt-in diff]).
set -u
cd "$(dirname "$0")/.."
export MODELS=${MODELS:-/tmp/helper-models}
which=${1:-all}
one() {  # label pythonpath args...
  local label=$1 pp=$2; shift 2
  local out
  out=$(PYTHONPATH=$pp timeout 900 .venv-test/bin/python docs/results/2026-12-03-prefix-cache-cpu/repro_sched.py "$@" 2>&1)
  local blk=$(grep -o 'block=[0-9]*' <<<"$out" | head -1)
  local nb=$(grep -o 'num_blocks=[0-9]*' <<<"$out" | head -1)
  local p2=$(grep -o 'pass2: prefix_cache hits=[0-9]*' <<<"$out" | grep -o '[0-9]*$')
  local fp=$(grep -o 'after pass 1: [0-9]*' <<<"$out" | grep -o '[0-9]*$')
  printf '%-28s %-40s %-10s %-15s footprint=%-5s pass2_hits=%s\n' "$label" "$*" "$blk" "$nb" "$fp" "$p2"
}
CFGS=(
  "bf16-off|--spec off"
  "bf16-mtp|--spec mtp --k 4"
  "int8-off|--spec off --kv int8_per_token_head --max-num-seqs 4"
  "int8-mtp|--spec mtp --k 3 --kv int8_per_token_head --max-num-seqs 4"
  "fp32-off|--spec off --dtype float32"
  "fp32-mtp|--spec mtp --k 4 --dtype float32"
)
S=/tmp/prefix-spec/site; P=/tmp/prefix-spec/patched:/tmp/prefix-spec/site
for c in "${CFGS[@]}"; do
  name=${c%%|*}; args=${c#*|}
  [[ $which == stock || $which == all ]] && one "stock $name" $S $args
  [[ $which == patched || $which == all ]] && one "patched $name" $P $args
  [[ $which == keep || $which == all ]] && [[ $name == *mtp ]] && \
    ONECARD_EAGLE_KEEP_LAST_BLOCK=1 one "patched+KEEP $name" $P $args
done
