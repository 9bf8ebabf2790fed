"""The benchmarks. Each one: warmup (discarded), /metrics sampled around the measured window,
provenance, a result file rewritten after every step, and a contract verdict at the end.

Kinds:
  ladder        concurrency ladder C1..C8: aggregate + per-stream, kv% peak/mean, preemptions,
                tail-mode flag when no instant had all N streams decoding
  depth         decode tok/s and TTFT at context depths (salted: axes 2 and 3, prefill slope)
  prefix_turns  one document, K turns, TTFT + cached tokens each (cold first turn via a salt)
  needle        recall of a passphrase at depths within a haystack
  perplexity    teacher-forced perplexity via echo + logprobs (fallback: prompt_logprobs)
  spec          speculation acceptance per position and tokens/step by prompt class
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import fairness, metrics, prompts as P, provenance
from .client import TOKEN_SOURCE, Client, RequestResult
from .metrics import Sampler
from .results import ResultFile

DEFAULT_SAMPLING = {"temperature": 0.0, "ignore_eos": True}
KINDS = ("ladder", "depth", "prefix_turns", "needle", "perplexity", "spec")


@dataclass
class Target:
    url: str
    model: str
    api_key: str | None = None
    endpoint: str = "completions"
    out_dir: str = "bench-results"
    warmup: int = 1
    metrics_interval: float = 0.25
    sampling: dict = field(default_factory=lambda: dict(DEFAULT_SAMPLING))
    label: str | None = None
    argv: list[str] | None = None
    server_config: dict = field(default_factory=dict)
    #: provenance fields this target knows better than the client process (e.g. the stock arm of
    #: a patched-vs-stock run: no patch series applied to the server's vLLM)
    provenance_overrides: dict = field(default_factory=dict)
    log: Callable[[str], None] = print

    def client(self) -> Client:
        return Client(self.url, self.model, api_key=self.api_key, endpoint=self.endpoint)


# -- shared plumbing -------------------------------------------------------------------------
def _warmup(t: Target, c: Client, prompt: str, max_tokens: int = 16) -> dict:
    done = 0
    errors = []
    for _ in range(max(0, t.warmup)):
        r = c.stream(P.salt(prompt), max_tokens, t.sampling, keep_text=False)
        if r.ok:
            done += 1
        else:
            errors.append(r.error)
    time.sleep(0.3)  # let the server's counters absorb the warmup before the window opens
    return {"policy": f"{t.warmup} salted request(s) of {max_tokens} tokens before measuring, "
                      "discarded", "discarded": done, "errors": errors[:2]}


def _open(t: Target, kind: str, pset: dict | None, max_tokens: Any, warm: dict,
          token_source: str = TOKEN_SOURCE, extra: dict | None = None) -> tuple[ResultFile, dict]:
    c = t.client()
    server = c.server_info()
    prov = provenance.build(argv=t.argv, prompt_set=pset, sampling=t.sampling,
                            token_count_source=token_source, warmup=warm, server=server,
                            max_tokens=max_tokens)
    prov.update(t.provenance_overrides or {})
    result = {"kind": kind, "label": t.label, "provenance": prov, "server_config": t.server_config,
              "traffic": {"requests": 0, "completion_tokens": 0, "failed": 0, "first_error": None,
                          "concurrency": 1},
              "data": {}, **(extra or {})}
    return ResultFile(t.out_dir, kind, result, label=t.label), result


def _account(result: dict, rs: list[RequestResult]) -> None:
    tr = result["traffic"]
    for r in rs:
        tr["requests"] += 1
        tr["completion_tokens"] += r.completion_tokens or 0
        if not r.ok:
            tr["failed"] += 1
            tr["first_error"] = tr["first_error"] or r.error


def _server_side(t: Target, result: dict, sampler: Sampler,
                 reqs: list[tuple[str, RequestResult]]) -> list[dict]:
    """Record the server's view of requests sent one at a time (one in flight) inside
    ``sampler``'s window, in order, in ``result["server_side"]["requests"]``; logs a stall the
    moment it is seen (the contract's verdict comes at the end)."""
    ss = result.setdefault("server_side", {"requests": []})
    out = []
    for i, (at, r) in enumerate(reqs):
        t_next = reqs[i + 1][1].t_start if i + 1 < len(reqs) else None
        rec = {"n": len(ss["requests"]) + 1, "at": at, "client_ttft": r.ttft,
               **metrics.server_view(sampler.samples, r.t_start, r.t_first, r.t_end, t_next)}
        ss["requests"].append(rec)
        out.append(rec)
        why = fairness.stall_reason(rec)
        if why:
            t.log(f"WARNING {why}")
    return out


def _finish(rf: ResultFile, result: dict) -> dict:
    result["partial"] = False
    verdict, reasons = fairness.verdict_for(result)
    rf.finish(verdict, reasons)
    result["path"] = str(rf.path)
    return result


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """Largest number of intervals open at one instant."""
    ev = []
    for a, b in intervals:
        ev.append((a, 1))
        ev.append((b, -1))
    ev.sort(key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in ev:
        cur += d
        best = max(best, cur)
    return best


def run_concurrent(c: Client, prompt_list: list[str], max_tokens: int, sampling: dict,
                   keep_times: bool = False) -> list[RequestResult]:
    """Start len(prompt_list) streams together (barrier) and wait for all. ``keep_times``: keep
    every content chunk's arrival time (``decode_window`` needs them)."""
    n = len(prompt_list)
    out: list[RequestResult | None] = [None] * n
    barrier = threading.Barrier(n)

    def work(i: int) -> None:
        try:
            barrier.wait(timeout=30)
        except threading.BrokenBarrierError:
            pass
        out[i] = c.stream(prompt_list[i], max_tokens, sampling, keep_text=False, keep_times=keep_times)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=c.timeout + 60)
    return [r if r is not None else RequestResult(error="client thread did not finish") for r in out]


DECODE_WINDOW_SOURCE = ("usage.completion_tokens of each stream, apportioned by its content chunks' arrival "
                        "times inside the window in which every stream of the level was decoding")


def decode_window(rs: list[RequestResult], min_chunks: int = 4) -> dict | None:
    """The aggregate decode rate of a level while *all* its streams decode at once.

    The window runs from the last stream's first content chunk to the first stream's last one.
    Each stream's tokens inside it are its ``completion_tokens`` (the server's count, never the
    chunks) times the share of its chunks that arrived in (start, end]; the rate is their sum over
    the window's length. Unlike ``aggregate_tps`` (tokens over the whole wall time), it leaves out
    the prefill of every stream and the time a stream decoded alone while another prefilled: at
    32k tokens per prompt and 128 tokens per stream the wall time is mostly prefill, which made
    an aggregate of two concurrent streams read ~19 tok/s against ~100 for one stream.

    Returns None without chunk times (``keep_times`` off) or when a request failed; ``tps`` is
    None when the streams never all decoded together (vLLM queued some: the KV pool) or when a
    stream had fewer than ``min_chunks`` chunks in the window (too few to be a rate). One chunk is
    one engine step: under speculative decoding the share is a step share, not a token share.
    """
    if not rs or any(not r.ok or not r.completion_tokens or not r.chunk_times for r in rs):
        return None
    w0 = max(r.chunk_times[0] for r in rs)
    w1 = min(r.chunk_times[-1] for r in rs)
    out = {"tps": None, "window_s": max(0.0, w1 - w0), "tokens": 0.0, "streams": len(rs),
           "source": DECODE_WINDOW_SOURCE}
    if w1 <= w0:
        out["why"] = "the streams never all decoded at once"
        return out
    tokens, fewest = 0.0, None
    for r in rs:
        inside = sum(1 for t in r.chunk_times if w0 < t <= w1)
        fewest = inside if fewest is None else min(fewest, inside)
        tokens += r.completion_tokens * inside / len(r.chunk_times)
    out["tokens"] = tokens
    if fewest < min_chunks:
        out["why"] = f"a stream had {fewest} chunk(s) in the {w1 - w0:.3f} s window (< {min_chunks})"
        return out
    out["tps"] = tokens / (w1 - w0)
    return out


def level_stats(rs: list[RequestResult], n: int) -> dict:
    ok = [r for r in rs if r.ok]
    t0 = min(r.t_start for r in rs)
    t1 = max((r.t_end or r.t_start) for r in rs)
    toks = sum(r.completion_tokens or 0 for r in ok)
    spans = [(r.t_first, r.t_last) for r in ok if r.t_first is not None and r.t_last is not None]
    overlap = max_overlap(spans) if spans else 0
    window = decode_window(rs)
    return {
        "n": n, "ok": len(ok), "failed": len(rs) - len(ok),
        "completion_tokens": toks, "chunks": sum(r.chunks for r in rs),
        "wall_s": t1 - t0,
        "aggregate_tps": toks / (t1 - t0) if t1 > t0 else None,
        "per_stream_decode_tps": [r.decode_tps for r in ok],
        "per_stream_decode_tps_mean": _mean([r.decode_tps for r in ok]),
        "per_stream_decode_tps_min": min((r.decode_tps for r in ok if r.decode_tps), default=None),
        "ttft_mean": _mean([r.ttft for r in ok]), "ttft_max": max((r.ttft for r in ok if r.ttft), default=None),
        "max_streams_decoding": overlap,
        "tail_mode": overlap < n,
        "decode_window": window,
        "decode_window_tps": (window or {}).get("tps"),
        "requests": [r.summary() for r in rs],
    }


# -- ladder ----------------------------------------------------------------------------------
def ladder(t: Target, pset: P.PromptSet, ns: list[int], max_tokens: int = 256, reps: int = 2,
           shared: bool = False) -> dict:
    if not ns or any(n < 1 for n in ns):
        raise ValueError(f"--n must be positive integers, got {ns}")
    c = t.client()
    warm = _warmup(t, c, pset.prompts[0])
    # Unshared ladders salt every request: TTFT is then a full prefill on every level and rep,
    # never a prefix-cache hit left over from the previous level.
    rf, result = _open(t, "ladder", pset.record(salted=not shared), max_tokens, warm,
                       extra={"shared_prompt": shared})
    levels = result["data"]["levels"] = []
    result["traffic"]["concurrency"] = max(ns)
    try:
        for n in ns:
            reps_out = []
            for rep in range(reps):
                plist = [pset.prompts[0]] * n if shared else [P.salt(p) for p in pset.cycle(n)]
                sampler = Sampler(t.url, t.metrics_interval, t.api_key).start()
                rs = run_concurrent(c, plist, max_tokens, t.sampling, keep_times=True)
                m = sampler.stop()
                _account(result, rs)
                st = level_stats(rs, n)
                st["rep"] = rep
                if n == 1:  # one request in flight: the server's view is unambiguous
                    sv = _server_side(t, result, sampler, [(f"C1 rep{rep}", rs[0])])[0]
                    st["requests"][0]["server"] = sv
                st["metrics"] = m
                reps_out.append(st)
                result["metrics"] = _merge_metrics(result.get("metrics"), m)
                levels_entry = _ladder_level(n, reps_out)
                if levels and levels[-1]["n"] == n:
                    levels[-1] = levels_entry
                else:
                    levels.append(levels_entry)
                rf.save()
                t.log(f"C{n} rep{rep}: aggregate {_fmt(st['aggregate_tps'])} tok/s (all {n} decoding: "
                      f"{_fmt(st['decode_window_tps'])}), per-stream "
                      f"{_fmt(st['per_stream_decode_tps_mean'])} tok/s, TTFT {_fmt(st['ttft_mean'], 3)} s"
                      f"{', TAIL-MODE' if st['tail_mode'] else ''}"
                      f"{', FAILED ' + str(st['failed']) if st['failed'] else ''}")
                if st["failed"] == n:
                    raise RuntimeError(f"all {n} requests failed at C{n}: {rs[0].error}")
    except BaseException as exc:
        rf.abort(f"aborted: {type(exc).__name__}: {exc}")
        result["path"] = str(rf.path)
        if isinstance(exc, KeyboardInterrupt):
            raise
        result["verdict"] = "INVALID"
        return result
    return _finish(rf, result)


def _ladder_level(n: int, reps: list[dict]) -> dict:
    def g(key):
        return [r[key] for r in reps]
    kv = [((r["metrics"].get("gauges") or {}).get("kv_usage") or {}) for r in reps]
    windows = g("decode_window_tps")
    return {
        "n": n, "reps": reps,
        "aggregate_tps": _median(g("aggregate_tps")),
        # None unless every rep had a window in which all n streams decoded (see decode_window)
        "decode_window_tps": _median(windows) if all(x is not None for x in windows) else None,
        "per_stream_decode_tps": _median(g("per_stream_decode_tps_mean")),
        "per_stream_decode_tps_min": min((x for x in g("per_stream_decode_tps_min") if x), default=None),
        "ttft_mean": _median(g("ttft_mean")),
        "kv_peak": max((k.get("peak") for k in kv if k.get("peak") is not None), default=None),
        "kv_mean": _mean([k.get("mean") for k in kv]),
        "duration_s": sum(r["wall_s"] for r in reps),
        "preemptions": sum(((r["metrics"].get("counters") or {}).get("preemptions") or 0) for r in reps),
        "tail_mode": any(r["tail_mode"] for r in reps),
        "failed": sum(r["failed"] for r in reps),
    }


def _merge_metrics(acc: dict | None, m: dict) -> dict:
    """Run-level metrics for the contract: counters summed over windows, engines unioned."""
    if not m.get("available"):
        return acc if acc else m
    peak = ((m.get("gauges") or {}).get("running") or {}).get("peak")
    if not acc or not acc.get("available"):
        return {"available": True, "counters": dict(m.get("counters") or {}),
                "engines": list(m.get("engines") or []), "running_peak": peak}
    if peak is not None:
        acc["running_peak"] = max(peak, acc.get("running_peak") or 0)
    c = acc["counters"]
    for k, v in (m.get("counters") or {}).items():
        if isinstance(v, (int, float)):
            c[k] = c.get(k, 0) + v
    acc["engines"] = sorted(set(acc["engines"]) | set(m.get("engines") or []))
    return acc


def _fmt(x, nd=1):
    return "n/a" if x is None else f"{x:.{nd}f}"


# -- context text --------------------------------------------------------------------------
def build_context(approx_tokens: int, needle: str | None = None, depth: float = 0.5) -> str:
    """Haystack paragraphs repeated to about ``approx_tokens`` (4 chars/token estimate; the
    real count is the server's usage.prompt_tokens), needle inserted at a paragraph boundary."""
    paras = [p for p in P.haystack_text().split("\n\n") if p.strip()]
    target = max(1, approx_tokens) * 4
    out, size, i = [], 0, 0
    while size < target:
        p = paras[i % len(paras)]
        out.append(p)
        size += len(p) + 2
        i += 1
    if needle is not None:
        pos = min(len(out), max(0, round(depth * len(out))))
        out.insert(pos, needle)
    return "\n\n".join(out)


def _fits(result: dict, n: int, max_tokens: int, t: Target) -> bool:
    """Skip (and record) a context the server cannot hold: est. tokens x 1.1 + output > max_model_len."""
    mml = (result["provenance"].get("server") or {}).get("max_model_len")
    if mml and n * 1.1 + max_tokens > mml:
        result["data"].setdefault("skipped", []).append(
            {"context": n, "reason": f"exceeds max_model_len {mml}"})
        t.log(f"skipping context {n}: exceeds max_model_len {mml}")
        return False
    return True


# -- depth (decode at context depth + prefill/TTFT slope) -----------------------------------
def depth(t: Target, contexts: list[int], max_tokens: int = 128) -> dict:
    c = t.client()
    pset_prompts = [build_context(n) + "\n\nContinue the story above:" for n in contexts]
    ps = {"id": "haystack-depth", "hash": P.prompts_hash(pset_prompts), "n": len(contexts),
          "salted": True, "contexts": contexts}
    warm = _warmup(t, c, "Say hello.")
    rf, result = _open(t, "depth", ps, max_tokens, warm, extra={"axis": "prefill"})
    rows = result["data"]["points"] = []
    try:
        for n, prompt in zip(contexts, pset_prompts):
            if not _fits(result, n, max_tokens, t):
                continue
            sampler = Sampler(t.url, t.metrics_interval, t.api_key).start()
            r = c.stream(P.salt(prompt), max_tokens, t.sampling, keep_text=False)
            m = sampler.stop()
            _account(result, [r])
            sv = _server_side(t, result, sampler, [(f"context {n}", r)])[0]
            result["metrics"] = _merge_metrics(result.get("metrics"), m)
            rows.append({"context": n, "prompt_tokens": r.prompt_tokens, "ttft": r.ttft,
                         "server_ttft": sv["server_ttft"],
                         "prefill_tps": (r.prompt_tokens / r.ttft) if r.prompt_tokens and r.ttft else None,
                         "decode_tps": r.decode_tps, "ok": r.ok, "error": r.error,
                         "kv": (m.get("gauges") or {}).get("kv_usage")})
            rf.save()
            t.log(f"depth {n}: prompt {r.prompt_tokens} tok, TTFT {_fmt(r.ttft, 3)} s "
                  f"(server {_fmt(sv['server_ttft'], 3)} s), decode {_fmt(r.decode_tps)} tok/s{'' if r.ok else ' FAILED: ' + str(r.error)}")
    except Exception as exc:  # noqa: BLE001
        rf.abort(f"aborted: {type(exc).__name__}: {exc}")
        result["path"] = str(rf.path)  # the partial result stays findable
        return result
    return _finish(rf, result)


# -- prefix turns ------------------------------------------------------------------------------
def prefix_turns(t: Target, context_tokens: int = 4000, turns: int = 3, max_tokens: int = 64) -> dict:
    c = t.client()
    doc = P.salt(build_context(context_tokens))  # salted once: turn 1 is cold, later turns may hit
    questions = ["Who keeps the ledger of debts, and when is it wiped clean?",
                 "What is rung at dusk, and why?",
                 "What does the teacher keep in her cabinet?",
                 "What is given to the oldest resident?"]
    qs = [questions[i % len(questions)] for i in range(turns)]
    ps = {"id": "haystack-turns", "hash": P.prompts_hash([build_context(context_tokens), *qs]),
          "n": turns, "salted": True}
    warm = _warmup(t, c, "Say hello.")
    rf, result = _open(t, "prefix_turns", ps, max_tokens, warm)
    rows = result["data"]["turns"] = []
    history = doc
    try:
        for i, q in enumerate(qs):
            prompt = f"{history}\n\nQuestion: {q}\nAnswer:"
            sampler = Sampler(t.url, t.metrics_interval, t.api_key).start()
            r = c.stream(prompt, max_tokens, t.sampling, keep_text=True)
            m = sampler.stop()
            _account(result, [r])
            sv = _server_side(t, result, sampler, [(f"turn {i + 1}", r)])[0]
            result["metrics"] = _merge_metrics(result.get("metrics"), m)
            cnt = m.get("counters") or {}
            rows.append({"turn": i + 1, "prompt_tokens": r.prompt_tokens, "ttft": r.ttft,
                         "server_ttft": sv["server_ttft"], "engine_idle_s": sv["engine_idle_s"],
                         "cached_tokens": r.cached_tokens,
                         "prefix_cache_hits": cnt.get("prefix_cache_hits"),
                         "prefix_cache_queries": cnt.get("prefix_cache_queries"),
                         "decode_tps": r.decode_tps, "ok": r.ok, "error": r.error})
            rf.save()
            t.log(f"turn {i + 1}: prompt {r.prompt_tokens} tok, TTFT {_fmt(r.ttft, 3)} s "
                  f"(server {_fmt(sv['server_ttft'], 3)} s), "
                  f"cache hits {cnt.get('prefix_cache_hits')}")
            history = f"{prompt}{r.text}"
    except Exception as exc:  # noqa: BLE001
        rf.abort(f"aborted: {type(exc).__name__}: {exc}")
        result["path"] = str(rf.path)  # the partial result stays findable
        return result
    return _finish(rf, result)


# -- needle ------------------------------------------------------------------------------------
def needle(t: Target, contexts: list[int], depths: list[float], max_tokens: int = 24) -> dict:
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"needle depths must be within 0..1, got {depths}")
    c = t.client()
    words = ["amber-falcon-42", "copper-lantern-17", "violet-harbour-88", "silent-orchard-05",
             "granite-meadow-63", "crimson-willow-29"]
    cases = []
    for n in contexts:
        for j, d in enumerate(depths):
            w = words[(len(cases)) % len(words)]
            text = build_context(n, needle=f"The secret passphrase is {w}. Remember it.", depth=d)
            cases.append((n, d, w, f"{text}\n\nQuestion: What is the secret passphrase?\n"
                                   f"Answer: The secret passphrase is"))
    ps = {"id": "needle-haystack", "hash": P.prompts_hash([x[3] for x in cases]), "n": len(cases),
          "salted": True}
    warm = _warmup(t, c, "Say hello.")
    t = dataclasses.replace(t, sampling={**t.sampling, "ignore_eos": False})  # answers may stop
    rf, result = _open(t, "needle", ps, max_tokens, warm)
    rows = result["data"]["cases"] = []
    sampler = None
    try:
        for n, d, w, prompt in cases:
            if not _fits(result, n, max_tokens, t):
                continue
            # one window per case: the server's TTFT of each case is then unambiguous
            sampler = Sampler(t.url, t.metrics_interval, t.api_key).start()
            r = c.stream(P.salt(prompt), max_tokens, t.sampling, keep_text=True)
            m = sampler.stop()
            _account(result, [r])
            sv = _server_side(t, result, sampler, [(f"context {n} depth {d:.2f}", r)])[0]
            sampler = None
            result["metrics"] = _merge_metrics(result.get("metrics"), m)
            hit = w.lower() in r.text.lower()
            rows.append({"context": n, "depth": d, "prompt_tokens": r.prompt_tokens, "found": hit,
                         "answer": r.text.strip()[:120], "ttft": r.ttft, "server_ttft": sv["server_ttft"],
                         "ok": r.ok, "error": r.error})
            rf.save()
            t.log(f"needle ctx {n} depth {d:.2f}: {'FOUND' if hit else 'missed'} ({r.text.strip()[:40]!r})")
        result["data"]["recall"] = sum(x["found"] for x in rows) / len(rows) if rows else None
    except Exception as exc:  # noqa: BLE001
        if sampler is not None:
            sampler.stop()
        rf.abort(f"aborted: {type(exc).__name__}: {exc}")
        result["path"] = str(rf.path)  # the partial result stays findable
        return result
    return _finish(rf, result)


