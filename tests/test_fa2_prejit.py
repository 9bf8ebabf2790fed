"""gpu/lib/fa2_prejit.py on the CPU: its worker plan, argument checks and dry run (the compiling
itself needs the GPU: gpu/run.sh starts it at the top of a lease)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "gpu" / "lib" / "fa2_prejit.py"
sys.path.insert(0, str(SCRIPT.parent))
import fa2_prejit as F  # noqa: E402


def test_one_worker_per_head_dim_and_causality():
    workers = F.plan([64, 256], "bfloat16")
    assert [w[-4:] for w in workers] == [
        ["64", "0", "--dtype", "bfloat16"], ["64", "1", "--dtype", "bfloat16"],
        ["256", "0", "--dtype", "bfloat16"], ["256", "1", "--dtype", "bfloat16"]]
    assert all(w[2] == "--one" for w in workers)


def test_default_head_dims_cover_the_suite_models():
    # tiny drafter 64, 27B-geometry drafter 128, tiny and 27B targets 256
    assert set(F.HEAD_DIMS) == {64, 128, 256}
    assert any(q == 1 for _, q, _ in F.SHAPES) and any(q > 1 for _, q, _ in F.SHAPES)


@pytest.mark.parametrize("text", ["", "7", "64,x", "512", "0"])
def test_bad_head_dims_get_one_line_naming_what_is_valid(text):
    with pytest.raises(SystemExit) as e:
        F.parse_dims(text)
    assert "valid:" in str(e.value) and "\n" not in str(e.value)


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_dry_run_lists_the_workers_and_starts_none():
    r = _run("--head-dims", "64,128", "--dry-run")
    assert r.returncode == 0
    assert "4 workers" in r.stdout and r.stdout.count("--one") == 4


def test_bad_dtype_and_causal_flag_are_refused():
    r = _run("--dtype", "float32", "--dry-run")
    assert r.returncode != 0 and "valid: bfloat16, float16" in r.stderr
    r = _run("--one", "64", "2")
    assert r.returncode != 0 and "valid: 0, 1" in r.stderr
