#!/usr/bin/env bash
# timeout: 900
# 80-reference: the reference performance run, quick tier (issue 11). Needs job 20's checkpoint
# $MODELS/qwen38-27b-geom. Boots the launcher (CTX=fast, 3090 KV_MEM pin, GDN_PREFILL=triton,
# CUDA graphs on) once per arm: patched ($PYTHONPATH) then stock ($STOCK_PYTHONPATH), SPEC=off:
# pools from the boot log vs onecard.memory, C1+C4 decode at ~1k, prefill ~16k, prefix 2 turns
# at ~16k, plain step; then, if the 6-minute budget still fits a boot, SPEC=mtp per arm (verify
# step vs plain). Copy bandwidth measured first with torch (roofline).
# Expected wall: ~5-6 min on a warm machine (4 boots x ~60-80 s + ~25 s of requests per boot);
# cold (first boot of each arm pays Triton JIT + torch.compile) the mtp boots are skipped by the
# budget and the job takes ~8-12 min.
# Writes: $JOB_OUT/{performance.md,results/reference-quick-*.json,results/{patched,stock}/*.json,
#         results/*/runs.jsonl,results/server-*.log,summary.txt}
# Exit 0 only when every essential row (pool fast/off, decode 1k C1+C4, prefill 16k, prefix 16k
# ratio) came out VALID in both arms and the table was written. Goals (>= 80% roofline, verify
# <= 1.3x plain, turn 2 <= 2.5% of turn 1, pools within 1%) are reported, never gating.
# Dry run on a CPU box: REF_SERVER_CMD="exec python3 tests/fake_openai_server.py" REF_BANDWIDTH=4000
# FAKE_VLLM_LOG=1 MODELS=<dir with a qwen38-27b-geom header-only checkpoint> bash gpu/jobs/80-reference.sh
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/80-reference}"
: "${MODELS:=/var/tmp/models}"
export JOB_OUT MODELS
mkdir -p "$JOB_OUT"
summary="$JOB_OUT/summary.txt"; : > "$summary"
say() { echo "$*" | tee -a "$summary"; }
M="$MODELS/qwen38-27b-geom"
say "== 80-reference $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null | tee -a "$summary"
if [ ! -f "$M/config.json" ]; then
  say "no checkpoint at $M: run gpu/jobs/20-geometry.sh first (it builds it)"
  exit 1
fi
[ -n "${STOCK_PYTHONPATH:-}" ] || say "WARNING: STOCK_PYTHONPATH unset: the stock arm will be skipped"

args=(--tier "${REF_TIER:-quick}" --model "$M" --out "$JOB_OUT/results" --md "$JOB_OUT/performance.md"
      --boot-timeout "${REF_BOOT_TIMEOUT:-420}")
[ -n "${REF_SERVER_CMD:-}" ] && args+=(--server-cmd "$REF_SERVER_CMD")
[ -n "${REF_BANDWIDTH:-}" ] && args+=(--bandwidth-gbs "$REF_BANDWIDTH")
# the quick tier's own 360 s skipped both SPEC=mtp boots on 2026-12-02 (28 s left after two
# SPEC=off boots of 117-187 s); REF_BUDGET_S=760 fits them inside this job's 820 s driver limit
[ -n "${REF_BUDGET_S:-}" ] && args+=(--budget-s "$REF_BUDGET_S")
t0=$(date +%s)
timeout -k 45 820 bash bench/reference.sh "${args[@]}" > "$JOB_OUT/reference.txt" 2>&1
rc=$?
wall=$(( $(date +%s) - t0 ))

# No server of ours may outlive the job (the driver stops each process group; belt and braces).
for pid in $(pgrep -f "vllm.entrypoints.cli.main serve $M" 2>/dev/null); do
  say "killing leftover server pid $pid"; kill -9 "$pid" 2>/dev/null
done

grep -E "^\[reference\]" "$JOB_OUT/reference.txt" | tail -30
ref=$(ls -t "$JOB_OUT"/results/reference-*.json 2>/dev/null | head -1)
if [ ! -f "$JOB_OUT/performance.md" ] && [ -n "$ref" ]; then  # driver killed before its table
  say "no table from the driver (rc=$rc): rebuilding it from $ref"
  timeout 60 bash bench/reference.sh --rebuild "$ref" --md "$JOB_OUT/performance.md" >> "$JOB_OUT/reference.txt" 2>&1
fi
if [ -f "$JOB_OUT/performance.md" ]; then
  sed -n '/^## Table/,/^## How to read/p' "$JOB_OUT/performance.md" | grep -v '^## How to read' | tee -a "$summary"
else
  say "no performance.md written; last lines of the driver:"; tail -25 "$JOB_OUT/reference.txt" | tee -a "$summary"
fi
# the driver's own summary last (rows, goals, MISSING lines)
sed -n '/^reference /,$p' "$JOB_OUT/reference.txt" | tee -a "$summary"
say "== 80-reference: rc=$rc wall ${wall}s: $([ $rc -eq 0 ] && echo PASS || echo FAIL)"
exit $rc
