#!/usr/bin/env bash
# timeout: 1020
# 31-verify-e2e (issues #7, #8): ms per engine step vs SPEC=off on the 27B-geometry random W4A16
# checkpoint ($MODELS/qwen38-27b-geom, built by job 20; skipped cleanly when absent), CTX=long
# (int8 per-token-head KV on TRITON_ATTN, the plan's 3090 KV_MEM pin), C1 greedy (or sampled:
# TEMPERATURE, below), prompts of 8k / 32k tokens (DEPTHS; 73728 may be added, e.g.
# DEPTHS=8192,32768,73728: a depth past a server's max_model_len is skipped for that arm), 48
# tokens out. Arms, one 27B boot each, in this order:
#   off        SPEC=off (plain decode steps)
#   mtp-wide1  SPEC=mtp WIDE_VERIFY=1
#   d2k7       SPEC=dflash2 DFLASH_TOKENS=7   DRAFT=$MODELS/qwen38-27b-geom-dflash2 (job 20 builds
#              it: the published 27B DFlash2 drafter's shapes, random weights)
#   d2k15      SPEC=dflash2 DFLASH_TOKENS=15  (7 drafter rows + 8 lookup positions, LOOKUP=1)
#   mtp-wide0  SPEC=mtp WIDE_VERIFY=0 (informative; only when the time left fits it)
# An arm whose 6th field is `prof` (e.g. d2k7:dflash2:1:7:1:prof) boots with vLLM's torch
# profiler (trace in $PROF_ROOT/prof-LABEL, /var/tmp by default, not packed: it can be tens of
# MB), measures like the others, then resends the first depth's prompt with PROF_TOKENS (40) out between
# /start_profile and /stop_profile; the profiler records PROF_STEPS (24) engine iterations after
# skipping 4 (the resend's short prefill); gpu/probe/trace_summary.py writes prof-LABEL.txt /
# .json (GPU busy vs idle per step, kernels and buckets per step) and vLLM's own table is copied
# to prof-LABEL-vllm.txt. Why: a DFlash2 k=7 step at 8k cost 22.6 ms vs 11.5 plain (2026-12-03),
# ~7 ms more than its kernels' timings predicted.
# ms/step from the server's counters (request_decode_time_seconds_sum / steps, steps = delta
# spec_decode_num_drafts with speculation: one draft per verify step at C1; else generated - 1)
# and from the wall time between stream events. Random weights: acceptance ~0, so every verify
# step yields ~one token; what is compared is the cost of one step.
# Time budget: the job stops starting work at JOB_BUDGET_S (default 1000 s, under the 1020 s
# timeout, so the table is always printed; the job runs detached, past one call's 10 minutes).
# An arm starts only when >= ARM_MIN_S (110 s) are left, and no less than the longest boot so far
# + MEASURE_S; a boot cut short by the budget counts as skipped for time. Its boot may wait up to BOOT_WAIT_S
# (330 s) but never into the MEASURE_S (60 s) kept for measuring. Skipped arms are named in the
# summary. Measured 2026-12-03 on a fresh H200: the `off` boot took 187 s (torch.compile 50 s,
# vLLM's profiling run 93 s: the FLA GDN kernels autotune at every boot) and a dflash2 boot
# more than 220 s (profiling 106 s, then the drafter's compile): four arms take ~15-17 minutes.
# Every arm runs the launcher's defaults unless its 7th field says otherwise, so GDN_DEFER=auto: 1
# with speculation (patch 0085, the default since 2026-12-05; the spec arms' pools and MAX_LEN are
# the deferred ones); a stock arm sets GDN_DEFER=0 there (e.g. d2k7-gd0:dflash2:1:7:1:-:GDN_DEFER=0).
# Spec-arm figures from runs before 2026-12-05 are stock (GDN_DEFER=0).
# Every boot goes through `python3 -m onecard.launch` (the launcher's argv and env), with
# VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (the geometry config's max_position_embeddings may be below
# CTX=long's MAX_LEN).
# Writes $JOB_OUT/{off,mtp-wide1,d2k7,d2k15,mtp-wide0}.json, server-*.log, table.txt, summary.txt.
# Exit 0 when every arm that ran measured all its depths validly (an arm skipped for time or for a
# missing drafter does not fail the job; off and mtp-wide1 must run); the mtp goal (verify step
# <= 1.3x plain step) is printed as MET/MISSED, it does not set the exit.
# REPEATS (3) requests per depth (from the 2nd on they hit the prefix cache): the row kept is the median
# one by server ms/step, every repeat's figure is printed (session 13: one boot's MTP mean moved
# 1.6 ms against another's; a repeat tells a stall inside one request from the boot's own cost).
# Sampled requests: TEMPERATURE (job-wide, default 0 = greedy, today's requests) or an arm's
# TEMPERATURE= field (e.g. d2k7-t07:dflash2:1:7:0:-:TEMPERATURE=0.7) sends requests with that
# temperature and a fixed per-request seed (SEED, default 31, or the arm's SEED=); top_p / top_k
# stay the server's defaults unless the arm sets TOP_P= / TOP_K= (with a temperature > 0). These
# four fields are the client's, never passed to the server. Each arm's JSON and the table mark its
# temperature (a column `[sampled T=0.7]`); a sampled arm's text is not compared with off's.
# An arm's 7th field may also carry ONECARD_* variables for that server process only (the launcher
# hands its environment on to vLLM), e.g. d2k15-host:dflash2:1:15:0:-:LOOKUP_LANE=host;
# one the launcher sets from a knob of its own (ONECARD_WIDE_VERIFY: WIDE_VERIFY) is refused.
# VLLM_DISABLED_KERNELS=MacheteLinearKernel too: the H200 then runs the W4A16 GEMMs on Marlin, the
# kernel vLLM picks on a 3090 (on sm_90 it picks Machete), e.g. off-marlin:off:1:-:1:-:VLLM_DISABLED_KERNELS=MacheteLinearKernel;
# or GEMM=ampere: every variable of onecard.profiles.AMPERE_GEMM_ENV (Marlin for W4A16 and for an FP8
# drafter, DRAFT_QUANT=fp8), e.g. d2k7-q8:dflash2:1:7:1:-:DRAFT_QUANT=fp8,GEMM=ampere.
# Every arm's fields are checked before any boot: a bad one is a one-line error, exit 2.
# SAME_TEXT="a=b c=d" prints, per depth, whether those arms' greedy texts are equal (a knob that
# must leave the target's logits alone, e.g. `d2k7=d2k7-m0` with GDN_SHARED_META=0 in d2k7-m0).
# Dry run without a GPU: JOB31_DRY=1 prints every arm's launcher plan (MODEL=tiny) and exits 0.
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/31-verify-e2e}"
. gpu/lib/job.sh  # MODELS, $summary, say, elapsed, free_port, boot_server, stop_server (trap EXIT)
STOP_TRIES=30     # a 27B server: up to 15 s after SIGTERM
M="$MODELS/qwen38-27b-geom"
D="${DRAFT_DIR:-$MODELS/qwen38-27b-geom-dflash2}"
DEPTHS=${DEPTHS:-8192,32768}
OUT_TOK=${OUT_TOK:-48}
JOB_BUDGET_S=${JOB_BUDGET_S:-1000}  # no work planned past this (the header's timeout is 1020)
ARM_MIN_S=${ARM_MIN_S:-110}        # an arm starts only with this much budget left
BOOT_WAIT_S=${BOOT_WAIT_S:-330}    # the longest one boot may take
MEASURE_S=${MEASURE_S:-60}         # kept for measuring + stopping after a boot
PROF_STEPS=${PROF_STEPS:-24}        # engine iterations a `prof` arm's trace records
PROF_ROOT=${PROF_ROOT:-/var/tmp}    # traces go to $PROF_ROOT/prof-LABEL (not under JOB_OUT)
PROF_TOKENS=${PROF_TOKENS:-40}      # tokens out of the profiled request (4 skipped + PROF_STEPS + slack)
# the arms, in order: LABEL SPEC WIDE_VERIFY DFLASH_TOKENS(- = none) REQUIRED(1: must run)
# [prof|-] [KNOB=VALUE,KNOB=VALUE: more launcher env for this arm, e.g. PREFIX_CACHE=0; CTX=huge
# (KVarN, installed into a private view first) with KVARN_GRAPHS=0|1; ONECARD_*=VALUE for the
# server; TEMPERATURE= / TOP_P= / TOP_K= / SEED= for the requests]
TEMPERATURE=${TEMPERATURE:-0}       # request temperature of every arm without TEMPERATURE= (0 = greedy)
SEED=${SEED:-31}                    # per-request seed of sampled requests (temperature > 0)
ARMS=${ARMS:-"off:off:1:-:1 mtp-wide1:mtp:1:-:1 d2k7:dflash2:1:7:0 d2k15:dflash2:1:15:0 mtp-wide0:mtp:0:-:0"}

