#!/usr/bin/env bash
# timeout: 660
# KV pool: boot CTX=fast/long through `python3 -m onecard.launch` with the plan's 3090 KV_MEM
# pin (so the H200 emulates a 3090's pool) and print vLLM's "GPU KV cache size: N tokens" next
# to onecard.memory's prediction. Cases: the tiny model (fast, long, fast without spec/prefix)
# and, if job 20 built it, $MODELS/qwen38-27b-geom (fast, long, long with a bf16 GDN state).
# Each boot is --enforce-eager and is killed as soon as the pool lines are logged.
# POOLS_ARGS: extra pools.py options, e.g. "--no-tiny" or "--only long-27b".
# Writes: $JOB_OUT/{pools.json,pools-table.txt,server-*.log,summary.txt}.
# Exit 0 only if every case booted and its pool is within 1% of the prediction.
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/40-pools}"
: "${MODELS:=/var/tmp/models}"
export JOB_OUT MODELS
mkdir -p "$JOB_OUT"
summary="$JOB_OUT/summary.txt"
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
say "== 40-pools $(date -u +%FT%TZ) commit ${ONECARD_TREE_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
python3 -c 'import sys, torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>&1 | tee -a "$summary"
ls -d "$MODELS"/qwen38-27b-geom 2>/dev/null | sed 's/^/27B geometry: /' | tee -a "$summary"

timeout 630 python3 gpu/lib/pools.py --out "$JOB_OUT" --models "$MODELS" --tolerance 0.01 ${POOLS_ARGS:-} 2>&1 | tee "$JOB_OUT/driver.txt"
rc=${PIPESTATUS[0]}
[ -f "$JOB_OUT/pools-table.txt" ] && cat "$JOB_OUT/pools-table.txt" >> "$summary"
grep -h "Setting attention block size\|Padding mamba page\|GPU KV cache size\|Maximum concurrency" "$JOB_OUT"/server-*.log 2>/dev/null | sed 's/^/  /' | head -40 >> "$summary"

# No server of ours may outlive the job (the driver kills each process group; belt and braces).
# (not when sharing the GPU with other jobs: their servers serve $MODELS/ too; gpu/run.sh
# cleans up after the whole group)
[ -z "${GPU_SHARED:-}" ] && for pid in $(pgrep -f "vllm.entrypoints.cli.main serve $MODELS/" 2>/dev/null); do
    say "killing leftover server pid $pid"; kill "$pid" 2>/dev/null
done
say "== 40-pools: $([ "$rc" -eq 0 ] && echo PASS || echo "FAIL (rc=$rc)")"
exit "$rc"
