"""Patch 0082: one GDN metadata build per step for all GDN KV cache groups.

vLLM 0.27.1's own GDNAttentionMetadataBuilder (patched view, CPU): for every batch shape a
speculative or plain step can have, `update_block_table` applied to group A's build with group
B's block table must equal, field by field, a stock build for group B (a builder made with
ONECARD_GDN_SHARED_META=0), and after it every FULL-graph buffer that group B's captured graph
reads must hold what the stock build would have left in its own buffers.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from onecard import patching

REPO = Path(__file__).resolve().parent.parent
PATCH = "0082-gdn-shared-metadata.patch"

_CHILD = r'''
import os, types, itertools
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as q
import vllm.v1.attention.backends.gdn_attn as g
from vllm.v1.kv_cache_interface import MambaSpec

import vllm.utils.torch_utils as tu
q._resolve_gdn_prefill_backend = lambda cfg: ("triton", "triton")
import vllm.v1.attention.backends.utils as bu
tu.PIN_MEMORY = bu.PIN_MEMORY = False  # CPU: no pinned host memory to stage through
K = 3  # draft tokens
BLOCK = 16


def config(mode, full):
    mode_obj = types.SimpleNamespace(has_full_cudagraphs=lambda: full)
    return types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(cudagraph_mode=mode_obj,
                                                 max_cudagraph_capture_size=None),
        speculative_config=types.SimpleNamespace(num_speculative_tokens=K,
                                                 parallel_drafting=False),
        scheduler_config=types.SimpleNamespace(max_num_seqs=8),
        cache_config=types.SimpleNamespace(mamba_cache_mode=mode),
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=1),
        additional_config={},
    )


def spec(mode):
    return MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,),
                     mamba_cache_mode=mode, num_speculative_blocks=K if mode != "align" else 0)


FIELDS = [f for f in g.GDNAttentionMetadata.__dataclass_fields__ if f != "onecard_share"]
BUFFERS = ["spec_state_indices_tensor", "non_spec_state_indices_tensor", *g._ONECARD_SHARED_NAMES]


def builder(mode, full, shared):
    os.environ["ONECARD_GDN_SHARED_META"] = "1" if shared else "0"
    b = g.GDNAttentionMetadataBuilder(spec(mode), ["l"], config(mode, full), torch.device("cpu"))
    # stock buffers start as garbage; make the comparison of untouched tails meaningful
    for name in BUFFERS:
        buf = getattr(b, name)
        buf.fill_(False if buf.dtype == torch.bool else -7)
    return b


def common(q_lens, seq_lens, block_table):
    cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    n = len(q_lens)
    return CommonAttentionMetadata(
        query_start_loc=cu, query_start_loc_cpu=cu.clone(), seq_lens=sl,
        num_reqs=n, num_actual_tokens=int(cu[-1]), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), block_table_tensor=block_table,
        slot_mapping=torch.zeros(int(cu[-1]), dtype=torch.int64), causal=True,
        _seq_lens_cpu=sl.clone(), _num_computed_tokens_cpu=sl - torch.tensor(q_lens, dtype=torch.int32),
    )


def same(a, b, path):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), path
        assert a.shape == b.shape and a.dtype == b.dtype, (path, a.shape, b.shape)
        assert torch.equal(a, b), (path, a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    else:
        assert a == b, (path, a, b)



# (name, query lens, draft tokens per request: -1 = no drafts)
CASES = [
    ("spec decode", [K + 1] * 3, [K] * 3),
    ("spec decode + padding", [K + 1] * 3 + [0, 0], [K] * 3 + [-1, -1]),
    ("spec decode, short drafts", [K + 1, 2, K + 1], [K, 1, K]),
    ("mixed prefill + spec", [K + 1, 7, K + 1, 5], [K, -1, K, -1]),
    ("prefill first, then spec", [9, K + 1, K + 1], [-1, K, K]),
    ("non-spec decode", [1, 1, 1, 1], [-1, -1, -1, -1]),
    ("non-spec decode + padding", [1, 1, 0], [-1, -1, -1]),
    ("decode + prefill, no drafts", [1, 1, 6], [-1, -1, -1]),
    ("prefill only", [11, 4], [-1, -1]),
    ("spec + non-spec decode", [K + 1, 1, K + 1], [K, -1, K]),
    # not produced by the runner (padding sits at the back), but it takes the FULL-graph
    # spec path with a mask that is not a prefix
    ("padding first", [0, K + 1, K + 1], [-1, K, K]),
]

torch.manual_seed(0)
checked = 0
for mode in ("align", "none"):
    for full in (True, False):
        A, B = builder(mode, full, True), builder(mode, full, True)
        assert A.supports_update_block_table and B.supports_update_block_table
        for name in g._ONECARD_SHARED_NAMES:
            assert getattr(A, name) is getattr(B, name), name
        C = builder(mode, full, False)  # stock: group B built on its own
        assert not C.supports_update_block_table
        assert getattr(C, "spec_sequence_masks") is not getattr(A, "spec_sequence_masks")
        for step in range(3):
            for name, q_lens, drafts in CASES:
                n = len(q_lens)
                seq_lens = [int(torch.randint(ql + 1, 200, ()).item()) if ql else 0 for ql in q_lens]
                cols = (200 // BLOCK + 1) if mode == "align" else 1 + K
                bt_a = torch.randint(1, 10_000, (n, cols), dtype=torch.int32)
                bt_b = torch.randint(1, 10_000, (n, cols), dtype=torch.int32)
                acc = torch.randint(1, K + 2, (n,), dtype=torch.int32)
                dcpu = torch.tensor(drafts, dtype=torch.int32)
                ma = A.build(0, common(q_lens, seq_lens, bt_a), num_accepted_tokens=acc.clone(),
                             num_decode_draft_tokens_cpu=dcpu.clone())
                ref = C.build(0, common(q_lens, seq_lens, bt_b), num_accepted_tokens=acc.clone(),
                              num_decode_draft_tokens_cpu=dcpu.clone())
                mb = B.update_block_table(ma, bt_b, torch.zeros(1, dtype=torch.int64))
                for f in FIELDS:
                    same(getattr(mb, f), getattr(ref, f), f"{mode}/{full}/{name}/{f}")
                for buf in BUFFERS:
                    same(getattr(B, buf), getattr(C, buf), f"{mode}/{full}/{name}/buffer {buf}")
                # group A's own view is untouched by group B's update
                assert ma.spec_state_indices_tensor is None or ma.spec_state_indices_tensor.data_ptr() != (
                    mb.spec_state_indices_tensor.data_ptr() if full and mb.spec_state_indices_tensor is not None else -1)
                checked += 1
print("checked", checked)

# the knob off: stock behaviour (no update_block_table, own buffers)
os.environ["ONECARD_GDN_SHARED_META"] = "0"
assert not g.onecard_shared_metadata_enabled()
print("OK")
'''


def test_listed_in_series():
    assert PATCH in [p.name for p in patching.read_series()]


def test_update_block_table_equals_a_stock_build_per_group(patched_site):
    env = {k: v for k, v in os.environ.items() if k != "ONECARD_GDN_SHARED_META"}
    env["PYTHONPATH"] = str(patched_site) + os.pathsep + str(REPO)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=str(patched_site))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "OK" in proc.stdout and "checked 132" in proc.stdout, proc.stdout[-2000:]