# per-step host timing in every server's engine core (gpu/lib/stackdump/onecard_host_timing.py:
# waits, the critical path to the target's launch, metadata builds, the drafter; no GPU syncs)
export ONECARD_HOST_TIMING=${ONECARD_HOST_TIMING:-1} ONECARD_HOST_TIMING_EVERY=${ONECARD_HOST_TIMING_EVERY:-40}
job_header
# an arm with CTX=huge (KVarN) needs kvarn/install.sh's files: a private view as job 62 makes
if [[ " $ARMS " == *CTX=huge* ]]; then
  kvarn_site || say "(the CTX=huge arms will be refused by the launcher)"
fi
PORT=$(free_port)
URL="http://127.0.0.1:$PORT"
# the launcher env of one arm: arm_env SPEC WIDE_VERIFY DFLASH_TOKENS(-: none)
arm_env() {
  local e="MODEL=$M CTX=long SPEC=$1 WIDE_VERIFY=$2 GDN_PREFILL=triton VISION=0 PORT=$PORT HOST=127.0.0.1"
  e="$e SERVED_NAME=geom VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
  [ "$1" = dflash2 ] && e="$e DRAFT=$D DFLASH_TOKENS=$3"
  echo "$e"
}
# an arm's 7th field, KNOB=VALUE[,KNOB=VALUE]: launcher knobs (onecard.profiles.KNOBS) and
# ONECARD_* server variables, one per line out; the client's fields (CLIENT_FIELDS) are left to
# arm_sampling; a bad field is a one-line error
CLIENT_FIELDS=" TEMPERATURE TOP_P TOP_K SEED "
KNOB_NAMES=""
SERVER_VARS=""
extra_env() {
  local label=$1 field=$2 kv name knob
  [ -z "$field" ] && return 0
  [ -n "$KNOB_NAMES" ] || KNOB_NAMES=" $(python3 -c 'from onecard.profiles import KNOBS; print(" ".join(KNOBS))') "
  # the server variables the launcher sets from its knobs, as " VAR=KNOB " words (profiles.SERVER_ENV)
  [ -n "$SERVER_VARS" ] || SERVER_VARS=" $(python3 -c 'from onecard.profiles import SERVER_ENV as E; print(" ".join(f"{v}={k}" for k, v in E.items()))') "
  for kv in ${field//,/ }; do
    name=${kv%%=*}
    [[ "$kv" =~ ^[A-Z][A-Z0-9_]*=[^[:space:]]*$ ]] && [[ "$CLIENT_FIELDS" == *" $name "* ]] && continue
    if [ "$name" = GEMM ]; then
      case "$kv" in
        GEMM=ampere) python3 -c 'from onecard.profiles import AMPERE_GEMM_ENV as E; print("\n".join(f"{k}={v}" for k, v in E.items()))' || return 1 ;;
        GEMM=vllm) ;;
        *) echo "31-verify-e2e: arm $label: '$kv' is not valid; valid: GEMM=ampere (the 3090's Marlin kernels) or GEMM=vllm (vLLM's choice)" >&2; return 1 ;;
      esac
      continue
    fi
    if [[ "$kv" =~ ^ONECARD_[A-Z0-9_]+=[^[:space:]]*$ ]] && [[ "$SERVER_VARS" == *" $name="* ]]; then
      # the plan's child env sets it from the knob and would silently win over the arm's value
      knob=${SERVER_VARS#* $name=}; knob=${knob%% *}
      echo "31-verify-e2e: arm $label: '$kv' is not valid; valid: the launcher knob $knob=VALUE (the launcher sets $name from it)" >&2
      return 1
    fi
    if [[ ! "$kv" =~ ^[A-Z][A-Z0-9_]*=[^[:space:]]*$ ]] || { [[ "$KNOB_NAMES" != *" $name "* ]] && [[ "$name" != ONECARD_?* ]] && [[ "$name" != VLLM_DISABLED_KERNELS ]]; }; then
      echo "31-verify-e2e: arm $label: '$kv' is not valid; valid: KNOB=VALUE[,KNOB=VALUE] with a launcher knob (e.g. PREFIX_CACHE=0), an ONECARD_* server variable the launcher does not set itself (e.g. ONECARD_HOST_TIMING=0), VLLM_DISABLED_KERNELS (e.g. MacheteLinearKernel: the 3090's Marlin GEMMs on the H200), GEMM=ampere|vllm or a request field TEMPERATURE|TOP_P|TOP_K|SEED" >&2
      return 1
    fi
    echo "$kv"
  done
}
# what a request field may hold: sampling_valid NAME VALUE -> nothing when VALUE is valid, else
# the valid values in words (the driver's sampling_params applies the same rules)
sampling_valid() {
  local num='^([0-9]+(\.[0-9]*)?|\.[0-9]+)$'
  case "$1" in
    TEMPERATURE) [[ "$2" =~ $num ]] || echo "a number >= 0 (0 = greedy, e.g. 0.7)" ;;
    SEED) [[ "$2" =~ ^[0-9]+$ ]] || echo "an integer >= 0 (the per-request seed of sampled requests)" ;;
    TOP_P) { [[ "$2" =~ $num ]] && awk -v p="$2" 'BEGIN { exit !(p > 0 && p <= 1) }'; } ||
             echo "0 < TOP_P <= 1 (leave it out for the server's default)" ;;
    TOP_K) [[ "$2" =~ ^(-1|[1-9][0-9]*)$ ]] || echo "-1 (all) or an integer >= 1 (leave it out for the server's default)" ;;
  esac
}
# the client's sampling arguments of one arm: arm_sampling LABEL FIELD -> one line of
# 31-verify-e2e.py arguments (--temperature T, and when T > 0 --seed S [--top-p P] [--top-k K]):
# the job-wide TEMPERATURE / SEED unless the arm's field sets them; a bad value is a one-line error
arm_sampling() {
  local label=$1 field=$2 kv name v why t=$TEMPERATURE s=$SEED p="" k=""
  for kv in ${field//,/ }; do
    name=${kv%%=*} v=${kv#*=}
    [[ "$CLIENT_FIELDS" == *" $name "* ]] || continue
    why=$(sampling_valid "$name" "$v")
    if [ -n "$why" ]; then
      echo "31-verify-e2e: arm $label: '$kv' is not valid; valid: $name=$why" >&2
      return 1
    fi
    case "$name" in TEMPERATURE) t=$v ;; SEED) s=$v ;; TOP_P) p=$v ;; TOP_K) k=$v ;; esac
  done
  if awk -v t="$t" 'BEGIN { exit !(t == 0) }'; then
    if [ -n "$p" ] || [ -n "$k" ]; then
      echo "31-verify-e2e: arm $label: TOP_P= / TOP_K= with temperature $t is not valid; valid: TOP_P= / TOP_K= only with TEMPERATURE > 0 (sampled requests)" >&2
      return 1
    fi
    echo "--temperature $t"   # greedy: the requests as before, no seed
    return 0
  fi
  echo "--temperature $t --seed $s${p:+ --top-p $p}${k:+ --top-k $k}"
}
# the job-wide request settings, then every arm's fields: checked before the dry run and before
# any boot
for v in TEMPERATURE SEED; do
  why=$(sampling_valid "$v" "${!v}")
  [ -z "$why" ] || { echo "31-verify-e2e: $v='${!v}' is not valid; valid: $why" >&2; exit 2; }
