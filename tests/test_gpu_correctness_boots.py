"""gpu/lib/job.sh correctness_boots: which GPU jobs turn Triton autotuning off, and what it exports."""
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "gpu" / "jobs"
CORRECTNESS = {"10-tiny-suite", "63-kvarn-spec", "70-dflash2", "71-spec-quant-kv", "72-dflash2-lane", "75-gdn-defer"}
TIMING = {"30-wide-verify", "31-verify-e2e", "40-pools", "50-bench-smoke", "62-kvarn-decode", "80-reference"}


def _calls(name: str) -> bool:
    text = (JOBS / f"{name}.sh").read_text()
    return re.search(r"^correctness_boots\b", text, re.M) is not None


def test_correctness_jobs_call_it_and_timing_jobs_never_do():
    for name in CORRECTNESS:
        assert _calls(name), f"{name} should call correctness_boots"
    for name in TIMING:
        assert (JOBS / f"{name}.sh").is_file(), name
        assert not _calls(name), f"{name} measures speed: autotuning must stay on"


def _probe(tmp_path, extra_env):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TRITON_FORCE_FIRST_CONFIG"}
    env.update(extra_env)
    script = (f'cd {ROOT}; JOB_OUT={tmp_path}/out; MODELS={tmp_path}/models; . gpu/lib/job.sh; '
              'correctness_boots >/dev/null; bash -c \'echo "v=$VLLM_TRITON_FORCE_FIRST_CONFIG"\'')
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_it_exports_the_switch_to_children(tmp_path):
    assert _probe(tmp_path, {}) == "v=1"


def test_a_callers_value_wins(tmp_path):
    assert _probe(tmp_path, {"VLLM_TRITON_FORCE_FIRST_CONFIG": "0"}) == "v=0"