# -- perplexity --------------------------------------------------------------------------------
def prompt_logprobs(c: Client, text: str) -> tuple[list[float], str]:
    """Log-probabilities of every prompt token but the first, from the server."""
    try:
        js = c.complete({"echo": True, "logprobs": 0, "temperature": 0.0}, text, max_tokens=0)
        ch = js["choices"][0]
        lps = (ch.get("logprobs") or {}).get("token_logprobs")
        n_prompt = (js.get("usage") or {}).get("prompt_tokens")
        if lps:
            if n_prompt:
                lps = lps[:n_prompt]
            return [float(x) for x in lps if x is not None], "echo+logprobs"
    except Exception as exc:  # noqa: BLE001
        echo_err = exc
    else:
        echo_err = None
    js = c.complete({"prompt_logprobs": 0, "temperature": 0.0}, text, max_tokens=1)
    plp = js["choices"][0].get("prompt_logprobs")
    if not plp:
        raise RuntimeError(f"server returned no prompt logprobs (echo failed: {echo_err})")
    out = []
    for entry in plp:
        if not entry:
            continue
        # {token_id: {"logprob":..., "rank":...}}: with prompt_logprobs=0 only the prompt token
        out.append(float(next(iter(entry.values()))["logprob"]))
    return out, "prompt_logprobs"


