"""Patch 0021: vLLM 0.27.1's hadacore calls that launch its masked kernel (more than 256
elements, head size <= 256, an odd count of 256-element chunks) made SmolLM2's stock int4 decode
return NaN in 8 of 8 texts on an H100, and 0 of 8 once padded (job 32, session 32). The patched
``fast_hadamard_transform`` pads such calls to chunk pairs. On the CPU the real kernel cannot run:
a stand-in hadacore computes the transform and poisons a masked launch's last chunk with NaN;
the GPU checks are job 32's int4st / int4raw arms and gpu/lib/hadacore_probe.py."""
from __future__ import annotations

import json

import pytest

from onecard import patching
from tests.child_code import REPO, TRITON_DRIVER_ACTIVE, run_child

CHILD = TRITON_DRIVER_ACTIVE + f"""
import json, math, sys, types
import torch
sys.path.insert(0, {str(REPO / "gpu" / "lib")!r})
from hadacore_probe import predicted_bad
from onecard.kernels.reference import _hadamard
import vllm
from vllm.v1.attention.ops import int4_per_token_head as i4

launches = {{"masked": 0, "all": 0}}

def hadacore_transform(x, inplace):
    # vLLM's host code: pad rows to a multiple of 256 elements, transform in place, narrow back
    d = x.shape[-1]
    shape = x.shape
    x2 = x.reshape(-1, d)
    rows = x2.shape[0]
    if x2.numel() % 256:
        x2 = torch.cat([x2, x2.new_zeros((256 - x2.numel() % 256) // d, d)])
    y = (x2.double() @ _hadamard(d) / math.sqrt(d)).to(x.dtype)
    launches["all"] += 1
    if predicted_bad(x2.shape[0], d):
        launches["masked"] += 1
        y.view(-1)[-256:] = float("nan")  # the masked warp's chunk: whatever shared memory held
    x2.copy_(y)
    return x2[:rows].reshape(shape)

fake = types.ModuleType("vllm._custom_ops")
fake.hadacore_transform = hadacore_transform
sys.modules["vllm._custom_ops"] = fake
vllm._custom_ops = fake

def butterfly(x):
    i4._HADACORE_AVAILABLE = False
    try:
        return i4.fast_hadamard_transform(x)
    finally:
        i4._HADACORE_AVAILABLE = True

i4._HADACORE_AVAILABLE = True
torch.manual_seed(0)
bad, nonfinite, checked = [], 0, 0
for d in (32, 64, 128, 256):
    for rows in range(1, 41):
        for dtype in (torch.bfloat16, torch.float32):
            for shape in ((rows, d), (rows, 3, d)):
                x = torch.randn(*shape).to(dtype)
                y = i4.fast_hadamard_transform(x)
                ref = butterfly(x.float())
                checked += 1
                if not torch.isfinite(y).all():
                    nonfinite += 1
                err = float((y.float() - ref).abs().max() / ref.abs().max())
                if y.shape != x.shape or y.dtype != x.dtype or not err <= 0.02:
                    bad.append([d, rows, str(dtype), list(shape), err])
rht = i4.single_rht(torch.randn(9, 64), inverse=False)
back = i4.single_rht(rht, inverse=True) / 64
print(json.dumps({{"bad": bad[:10], "n_bad": len(bad), "nonfinite": nonfinite, "checked": checked,
                  "launches": launches, "rht_roundtrip_finite": bool(torch.isfinite(back).all())}}))
"""


@pytest.fixture(scope="module")
def p0021_site(vllm_dir, tmp_path_factory):
    return patching.overlay(vllm_dir, tmp_path_factory.mktemp("p0021"))


def _run(site, **env) -> dict:
    out = run_child(site, CHILD, env_extra=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_patched_wrapper_never_launches_the_masked_kernel(p0021_site):
    got = _run(p0021_site)
    assert got["checked"] == 4 * 40 * 2 * 2
    assert got["launches"]["masked"] == 0 and got["launches"]["all"] > 0
    assert got["nonfinite"] == 0 and got["n_bad"] == 0, got["bad"]
    assert got["rht_roundtrip_finite"]


def test_pad_off_passes_vllms_call_through(p0021_site):
    """ONECARD_HADACORE_PAD=0 (A/B only): the stand-in sees vLLM's own masked launches again."""
    got = _run(p0021_site, ONECARD_HADACORE_PAD="0")
    assert got["launches"]["masked"] > 0 and got["nonfinite"] > 0


def test_probe_prediction_matches_the_launch_rule():
    """gpu/lib/hadacore_probe.predicted_bad: SmolLM2's decode query (9 x 64) is a masked launch,
    the 27B's (24 x 256) and its K/V rows (4 x 256) never are."""
    import sys
    sys.path.insert(0, str(REPO / "gpu" / "lib"))
    from hadacore_probe import predicted_bad
    assert predicted_bad(9, 64) and not predicted_bad(3, 64) and not predicted_bad(4, 64)
    assert not any(predicted_bad(24 * t, 256) or predicted_bad(4 * t, 256) for t in range(1, 65))
    assert [r for r in range(1, 13) if predicted_bad(r, 64)] == [9, 10, 11, 12]
    assert [r for r in range(1, 8) if predicted_bad(r, 256)] == [3, 5, 7]
