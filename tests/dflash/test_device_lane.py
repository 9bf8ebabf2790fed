"""The lookup lane on the device (patch_src/dflash2_lane.py DeviceLane, ONECARD_DFLASH_LANE=device):
its picks equal the host lane's (LookupLane over every occurrence) step by step, its per-step
work converts no tensor to a Python value (no host sync), batch changes reseed only new
requests, and the Triton match (dflash2_lane_kernel.py, under TRITON_INTERPRET=1) equals the
plain-torch match it replaces on CUDA."""
from __future__ import annotations

import importlib.util
import random
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.interpret import child_rerun, enable, inproc_mark

_PREIMPORTED = enable()  # before the first `import triton` (tests/interpret.py)

_DIR = Path(__file__).resolve().parents[2] / "onecard/dflash/patch_src"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


lane = _load("onecard_test_dflash2_lane_dev", _DIR / "dflash2_lane.py")
ALL = 10**6  # LookupLane max_candidates that keeps every occurrence, like the device lane


def _host_rows(ids, drafts, k, max_model_len, key_len=2, max_match=16, max_candidates=ALL):
    ln = lane.LookupLane(key_len, max_match, max_candidates)
    ln.extend(ids)
    rows = len(drafts)
    room = max_model_len - len(ln) - rows - 1
    return lane.assemble_block(drafts, ln.propose(drafts, cap=k - rows, room=room), k)


def _device(slots=4, max_model_len=200, k=9, key_len=2, max_match=16):
    return lane.DeviceLane(slots=slots, max_model_len=max_model_len, k_max=k, key_len=key_len,
                           max_match=max_match)


@pytest.mark.parametrize("key_len,max_match", [(1, 4), (2, 16), (3, 5)])
def test_device_rows_equal_host_lane(key_len, max_match):
    rnd = random.Random(1000 * key_len + max_match)
    for trial in range(60):
        vocab = rnd.choice([3, 5, 9])
        b, rows, k = rnd.randint(1, 4), rnd.choice([1, 3, 7]), rnd.choice([8, 11, 15])
        k = max(k, rows + 1)
        max_model_len = rnd.choice([40, 90, 400])
        hists = [[rnd.randrange(vocab) for _ in range(rnd.choice([0, 1, 2, 7, 30, 80]))]
                 for _ in range(b)]
        drafts = torch.randint(0, vocab, (b, rows), generator=torch.Generator().manual_seed(trial))
        dl = _device(slots=4, max_model_len=max_model_len, k=k, key_len=key_len,
                     max_match=max_match)
        ids = [f"r{i}" for i in range(b)]
        dl.bind(ids, lambda r: True, lambda r: hists[int(r[1:])])
        got = dl.rows(drafts, k).tolist()
        for i in range(b):
            want = _host_rows(hists[i], drafts[i].tolist(), k, max_model_len, key_len, max_match)
            assert got[i] == want, (trial, i, hists[i], drafts[i].tolist())


def test_steps_batch_changes_and_padding():
    """Several steps: accepted tokens appended on the device (rejected ones -1), a request
    leaving and a new one taking its slot (reseeded), a padding row (no request)."""
    rnd = random.Random(7)
    vocab, rows, k, mml = 4, 3, 9, 500
    seqs = {f"q{i}": [rnd.randrange(vocab) for _ in range(rnd.randint(0, 25))] for i in range(6)}
    dl = _device(slots=3, max_model_len=mml, k=k)
    batches = [["q0", "q1"], ["q0", "q1"], ["q1", "q2", None], ["q1", "q2", None],
               ["q3", "q1", "q2"], ["q3", "q4"], ["q3", "q4"]]
    known = {}
    for step, batch in enumerate(batches):
        alive = set(r for r in batch if r)
        dl.bind(batch, lambda r: r in alive, lambda r: seqs[r])
        for r in batch:
            if r and r not in known:
                known[r] = list(seqs[r])
        # this step's accepted tokens: a prefix of k + 1 sampled ids, the rest -1
        sampled = torch.full((len(batch), k + 1), -1, dtype=torch.int64)
        for i, r in enumerate(batch):
            n = rnd.randint(0, k + 1)
            toks = [rnd.randrange(vocab) for _ in range(n)]
            sampled[i, :n] = torch.tensor(toks, dtype=torch.int64)
            if r:
                known[r] += toks
        valid = None if step % 2 else (sampled >= 0).sum(1).to(torch.int32)
        dl.append(sampled, valid)
        drafts = torch.randint(0, vocab, (len(batch), rows),
                               generator=torch.Generator().manual_seed(step))
        got = dl.rows(drafts, k).tolist()
        for i, r in enumerate(batch):
            d = drafts[i].tolist()
            want = _host_rows(known[r], d, k, mml) if r else lane.assemble_block(d, [], k)
            assert got[i] == want, (step, r)
            if r:
                slot = dl.slots.owner[r]
                assert dl.hist[slot, : len(known[r])].tolist() == known[r]
                assert int(dl.count[slot]) == len(known[r])


