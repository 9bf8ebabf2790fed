"""Boot profiles through `python3 -m onecard.launch` and compare vLLM's KV pool to onecard.memory.

For each case (model x CTX x knobs) the driver builds the plan in-process (the prediction),
starts the launcher with the same environment in its own process group, reads the log until
vLLM prints "GPU KV cache size: N tokens" and "Maximum concurrency for L tokens per request: Cx"
(vllm/v1/core/kv_cache_utils.py::get_kv_cache_configs) and "Setting attention block size to B
tokens" (platforms/interface.py), then kills the server. No GPU work is needed beyond the boot.

    python3 gpu/lib/pools.py --out DIR [--models ROOT] [--boot-timeout S] [--only NAME ...]
Exit 0 when every case that ran reported a pool within --tolerance of the prediction.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jobutil import free_port, stop, write_json  # noqa: E402  (gpu/lib/jobutil.py; 61-kvarn-serve.py uses pools.free_port/stop)

RE_POOL = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
RE_CONC = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
RE_BLOCK = re.compile(r"Setting attention block size to (\d+) tokens")
RE_ERRLINE = re.compile(r"(\w*(Error|Exception)\b.*:|CUDA out of memory)")


def cases(models: Path, tiny_path: str | None) -> list[dict]:
    out = []
    # The tiny model says max_position_embeddings 32768 (the 27B geometry 262,144 since
    # 2026-12-02): VLLM_ALLOW_LONG_MAX_MODEL_LEN keeps the profiles' 64k/128k MAX_LEN on the tiny
    # model (the preflight would cap it otherwise) so its pools are the profiles'; nothing decodes.
    common = {"GDN_PREFILL": "triton", "HOST": "127.0.0.1", "TOOLS": "0", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
              "EXTRA_ARGS": "--language-model-only --enforce-eager --disable-log-stats --seed 0"}
    if tiny_path:
        for ctx in ("fast", "long"):
            out.append({"name": f"tiny-{ctx}", "timeout": 90,
                        "env": {**common, "MODEL": tiny_path, "CTX": ctx, "SPEC": "mtp"}})
        out.append({"name": "tiny-fast-off-noprefix", "timeout": 90,
                    "env": {**common, "MODEL": tiny_path, "CTX": "fast", "SPEC": "off", "PREFIX_CACHE": "0",
                            "MAX_LEN": "32768"}})
    geom = models / "qwen38-27b-geom"
    if (geom / "config.json").is_file():
        for ctx in ("fast", "long"):
            out.append({"name": f"27b-{ctx}", "timeout": int(os.environ.get("POOLS_27B_TIMEOUT", "150")), "env": {**common, "MODEL": str(geom), "CTX": ctx}})
        out.append({"name": "27b-long-bf16state", "timeout": 150,
                    "env": {**common, "MODEL": str(geom), "CTX": "long", "SSM_DTYPE": "bfloat16"}})
    return out


def predict(env: dict, root: Path) -> dict:
    from onecard import memory
    from onecard.plan import make_plan

    model = env["MODEL"]
    geom = memory.ModelGeometry.from_model_dir(model) if (Path(model) / "config.json").is_file() else None
    plan = make_plan(env, root, python="python3", geometry=geom)
    return {"prediction": plan.prediction, "argv": plan.argv,
            "values": {k: {"value": v.value, "source": v.source, "reason": v.reason} for k, v in plan.values.items()}}


def boot(case: dict, out: Path, root: Path, launcher: list[str]) -> dict:
    rec: dict = {"name": case["name"], "env": case["env"]}
    try:
        rec.update(predict(case["env"], root))
    except Exception as e:  # a refused plan is a result too
        rec["error"] = f"plan: {e}"
        return rec
    env = {**os.environ, **case["env"], "PORT": str(free_port())}
    log_path = out / f"server-{case['name']}.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(launcher, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root,
                                start_new_session=True)
        try:
            while time.monotonic() - t0 < case["timeout"]:
                time.sleep(1)
                text = log_path.read_text(errors="replace")
                if RE_POOL.search(text) and RE_CONC.search(text):
                    break
                if proc.poll() is not None:
                    break
        finally:
            stop(proc)
    text = log_path.read_text(errors="replace")
    rec["seconds"] = round(time.monotonic() - t0, 1)
    m = RE_POOL.search(text)
    rec["pool_tokens"] = int(m.group(1).replace(",", "")) if m else None
    c = RE_CONC.search(text)
    rec["max_concurrency"] = float(c.group(2)) if c else None
    b = RE_BLOCK.findall(text)
    rec["block_size"] = int(b[-1]) if b else None
    if rec["pool_tokens"] is None:
        errs = [ln.strip() for ln in text.splitlines() if RE_ERRLINE.search(ln)]
        tail = [ln.strip() for ln in text.splitlines() if ln.strip()][-1:] or [""]
        why = errs[-1] if errs else (f"timeout after {rec['seconds']} s: {tail[0]}" if proc.returncode in (None, -2, -15, -9)
                                     else f"rc={proc.returncode}: {tail[0]}")
        rec["error"] = "no pool line; " + why[:300]
    return rec


def table(recs: list[dict], tol: float) -> tuple[str, bool]:
    head = f"{'case':<24} {'predicted':>10} {'vLLM':>10} {'dev %':>7} {'block p/v':>11} {'conc p/v':>13}  status"
    lines, ok = [head, "-" * len(head)], True
    for r in recs:
        p = r.get("prediction") or {}
        pv, vv = p.get("pool_tokens"), r.get("pool_tokens")
        if vv is None or pv is None:
            ok = False
            lines.append(f"{r['name']:<24} {pv if pv is not None else '-':>10} {'-':>10} {'-':>7} {'-':>11} {'-':>13}  "
                         f"FAIL {r.get('error', '')[:160]}")
            continue
        dev = (pv - vv) / vv * 100
        good = abs(dev) <= tol * 100
        ok &= good
        blk = f"{p.get('block_size')}/{r.get('block_size') or '?'}"
        conc = f"{p.get('max_concurrency', 0):.2f}/{r.get('max_concurrency') or 0:.2f}"
        lines.append(f"{r['name']:<24} {pv:>10,} {vv:>10,} {dev:>7.2f} {blk:>11} {conc:>13}  {'ok' if good else 'OFF'}")
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", type=Path, default=Path(os.environ.get("MODELS", "/var/tmp/models")))
    ap.add_argument("--tiny", default=None, help="tiny model path (default: ensure_tiny_model())")
    ap.add_argument("--no-tiny", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, help="case names to run")
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--launcher", default=f"{sys.executable} -m onecard.launch")
    ap.add_argument("--root", type=Path, default=Path.cwd())
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    tiny = None
    if not a.no_tiny:
        if a.tiny:
            tiny = a.tiny
        else:
            try:
                from onecard.prepare.tiny import ensure_tiny_model
                tiny = str(ensure_tiny_model())
            except Exception as e:
                print(f"[pools] tiny model unavailable: {e!r}", flush=True)
    todo = [c for c in cases(a.models, tiny) if a.only is None or c["name"] in a.only]
    if not any(c["name"].startswith("27b") for c in todo):
        print(f"[pools] no 27B-geometry checkpoint at {a.models / 'qwen38-27b-geom'}: tiny cases only", flush=True)
    recs = []
    for c in todo:
        print(f"[pools] boot {c['name']} (timeout {c['timeout']} s)", flush=True)
        r = boot(c, a.out, a.root, a.launcher.split())
        recs.append(r)
        print(f"[pools] {c['name']}: vLLM {r.get('pool_tokens')} predicted "
              f"{(r.get('prediction') or {}).get('pool_tokens')} ({r.get('seconds', 0)} s) {r.get('error', '')}", flush=True)
        write_json(a.out / "pools.json", recs, indent=2, default=str)
    text, ok = table(recs, a.tolerance)
    print(text)
    (a.out / "pools-table.txt").write_text(text + "\n")
    return 0 if ok and recs else 1


if __name__ == "__main__":
    raise SystemExit(main())
