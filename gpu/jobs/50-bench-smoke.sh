#!/usr/bin/env bash
# timeout: 240
# Bench harness smoke on the patched vLLM: boot one small model (SmolLM2-135M from $MODELS if
# an earlier job converted it, else the tiny Qwen3.5), run a concurrency ladder C1/C2/C4 and a
# perplexity pass (both must come out VALID with usage-based token counts), plus informative
# depth / prefix-turn runs; if time is left, boot tiny Qwen3.5 + MTP and run the speculation
# acceptance pass (checks the spec-decode metric names on the real server).
# Writes: $JOB_OUT/{results/*.json,results/runs.jsonl,report.md,ladder.png,server-*.log,summary.txt}
# Exit 0 only if the ladder and perplexity results are VALID and their token counts add up.
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/50-bench-smoke}"
: "${MODELS:=/var/tmp/models}"
: "${VLLM:=python3 -m vllm.entrypoints.cli.main}"
export JOB_OUT MODELS
mkdir -p "$JOB_OUT/results"
RES="$JOB_OUT/results"
summary="$JOB_OUT/summary.txt"; : > "$summary"
say() { echo "$*" | tee -a "$summary"; }
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
status=0
SPID=""

stop_server() {
  if [ -n "$SPID" ] && kill -0 "$SPID" 2>/dev/null; then
    kill -TERM -- "-$SPID" 2>/dev/null
    for _ in $(seq 1 20); do kill -0 "$SPID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$SPID" 2>/dev/null
  fi
  SPID=""
}
trap stop_server EXIT

# HTTP GET without curl (may be missing on the GPU host): get URL [OUTFILE]; rc 0 on HTTP 200
get() {
  python3 - "$@" <<'PYEOF' 2>/dev/null
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=3) as r:
        body = r.read()
        if len(sys.argv) > 2:
            open(sys.argv[2], "wb").write(body)
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
PYEOF
}

PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
URL="http://127.0.0.1:$PORT"

# boot NAME MODEL_DIR SERVED WAIT_S ARGS... ; returns 0 once /health answers
boot() {
  local name=$1 model=$2 served=$3 wait_s=$4; shift 4
  local log="$JOB_OUT/server-$name.log"
  say "[$(elapsed)s] booting $name: $model"
  setsid $VLLM serve "$model" --host 127.0.0.1 --port "$PORT" --served-model-name "$served" \
    --max-model-len 2048 --max-num-seqs 8 --seed 0 --gpu-memory-utilization 0.30 "$@" \
    > "$log" 2>&1 &
  SPID=$!
  local t=0
  while [ $t -lt "$wait_s" ]; do
    if ! kill -0 "$SPID" 2>/dev/null; then
      say "server $name exited during boot; last log lines:"; tail -25 "$log" | tee -a "$summary"
      SPID=""; return 1
    fi
    if get "$URL/health"; then say "[$(elapsed)s] $name healthy after ${t}s"; return 0; fi
    sleep 1; t=$((t + 1))
  done
  say "server $name not healthy after ${wait_s}s; last log lines:"; tail -25 "$log" | tee -a "$summary"
  stop_server; return 1
}

bench() {  # bench LIMIT_S SUBCOMMAND ARGS...
  local lim=$1; shift
  timeout -k 5 "$lim" python3 -m onecard bench "$@" --url "$URL" --results "$RES" --interval 0.25
}

say "== 50-bench-smoke $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

SMOL="$MODELS/smollm2-135m"
if [ -f "$SMOL/config.json" ]; then
  MODEL="$SMOL"; NAME=smol; EXTRA=(--enforce-eager)
else
  MODEL=$(timeout 180 python3 -c 'from onecard.prepare.tiny import ensure_tiny_model; print(ensure_tiny_model())' 2>>"$JOB_OUT/tiny-build.log" | tail -1)
  NAME=tiny; EXTRA=(--enforce-eager --language-model-only --additional-config '{"gdn_prefill_backend":"triton"}')
  [ -n "$MODEL" ] && [ -d "$MODEL" ] || { say "no model: $SMOL missing and the tiny build failed"; tail -20 "$JOB_OUT/tiny-build.log"; exit 1; }
fi

