#!/usr/bin/env python3
"""Driver of gpu/jobs/90-tp2.sh (issue 10): TP=1 vs TP=2 through `python3 -m onecard.launch`.

Cases, in value order (what the time budget cuts off comes last):
  tiny-tp1, tiny-tp2   the tiny Qwen3.5 hybrid (ensure_tiny_model): boot, greedy text of 4
                       prompts (TP=2 must equal TP=1), C1/C4 decode tok/s, pool vs prediction
  27b-tp2, 27b-tp1     $MODELS/qwen38-27b-geom (job 20 builds it): boot, C1/C4, pool vs prediction
Every boot: CTX=fast SPEC=mtp (the default k), MAX_LEN 4096, KV_MEM=auto, GPU_UTIL (default 0.5),
--enforce-eager (no compile: the budget is minutes). The launcher adds --tensor-parallel-size and
the multicast-off env at TP>1 (onecard.profiles.TP_CHILD_ENV); this driver checks they are there.

Pool check (pass/fail): onecard.memory.predict_tp fed with the per-GPU KV bytes vLLM logged
("Available KV cache memory: X GiB", smallest rank) must give vLLM's "GPU KV cache size: N
tokens" within --tolerance. Informative: per-GPU weights predicted from the checkpoint headers
vs "Model loading took X GiB"; the end-to-end pool from GPU_UTIL and the card size (the
activation/graph reserves are 3090 figures). Tokens are counted from usage.completion_tokens.

    python3 gpu/jobs/90-tp2.py --out DIR [--models ROOT] [--budget S] [--only NAME ...]
Exit 0 when every case that must run booted, tiny greedy text matched, and pools were within
tolerance; 1 otherwise (a case cut by the budget or a missing 27B checkpoint is a failure: the
Show list is not complete).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "gpu" / "lib"))
from jobutil import free_port, stop, write_json  # noqa: E402  (gpu/lib/jobutil.py)

RE_POOL = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
RE_KV_GIB = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
RE_LOAD = re.compile(r"Model loading took ([\d.]+) GiB")
RE_ERR = re.compile(r"(\w*(Error|Exception)\b.*:|CUDA out of memory)")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "1, 2, 3, 4, 5,"]
GiB = 1024**3


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=3) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001
        return False


def decode_rate(url: str, conc: int, max_tokens: int) -> dict:
    """conc concurrent greedy completions of max_tokens (ignore_eos): tokens from usage / wall."""
    res: list = [None] * conc

    def one(i: int) -> None:
        try:
            r = post(url + "/v1/completions", {"model": "tp", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                                               "temperature": 0, "ignore_eos": True})
            res[i] = r["usage"]["completion_tokens"]
        except Exception as e:  # noqa: BLE001
            res[i] = e

    t0 = time.monotonic()
    th = [threading.Thread(target=one, args=(i,)) for i in range(conc)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    wall = time.monotonic() - t0
    bad = [r for r in res if not isinstance(r, int)]
    toks = sum(r for r in res if isinstance(r, int))
    return {"conc": conc, "tokens": toks, "wall_s": round(wall, 3), "tok_s": round(toks / wall, 1) if wall else None,
            "errors": [repr(b)[:200] for b in bad]}


def predictions(case: dict, rec: dict, card_bytes: int) -> None:
    from onecard import memory

    model, tp = case["env"]["MODEL"], int(case["env"]["TP"])
    geom = memory.ModelGeometry.from_model_dir(model)
    weights = memory.tp_weight_bytes(memory.checkpoint_tensors(model), tp, "checkpoint headers")
    k, max_len = rec["plan"]["SPEC_K"], rec["plan"]["MAX_LEN"]
    kv = rec["plan"]["KV"]
    util = float(case["env"]["GPU_UTIL"])
    rec["weights_pred_gib"] = round(weights.per_gpu / GiB, 3)
    e2e = memory.predict_tp(geom, tp, weights, kv, max_len, k, True, util, card_bytes)
    rec["pool_pred_from_util"] = e2e.pool.pool_tokens
    if rec.get("kv_gib_min") is not None:
        p = memory.predict_tp(geom, tp, weights, kv, max_len, k, True, util, card_bytes,
                              kv_bytes_per_gpu=int(rec["kv_gib_min"] * GiB))
        rec["pool_pred"] = p.pool.pool_tokens
        rec["block_pred"] = p.pool.block_size


def run_case(case: dict, out: Path, card_bytes: int, deadline: float, launcher: list[str]) -> dict:
    from onecard.plan import make_plan
    from onecard import profiles

    rec: dict = {"name": case["name"], "env": case["env"]}
    env = {**os.environ, **case["env"], "PORT": str(free_port())}
    try:
        plan = make_plan(env, REPO, python=sys.executable)
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"plan: {e}"
        return rec
    rec["plan"] = {k: v.value for k, v in plan.values.items() if k in ("TP", "KV", "SPEC_K", "MAX_LEN", "KV_MEM", "GPU_UTIL")}
    rec["argv"] = plan.argv
    tp = int(case["env"]["TP"])
    if tp > 1:
        rec["tp_flag_ok"] = plan.argv[plan.argv.index("--tensor-parallel-size") + 1] == str(tp)
        rec["multicast_off"] = all(plan.child_env.get(k) == v for k, v in profiles.TP_CHILD_ENV.items())
    url = f"http://127.0.0.1:{env['PORT']}"
    log_path = out / f"server-{case['name']}.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(launcher, env=env, cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            up = False
            while time.monotonic() < min(deadline, t0 + case["boot_timeout"]):
                if proc.poll() is not None:
                    break
                if healthy(url):
                    up = True
                    break
                time.sleep(2)
            rec["boot_s"] = round(time.monotonic() - t0, 1)
            if up:
                rec["texts"] = [post(url + "/v1/completions", {"model": "tp", "prompt": p, "max_tokens": 32,
                                                               "temperature": 0})["choices"][0]["text"] for p in PROMPTS]
                decode_rate(url, 1, 16)  # warm-up: the first run after a boot reads low
                rec["c1"] = decode_rate(url, 1, case["tokens"])
                rec["c4"] = decode_rate(url, 4, case["tokens"])
            else:
                rec["error"] = f"no /health within {rec['boot_s']} s (rc={proc.poll()})"
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"requests: {e!r}"[:300]
        finally:
            stop(proc, sigint_wait=15)
    text = log_path.read_text(errors="replace")
    m = RE_POOL.findall(text)
    rec["pool_tokens"] = int(m[-1].replace(",", "")) if m else None
    kvs = [float(x) for x in RE_KV_GIB.findall(text)]
    rec["kv_gib_min"] = min(kvs) if kvs else None
    rec["kv_gib_ranks"] = kvs
    loads = [float(x) for x in RE_LOAD.findall(text)]
    rec["weights_gib_ranks"] = loads
    if "error" in rec:
        errs = [ln.strip() for ln in text.splitlines() if RE_ERR.search(ln)]
        if errs:
            rec["error"] += " | " + errs[-1][:240]
    try:
        predictions(case, rec, card_bytes)
    except Exception as e:  # noqa: BLE001
        rec["pred_error"] = repr(e)[:200]
    return rec


def table(recs: list[dict], tol: float) -> tuple[str, bool, list[str]]:
    by = {r["name"]: r for r in recs}
    ok, why = True, []
    head = (f"{'case':<9} {'boot s':>6} {'W GiB/GPU vLLM/pred':>20} {'KV GiB/GPU':>10} {'pool vLLM':>10} {'pred':>10} "
            f"{'dev %':>6} {'pred@util':>10} {'C1 tok/s':>9} {'C4 tok/s':>9}")
    lines = [head, "-" * len(head)]
    for r in recs:
        if "boot_s" not in r or r.get("error"):
            ok = False
            why.append(f"{r['name']}: {r.get('error', 'not run')}")
            lines.append(f"{r['name']:<9} FAIL {r.get('error', '')[:200]}")
            continue
        w = "/".join(f"{x:.2f}" for x in r["weights_gib_ranks"][:2]) or "-"
        pv, pp = r.get("pool_tokens"), r.get("pool_pred")
        dev = (pp - pv) / pv * 100 if pv and pp else None
        if dev is None or abs(dev) > tol * 100:
            ok = False
            why.append(f"{r['name']}: pool {pv} vs predicted {pp}")
        for key in ("tp_flag_ok", "multicast_off"):
            if r.get(key) is False:
                ok = False
                why.append(f"{r['name']}: {key} false")
        c1, c4 = (r.get(c, {}) for c in ("c1", "c4"))
        for c in (c1, c4):
            if c.get("errors"):
                ok = False
                why.append(f"{r['name']}: C{c['conc']} errors {c['errors'][:1]}")
        lines.append(f"{r['name']:<9} {r['boot_s']:>6} {w + ' / ' + str(r.get('weights_pred_gib', '-')):>20} "
                     f"{r.get('kv_gib_min') or '-':>10} {pv or '-':>10} {pp or '-':>10} "
                     f"{f'{dev:.2f}' if dev is not None else '-':>6} {r.get('pool_pred_from_util', '-'):>10} "
                     f"{c1.get('tok_s', '-'):>9} {c4.get('tok_s', '-'):>9}")
    for model in ("tiny", "27b"):
        a, b = by.get(f"{model}-tp1"), by.get(f"{model}-tp2")
        if a and b and a.get("c1") and b.get("c1"):
            r1 = b["c1"]["tok_s"] / a["c1"]["tok_s"] if a["c1"]["tok_s"] else float("nan")
            r4 = b["c4"]["tok_s"] / a["c4"]["tok_s"] if a["c4"].get("tok_s") else float("nan")
            lines.append(f"{model}: decode tok/s TP=2 / TP=1: C1 {r1:.2f}x, C4 {r4:.2f}x")
        if model == "tiny" and a and b:
            ta, tb = a.get("texts"), b.get("texts")
            if ta and tb:
                same = [x == y for x, y in zip(ta, tb)]
                first = [next((i for i, (c, d) in enumerate(zip(x, y)) if c != d), min(len(x), len(y)))
                         for x, y in zip(ta, tb)]
                lines.append(f"tiny greedy TP=2 == TP=1: {sum(same)}/{len(same)} prompts identical"
                             + ("" if all(same) else f" (first differing char per prompt: {first})"))
                if not all(same):
                    ok = False
                    why.append("tiny greedy text differs between TP=1 and TP=2")
            else:
                ok = False
                why.append("tiny greedy comparison not run")
    return "\n".join(lines), ok, why


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", type=Path, default=Path(os.environ.get("MODELS", "/var/tmp/models")))
    ap.add_argument("--budget", type=float, default=330, help="seconds for all cases")
    ap.add_argument("--gpu-util", default="0.5")
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--launcher", default=f"{sys.executable} -m onecard.launch", help="(dry runs: a fake server)")
    ap.add_argument("--card-gib", type=float, default=None, help="GPU memory (default: torch's figure for GPU 0)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    # a timeout around us sends TERM: turn it into SystemExit so run_case's finally kills the server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    deadline = time.monotonic() + a.budget
    if a.card_gib is None:
        import torch

        card = torch.cuda.get_device_properties(0).total_memory
    else:
        card = int(a.card_gib * GiB)
    from onecard.prepare.tiny import ensure_tiny_model

    tiny = str(ensure_tiny_model())
    geom = a.models / "qwen38-27b-geom"
    common = {"CTX": "fast", "SPEC": "mtp", "MAX_LEN": "4096", "MAX_SEQS": "4", "KV_MEM": "auto",
              "GPU_UTIL": a.gpu_util, "GDN_PREFILL": "triton", "TOOLS": "0", "HOST": "127.0.0.1",
              "SERVED_NAME": "tp", "EXTRA_ARGS": "--enforce-eager --disable-log-stats --seed 0"}
    cases = [{"name": "tiny-tp1", "env": {**common, "MODEL": tiny, "TP": "1"}, "boot_timeout": 120, "tokens": 128},
             {"name": "tiny-tp2", "env": {**common, "MODEL": tiny, "TP": "2"}, "boot_timeout": 150, "tokens": 128},
             {"name": "27b-tp2", "env": {**common, "MODEL": str(geom), "TP": "2"}, "boot_timeout": 200, "tokens": 64},
             {"name": "27b-tp1", "env": {**common, "MODEL": str(geom), "TP": "1"}, "boot_timeout": 200, "tokens": 64}]
    recs = []
    for c in cases:
        if a.only is not None and c["name"] not in a.only:
            continue
        if not (Path(c["env"]["MODEL"]) / "config.json").is_file():
            recs.append({"name": c["name"], "error": f"no checkpoint at {c['env']['MODEL']} (run job 20 first)"})
            continue
        if time.monotonic() > deadline - 30:
            recs.append({"name": c["name"], "error": "not run: time budget spent"})
            continue
        print(f"[tp2] {c['name']}: boot", flush=True)
        r = run_case(c, a.out, card, deadline, a.launcher.split())
        recs.append(r)
        print(f"[tp2] {c['name']}: boot {r.get('boot_s')} s pool {r.get('pool_tokens')} pred {r.get('pool_pred')} "
              f"C1 {r.get('c1', {}).get('tok_s')} C4 {r.get('c4', {}).get('tok_s')} {r.get('error', '')}", flush=True)
        write_json(a.out / "tp2.json", recs, indent=2, default=str)
    text, ok, why = table(recs, a.tolerance)
    text += f"\ncard {card / GiB:.1f} GiB, GPU_UTIL {a.gpu_util}, eager, CTX=fast SPEC=mtp MAX_LEN 4096; C1/C4 ignore_eos greedy"
    print(text)
    (a.out / "tp2-table.txt").write_text(text + "\n" + "".join(f"FAIL: {w}\n" for w in why))
    for w in why:
        print(f"FAIL: {w}")
    return 0 if ok and recs else 1


if __name__ == "__main__":
    raise SystemExit(main())
