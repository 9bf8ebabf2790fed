#!/usr/bin/env bash
# Wait for a detached gpu/run.sh (up to SECONDS), print its progress, pack results into $OUT.
# Usage: bash gpu/wait.sh [SECONDS=540]
OUTROOT=${OUTROOT:-/var/tmp/out}; limit=${1:-540}; t0=$(date +%s)
while [ ! -f "$OUTROOT/DONE" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 5; done
if [ -f "$OUTROOT/DONE" ]; then echo "== driver finished"; else echo "== driver still running after ${limit}s"; fi
tail -c 9000 "$OUTROOT/driver.log" 2>/dev/null
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/results.tgz.tmp" -C "$OUTROOT" . && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"
fi
