#!/usr/bin/env python3
"""Job 32's client side: KV-cache quantization quality on a running server (SmolLM2-135M).

  measure --url URL --model NAME --label LABEL --json PATH
      teacher-forced log-probabilities of every prompt token of the fixed texts (bench/prompts
      prose + code, through onecard.bench.runner.prompt_logprobs: echo+logprobs, else
      prompt_logprobs) and greedy continuations (temperature 0, GEN tokens, token ids from
      logprobs.tokens with return_tokens_as_token_ids) of the same texts. A greedy request that
      fails (session 30: HTTP 400 on a NaN log-probability) is bisected on max_tokens: the row's
      `greedy_failure.step` is the first generated position whose request fails.
  compare --dir DIR [--base bf16]
      per arm vs the base arm: perplexity and its delta (%), mean |delta logprob| per token,
      first position where the greedy tokens differ (per prompt, and the minimum), failed prompts
      as `id:ERROR@position`, as a table;
      writes DIR/compare.json. Exit 1 if an arm's files are missing or token counts disagree.
Writes are atomic. Exit 0 when every request succeeded; 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from onecard.bench import prompts as P  # noqa: E402
from onecard.bench import provenance  # noqa: E402
from onecard.bench.client import Client  # noqa: E402
from onecard.bench.runner import prompt_logprobs  # noqa: E402
from jobutil import write_json  # noqa: E402  (gpu/lib/jobutil.py)

GEN = 96


LONG_DOCS = ("README.md", "docs/wide-verify.md")  # this repository's own prose, 6,000 chars each
LONG_CHARS = 6000


def texts(n_per_class: int = 3) -> list[tuple[str, str]]:
    """Short prompts of each class, plus two long documents: KVarN keeps the first 128-token tile
    and the tile being written in fp16, so only texts well past one tile (~1,500 SmolLM2 tokens
    here) put its 4/2-bit path under the perplexity (2026-12-02: the short texts alone measured
    kernel arithmetic, not quantization)."""
    out = []
    for cls in ("prose", "code"):
        ps = P.load(cls)
        out += list(zip(ps.ids, ps.prompts))[:n_per_class]
    root = Path(__file__).resolve().parents[2]
    for rel in LONG_DOCS:
        text = (root / rel).read_text(encoding="utf-8")[:LONG_CHARS]
        out.append((f"doc-{Path(rel).stem}", text))
    return out


def texts_id() -> dict:
    import hashlib
    joined = "\x00".join(f"{i}\x01{t}" for i, t in texts())
    return {"id": "prose+code first 3 each + 2 repo docs x 6000 chars",
            "sha256": hashlib.sha256(joined.encode()).hexdigest()[:16], "classes": ["prose", "code", "doc"]}


def greedy_tokens(c: Client, text: str, n: int) -> list[str]:
    js = c.complete({"temperature": 0.0, "logprobs": 0, "ignore_eos": True,
                     "return_tokens_as_token_ids": True}, text, max_tokens=n)
    toks = ((js["choices"][0].get("logprobs") or {}).get("tokens")) or []
    if not toks:
        raise RuntimeError("server returned no logprobs.tokens for the greedy continuation")
    return [str(t) for t in toks]


def first_failing_length(c: Client, text: str, n: int, error: str = "") -> dict:
    """After a greedy request of n tokens failed: bisect max_tokens for the shortest request that
    still fails, so a NaN log-probability is pinned to one generated position (0-based `step`), and
    keep the tokens the longest passing request returned. About log2(n) short requests."""
    lo, hi, ok_tokens, last_err = 0, n, [], error
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            ok_tokens = greedy_tokens(c, text, mid)
            lo = mid
        except Exception as exc:  # noqa: BLE001
            hi, last_err = mid, f"{type(exc).__name__}: {exc}"
    return {"step": hi - 1, "passing_tokens": ok_tokens, "error": last_err[:300]}


def measure(a) -> int:
    c = Client(a.url, a.model, timeout=120)
    rows, ok = [], True
    prov = provenance.build(
        prompt_set=texts_id(), sampling={"temperature": 0.0, "greedy_tokens": a.gen},
        token_count_source="server logprobs", warmup={"policy": "none (logprobs are exact)"},
        server=c.server_info(), max_tokens=a.gen)
    for pid, text in texts():
        row = {"id": pid}
        try:
            lps, method = prompt_logprobs(c, text)
            row.update(logprobs=lps, method=method)
            try:
                row["greedy"] = greedy_tokens(c, text, a.gen)
            except Exception as exc:
                row["greedy_failure"] = first_failing_length(c, text, a.gen, f"{type(exc).__name__}: {exc}")
                print(f"{a.label:<6} {pid:<14} greedy fails from generated position "
                      f"{row['greedy_failure']['step']} on", flush=True)
                raise
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {exc}"
            ok = False
        rows.append(row)
        n = len(row.get("logprobs", []))
        print(f"{a.label:<6} {pid:<14} {n:>4} prompt tokens, {len(row.get('greedy', []))} greedy"
              + (f"  ERROR {row['error']}" if "error" in row else ""), flush=True)
        # after every text: a measurement cut by the job's time limit keeps what it measured
        write_json(a.json, {"kind": "kv_quality", "label": a.label, "rows": rows, "complete": False,
                            "provenance": prov})
    c.close()
    write_json(a.json, {"kind": "kv_quality", "label": a.label, "rows": rows, "complete": True,
                        "provenance": prov})
    return 0 if ok else 1


def first_divergence(a: list[str], b: list[str]) -> int | None:
    """Index of the first differing token; None when equal over the shorter length."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def compare(a) -> int:
    d = Path(a.dir)
    arms = {}
    for p in sorted(d.glob("kvq-*.json")):
        rec = json.load(open(p))
        arms[rec["label"]] = {r["id"]: r for r in rec["rows"]}
    if a.base not in arms:
        print(f"no base arm {a.base!r} in {d} (have {sorted(arms)}); valid: run measure for it first")
        return 1
    base = arms[a.base]
    bad = 0
    out = {"base": a.base, "arms": {}}
    print(f"| KV | ppl | delta ppl | mean abs delta logprob | first greedy divergence (min / per prompt) |")
    print("|---|---|---|---|---|")
    for label, rows in arms.items():
        tot_lp = tot_base = 0.0
        n = 0
        abs_d = 0.0
        divs = {}
        failed = []  # prompts whose request failed (their error is in the arm's kvq-*.json)
        fail_at = {}  # prompt -> first generated position whose greedy request fails (bisected)
        for pid in base:
            if pid not in rows:  # the arm's measurement stopped before this text (time limit)
                bad += 1
                failed.append(pid)
        for pid, r in rows.items():
            b = base.get(pid)
            if b is None or "logprobs" not in r or "logprobs" not in b:
                bad += 1
                failed.append(pid)
                continue
            if len(r["logprobs"]) != len(b["logprobs"]):
                print(f"{label} {pid}: {len(r['logprobs'])} vs {len(b['logprobs'])} prompt tokens")
                bad += 1
                continue
            tot_lp += sum(r["logprobs"])
            tot_base += sum(b["logprobs"])
            abs_d += sum(abs(x - y) for x, y in zip(r["logprobs"], b["logprobs"]))
            n += len(r["logprobs"])
            if "greedy" in r and "greedy" in b:
                divs[pid] = first_divergence(r["greedy"], b["greedy"])
            else:  # teacher-forced log-probabilities counted, the greedy continuation failed
                bad += 1
                failed.append(pid)
                if "greedy_failure" in r:
                    fail_at[pid] = r["greedy_failure"]["step"]
        ppl = math.exp(-tot_lp / n) if n else None
        ppl_b = math.exp(-tot_base / n) if n else None
        delta = 100 * (ppl / ppl_b - 1) if ppl and ppl_b else None
        finite = [v for v in divs.values() if v is not None]
        first = min(finite) if finite else None
        out["arms"][label] = {"ppl": ppl, "base_ppl": ppl_b, "delta_ppl_pct": delta, "tokens": n,
                              "mean_abs_dlogprob": abs_d / n if n else None,
                              "first_divergence": divs, "first_divergence_min": first,
                              "failed": failed, "failed_from_position": fail_at}
        f = lambda x, nd=3: "-" if x is None else f"{x:.{nd}f}"  # noqa: E731
        per = ", ".join([f"{k}:{'none' if v is None else v}" for k, v in divs.items()]
                        + [f"{k}:ERROR" + (f"@{fail_at[k]}" if k in fail_at else "") for k in failed])
        print(f"| {label} | {f(ppl)} | {f(delta, 2)}% | {f(abs_d / n if n else None, 4)} | "
              f"{'none' if first is None else first} / {per} |")
    write_json(d / "compare.json", out)
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--url", required=True)
    m.add_argument("--model", required=True)
    m.add_argument("--label", required=True)
    m.add_argument("--json", required=True, type=Path)
    m.add_argument("--gen", type=int, default=GEN)
    c = sub.add_parser("compare")
    c.add_argument("--dir", required=True)
    c.add_argument("--base", default="bf16")
    a = ap.parse_args(argv)
    return measure(a) if a.cmd == "measure" else compare(a)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
