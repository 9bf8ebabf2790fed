"""Preflight: refuse or cap before a multi-minute boot."""
import pytest

from onecard import memory
from onecard import plan as P


def mk(env, tmp_path, **kw):
    return P.make_plan(env, tmp_path, python="python3", **kw)


def test_tp_drops_pin(tmp_path):
    plan = mk({"EXTRA_ARGS": "--tensor-parallel-size 2"}, tmp_path)
    assert plan.values["KV_MEM"].source == "cap" and "tensor parallel" in plan.values["KV_MEM"].reason
    assert "--kv-cache-memory-bytes" not in plan.argv and "--gpu-memory-utilization" in plan.argv
    assert mk({"EXTRA_ARGS": "-tp=2"}, tmp_path).get("KV_MEM") == "auto"


def test_fp16_with_spec_refused_but_ok_without(tmp_path):
    with pytest.raises(P.PlanError, match="float16"):
        mk({"SPEC": "mtp", "EXTRA_ARGS": "--dtype=half"}, tmp_path)
    plan = mk({"SPEC": "off", "EXTRA_ARGS": "--dtype float16"}, tmp_path)
    assert plan.argv[-2:] == ["--dtype", "float16"]


def test_max_len_capped_with_reason(tmp_path):
    plan = mk({"CTX": "fast", "MAX_LEN": "200000"}, tmp_path)
    v = plan.values["MAX_LEN"]
    assert v.source == "cap" and "predicted pool" in v.reason and v.value < 200000 and v.value % 256 == 0
    assert plan.argv[plan.argv.index("--max-model-len") + 1] == str(v.value)
    assert plan.prediction["max_concurrency"] >= 1.0


def test_tiny_pool_refused(tmp_path):
    with pytest.raises(P.PlanError, match="KV_MEM >="):
        mk({"KV_MEM": "200M"}, tmp_path)


def test_max_seqs_capped_to_mamba_blocks(tmp_path):
    plan = mk({"CTX": "fast", "SPEC": "off", "KV_MEM": "1G", "MAX_LEN": "4096", "MAX_SEQS": "256"}, tmp_path)
    v = plan.values["MAX_SEQS"]
    assert v.source == "cap" and "Mamba cache blocks" in v.reason
    assert v.value == plan.prediction["num_blocks"]


def test_residency_note(tmp_path):
    plan = mk({"CTX": "long", "SPEC": "mtp"}, tmp_path)
    assert any("GDN state blocks" in n and "residency" in n for n in plan.notes)


def test_k_above_7_caps_graphs_and_len(tmp_path, monkeypatch):
    import importlib.util
    import types

    d = tmp_path / "v"
    d.mkdir()
    (d / "dflash2_installed.txt").write_text("")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: types.SimpleNamespace(submodule_search_locations=[str(d)]))
    draft = tmp_path / "dr"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    plan = mk({"CTX": "long", "SPEC": "dflash2", "DFLASH_TOKENS": "15", "DRAFT": str(draft), "SSM_DTYPE": "bfloat16",
               "KV_MEM": "8G"}, tmp_path)
    assert plan.get("CUDAGRAPH_SIZES") == [16, 32, 64]
    assert plan.values["MAX_LEN"].source == "cap" and plan.get("MAX_LEN") == 65_536
    assert '{"cudagraph_capture_sizes":[16,32,64]}' in plan.argv


def test_ssm_dtype_changes_prediction(tmp_path):
    a = mk({"CTX": "long", "SSM_DTYPE": "bfloat16"}, tmp_path).prediction
    b = mk({"CTX": "long", "SSM_DTYPE": "float32", "MAX_LEN": "65536"}, tmp_path).prediction
    assert a["block_size"] < b["block_size"]
    assert "--mamba-ssm-cache-dtype" in mk({"SSM_DTYPE": "bfloat16"}, tmp_path).argv


def test_geometry_from_model(tmp_path):
    g = memory.ModelGeometry(num_layers=8, num_full_attention=2, num_kv_heads=2, linear_num_key_heads=2,
                             linear_num_value_heads=6)
    plan = mk({"MAX_LEN": "4096", "KV_MEM": "64M"}, tmp_path, geometry=g)
    assert plan.prediction["group_size"] == 3


def test_short_residency_note(tmp_path):
    plan = mk({"CTX": "fast", "MAX_SEQS": "64"}, tmp_path)
    assert any("wait for GDN state blocks" in n for n in plan.notes)
    assert "GiB" in P.format_table(plan)
