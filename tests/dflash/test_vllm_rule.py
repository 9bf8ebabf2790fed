"""onecard.dflash.rejection re-states vLLM 0.27.1's rule exactly: same inputs, same tokens.

Runs vLLM's own Triton kernels under the interpreter in a subprocess (vllm_rule_check.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.mark.vllm
def test_restatement_matches_vllm_kernels(vllm_dir):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(vllm_dir.parent)]))
    proc = subprocess.run([sys.executable, str(HERE / "vllm_rule_check.py"), "60"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=str(REPO))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "OK 60" in proc.stdout
