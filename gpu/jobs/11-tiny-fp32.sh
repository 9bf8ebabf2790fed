#!/usr/bin/env bash
# timeout: 640
# 11-tiny-fp32: the float32 strict-mode half of the GPU serving suite (tests/gpu/test_serve_suite.py
# -k fp32: SPEC=mtp vs SPEC=off across the 128 prompt-length residues with float32 activations,
# bf16 and int8 KV; four servers booted at once). Job 10 runs the rest of the file; together they
# are `pytest -m gpu tests/gpu/test_serve_suite.py`. Same outputs as job 10, in its own JOB_OUT.
# Expected wall: ~4-6 min after job 10 (warm Triton cache; float32 compiles its own graphs).
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/11-tiny-fp32}"
export JOB_OUT SUITE_K=fp32 SUITE_LIMIT=${SUITE_LIMIT:-560}
exec bash gpu/jobs/10-tiny-suite.sh
