"""Markdown tables (and optional matplotlib plots) from result JSON files.

Every table names the result's verdict, prompt set (id + hash prefix), token-count source and
duration, so a figure never travels without what makes it comparable.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .results import atomic_write_text


def _f(x: Any, nd: int = 1) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def load_results(paths: list[str | Path]) -> list[dict]:
    out = []
    for p in paths:
        p = Path(p)
        files = sorted(p.glob("*.json")) if p.is_dir() else [p]
        for f in files:
            try:
                d = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(d, dict) and "kind" in d and "provenance" in d:
                d.setdefault("path", str(f))
                out.append(d)
    return out


def _header(r: dict) -> list[str]:
    prov = r.get("provenance") or {}
    ps = prov.get("prompt_set") or {}
    srv = prov.get("server") or {}
    gpus = ", ".join(g.get("name", "?") for g in (prov.get("gpu") or {}).get("gpus", [])) or "no GPU seen"
    verdict = r.get("verdict")
    reasons = "; ".join(r.get("verdict_reasons") or [])
    return [
        f"### {r.get('kind')} — {Path(r.get('path', '')).name}",
        "",
        f"- verdict: **{verdict}**{' — ' + reasons if reasons else ''}",
        f"- model: `{srv.get('model')}` at {srv.get('url')} · vLLM {prov.get('vllm_version')} · "
        f"commit {str((prov.get('git') or {}).get('commit'))[:10]} · series "
        f"{str((prov.get('patch_series') or {}).get('hash'))[:12]} · {gpus}",
        f"- prompts: `{ps.get('id')}` ({str(ps.get('hash'))[:12]}, n={ps.get('n')}"
        f"{', salted' if ps.get('salted') else ''}) · max_tokens {prov.get('max_tokens')} · sampling "
        f"{json.dumps(prov.get('sampling'))} · tokens from `{prov.get('token_count_source')}` · "
        f"warmup {(prov.get('warmup') or {}).get('discarded')} discarded · {prov.get('date')}",
        "",
    ]


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(_f(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return out + [""]


def render(r: dict) -> list[str]:
    k = r.get("kind")
    d = r.get("data") or {}
    lines = _header(r)
    if k == "ladder":
        rows = []
        for lv in d.get("levels", []):
            kvp = lv.get("kv_peak")
            kvm = lv.get("kv_mean")
            rows.append([f"C{lv['n']}", lv.get("aggregate_tps"), lv.get("decode_window_tps"),
                         lv.get("per_stream_decode_tps"),
                         lv.get("per_stream_decode_tps_min"), _f(lv.get("ttft_mean"), 3),
                         _f(None if kvp is None else 100 * kvp) + " / " + _f(None if kvm is None else 100 * kvm),
                         _f(lv.get("duration_s"), 1), _f(lv.get("preemptions"), 0),
                         "TAIL" if lv.get("tail_mode") else "full", lv.get("failed")])
        lines += _table(["N", "aggregate tok/s", "all-N-decoding tok/s", "per-stream decode tok/s", "slowest stream",
                         "TTFT s", "kv% peak / mean", "over s", "preempt", "overlap", "failed"], rows)
    elif k == "depth":
        lines += _table(["context", "prompt tok", "TTFT s", "prefill tok/s", "decode tok/s", "ok"],
                        [[p["context"], p.get("prompt_tokens"), _f(p.get("ttft"), 3), p.get("prefill_tps"),
                          p.get("decode_tps"), p.get("ok")] for p in d.get("points", [])])
        for sk in d.get("skipped", []):
            lines += [f"- skipped context {sk['context']}: {sk['reason']}"]
        lines += [""] if d.get("skipped") else []
    elif k == "prefix_turns":
        lines += _table(["turn", "prompt tok", "TTFT s", "cached tok", "cache hits", "decode tok/s"],
                        [[t["turn"], t.get("prompt_tokens"), _f(t.get("ttft"), 3), t.get("cached_tokens"),
                          _f(t.get("prefix_cache_hits"), 0), t.get("decode_tps")] for t in d.get("turns", [])])
    elif k == "needle":
        lines += _table(["context", "depth", "prompt tok", "found", "answer"],
                        [[c["context"], _f(c["depth"], 2), c.get("prompt_tokens"), c.get("found"),
                          "`" + (c.get("answer") or "").replace("|", "/").replace("`", "'")[:40] + "`"]
                         for c in d.get("cases", [])])
        lines += [f"recall: {_f(d.get('recall'), 2)}", ""]
    elif k == "perplexity":
        lines += _table(["prompt", "tokens", "nll", "ppl"],
                        [[p["id"], p.get("tokens"), _f(p.get("nll"), 4), _f(p.get("ppl"), 3)]
                         for p in d.get("prompts", [])])
        lines += [f"perplexity: **{_f(d.get('ppl'), 3)}** over {d.get('tokens')} tokens ({d.get('method')})", ""]
    elif k == "spec":
        rows = []
        for c in d.get("classes", []):
            sp = c.get("spec") or {}
            rows.append([c["class"], c.get("decode_tps"), c.get("tokens"), c.get("chunks"),
                         _f(c.get("tokens_per_chunk"), 2), _f(sp.get("tokens_per_step"), 2),
                         ", ".join(f"{x:.2f}" for x in sp.get("acceptance_per_position", [])) or "no speculation"])
        lines += _table(["class", "decode tok/s", "tokens", "chunks", "tok/chunk", "tokens/step",
                         "acceptance per position"], rows)
    elif k == "ab":
        lines += [f"A/B on `{d.get('knob')}`: **{(d.get('verdict') or {}).get('status')}** — "
                  f"{'; '.join((d.get('verdict') or {}).get('reasons', []))}", ""]
    return lines


def markdown(results: list[dict], title: str = "onecard benchmark report") -> str:
    lines = [f"# {title}", ""]
    for r in results:
        lines += render(r)
    return "\n".join(lines) + "\n"


def _pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return None
    return plt


def _save(plt, fig, path: str | Path) -> Path:
    """Write the figure atomically (temp file + rename) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)
    return path


