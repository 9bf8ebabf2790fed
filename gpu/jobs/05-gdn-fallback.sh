# timeout: 420
# Patch 0001 on Hopper without cutlass: stock vLLM 0.27.1 picks FlashInfer's GDN prefill and
# fails at the first prefill; the patched one falls back to Triton and serves. Same tiny model,
# same flags, no gdn_prefill_backend given (so the resolver decides).
set -uo pipefail
tiny=$(python3 -c 'from onecard.prepare.tiny import ensure_tiny_model; print(ensure_tiny_model())') || exit 2
common=(--language-model-only --enforce-eager --max-model-len 2048 --max-num-seqs 4 --gpu-memory-utilization 0.3)
PYTHONPATH="$STOCK_PYTHONPATH" python3 gpu/serve_once.py --label stock --model "$tiny" --port 18101 -- "${common[@]}" \
  | tee "$JOB_OUT/stock.json"
PYTHONPATH="$PYTHONPATH" python3 gpu/serve_once.py --label patched --model "$tiny" --port 18102 -- "${common[@]}" \
  | tee "$JOB_OUT/patched.json"
python3 - "$JOB_OUT" <<'PY'
import json, sys
out = sys.argv[1]
s, p = (json.load(open(f"{out}/{n}.json")) for n in ("stock", "patched"))
print(f"stock:   booted={s['booted']} served={s['served']} alive_after={s.get('server_alive_after')}")
for l in s["log_lines"][-4:]: print("   ", l[:220])
print(f"patched: booted={p['booted']} served={p['served']} text={p.get('text')!r}")
for l in p["log_lines"][-3:]: print("   ", l[:220])
ok = (not s["served"]) and p["served"]
print("GDN fallback:", "PROVEN (stock fails, patched serves)" if ok else "NOT proven")
sys.exit(0 if ok else 1)
PY
