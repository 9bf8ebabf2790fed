"""Tensor parallelism (issue 10): TP knob / -tp in EXTRA_ARGS decided once, argv goldens at TP=2,
one-line errors, the multicast-off server env, and the per-GPU memory model."""
import json
import os
import shlex
from pathlib import Path

import pytest

from onecard import memory, profiles
from onecard import plan as P

GOLDEN = Path(__file__).parent / "golden" / "launch"
TP_COMBOS = [("fast", "mtp"), ("long", "mtp"), ("fast", "off")]


def mk(env, root, **kw):
    return P.make_plan(env, root, python="python3", **kw)


@pytest.mark.parametrize("ctx,spec", TP_COMBOS)
def test_golden_argv_tp2(ctx, spec, tmp_path):
    plan = mk({"CTX": ctx, "SPEC": spec, "TP": "2"}, tmp_path)
    got = shlex.join(plan.argv) + "\n"
    path = GOLDEN / f"{ctx}-{spec}-tp2.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(got)
    assert got == path.read_text()
    a = plan.argv
    assert a[a.index("--tensor-parallel-size") + 1] == "2" and "--kv-cache-memory-bytes" not in a
    assert a[a.index("--gpu-memory-utilization") + 1] == "0.92"
    k = profiles.SPEC_PROFILES[spec].k_default[ctx]  # speculative defaults hold at TP=2
    if k:
        assert json.loads(a[a.index("--speculative-config") + 1])["num_speculative_tokens"] == k


def test_knob_and_extra_args_are_one_decision(tmp_path):
    for env in ({"TP": "2"}, {"EXTRA_ARGS": "--tensor-parallel-size 2"}, {"EXTRA_ARGS": "-tp=2"},
                {"TP": "2", "EXTRA_ARGS": "-tp 2"}):
        plan = mk(env, tmp_path)
        assert plan.get("TP") == 2 and plan.get("KV_MEM") == "auto", env
        assert plan.values["KV_MEM"].source == "cap" and "GPU_UTIL" in plan.values["KV_MEM"].reason
        flags = [x for x in plan.argv if x in ("--tensor-parallel-size", "-tp") or x.startswith(("-tp=", "--tensor-parallel-size="))]
        assert len(flags) == 1, (env, plan.argv)  # never passed twice
    assert mk({"EXTRA_ARGS": "-tp 2"}, tmp_path).values["TP"].reason == "--tensor-parallel-size in EXTRA_ARGS"
    plan = mk({}, tmp_path)
    assert plan.get("TP") == 1 and "--tensor-parallel-size" not in plan.argv and "GPUS" not in plan.values
    assert not set(profiles.TP_CHILD_ENV) & set(plan.child_env)


def test_multicast_off_in_server_env(tmp_path):
    plan = mk({"TP": "2"}, tmp_path)
    assert plan.child_env["NCCL_NVLS_ENABLE"] == "0"
    assert plan.child_env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert plan.child_env["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"
    assert any("NCCL_NVLS_ENABLE=0" in n for n in plan.notes)


@pytest.mark.parametrize("env,match", [
    ({"TP": "3"}, r"^TP='3' is not valid; valid: 1\|2\|4\|8$"),
    ({"TP": "two"}, r"valid: 1\|2\|4\|8"),
    ({"EXTRA_ARGS": "-tp 3"}, r"--tensor-parallel-size 3 in EXTRA_ARGS is not valid; valid: 1\|2\|4\|8"),
    ({"EXTRA_ARGS": "--tensor-parallel-size x"}, r"not an integer; valid: 1\|2\|4\|8"),
    ({"TP": "4", "EXTRA_ARGS": "-tp 2"}, r"disagree"),
    ({"TP": "8"}, r"TP=8 does not divide the model's 4 KV heads.*valid for this model: TP=1\|2\|4$"),
    ({"TP": "2", "KV_MEM": "6G"}, r"per-GPU byte pin.*valid at TP>1: KV_MEM unset or auto"),
    ({"TP": "2", "CUDA_VISIBLE_DEVICES": "0"}, r"TP=2 needs 2 GPUs but only 1 visible.*valid here: TP=1$"),
    ({"TP": "4", "CUDA_VISIBLE_DEVICES": "0,1,2"}, r"valid here: TP=1\|2$"),
    ({"TP": "2", "CUDA_VISIBLE_DEVICES": ""}, r"only 0 visible"),
])
def test_tp_errors_one_line(env, match, tmp_path):
    with pytest.raises(P.PlanError, match=match) as e:
        mk(env, tmp_path)
    assert "\n" not in str(e.value)


def test_tp_must_divide_gdn_heads(tmp_path):
    g = memory.ModelGeometry(num_kv_heads=4, linear_num_key_heads=6, linear_num_value_heads=18, num_attention_heads=8)
    with pytest.raises(P.PlanError, match=r"does not divide the model's 6 GDN key heads.*valid for this model: TP=1\|2$"):
        mk({"TP": "4", "KV_MEM": "auto"}, tmp_path, geometry=g)


def test_visible_gpus(monkeypatch, tmp_path):
    import shutil

    assert P.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"})[0] == 2
    assert P.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c"})[0] == 3
    assert P.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,1"})[0] == 1  # CUDA stops at an invalid id
    monkeypatch.setattr(shutil, "which", lambda name: None)
    n, why = P.visible_gpus({})
    assert n is None and "not checked" in why
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA GeForce RTX 3090 (UUID: GPU-a)'\n"
                   "echo '  MIG 1g.5gb Device 0: (UUID: MIG-x)'\necho 'GPU 1: NVIDIA GeForce RTX 3090 (UUID: GPU-b)'\n")
    smi.chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda name: str(smi))
    assert P.visible_gpus({}) == (2, "nvidia-smi -L")
    assert P.visible_gpus({}, probe=False)[0] is None