def test_room_and_history_end_cap_the_copy():
    """A match near the end of the history copies only the tokens that exist, then repeats the
    last one; max_model_len leaves room for fewer."""
    dl = _device(slots=1, max_model_len=30, k=10)
    hist = [1, 2, 3, 4, 5, 6, 1, 2]  # suffix (1, 2) + drafts (3, 4) matched at end 4
    dl.bind(["a"], lambda r: True, lambda r: hist)
    got = dl.rows(torch.tensor([[3, 4]]), 10).tolist()[0]
    assert got == [3, 4, 5, 6, 1, 2, 2, 2, 2, 2]
    assert got == _host_rows(hist, [3, 4], 10, 30)
    dl = _device(slots=1, max_model_len=14, k=10)  # room = 14 - 8 - 2 - 1 = 3
    dl.bind(["a"], lambda r: True, lambda r: hist)
    got = dl.rows(torch.tensor([[3, 4]]), 10).tolist()[0]
    assert got == [3, 4, 5, 6, 1, 1, 1, 1, 1, 1] == _host_rows(hist, [3, 4], 10, 14)


def test_default_host_lane_may_differ_only_past_eight_occurrences():
    """The host lane keeps the 8 most recent occurrences of a key; the device lane all. With a
    longer match before the 9th most recent occurrence the two choose differently (both
    exact: lookup tokens are proposals)."""
    hist = [7, 8, 9, 1, 2, 50, 51] + [0, 3, 1, 2, 60] * 8 + [7, 8, 9]
    drafts = [1, 2]
    dl = _device(slots=1, max_model_len=200, k=4)
    dl.bind(["a"], lambda r: True, lambda r: hist)
    dev = dl.rows(torch.tensor([drafts]), 4).tolist()[0]
    assert dev == [1, 2, 50, 51]  # the 5-token match (7 8 9 1 2) far back
    assert _host_rows(hist, drafts, 4, 200, max_candidates=8) == [1, 2, 60, 7]


def test_per_step_work_does_not_sync(monkeypatch):
    """append + rows for a bound batch convert no tensor to a Python bool / number / list."""
    dl = _device(slots=2, max_model_len=100, k=9)
    dl.bind(["a", "b"], lambda r: True, lambda r: [1, 2, 3, 1, 2] if r == "a" else [4])
    sampled = torch.tensor([[3, 1, -1], [5, -1, -1]])
    valid = torch.tensor([2, 1])

    def trap(*a, **kw):
        raise AssertionError("host sync in the device lane's step")

    for name in ("__bool__", "item", "tolist", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, trap)
    dl.bind(["a", "b"], lambda r: True, lambda r: [])  # same batch: nothing to do
    dl.append(sampled, valid)
    dl.append(sampled, None)
    out = dl.rows(torch.tensor([[2, 3], [9, 9]]), 9)
    monkeypatch.undo()
    assert out.shape == (2, 9)


def test_lane_mode_switch():
    assert lane.lane_mode({}) == "device"
    assert lane.lane_mode({"ONECARD_DFLASH_LANE": "host"}) == "host"
    with pytest.raises(ValueError, match="valid: device .* or host"):
        lane.lane_mode({"ONECARD_DFLASH_LANE": "gpu"})


def _kernel_module(monkeypatch):
    """The kernel file with Triton itself behind ``vllm.triton_utils`` (vLLM turns Triton off
    on a machine without a GPU driver; the interpreter needs none)."""
    triton = pytest.importorskip("triton")
    shim = types.ModuleType("vllm.triton_utils")
    shim.triton, shim.tl = triton, triton.language
    monkeypatch.setitem(sys.modules, "vllm.triton_utils", shim)
    if "vllm" not in sys.modules:
        monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    return _load("onecard_test_dflash2_lane_kernel", _DIR / "dflash2_lane_kernel.py")


@inproc_mark(_PREIMPORTED)
@pytest.mark.parametrize("max_match,block", [(2, 16), (5, 32), (16, 64)])
def test_triton_match_equals_torch(max_match, block, monkeypatch):
    kern = _kernel_module(monkeypatch)
    g = torch.Generator().manual_seed(max_match)
    slots, width, b = 3, 150, 4
    hist = torch.randint(0, 4, (slots + 1, width), generator=g, dtype=torch.int32)
    count = torch.tensor([0, 1, 60, 149], dtype=torch.int64)
    slot_idx = torch.tensor([0, 2, 1, 3], dtype=torch.int64)
    seen = []
    for key_len in sorted({1, 2, max_match}):
        for want in (1, 8):
            drafts = torch.randint(0, 4, (b, 3), generator=g)
            query = lane.lane_query(hist, slot_idx, count, drafts, max_match)
            ref = lane.lane_match_torch(hist, slot_idx, count, query, key_len, want)
            got = kern.lane_match(hist, slot_idx, count, query, key_len, want, block, lane._PAD)
            assert got.tolist() == ref.tolist(), (key_len, want)
            seen += ref.tolist()
    assert min(seen) < 0 <= max(seen)  # both outcomes exercised


test_in_child_process = child_rerun(__file__, _PREIMPORTED)


def test_memory_model_counts_the_lane_as_built():
    """onecard.memory.dflash2_lane_bytes (the preflight's term) == DeviceLane.nbytes."""
    from onecard import memory

    for slots, mml, k in ((2, 245760, 15), (8, 131072, 8), (1, 100, 9)):
        dl = lane.DeviceLane(slots=slots, max_model_len=mml, k_max=k)
        assert memory.dflash2_lane_bytes(slots, mml, k) == dl.nbytes
        assert dl.hist.shape[1] % 16 == 0
