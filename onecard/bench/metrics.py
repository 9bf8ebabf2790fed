"""Scrape vLLM's Prometheus ``/metrics`` (parsed with prometheus_client), on a fixed cadence.

Names are those of vLLM 0.27.1 (vllm/v1/metrics/loggers.py, vllm/v1/spec_decode/metrics.py);
counters appear with the ``_total`` suffix in the text format. Samples are summed over the
``model_name``/``engine`` labels; the number of distinct engines is kept (one replica check).
``vllm:spec_decode_num_accepted_tokens_per_pos`` is kept per ``position``.

Gauges are reported as peak AND time-weighted mean (each sample held until the next one), with
the run duration and sample count beside every peak: a peak polled every 250 ms on a longer run
has more chances to be high, so a bare peak is not comparable across runs.
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


def scrape(base_url: str, timeout: float = 5.0, api_key: str | None = None, http=None) -> Snapshot:
    import httpx
    url = base_url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
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
                self._http = httpx.Client(verify=not self.base_url.startswith("http://"))
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
