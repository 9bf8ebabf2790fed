#!/usr/bin/env bash
# Wait for a detached gpu/run.sh (up to SECONDS), print its progress, pack results into $OUT.
# Usage: bash gpu/wait.sh [SECONDS=540]
# GPU_PACK_CACHES=1: also pack the compile caches (Triton, inductor, vLLM torch.compile, FlashInfer)
# into $OUT/gpu-caches.tgz when it stays under 60 MiB (one carry), for the next lease's gpu/run.sh.
OUTROOT=${OUTROOT:-/var/tmp/out}; limit=${1:-540}; t0=$(date +%s)
while [ ! -f "$OUTROOT/DONE" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 5; done
if [ -f "$OUTROOT/DONE" ]; then echo "== driver finished"; else echo "== driver still running after ${limit}s"; fi
tail -c 9000 "$OUTROOT/driver.log" 2>/dev/null
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/results.tgz.tmp" -C "$OUTROOT" . && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"
fi
if [ -n "${OUT:-}" ] && [ "${GPU_PACK_CACHES:-0}" = 1 ]; then
  dirs=()
  for d in "$HOME/.triton/cache" "$HOME/.cache/vllm/torch_compile_cache" "$HOME/.cache/flashinfer" \
           "/tmp/torchinductor_$(id -un)"; do [ -d "$d" ] && dirs+=("${d#/}"); done
  if [ ${#dirs[@]} -gt 0 ]; then
    tar -czf /var/tmp/gpu-caches.tgz -C / "${dirs[@]}" 2>/dev/null
    sz=$(stat -c %s /var/tmp/gpu-caches.tgz 2>/dev/null || echo 0)
    echo "== compile caches: $sz bytes (${dirs[*]})"
    if [ "$sz" -gt 0 ] && [ "$sz" -lt $((60 << 20)) ]; then cp /var/tmp/gpu-caches.tgz "$OUT/gpu-caches.tgz"
    else echo "== compile caches not brought back (over 60 MiB)"; fi
  fi
fi
