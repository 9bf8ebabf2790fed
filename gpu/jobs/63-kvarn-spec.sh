#!/usr/bin/env bash
# timeout: 600
# 63-kvarn-spec (issue 9): SPEC=mtp and SPEC=dflash2 on the KVarN KV cache (kvarn_k4v2_g128) vs
# SPEC=off, on the tiny model (+ its tiny DFlash2 drafter; head_dim 256 target / 64 drafter). KVarN
# goes into a private view of the patched tree (/var/tmp/site-kvarn-63) exactly as job 61 does
# (61-kvarn-serve.py setup), put first on PYTHONPATH.
# tests/gpu/spec_kv_sweep.py --suite kvarn boots through the launcher's plan, CTX=huge (KVarN),
# MAX_LEN 4096 (tiny KVarN block B = 1,024: a hit under speculation needs prompts > 2B), KV_MEM
# 1G, MAX_SEQS 16, prefix caching on, CUDA graphs (KVARN itself runs eager: piecewise graphs):
#   kvarn-off, kvarn-mtp (k 3) and kvarn-d2k7 (DFLASH_TOKENS 7). SPEC_KV_KNOBS='KNOB=VALUE ...'
#   lays launcher knobs over every server (e.g. 'KVARN_DRAFT_HOST=1 KVARN_WINDOW=3 KVARN_SINKS=2';
#   an exported ONECARD_* is overwritten by the plan).
# kvarn-d2k7 runs with DFLASH_RING=1 (auto with CTX=huge; ONECARD_DFLASH_RING=1 in the server): the
# drafter's layers hand vLLM no KV-cache spec and keep their K/V in per-request bf16 rings beside
# the pool, on FLASH_ATTN (docs/dflash2-huge.md section 3). In the pool they cannot work: the
# drafter's attention is non-causal and KVARN has none, and bf16 skip layers fail at vLLM 0.27.1's
# KV-cache setup (docs/results/2026-12-03-huge-dflash2-cpu). The tiny drafter's window is 64: its
# ring (80 rows) wraps ~30 times per prompt. Not yet run on a GPU.
# Checks: greedy, 128 prompts of 2,176..2,303 tokens (every residue mod 128 = the KVarN tile), 32
# tokens, two passes (2nd hits the prefix cache; hit tokens printed), all servers at once; each
# spec server == kvarn-off token for token (bf16 near-tie rule), reported per pair and pass.
# Expected wall: 200-450 s (two servers; a third boots beside them). Exit 0 only if kvarn-off
# and -mtp booted and no pair diverged; -d2k7 is informational until the rings have booted once
# (its failed boot is reported, a real divergence after boot still fails).
# Writes $JOB_OUT/{kvarn.json,run.txt,server-*.log,summary.txt}. CPU dry run:
# python3 tests/gpu/spec_kv_sweep.py --suite kvarn --dry-run (tests/test_gpu_spec_kv_dry.py).
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/63-kvarn-spec}"
. gpu/lib/job.sh  # MODELS, $summary, say, kill_leftover_groups
correctness_boots  # outputs only, no timings: no Triton autotuning (gpu/lib/job.sh)
mkdir -p "$MODELS"
job_header

# --- KVarN into a private view (job 61's setup; /var/tmp/site is not written). A view of its own,
# not job 61's /var/tmp/site-kvarn: setup deletes and rebuilds its view, and 61 may run beside
# this job in a `+` group.
SITE=/var/tmp/site-kvarn-63
SRC=$(python3 -c 'import importlib.util as u; print(list(u.find_spec("vllm").submodule_search_locations)[0])' 2>/dev/null)
timeout 60 python3 gpu/jobs/61-kvarn-serve.py setup --src "${SRC:-/var/tmp/site/vllm}" --site "$SITE" 2>&1 | tail -2 | tee -a "$summary"
if [ "${PIPESTATUS[0]}" != 0 ]; then say "FAIL: kvarn install into $SITE"; say "== 63-kvarn-spec: FAIL"; exit 1; fi
export PYTHONPATH="$(pwd):$SITE:${PYTHONPATH:-/var/tmp/site}"
vllm_markers
ensure_tiny_drafter 63-kvarn-spec   # the tiny model and its DFlash2 drafter
# whatever setup and build took comes off the driver's time: everything ends inside the header
run_driver kvarn 585 python3 tests/gpu/spec_kv_sweep.py --suite kvarn --out "$JOB_OUT"
rc=$?
grep -h "Setting attention block size\|GPU KV cache size" "$JOB_OUT"/server-kvarn-*.log 2>/dev/null \
  | cut -c1-200 | head -8 | sed 's/^/  /' | tee -a "$summary"
job_end $rc
