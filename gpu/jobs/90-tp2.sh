#!/usr/bin/env bash
# timeout: 360
# 90-tp2 (issue 10): two GPUs through vLLM's own tensor parallelism. Needs >= 2 visible GPUs
# (the nvidia-h200-x2 kind); with fewer it prints "SKIP: needs 2 GPUs" and exits 0.
# Otherwise, through `python3 -m onecard.launch` with TP=1 and TP=2 (driver: gpu/jobs/90-tp2.py):
# the tiny model (boot, greedy text TP=2 == TP=1, pool vs onecard.memory's prediction, C1/C4
# decode tok/s) and the 27B-geometry checkpoint that job 20 builds (boot, pool, C1/C4), then a
# table with the TP=2/TP=1 tok/s ratios. Run it after job 20 in the same session: gpu/run.sh 20 90.
# NVLink multicast stays off: the launcher puts NCCL_NVLS_ENABLE=0 (and the PyTorch/NVSHMEM
# equivalents, onecard.profiles.TP_CHILD_ENV) in the server env; exported here as well.
# TP2_ARGS: extra driver options, e.g. "--only tiny-tp1 tiny-tp2" or "--gpu-util 0.3".
# Writes: $JOB_OUT/{tp2.json,tp2-table.txt,server-*.log,summary.txt}.
# Exit 0 when every case booted, the tiny greedy text matched and every pool was within 1%.
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/90-tp2}"
: "${MODELS:=/var/tmp/models}"
export JOB_OUT MODELS
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
mkdir -p "$JOB_OUT"
summary="$JOB_OUT/summary.txt"
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
say "== 90-tp2 $(date -u +%FT%TZ) commit ${ONECARD_TREE_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"

# Visible GPUs: CUDA_VISIBLE_DEVICES when set, else nvidia-smi -L; neither = 0 (skip).
if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
  n=$(printf '%s' "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | awk 'NF && $1 !~ /^-/ {n++} /^-/ {exit} END {print n+0}')
  how="CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES'"
elif command -v nvidia-smi >/dev/null 2>&1; then
  n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  how="nvidia-smi -L"
else
  n=0; how="no nvidia-smi"
fi
if [ "${n:-0}" -lt 2 ]; then
  say "SKIP: needs 2 GPUs (${n:-0} visible, $how); run on the nvidia-h200-x2 kind"
  exit 0
fi
say "$n GPUs visible ($how)"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$summary"
nvidia-smi topo -m 2>&1 | head -8 | tee -a "$summary"
ls -d "$MODELS"/qwen38-27b-geom 2>/dev/null | sed 's/^/27B geometry: /' | tee -a "$summary" \
  || say "27B geometry: missing (job 20 builds it); the 27B cases will FAIL"

timeout -k 10 340 python3 gpu/jobs/90-tp2.py --out "$JOB_OUT" --models "$MODELS" --budget 320 ${TP2_ARGS:-} 2>&1 \
  | tee "$JOB_OUT/driver.txt"
rc=${PIPESTATUS[0]}
[ -f "$JOB_OUT/tp2-table.txt" ] && cat "$JOB_OUT/tp2-table.txt" >> "$summary"
grep -h "GPU KV cache size\|Available KV cache memory\|Model loading took\|tensor_parallel_size\|NCCL version\|multicast" \
  "$JOB_OUT"/server-*.log 2>/dev/null | sed 's/^/  /' | head -40 >> "$summary"
# No server of ours may outlive the job (the driver kills each process group; belt and braces).
for pid in $(pgrep -f "vllm.entrypoints.cli.main serve .*--served-model-name tp " 2>/dev/null); do
  say "killing leftover server pid $pid"; kill "$pid" 2>/dev/null
done
say "== 90-tp2: $([ "$rc" -eq 0 ] && echo PASS || echo "FAIL (rc=$rc)")"
exit "$rc"
