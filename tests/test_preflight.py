"""Preflight: refuse or cap before a multi-minute boot."""
import pytest

from onecard import memory
from onecard import plan as P
from tests.conftest import REAL_CARD_MEMORY as card_memory  # the real one (conftest stubs it per test)


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
    of weights (+ DFlash's 0.10 GiB K/V copy) push the 3090 fast pin over a 24 GiB card (the note names it and the pin that fits)."""
    draft = _dflash2_installed(tmp_path, monkeypatch)
    plan = mk({"CTX": "fast", "SPEC": "dflash2", "DRAFT": str(draft), "DRAFT_QUANT": "bf16"}, tmp_path)
    v = plan.values["MAX_LEN"]
    assert v.source == "cap" and "drafter's 5 attention layers hold KV in the same pool" in v.reason
    assert plan.prediction["group_size"] == 5  # its own bucket: 8 KV heads x 128 vs 4 x 256
    vram = plan.prediction["vram"]
    assert vram["drafter_weights"] == memory.DFLASH2_27B_PARAMS * 2 + 100 * memory.MiB and not vram["fits"]
    note = next(n for n in plan.notes if n.startswith("VRAM on one GPU"))
    assert "does NOT fit a 24 GiB card because of the DFlash2 drafter's weights" in note
    assert f"KV_MEM <= {vram['kv_max'] // memory.MiB}M" in note
    # at that pin it fits
    fit = mk({"CTX": "fast", "SPEC": "dflash2", "DRAFT": str(draft), "DRAFT_QUANT": "bf16",
              "KV_MEM": f"{vram['kv_max'] // memory.MiB}M"}, tmp_path)
    assert fit.prediction["vram"]["fits"]
    # without a drafter nothing of this
    off = mk({"CTX": "fast", "SPEC": "off"}, tmp_path)
    assert off.prediction["vram"]["drafter_weights"] == 0 and off.prediction["vram"]["fits"]


def test_draft_quant_auto_fp8_where_bf16_does_not_fit(tmp_path, monkeypatch):
    """DRAFT_QUANT=auto: fp8 exactly when the plan with a bf16 drafter does not fit the card
    (the 24 GiB assumption of --dry-run, or CARD_GIB), with a note naming what it saves; bf16 on
    a card it fits; explicit values win; the server gets dflash2_draft_quant only with fp8."""
    import json

    draft = _dflash2_installed(tmp_path, monkeypatch)

    def spec_config(plan):
        return json.loads(plan.argv[plan.argv.index("--speculative-config") + 1])

    saved = memory.fp8_saving(memory.drafter_fp8_linears(5120, 32 * 128, 17408, 5 * 5120, 5))
    assert round(saved / memory.GiB, 2) == 1.44
    auto = mk({"CTX": "long", "SPEC": "dflash2", "DRAFT": str(draft)}, tmp_path)
    v = auto.values["DRAFT_QUANT"]
    # 25.26 GiB: the default GDN_DEFER=auto -> 1 adds its 0.03 GiB verify scratch to 25.23
    assert (v.value, v.source) == ("fp8", "profile") and "25.26 GiB of the 24 GiB card" in v.reason
    assert "(assumed: CARD_GIB unset and no nvidia-smi answer)" in v.reason   # --dry-run knows no card
    kv_copy = memory.fused_kv_copy_bytes(5, 8, 128, 5120)  # DFlash's bf16 K/V rows, either way
    assert auto.prediction["vram"]["drafter_weights"] == memory.DFLASH2_27B_PARAMS * 2 - saved + kv_copy
    assert auto.prediction["vram"]["fits"]                  # 23.82 GiB with the reserves
    note = next(n for n in auto.notes if n.startswith("DRAFT_QUANT=auto -> fp8"))
    assert "save 1.44 GiB" in note and "not the output distribution" in note and "job 70" in note
    assert "acceptance with the real drafter's weights is not yet measured" in note
    assert spec_config(auto)["dflash2_draft_quant"] == "fp8_per_block"
    big = mk({"CTX": "long", "SPEC": "dflash2", "DRAFT": str(draft), "CARD_GIB": "141"}, tmp_path)
    assert big.get("DRAFT_QUANT") == "bf16" and "fits the 141 GiB card" in big.values["DRAFT_QUANT"].reason
    assert "dflash2_draft_quant" not in spec_config(big)
    assert big.prediction["vram"]["drafter_weights"] == memory.DFLASH2_27B_PARAMS * 2 + kv_copy
    forced = mk({"CTX": "long", "SPEC": "dflash2", "DRAFT": str(draft), "CARD_GIB": "141", "DRAFT_QUANT": "fp8"}, tmp_path)
    assert spec_config(forced)["dflash2_draft_quant"] == "fp8_per_block"
    assert not any(n.startswith("DRAFT_QUANT=auto") for n in forced.notes)
    kept = mk({"CTX": "long", "SPEC": "dflash2", "DRAFT": str(draft), "DRAFT_QUANT": "bf16"}, tmp_path)
    assert "dflash2_draft_quant" not in spec_config(kept) and not kept.prediction["vram"]["fits"]
    tp = mk({"CTX": "long", "SPEC": "dflash2", "DRAFT": str(draft), "TP": "2"}, tmp_path)
    assert tp.get("DRAFT_QUANT") == "bf16" and "TP>1" in tp.values["DRAFT_QUANT"].reason


def test_draft_quant_needs_dflash2_and_a_valid_value(tmp_path):
    with pytest.raises(P.PlanError, match="DRAFT_QUANT=fp8 needs SPEC=dflash2.*valid otherwise: leave DRAFT_QUANT unset"):
        mk({"CTX": "long", "SPEC": "mtp", "DRAFT_QUANT": "fp8"}, tmp_path)
    with pytest.raises(P.PlanError, match="DRAFT_QUANT.*valid: auto\\|bf16\\|fp8"):
        mk({"CTX": "long", "SPEC": "mtp", "DRAFT_QUANT": "int4"}, tmp_path)
    assert mk({"CTX": "long", "SPEC": "mtp"}, tmp_path).get("DRAFT_QUANT") == "bf16"


def test_draft_quant_saving_from_safetensors_headers(tmp_path):
    """With weights in DRAFT the saving comes from their headers: the fc, o_proj and MLP tensors
    (any prefix), FP8 bytes + Marlin's bf16 scale per 128-wide input group per output row."""
    from safetensors.torch import save_file
    import torch

    d = tmp_path / "drafter"
    d.mkdir()
    t = {"fc.weight": torch.zeros(256, 384, dtype=torch.bfloat16),
         "model.layers.0.self_attn.o_proj.weight": torch.zeros(256, 256, dtype=torch.bfloat16),
         "layers.0.mlp.gate_proj.weight": torch.zeros(512, 256, dtype=torch.bfloat16),
         "layers.0.mlp.down_proj.weight": torch.zeros(256, 200, dtype=torch.bfloat16),
         "layers.0.self_attn.q_proj.weight": torch.zeros(256, 256, dtype=torch.bfloat16),
         "candidate_selector.predecessor_codebook": torch.zeros(1000, 32, dtype=torch.bfloat16)}
    save_file(t, str(d / "model.safetensors"))
    whole = memory.weight_bytes(d)
    got = memory.dflash_drafter_vram(d, fp8=True)
    want = {"fc.weight": 256 * 384 + 3 * 256 * 2, "model.layers.0.self_attn.o_proj.weight": 256 * 256 + 2 * 256 * 2,
            "layers.0.mlp.gate_proj.weight": 512 * 256 + 2 * 512 * 2, "layers.0.mlp.down_proj.weight": 256 * 200 + 2 * 256 * 2}
    assert got.weight_bytes == whole - sum(t[k].numel() * 2 - v for k, v in want.items())
    assert "fc/o_proj/MLP in FP8 (DRAFT_QUANT=fp8)" in got.source
    assert memory.dflash_drafter_vram(d).weight_bytes == whole


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


# ---------------------------------------------------------------- 9a: the card, when known


def test_known_card_over_only_by_the_estimated_reserves_keeps_the_pin(tmp_path, monkeypatch):
    """CTX=long SPEC=dflash2 on a 24 GiB card: 25.26 GiB with the 2.5 GiB of estimated reserves, but
    23.26 GiB without the graph/activation part (weights 14.10 + drafter 3.68 + GDN_DEFER=1 scratch
    0.03 (the default) + KV 4.95 + context 0.5): not certain to fail, so the pin stays and the note
    names the pin that fits by the estimate."""
    draft = _dflash2_installed(tmp_path, monkeypatch)
    env = {"CTX": "long", "SPEC": "dflash2", "DRAFT": str(draft), "CARD_GIB": "24", "DRAFT_QUANT": "bf16"}
    plan = mk(env, tmp_path)
    assert plan.values["KV_MEM"].source == "profile" and plan.get("MAX_LEN") == 90_368
    note = next(n for n in plan.notes if n.startswith("VRAM on one GPU"))
    assert "= 25.26 GiB: does NOT fit a 24 GiB card (CARD_GIB) because of the DFlash2 drafter's weights" in note
    assert "KV_MEM <= 3775M; without the estimated graph/activation reserves it is 23.26 GiB, so the pin stays" in note
    # an explicit pin in the same spot is kept too (not certain to fail)
    assert mk({**env, "KV_MEM": "4800M"}, tmp_path).values["KV_MEM"].source == "env"


def test_known_card_caps_a_profile_pin_that_cannot_fit(tmp_path, monkeypatch):
    """On a 23 GiB card the certain part (23.26 GiB) is over: the pin drops to the largest that fits
    by the estimate, the pool and MAX_LEN follow, the note says it fits."""
    draft = _dflash2_installed(tmp_path, monkeypatch)
    env = {"CTX": "long", "SPEC": "dflash2", "DRAFT": str(draft), "CARD_GIB": "23", "DRAFT_QUANT": "bf16"}
    plan = mk(env, tmp_path)
    kv = plan.values["KV_MEM"]
    b = plan.prediction["vram"]
    assert kv.source == "cap" and kv.value == b["kv_max"] // memory.MiB * memory.MiB < 5_309_988_864
    assert "does not fit the 23 GiB card (CARD_GIB)" in kv.reason and "still 23.26 GiB" in kv.reason
    assert plan.argv[plan.argv.index("--kv-cache-memory-bytes") + 1] == str(kv.value)
    assert b["fits"] and plan.get("MAX_LEN") < 93_696
    assert plan.get("MAX_LEN") <= plan.prediction["num_blocks"] * plan.prediction["block_size"]
    vnote = next(n for n in plan.notes if n.startswith("VRAM on one GPU"))
    assert vnote.endswith("fits a 23 GiB card (CARD_GIB)")
    # VRAM_CHECK=0: the pin stays and the note says it does not fit
    kept = mk({**env, "VRAM_CHECK": "0"}, tmp_path)
    assert kept.values["KV_MEM"].source == "profile" and not kept.prediction["vram"]["fits"]
    assert kept.get("MAX_LEN") == 90_368
    # a card that holds it: nothing changes
    big = mk({**env, "CARD_GIB": "80"}, tmp_path)
    assert big.values["KV_MEM"].source == "profile" and big.prediction["vram"]["fits"]
    assert any(n.endswith("fits a 80 GiB card (CARD_GIB)") for n in big.notes)


def test_known_card_refuses_an_explicit_pin_that_cannot_fit(tmp_path, monkeypatch):
    draft = _dflash2_installed(tmp_path, monkeypatch)
    env = {"CTX": "long", "SPEC": "dflash2", "DRAFT": str(draft), "CARD_GIB": "24", "KV_MEM": "6G", "DRAFT_QUANT": "bf16"}
    with pytest.raises(P.PlanError, match=r"KV_MEM=6442450944 does not fit the 24 GiB card .*valid: KV_MEM "
                                          r"<= 3775M, or VRAM_CHECK=0"):
        mk(env, tmp_path)
    assert mk({**env, "KV_MEM": "3775M"}, tmp_path).values["KV_MEM"].source == "env"
    assert mk({**env, "VRAM_CHECK": "0"}, tmp_path).get("KV_MEM") == 6 * memory.GiB


def test_known_card_too_small_is_refused(tmp_path, monkeypatch):
    draft = _dflash2_installed(tmp_path, monkeypatch)
    with pytest.raises(P.PlanError, match="does not fit the 16 GiB card .*even without a KV pool"):
        mk({"CTX": "long", "SPEC": "dflash2", "DRAFT": str(draft), "CARD_GIB": "16", "DRAFT_QUANT": "bf16"}, tmp_path)
    # a pin that fits but holds no useful pool
    with pytest.raises(P.PlanError, match=r"on the 20\.50 GiB card \(CARD_GIB\) the KV pin that fits, \d+M, gives a pool"):
        mk({"CTX": "long", "SPEC": "dflash2", "DRAFT": str(draft), "CARD_GIB": "20.5", "DRAFT_QUANT": "bf16"}, tmp_path)


def test_mtp_and_off_profiles_fit_a_24_gib_card_unchanged(tmp_path):
    for ctx in ("fast", "long"):
        for spec in ("off", "mtp"):
            plan = mk({"CTX": ctx, "SPEC": spec, "CARD_GIB": "24"}, tmp_path)
            assert plan.values["KV_MEM"].source == "profile" and plan.prediction["vram"]["fits"], (ctx, spec)


@pytest.mark.parametrize("bad", ["abc", "0.5", "4096", "-3"])
def test_card_gib_validated(tmp_path, bad):
    with pytest.raises(P.PlanError, match=r"CARD_GIB=.* valid: 1\.\.2048"):
        mk({"CARD_GIB": bad}, tmp_path)


def test_unknown_card_stays_a_note(tmp_path, monkeypatch):
    """No CARD_GIB and no nvidia-smi answer (a dry run, or a machine without one): today's note."""
    draft = _dflash2_installed(tmp_path, monkeypatch)
    plan = mk({"CTX": "long", "SPEC": "dflash2", "DRAFT": str(draft), "DRAFT_QUANT": "bf16"}, tmp_path)
    assert plan.values["KV_MEM"].source == "profile" and plan.get("CARD_GIB") == ""
    assert any("does NOT fit a 24 GiB card because of" in n for n in plan.notes)


def header_only_weights(draft):
    """A model.safetensors whose header lists every tensor of DRAFT's config (no data: the launch
    reads headers only)."""
    import json
    import struct

    from onecard.dflash.config import DrafterConfig, tensor_shapes

    hdr, off = {}, 0
    for name, shape in tensor_shapes(DrafterConfig.load(draft)).items():
        n = 2
        for x in shape:
            n *= x
        hdr[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(hdr).encode()
    (draft / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_real_launch_asks_nvidia_smi(tmp_path, monkeypatch):
    """make_plan(check_paths=True) is the real launch: the card comes from plan.card_memory."""
    from onecard.dflash.tiny_drafter import build_geometry_drafter

    _dflash2_installed(tmp_path, monkeypatch)
    draft = tmp_path / "geometry-drafter"
    build_geometry_drafter(draft, config_only=True)  # a real DFlash2 config (checked at launch)
    header_only_weights(draft)                       # and its tensors, as far as a launch reads them
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    asked = []
    monkeypatch.setattr(P, "card_memory", lambda env, probe=True: asked.append(probe) or
                        (24576 * memory.MiB, "nvidia-smi: GPU 0, 24,576 MiB"))
    plan = mk({"CTX": "long", "SPEC": "dflash2", "DRAFT": str(draft), "MODEL": str(model)}, tmp_path,
              check_paths=True)
    assert asked == [True] and plan.values["CARD_GIB"].source == "nvidia-smi"
    # DRAFT_QUANT=auto decides on nvidia-smi's card: FP8, and then it fits
    assert plan.get("DRAFT_QUANT") == "fp8" and "24 GiB card (nvidia-smi)" in plan.values["DRAFT_QUANT"].reason
    assert any(n.startswith("VRAM on one GPU") and "fits a 24 GiB card (nvidia-smi)" in n for n in plan.notes)
    kept = mk({"CTX": "long", "SPEC": "dflash2", "DRAFT": str(draft), "MODEL": str(model), "DRAFT_QUANT": "bf16"},
              tmp_path, check_paths=True)
    assert any("does NOT fit a 24 GiB card (nvidia-smi)" in n and "so the pin stays" in n for n in kept.notes)


def test_real_launch_fits_the_plan_into_what_other_processes_leave(tmp_path, monkeypatch):
    """A desktop (or another server) holding GPU memory at launch: the plan is fitted into what is
    left, with a note naming the figure; a driver's few MiB are ignored; CARD_GIB counts the whole
    card. The headline (0.22 GiB to spare on 24 GiB) then no longer fits by its reserves: the pin
    stays and the note names the one that fits; a server already holding the card leaves no room
    even without a pool, and the launch is refused in one line."""
    from onecard.dflash.tiny_drafter import build_geometry_drafter

    _dflash2_installed(tmp_path, monkeypatch)
    draft = tmp_path / "geometry-drafter"
    build_geometry_drafter(draft, config_only=True)
    header_only_weights(draft)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(P, "card_memory", lambda env, probe=True: (24576 * memory.MiB, "nvidia-smi: GPU 0, 24,576 MiB"))
    env = {"CTX": "long", "SPEC": "dflash2", "DRAFT": str(draft), "MODEL": str(model)}

    def launch(used_mib, **extra):
        monkeypatch.setattr(P, "card_in_use", lambda e, probe=True: (used_mib * memory.MiB, "nvidia-smi"))
        return mk({**env, **extra}, tmp_path, check_paths=True)

    quiet = launch(3)
    assert quiet.get("CARD_GIB") == 24.0 and not any(n.startswith("GPU memory in use") for n in quiet.notes)
    desk = launch(600)
    (note,) = [n for n in desk.notes if n.startswith("GPU memory in use before the boot")]
    assert "600 MiB of this GPU's 24,576 MiB is held by other processes" in note and "23,976 MiB left" in note
    assert "CARD_GIB=24 fits it into the whole card" in note and "\n" not in note
    assert desk.get("CARD_GIB") == round(23976 / 1024, 2) and "600 MiB of it in use" in desk.values["CARD_GIB"].reason
    b = desk.prediction["vram"]
    assert not b["fits"] and b["card_bytes"] == int(desk.get("CARD_GIB") * memory.GiB)
    assert desk.values["KV_MEM"].source == "profile"       # over by the reserves only: the pin stays, with the note
    assert launch(600, CARD_GIB="24").prediction["vram"]["fits"]
    assert "does NOT fit a 23.41 GiB card (what other processes leave of this GPU, nvidia-smi)" in next(
        n for n in desk.notes if n.startswith("VRAM on one GPU"))
    with pytest.raises(P.PlanError, match="does not fit the 2.52 GiB card [(]what other processes leave") as e:
        launch(22000)
    assert "valid: the GPU freed of the other processes (a server still running?)" in str(e.value)
    assert "\n" not in str(e.value)


def test_card_in_use_reads_the_visible_gpu(monkeypatch):
    from tests.conftest import REAL_CARD_IN_USE as card_in_use

    _smi(monkeypatch, "0, GPU-aaaa1111, 612\n1, GPU-bbbb2222, 5\n")
    assert card_in_use({}) == (612 * memory.MiB, "nvidia-smi: GPU 0, 612 MiB in use")
    assert card_in_use({"CUDA_VISIBLE_DEVICES": "1"})[0] == 5 * memory.MiB
    assert card_in_use({"CUDA_VISIBLE_DEVICES": "GPU-bbbb"})[0] == 5 * memory.MiB
    assert card_in_use({"CUDA_VISIBLE_DEVICES": "7"})[0] is None
    assert card_in_use({}, probe=False)[0] is None
    _smi(monkeypatch, "")
    assert card_in_use({})[0] is None


def _smi(monkeypatch, out: str):
    import shutil
    import subprocess
    import types

    monkeypatch.setattr(shutil, "which", lambda n: "/usr/bin/nvidia-smi" if n == "nvidia-smi" else None)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=out, returncode=0))


def test_card_memory_reads_the_first_visible_gpu(monkeypatch):
    out = "0, GPU-aaaa1111, 24576\n1, GPU-bbbb2222, 12288\n"
    _smi(monkeypatch, out)
    assert card_memory({}) == (24576 * memory.MiB, "nvidia-smi: GPU 0, 24,576 MiB")
    assert card_memory({"CUDA_VISIBLE_DEVICES": "1,0"})[0] == 12288 * memory.MiB
    assert card_memory({"CUDA_VISIBLE_DEVICES": "GPU-bbbb"})[0] == 12288 * memory.MiB
    n, why = card_memory({"CUDA_VISIBLE_DEVICES": "7"})
    assert n == 12288 * memory.MiB and "not matched, the smallest GPU" in why
    assert card_memory({}, probe=False)[0] is None
    _smi(monkeypatch, "")
    assert card_memory({})[0] is None


def test_measured_reserves_replace_the_estimate_for_exactly_the_measured_profiles(tmp_path, drafter_27b,
                                                                                  fake_features):
    """The profiles job 41 measured at the 2,048 chunk (memory.RESERVES_MEASURED) are budgeted
    with their measured reserves, named as such in the note; any knob that sizes the reserves
    (MAX_SEQS, DFLASH_TOKENS, GDN_DEFER, PREFILL_CHUNK) moved off the measured value, or another
    profile, keeps the estimate. CTX=huge SPEC=dflash2 fits a 24 GiB card by its measurement
    (24.15 GiB by the estimate)."""
    def vram(env):
        plan = mk({"CARD_GIB": "24", **env}, tmp_path)
        return plan, plan.prediction["vram"], next(n for n in plan.notes if n.startswith("VRAM on one GPU"))

    d2 = {"SPEC": "dflash2", "DRAFT": str(drafter_27b)}
    for env, key in (({"CTX": "long", **d2}, ("long", "dflash2", 7, 4, "1", 2048, "fp8", "0")),
                     ({"CTX": "long", "GDN_DEFER": "0", **d2}, ("long", "dflash2", 7, 4, "0", 2048, "fp8", "0")),
                     ({"CTX": "huge", **d2}, ("huge", "dflash2", 7, 2, "1", 2048, "fp8", "1"))):
        plan, b, note = vram(env)
        assert b["reserves"] == memory.RESERVES_MEASURED[key], env
        assert f"reserves {b['reserves'] / memory.GiB:.2f} ({memory.RESERVES_MEASURED_WHERE})" in note
        assert b["fits"] and note.endswith("fits a 24 GiB card (CARD_GIB)"), note
        assert "\n" not in note
    for env in ({"CTX": "long", "MAX_SEQS": "2", **d2}, {"CTX": "long", "DFLASH_TOKENS": "15", **d2},
                {"CTX": "long", "DFLASH_RING": "1", **d2},
                {"CTX": "long", "PREFILL_CHUNK": "4096", "KV_MEM": "1G", **d2}, {"CTX": "long", "SPEC": "mtp"},
                {"CTX": "fast", **d2}, {"CTX": "long", "SPEC": "off"}):
        plan, b, note = vram(env)
        assert b["reserves"] == memory.reserves(int(plan.get("PREFILL_CHUNK"))), env
        assert memory.RESERVES_MEASURED_WHERE not in note
    # fast-dflash2 was not measured: over the card by the estimated reserves only, the pin stays
    plan, b, note = vram({"CTX": "fast", **d2})
    assert not b["fits"] and b["certain"] <= b["card_bytes"] and note.endswith("the reserves are 3090 estimates)")


def test_card_capability_reads_nvidia_smi_for_the_visible_gpu(monkeypatch):
    from tests.conftest import REAL_CARD_CAPABILITY as card_capability

    out = "0, GPU-aaaa1111, 8.6\n1, GPU-bbbb2222, 9.0\n"
    monkeypatch.setattr(P, "_nvidia_smi", lambda args: (out, "") if "compute_cap" in args[0] else (None, "x"))
    assert card_capability({}) == ((8, 6), "nvidia-smi: GPU 0, compute capability 8.6")
    assert card_capability({"CUDA_VISIBLE_DEVICES": "1"})[0] == (9, 0)
    assert card_capability({"CUDA_VISIBLE_DEVICES": "GPU-bbbb"})[0] == (9, 0)
    assert card_capability({"CUDA_VISIBLE_DEVICES": "7"})[0] is None
    assert card_capability({}, probe=False) == (None, "not asked in a dry run")
    monkeypatch.setattr(P, "_nvidia_smi", lambda args: ("0, GPU-aaaa, [N/A]\n", ""))
    assert card_capability({})[0] is None
    monkeypatch.setattr(P, "_nvidia_smi", lambda args: (None, "no nvidia-smi"))
    assert card_capability({}) == (None, "no nvidia-smi")