done
for arm in $ARMS; do
  IFS=: read -r label _ _ _ _ _ extra <<< "$arm"
  extra_env "$label" "$extra" > /dev/null && arm_sampling "$label" "$extra" > /dev/null || exit 2
done

if [ "${JOB31_DRY:-0}" = 1 ]; then
  if [ ! -f "$D/config.json" ]; then
    # a dry run's plan reads only DRAFT's config.json: the geometry drafter's, without weights
    D="$JOB_OUT/dry-drafter"
    python3 -m onecard.dflash.tiny_drafter --geometry 27b --out "$D" --config-only | tee -a "$summary"
  fi
  for arm in $ARMS; do
    IFS=: read -r label spec wv k _ _ extra <<< "$arm"
    xenv=$(extra_env "$label" "$extra") || exit 2
    samp=$(arm_sampling "$label" "$extra") || exit 2
    say "-- plan $label: SPEC=$spec WIDE_VERIFY=$wv$([ "$k" != - ] && echo " DFLASH_TOKENS=$k")${extra:+ $extra}"
    say "   requests: $samp"
    # a vLLM without patch 0080's / KVarN's markers (the pristine CPU test vLLM) refuses
    # SPEC=dflash2 / CTX=huge at plan time; the dry run plans as if they were installed
    # (onecard.profiles.pretend_installed; the GPU host has them)
    env $(arm_env "$spec" "$wv" "$k") $xenv MODEL=tiny python3 - <<'PY' 2>&1 | grep -E '^(argv|child env|WIDE_VERIFY|KV |KV_MEM|SPEC|DFLASH|MAX_LEN|DRAFT|\(dry)' | tee -a "$summary"
