#!/usr/bin/env bash
# timeout: 330
# What a missing FlashInfer costs a sampled request per engine step (#8: the DFlash2 proposer's
# "FlashInfer is NOT installed" warning should carry a measured cost): gpu/probe/sampler_cost.py
# times vLLM's TopKTopPSampler.forward_native (the fallback) and forward_cuda (FlashInfer, in a
# child process that may JIT-compile FlashInfer's sampling module first: up to 240 s) at the 27B
# vocabulary (248,320), top_k 20 / top_p 0.95, rows 1 / 4 / 8 / 32, plus apply_top_k_top_p alone
# (the rejection sampler's filter, which never uses FlashInfer). No servers, no model.
# Expected wall: ~20 s plus FlashInfer's first call. Figures only; fails only if the probe fails.
# Writes $JOB_OUT/{run.txt,sampler_cost.json,summary.txt}. CPU check of the plumbing:
# tests/test_sampler_cost_probe.py.
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/74-sampler-cost}"
. gpu/lib/job.sh  # $summary, say, run_driver, job_header / job_end
job_header
unset VLLM_USE_FLASHINFER_SAMPLER   # gpu/run.sh turns it off for serving jobs; this job measures it
run_driver sampler 315 python3 gpu/probe/sampler_cost.py --json "$JOB_OUT/sampler_cost.json"
job_end $?
