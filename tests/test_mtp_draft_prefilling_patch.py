"""Patch 0087: the EAGLE/MTP proposer's own attention metadata keeps the runner's is_prefilling,
so patch 0070's TRITON_ATTN builder can mark the MTP layer's draft passes for the wide-verify
kernel. vLLM's own prepare_inputs_padded / prepare_inputs run on the CPU over the patched series
(its Triton kernel, whose outputs are not under test, is stubbed), and the patched builder's real
build() decides on the metadata they return, then on the draft steps' in-place edit of it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from onecard import patching
from tests.child_code import TRITON_ATTN_BUILDER, TRITON_DRIVER_ACTIVE, run_child

REPO = Path(__file__).resolve().parent.parent
PATCH = REPO / "patches" / "0087-mtp-draft-prefilling.patch"


def test_listed_after_0084_with_a_header():
    names = [p.name for p in patching.read_series()]
    assert PATCH.name in names and names.index(PATCH.name) > names.index("0084-host-block-table.patch")
    patch = patching.parse_patch(PATCH)
    for key in ("What", "Why", "Test", "Upstream"):
        assert patch.header.get(key), f"header lacks {key}:"
    assert [fd.path for fd in patch.files] == ["vllm/v1/spec_decode/llm_base_proposer.py"]


@pytest.fixture(scope="module")
def site(vllm_dir, tmp_path_factory):
    return patching.overlay(vllm_dir, tmp_path_factory.mktemp("p0087"))


_CHILD = TRITON_DRIVER_ACTIVE + r"""
import json, types
import numpy as np
import torch
import vllm.v1.attention.backends.triton_attn as t
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode import llm_base_proposer as LBP
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

LBP.eagle_prepare_inputs_padded_kernel = {(2,): lambda *a: None}
LBP.PIN_MEMORY = False
LBP.async_tensor_h2d = lambda data, device: torch.as_tensor(data).to(device)
""" + TRITON_ATTN_BUILDER + r"""

def cam(prefilling, q=4):
    # the runner's verify batch: two requests of 1 + 3 tokens (CTX=long's MTP draft count)
    n = 2
    qsl = torch.arange(0, (n + 1) * q, q, dtype=torch.int32)
    seq = torch.tensor([50, 60], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=n,
        num_actual_tokens=n * q, max_query_len=q, max_seq_len=60,
        block_table_tensor=torch.zeros(n, 5, dtype=torch.int32), slot_mapping=torch.arange(n * q),
        seq_lens_cpu_upper_bound=seq.clone(), causal=True,
        is_prefilling=None if prefilling is None else torch.tensor(prefilling, dtype=torch.bool))


def draft_step(c):
    # what propose() does to the first pass's metadata before its q=1 draft steps
    n = c.num_reqs
    c.num_actual_tokens = n
    c.max_query_len = 1
    c.query_start_loc = torch.arange(n + 1, dtype=torch.int32)
    c.query_start_loc_cpu = torch.arange(n + 1, dtype=torch.int32)
    return c


sdm = types.SimpleNamespace(cu_num_draft_tokens=torch.tensor([3, 6], dtype=torch.int32))
valid = torch.tensor([2, 4], dtype=torch.int32)
b = builder()
t._ONECARD_WIDE_VERIFY = True
out = {}
for name, pre in (("decoding", [False, False]), ("one_in_prompt", [False, True]), ("unknown", None)):
    c = cam(pre)
    padded = SpecDecodeBaseProposer.prepare_inputs_padded(types.SimpleNamespace(), c, sdm, valid)[0]
    plain = SpecDecodeBaseProposer.prepare_inputs(
        types.SimpleNamespace(token_arange_np=np.arange(64)), cam(pre), [[1, 2], [3, 4, 5, 6]], [3, 3])[0]
    row = {"padded_same": padded.is_prefilling is c.is_prefilling,
           "plain_kept": (plain.is_prefilling is None) if pre is None else (
               plain.is_prefilling is not None and plain.is_prefilling.tolist() == pre),
           "first_pass": b.build(0, padded).onecard_verify,
           "first_pass_plain": b.build(0, plain).onecard_verify}
    draft_step(padded)
    t._ONECARD_WIDE_DECODE = True
    row["step_wide_decode"] = b.build(0, padded).onecard_verify
    t._ONECARD_WIDE_DECODE = False
    row["step_stock_decode"] = b.build(0, padded).onecard_verify
    out[name] = row
print("JSON" + json.dumps(out))
"""


def _child(site, extra=None):
    return run_child(site, _CHILD, extra)


def _out(r):
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("JSON")]
    assert r.returncode == 0 and line, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(line[0][4:])


def test_knob_off_is_stock_and_a_bad_value_is_one_line(site):
    """ONECARD_MTP_DRAFT_WIDE=0 (launcher MTP_DRAFT_WIDE=0, the A/B): no draft pass keeps
    is_prefilling, none is marked; a bad value stops the import with the valid values."""
    out = _out(_child(site, {"ONECARD_MTP_DRAFT_WIDE": "0"}))
    assert not out["decoding"]["padded_same"] and not out["decoding"]["plain_kept"]
    for row in out.values():
        assert not any(row[k] for k in ("first_pass", "first_pass_plain", "step_wide_decode",
                                        "step_stock_decode")), row
    r = _child(site, {"ONECARD_MTP_DRAFT_WIDE": "maybe"})
    assert r.returncode != 0
    assert "ONECARD_MTP_DRAFT_WIDE='maybe' is not valid; valid: 1, on, 0, off" in r.stderr


def test_draft_passes_keep_is_prefilling_and_are_marked(site):
    """Both proposer paths keep is_prefilling. The builder marks the first draft pass of a batch
    whose requests all decode, and its q=1 steps with WIDE_DECODE (stock decode without it). One
    request in its prompt, or no is_prefilling at all (vLLM without 0087), keeps every draft
    pass on stock."""
    out = _out(_child(site))
    assert out["decoding"] == {"padded_same": True, "plain_kept": True, "first_pass": True,
                               "first_pass_plain": True, "step_wide_decode": True,
                               "step_stock_decode": False}
    for name in ("one_in_prompt", "unknown"):
        row = out[name]
        assert row["padded_same"] and row["plain_kept"], (name, row)
        assert not any(row[k] for k in ("first_pass", "first_pass_plain", "step_wide_decode",
                                        "step_stock_decode")), (name, row)