import sys, tempfile
from onecard import profiles
from onecard.launch import main
if all(profiles.feature_installed(f) for f in profiles.FEATURE_MARKERS):
    sys.exit(main(["--dry-run"]))
print("(dry run: this vLLM lacks patch 0080's or KVarN's marker; planned as if installed)")
with profiles.pretend_installed(tempfile.mkdtemp()):
    rc = main(["--dry-run"])
sys.exit(rc)
PY
  done
  say "== 31-verify-e2e dry run done"
  exit 0
fi

if [ ! -f "$M/config.json" ]; then
  say "SKIP: $M/config.json missing (job 20 builds the 27B-geometry checkpoint first)"
  exit 0
fi

# A second run on a warm machine writes into the same JOB_OUT: move the earlier run's arm files
# aside (kept, packed with the rest) so the table and its ratios only use arms of this run
# (session 14: a lone d2k7 run took its 'vs off' ratio from the previous run's off.json).
shopt -s nullglob
earlier=("$JOB_OUT"/*.json "$JOB_OUT"/server-*.log "$JOB_OUT"/prof-* "$JOB_OUT"/table.tx[t])
shopt -u nullglob
if [ ${#earlier[@]} -gt 0 ]; then
  prev="$JOB_OUT/earlier-$(date -u +%H%M%S)"
  mkdir -p "$prev" && mv "${earlier[@]}" "$prev/" && say "moved ${#earlier[@]} file(s) of an earlier run to $prev"
fi

status=0
ran=""
skipped=""
failed=""
max_boot=0  # the longest boot so far (s): a later arm needs at least that much + MEASURE_S
# run_arm LABEL SPEC WIDE_VERIFY DFLASH_TOKENS REQUIRED: boot, measure, stop; rc 0 measured,
# 1 not valid, 2 skipped (time or drafter)
run_arm() {
  local label=$1 spec=$2 wv=$3 k=$4 prof=${5:-} extra=${6:-} left wait mt specflag="" profargs=() envargs=() sampargs=()
  [ "$spec" != off ] && specflag="--spec"
  read -ra envargs <<< "$(arm_env "$spec" "$wv" "$k")"
  local xenv
  xenv=$(extra_env "$label" "$extra") || { failed="$failed $label(arm)"; return 1; }
  envargs+=($xenv)
  local samp
  samp=$(arm_sampling "$label" "$extra") || { failed="$failed $label(arm)"; return 1; }
  read -ra sampargs <<< "$samp"
  if [ "$prof" = prof ]; then
    rm -rf "$PROF_ROOT/prof-$label"
    envargs+=("EXTRA_ARGS=--profiler-config.profiler=torch --profiler-config.torch_profiler_dir=$PROF_ROOT/prof-$label --profiler-config.torch_profiler_with_stack=false --profiler-config.ignore_frontend=true --profiler-config.delay_iterations=4 --profiler-config.max_iterations=$PROF_STEPS")
    profargs=(--profile-depth "${DEPTHS%%,*}" --profile-tokens "$PROF_TOKENS")
  fi
  if [ "$spec" = dflash2 ] && [ ! -f "$D/config.json" ]; then
    say "($label skipped: no drafter at $D (job 20 builds it))"; skipped="$skipped $label(no-drafter)"; return 2
  fi
  left=$((JOB_BUDGET_S - $(elapsed)))
  # an arm needs a boot as long as the longest one so far (2026-12-05, cold H100: off booted in 243 s,
  # then mtp got 57 s of a 430 s budget and was counted a failed boot)
  need=$ARM_MIN_S; [ $((max_boot + MEASURE_S)) -gt "$need" ] && need=$((max_boot + MEASURE_S))
  if [ "$left" -lt "$need" ]; then
    say "($label skipped: ${left}s left of the ${JOB_BUDGET_S}s budget < ${need}s for a 27B boot + measurement (ARM_MIN_S=${ARM_MIN_S}, longest boot so far ${max_boot}s))"
    skipped="$skipped $label(time)"; return 2
  fi
  wait=$((left - MEASURE_S)); [ "$wait" -gt "$BOOT_WAIT_S" ] && wait=$BOOT_WAIT_S
  say "[$(elapsed)s] booting $label (SPEC=$spec WIDE_VERIFY=$wv$([ "$k" != - ] && echo " DFLASH_TOKENS=$k")${extra:+ $extra}; boot may take ${wait}s)"
  local t_boot=$(elapsed)
  if ! boot_server "$label" "$wait" env "${envargs[@]}" python3 -m onecard.launch; then
    if [ "$wait" -lt "$BOOT_WAIT_S" ]; then  # cut short by the job budget, not a boot failure
      say "$label: not healthy within ${wait}s (the budget's remainder; BOOT_WAIT_S=${BOOT_WAIT_S}): skipped for time"
      skipped="$skipped $label(time)"; return 2
    fi
    say "$label: boot failed or not healthy within ${wait}s"; failed="$failed $label(boot)"; return 1
  fi
  t_boot=$(( $(elapsed) - t_boot )); [ "$t_boot" -gt "$max_boot" ] && max_boot=$t_boot
  grep -E "attention block size|GPU KV cache size|Maximum concurrency|Model loading took" \
    "$JOB_OUT/server-$label.log" | tail -4 | tee -a "$summary"
  mt=$((JOB_BUDGET_S - $(elapsed) - 15)); [ "$mt" -gt 150 ] && mt=150; [ "$mt" -lt 20 ] && mt=20
  timeout -k 5 "$mt" python3 gpu/jobs/31-verify-e2e.py --url "$URL" --model geom --label "$label" $specflag \
    --depths "$DEPTHS" --out-tokens "$OUT_TOK" --repeats "${REPEATS:-3}" --json "$JOB_OUT/$label.json" "${sampargs[@]}" "${profargs[@]}" 2>&1 | tee -a "$summary"
  local rc=${PIPESTATUS[0]}
  stop_server
  # the engine core's per-step host timing (ONECARD_HOST_TIMING, on by default here)
  grep -h "\[onecard host timing\] steps" "$JOB_OUT/server-$label.log" | tail -3 | sed "s/^.*\[onecard/$label: [onecard/" | tee -a "$summary"
  if [ "$prof" = prof ]; then
    cp "$PROF_ROOT/prof-$label"/profiler_out_*.txt "$JOB_OUT/prof-$label-vllm.txt" 2>/dev/null
    timeout -k 5 120 python3 gpu/probe/trace_summary.py "$PROF_ROOT/prof-$label" --steps "$PROF_STEPS" \
      --json "$JOB_OUT/prof-$label.json" > "$JOB_OUT/prof-$label.txt" 2>&1
    head -12 "$JOB_OUT/prof-$label.txt" | tee -a "$summary"
    grep -A 5 "^host per step" "$JOB_OUT/prof-$label.txt" | tee -a "$summary"  # the host's waits
  fi
  if [ "$rc" != 0 ]; then
    say "$label: measurement not valid (rc $rc$([ "$rc" = 124 ] && echo ", cut at ${mt}s"))"; failed="$failed $label"; return 1
  fi
  ran="$ran $label"
  return 0
}

for arm in $ARMS; do
  IFS=: read -r label spec wv k required prof extra <<< "$arm"
  run_arm "$label" "$spec" "$wv" "$k" "$prof" "$extra"
  rc=$?
  if [ $rc = 1 ] && [ "$label" != mtp-wide0 ]; then status=1; fi
  if [ $rc = 2 ] && [ "$required" = 1 ]; then status=1; fi
done

python3 - "$JOB_OUT" $ARMS <<'PY' 2>&1 | tee "$JOB_OUT/table.txt" | tee -a "$summary"
import json, os, sys
out = sys.argv[1]
LABELS = ("off", "mtp-wide1", "d2k7", "d2k15", "mtp-wide0")
# arms named in ARMS beyond the five (e.g. d2k7-wv0: the drafter's attention on stock) get a
# column of their own after them
LABELS += tuple(a.split(":")[0] for a in sys.argv[2:] if a.split(":")[0] not in LABELS)
NAMES = {"mtp-wide1": "mtp (WIDE_VERIFY=1)", "d2k7": "dflash2 k7", "d2k15": "dflash2 k15",
         "mtp-wide0": "mtp (WIDE_VERIFY=0)"}
arms = {}
temp = {}  # an arm's request temperature (0 = greedy; a JSON without the field is from a greedy-only job)
for label in LABELS:
    p = os.path.join(out, label + ".json")
    if os.path.exists(p):
        rec = json.load(open(p))
        arms[label] = {r["depth"]: r for r in rec["rows"] if not r.get("skipped")}
        temp[label] = rec.get("temperature") or 0.0
f = lambda x: "-" if x is None else f"{x:.2f}"
mark = lambda c: f" [sampled T={temp[c]:g}]" if temp.get(c) else ""  # noqa: E731
cols = ["mtp-wide1", "d2k7", "d2k15"] + [k for k in LABELS[4:] if k in arms]
sampled = [c for c in arms if temp.get(c)]
mode = ("greedy" if not sampled else "sampled (seeded)" if len(sampled) == len(arms)
        else "greedy, the columns marked [sampled T=..] sampled (seeded)")
print(f"ms per engine step, C1 {mode}, CTX=long int8 KV, 27B geometry, random weights "
      "(server counters / client stream gaps; ratio = server ms vs off)")
print(f"| depth | off{mark('off')} ms/step | " + " | ".join(f"{NAMES.get(c, c)}{mark(c)} ms/step (ratio)" for c in cols)
      + " | mtp goal <= 1.3x |")
print("|---|---|" + "---|" * len(cols) + "---|")
depths = sorted({d for a in arms.values() for d in a})
# the goal column judges SPEC=mtp on the wide kernel: the arm labelled mtp-wide1, else one labelled
# mtp (gpu/README's next lease names it so; session 36's table left the column empty for it)
goal_arm = next((a for a in ("mtp-wide1", "mtp") if a in arms), None)
def cell(r):
    return "-" if r is None else f"{f(r.get('server_ms_per_step'))} / {f(r.get('client_ms_per_step'))}"
for d in depths:
    off = arms.get("off", {}).get(d)
    def ratio(r):
        try:
            return r["server_ms_per_step"] / off["server_ms_per_step"]
        except (TypeError, KeyError, ZeroDivisionError):
            return None
    cells = []
    for c in cols:
        r = arms.get(c, {}).get(d)
        cells.append(f"{cell(r)} ({f(ratio(r))}x)" if r is not None else "-")
    r1 = ratio(arms.get(goal_arm, {}).get(d)) if goal_arm else None
    goal = "-" if r1 is None else ("MET" if r1 <= 1.3 else "MISSED")
    print(f"| {d} | {cell(off)} | " + " | ".join(cells) + f" | {goal} |")
print("tokens per verify step (acceptance; ~1.0 with random weights): " + "; ".join(
    f"{c}{mark(c)} " + ",".join(f(arms[c][d].get("tokens_per_step")) for d in depths if d in arms[c])
    for c in cols if c in arms))
def first_diff(a, b):
    if a is None or b is None:
        return "-"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"differs at char {i}"
    return "same" if len(a) == len(b) else f"prefix-equal ({len(a)} vs {len(b)} chars)"
print("greedy text vs SPEC=off (informative: random weights make near-ties, bf16 order can flip them):")
for d in depths:
    off = arms.get("off", {}).get(d, {}).get("text")
    for k in cols:
        if d in arms.get(k, {}):
            if temp.get(k) or temp.get("off"):
                print(f"  depth {d} {k}: not compared (sampled requests: {k}{mark(k) or ' greedy'}, off{mark('off') or ' greedy'})")
                continue
            print(f"  depth {d} {k}: {first_diff(arms[k][d].get('text'), off)}")
# SAME_TEXT="a=b c=d": arms whose greedy text must be equal (the same speculation, a knob that must
# not change the target's logits, e.g. GDN_SHARED_META=0); a repeat pair (the same arm twice) shows
# whether two boots of one configuration agree at all
pairs = [p.split("=", 1) for p in os.environ.get("SAME_TEXT", "").split() if "=" in p]
for a, b in pairs:
    for d in depths:
        ta = arms.get(a, {}).get(d, {}).get("text")
        tb = arms.get(b, {}).get(d, {}).get("text")
        verdict = "-" if ta is None or tb is None else ("SAME" if ta == tb else "DIFFER: " + first_diff(ta, tb))
        if temp.get(a) or temp.get(b):  # seeded sampled texts: equal only if both sides sample alike
            verdict += f" (sampled: {a}{mark(a) or ' greedy'}, {b}{mark(b) or ' greedy'}; informative)"
        print(f"same text {a} = {b}, depth {d}: {verdict}")
PY
say "arms measured:${ran:- none}"
[ -n "$skipped" ] && say "arms skipped:$skipped (not measured: see the lines above; a warm machine fits all four)"
[ -n "$failed" ] && say "arms not valid:$failed"
say "== 31-verify-e2e done in $(elapsed)s: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
