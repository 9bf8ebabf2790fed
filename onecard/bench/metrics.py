"""Scrape vLLM's Prometheus ``/metrics`` (parsed with prometheus_client), on a fixed cadence.

Names are those of vLLM 0.27.1 (vllm/v1/metrics/loggers.py, vllm/v1/spec_decode/metrics.py);
counters appear with the ``_total`` suffix in the text format. Samples are summed over the
``model_name``/``engine`` labels; the number of distinct engines is kept (one replica check).
``vllm:spec_decode_num_accepted_tokens_per_pos`` is kept per ``position``.

Gauges are reported as peak AND time-weighted mean (each sample held until the next one), with
the run duration and sample count beside every peak: a peak polled every 250 ms on a longer run
has more chances to be high, so a bare peak is not comparable across runs.

Server-side view of one request (:func:`server_view`, C1 windows only: one request in flight):
the delta of vLLM's request histograms (``_sum``/``_count``) between the last scrape before the
request and a scrape after it, plus the engine-idle evidence from the sampled
``vllm:num_requests_running`` gauge. vLLM's TTFT starts when its input processor sees the request
(``arrival_time``), so a client TTFT far above the server's is time lost before the engine
(client, network, HTTP server, event loop): see the ``client-side stall`` check in fairness.py.
Optional: a server without these series gets ``None`` values and a note, never an error.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

GAUGES = {
    "kv_usage": "vllm:kv_cache_usage_perc",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
}
COUNTERS = {
    "preemptions": "vllm:num_preemptions_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "requests_finished": "vllm:request_success_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "spec_drafts": "vllm:spec_decode_num_drafts_total",
    "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "spec_accepted": "vllm:spec_decode_num_accepted_tokens_total",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
#: per-request histograms (vLLM 0.27.1 names; exposed as <name>_sum / <name>_count / _bucket)
HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",      # arrival (input processor) -> first token
    "e2e": "vllm:e2e_request_latency_seconds",       # arrival -> finished
    "queue": "vllm:request_queue_time_seconds",      # engine: queued -> scheduled
    "prefill": "vllm:request_prefill_time_seconds",  # engine: scheduled -> first token
}
RUNNING = GAUGES["running"]


@dataclass
class Snapshot:
    t: float
    values: dict[str, float] = field(default_factory=dict)
    per_pos: dict[int, float] = field(default_factory=dict)
    engines: set[str] = field(default_factory=set)

    def get(self, key: str, default: float = 0.0) -> float:
        return self.values.get(key, default)


def parse(text: str, t: float | None = None) -> Snapshot:
    from prometheus_client.parser import text_string_to_metric_families
    snap = Snapshot(t=time.perf_counter() if t is None else t)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name, labels, value = s.name, s.labels, s.value
            if "engine" in labels:
                snap.engines.add(str(labels["engine"]))
            if name == PER_POS:
                pos = int(labels.get("position", 0))
                snap.per_pos[pos] = snap.per_pos.get(pos, 0.0) + value
                continue
            snap.values[name] = snap.values.get(name, 0.0) + value
    return snap


def scrape(base_url: str, timeout: float = 5.0, api_key: str | None = None, http=None,
           headers: dict[str, str] | None = None) -> Snapshot:
    """/metrics of a server, parsed; ``headers`` (e.g. a caller's Authorization) or ``api_key``."""
    import httpx
    url = base_url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    headers = {**(headers or {}), **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    r = (http or httpx).get(url + "/metrics", timeout=timeout, headers=headers)
    r.raise_for_status()
    return parse(r.text)


def gauge_stats(samples: list[Snapshot], key: str, t_end: float | None = None) -> dict[str, Any]:
    pts = [(s.t, s.values[key]) for s in samples if key in s.values]
    if not pts:
        return {"peak": None, "mean": None, "samples": 0, "duration_s": None}
    t_end = pts[-1][0] if t_end is None else max(t_end, pts[-1][0])
    dur = t_end - pts[0][0]
    if dur <= 0:
        mean = sum(v for _, v in pts) / len(pts)
    else:
        area = 0.0
        for (t0, v0), (t1, _) in zip(pts, pts[1:] + [(t_end, None)]):
            area += v0 * (t1 - t0)
        mean = area / dur
    return {"peak": max(v for _, v in pts), "mean": mean, "samples": len(pts), "duration_s": dur}


def counter_deltas(first: Snapshot, last: Snapshot) -> dict[str, Any]:
    out: dict[str, Any] = {k: last.get(n) - first.get(n) for k, n in COUNTERS.items()
                           if n in last.values or n in first.values}
    positions = sorted(set(first.per_pos) | set(last.per_pos))
    per_pos = [last.per_pos.get(p, 0.0) - first.per_pos.get(p, 0.0) for p in positions]
    out["spec_accepted_per_pos"] = per_pos
    return out


def histogram_delta(first: Snapshot, last: Snapshot, name: str) -> tuple[float, float] | None:
    """(sum, count) added to histogram ``name`` between two snapshots; None if not exposed."""
    ks, kc = name + "_sum", name + "_count"
    if kc not in last.values or ks not in last.values:
        return None
    return last.get(ks) - first.get(ks), last.get(kc) - first.get(kc)


def engine_idle_s(samples: list[Snapshot], t_from: float, t_to: float) -> float | None:
    """Longest stretch (first to last of consecutive samples inside [t_from, t_to]) in which
    ``vllm:num_requests_running`` read 0; None when the gauge is not exposed. No extrapolation
    beyond the samples, so it underestimates by up to one interval."""
    if not any(RUNNING in s.values for s in samples):
        return None
    best, start, prev = 0.0, None, None
    for s in samples:
        if s.t < t_from or s.t > t_to or RUNNING not in s.values:
            continue
        if s.values[RUNNING] == 0:
            start = s.t if start is None else start
            prev = s.t
            best = max(best, prev - start)
        else:
            start = None
    return best


def server_view(samples: list[Snapshot], t_start: float, t_first: float | None, t_end: float | None,
                t_next: float | None = None) -> dict[str, Any]:
    """The server's account of one request that was alone in flight from ``t_start`` (send) to
    ``t_end``; ``t_next`` is when the next request of the same window was sent (None: the window's
    last request). Each histogram's delta runs from the last scrape before the send to the last
    scrape before ``t_next`` (or the window's end) that follows the moment vLLM records it (first
    token for TTFT, the end for the others), and is kept only when it counted exactly one request
    (otherwise None and a note). ``histograms``: whether the server exposes the TTFT histogram.
    ``engine_idle_s``: how long the engine read 0 running requests while we waited for the first
    token, not counting the engine's own prefill of this request (a long prefill step leaves the
    gauge at its old value until the step ends); None when that prefill time is ambiguous or the
    gauge is not exposed."""
    out: dict[str, Any] = {f"server_{k}": None for k in HISTOGRAMS}
    out["engine_idle_s"] = None
    notes = []
    before = [s for s in samples if s.t <= t_start]
    out["histograms"] = any(HISTOGRAMS["ttft"] + "_count" in s.values for s in samples)
    if not out["histograms"]:
        notes.append(f"server exposes no {HISTOGRAMS['ttft']} histogram")
    elif not before:
        notes.append("no scrape before the request")
    else:
        first = before[-1]
        for k, name in HISTOGRAMS.items():
            recorded = t_first if k == "ttft" else t_end
            if recorded is None:
                continue
            after = [s for s in samples if s.t >= recorded and (t_next is None or s.t <= t_next)]
            d = histogram_delta(first, after[-1], name) if after else None
            if d is None:
                if k == "ttft":
                    notes.append(f"no scrape of {name} between the first token and the next send"
                                 if not after else f"server exposes no {name} histogram")
                continue
            total, count = d
            if round(count) == 1:
                out[f"server_{k}"] = total
            elif k == "ttft":
                notes.append(f"{name} counted {count:g} requests in the window (need exactly 1)")
    if t_first is not None:
        engine_s = out["server_prefill"] if out["server_prefill"] is not None else out["server_ttft"]
        if engine_s is None and out["histograms"]:
            notes.append("engine-idle not checked: this request's prefill time is ambiguous")
        else:
            out["engine_idle_s"] = engine_idle_s(samples, t_start, t_first - (engine_s or 0.0))
            if out["engine_idle_s"] is None:
                notes.append(f"server exposes no {RUNNING} gauge")
    if notes:
        out["note"] = "; ".join(notes)
    return out


def spec_summary(deltas: dict[str, Any]) -> dict[str, Any] | None:
    drafts = deltas.get("spec_drafts") or 0.0
    if drafts <= 0:
        return None
    accepted = deltas.get("spec_accepted", 0.0)
    draft_tokens = deltas.get("spec_draft_tokens", 0.0)
    return {
        "drafts": drafts,
        "acceptance_per_position": [a / drafts for a in deltas.get("spec_accepted_per_pos", [])],
        "tokens_per_step": 1.0 + accepted / drafts,
        "draft_acceptance_rate": (accepted / draft_tokens) if draft_tokens else None,
    }


class Sampler:
    """Polls /metrics every ``interval`` s in a thread; ``start``/``stop`` scrape synchronously
    so counter deltas span exactly the measured window. Failures are counted, not raised."""

    def __init__(self, base_url: str, interval: float = 0.25, api_key: str | None = None):
        self.base_url, self.interval, self.api_key = base_url, interval, api_key
        self.samples: list[Snapshot] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t_start = self.t_stop = None

    def _one(self) -> None:
        try:
            if getattr(self, "_http", None) is None:
                import httpx

                from onecard.bench.client import http_limits
                self._http = httpx.Client(verify=not self.base_url.startswith("http://"),
                                          limits=http_limits(max_connections=4, max_keepalive_connections=1))
            self.samples.append(scrape(self.base_url, api_key=self.api_key, http=self._http))
        except Exception as exc:  # noqa: BLE001
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def start(self) -> "Sampler":
        self.t_start = time.perf_counter()
        self._one()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="metrics-sampler")
        self._thread.start()
        return self

    def _loop(self) -> None:
        nxt = time.perf_counter() + self.interval
        while not self._stop.wait(max(0.0, nxt - time.perf_counter())):
            self._one()
            nxt += self.interval

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)
        self._one()
        self.t_stop = time.perf_counter()
        if getattr(self, "_http", None) is not None:
            self._http.close()
            self._http = None
        return self.summary()

    def summary(self) -> dict[str, Any]:
        if len(self.samples) < 2:
            return {"available": False, "errors": self.errors[-3:], "samples": len(self.samples)}
        first, last = self.samples[0], self.samples[-1]
        deltas = counter_deltas(first, last)
        engines = set().union(*(s.engines for s in self.samples))
        return {
            "available": True,
            "interval_s": self.interval,
            "samples": len(self.samples),
            "scrape_errors": len(self.errors),
            "duration_s": last.t - first.t,
            "gauges": {k: gauge_stats(self.samples, n, last.t) for k, n in GAUGES.items()},
            "counters": deltas,
            "spec": spec_summary(deltas),
            "engines": sorted(engines),
        }