def plot_ladders(results: list[dict], path: str | Path) -> Path | None:
    """Aggregate and per-stream tok/s vs N for every ladder result; None if matplotlib missing."""
    plt = _pyplot()
    if plt is None:
        return None
    ladders = [r for r in results if r.get("kind") == "ladder" and (r.get("data") or {}).get("levels")]
    if not ladders:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in ladders:
        lv = r["data"]["levels"]
        pid = (r["provenance"].get("prompt_set") or {}).get("id")
        name = " ".join(x for x in (r.get("label"), pid) if x) or "run"  # e.g. "smol prose", "smol code"
        ns = [x["n"] for x in lv]
        ax.plot(ns, [x.get("aggregate_tps") or 0 for x in lv], marker="o", label=f"{name} aggregate")
        ax.plot(ns, [x.get("per_stream_decode_tps") or 0 for x in lv], marker="x", ls="--",
                label=f"{name} per stream")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("tok/s (usage.completion_tokens)")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_depth(results: list[dict], path: str | Path) -> Path | None:
    """TTFT and decode tok/s against context depth for every depth result."""
    plt = _pyplot()
    if plt is None:
        return None
    runs = [r for r in results if r.get("kind") == "depth" and (r.get("data") or {}).get("points")]
    if not runs:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for r in runs:
        pts = [p for p in r["data"]["points"] if p.get("ok")]
        xs = [p.get("prompt_tokens") or p["context"] for p in pts]
        name = r.get("label") or "run"
        a1.plot(xs, [p.get("ttft") or 0 for p in pts], marker="o", label=name)
        a2.plot(xs, [p.get("decode_tps") or 0 for p in pts], marker="o", label=name)
    a1.set_xlabel("prompt tokens")
    a1.set_ylabel("TTFT s (salted, no cache)")
    a2.set_xlabel("prompt tokens")
    a2.set_ylabel("decode tok/s")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    return _save(plt, fig, path)


def write_report(result_paths: list[str | Path], out_md: str | Path, plot: str | Path | None = None) -> str:
    results = load_results(result_paths)
    text = markdown(results)
    if plot:
        p = plot_ladders(results, plot)
        if p is not None:
            text += f"\n![ladder]({Path(p).name})\n"
        plot = Path(plot)
        p = plot_depth(results, plot.with_name(plot.stem + "-depth" + plot.suffix))
        if p is not None:
            text += f"\n![depth]({Path(p).name})\n"
    atomic_write_text(out_md, text)
    return text
