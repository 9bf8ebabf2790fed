#!/usr/bin/env bash
# timeout: 600
# 61-kvarn-serve (issue 9): the KVarN KV cache served by vLLM 0.27.1. kvarn/install.sh's
# installer puts KVarN into a private view of the patched tree (/var/tmp/site-kvarn: symlinks +
# copies; /var/tmp/site is not written), put first on PYTHONPATH. Then:
#  1. SmolLM2-135M with --kv-cache-dtype kvarn_k4v2_g128 (KVARN backend, eager, 4k, seed 0, the
#     same flags as job 32 minus --attention-backend): teacher-forced logprobs + 96-token greedy
#     continuations of job 32's 6 texts (gpu/jobs/32-kv-quality.py measure), one needle (~2.2k
#     tokens) at the server's default read rule (fp16 window 3 + two sink tiles since 2026-12-04
#     session 17; label kvarn); then the same at window 1 + one sink (label kvarn-w1,
#     ONECARD_KVARN_WINDOW=1 ONECARD_KVARN_SINKS=1, the rule before 2026-12-04; KVARN_W1=0 skips
#     it); then the k4v4_g128 preset at the default rule (label kvarn-v4, the launcher's
#     KVARN_PRESET=k4v4_g128; KVARN_V4=0 skips it); then window 2 + one sink (label kvarn-w2s1,
#     ONECARD_KVARN_WINDOW=2 ONECARD_KVARN_SINKS=1, the default until session 17; KVARN_W2S1=0
#     skips it): the read rules side by side in one lease;
#     perplexity delta vs bf16 and int8 from job 32's files of this session
#     (/var/tmp/out/32-kv-quality; compared after part 2, waiting for job 32 when it runs beside
#     this one in a `+` group), or a bf16 boot of our own when job 32 did not run (right after
#     the KVarN server, before part 2: the files are kept if part 2 is cut).
#  2. If $MODELS/qwen38-27b-geom exists: CTX=huge through `python3 -m onecard.launch` (SPEC=mtp
#     default, KV_MEM pin, 245,760): "GPU KV cache size" vs onecard.memory's prediction, block
#     size, health, C1 decode tok/s at an 8k prompt; CTX=long (int8) the same if time is left.
# Writes $JOB_OUT/{kvq-*.json,compare.json,needle.json,huge.json,server-*.log,summary.txt}.
# Exit 0 when: install held, SmolLM2 served with KVarN, its perplexity is within 25 % of bf16
# (a broken integration is far worse; the 0.5 % goal is printed MET / NOT MET), and the huge boot (if the 27B
# geometry exists) came up healthy with a pool within 1 % of the prediction.
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/61-kvarn-serve}"
: "${VLLM:=python3 -m vllm.entrypoints.cli.main}"
. gpu/lib/job.sh  # MODELS, $summary, say, elapsed, free_port, boot_server, stop_server (trap EXIT)
job_header
H="gpu/jobs/61-kvarn-serve.py"
status=0

# --- 0. install into a private view ------------------------------------------------------------
kvarn_site || exit 1
python3 -m onecard.kvarn.installer --status 2>&1 | tee -a "$summary"

# --- 1. SmolLM2 ----------------------------------------------------------------------------------
SMOL=$(timeout 120 python3 -c 'from onecard.prepare.gguf import ensure_smollm2; print(ensure_smollm2())' 2>"$JOB_OUT/convert.log" | tail -1)
if [ -z "$SMOL" ] || [ ! -f "$SMOL/config.json" ]; then
  say "FAIL: no SmolLM2 checkpoint"; tail -5 "$JOB_OUT/convert.log" | tee -a "$summary"; exit 1
fi
PORT=$(free_port)
URL="http://127.0.0.1:$PORT"
boot() {  # boot LABEL WAIT_S ARGS...
  local label=$1 wait=$2; shift 2
  say "[$(elapsed)s] booting $label ($*)"
  boot_server "$label" "$wait" $VLLM serve "$SMOL" --host 127.0.0.1 --port "$PORT" --served-model-name smol \
    --enforce-eager --seed 0 --max-model-len 4096 --max-num-seqs 4 ${SERVE_MEM_ARGS:---gpu-memory-utilization 0.30} "$@"
}
if boot kvarn 130 --kv-cache-dtype kvarn_k4v2_g128; then
  grep -E "KVARN|fp16 window|attention block size|GPU KV cache size" "$JOB_OUT/server-kvarn.log" | head -5 | cut -c1-200 | tee -a "$summary"
  timeout -k 5 60 python3 gpu/jobs/32-kv-quality.py measure --url "$URL" --model smol --label kvarn \
    --json "$JOB_OUT/kvq-kvarn.json" 2>&1 | tee -a "$summary"
  [ "${PIPESTATUS[0]}" = 0 ] || { say "kvarn: measurement failed"; status=1; }
  timeout -k 5 30 python3 "$H" needle --url "$URL" --model smol --json "$JOB_OUT/needle.json" 2>&1 | tee -a "$summary"
  stop_server
else
  status=1
