#!/usr/bin/env bash
# Wait for a detached gpu/run.sh (up to SECONDS), print its progress, pack results into $OUT.
# Usage: bash gpu/wait.sh [SECONDS=540]
# GPU_PACK_CACHES=1: also pack the compile caches (Triton, inductor, vLLM torch.compile, FlashInfer,
# the CUDA driver's JIT cache that gpu/run.sh names)
# as 15 MiB parts in /var/tmp/cache-parts (a call brings back at most 8 files of 16 MiB, 64 MiB in
# all: fetch them 4 per call; 2026-12-02 they were 267 MB = 18 parts), for the next lease.
OUTROOT=${OUTROOT:-/var/tmp/out}; limit=${1:-540}; t0=$(date +%s)
while [ ! -f "$OUTROOT/DONE" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 5; done
if [ -f "$OUTROOT/DONE" ]; then echo "== driver finished"; else echo "== driver still running after ${limit}s"; fi
tail -c 9000 "$OUTROOT/driver.log" 2>/dev/null
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/results.tgz.tmp" -C "$OUTROOT" . && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"
fi
if [ "${GPU_PACK_CACHES:-0}" = 1 ]; then
  dirs=()
  for d in "$HOME/.triton/cache" "$HOME/.cache/vllm/torch_compile_cache" "$HOME/.cache/flashinfer" \
           "/tmp/torchinductor_$(id -un)" "${CUDA_CACHE_PATH:-/var/tmp/cuda-jit-cache}"; do [ -d "$d" ] && dirs+=("${d#/}"); done
  rm -rf /var/tmp/cache-parts && mkdir -p /var/tmp/cache-parts
  if [ ${#dirs[@]} -gt 0 ] && tar -czf - -C / "${dirs[@]}" 2>/dev/null \
       | split -b 15M -d -a 2 - /var/tmp/cache-parts/gpu-caches.part-; then
    n=$(ls /var/tmp/cache-parts | wc -l)
    echo "== compile caches: $(du -cb /var/tmp/cache-parts/* | tail -1 | cut -f1) bytes in $n parts of <= 15 MiB" \
         "under /var/tmp/cache-parts (${dirs[*]}); fetch 4 per call: cp /var/tmp/cache-parts/gpu-caches.part-0[0-3] \$OUT/"
  fi
fi