if boot "$NAME" "$MODEL" bench 100 "${EXTRA[@]}"; then
  say "--- ladder C1/C2/C4 (64 tokens, 1 rep)"
  bench 50 ladder --model bench --n 1,2,4 --out 64 --reps 1 --prompts prose --label "$NAME-prose" || status=1
  say "--- perplexity (prose)"
  bench 30 perplexity --model bench --prompts prose --label "$NAME" || status=1
  say "--- informative: depth 256/1024, prefix turns 1000"
  bench 25 depth --model bench --contexts 256,1024 --out 32 --label "$NAME" || say "(depth not VALID)"
  bench 25 prefix-turns --model bench --context 1000 --turns 3 --out 16 --label "$NAME" || say "(prefix-turns not VALID)"
  get "$URL/metrics" "$JOB_OUT/metrics-$NAME.txt" || say "(could not save /metrics)"
  stop_server
else
  status=1
fi

# Token accounting: ladder tokens == sum of usage == N*64 per level (ignore_eos), verdicts VALID
python3 - "$RES" <<'PYEOF' 2>&1 | tee -a "$summary" || status=1
import json, sys, glob
res = [json.load(open(f)) for f in sorted(glob.glob(sys.argv[1] + "/*.json"))]
bad = 0
for r in res:
    if r["kind"] not in ("ladder", "perplexity"):
        continue
    ok = r["verdict"] == "VALID"
    note = ""
    if r["kind"] == "ladder":
        for lv in r["data"]["levels"]:
            rep = lv["reps"][0]
            want = lv["n"] * r["provenance"]["max_tokens"]
            note += f" C{lv['n']}: {rep['completion_tokens']} tok/{rep['chunks']} chunks (want {want})"
            ok &= rep["completion_tokens"] == want
    else:
        note = f" ppl {r['data'].get('ppl')} over {r['data'].get('tokens')} tokens ({r['data'].get('method')})"
        ok &= r["data"].get("ppl") is not None
    print(f"{'OK  ' if ok else 'FAIL'} {r['kind']}: {r['verdict']} {r.get('verdict_reasons')}{note}")
    bad += not ok
kinds = {r["kind"] for r in res}
if not {"ladder", "perplexity"} <= kinds:
    print(f"FAIL missing results: have {sorted(kinds)}"); bad += 1
sys.exit(1 if bad else 0)
PYEOF

# Optional: speculation acceptance on the tiny Qwen3.5 with MTP (informative; never fails the job)
if [ "$(elapsed)" -lt 120 ]; then
  TINY=$(timeout 60 python3 -c 'from onecard.prepare.tiny import ensure_tiny_model; print(ensure_tiny_model())' 2>>"$JOB_OUT/tiny-build.log" | tail -1)
  if [ -n "$TINY" ] && [ -d "$TINY" ] && boot tiny-mtp "$TINY" bench 90 --enforce-eager --language-model-only \
       --additional-config '{"gdn_prefill_backend":"triton"}' \
       --speculative-config '{"method":"mtp","num_speculative_tokens":2}'; then
    say "--- informative: spec acceptance per position (tiny + MTP k=2)"
    bench 40 spec --model bench --prompts prose,code,copy --out 32 --label tiny-mtp || say "(spec not VALID)"
    get "$URL/metrics" "$JOB_OUT/metrics-tiny-mtp.txt" && grep -E '^vllm:spec_decode' "$JOB_OUT/metrics-tiny-mtp.txt" | tee -a "$summary"
    stop_server
  else
    say "(tiny + MTP boot skipped or failed: see server-tiny-mtp.log)"
  fi
else
  say "(spec pass skipped: $(elapsed)s elapsed)"
fi

timeout 60 python3 -m onecard bench report "$RES" --md "$JOB_OUT/report.md" --plot "$JOB_OUT/ladder.png" >/dev/null 2>&1 \
  || say "report generation failed"
[ -f "$JOB_OUT/report.md" ] && cat "$JOB_OUT/report.md"
[ -f "$JOB_OUT/ladder.png" ] || say "(no ladder.png: matplotlib missing?)"
if [ -f "$JOB_OUT/report.md" ]; then  # the key lines again, last, where gpu/run.sh's tail shows them
  say "--- ladder ($NAME, prose, 64 tok): N | aggregate | per-stream | slowest | TTFT | kv% peak/mean | s | preempt | overlap | failed"
  grep -E '^\| C[0-9]+ \|' "$JOB_OUT/report.md" | tee -a "$summary"
  grep -E '^perplexity:|^\| (prose|code|copy) \|' "$JOB_OUT/report.md" | tee -a "$summary"
fi
say "== 50-bench-smoke done in $(elapsed)s: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
