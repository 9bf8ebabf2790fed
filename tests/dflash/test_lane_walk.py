"""patch_src/dflash2_lane.py's walk without host syncs: the vectorized step-back equals the
one-index-at-a-time loop it replaced, a sampled walk converts no tensor to a Python bool or
number, and the picks equal the reference walk (onecard.dflash.select) for mixed batches."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from onecard.dflash import select as ref_select

_SRC = Path(__file__).resolve().parents[2] / "onecard/dflash/patch_src/dflash2_lane.py"
_spec = importlib.util.spec_from_file_location("onecard_test_dflash2_lane", _SRC)
lane = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lane)


def _loop_step_back(p, js):
    rows = torch.arange(p.shape[0])
    for _ in range(p.shape[1]):
        zero = (p[rows, js] == 0) & (js > 0)
        if not bool(zero.any()):
            break
        js = torch.where(zero, js - 1, js)
    return js


def test_step_back_equals_the_loop(gen):
    for _ in range(200):
        b, k = 6, 8
        p = torch.rand(b, k, generator=gen)
        p[torch.rand(b, k, generator=gen) < 0.45] = 0.0  # runs of zeros, some whole rows
        js = torch.randint(0, k, (b,), generator=gen)
        assert torch.equal(lane.step_back_to_nonzero(p, js), _loop_step_back(p, js))


def _case(gen, b=5, t=7, k=8, r=16, v=300):
    unary = torch.randn(b, t, k, generator=gen).sort(-1, descending=True).values
    cand = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(b * t)]).view(b, t, k)
    hproj = torch.randn(b, t, r, generator=gen)
    anchors = torch.randint(0, v, (b,), generator=gen)
    pred, succ = torch.randn(v, r, generator=gen), torch.randn(v, r, generator=gen)
    return unary, cand, hproj, anchors, pred, succ


def test_sampled_walk_has_no_host_sync_and_matches_the_reference(gen, monkeypatch):
    unary, cand, hproj, anchors, pred, succ = _case(gen)
    unary[:, :, 1:] -= 200.0  # candidates whose float32 probability underflows to 0
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.0])
    uni = torch.rand(5, 7, generator=gen, dtype=torch.float64)
    uni[:, ::2] = 1.0 - 1e-12  # draws at the top of the CDF: the step-back path
    want, wp = ref_select.selector_walk_batched(unary, cand, hproj, anchors, pred, succ,
                                                temperature=temp, uniforms=uni)

    def no_sync(*_a, **_k):
        raise AssertionError("a tensor became a Python value inside the walk (a host sync on a GPU)")

    for name in ("__bool__", "item", "tolist", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    got, gp = lane.selector_walk(unary, cand, hproj, anchors, pred, succ, temp, uni)
    monkeypatch.undo()
    assert torch.equal(got, want)
    rows = temp > 0
    assert torch.allclose(gp[rows], wp[rows].float(), atol=1e-6)
    assert bool((gp[~rows].sum(-1) == 1).all())  # greedy rows: one-hot at their pick


@pytest.mark.parametrize("temps", [None, [0.0, 0.0, 0.0, 0.0, 0.0]])
def test_all_greedy_batch_picks_argmax_with_or_without_temperature(gen, temps):
    unary, cand, hproj, anchors, pred, succ = _case(gen)
    want, _ = lane.selector_walk(unary, cand, hproj, anchors, pred, succ)
    temp = None if temps is None else torch.tensor(temps)
    uni = None if temps is None else torch.rand(5, 7, generator=gen, dtype=torch.float64)
    got, probs = lane.selector_walk(unary, cand, hproj, anchors, pred, succ, temp, uni)
    assert torch.equal(got, want)
    assert (probs is None) == (temps is None)


def test_a_draw_past_the_last_nonzero_candidate_steps_back():
    """hproj 0 (scores = unary): a float32 softmax whose double CDF ends below u = 1 - 1e-12
    sends searchsorted past the last nonzero candidate; the pick must step back onto it."""
    g = torch.Generator().manual_seed(0)
    for _ in range(1000):
        row = torch.cat([torch.randn(5, generator=g), torch.full((3,), -200.0)])
        p = torch.softmax(row, -1)
        if float(torch.cumsum(p.double(), -1)[-1]) < 1 - 1e-9:
            break
    else:
        pytest.skip("no float32 softmax below 1 found")
    k, v, r = 8, 50, 4
    unary = row.view(1, 1, k)
    cand = torch.arange(k).view(1, 1, k) + 10
    pred, succ = torch.randn(v, r, generator=g), torch.randn(v, r, generator=g)
    uni = torch.full((1, 1), 1 - 1e-12, dtype=torch.float64)
    tok, probs = lane.selector_walk(unary, cand, torch.zeros(1, 1, r), torch.tensor([3]), pred, succ,
                                    torch.tensor([1.0]), uni)
    want, _ = ref_select.selector_walk_batched(unary, cand, torch.zeros(1, 1, r), torch.tensor([3]),
                                               pred, succ, temperature=torch.tensor([1.0]), uniforms=uni)
    assert int(tok[0, 0]) == int(want[0, 0]) == 10 + 4  # the last candidate with p > 0
    assert float(probs[0, 0, 4]) > 0
