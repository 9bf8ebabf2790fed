#!/usr/bin/env python3
"""Job 61's helpers (KVarN served by vLLM, issue 9).

  setup --src /var/tmp/site/vllm --site /var/tmp/site-kvarn
      a private view of the patched vLLM (onecard.patching.overlay: symlinks, real copies of
      what kvarn writes), then kvarn/install.sh's installer on it; the shared tree is untouched.
  needle --url URL --model NAME --json PATH [--chars N]
      one passphrase in a haystack (~N characters, at 40% depth), greedy 12 tokens: found or not.
  quality --dir DIR --max-delta PCT
      reads DIR/compare.json (32-kv-quality.py compare): kvarn's perplexity delta vs bf16 and
      int8; exit 1 if kvarn is missing or its delta exceeds PCT (a sanity bound; the issue's
      goal, <= 0.5 %, is printed as met / not met).
  huge --out DIR --models ROOT --deadline EPOCH_S
      boots $MODELS/qwen38-27b-geom with CTX=huge (SPEC=mtp default) through
      `python3 -m onecard.launch`, prints vLLM's "GPU KV cache size" vs onecard.memory's
      prediction and the attention block size, waits for health, measures C1 decode tok/s at an
      8k prompt (usage-counted, streamed), kills the server; then, if the deadline allows, the
      same decode on CTX=long (int8). Exit 1 if the huge boot or the pool check (1 %) failed.
Writes are atomic JSON files under the given directories.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "gpu" / "lib"))
from jobutil import write_json  # noqa: E402  (gpu/lib/jobutil.py)
from onecard.profiles import knob_overrides  # noqa: E402  (stdlib only: no vLLM, no torch)


# ------------------------------------------------------------------------------------------ setup


def setup(a) -> int:
    import shutil

    from onecard import patching
    from onecard.kvarn import installer as kin

    site = Path(a.site)
    if site.exists():
        shutil.rmtree(site)  # ours: symlinks and copies only (rmtree does not follow links)
    also = tuple({p for patch in patching.read_series(kin.SERIES) for p in patch.paths}
                 | set(kin.sources()) | {kin.MARKER})
    patching.overlay(Path(a.src), site, also=also)
    for m in kin.install(site / "vllm"):
        print(m)
    st = kin.state(site / "vllm")
    print(f"KVarN on {site / 'vllm'}: patch {st['patch']}, marker {st['marker']}, files "
          f"{sorted(set(st['files'].values()))}")
    src_marker = Path(a.src) / "kvarn_installed.txt"
    if src_marker.exists():
        print(f"note: {src_marker} exists in the shared tree (not written by this job)")
    return 0 if st["patch"] == patching.APPLIED and st["marker"] == "ok" else 1


# ----------------------------------------------------------------------------------------- needle


def needle(a) -> int:
    from onecard.bench.client import Client

    hay = (REPO / "bench" / "prompts" / "haystack.txt").read_text()
    body = (hay + "\n") * (a.chars // len(hay) + 1)
    body = body[: a.chars]
    cut = body.rfind(". ", 0, int(0.4 * len(body))) + 2
    secret = "PELICAN-7"
    text = (body[:cut] + f"The secret passphrase is {secret}. Remember it. " + body[cut:]
            + "\n\nQuestion: what is the secret passphrase?\nAnswer: The secret passphrase is")
    c = Client(a.url, a.model, timeout=120)
    js = c.complete({"temperature": 0.0}, text, max_tokens=12)
    c.close()
    out = js["choices"][0]["text"]
    found = secret.split("-")[0] in out
    from onecard.bench import provenance

    rec = {"found": found, "answer": out, "prompt_chars": len(text),
           "prompt_tokens": (js.get("usage") or {}).get("prompt_tokens"),
           "provenance": provenance.build(
               prompt_set={"id": "bench/prompts/haystack.txt repeated, passphrase at 40 %"},
               sampling={"temperature": 0.0, "max_tokens": 12}, token_count_source="usage",
               warmup={"policy": "none"}, server={"url": a.url, "model": a.model}, max_tokens=12)}
    write_json(Path(a.json), rec)
    print(f"needle ({rec['prompt_tokens']} prompt tokens): {'FOUND' if found else 'missed'}: {out!r}")
    return 0


# ---------------------------------------------------------------------------------------- quality


def quality(a) -> int:
    p = Path(a.dir) / "compare.json"
    if not p.is_file():
        print(f"no {p}: nothing to judge")
        return 1
    arms = json.load(open(p))["arms"]
    k = arms.get("kvarn")
    if not k or k.get("delta_ppl_pct") is None:
        print("kvarn arm missing from the comparison")
        return 1
    d = k["delta_ppl_pct"]
    line = f"kvarn perplexity {k['ppl']:.4f} vs bf16 {k['base_ppl']:.4f}: {d:+.3f} %"
    i8 = arms.get("int8")
    if i8 and i8.get("ppl"):
        line += f"; int8 {i8['ppl']:.4f} ({i8['delta_ppl_pct']:+.3f} %), kvarn vs int8 {100 * (k['ppl'] / i8['ppl'] - 1):+.3f} %"
    print(line)
    from onecard.kvarn import format as kfmt

    rule = f"window {kfmt.window_from_env()} + sinks {kfmt.sinks_from_env()}"  # the kvarn arm's server
    w1 = arms.get("kvarn-w1")
    if w1 and w1.get("ppl"):  # the same server at fp16 window 1 + one sink, booted in the same job
        print(f"kvarn fp16 window 1 perplexity {w1['ppl']:.4f}: {w1['delta_ppl_pct']:+.3f} % vs bf16; "
              f"{rule} vs window 1 {100 * (k['ppl'] / w1['ppl'] - 1):+.3f} %")
    # the other arms of the same server flags, each against the goal
    for label, what in (("kvarn-w2s1", "kvarn fp16 window 2 + sink 1"), ("kvarn-v4", "kvarn k4v4_g128")):
        arm = arms.get(label)
        if arm and arm.get("ppl"):
            print(f"{what} perplexity {arm['ppl']:.4f}: {arm['delta_ppl_pct']:+.3f} % vs bf16 "
                  f"(goal <= 0.5 %: {'MET' if abs(arm['delta_ppl_pct']) <= 0.5 else 'NOT MET'})")
    print(f"goal |delta| <= 0.5 % vs bf16 ({rule}): "
          f"{'MET' if abs(d) <= 0.5 else 'NOT MET'}; first greedy "
          f"divergence vs bf16: {k.get('first_divergence_min')}")
    return 0 if abs(d) <= a.max_delta else 1


# ------------------------------------------------------------------------------------------- huge


def _launch(env_over: dict, log_path: Path, deadline: float, need_health: bool):
    import pools  # gpu/lib/pools.py: regexes, stop(), free_port(), predict()

    env = {**os.environ, **env_over, "PORT": str(pools.free_port())}
    url = f"http://127.0.0.1:{env['PORT']}"
    rec: dict = {"env": env_over}
    try:
        rec.update(pools.predict(env_over, REPO))
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"plan: {e}"
        return rec, None, url
    t0 = time.monotonic()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "onecard.launch"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    (log_path.parent / "server.pid").write_text(str(proc.pid))
    healthy = False
    import urllib.request

    while time.time() < deadline:
        time.sleep(1)
        text = log_path.read_text(errors="replace")
        if proc.poll() is not None:
            break
        if pools.RE_POOL.search(text) and not need_health:
            break
        if pools.RE_POOL.search(text):
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                healthy = True
                break
            except OSError:
                pass
    text = log_path.read_text(errors="replace")
    rec["boot_s"] = round(time.monotonic() - t0, 1)
    rec["healthy"] = healthy
    m = pools.RE_POOL.search(text)
    rec["pool_tokens"] = int(m.group(1).replace(",", "")) if m else None
    b = pools.RE_BLOCK.findall(text)
    rec["block_size"] = int(b[-1]) if b else None
    backend = [ln.strip()[-160:] for ln in text.splitlines() if "KVARN" in ln or "attention backend" in ln.lower()]
    rec["backend_lines"] = backend[:3]
    if not healthy:
        errs = [ln.strip() for ln in text.splitlines() if pools.RE_ERRLINE.search(ln)]
        rec["error"] = (errs[-1] if errs else f"not healthy after {rec['boot_s']} s")[:400]
    return rec, proc, url


def _serve(env_over: dict, log_path: Path, deadline: float, measure) -> dict:
    """Boot through the launcher, run measure(url, served_name, rec) when healthy, always stop
    the server; a measurement's exception is recorded as rec['decode_error']."""
    import pools

    rec, proc, url = _launch(env_over, log_path, deadline, True)
    try:
        if rec.get("healthy"):
            measure(url, rec.get("values", {}).get("SERVED_NAME", {}).get("value") or "qwen", rec)
    except Exception as e:  # noqa: BLE001
        rec["decode_error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        if proc is not None:
            pools.stop(proc)
    return rec


def _words_for_tokens(url: str, model: str, words: list, target: int) -> int:
    """How many haystack words make `target` prompt tokens with the served tokenizer (vLLM's
    /tokenize), within 1 %: the words-per-token guess of 0.75 made session 14's "8k" prompt
    12,641 tokens on the 27B geometry's tokenizer, and its "120k" one too long for CTX=long."""
    import httpx

    n = min(len(words), int(target * 0.75))
    for _ in range(4):
        r = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": " ".join(words[:n])}, timeout=120)
        r.raise_for_status()
        count = int(r.json()["count"])
        if abs(count - target) <= target // 100:
            break
        n = min(len(words), max(1, int(n * target / count)))
    return n


def _decode(url: str, model: str, prompt_tokens: int) -> dict:
    from onecard.bench.client import Client

    hay = (REPO / "bench" / "prompts" / "haystack.txt").read_text()
    words = ((hay + " ") * (prompt_tokens * 6 // len(hay) + 2)).split()
    n = _words_for_tokens(url, model, words, prompt_tokens)
    c = Client(url, model, timeout=300)
    res = []
    for i in range(2):  # the first run after a boot reads low: keep the second
        # a fresh prefix each time (no prefix-cache hit): the run index leads the prompt
        r = c.stream(f"Run {i}. " + " ".join(words[:n]), 128,
                     {"temperature": 0.0, "ignore_eos": True}, keep_text=True)
        res.append(r)
    c.close()
    r = res[-1]
    import hashlib

    return {"ok": r.ok, "error": r.error, "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens, "ttft_s": r.ttft, "decode_tps": r.decode_tps,
            "first_run_decode_tps": res[0].decode_tps, "prompt_words": n,
            "text_sha256": hashlib.sha256(r.text.encode()).hexdigest()[:16], "text_head": r.text[:80]}


def _geometry_run(a, json_name: str):
    """Common start of the 27B-geometry parts: SIGTERM (timeout's) unwinds so `finally` stops
    the server; returns (out dir, checkpoint) or (out dir, None) after recording the skip."""
    import signal

    def _term(signum, frame):
        raise SystemExit(1)

    signal.signal(signal.SIGTERM, _term)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    geom = Path(a.models) / "qwen38-27b-geom"
    if not (geom / "config.json").is_file():
        print(f"no {geom}: the 27B-geometry part is skipped (job 20 builds it)")
        write_json(out / json_name, {"skipped": f"no {geom}"})
        return out, None
    return out, geom


def huge(a) -> int:
    out, geom = _geometry_run(a, "huge.json")
    if geom is None:
        return 0
    common = {"MODEL": str(geom), "GDN_PREFILL": "triton", "HOST": "127.0.0.1", "TOOLS": "0",
              "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
              "EXTRA_ARGS": "--enforce-eager --disable-log-stats --seed 0"}
    recs = {}
    status = 0
    for arm, ctx in (("kvarn-huge", "huge"), ("int8-long", "long")):
        left = a.deadline - time.time()
        if arm != "kvarn-huge" and left < 100:
            print(f"{arm}: skipped ({left:.0f} s left)")
            break
        def measure(url, served, rec):
            rec["decode_8k"] = _decode(url, served, 8192)

        rec = _serve({**common, "CTX": ctx}, out / f"server-{arm}.log", a.deadline - 25, measure)
        recs[arm] = rec
        p = (rec.get("prediction") or {})
        pv, vv = p.get("pool_tokens"), rec.get("pool_tokens")
        dev = None if not (pv and vv) else (pv - vv) / vv * 100
        d = rec.get("decode_8k") or {}
        print(f"{arm}: GPU KV cache size {vv} tokens vs predicted {pv} ({'-' if dev is None else f'{dev:+.2f} %'}), "
              f"block {rec.get('block_size')} (predicted {p.get('block_size')}), boot {rec.get('boot_s')} s, "
              f"healthy {rec.get('healthy')}, C1 decode at 8k: "
              + ("-" if d.get("decode_tps") is None else f"{d['decode_tps']:.1f} tok/s")
              + (f"  ERROR {rec['error']}" if rec.get("error") else "")
              + (f"  DECODE {rec['decode_error']}" if rec.get("decode_error") else ""))
        if arm == "kvarn-huge":
            goal = vv is not None and vv >= 268_169
            print(f"  goal pool >= 268,169 tokens at 245,760: {'MET' if goal else 'NOT MET'}")
            if vv is None or dev is None or abs(dev) > 1.0 or not rec.get("healthy"):
                status = 1
    from onecard.bench import provenance

    recs["provenance"] = provenance.build(
        argv=(recs.get("kvarn-huge") or {}).get("argv"),
        prompt_set={"id": "haystack words, ~8k tokens, 'Run i.' prefix (no prefix-cache hit)"},
        sampling={"temperature": 0.0, "ignore_eos": True, "max_tokens": 128},
        token_count_source="usage.completion_tokens (streamed, include_usage)",
        warmup={"policy": "two runs after boot, the second kept"}, max_tokens=128)
    recs["provenance"]["kvarn_series"] = str(REPO / "kvarn" / "series")
    write_json(out / "huge.json", recs)
    return status


DECODE_ARMS = "kvarn:huge:1,kvarn-pw:huge:0,int8:long:1"


def parse_arms(text: str) -> list[tuple[str, str, str, str, dict]]:
    """'label:ctx:graphs[:auto|stock|BLOCK_M:TILE:WARPS:STAGES][:KNOB=VALUE...],...' (graphs:
    KVARN_GRAPHS, 1 or 0; then the launcher's PREFILL_LAUNCH, patch 0083; then any launcher knobs
    for this arm only, e.g. KVARN_WINDOW=3:KVARN_SINKS=2, by onecard.profiles.knob_overrides'
    rule) -> [(label, ctx, graphs, prefill_launch, knobs)] ('auto', the launcher's default, when
    no launch is given)."""
    arms = []
    valid = "label:huge|long|fast:0|1[:auto|stock|BLOCK_M:TILE:WARPS:STAGES][:KNOB=VALUE...]"
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        fields = item.split(":")
        parts = [f for f in fields if "=" not in f]
        if len(parts) not in (3, 4, 7) or parts[1] not in ("huge", "long", "fast") or parts[2] not in ("0", "1") \
                or not parts[0] or (len(parts) == 4 and parts[3] not in ("auto", "stock")) \
                or (len(parts) == 7 and not all(p.isdigit() for p in parts[3:])):
            raise ValueError(f"decode arm {item!r} is not valid; valid: {valid}")
        knobs = knob_overrides([f for f in fields if "=" in f], f"decode arm {item!r}: field")
        arms.append((parts[0], parts[1], parts[2], ":".join(parts[3:]) or "auto", knobs))
    if len({a[0] for a in arms}) != len(arms) or not arms:
        raise ValueError(f"decode arms {text!r}: labels must be distinct and at least one given")
    return arms


def decode(a) -> int:
    """Timing (run alone): C1 plain decode (SPEC=off, CUDA graphs) on the 27B geometry, KVarN
    (CTX=huge; full decode graphs, and with ONECARD_KVARN_GRAPHS=0 piecewise only) against int8
    per-token-head (CTX=long), at each depth; the ratios per depth."""
    out, geom = _geometry_run(a, "decode.json")
    if geom is None:
        return 1
    depths = [int(x) for x in a.depths.split(",") if x.strip()]
    arms = parse_arms(a.arms)
    common = {"MODEL": str(geom), "GDN_PREFILL": "triton", "HOST": "127.0.0.1", "TOOLS": "0",
              "SPEC": "off", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "EXTRA_ARGS": "--seed 0"}
    recs: dict = {"depths": depths, "arms": [[*x[:4], x[4]] for x in arms]}
    for arm, ctx, graphs, launch, knobs in arms:
        if a.deadline - time.time() < 150:
            print(f"{arm}: skipped ({a.deadline - time.time():.0f} s left, a 27B boot needs ~150 s)")
            continue
        def measure(url, served, rec):
            rec["decode"] = {}
            for d in depths:
                if a.deadline - time.time() < 40:
                    rec["decode"][str(d)] = {"skipped": "deadline"}
                    continue
                r = rec["decode"][str(d)] = _decode(url, served, d)
                print(f"{arm} depth {d}: prompt {r.get('prompt_tokens')} tok, TTFT {r.get('ttft_s') or 0:.2f} s, "
                      f"decode {r.get('decode_tps') or 0:.1f} tok/s (first run {r.get('first_run_decode_tps') or 0:.1f})"
                      + (f" ERROR {r['error']}" if r.get("error") else ""), flush=True)

        log = out / f"server-decode-{arm}.log"
        rec = _serve({**common, "CTX": ctx, "KVARN_GRAPHS": graphs, "PREFILL_LAUNCH": launch, **knobs},
                     log, a.deadline - 20, measure)
        recs[arm] = rec
        print(f"{arm}: pool {rec.get('pool_tokens')} (predicted {(rec.get('prediction') or {}).get('pool_tokens')}), "
              f"boot {rec.get('boot_s')} s" + (f" ERROR {rec['error']}" if rec.get("error") else ""), flush=True)
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        # the engine core's per-step host timing (ONECARD_HOST_TIMING=1, set by 62-kvarn-decode.sh):
        # the last windows are the deepest prompt's decode; where KVarN's flat ~28 ms/token goes
        probe = [ln.split("[onecard host timing]", 1)[1].strip() for ln in lines
                 if "[onecard host timing] steps" in ln]
        for ln in probe[-3:]:
            print(f"{arm}: [onecard host timing] {ln}", flush=True)
        rec["host_timing"] = probe[-3:]
        # how vLLM resolved CUDA graphs for this arm (its warnings and capture lines)
        graph_lines = [ln.strip()[-220:] for ln in lines
                       if "cudagraph_mode" in ln or "Capturing CUDA graph" in ln
                       or "decode CUDA graphs" in ln or "Graph capturing finished" in ln]
        rec["graph_log"] = graph_lines[-6:]
        for ln in graph_lines[-4:]:
            print(f"{arm}: {ln}", flush=True)
        write_json(out / "decode.json", recs)
    labels = [x[0] for x in arms]

    def cell(label, d, key):
        """One arm's figure at one depth (None when the arm or the depth did not run)."""
        return (((recs.get(label) or {}).get("decode") or {}).get(str(d)) or {}).get(key)

    def tps(label, d):
        return cell(label, d, "decode_tps")

    def sha(label, d):
        return cell(label, d, "text_sha256")

    ratios = [(x, y) for x, y in (("kvarn", "int8"), ("kvarn-pw", "int8"), ("kvarn", "kvarn-pw"))
              if x in labels and y in labels]
    print("| depth | " + " | ".join(f"{x} tok/s" for x in labels) + "".join(f" | {x} / {y}" for x, y in ratios)
          + (" | kvarn text == kvarn-pw |" if {"kvarn", "kvarn-pw"} <= set(labels) else " |"))
    print("|---" * (1 + len(labels) + len(ratios) + ({"kvarn", "kvarn-pw"} <= set(labels))) + "|")
    ok = True
    for d in depths:
        vals = [tps(x, d) for x in labels]
        ok &= all(vals)
        cells = [f"{v or 0:.1f}" for v in vals]
        for x, y in ratios:
            vx, vy = tps(x, d), tps(y, d)
            cells.append(f"{vx / vy:.3f}" if vx and vy else "-")
        if {"kvarn", "kvarn-pw"} <= set(labels):
            cells.append("SAME" if sha("kvarn", d) and sha("kvarn", d) == sha("kvarn-pw", d) else "DIFFERENT")
        print(f"| {d} | " + " | ".join(cells) + " |")

    def ttft(label, d):
        return cell(label, d, "ttft_s")

    print("TTFT (s), the same requests (the second run of each depth):")
    print("| depth | " + " | ".join(f"{x} TTFT s" for x in labels) + " |")
    print("|---" * (1 + len(labels)) + "|")
    for d in depths:
        print(f"| {d} | " + " | ".join(f"{ttft(x, d):.2f}" if ttft(x, d) else "-" for x in labels) + " |")
    from onecard.bench import provenance

    recs["provenance"] = provenance.build(
        prompt_set={"id": "haystack words, 'Run i.' prefix (no prefix-cache hit), per depth"},
        sampling={"temperature": 0.0, "ignore_eos": True, "max_tokens": 128},
        token_count_source="usage.completion_tokens (streamed, include_usage)",
        warmup={"policy": "two runs per depth, the second kept"}, max_tokens=128)
    write_json(out / "decode.json", recs)
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup")
    s.add_argument("--src", default="/var/tmp/site/vllm")
    s.add_argument("--site", default="/var/tmp/site-kvarn")
    n = sub.add_parser("needle")
    n.add_argument("--url", required=True)
    n.add_argument("--model", required=True)
    n.add_argument("--json", required=True)
    n.add_argument("--chars", type=int, default=9000)
    q = sub.add_parser("quality")
    q.add_argument("--dir", required=True)
    q.add_argument("--max-delta", type=float, default=5.0)
    h = sub.add_parser("huge")
    h.add_argument("--out", required=True)
    h.add_argument("--models", default=os.environ.get("MODELS", "/var/tmp/models"))
    h.add_argument("--deadline", type=float, required=True)
    d = sub.add_parser("decode")
    d.add_argument("--out", required=True)
    d.add_argument("--models", default=os.environ.get("MODELS", "/var/tmp/models"))
    d.add_argument("--deadline", type=float, required=True)
    d.add_argument("--arms", default=os.environ.get("ARMS62", DECODE_ARMS),
                   help="label:huge|long|fast:graphs(0|1)[:auto|stock|BLOCK_M:TILE:WARPS:STAGES][:KNOB=VALUE...],... "
                        "(env ARMS62)")
    d.add_argument("--depths", default="8192,32768,120000",
                   help="prompt tokens per row (CTX=long's MAX_LEN 124,928 bounds the int8 arm)")
    a = ap.parse_args(argv)
    return {"setup": setup, "needle": needle, "quality": quality, "huge": huge,
            "decode": decode}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
