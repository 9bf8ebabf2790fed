#!/usr/bin/env bash
# timeout: 480
# 21-requant (issue #5): requantize lm_head / embed_tokens / MTP to int8 on a hard-linked copy of
# the 27B-geometry checkpoint ($MODELS/qwen38-27b-geom-rq; the original other jobs use stays
# untouched: requant writes new files and renames them over the links, never into a file), add a
# draft vocabulary, then boot original and requantized under SPEC=mtp with a 24 GiB budget
# emulated by --gpu-memory-utilization (24 GiB / this GPU's total) and compare vLLM's own
# "GPU KV cache size" lines; the requantized server must return greedy tokens and its
# spec-decode draft counter must move. Then the tiny model, plain and requantized, served side by
# side (the requantized one under SPEC=mtp with compile + CUDA graphs): first greedy divergence.
# Prints: per step bytes freed, per tensor rel. error; KV tokens base -> rq and the gain;
# completions; drafts/accepted counters; the draft-vocab log line; tiny divergence.
# Pass: every step OK, re-run no-op, layout check clean, both 27B boots serve, rq drafts > 0,
# tiny rq serves. Expected wall (warm Triton cache): requant ~60 s, boots ~2 x 80 s, tiny ~60 s
# (~4.5 min); the caps add up to the 480 s timeout line.
set -u
: "${JOB_OUT:=/var/tmp/out/21-requant}" "${MODELS:=/var/tmp/models}"
mkdir -p "$JOB_OUT"
M="$MODELS/qwen38-27b-geom"
R="$MODELS/qwen38-27b-geom-rq"
TB="$MODELS/qwen35-tiny-j21"
TR="$MODELS/qwen35-tiny-j21-rq"
echo "== $(date -u +%FT%TZ) 21-requant; repo ${ONECARD_TREE_REV:-$(git rev-parse --short HEAD 2>/dev/null)}"
if [ ! -f "$M/model.safetensors.index.json" ]; then
  echo "FAIL: $M missing (job 20-geometry builds it)"; exit 1
