"""The no-vLLM GPU probes (gpu/lib/verify_probe.py, gpu/lib/ncu_launch.py) name only launches the
wide-verify wrapper accepts, so a short lease never spends its minutes on a typo; one arm runs
end to end under the CPU interpreter (tiny shapes)."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "gpu" / "lib"))


def _params():
    wv = pytest.importorskip("onecard.kernels.wide_verify")
    return set(inspect.signature(wv.wide_verify_attention).parameters)


def test_probe_arms_and_ncu_labels_are_valid_launches():
    import ncu_launch
    import verify_probe

    params = _params()
    launches = [x for arm in verify_probe.ARMS.values() for x in arm] + list(ncu_launch.LAUNCHES.values())
    for kv, kw in launches:
        assert kv in ("bf16", "int8", "int4"), kv
        assert set(kw) <= params, set(kw) - params
    assert "occupancy" in verify_probe.ARMS and "int8-rs2-flat" in ncu_launch.LAUNCHES
    assert "qkint8" in verify_probe.ARMS and "int8-qk8" in ncu_launch.LAUNCHES


def test_probe_rejects_an_unknown_arm(capsys):
    import verify_probe

    with pytest.raises(SystemExit):
        verify_probe.main(["--arms", "nope", "--out", "/nonexistent"])
    assert "valid: flat" in capsys.readouterr().err


@pytest.mark.parametrize("arm, rows", [("occupancy", 8), ("qkint8", 4)])
def test_next_lease_arms_run_under_the_interpreter(tmp_path, arm, rows):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, str(REPO / "gpu" / "lib" / "verify_probe.py"), "--smoke",
                        "--arms", arm, "--out", str(tmp_path)], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "verify_probe.json").read_text())
    assert len(res["correctness"]) == rows and all(x["ok"] for x in res["correctness"])
    assert len(res["timing"]) == rows and all("ours_ms" in x for x in res["timing"])


def test_a_launch_that_raises_is_its_own_row(tmp_path):
    """A launch that fails (a new option the device's Triton cannot compile, say) is recorded as an
    error row; the other launches are still checked and timed, and the probe exits 1."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO}:{REPO / 'gpu' / 'lib'}"}
    code = ("import sys, verify_probe as vp\n"
            "vp.ARMS['t'] = [('int8', {'row_split': 3}), ('int8', {'tile_n': 16})]\n"
            f"sys.exit(vp.main(['--smoke', '--arms', 't', '--out', {str(tmp_path)!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=900)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "verify_probe.json").read_text())
    bad, good = res["correctness"]
    assert not bad["ok"] and "row_split=3 is not valid" in bad["error"] and good["ok"]
    assert "ours_error" in res["timing"][0] and "ours_ms" in res["timing"][1]
