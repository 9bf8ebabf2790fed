"""Patch 0086: under async scheduling vLLM 0.27.1's align-mode MambaManager forgot every
superseded GDN state block it could not free yet, one per prefill chunk per GDN group, so on
CTX=fast (784-token blocks, 2,048-token chunk) a 32k prompt held 94.5 % of the pool (job 80 on the
H100, 2026-12-05). vLLM's own Scheduler / AsyncScheduler and KVCacheManager run on the CPU
(tests/mamba_align_sim.py) over the 27B's CTX=fast pool, pristine and patched."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onecard import patching

SIM = Path(__file__).with_name("mamba_align_sim.py")


@pytest.fixture(scope="module")
def p0086_site(vllm_dir, tmp_path_factory):
    return patching.overlay(vllm_dir, tmp_path_factory.mktemp("p0086"))


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    model = tmp_path_factory.mktemp("sim-model")

    def run(site: Path | None, prompts: str, *flags: str) -> dict:
        env = dict(os.environ)
        if site is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
        out = subprocess.run([sys.executable, str(SIM), "--model-dir", str(model), "--prompts", prompts, *flags],
                             env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    return run


def test_pristine_vllm_leaks_a_state_block_per_chunk(sim):
    """The bug as measured: 32,102 tokens = 21 chunks of <= 1,568 -> 21 state blocks per GDN group,
    0.955 of the pool, and a second 32k request waits for the first to finish."""
    pytest.importorskip("vllm")
    got = sim(None, "32102,32102", "--async")
    assert got["state_blocks_peak"] == {"r0": 21, "r1": 21} and got["most_running"] == 1
    assert got["peak_usage"] > 0.94 and got["first_step"]["r1"] > got["finished_step"]["r0"] - 2


def test_patched_two_32k_requests_run_together(sim, p0086_site):
    got = sim(p0086_site, "32102,32102", "--async")
    assert max(got["state_blocks_peak"].values()) <= 3
    assert got["most_running"] == 2 and got["preemptions"] == {} and got["unfinished"] == []
    assert got["first_step"]["r1"] < got["finished_step"]["r0"]


def test_patched_60k_prompt_is_not_preempted(sim, p0086_site):
    """Alone, a 60k prompt filled the leaking pool and preempted itself twice (job 80's depth and
    prefix rows on the H100: vllm:num_preemptions 2 in both arms)."""
    before = sim(None, "60186", "--async", "--max-tokens", "64")
    after = sim(p0086_site, "60186", "--async", "--max-tokens", "64")
    assert before["preemptions"] == {"r0": 2}
    assert after["preemptions"] == {} and after["unfinished"] == [] and after["state_blocks_peak"]["r0"] <= 3


def test_synchronous_scheduling_frees_as_before(sim, p0086_site):
    """Without async scheduling the state block is due at the next step anyway: same schedule."""
    assert sim(p0086_site, "32102,32102") == sim(None, "32102,32102")
