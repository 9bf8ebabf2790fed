#!/usr/bin/env bash
# timeout: 420
# 31-verify-e2e (issue #7): on the 27B-geometry random W4A16 checkpoint ($MODELS/qwen38-27b-geom,
# built by job 20; skipped cleanly when absent), CTX=long (int8 per-token-head KV on TRITON_ATTN,
# the plan's 3090 KV_MEM pin), C1 greedy, prompts of 8k / 32k / 72k tokens, 48 tokens out:
# ms per engine step with SPEC=mtp (verify steps, WIDE_VERIFY=1) vs SPEC=off (plain decode
# steps), from the server's counters (request_decode_time_seconds_sum / spec_decode_num_drafts)
# and from the wall time between stream events; then SPEC=mtp with WIDE_VERIFY=0 when the
# first two arms took < 170 s (THIRD_BOOT_IF_BEFORE_S), i.e. boots were warm and short.
# Random weights: acceptance ~0, so every verify step yields one token; what is compared is the
# cost of one step. Expected wall: 3-4.5 min for the two arms (two 27B boots + 2 x 114k tokens
# of prefill), ~1.5 min more for the third.
# Every boot goes through `python3 -m onecard.launch` (the launcher's argv and env).
# Writes $JOB_OUT/{mtp-wide1,off,mtp-wide0}.json, server-*.log, table.txt, summary.txt.
# Exit 0 when every arm that ran measured all depths validly (mtp-wide1 and off must run);
# the goal (verify step <= 1.3x plain step) is printed as MET/MISSED, it does not set the exit.
# Dry run without a GPU: JOB31_DRY=1 prints the three launcher plans and exits 0.
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/31-verify-e2e}"
. gpu/lib/job.sh  # MODELS, $summary, say, elapsed, free_port, boot_server, stop_server (trap EXIT)
STOP_TRIES=30     # a 27B server: up to 15 s after SIGTERM
M="$MODELS/qwen38-27b-geom"
DEPTHS=${DEPTHS:-8192,32768,73728}
OUT_TOK=${OUT_TOK:-48}
THIRD_BOOT_IF_BEFORE_S=${THIRD_BOOT_IF_BEFORE_S:-170}  # start the WIDE_VERIFY=0 arm only before this

say "== 31-verify-e2e $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
PORT=$(free_port)
URL="http://127.0.0.1:$PORT"
# the launcher env of one arm: arm_env SPEC WIDE_VERIFY
arm_env() {
  echo "MODEL=$M CTX=long SPEC=$1 WIDE_VERIFY=$2 GDN_PREFILL=triton VISION=0 PORT=$PORT HOST=127.0.0.1 SERVED_NAME=geom"
}

if [ "${JOB31_DRY:-0}" = 1 ]; then
  for arm in "mtp 1" "off 1" "mtp 0"; do
    set -- $arm
    say "-- plan SPEC=$1 WIDE_VERIFY=$2"
    env $(arm_env "$1" "$2") MODEL=tiny python3 -m onecard.launch --dry-run 2>&1 | grep -E '^(argv|child env|WIDE_VERIFY|KV |KV_MEM|SPEC)' | tee -a "$summary"
  done
  say "== 31-verify-e2e dry run done"
  exit 0
fi

if [ ! -f "$M/config.json" ]; then
  say "SKIP: $M/config.json missing (job 20 builds the 27B-geometry checkpoint first)"
  exit 0
fi

# boot LABEL SPEC WIDE_VERIFY WAIT_S; returns 0 once /health answers
boot() {
  say "[$(elapsed)s] booting $1 (SPEC=$2 WIDE_VERIFY=$3)"
  boot_server "$1" "$4" env $(arm_env "$2" "$3") python3 -m onecard.launch || return 1
  grep -E "attention block size|GPU KV cache size|Maximum concurrency" "$JOB_OUT/server-$1.log" | tail -3 | tee -a "$summary"
  return 0
}

status=0
ran=""
measure() {  # measure LABEL SPEC WIDE_VERIFY BOOT_WAIT_S
  local label=$1 specflag=""
  [ "$2" = mtp ] && specflag="--spec"
  if boot "$1" "$2" "$3" "$4"; then
    timeout -k 5 150 python3 gpu/jobs/31-verify-e2e.py --url "$URL" --model geom --label "$label" $specflag \
      --depths "$DEPTHS" --out-tokens "$OUT_TOK" --json "$JOB_OUT/$label.json" 2>&1 | tee -a "$summary"
    [ "${PIPESTATUS[0]}" = 0 ] || { say "$label: measurement not valid"; return 1; }
    ran="$ran $label"
    stop_server
    return 0
  fi
  return 1
}

measure mtp-wide1 mtp 1 200 || status=1
measure off off 1 160 || status=1
if [ "$(elapsed)" -lt "$THIRD_BOOT_IF_BEFORE_S" ]; then
  measure mtp-wide0 mtp 0 160 || say "(mtp-wide0 arm not valid; informative only)"
else
  say "(mtp-wide0 arm skipped: $(elapsed)s elapsed >= $THIRD_BOOT_IF_BEFORE_S s)"
fi

python3 - "$JOB_OUT" <<'PY' 2>&1 | tee "$JOB_OUT/table.txt" | tee -a "$summary"
import json, os, sys
out = sys.argv[1]
arms = {}
for label in ("mtp-wide1", "off", "mtp-wide0"):
    p = os.path.join(out, label + ".json")
    if os.path.exists(p):
        arms[label] = {r["depth"]: r for r in json.load(open(p))["rows"]}
f = lambda x: "-" if x is None else f"{x:.2f}"
print("ms per engine step, C1, CTX=long int8 KV, 27B geometry (server counters | client stream gaps)")
print("| depth | off (plain decode) | mtp verify, WIDE_VERIFY=1 | ratio | mtp verify, WIDE_VERIFY=0 | ratio | goal <= 1.3x |")
print("|---|---|---|---|---|---|---|")
depths = sorted({d for a in arms.values() for d in a})
for d in depths:
    off, w1, w0 = (arms.get(k, {}).get(d) for k in ("off", "mtp-wide1", "mtp-wide0"))
    def cell(r):
        return "-" if r is None else f"{f(r['server_ms_per_step'])} / {f(r['client_ms_per_step'])}"
    def ratio(r):
        try:
            return r["server_ms_per_step"] / off["server_ms_per_step"]
        except (TypeError, KeyError, ZeroDivisionError):
            return None
    r1, r0 = ratio(w1), ratio(w0)
    goal = "-" if r1 is None else ("MET" if r1 <= 1.3 else "MISSED")
    print(f"| {d} | {cell(off)} | {cell(w1)} | {f(r1)} | {cell(w0)} | {f(r0)} | {goal} |")
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
    for k in ("mtp-wide1", "mtp-wide0"):
        if d in arms.get(k, {}):
            print(f"  depth {d} {k}: {first_diff(arms[k][d].get('text'), off)}")
PY
say "arms measured:${ran:- none}"
say "== 31-verify-e2e done in $(elapsed)s: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