def test_unknown_gpu_count_does_not_fail(tmp_path, monkeypatch):
    import shutil

    def boom(name):
        raise AssertionError("nvidia-smi must not be asked outside a real launch")

    monkeypatch.setattr(shutil, "which", boom)  # dry runs and tests are machine-independent
    plan = mk({"TP": "2"}, tmp_path)
    assert plan.get("GPUS") == "unknown" and any("unknown" in n for n in plan.notes)
    assert mk({"TP": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, tmp_path).get("GPUS") == 2
    monkeypatch.setattr(shutil, "which", lambda name: None)  # a real launch asks; none here: not checked
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    plan = mk({"TP": "2", "MODEL": str(tmp_path / "m")}, tmp_path, check_paths=True)
    assert plan.get("GPUS") == "unknown" and "not checked" in plan.values["GPUS"].reason


def test_prediction_per_gpu_and_total(tmp_path):
    plan = mk({"TP": "2", "CTX": "fast", "SPEC": "mtp"}, tmp_path)
    p = plan.prediction
    assert p["tp"] == 2 and p["kv_bytes_total"] == 2 * p["kv_bytes_per_gpu"]
    assert p["weights_source"].startswith("27B layout")
    one = memory.tp_weight_bytes(memory.layout_27b_tensors(), 1).per_gpu
    assert 0.49 * one < p["weights_per_gpu"] < 0.51 * one
    table = P.format_table(plan)
    assert "predicted at TP=2 on 24 GiB cards" in table and "GiB/GPU" in table


def test_prediction_reads_checkpoint_headers(tmp_path):
    """A checkpoint on disk: per-GPU weights come from its safetensors headers."""
    import struct

    model = tmp_path / "m"
    model.mkdir()
    hdr, off = {}, 0
    for name, n in (("model.language_model.layers.0.mlp.up_proj.weight", 4000),
                    ("model.language_model.embed_tokens.weight", 2000),
                    ("model.language_model.norm.weight", 100), ("model.visual.blocks.0.attn.qkv.weight", 999)):
        hdr[name] = {"dtype": "U8", "shape": [n], "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(hdr).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * off)
    plan = mk({"TP": "2", "MODEL": str(model)}, tmp_path)
    assert plan.prediction["weights_per_gpu"] == 2000 + 1000 + 100  # visual skipped (text only)
    assert plan.prediction["weights_source"] == "checkpoint headers"


def test_dry_run_shows_tp_reason(tmp_path):
    from test_launch import _run

    r = _run(["--dry-run"], {"TP": "2", "CTX": "long"}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "IMPORTED []" in r.stderr
    assert "tensor parallel 2 > 1: the single-card pin does not apply" in r.stdout
    assert "--tensor-parallel-size 2" in r.stdout and "--kv-cache-memory-bytes" not in r.stdout
