"""CPU dry run of GPU job 73-warmup (tests/gpu/warmup_check.py --dry-run): both arms' launcher
plans come from `onecard.launch --json` under the arm's environment (WARMUP 1 / 0, SPEC=dflash2,
an own TRITON_CACHE_DIR), and the warm-up line parser reads onecard/warmup.py's own line."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import check_job_contract

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "gpu" / "warmup_check.py"
JOB = REPO / "gpu" / "jobs" / "73-warmup.sh"


def test_job_header_and_syntax():
    check_job_contract(JOB)


def test_dry_run_passes(tmp_path, patched_site):
    if not (patched_site / "vllm" / "dflash2_installed.txt").is_file():
        pytest.skip("patches/series does not list 0080-dflash2.patch")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(patched_site), str(REPO)]))
    p = subprocess.run([sys.executable, str(DRIVER), "--dry-run", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[warmup] dry run PASS" in p.stdout
    assert re.search(r'plan warm: .*"WARMUP": "1"', p.stdout) and re.search(r'plan cold: .*"WARMUP": "0"', p.stdout)


def test_the_parser_reads_the_helpers_own_line(monkeypatch):
    """warmup.warm's log line, as it prints it, parses (a drift between the two would make job
    73 fail with 'no warm-up line')."""
    sys.path.insert(0, str(DRIVER.parent))
    import warmup_check as W
    from onecard import warmup

    lines = []

    class Client:  # every request answered 200, /health too
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def get(self, *a, **k):
            return type("R", (), {"status_code": 200})()

        def post(self, *a, **k):
            return type("R", (), {"status_code": 500 if k["json"]["temperature"] > 0 else 200})()

    import httpx

    monkeypatch.setattr(httpx, "Client", Client)
    res = warmup.warm("http://127.0.0.1:1", "tiny", log=lines.append)
    got = W.parse_warmup_line("\n".join(lines))
    assert got is not None and got["requests"] == res["requests"] == 7
    assert got["failed"] == res["failed"] == 3 and got["total_s"] == res["total_s"]
    assert W.parse_warmup_line("no line here") is None
