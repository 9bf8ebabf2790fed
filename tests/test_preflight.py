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


def _dflash2_installed(tmp_path, monkeypatch):
    import importlib.util
    import types

    d = tmp_path / "v"
    d.mkdir(exist_ok=True)
    (d / "dflash2_installed.txt").write_text("")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: types.SimpleNamespace(submodule_search_locations=[str(d)]))
    draft = tmp_path / "dr"
    draft.mkdir(exist_ok=True)
    (draft / "config.json").write_text("{}")
    return draft


def test_dflash2_drafter_weights_and_kv_layers(tmp_path, monkeypatch):
    """The drafter's 5 attention layers share the pool (MAX_LEN cap names them) and its 3.58 GiB
    of weights push the 3090 fast pin over a 24 GiB card (the note names it and the pin that fits)."""
    draft = _dflash2_installed(tmp_path, monkeypatch)
    plan = mk({"CTX": "fast", "SPEC": "dflash2", "DRAFT": str(draft)}, tmp_path)
    v = plan.values["MAX_LEN"]
    assert v.source == "cap" and "drafter's 5 attention layers hold KV in the same pool" in v.reason
    assert plan.prediction["group_size"] == 5  # its own bucket: 8 KV heads x 128 vs 4 x 256
    vram = plan.prediction["vram"]
    assert vram["drafter_weights"] == memory.DFLASH2_27B_PARAMS * 2 and not vram["fits"]
    note = next(n for n in plan.notes if n.startswith("VRAM on one GPU"))
    assert "does NOT fit a 24 GiB card because of the DFlash2 drafter's weights" in note
    assert f"KV_MEM <= {vram['kv_max'] // memory.MiB}M" in note
    # at that pin it fits
    fit = mk({"CTX": "fast", "SPEC": "dflash2", "DRAFT": str(draft), "KV_MEM": f"{vram['kv_max'] // memory.MiB}M"}, tmp_path)
    assert fit.prediction["vram"]["fits"]
    # without a drafter nothing of this
    off = mk({"CTX": "fast", "SPEC": "off"}, tmp_path)
    assert off.prediction["vram"]["drafter_weights"] == 0 and off.prediction["vram"]["fits"]


def test_mtp_draft_lm_head_counted_unless_disabled(tmp_path):
    from safetensors.torch import save_file
    import json
    import torch

    model = tmp_path / "model"
    model.mkdir()
    save_file({"lm_head.weight": torch.zeros(1000, 64, dtype=torch.bfloat16)}, model / "model.safetensors")
    (model / "draft_vocab.json").write_text(json.dumps({"ids": list(range(250))}))
    plan = mk({"CTX": "fast", "SPEC": "mtp", "MODEL": str(model)}, tmp_path)
    assert plan.prediction["vram"]["draft_lm_head"] == 250 * 64 * 2
    assert any("MTP draft_lm_head" in n and "250 draft ids" in n for n in plan.notes)
    plan = mk({"CTX": "fast", "SPEC": "mtp", "MODEL": str(model), "ONECARD_DRAFT_VOCAB": "0"}, tmp_path)
    assert plan.prediction["vram"]["draft_lm_head"] == 0
    assert mk({"CTX": "fast", "SPEC": "off", "MODEL": str(model)}, tmp_path).prediction["vram"]["draft_lm_head"] == 0


def test_huge_counts_the_kvarn_stage(tmp_path, monkeypatch):
    from onecard import profiles

    monkeypatch.setattr(profiles, "feature_installed", lambda f: True)
    plan = mk({"CTX": "huge", "SPEC": "mtp"}, tmp_path)
    g = memory.QWEN38_27B
    want = (memory.kvarn_stage_bytes(g, "kvarn", int(plan.get("MAX_SEQS")), g.num_full_attention + g.mtp_layers)
            + memory.kvarn_prefill_scratch_bytes(g))  # stage + the prefill scratch
    assert plan.prediction["vram"]["kvarn_stage"] == want > memory.kvarn_prefill_scratch_bytes(g) > 0
    assert any("KVarN fp16 stage" in n for n in plan.notes)
    assert mk({"CTX": "long", "SPEC": "mtp"}, tmp_path).prediction["vram"]["kvarn_stage"] == 0


def test_vram_note_when_over_without_new_terms(tmp_path):
    plan = mk({"CTX": "fast", "SPEC": "off", "KV_MEM": "9G"}, tmp_path)
    note = next(n for n in plan.notes if n.startswith("VRAM on one GPU"))
    assert "does NOT fit a 24 GiB card;" in note and "because of" not in note and "KV_MEM <=" in note
