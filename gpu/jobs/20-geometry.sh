#!/usr/bin/env bash
# timeout: 480
# 20-geometry: build the Qwen3.8-27B-geometry random W4A16 checkpoint ON the GPU into
# $MODELS/qwen38-27b-geom (kept for later jobs), print its size and build time, then boot it
# with the patched vLLM (text-only, eager) and send one greedy completion to prove it loads.
# Prints: build GiB / seconds, boot seconds, "Model loading took" GiB, KV cache tokens, the text.
set -u
: "${JOB_OUT:=/var/tmp/out/20-geometry}" "${MODELS:=/var/tmp/models}"
mkdir -p "$JOB_OUT" "$MODELS"
M="$MODELS/qwen38-27b-geom"
echo "== $(date -u +%FT%TZ) 20-geometry; repo $(git rev-parse --short HEAD 2>/dev/null)"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader || true
df -h "$MODELS" | tail -1
free -g | head -2
rm -rf "$MODELS"/.qwen38-27b-geom.tmp-* "$MODELS"/.qwen38-27b-geom.old-* 2>/dev/null
# never leave a server behind: the probe kills its own, this catches a probe killed with -9
cleanup() { [ -s "$JOB_OUT/server.pid" ] && kill -9 -- "-$(cat "$JOB_OUT/server.pid")" 2>/dev/null; rm -f "$JOB_OUT/server.pid"; }
trap cleanup EXIT

echo "== build (GPU random weights, streamed shards)"
t0=$(date +%s)
# GEOM_EXTRA / PROBE_EXTRA: only for dry runs of this script on a CPU box (scale-down, fake server)
timeout 200 python3 -m onecard prepare geometry --out "$M" --report "$JOB_OUT/build.json" ${GEOM_EXTRA:-}
rc_build=$?
t_build=$(( $(date +%s) - t0 ))
if [ $rc_build -ne 0 ]; then
  rm -rf "$MODELS"/.qwen38-27b-geom.tmp-* 2>/dev/null
  echo "build FAILED rc=$rc_build after ${t_build}s"
fi
size=$(du -sh "$M" 2>/dev/null | cut -f1)
echo "checkpoint: $M  size ${size:-?}  wall ${t_build}s"
[ -f "$JOB_OUT/build.json" ] && cat "$JOB_OUT/build.json"
ls -la "$M" 2>/dev/null | head -20
df -h "$MODELS" | tail -1

rc_serve=1
# GEOM_SERVE=0: build only (job 40 boots it anyway; saves a 27B boot in a short lease)
if [ "${GEOM_SERVE:-1}" = "0" ] && [ $rc_build -eq 0 ]; then
  echo "== serve skipped (GEOM_SERVE=0)"; rc_serve=0
elif [ $rc_build -eq 0 ]; then
  echo "== serve (patched vLLM, --language-model-only, eager, 4k context)"
  timeout 250 python3 gpu/lib/serve_probe.py --model "$M" --out "$JOB_OUT/serve.json" \
      --log "$JOB_OUT/serve.log" --pidfile "$JOB_OUT/server.pid" --port 8321 --boot-timeout 220 --max-tokens 16 ${PROBE_EXTRA:-} -- \
      --max-model-len 4096 --enforce-eager --language-model-only --max-num-seqs 4 \
      --gpu-memory-utilization 0.5 --additional-config '{"gdn_prefill_backend":"triton"}'
  rc_serve=$?
  echo "-- serve.log tail"; tail -n 40 "$JOB_OUT/serve.log" 2>/dev/null
fi

echo "== summary 20-geometry"
python3 - "$JOB_OUT" "$t_build" "$rc_build" "$rc_serve" <<'PY'
import json, os, sys
out, t_build, rc_b, rc_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def load(n):
    try:
        return json.load(open(os.path.join(out, n)))
    except Exception:
        return {}
b, s = load("build.json"), load("serve.json")
print(f"build : rc={rc_b} {b.get('gib', '?')} GiB, {b.get('shards', '?')} shards, {b.get('tensors', '?')} tensors, "
      f"{b.get('seconds', t_build)} s on {b.get('device', '?')}")
print(f"serve : rc={rc_s} ok={s.get('ok')} boot {s.get('boot_s')} s, model load {s.get('model_load_gib')} GiB "
      f"/ {s.get('model_load_s')} s, KV cache {s.get('kv_cache_tokens')} tokens ({s.get('kv_cache_gib')} GiB)")
print(f"text  : {s.get('completion')!r} usage={s.get('usage')}")
if s.get("error"):
    print(f"error : {s['error']}")
for ln in s.get("error_lines", [])[-4:]:
    print(f"log   : {ln[:200]}")
PY
[ $rc_build -eq 0 ] && [ $rc_serve -eq 0 ]
