#!/usr/bin/env bash
# timeout: 540
# prejit: no-wait   (measures memory, times nothing)
# 41-fit: does `CTX=long SPEC=dflash2 ./start_qwen.sh` fit a 24 GB card? onecard's memory model
# predicts every SPEC=dflash2 profile at 25.2-25.6 GiB with the drafter as stored (bf16) and
# 23.8-24.2 GiB with DRAFT_QUANT=auto's FP8 drafter (docs/profiles.md), counting ESTIMATED reserves
# (CUDA graphs 0.75 + activations 1.25 + CUDA context 0.5 GiB). This job measures
# the real footprint: gpu/lib/fit.py boots each case of FIT_CASES (default "long-dflash2
# fast-dflash2 long-mtp long-off"; also long-dflash2-bf16 (DRAFT_QUANT=bf16), and huge-dflash2
# huge-mtp, which install KVarN into a private
# site first, as jobs 61-63 do) through `python3 -m onecard.launch` with MODEL=$MODELS/qwen38-27b-geom
# (job 20; FIT_MODEL overrides, e.g. job 22's $MODELS/qwen38-27b-geom-prep), DRAFT=
# $MODELS/qwen38-27b-geom-dflash2 (job 20), CARD_GIB=24 (the 3090's plan: KV_MEM pin, MAX_LEN caps,
# MAX_SEQS), default CUDA graphs, GDN_PREFILL=triton, GPU_UTIL=FIT_GPU_UTIL (0.1: with the pin only
# vLLM's free-memory bar, so the servers boot side by side; as many at once as their predicted
# totals fit the free GPU memory). Per server: nvidia-smi's used_memory summed over its session's
# processes every 0.5 s (FIT_POLL_S), max over boot, one request of MAX_LEN/2 ids + 64 tokens
# (FIT_PROMPT_FRAC), then MAX_SEQS requests at once (greedy); vLLM's memory lines from its log;
# the H200's bare CUDA context from a torch.zeros(1) process. Reported per case: H200 peak MiB,
# the plan's predicted total and certain part, the difference, the reserves as measured, and a
# 3090 ESTIMATE (context swapped for onecard.memory.CUDA_CONTEXT, FIT_CTX_3090_MIB; and for the
# prepared 27B layout: less the memory model's weight difference) against 24 GiB = 24,576 MiB:
# fits / does NOT fit with the margin. A verdict is a figure, never a failure.
# W4A16 GEMMs on Marlin, the kernel vLLM picks on a 3090 (FIT_GEMM=marlin, the default:
# VLLM_DISABLED_KERNELS=MacheteLinearKernel; on sm_90 vLLM would pick Machete: FIT_GEMM=vllm).
# FIT_TORCH_CAP=auto|MiB caps each server's torch caching allocator (gpu/lib/stackdump/onecard_torch_mem.py;
# auto: 24 GiB - the 3090 context estimate - FIT_NONTORCH_MIB (256) + the checkpoint's excess over the
# prepared layout): on the H200 the allocator never frees its cache, on a 24 GiB card it must; a
# capped case that boots and runs its workload fits, one that raises OOM does not. Every server's
# allocator is watched (peak allocated / reserved, retries, OOMs) in any case.
# Run it alone (the default four servers hold ~110 GiB). FIT_FORCE_FIRST_CONFIG=1: servers without
# Triton autotuning (faster boots; the product autotunes, so the default keeps it).
# Writes $JOB_OUT/{fit.json,fit-table.txt,fit-samples.csv,server-*.log,run.txt,summary.txt}.
# Exit 0 when every case booted and its workload ran; 2 for a bad FIT_CASES (one line naming the
# valid cases, before anything boots). CPU dry run: python3 gpu/lib/fit.py --dry-run
# (tests/test_fit_job.py). Figures go to docs/measurements.md and docs/profiles.md's provenance.
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/41-fit}"
. gpu/lib/job.sh  # MODELS, $summary, say, run_driver, kvarn_site, job_header / job_end
job_header
# FIT_CASES checked before anything else (unset: the default four; set but bad: exit 2, one line)
python3 gpu/lib/fit.py --check-cases 2>&1 | tee -a "$summary"
[ "${PIPESTATUS[0]}" = 0 ] || job_end 2
[ -n "${GPU_SHARED:-}" ] && say "WARNING: sharing the GPU with $((GPU_SHARED - 1)) other job(s): this job needs ~110 GiB; run it alone"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$summary"
M=${FIT_MODEL:-$MODELS/qwen38-27b-geom}
D=${FIT_DRAFT:-$MODELS/qwen38-27b-geom-dflash2}
if [ ! -f "$M/config.json" ]; then
  say "FAIL: $M/config.json missing (job 20 builds the 27B-geometry checkpoint first)"
  job_end 1
fi
[ -f "$D/config.json" ] || say "no drafter at $D (job 20 builds it): the SPEC=dflash2 cases will fail"
# a huge case needs KVarN: a private view of the patched tree, first on PYTHONPATH (jobs 31, 61-63)
case "${FIT_CASES:-}" in
  *huge-*) kvarn_site || job_end 1 ;;
esac
# everything ends inside the 540 s header
run_driver fit 525 python3 gpu/lib/fit.py --out "$JOB_OUT" --model "$M" --draft "$D"
rc=$?
[ -f "$JOB_OUT/fit-table.txt" ] && cat "$JOB_OUT/fit-table.txt" >> "$summary"
job_end $rc