def perplexity(t: Target, pset: P.PromptSet) -> dict:
    c = t.client()
    warm = _warmup(t, c, pset.prompts[0], max_tokens=4)
    t = dataclasses.replace(t, sampling={"echo": True, "logprobs": 0, "temperature": 0.0,
                                         "fallback": "prompt_logprobs=0"})
    rf, result = _open(t, "perplexity", pset.record(), 0, warm, token_source="server_logprobs")
    rows = result["data"]["prompts"] = []
    total_lp, total_n, method = 0.0, 0, None
    sampler = Sampler(t.url, t.metrics_interval, t.api_key).start()
    try:
        for pid, text in zip(pset.ids, pset.prompts):
            lps, method = prompt_logprobs(c, text)
            result["traffic"]["requests"] += 1
            nll = -sum(lps) / len(lps) if lps else None
            rows.append({"id": pid, "tokens": len(lps), "nll": nll,
                         "ppl": math.exp(nll) if nll is not None else None})
            total_lp += sum(lps)
            total_n += len(lps)
            rf.save()
        result["data"]["method"] = method
        result["data"]["tokens"] = total_n
        result["data"]["ppl"] = math.exp(-total_lp / total_n) if total_n else None
        t.log(f"perplexity {pset.id}: {_fmt(result['data']['ppl'], 3)} over {total_n} tokens ({method})")
        result["metrics"] = _merge_metrics(None, sampler.stop())
    except Exception as exc:  # noqa: BLE001
        sampler.stop()
        result["traffic"]["failed"] += 1
        result["traffic"]["first_error"] = str(exc)
        rf.abort(f"aborted: {type(exc).__name__}: {exc}")
        result["path"] = str(rf.path)  # the partial result stays findable
        return result
    result["traffic"]["completion_tokens"] = None  # echo requests: compare prompt tokens only
    return _finish(rf, result)


