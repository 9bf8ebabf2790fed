"""ONECARD_HOST_TIMING=1 (GPU jobs; imported by this directory's sitecustomize): where the host's
time goes in each engine step of vLLM 0.27.1's V1 runner, without the profiler and without adding
a single GPU synchronization.

docs/dflash2-host-overhead.md section 2.1 explains the GPU idle of a speculative step by host work
that runs after two blocking waits (``--mamba-cache-mode align``) and before the target's graph
launch. This measures exactly that, per engine step of the engine core process:

- ``wait_accepted`` / ``wait_sampled``: time blocked in ``num_accepted_tokens_event.synchronize()``
  (``_prepare_inputs``) and ``valid_sampled_token_count_event.synchronize()`` (the deferred state
  corrections), through a proxy around the two events (they are only ever ``record``-ed and
  ``synchronize``-d);
- ``crit``: from the end of the step's last wait (or the start of ``execute_model`` when it had
  none) to the call of ``_model_forward`` (the target's launch): the host work the GPU waits for;
- ``prepare_inputs``, ``build_attn_metadata``, ``model_forward`` (host side of the launch),
  ``execute_model``, ``sample_tokens`` (sampling, and the drafter: ``propose_draft_token_ids``
  runs inside it), ``propose``, and ``step`` (from one ``execute_model`` start to the next).

Every ``ONECARD_HOST_TIMING_EVERY`` (50) steps one line goes to stderr (the server log):
``[onecard host timing] steps A-B (median ms): step 17.20, crit 5.01, ...``. Medians, so a
prefill or a stall in the window does not move them. The wrappers cost a few microseconds of
``time.perf_counter`` per step.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import statistics
import sys
import time

TARGET = "vllm.v1.worker.gpu_model_runner"
FIELDS = ("step", "crit", "wait_accepted", "wait_sampled", "prepare_inputs", "build_attn_metadata",
          "model_forward", "execute_model", "sample_tokens", "propose")
TIMED = {  # runner method -> field (its duration)
    "_prepare_inputs": "prepare_inputs",
    "_build_attention_metadata": "build_attn_metadata",
    "_model_forward": "model_forward",
    "sample_tokens": "sample_tokens",
    "propose_draft_token_ids": "propose",
}
EVENTS = {"num_accepted_tokens_event": "wait_accepted",
          "valid_sampled_token_count_event": "wait_sampled"}


class Recorder:
    """Per-step figures (ms) and the window report."""

    def __init__(self, every: int, out=None):
        self.every = max(1, every)
        self.out = out
        self.steps: list[dict] = []
        self.first = 1
        self.cur: dict | None = None
        self.last_start: float | None = None
        self.last_wait_end: float | None = None
        self.forward_seen = False

    def add(self, field: str, ms: float) -> None:
        if self.cur is not None:
            self.cur[field] = self.cur.get(field, 0.0) + ms

    def begin_step(self, now: float) -> None:
        self.finish_step()
        self.cur = {} if self.last_start is None else {"step": 1000 * (now - self.last_start)}
        self.last_start = now
        self.last_wait_end = None
        self.forward_seen = False

    def wait_done(self, now: float) -> None:
        self.last_wait_end = now

    def forward_starts(self, now: float) -> None:
        if self.cur is not None and not self.forward_seen:
            self.forward_seen = True
            self.cur["crit"] = 1000 * (now - (self.last_wait_end or self.last_start))

    def finish_step(self) -> None:
        if self.cur is None:
            return
        self.steps.append(self.cur)
        self.cur = None
        if len(self.steps) >= self.every:
            self.report()

    def report(self) -> str | None:
        if not self.steps:
            return None
        parts = []
        for f in FIELDS:
            vals = [s.get(f, 0.0) for s in self.steps if f != "step" or "step" in s]
            if vals:
                parts.append(f"{f} {statistics.median(vals):.2f}")
        line = (f"[onecard host timing] steps {self.first}-{self.first + len(self.steps) - 1} "
                f"(median ms): " + ", ".join(parts))
        self.first += len(self.steps)
        self.steps = []
        print(line, file=self.out or sys.stderr, flush=True)
        return line


class TimedEvent:
    """A torch.Event stand-in whose synchronize() is timed; everything else is the event's."""

    def __init__(self, event, field: str, rec: Recorder):
        self._event, self._field, self._rec = event, field, rec

    def synchronize(self):
        t0 = time.perf_counter()
        try:
            return self._event.synchronize()
        finally:
            t1 = time.perf_counter()
            self._rec.add(self._field, 1000 * (t1 - t0))
            self._rec.wait_done(t1)

    def __getattr__(self, name):
        return getattr(self._event, name)


def _timed(fn, field: str, rec: Recorder):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        if field == "model_forward":
            rec.forward_starts(t0)
        try:
            return fn(*args, **kwargs)
        finally:
            rec.add(field, 1000 * (time.perf_counter() - t0))
    return wrapper


def patch_runner_class(cls, rec: Recorder) -> None:
    """Wrap a GPUModelRunner-shaped class in place (idempotent)."""
    if getattr(cls, "_onecard_host_timing", False):
        return
    for name, field in TIMED.items():
        if hasattr(cls, name):
            setattr(cls, name, _timed(getattr(cls, name), field, rec))

    execute = cls.execute_model

    @functools.wraps(execute)
    def execute_model(self, *args, **kwargs):
        for attr, field in EVENTS.items():
            ev = getattr(self, attr, None)
            if ev is not None and not isinstance(ev, TimedEvent):
                setattr(self, attr, TimedEvent(ev, field, rec))
        t0 = time.perf_counter()
        rec.begin_step(t0)
        try:
            return execute(self, *args, **kwargs)
        finally:
            rec.add("execute_model", 1000 * (time.perf_counter() - t0))

    cls.execute_model = execute_model
    cls._onecard_host_timing = True


class _Finder(importlib.abc.MetaPathFinder):
    """Patches the runner module right after it executes (vLLM is not imported yet when
    sitecustomize runs)."""

    def __init__(self, rec: Recorder):
        self.rec = rec

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, rec = spec.loader, self.rec
        original = loader.exec_module

        def exec_module(module):
            original(module)
            try:
                patch_runner_class(module.GPUModelRunner, rec)
                print("[onecard host timing] on (gpu/lib/stackdump/onecard_host_timing.py)",
                      file=sys.stderr, flush=True)
            except Exception as e:  # noqa: BLE001 - a probe must never stop a server
                print(f"[onecard host timing] not installed: {e!r}", file=sys.stderr, flush=True)

        loader.exec_module = exec_module
        return spec


def install() -> Recorder | None:
    if os.environ.get("ONECARD_HOST_TIMING", "0") != "1":
        return None
    try:
        every = int(os.environ.get("ONECARD_HOST_TIMING_EVERY", "50"))
    except ValueError:
        every = 50
    rec = Recorder(every)
    sys.meta_path.insert(0, _Finder(rec))
    return rec
