#!/usr/bin/env bash
# Where a wide-verify tile's time goes (issue #7): Nsight Compute on one launch of the q=16 verify
# kernel at 32k, batch 1, for each launch named in gpu/lib/ncu_launch.py (int8 / int4 / bf16;
# 2-D and flat word loads). No vLLM needed (the image's torch + Triton, this tree):
#   bash gpu/lib/ncu_probe.sh [OUT_DIR]
# Writes ncu-<label>.txt (speed of light, warp state / stall reasons, scheduler, occupancy, memory
# workload) and sass-<label>-summary.txt (stalls and bank conflicts by SASS instruction) per
# launch. When ncu is absent or the driver refuses counters (ERR_NVGPUCTRPERM), it says so on one
# line and exits 0: the probe is informational.
set -u
out="${1:-${OUT:-.}}"
mkdir -p "$out"
ncu_bin="$(command -v ncu || ls /usr/local/cuda*/bin/ncu /usr/local/cuda*/nsight-compute*/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n1)"
if [ -z "$ncu_bin" ]; then
  echo "ncu_probe: no ncu on this machine (looked in PATH, /usr/local/cuda*/bin, /opt/nvidia/nsight-compute)"
  exit 0
fi
echo "ncu_probe: $ncu_bin ($("$ncu_bin" --version 2>&1 | tail -n1))"
here="$(cd "$(dirname "$0")/../.." && pwd)"
# NCU_LABELS="int8-flat bf16-default" profiles those only (default: every label)
for label in ${NCU_LABELS:-$(PYTHONPATH="$here" python3 "$here/gpu/lib/ncu_launch.py" --list)}; do
  # launch-skip 2: the first calls compile and warm up; one profiled launch of the split kernel
  PYTHONPATH="$here" timeout -k 5 120 "$ncu_bin" --target-processes all \
    --kernel-name regex:_wide_verify_split_kernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section SourceCounters \
    python3 "$here/gpu/lib/ncu_launch.py" --label "$label" > "$out/ncu-$label.txt" 2>&1
  rc=$?
  if grep -q "ERR_NVGPUCTRPERM" "$out/ncu-$label.txt"; then
    echo "ncu_probe: the driver refuses performance counters here (ERR_NVGPUCTRPERM); nothing measured"
    exit 0
  fi
  echo "ncu_probe: $label rc=$rc -> $out/ncu-$label.txt"
  # the per-instruction view (SASS): bank conflicts and stall reasons by instruction, summarized
  # here (the CSV itself is ~1 MB) by gpu/probe/ncu_source_summary.py
  csv="${TMPDIR:-/tmp}/ncu-src-$label.csv"
  PYTHONPATH="$here" timeout -k 5 120 "$ncu_bin" --target-processes all \
    --kernel-name regex:_wide_verify_split_kernel --launch-skip 2 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
    python3 "$here/gpu/lib/ncu_launch.py" --label "$label" > "$csv" 2>&1 \
    && python3 "$here/gpu/probe/ncu_source_summary.py" "$csv" > "$out/sass-$label-summary.txt" 2>&1
  head -n 14 "$out/sass-$label-summary.txt" 2>/dev/null
  grep -E "Duration|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Issue Slots Busy|Memory Throughput|DRAM Throughput|Stall|No Eligible" \
    "$out/ncu-$label.txt" | head -n 20
done
exit 0