# -- speculation by prompt class ---------------------------------------------------------------
def spec(t: Target, psets: list[P.PromptSet], max_tokens: int = 128) -> dict:
    c = t.client()
    allp = [p for s in psets for p in s.prompts]
    ps = {"id": "+".join(s.id for s in psets), "hash": P.prompts_hash(allp), "n": len(allp)}
    warm = _warmup(t, c, psets[0].prompts[0])
    rf, result = _open(t, "spec", ps, max_tokens, warm)
    rows = result["data"]["classes"] = []
    try:
        for s in psets:
            sampler = Sampler(t.url, t.metrics_interval, t.api_key).start()
            rs = [c.stream(p, max_tokens, t.sampling, keep_text=False) for p in s.prompts]
            m = sampler.stop()
            _account(result, rs)
            # sequential, one in flight: each request's server view where a scrape separates them
            _server_side(t, result, sampler, [(f"{s.id} #{j + 1}", r) for j, r in enumerate(rs)])
            result["metrics"] = _merge_metrics(result.get("metrics"), m)
            ok = [r for r in rs if r.ok]
            toks = sum(r.completion_tokens or 0 for r in ok)
            chunks = sum(r.chunks for r in ok)
            rows.append({"class": s.id, "prompt_hash": s.hash, "decode_tps": _mean([r.decode_tps for r in ok]),
                         "tokens": toks, "chunks": chunks,
                         "tokens_per_chunk": toks / chunks if chunks else None,
                         "spec": m.get("spec"), "failed": len(rs) - len(ok)})
            rf.save()
            sp = m.get("spec") or {}
            t.log(f"spec {s.id}: decode {_fmt(rows[-1]['decode_tps'])} tok/s, tokens/step "
                  f"{_fmt(sp.get('tokens_per_step'), 2)}, per position "
                  f"{[round(x, 2) for x in sp.get('acceptance_per_position', [])]}")
    except Exception as exc:  # noqa: BLE001
        rf.abort(f"aborted: {type(exc).__name__}: {exc}")
        result["path"] = str(rf.path)  # the partial result stays findable
        return result
    return _finish(rf, result)
