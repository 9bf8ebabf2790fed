#!/usr/bin/env bash
# timeout: 200
# 22-prepare-model: `onecard prepare model` (what `install.sh --model PATH` runs) on the
# 27B-geometry checkpoint into a hard-linked --dest ($MODELS/qwen38-27b-geom-prep; the original
# stays untouched): int8 lm_head / embed / MTP, draft vocabulary, completeness check. A second
# run must be a no-op (no file changes); verify.sh's requant / draft-vocab checks must PASS.
# The boot of this layout (same requant code, same groups) is job 21's; PREP_BOOT=1 boots this
# one too under a 24 GiB budget (+ ~80 s; then raise the timeout line to 420). Expected wall: prepare ~60 s, re-run ~5 s, checks ~5 s.
# Prints: per-step "done" lines (rel. error, bytes freed), draft vocab line, check lines.
set -u
: "${JOB_OUT:=/var/tmp/out/22-prepare-model}" "${MODELS:=/var/tmp/models}"
mkdir -p "$JOB_OUT"
M="$MODELS/qwen38-27b-geom"
P="$MODELS/qwen38-27b-geom-prep"
echo "== $(date -u +%FT%TZ) 22-prepare-model; repo ${ONECARD_TREE_REV:-$(git rev-parse --short HEAD 2>/dev/null)}"
if [ ! -f "$M/model.safetensors.index.json" ]; then
  echo "FAIL: $M missing (job 20-geometry builds it)"; exit 1
fi
cleanup() { [ -s "$JOB_OUT/server.pid" ] && kill -9 -- "-$(cat "$JOB_OUT/server.pid")" 2>/dev/null; rm -f "$JOB_OUT/server.pid"; }
trap cleanup EXIT
rm -rf "$P"
ok=1
echo "== prepare (row blocks on ${RQ_DEVICE:-cuda})"
t0=$(date +%s)
timeout 170 python3 -m onecard prepare model "$M" --dest "$P" --device "${RQ_DEVICE:-cuda}" 2>&1 | tee "$JOB_OUT/prepare.txt"
rc=${PIPESTATUS[0]}; echo "prepare rc=$rc wall $(( $(date +%s) - t0 ))s"; [ $rc -eq 0 ] || ok=0
echo "== second run (must be a no-op)"
find "$P" -type f ! -name prepare.lock -printf '%P %s %T@\n' | sort > "$JOB_OUT/before.txt"
python3 -m onecard prepare model "$M" --dest "$P" 2>&1 | tee "$JOB_OUT/rerun.txt"
find "$P" -type f ! -name prepare.lock -printf '%P %s %T@\n' | sort > "$JOB_OUT/after.txt"
if cmp -s "$JOB_OUT/before.txt" "$JOB_OUT/after.txt" && [ "$(grep -c 'already int8 (no-op' "$JOB_OUT/rerun.txt")" = 3 ]; then
  echo "re-run: no-op"
else
  echo "FAIL: re-run changed files or re-did a step"; ok=0
fi
echo "== verify checks"
python3 - "$P" <<'PY' || ok=0
import sys
from onecard import verify
ctx = {"model": sys.argv[1]}
bad = 0
for check in (verify.check_model, verify.check_model_requant, verify.check_draft_vocab):
    r = check(ctx)
    print(f"{r.status} {r.name:<12} {r.detail}")
    bad += r.status != verify.PASS
sys.exit(1 if bad else 0)
PY
du -sh "$M" "$P" 2>/dev/null; df -h "$MODELS" | tail -1
if [ "${PREP_BOOT:-0}" = 1 ]; then
  UTIL=$(python3 -c 'import torch; print(round(24 * 2**30 / torch.cuda.get_device_properties(0).total_memory, 4))' 2>/dev/null || echo 0.17)
  echo "== boot the prepared checkpoint: --gpu-memory-utilization $UTIL"
  timeout 200 python3 gpu/lib/serve_probe.py --model "$P" --out "$JOB_OUT/serve.json" --log "$JOB_OUT/serve.log" \
      --pidfile "$JOB_OUT/server.pid" --port 8324 --boot-timeout 180 --max-tokens 16 -- \
      --max-model-len 4096 --enforce-eager --language-model-only --max-num-seqs 4 \
      --gpu-memory-utilization "$UTIL" --additional-config '{"gdn_prefill_backend":"triton"}'
  rc=$?; echo "boot rc=$rc"; [ $rc -eq 0 ] || { ok=0; tail -n 30 "$JOB_OUT/serve.log"; }
else
  echo "== boot skipped (job 21 boots the same layout; PREP_BOOT=1 boots this one)"
fi
echo "== summary 22-prepare-model"
grep -E '^(lm_head|embed|mtp): int8 done|^draft vocab|^check:' "$JOB_OUT/prepare.txt"
[ "${PREP_BOOT:-0}" = 1 ] && python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print(f\"serve: ok={s.get('ok')} KV {s.get('kv_cache_tokens')} tokens, weights {s.get('model_load_gib')} GiB, text {s.get('completion')!r}\")" "$JOB_OUT/serve.json" 2>/dev/null
[ $ok -eq 1 ]
