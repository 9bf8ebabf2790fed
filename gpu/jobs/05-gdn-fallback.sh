# timeout: 720
# Patch 0001 on Hopper without cutlass: stock vLLM 0.27.1 picks FlashInfer's GDN prefill and
# fails at the first prefill; the patched one falls back to Triton and serves. Same tiny model,
# same flags, no gdn_prefill_backend given (so the resolver decides). First boots pay Triton JIT.
set -uo pipefail
tiny=$(python3 -c 'from onecard.prepare.tiny import ensure_tiny_model; print(ensure_tiny_model())') || exit 2
common=(--language-model-only --enforce-eager --max-model-len 2048 --max-num-seqs 4 --gpu-memory-utilization 0.3)
for side in stock patched; do
  if [ $side = stock ]; then pp="$STOCK_PYTHONPATH"; else pp="$PYTHONPATH"; fi
  PYTHONPATH="$pp" python3 gpu/lib/serve_probe.py --model "$tiny" --port 18101 --boot-timeout 330 \
    --request-timeout 240 --out "$JOB_OUT/$side.json" --log "$JOB_OUT/$side.log" -- "${common[@]}"
done
python3 - "$JOB_OUT" <<'PY'
import json, sys
out = sys.argv[1]
res = {n: json.load(open(f"{out}/{n}.json")) for n in ("stock", "patched")}
for n, r in res.items():
    log = open(f"{out}/{n}.log", errors="replace").read().splitlines()
    notes = [l for l in log if "cutlass" in l or "GDN prefill" in l][-4:]
    print(f"{n}: ok={r['ok']} boot={r.get('boot_s')} s completion={r.get('completion')!r} error={r.get('error')}")
    for l in notes:
        print("   ", l[:220])
ok = (not res["stock"]["ok"]) and res["patched"]["ok"]
print("GDN fallback:", "PROVEN (stock fails, patched serves)" if ok else "NOT proven")
sys.exit(0 if ok else 1)
PY