fi
cleanup() { for f in "$JOB_OUT"/*.pid; do [ -s "$f" ] && kill -9 -- "-$(cat "$f")" 2>/dev/null; rm -f "$f"; done; }
trap cleanup EXIT
rm -rf "$R" && cp -al "$M" "$R" || { echo "FAIL: cannot hard-link $M to $R"; exit 1; }
df -h "$MODELS" | tail -1
ok=1
for step in lm_head embed mtp; do
  echo "== quant_$step (int8, row blocks on ${RQ_DEVICE:-cuda})"
  t0=$(date +%s)
  timeout 150 python3 scripts/quant_$step.py "$R" --device "${RQ_DEVICE:-cuda}" --report "$JOB_OUT/rq-$step.json"
  rc=$?; echo "quant_$step rc=$rc wall $(( $(date +%s) - t0 ))s"
  [ $rc -eq 0 ] || ok=0
done
echo "== re-run (must be a no-op), layout check, draft vocabulary"
python3 scripts/quant_lm_head.py "$R" | tee "$JOB_OUT/rerun.txt"
grep -q "nothing to do" "$JOB_OUT/rerun.txt" || { echo "FAIL: re-run was not a no-op"; ok=0; }
python3 scripts/quant_lm_head.py "$R" --check || ok=0
python3 scripts/build_draft_vocab.py "$R" --out "$R/draft_vocab.json" || ok=0
du -sh "$M" "$R" 2>/dev/null
python3 - "$M" <<'PY' | tee "$JOB_OUT/original-intact.txt"
import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
groups = sorted(c.get("quantization_config", {}).get("config_groups", {}))
print("original config groups:", groups, "(must hold no onecard_*)")
sys.exit(1 if any(g.startswith("onecard_") for g in groups) else 0)
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || ok=0

# ---- the probe: boot, greedy completion, /metrics spec-decode counters, vLLM's own log lines
cat > "$JOB_OUT/probe.py" <<'PY'
import json, os, re, signal, subprocess, sys, time, urllib.request
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout around us: still kill the server
sys.path.insert(0, "gpu/lib")
import serve_probe as sp  # parse_log (KV / load lines), kill_group
name, model, port, boot_timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
extra = sys.argv[5:]
out_dir = os.environ["JOB_OUT"]
log_path = f"{out_dir}/serve-{name}.log"
cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", "127.0.0.1",
       "--port", str(port), "--served-model-name", "probe", *extra]
if os.environ.get("PROBE_SERVER_CMD"):  # CPU dry runs of this job: a fake server
    import shlex
    cmd = shlex.split(os.environ["PROBE_SERVER_CMD"].format(port=port))
res = {"name": name, "cmd": cmd, "ok": False}
t0 = time.monotonic()
with open(log_path, "w") as logf:
    p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    open(f"{out_dir}/{name}.pid", "w").write(str(p.pid))
    base = f"http://127.0.0.1:{port}"
    def get(path):
        with urllib.request.urlopen(base + path, timeout=10) as r:
            return r.read().decode()
    def metrics():
        vals = {}
        try:
            for ln in get("/metrics").splitlines():
                m = re.match(r"vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total\{[^}]*\} ([\d.e+]+)", ln)
                if m:
                    vals[m.group(1)] = vals.get(m.group(1), 0) + float(m.group(2))
        except Exception as e:  # noqa: BLE001
            vals["error"] = str(e)
        return vals
    try:
        up = False
        while time.monotonic() - t0 < boot_timeout and not up:
            if p.poll() is not None:
                res["error"] = f"server exited with {p.returncode} during boot"
                break
            try:
                up = get("/health") is not None
            except Exception:  # noqa: BLE001
                time.sleep(2)
        res["boot_s"] = round(time.monotonic() - t0, 1)
        if up:
            res["metrics_before"] = metrics()
            outs = []
            for prompt in ("The capital of France is", "def fibonacci(n):", "Once upon a time"):
                body = {"model": "probe", "prompt": prompt, "max_tokens": 32, "temperature": 0,
                        "return_token_ids": True}
                req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as r:
                    c = json.loads(r.read())["choices"][0]
                outs.append({"prompt": prompt, "text": c.get("text"), "token_ids": c.get("token_ids")})
            res["completions"] = outs
            res["metrics_after"] = metrics()
            res["ok"] = all(o["text"] or o["token_ids"] for o in outs)
        elif "error" not in res:
            res["error"] = f"no /health within {boot_timeout} s"
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        sp.kill_group(p)
        os.unlink(f"{out_dir}/{name}.pid")
text = open(log_path, errors="replace").read()
res.update(sp.parse_log(text))
res["draft_vocab_line"] = next((ln[ln.find("onecard draft vocab"):] for ln in text.splitlines()
                                if "onecard draft vocab" in ln), None)
json.dump(res, open(f"{out_dir}/serve-{name}.json", "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k not in ("cmd", "completions")}, indent=1))
for o in res.get("completions", []):
    print(f"  {o['prompt']!r} -> {o['text']!r}")
sys.exit(0 if res["ok"] else 1)
PY

UTIL=$(python3 -c 'import torch; t = torch.cuda.get_device_properties(0).total_memory; print(f"{24 * 2**30 / t:.4f}")' 2>/dev/null || echo 0.1700)
python3 -c 'import torch; t = torch.cuda.get_device_properties(0).total_memory; print(f"GPU total {t / 2**30:.2f} GiB; 24 GiB = --gpu-memory-utilization {24 * 2**30 / t:.4f}")' 2>/dev/null
SPEC='{"method":"mtp","num_speculative_tokens":1}'
COMMON=(--max-model-len 4096 --enforce-eager --language-model-only --max-num-seqs 4 --max-num-batched-tokens 4096
        --gpu-memory-utilization "$UTIL" --additional-config '{"gdn_prefill_backend":"triton"}'
        --speculative-config "$SPEC")
for which in base rq; do
  model="$M"; [ $which = rq ] && model="$R"
  echo "== boot 27B $which under SPEC=mtp, 24 GiB budget: $model"
  # the first SPEC=mtp boot of the session pays the drafter's Triton JIT: base gets more time
  limit=170; [ $which = base ] && limit=210
  timeout $limit python3 "$JOB_OUT/probe.py" "27b-$which" "$model" 8322 $(( limit - 10 )) "${COMMON[@]}"
  rc=$?; cleanup; echo "boot 27B $which rc=$rc"
  [ $rc -eq 0 ] || { ok=0; grep -E "Error|error" "$JOB_OUT/serve-27b-$which.log" | tail -n 8; tail -n 15 "$JOB_OUT/serve-27b-$which.log"; }
done

echo "== tiny model: plain (eager) and requantized + draft vocab (SPEC=mtp, compile + CUDA graphs), side by side"
python3 - "$TB" "$TR" <<'PY' || ok=0
import shutil, sys
from pathlib import Path
from onecard.prepare import draft_vocab, requant
from onecard.prepare.tiny import build_tiny_model
base, rq = Path(sys.argv[1]), Path(sys.argv[2])
build_tiny_model(base, force=True)
shutil.rmtree(rq, ignore_errors=True)
shutil.copytree(base, rq)
for t in ("lm_head", "embed", "mtp"):
    requant.requantize(rq, t, bits=8)
draft_vocab.write(draft_vocab.build(rq, draft_vocab.builtin_corpus()[:80], size=1024), rq / "draft_vocab.json")
PY
TINY=(--max-model-len 2048 --language-model-only --max-num-seqs 4 --gpu-memory-utilization 0.08
      --additional-config '{"gdn_prefill_backend":"triton"}')
timeout 150 python3 "$JOB_OUT/probe.py" tiny-base "$TB" 8325 140 "${TINY[@]}" --enforce-eager > "$JOB_OUT/tiny-base.txt" 2>&1 &
pb=$!
timeout 150 python3 "$JOB_OUT/probe.py" tiny-rq "$TR" 8326 140 "${TINY[@]}" \
    --speculative-config '{"method":"mtp","num_speculative_tokens":2}' > "$JOB_OUT/tiny-rq.txt" 2>&1
rc_trq=$?; wait $pb; rc_tb=$?; cleanup
cat "$JOB_OUT/tiny-base.txt" "$JOB_OUT/tiny-rq.txt"
echo "tiny base rc=$rc_tb, tiny rq rc=$rc_trq"
[ $rc_trq -eq 0 ] || { ok=0; tail -n 20 "$JOB_OUT/serve-tiny-rq.log"; }

echo "== summary 21-requant"
python3 - "$JOB_OUT" "$ok" "$R" <<'PY'
import json, os, sys
out, ok = sys.argv[1], sys.argv[2] == "1"
try:
    draft_rows = len(json.load(open(os.path.join(sys.argv[3], "draft_vocab.json")))["ids"])
except Exception:
    draft_rows = 0
def load(n):
    try:
        return json.load(open(os.path.join(out, n)))
    except Exception:
        return {}
freed_total = 0
for step in ("lm_head", "embed", "mtp"):
    r = load(f"rq-{step}.json")
    if not r:
        print(f"{step:8s}: no report (failed)"); continue
    freed = r.get("bytes_before", 0) - r.get("bytes_after", 0)
    freed_total += freed
    print(f"{step:8s}: int{r.get('bits')} {len(r.get('tensors', {}))} tensor(s), {r.get('bytes_before', 0) / 2**30:.3f} -> "
          f"{r.get('bytes_after', 0) / 2**30:.3f} GiB, freed {freed / 2**30:.3f} GiB, peak RSS {r.get('peak_rss_mb')} MB, "
          f"{r.get('seconds')} s on {r.get('device')}")
    for name, t in r.get("tensors", {}).items():
        print(f"    rel.err {t['rel_error']:.5f}  freed {(t['bytes_before'] - t['bytes_after']) / 2**20:8.1f} MiB  {name}")
print(f"freed in total: {freed_total / 2**30:.3f} GiB")
b, q = load("serve-27b-base.json"), load("serve-27b-rq.json")
for name, s in (("27B base", b), ("27B rq", q)):
    m0, m1 = s.get("metrics_before", {}), s.get("metrics_after", {})
    print(f"{name:8s}: ok={s.get('ok')} boot {s.get('boot_s')} s, weights {s.get('model_load_gib')} GiB, "
          f"KV {s.get('kv_cache_gib')} GiB = {s.get('kv_cache_tokens')} tokens; drafts "
          f"{m1.get('draft_tokens', 0) - m0.get('draft_tokens', 0):.0f}, accepted "
          f"{m1.get('accepted_tokens', 0) - m0.get('accepted_tokens', 0):.0f} {s.get('error', '')}")
    if s.get("draft_vocab_line"):
        print(f"          {s['draft_vocab_line'][:160]}")
    for o in s.get("completions", [])[:1]:
        print(f"          {o['prompt']!r} -> {o['text']!r}")
if b.get("kv_cache_tokens") and q.get("kv_cache_tokens"):
    print(f"KV pool under a 24 GiB budget (SPEC=mtp): {b['kv_cache_tokens']:,} -> {q['kv_cache_tokens']:,} tokens "
          f"({q['kv_cache_tokens'] - b['kv_cache_tokens']:+,}); weights {b.get('model_load_gib')} -> {q.get('model_load_gib')} GiB "
          f"(rq includes its {draft_rows:,}-row int8 draft head, {draft_rows * 5120 / 2**20:.0f} MiB at hidden 5120)")
tb, tq = load("serve-tiny-base.json"), load("serve-tiny-rq.json")
m0, m1 = tq.get("metrics_before", {}), tq.get("metrics_after", {})
print(f"tiny rq : ok={tq.get('ok')} boot {tq.get('boot_s')} s (compile + CUDA graphs, SPEC=mtp k=2), drafts "
      f"{m1.get('draft_tokens', 0) - m0.get('draft_tokens', 0):.0f}, accepted {m1.get('accepted_tokens', 0) - m0.get('accepted_tokens', 0):.0f}")
for ob, oq in zip(tb.get("completions", []), tq.get("completions", [])):
    a, c = ob.get("token_ids") or [], oq.get("token_ids") or []
    div = next((i for i, (x, y) in enumerate(zip(a, c)) if x != y), None)
    where = "identical" if a == c and a else (f"first divergence at token {div}" if div is not None else
                                              f"lengths {len(a)} vs {len(c)}")
    print(f"tiny {ob['prompt']!r}: plain vs int8 greedy ({len(a)} tokens): {where}")
    print(f"    plain: {ob.get('text')!r}\n    int8 : {oq.get('text')!r}")
q1 = q.get("metrics_after", {}).get("draft_tokens", 0) - q.get("metrics_before", {}).get("draft_tokens", 0)
print(f"checks: steps/re-run/layout/boots {'OK' if ok else 'FAILED'}; 27B rq drafts moved: {q1 > 0}")
sys.exit(0 if ok and q1 > 0 else 1)
PY
