"""scripts/dflash2_huge_pool.py: CTX=huge + SPEC=dflash2 drafter-KV designs through vLLM 0.27.1's own
KV-cache functions (CPU, a few seconds). Anchors: the H200-measured CTX=huge SPEC=off pool (358,107,
docs/measurements.md, job 62) and the full-engine CPU reproduction of the fixed bf16-skip-layers
drafter (74,209 at MAX_LEN 73,728, docs/results/2026-12-03-huge-dflash2-cpu/FINDINGS.md)."""
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from onecard import memory

ROOT = Path(__file__).resolve().parents[1]
GEOM = replace(memory.ModelGeometry(), ssm_state_bytes=4)  # the 27B geometry checkpoint (fp32 GDN state)
PIN, HUGE = memory.LONG_KV_MEM, 245_760
P = None


@pytest.fixture(autouse=True, scope="module")
def _script():
    """Load the script (and vLLM, hence Triton) when these tests run, not at collection: the
    kernel test modules must turn Triton's interpreter on before its first import
    (tests/interpret.py)."""
    global P
    pytest.importorskip("vllm.v1.core.kv_cache_utils")
    spec = importlib.util.spec_from_file_location("dflash2_huge_pool", ROOT / "scripts" / "dflash2_huge_pool.py")
    P = importlib.util.module_from_spec(spec)
    sys.modules["dflash2_huge_pool"] = P  # its dataclass needs its module registered
    spec.loader.exec_module(P)


def run(design, k=7, max_len=HUGE, **kw):
    return P.pool(design, GEOM, k, PIN, max_len, **kw)


def test_control_matches_h200_measurement():
    r = run("none", k=0)
    assert r["pool_tokens"] == 358_107 and r["target_block"] == 3840 and r["fits_max_len"]
    # and the launcher's own memory model agrees
    assert memory.predict_pool(GEOM, PIN, "kvarn", HUGE, 0, True).pool_tokens == 358_107


def test_bf16_drafter_today_and_with_the_candidate_fix():
    assert "NotImplementedError" in run("bf16-full-stock")["error"]
    r = run("bf16-full-fixed")
    assert not r["fits_max_len"] and r["est_max_len"] == 73_728 and r["pool_at_est"] == 74_209
    assert r["group_size"] == 5 and r["num_blocks"] == 308


def test_designs():
    assert "NotImplementedError" in run("kvarn-full-stock")["error"]
    assert run("swa-stock")["est_max_len"] < 8192  # block 16 padded to a 3.4 MB page
    assert not run("swa-divisor")["fits_max_len"]  # 5-layer group: 10 GDN groups x (2 + 7)
    g16 = run("swa-divisor-g16", concurrent_batches=1)
    assert g16["fits_max_len"] and g16["pool_tokens"] == HUGE
    assert not run("swa-divisor-g16")["fits_max_len"]  # async scheduling: 2 batches in flight
    ring, none = run("outside-ring"), run("none")
    assert ring["pool_tokens"] == none["pool_tokens"] == 271_183 and ring["fits_max_len"]
    assert ring["ring_bytes"] == 2 * 5 * (2048 + 16) * 8 * 128 * 4
    assert run("outside-ring-in-pin")["pool_tokens"] == 265_533
