#!/usr/bin/env bash
# Drive one GPU session from a copied wheelhouse: install, patch, run gpu/jobs/*, pack results.
# Usage: bash gpu/run.sh [--detach] [JOB-PREFIX ...]   (contract and layout: gpu/README.md)
#   With prefixes, the matching jobs run in the order the prefixes are given.
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

if [ ! -f "$SITE/vllm/__init__.py" ]; then
  ls "$ACC"/chunk_* >/dev/null 2>&1 || { say "no wheelhouse: $SITE is empty and $ACC has no chunk_*"; exit 2; }
  say "installing the wheelhouse to $SITE"
  rm -rf /var/tmp/wh && mkdir -p /var/tmp/wh && cat "$ACC"/chunk_* | tar xf - -C /var/tmp/wh \
    && python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" /var/tmp/wh/*.whl \
    || { say "wheelhouse install failed"; exit 2; }
fi
export PYTHONPATH="$repo:$SITE" STOCK_PYTHONPATH="$repo:$STOCK:$SITE"
export VLLM="python3 -m vllm.entrypoints.cli.main" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
if [ ! -f "$STOCK/vllm/__init__.py" ]; then
  mkdir -p "$STOCK" && cp -a "$SITE/vllm" "$STOCK/" || exit 2
fi
python3 -m onecard patches revert --vllm-dir "$STOCK/vllm" >/dev/null || { say "cannot make $STOCK pristine"; exit 2; }
python3 -m onecard patches apply --vllm-dir "$SITE/vllm" || { say "patch series does not apply"; exit 2; }
python3 -m onecard patches status --vllm-dir "$SITE/vllm"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,power.limit --format=csv,noheader \
  > "$OUTROOT/gpu.txt" 2>&1 || echo "nvidia-smi: not available" > "$OUTROOT/gpu.txt"
cat "$OUTROOT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUTROOT/gpu.txt"

summary="$OUTROOT/summary.txt"; : > "$summary"
pack() {
  [ -n "${OUT:-}" ] || return 0
  tar -czf "$OUT/results.tgz.tmp" -C "$OUTROOT" . && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"
  cp "$summary" "$OUT/summary.txt"
}
jobs=()
if [ $# -eq 0 ]; then
  jobs=("$JOBS_DIR"/*.sh)
else
  for p in "$@"; do
    for job in "$JOBS_DIR"/"$p"*.sh; do [ -f "$job" ] && jobs+=("$job"); done
  done
fi
for job in "${jobs[@]}"; do
  name="$(basename "$job" .sh)"
  limit=$(sed -n 's/^# timeout: *\([0-9]*\).*/\1/p' "$job" | head -1); limit=${limit:-300}
  export JOB_OUT="$OUTROOT/$name"; mkdir -p "$JOB_OUT"
  say "job $name (timeout ${limit}s)"
  t0=$(date +%s)
  (cd "$repo" && timeout -k 15 "$limit" bash "$job") > "$JOB_OUT/log.txt" 2>&1
  rc=$?; dt=$(( $(date +%s) - t0 ))
  pkill -f "vllm.entrypoints" 2>/dev/null; sleep 1; pkill -9 -f "vllm.entrypoints" 2>/dev/null
  printf '%-28s rc=%-4s %5ss\n' "$name" "$rc" "$dt" | tee -a "$summary"
  tail -n 25 "$JOB_OUT/log.txt" | sed "s/^/  [$name] /"
  pack  # after every job, so a call cut off at its time limit still brings back what ran
done
say "summary"; cat "$OUTROOT/gpu.txt" "$summary"
pack
touch "$OUTROOT/DONE"
