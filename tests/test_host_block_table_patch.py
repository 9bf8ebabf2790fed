"""Patch 0084: GPUModelRunner._build_attention_metadata gives every KV cache group's common
attention metadata the host copy of that group's block table (cm.block_table_cpu), which
KVarN's builder plans from instead of copying the device table (a sync). The statement is found
in the patched runner (inside the per-group loop, after the metadata copy) and run as written
against vLLM's own spec classes and a host block table."""
from __future__ import annotations

import ast
import types

import pytest

from onecard import patching


@pytest.fixture(scope="module")
def runner_source(vllm_dir, tmp_path_factory):
    site = patching.overlay(vllm_dir, tmp_path_factory.mktemp("p0084"))
    return (site / "vllm" / "v1" / "worker" / "gpu_model_runner.py").read_text()


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
