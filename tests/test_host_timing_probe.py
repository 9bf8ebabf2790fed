"""gpu/lib/stackdump/onecard_host_timing.py: the per-step host timing of vLLM's runner (GPU jobs,
ONECARD_HOST_TIMING=1). On CPU: a runner-shaped class with sleeps in place of the work gives the
expected waits, critical path and window report; the real vLLM runner module gets patched at
import in a child process, and nothing happens without the knob."""
from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STACKDUMP = REPO / "gpu" / "lib" / "stackdump"
_spec = importlib.util.spec_from_file_location("onecard_host_timing", STACKDUMP / "onecard_host_timing.py")
ht = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ht)


class FakeEvent:
    def __init__(self, wait_s):
        self.wait_s, self.records = wait_s, 0

    def record(self):
        self.records += 1

    def synchronize(self):
        time.sleep(self.wait_s)


class FakeRunner:
    def __init__(self):
        self.num_accepted_tokens_event = FakeEvent(0.004)
        self.valid_sampled_token_count_event = FakeEvent(0.002)

    def _prepare_inputs(self):
        self.num_accepted_tokens_event.synchronize()
        time.sleep(0.001)

    def _build_attention_metadata(self):
        time.sleep(0.003)

    def _model_forward(self):
        time.sleep(0.001)

    def execute_model(self, x):
        self._prepare_inputs()
        self.valid_sampled_token_count_event.synchronize()
        self._build_attention_metadata()
        self._model_forward()
        return x + 1

    def sample_tokens(self):
        self.propose_draft_token_ids()
        self.valid_sampled_token_count_event.record()

    def propose_draft_token_ids(self):
        time.sleep(0.002)


def test_waits_and_critical_path():
    out = io.StringIO()
    rec = ht.Recorder(every=4, out=out)
    ht.patch_runner_class(FakeRunner, rec)
    ht.patch_runner_class(FakeRunner, rec)  # idempotent
    r = FakeRunner()
    for i in range(5):
        assert r.execute_model(i) == i + 1
        r.sample_tokens()
    assert isinstance(r.num_accepted_tokens_event, ht.TimedEvent)
    assert r.valid_sampled_token_count_event.records == 5  # record() reaches the real event
    line = out.getvalue().strip()
    assert line.startswith("[onecard host timing] steps 1-4 (median ms): "), line
    vals = dict(p.rsplit(" ", 1) for p in line.split(": ", 1)[1].split(", "))
    v = {k: float(x) for k, x in vals.items()}
    assert 3.5 < v["wait_accepted"] < 20 and 1.5 < v["wait_sampled"] < 20
    # crit: from the sampled wait's end to _model_forward = the metadata build (3 ms)
    assert 2.5 < v["crit"] < 20 and v["crit"] < v["execute_model"]
    assert 1.5 < v["propose"] <= v["sample_tokens"] + 0.5
    assert v["step"] >= v["execute_model"]
    assert len(rec.steps) == 0 and rec.cur is not None  # the 5th step is still open


def test_real_runner_patched_at_import_only_with_the_knob():
    code = ("import sys; sys.path.insert(0, %r); import sitecustomize\n"
            "import vllm.v1.worker.gpu_model_runner as m\n"
            "print('patched', getattr(m.GPUModelRunner, '_onecard_host_timing', False))\n") % str(STACKDUMP)
    for knob, want in (("1", "patched True"), ("0", "patched False")):
        env = {**os.environ, "ONECARD_HOST_TIMING": knob, "PYTHONPATH": str(STACKDUMP)}
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        assert want in p.stdout, p.stdout + p.stderr[-2000:]
