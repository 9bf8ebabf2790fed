#!/usr/bin/env bash
# Runs repro_dflash.py over the tiny d2k7 / d2k15 setups (and SPEC=off / mtp as controls), stock
# vLLM 0.27.1 and each candidate fix (monkeypatched). From /work/main:
#   docs/results/2026-12-03-dflash-prefix-cpu/run_matrix.sh > docs/results/2026-12-03-dflash-prefix-cpu/matrix-output.txt
# Needs /tmp/dflash-cpu/patched/vllm (the venv's vllm + patches/series), the tiny drafter at
# /tmp/dflash-cpu/models/qwen35-tiny-dflash2 and /tmp/prefix-spec/site (see FINDINGS.md).
set -u
cd "$(dirname "$0")/../../.."
export MODELS=${MODELS:-/tmp/helper-models}
export PYTHONPATH=/tmp/dflash-cpu/patched:/tmp/prefix-spec/site
R=docs/results/2026-12-03-dflash-prefix-cpu/repro_dflash.py
one() {  # label args...
  local label=$1; shift
  local out
  out=$(timeout 900 .venv-test/bin/python $R "$@" 2>&1)
  local sbs=$(grep -o 'scheduler_block_size=[0-9]*' <<<"$out" | head -1 | cut -d= -f2)
  local nb=$(grep -o 'num_blocks=[0-9]*' <<<"$out" | head -1 | cut -d= -f2)
  local cap=$(sed -n "s/.*GPU KV cache size: \([0-9,]*\) tokens.*/\1/p" <<<"$out" | head -1)
  local p2=$(grep -o 'pass2: prefix_cache hits=[0-9]*' <<<"$out" | grep -o '[0-9]*$')
  local ideal=$(grep -o 'ideal at block [0-9]*: [0-9]*' <<<"$out" | grep -o '[0-9]*$')
  printf '%-34s %-58s sched_block=%-4s blocks=%-6s kv_tokens=%-10s pass2_hits=%-7s ideal(B,eagle)=%s\n' \
    "$label" "$*" "$sbs" "$nb" "$cap" "${p2:-ERROR}" "$ideal"
}
FIXES=(none drafter-eagle-only nodrop pad proposed nodrop,pad)
for k in 7 15; do
  for pool in unbounded 3G; do
    p=""; [[ $pool == unbounded ]] && p=--unbounded
    for f in "${FIXES[@]}"; do
      ff=$f; [[ $f == none ]] && ff=
      one "d2k$k $pool fix=$f" --spec dflash --k $k $p --fix=$ff
    done
  done
done
# controls: the suite's settings (32 seqs, 32 tokens) and the earlier sweep's (8 seqs, 20 tokens)
for f in none proposed nodrop,pad; do
  ff=$f; [[ $f == none ]] && ff=
  one "off 3G fix=$f" --spec off --fix=$ff
  one "off 3G 8seq/20tok fix=$f" --spec off --max-num-seqs 8 --max-tokens 20 --fix=$ff
  one "mtp k4 3G 8seq/20tok fix=$f" --spec mtp --k 4 --max-num-seqs 8 --max-tokens 20 --fix=$ff
  one "mtp k4 3G fix=$f" --spec mtp --k 4 --fix=$ff
done
