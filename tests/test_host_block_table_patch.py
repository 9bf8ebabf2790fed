"""Patch 0084: GPUModelRunner._build_attention_metadata gives every KV cache group's common
attention metadata the host copy of that group's block table (cm.block_table_cpu), which
KVarN's builder plans from instead of copying the device table (a sync). The statement is found
in the patched runner (inside the per-group loop, after the metadata copy) and run as written
against vLLM's own spec classes and a host block table; the speculative proposer's own common
metadata (unpadded, prepare_inputs_padded, prepare_inputs) keeps it."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from onecard import patching


@pytest.fixture(scope="module")
def p0084_site(vllm_dir, tmp_path_factory):
    return patching.overlay(vllm_dir, tmp_path_factory.mktemp("p0084"))


@pytest.fixture(scope="module")
def runner_source(p0084_site):
    return (p0084_site / "vllm" / "v1" / "worker" / "gpu_model_runner.py").read_text()


def _loop_and_statement(src: str):
    tree = ast.parse(src)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_build_attention_metadata")
    loop = next(n for n in ast.walk(fn) if isinstance(n, ast.For) and ast.unparse(n.target) == "(kv_cache_gid, kv_cache_group)")
    stmts = [s for s in loop.body if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "cm.block_table_cpu"]
    return loop, stmts


def test_statement_in_the_per_group_loop(runner_source):
    loop, stmts = _loop_and_statement(runner_source)
    assert len(stmts) == 1
    body = [ast.unparse(s) for s in loop.body]
    assert body.index("cm = copy(cm_base)") < loop.body.index(stmts[0])


def test_statement_gives_the_groups_host_rows(runner_source):
    torch = pytest.importorskip("torch")
    from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec, FullAttentionSpec

    _, stmts = _loop_and_statement(runner_source)
    code = compile(ast.Module(body=stmts, type_ignores=[]), "<0084>", "exec")
    tables = [torch.arange(40, dtype=torch.int32).view(8, 5) + 100 * g for g in range(2)]
    fake_self = types.SimpleNamespace(input_batch=types.SimpleNamespace(
        block_table=[types.SimpleNamespace(get_cpu_tensor=lambda t=t: t) for t in tables]))
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    enc = EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    for gid, spec, want in ((1, full, tables[1][:3]), (0, enc, None)):
        cm = types.SimpleNamespace()
        exec(code, {"EncoderOnlyAttentionSpec": EncoderOnlyAttentionSpec},  # noqa: S102 - the patch's line
             {"self": fake_self, "cm": cm, "kv_cache_gid": gid,
              "kv_cache_group": types.SimpleNamespace(kv_cache_spec=spec), "num_reqs_padded": 3})
        if want is None:
            assert cm.block_table_cpu is None
        else:
            assert torch.equal(cm.block_table_cpu, want)


_CARRY = r"""
import json, types
import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode import llm_base_proposer as LBP
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
# no GPU here: the Triton kernel (its outputs are not under test), pinned memory, async H2D
LBP.eagle_prepare_inputs_padded_kernel = {(2,): lambda *a: None}
LBP.PIN_MEMORY = False
LBP.async_tensor_h2d = lambda data, device: torch.as_tensor(data).to(device)


def cam(n, q=4, host=True):
    qsl = torch.arange(0, (n + 1) * q, q, dtype=torch.int32)
    seq = torch.tensor([50, 60, 0][:n], dtype=torch.int32)
    c = CommonAttentionMetadata(query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq,
                                num_reqs=n, num_actual_tokens=n * q, max_query_len=q, max_seq_len=60,
                                block_table_tensor=torch.arange(n * 5, dtype=torch.int32).view(n, 5),
                                slot_mapping=torch.arange(n * q), seq_lens_cpu_upper_bound=seq.clone())
    if host:
        c.block_table_cpu = c.block_table_tensor + 1000
    return c


out = {"unpadded": cam(3).unpadded(8, 2).block_table_cpu.tolist(),
       "unpadded_none": cam(3, host=False).unpadded(8, 2).block_table_cpu is None}
c = cam(2)
sdm = types.SimpleNamespace(cu_num_draft_tokens=torch.tensor([3, 6], dtype=torch.int32))
p = SpecDecodeBaseProposer.prepare_inputs_padded(types.SimpleNamespace(), c, sdm,
                                                 torch.tensor([2, 4], dtype=torch.int32))
out["padded"] = p[0].block_table_cpu is c.block_table_cpu
p = SpecDecodeBaseProposer.prepare_inputs(types.SimpleNamespace(token_arange_np=np.arange(64)), c,
                                          [[1, 2], [3, 4, 5, 6]], [3, 3])
out["plain"] = p[0].block_table_cpu is c.block_table_cpu
c = cam(2, host=False)
p = SpecDecodeBaseProposer.prepare_inputs_padded(types.SimpleNamespace(), c, sdm,
                                                 torch.tensor([2, 4], dtype=torch.int32))
out["padded_none"] = p[0].block_table_cpu is None
print("JSON" + json.dumps(out))
"""


def test_drafter_metadata_keeps_the_host_block_table(p0084_site):
    """The proposer's own common metadata keeps block_table_cpu (KVarN's drafter builds plan
    from it): CommonAttentionMetadata.unpadded slices its rows like the device table's, the
    EAGLE/MTP proposer's prepare_inputs_padded / prepare_inputs hand the same rows on; without
    it (no patch 0084 upstream of them) it stays None."""
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{p0084_site}:{repo}"}
    r = subprocess.run([sys.executable, "-c", _CARRY], capture_output=True, text=True, env=env,
                       cwd=p0084_site, timeout=600)
    line = [l for l in r.stdout.splitlines() if l.startswith("JSON")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    out = json.loads(line[0][4:])
    assert out["unpadded"] == [[1000 + i for i in range(5)], [1005 + i for i in range(5)]]
    assert out["unpadded_none"] and out["padded_none"]
    assert out["padded"] and out["plain"]
