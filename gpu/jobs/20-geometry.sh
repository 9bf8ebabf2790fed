#!/usr/bin/env bash
# timeout: 620
# prejit: no-wait   (builds checkpoints; its boot figures are informational: runs beside the pre-JIT)
# 20-geometry: build the Qwen3.8-27B-geometry random W4A16 checkpoint ON the GPU into
# $MODELS/qwen38-27b-geom (kept for later jobs), print its size and build time, then boot it
# with the patched vLLM (text-only, eager) and send one greedy completion to prove it loads.
# Prints: build GiB / seconds, boot seconds, "Model loading took" GiB, KV cache tokens, the text.
# Also builds the geometry DFlash2 drafter beside it ($MODELS/qwen38-27b-geom-dflash2: the
# published 27B drafter's shapes, random bf16 weights drawn on the GPU, ~1.92 B params / 3.58 GiB;
# skipped when a build with the same stamp is there) for job 31's SPEC=dflash2 arms; its
# failure is reported in the summary and fails the job, after the serve check has run.
set -u
: "${JOB_OUT:=/var/tmp/out/20-geometry}" "${MODELS:=/var/tmp/models}"
mkdir -p "$JOB_OUT" "$MODELS"
M="$MODELS/qwen38-27b-geom"
D="$MODELS/qwen38-27b-geom-dflash2"
echo "== $(date -u +%FT%TZ) 20-geometry; repo ${ONECARD_TREE_REV:-$(git rev-parse --short HEAD 2>/dev/null)}"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader || true
df -h "$MODELS" | tail -1
free -g | head -2
rm -rf "$MODELS"/.qwen38-27b-geom.tmp-* "$MODELS"/.qwen38-27b-geom.old-* 2>/dev/null
rm -rf "$MODELS"/.qwen38-27b-geom-dflash2.tmp-* "$MODELS"/.qwen38-27b-geom-dflash2.old-* 2>/dev/null
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
# The prepared model users serve has a draft vocabulary (onecard.prepare: 40,960 ids, patch 0012),
# so SPEC=mtp drafts over 40,960 lm_head rows, not 248,320. The geometry's tokenizer is a stand-in,
# so the ids here are simply the first 40,960 (same cost, no frequency choice). Before 2026-12-03
# the geometry had none and job 31's mtp arms drafted over the whole vocabulary.
# GEOM_DRAFT_VOCAB=0 keeps the full head.
if [ "${GEOM_DRAFT_VOCAB:-1}" = 1 ] && [ -f "$M/config.json" ] && [ ! -f "$M/draft_vocab.json" ]; then
  python3 - "$M" <<'PY' && echo "draft vocabulary: $M/draft_vocab.json (ids 0..40959)"
import json, sys
from pathlib import Path
from onecard.prepare.st import atomic_write_text
m = Path(sys.argv[1])
n = 40960
atomic_write_text(m / "draft_vocab.json", json.dumps(
    {"ids": list(range(n)), "size": n, "note": "27B geometry stand-in: the default size, ids 0..n-1"}) + "\n")
PY
fi
ls -la "$M" 2>/dev/null | head -20

echo "== geometry DFlash2 drafter (GPU random weights) -> $D"
t0=$(date +%s)
# DRAFT_EXTRA: scale-down overrides, only for dry runs on a CPU box
target_arg=""
[ -f "$M/config.json" ] && target_arg="--target $M"
timeout 150 python3 -m onecard.dflash.tiny_drafter --geometry 27b $target_arg --out "$D" \
    --report "$JOB_OUT/drafter.json" ${DRAFT_EXTRA:-}
rc_draft=$?
t_draft=$(( $(date +%s) - t0 ))
[ $rc_draft -ne 0 ] && { rm -rf "$MODELS"/.qwen38-27b-geom-dflash2.tmp-* 2>/dev/null; echo "drafter build FAILED rc=$rc_draft after ${t_draft}s"; }
echo "drafter: $D  size $(du -sh "$D" 2>/dev/null | cut -f1)  wall ${t_draft}s"
df -h "$MODELS" | tail -1

rc_serve=1
# GEOM_SERVE=0: build only (job 40 boots it anyway; saves a 27B boot in a short lease)
if [ "${GEOM_SERVE:-1}" = "0" ] && [ $rc_build -eq 0 ]; then
  echo "== serve skipped (GEOM_SERVE=0)"; rc_serve=0
elif [ $rc_build -eq 0 ]; then
  echo "== serve (patched vLLM, --language-model-only, eager, 4k context)"
  # the first request JIT-compiles the eager GDN kernels: over 60 s beside job 63 (session 16),
  # over 120 s beside jobs 63 + 61 (session 17: JIT at +45 s, no answer at +120 s); in a group
  # the request gets 300 s; alone on a fresh H100 (session 21) the conv1d JIT came 67 s in and
  # 16 tokens had not come at 120 s, so alone it gets 300 s too (build 36 s + drafter 13 s + boot
  # 198 s + 300 s stays under the 620 s limit)
  req_s=300
  timeout $(( 240 + req_s )) python3 gpu/lib/serve_probe.py --model "$M" --out "$JOB_OUT/serve.json" --request-timeout $req_s \
      --log "$JOB_OUT/serve.log" --pidfile "$JOB_OUT/server.pid" --port 8321 --boot-timeout 220 --max-tokens 16 ${PROBE_EXTRA:-} -- \
      --max-model-len 4096 --enforce-eager --language-model-only --max-num-seqs 4 \
      --gpu-memory-utilization 0.5 --additional-config '{"gdn_prefill_backend":"triton"}'
  rc_serve=$?
  echo "-- serve.log tail"; tail -n 40 "$JOB_OUT/serve.log" 2>/dev/null
fi

echo "== summary 20-geometry"
python3 - "$JOB_OUT" "$t_build" "$rc_build" "$rc_serve" "$t_draft" "$rc_draft" <<'PY'
import json, os, sys
out, t_build, rc_b, rc_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
t_draft, rc_d = sys.argv[5], int(sys.argv[6])
def load(n):
    try:
        return json.load(open(os.path.join(out, n)))
    except Exception:
        return {}
b, s, d = load("build.json"), load("serve.json"), load("drafter.json")
print(f"build : rc={rc_b} {b.get('gib', '?')} GiB, {b.get('shards', '?')} shards, {b.get('tensors', '?')} tensors, "
      f"{b.get('seconds', t_build)} s on {b.get('device', '?')}")
print(f"drafter: rc={rc_d} {d.get('gib', '?')} GiB, {d.get('params', '?')} params, {d.get('tensors', '?')} tensors, "
      f"{d.get('seconds', t_draft)} s on {d.get('device', '?')}" + (" (present, skipped)" if d.get("skipped") else ""))
print(f"serve : rc={rc_s} ok={s.get('ok')} boot {s.get('boot_s')} s, model load {s.get('model_load_gib')} GiB "
      f"/ {s.get('model_load_s')} s, KV cache {s.get('kv_cache_tokens')} tokens ({s.get('kv_cache_gib')} GiB)")
print(f"text  : {s.get('completion')!r} usage={s.get('usage')}")
if s.get("error"):
    print(f"error : {s['error']}")
for ln in s.get("error_lines", [])[-4:]:
    print(f"log   : {ln[:200]}")
PY
[ $rc_build -eq 0 ] && [ $rc_serve -eq 0 ] && [ $rc_draft -eq 0 ]