fi
# a further SmolLM2 KVarN arm: LABEL, its name in messages, NAME=VALUE settings for the server's
# environment, --, the server's flags; its perplexity goes to kvq-LABEL.json
quality_arm() {
  local label=$1 what=$2; shift 2
  while [ $# -gt 0 ] && [ "$1" != -- ]; do local -x "$1"; shift; done  # exported for this call only
  shift
  if boot "$label" 130 "$@"; then
    grep -E "KVARN|fp16 window|GPU KV cache size" "$JOB_OUT/server-$label.log" | head -3 | cut -c1-200 | tee -a "$summary"
    timeout -k 5 60 python3 gpu/jobs/32-kv-quality.py measure --url "$URL" --model smol --label "$label" \
      --json "$JOB_OUT/kvq-$label.json" 2>&1 | tail -2 | tee -a "$summary"
    stop_server
  else
    say "$what: boot failed"; return 1
  fi
}
if [ "${KVARN_W1:-1}" = 1 ]; then  # window 1 + one sink (the read rule before 2026-12-04), same server flags
  quality_arm kvarn-w1 "kvarn window 1" ONECARD_KVARN_WINDOW=1 ONECARD_KVARN_SINKS=1 -- \
    --kv-cache-dtype kvarn_k4v2_g128
fi
if [ "${KVARN_V4:-1}" = 1 ]; then  # the k4v4_g128 preset (launcher KVARN_PRESET=k4v4_g128), default rule
  quality_arm kvarn-v4 "kvarn k4v4_g128" -- --kv-cache-dtype kvarn_k4v4_g128 || status=1
fi
if [ "${KVARN_W2S1:-1}" = 1 ]; then  # window 2 + one sink (the default until session 17)
  quality_arm kvarn-w2s1 "kvarn window 2 + sink 1" ONECARD_KVARN_WINDOW=2 ONECARD_KVARN_SINKS=1 -- \
    --kv-cache-dtype kvarn_k4v2_g128 || status=1
fi
# --- 1b. the bf16 baseline, before the 27B part (2026-12-03: booted after it, it never ran: the
# huge boot used the time left, and the quality comparison had no pair). Only when job 32 is not
# in this lease (its files are the baselines then, compared below).
J32=/var/tmp/out/32-kv-quality
if [ -f "$JOB_OUT/kvq-kvarn.json" ] && [ ! -d "$J32" ]; then
  if boot bf16 130 --attention-backend TRITON_ATTN; then
    timeout -k 5 60 python3 gpu/jobs/32-kv-quality.py measure --url "$URL" --model smol --label bf16 \
      --json "$JOB_OUT/kvq-bf16.json" 2>&1 | tail -2 | tee -a "$summary"
    timeout -k 5 30 python3 "$H" needle --url "$URL" --model smol --json "$JOB_OUT/needle-bf16.json" 2>&1 | tee -a "$summary"
    stop_server
  else
    say "bf16 baseline: boot failed"
  fi
fi

# --- 2. 27B geometry, CTX=huge (KVARN_HUGE=0 skips it: its pool was measured = the prediction in
# the third and the eleventh sessions; a 27B boot costs ~2.5-4 minutes) ----------------------------
if [ "${KVARN_HUGE:-1}" = 1 ]; then
  say "[$(elapsed)s] 27B geometry: CTX=huge via onecard.launch"
  timeout -k 5 $(( 585 - $(elapsed) )) python3 "$H" huge --out "$JOB_OUT" --models "$MODELS" \
    --deadline $(( T0 + 580 )) 2>&1 | tee -a "$summary"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
else
  say "27B CTX=huge part skipped (KVARN_HUGE=0)"
fi
grep -h "Setting attention block size\|Padding mamba page\|GPU KV cache size" "$JOB_OUT"/server-*huge*.log 2>/dev/null \
  | cut -c1-200 | head -4 | sed 's/^/  /' | tee -a "$summary"
# Job 32 may run beside this one in a `+` group (its bf16 / int8 files are the baselines): wait for
# them while it is still running and the time left allows; only without job 32 boot our own bf16.
while [ -d "$J32" ] && [ ! -f "$J32/kvq-int8.json" ] && pgrep -f "32-kv-quality" >/dev/null 2>&1 \
      && [ "$(elapsed)" -lt 560 ]; do sleep 3; done
for arm in bf16 int8; do
  [ -f "$J32/kvq-$arm.json" ] && cp "$J32/kvq-$arm.json" "$JOB_OUT/" && say "baseline $arm from job 32 of this session"
done
if [ -f "$JOB_OUT/kvq-bf16.json" ] && [ -f "$JOB_OUT/kvq-kvarn.json" ]; then
  say "--- KV quality vs bf16 (SmolLM2-135M, 6 texts, greedy 96)"
  python3 gpu/jobs/32-kv-quality.py compare --dir "$JOB_OUT" --base bf16 2>&1 | tee -a "$summary"
  python3 "$H" quality --dir "$JOB_OUT" --max-delta 25 2>&1 | tee -a "$summary"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
else
  say "FAIL: no kvarn/bf16 pair to compare"; status=1
fi

if [ -f "$JOB_OUT/server.pid" ]; then  # the helper's server group, by id, should it have outlived it
  pid=$(cat "$JOB_OUT/server.pid")
  if kill -0 "$pid" 2>/dev/null; then say "killing leftover server group $pid"; kill -KILL -- "-$pid" 2>/dev/null; fi
fi
say "== 61-kvarn-serve done in $(elapsed)s: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
