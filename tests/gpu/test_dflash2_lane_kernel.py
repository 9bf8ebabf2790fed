"""The DFlash2 lookup lane on the device (patch 0080's DeviceLane, ONECARD_DFLASH_LANE=device) on
CUDA at serving sizes: the Triton match equals the plain-torch match and DeviceLane's rows equal
the host lane's (LookupLane over every occurrence) on histories of up to 245,760 tokens (CTX=huge's
max_model_len); one step's device time is printed (informational, never asserted).
Run on the GPU host: python3 -m pytest -m gpu -s tests/gpu/test_dflash2_lane_kernel.py
(gpu/jobs/72-dflash2-lane.sh runs it before its servers)."""

from __future__ import annotations

import importlib.util
import random
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SRC = Path(__file__).resolve().parents[2] / "onecard" / "dflash" / "patch_src"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def mods():
    """patch_src's lane and kernel files, the kernel against Triton itself (vLLM's triton_utils
    when vLLM is importable, as in the server)."""
    saved = {k: sys.modules.get(k) for k in ("vllm", "vllm.triton_utils")}
    try:
        import vllm.triton_utils  # noqa: F401
    except ImportError:
        import triton

        shim = types.ModuleType("vllm.triton_utils")
        shim.triton, shim.tl = triton, triton.language
        sys.modules.setdefault("vllm", types.ModuleType("vllm"))
        sys.modules["vllm.triton_utils"] = shim
    try:
        lane = _load("gpu_test_dflash2_lane", SRC / "dflash2_lane.py")
        kern = _load("gpu_test_dflash2_lane_kernel", SRC / "dflash2_lane_kernel.py")
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return lane, kern


@pytest.mark.parametrize("width,b,max_match", [(4096, 4, 16), (131072, 2, 16), (245760, 2, 16),
                                               (245760, 2, 64)])
def test_triton_match_equals_torch_at_size(mods, width, b, max_match):
    lane, kern = mods
    g = torch.Generator(device="cuda").manual_seed(width + b)
    hist = torch.randint(0, 6, (b + 1, width + 17), device="cuda", generator=g, dtype=torch.int32)
    count = torch.tensor([width - 5 * i for i in range(b)], device="cuda", dtype=torch.int64)
    slot_idx = torch.arange(b, device="cuda", dtype=torch.int64)
    drafts = torch.randint(0, 6, (b, 7), device="cuda", generator=g)
    query = lane.lane_query(hist, slot_idx, count, drafts, max_match)
    for key_len in (2, 4):
        ref = lane.lane_match_torch(hist, slot_idx, count, query, key_len, 8)
        got = kern.lane_match(hist, slot_idx, count, query, key_len, 8, lane.LANE_BLOCK,
                              lane._PAD)
        assert got.tolist() == ref.tolist()
    # one step's device time (informational)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        kern.lane_match(hist, slot_idx, count, query, 2, 8, lane.LANE_BLOCK, lane._PAD)
    start.record()
    for _ in range(20):
        kern.lane_match(hist, slot_idx, count, query, 2, 8, lane.LANE_BLOCK, lane._PAD)
    end.record()
    torch.cuda.synchronize()
    print(f"[lane-kernel] width {width} batch {b} max_match {max_match}: "
          f"{start.elapsed_time(end) / 20 * 1000:.1f} us per match")


def test_device_lane_rows_equal_host_lane_on_cuda(mods):
    lane, _ = mods
    rnd = random.Random(5)
    hists = {f"r{i}": [rnd.randrange(7) for _ in range(n)]
             for i, n in enumerate((0, 3, 500, 20000))}
    ids = list(hists)
    dl = lane.DeviceLane(slots=4, max_model_len=40000, k_max=15, device="cuda")
    dl.bind(ids, lambda r: True, lambda r: hists[r])
    for step in range(5):
        sampled = torch.full((4, 16), -1, dtype=torch.int64)
        for i, r in enumerate(ids):
            n = rnd.randint(0, 16)
            toks = [rnd.randrange(7) for _ in range(n)]
            sampled[i, :n] = torch.tensor(toks, dtype=torch.int64)
            hists[r] += toks
        dl.append(sampled.cuda(), None)
        drafts = torch.randint(0, 7, (4, 7))
        got = dl.rows(drafts.cuda(), 15).tolist()
        for i, r in enumerate(ids):
            ln = lane.LookupLane(2, 16, 10**6)
            ln.extend(hists[r])
            want = lane.assemble_block(
                drafts[i].tolist(),
                ln.propose(drafts[i].tolist(), cap=8, room=40000 - len(ln) - 8), 15)
            assert got[i] == want, (step, r)
