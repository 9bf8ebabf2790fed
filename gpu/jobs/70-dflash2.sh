#!/usr/bin/env bash
# timeout: 480
# SPEC=dflash2 (patch 0080) on the tiny model vs SPEC=off: tests/gpu/test_dflash2.py boots three
# servers at once through the launcher's plan (off; dflash2 DFLASH_TOKENS=7 greedy drafting;
# dflash2 DFLASH_TOKENS=15 = 7 drafter rows + 8 lookup positions, probabilistic drafting),
# prefix caching on, default CUDA graphs, GDN_PREFILL=triton, --language-model-only.
# Checks: (1) greedy 128 prompt-length residues x 2 passes (2nd hits the prefix cache), 32
# tokens, concurrent: d2k7 and d2k15 == off token for token, a divergence allowed only as a bf16
# near-tie (spec token = off's top-2, raw-logit gap <= 2 bf16 ulps), each reported;
# (2) /metrics spec_decode_num_accepted_tokens_per_pos shows positions 0..k-1 for k 7 and 15,
# copy-task tokens/step 15 vs 7 (random drafter: plumbing, not speed); (3) if >= 40 s are left,
# sampled chi-square (T=1, whole vocabulary) at tokens 2..4 vs off, p >= 1e-3.
# Expected wall: boots 45-200 s (first boot of the DFlash drafter compiles), checks ~40 s;
# the script stops itself at ~445 s (header 480 since it shares a group with the GPU suite) (2026-12-02: boots 161-207 s in a four-job group and 47 s of
# greedy checks left the sampled check no time under the old 300 s limit).
# Writes $JOB_OUT/{log of the run,dflash2.json,server-*.log,summary.txt}. Exit 0 only if every check held. CPU dry run: python3 tests/gpu/test_dflash2.py
# --dry-run (tests/dflash/test_gpu_dflash2_dry.py).
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/70-dflash2}"
. gpu/lib/job.sh  # MODELS, $summary, say, kill_leftover_groups
correctness_boots  # outputs only, no timings: no Triton autotuning (gpu/lib/job.sh)
mkdir -p "$MODELS"
job_header
vllm_markers
ensure_tiny_drafter 70-dflash2   # the tiny model and its DFlash2 drafter
# everything ends inside the 480 s header
run_driver dflash2 465 python3 tests/gpu/test_dflash2.py --out "$JOB_OUT"
job_end $?
