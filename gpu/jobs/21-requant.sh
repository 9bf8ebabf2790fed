#!/usr/bin/env bash
# timeout: 600
# 21-requant: requantize lm_head / embed_tokens (int8) and MTP (int8) of a hard-linked copy of the
# 27B-geometry checkpoint ($MODELS/qwen38-27b-geom-rq; the original stays untouched: requant only
# renames new files over old names, never writes into an existing file), then boot original and
# requantized under a 24 GiB budget emulated with --gpu-memory-utilization and compare vLLM's own
# "GPU KV cache size" lines. Prints: per step bytes freed, max rel. error, peak RSS, seconds;
# the no-op re-run; KV tokens base vs requantized and the gain; one completion each.
set -u
: "${JOB_OUT:=/var/tmp/out/21-requant}" "${MODELS:=/var/tmp/models}"
mkdir -p "$JOB_OUT"
M="$MODELS/qwen38-27b-geom"
R="$MODELS/qwen38-27b-geom-rq"
echo "== $(date -u +%FT%TZ) 21-requant; repo $(git rev-parse --short HEAD 2>/dev/null)"
if [ ! -f "$M/model.safetensors.index.json" ]; then
  echo "FAIL: $M missing (job 20-geometry builds it)"; exit 1
fi
cleanup() { for f in "$JOB_OUT"/server-*.pid; do [ -s "$f" ] && kill -9 -- "-$(cat "$f")" 2>/dev/null; rm -f "$f"; done; }
trap cleanup EXIT
rm -rf "$R" && cp -al "$M" "$R" || { echo "FAIL: cannot hard-link $M to $R"; exit 1; }
df -h "$MODELS" | tail -1
ok=1
# lm_head on the CPU (the path users run; its peak RSS is the <4 GB figure), the rest on cuda
for step in lm_head embed mtp; do
  dev="${RQ_DEVICE:-cuda}"; [ $step = lm_head ] && dev=cpu
  echo "== quant_$step (int8, row blocks on $dev)"
  t0=$(date +%s)
  timeout 150 python3 scripts/quant_$step.py "$R" --device "$dev" --report "$JOB_OUT/rq-$step.json"
  rc=$?; echo "quant_$step rc=$rc wall $(( $(date +%s) - t0 ))s"
  [ $rc -eq 0 ] || ok=0
done
echo "== re-run (must be a no-op) and layout check"
python3 scripts/quant_lm_head.py "$R" | tee "$JOB_OUT/rerun.txt"
grep -q "nothing to do" "$JOB_OUT/rerun.txt" || { echo "FAIL: re-run was not a no-op"; ok=0; }
python3 scripts/quant_lm_head.py "$R" --check || ok=0
du -sh "$M" "$R" 2>/dev/null
cmp -s "$M/config.json" "$R/.onecard/backup/config.json" && echo "backup config == original config"
df -h "$MODELS" | tail -1

UTIL=$(python3 -c 'import torch; print(round(24 * 2**30 / torch.cuda.get_device_properties(0).total_memory, 4))' 2>/dev/null || echo 0.17)
echo "== boots under a 24 GiB budget: --gpu-memory-utilization $UTIL"
COMMON=(--max-model-len 4096 --enforce-eager --language-model-only --max-num-seqs 4
        --gpu-memory-utilization "$UTIL" --additional-config '{"gdn_prefill_backend":"triton"}')
for which in base rq; do
  model="$M"; [ $which = rq ] && model="$R"
  echo "-- boot $which: $model"
  timeout 180 python3 gpu/lib/serve_probe.py --model "$model" --out "$JOB_OUT/serve-$which.json" \
      --log "$JOB_OUT/serve-$which.log" --pidfile "$JOB_OUT/server-$which.pid" --port 8322 \
      --boot-timeout 160 --max-tokens 16 -- "${COMMON[@]}"
  rc=$?; echo "boot $which rc=$rc"
  [ $rc -eq 0 ] || { ok=0; tail -n 30 "$JOB_OUT/serve-$which.log"; }
done
if [ $SECONDS -lt 300 ]; then
  echo "-- boot rq with SPEC=mtp (1 draft token), util 0.5"
  timeout 170 python3 gpu/lib/serve_probe.py --model "$R" --out "$JOB_OUT/serve-rq-mtp.json" \
      --log "$JOB_OUT/serve-rq-mtp.log" --pidfile "$JOB_OUT/server-mtp.pid" --port 8323 \
      --boot-timeout 150 --max-tokens 16 -- --max-model-len 4096 --enforce-eager --language-model-only \
      --max-num-seqs 4 --gpu-memory-utilization 0.5 --additional-config '{"gdn_prefill_backend":"triton"}' \
      --speculative-config '{"method":"mtp","num_speculative_tokens":1}' \
    || tail -n 30 "$JOB_OUT/serve-rq-mtp.log"
else
  echo "-- SPEC=mtp boot skipped (time: ${SECONDS}s used)"
fi

echo "== summary 21-requant"
python3 - "$JOB_OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(n):
    try:
        return json.load(open(os.path.join(out, n)))
    except Exception:
        return {}
for step in ("lm_head", "embed", "mtp"):
    r = load(f"rq-{step}.json")
    if not r:
        print(f"{step:8s}: no report (failed)"); continue
    errs = [t["rel_error"] for t in r.get("tensors", {}).values()]
    freed = (r.get("bytes_before", 0) - r.get("bytes_after", 0)) / 2**30
    print(f"{step:8s}: {len(errs)} tensor(s) int{r.get('bits')}, freed {freed:.3f} GiB, max rel.err "
          f"{max(errs) if errs else float('nan'):.5f}, peak RSS {r.get('peak_rss_mb')} MB, {r.get('seconds')} s on {r.get('device')}")
b, q, m = load("serve-base.json"), load("serve-rq.json"), load("serve-rq-mtp.json")
for name, s in (("base", b), ("rq", q), ("rq+mtp", m)):
    print(f"serve {name:6s}: ok={s.get('ok')} KV {s.get('kv_cache_tokens')} tokens ({s.get('kv_cache_gib')} GiB), "
          f"weights {s.get('model_load_gib')} GiB, text {s.get('completion')!r} {s.get('error', '')}")
    for ln in s.get("error_lines", [])[-3:]:
        print(f"   log: {ln[:200]}")
if b.get("kv_cache_tokens") and q.get("kv_cache_tokens"):
    print(f"KV pool gained under 24 GiB: {q['kv_cache_tokens'] - b['kv_cache_tokens']:+,} tokens")
PY
[ $ok -eq 1 ]
