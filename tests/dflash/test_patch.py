"""Patch 0080 (DFlash2 for vLLM 0.27.1): generated == committed, applies and is revertible on top
of the current series, and what it ships equals onecard.dflash's reference on CPU (selector walk,
lookup lane, block conv, the proposer's block assembly) while the patched SpeculativeConfig
accepts method "dflash2" and refuses bad values with one line."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from onecard import patching

REPO = Path(__file__).resolve().parents[2]
NAME = "0080-dflash2.patch"
PATCH = REPO / "patches" / NAME
GOLDEN = REPO / "tests" / "golden" / "launch"
NEW = {"vllm/v1/spec_decode/dflash2_lane.py", "vllm/v1/spec_decode/dflash2_lane_kernel.py",
       "vllm/v1/spec_decode/dflash2.py",
       "vllm/model_executor/models/qwen3_dflash2.py", "vllm/dflash2_installed.txt"}


def test_header_and_files():
    p = patching.parse_patch(PATCH)
    for key in ("What", "Why", "Test", "Upstream"):
        assert p.header.get(key), f"header lacks {key}:"
    created = {fd.path for fd in p.files if fd.created}
    assert created == NEW
    changed = {fd.path for fd in p.files if not fd.created}
    assert changed == {"vllm/config/speculative.py", "vllm/model_executor/models/registry.py",
                       "vllm/model_executor/models/qwen3_dflash.py",
                       "vllm/v1/worker/gpu_model_runner.py"}


def test_generated_equals_committed(vllm_dir):
    from onecard.dflash import make_patch

    assert make_patch.build(vllm_dir) == PATCH.read_text(encoding="utf-8"), (
        "run: python -m onecard.dflash.make_patch")


@pytest.fixture(scope="module")
def series_dir(tmp_path_factory):
    """The current series, plus 0080 at its place if the series does not list it yet."""
    tmp = tmp_path_factory.mktemp("d2-series")
    names = [p.name for p in patching.read_series()]
    if NAME not in names:
        names.append(NAME)
    names.sort(key=lambda n: n[:4])
    for n in names:
        shutil.copy2(REPO / "patches" / n, tmp / n)
    (tmp / "series").write_text("\n".join(names) + "\n")
    return tmp


@pytest.fixture(scope="module")
def overlay(vllm_dir, series_dir, tmp_path_factory):
    return patching.overlay(vllm_dir, tmp_path_factory.mktemp("d2-site"),
                            series=series_dir / "series")


def test_applies_once_and_reverts_on_the_series(overlay, series_dir, vllm_dir, tmp_path):
    # on the overlay every patch reads "applied" (= its reverse applies: it is revertible)
    report = patching.status(overlay / "vllm", series_dir / "series")
    assert report.all_applied, report.lines()
    assert NAME in [n for n, _, _ in report.states]
    _, todo = patching.apply(overlay / "vllm", series_dir / "series", dry_run=True)
    assert todo == []                     # a second apply is a no-op
    assert (overlay / "vllm" / "dflash2_installed.txt").is_file()
    # a fresh pristine copy of every file the series touches takes the whole series, and
    # reverting it gives the pristine files back
    paths = {path for p in patching.read_series(series_dir / "series") for path in p.paths}
    site = vllm_dir.parent
    for rel in paths | {"vllm/__init__.py", "vllm/_version.py"}:
        if (site / rel).is_file():
            (tmp_path / "site" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(site / rel, tmp_path / "site" / rel)
    for info in site.glob("vllm-*.dist-info"):
        shutil.copytree(info, tmp_path / "site" / info.name)
    dest = tmp_path / "site" / "vllm"
    before = {p: (tmp_path / "site" / p).read_bytes() for p in paths
              if (tmp_path / "site" / p).is_file()}
    _, applied = patching.apply(dest, series_dir / "series")
    assert NAME in applied
    assert patching.status(dest, series_dir / "series").all_applied
    patching.revert(dest, series_dir / "series")
    after = {p: (tmp_path / "site" / p).read_bytes() for p in paths
             if (tmp_path / "site" / p).is_file()}
    assert after == before


@pytest.fixture(scope="module")
def checks(overlay, tmp_path_factory):
    from onecard.dflash.tiny_drafter import build_tiny_drafter
    from onecard.prepare.tiny import build_tiny_model

    d = tmp_path_factory.mktemp("d2-models")
    target = build_tiny_model(d / "qwen35-tiny")
    drafter = build_tiny_drafter(target, d / "qwen35-tiny-dflash2")
    # SpeculativeConfig needs a target ModelConfig; the Qwen3.5 one imports torchvision, so a
    # text-only Qwen3 config with the tiny model's sizes stands in (same vocab/hidden/layers)
    tc = json.loads((target / "config.json").read_text())
    t = tc.get("text_config", tc)
    fake = d / "text-target"
    fake.mkdir()
    (fake / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": t["hidden_size"], "num_hidden_layers": t["num_hidden_layers"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "intermediate_size": 256, "vocab_size": t["vocab_size"], "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False, "hidden_act": "silu"}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(overlay), str(REPO)]))
    configs = [json.loads(shlex.split(g.read_text())[shlex.split(g.read_text()).index(
        "--speculative-config") + 1]) for g in sorted(GOLDEN.glob("*-dflash2.txt"))]
    configs.append({"method": "dflash2", "num_speculative_tokens": 15, "dflash2_lookup": True,
                    "draft_sample_method": "probabilistic"})   # tests/gpu/test_dflash2.py d2k15
    arg = json.dumps({"drafter": str(drafter), "target": str(fake), "configs": configs})
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("patch_check.py")), arg],
                          cwd=d, env=env, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PATCH_CHECK ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line.removeprefix("PATCH_CHECK "))


def test_selector_walk_equals_reference(checks):
    assert checks["walk_equal"] == [True, True]


def test_lookup_lane_equals_reference(checks):
    assert checks["lane_mismatches"] == 0
    assert checks["lanebook"] == [[1, 2, 3], True, False]  # -1 placeholders skipped; pruned


def test_block_assembly(checks):
    assert checks["assemble"] == [[5, 6, 7, 8, 9, 9, 9], [5, 6, 7, 7, 7], [5, 6, 7, 8]]
    full, qshape, q_matches, lane_tail, plain, device_same = checks["proposer_extend"]
    # request a: prompt 10..22, accepted 10 11, drafts 12 13 14 -> lookup copies 15..18
    assert full == [[12, 13, 14, 15, 16, 17, 18], [7, 7, 8, 8, 8, 8, 8]]
    assert qshape == [2, 7, 40] and q_matches
    assert lane_tail == [22, 10, 11]
    assert plain == [[12, 13, 14, 14, 14], [7, 7, 8, 8, 8]]
    # ONECARD_DFLASH_LANE=device (the default) picks the same tokens and q rows, two steps;
    # the CPU path's first step (after vLLM's bookkeeping) seeds without a double count, in the
    # device lane and in the host lane
    assert device_same == [True, True, True, True, True, True, True]


def test_proposer_walk_from_logits_equals_reference(checks):
    assert checks["proposer_sample"] is True


def test_vllm_model_forward_equals_reference(checks):
    """The patched model class, built and loaded by vLLM's code on CPU (block attention stand-in:
    no attention backend here), equals onecard.dflash.drafter.forward (empty context)."""
    name, rows, loaded, worst, prop, prefixed = checks["model_forward"]
    assert name == "DFlash2Qwen3Model" and rows == 8 and loaded
    assert prefixed   # a checkpoint stored under "model." loads the same parameters
    assert worst < 1e-4
    # DFlash2Proposer on the same config: 7 drafter rows, top-8, lookup on, k 15, keeps the
    # runner, parallel drafting, non-causal blocks
    assert prop == [7, 8, True, 15, "RUNNER", True, False]


def test_block_conv_equals_reference(checks):
    assert checks["conv_equal"] is True


def test_speculative_config_dflash2(checks):
    sc = checks["spec_config"]
    assert isinstance(sc, dict), sc
    # method, dflash2, k, parallel_drafting, use_dflash(), dflash2_lookup, causal
    assert sc["ok7"] == ["dflash", True, 7, True, True, False, False]
    assert sc["ok15"] == ["dflash", True, 15, True, True, True, False]
    errs = sc["errors"]
    assert "valid: 1..15" in errs["k16"]
    assert "dflash2_lookup_key_len=0; valid: 1..8" in errs["key_len"]
    assert "valid: 2..64" in errs["max_match"]
    assert "needs model=" in errs["no_model"]
    assert "dflash2_lookup needs method 'dflash2'" in errs["lookup_without_dflash2"]
    for msg in errs.values():
        assert "\n" not in msg and "valid" in msg
    # the launcher goldens (fast/long: k 7, lookup on; huge+dflash2 is refused by the launcher)
    # and the GPU job's d2k15 server
    assert sc["configs"][:-1] == [["dflash", True, 7, True, "greedy"]] * 2
    assert sc["configs"][-1] == ["dflash", True, 15, True, "probabilistic"]


def test_ring_mode(checks):
    """ONECARD_DFLASH_RING=1 (docs/dflash2-huge.md §3 (d)) in the patched vLLM on CPU: drafter
    layers with no KV-cache spec, the drafter's window and an unquantized cache dtype; the
    proposer's ring geometry, rings in FlashAttention's layout, the slot map, and vLLM's own
    set_inputs_first_pass reading the ring block table with the -1 context filter."""
    r = checks["ring_mode"]
    assert isinstance(r, dict), r
    # ONECARD_DFLASH_RING=0: the layers as before (the tiny drafter's top-level
    # use_sliding_window gives no window in 0.27.1, the target's cache dtype passes through)
    off_seen, off_names, off_use_swa = r["ring_off"]
    assert off_seen and all(w is None and dt == "fp8" for _, w, dt in off_seen)
    assert set(off_names) == {"Recorder"} and off_use_swa is False
    seen, names, specs, flags, target_dtype, use_swa, swa = r["model"]
    layers = len(seen)                       # the tiny drafter's 2 layers
    assert layers >= 2 and all(w == 64 and dt == "auto" for _, w, dt in seen)
    assert all(n.startswith("DFlash2Ring") for n in names)
    assert specs == [None] * layers and flags == [True] * layers
    assert target_dtype == "fp8" and use_swa is True and swa == 64
    # window 64, k 7, max_num_seqs 3 slots x 5 blocks (80 rows), + 1 spare; table width
    # cdiv(2048 + 7 + 2, 16) + 1
    assert r["geometry"] == [True, 64, 7, 3, 5, 80, 16, 130]
    assert r["validate_noop"] is True
    shape, bf16, nhd_contiguous, bound, separate, table = r["rings"]
    assert shape[0] == 16 and shape[2] == 16 and bf16 and nhd_contiguous and bound and separate
    assert table == [4, 130]                 # 3 slots + the spare row for padding rows
    assert r["rings_kept"] is True
    assert r["kv_first_clear"] == [1, True]   # a K/V-first layout clears along its block dim
    bt, same, cleared, owner, padded = r["slots"]
    assert bt == [[0, 1, 2, 3, 4, 0, 1], [5, 6, 7, 8, 9, 5, 6]] and same
    assert cleared == [True, True] and owner == {"a": 0, "b": 1}
    assert padded == bt + [[15] * 7]         # the padding row reads/writes the spare block
    # the drafter's attention group: FlashAttention over SlidingWindowSpec(16, window 64), the
    # first attention KV group's id (group 0 is a GDN/mamba group here), block size 16
    assert r["attn_backend"] == [1, ["l0", "l1"], "FLASH_ATTN", "SlidingWindowSpec", 16, 64,
                                 True, True, 1, 16, True]
    n, ring_table, target_table_kept, ctx_a, ctx_b, query, kept_b, seq_lens = r["first_pass"]
    assert n == 16 and ring_table and target_table_kept
    assert ctx_a and ctx_b and query
    assert kept_b == 72                      # the 150-row chunk keeps its last 80 - 8 rows
    assert seq_lens == [305 + 8, 150 + 8]


def test_draft_quant_fp8(checks):
    """dflash2_draft_quant="fp8_per_block" (the launcher's DRAFT_QUANT=fp8) in the patched vLLM
    on CPU, vLLM's FP8 GEMM replaced by a torch stand-in: vLLM's online FP8 method takes the
    drafter's fc, o_proj and MLP; qkv_proj (read directly by the context K/V precompute), the
    convs' kernel_projection and the selector's hidden_projection stay bf16; the loaded drafter's
    forward equals the reference over FP8-rounded weights, and is not the bf16 forward."""
    r = checks["draft_quant"]
    assert isinstance(r, dict), r
    errs = r["errors"]
    assert "dflash2_draft_quant='fp8_per_tensor'; valid: fp8_per_block, or unset" in errs["bad"]
    assert "dflash2_draft_quant needs method 'dflash2'" in errs["without_dflash2"]
    assert r["hash"] == [True, True]   # SpeculativeConfig.compute_hash tells the two drafters apart
    # vLLM's own loader (get_model) gives the same FP8 layers, and DFlash's K/V copy stays bf16
    assert r["loader"] == [True, "bfloat16"]
    q = r["fp8_per_block"]
    layers = sorted({n.split(".")[2] for n in q["fp8"] if n.startswith("model.layers.")})
    assert layers == ["0", "1"]
    want = ["model.fc"] + [f"model.layers.{i}.{m}" for i in layers
                           for m in ("mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj")]
    assert q["fp8"] == sorted(want)
    assert all(n.endswith(("qkv_proj", "kernel_projection", "hidden_projection")) for n in q["kept"])
    assert sum(n.endswith("qkv_proj") for n in q["kept"]) == len(layers)
    assert q["methods"] == ["Fp8PerBlockOnlineLinearMethod", "UnquantizedLinearMethod"]
    assert q["n_fp8_tensors"] == 1 + 4 * len(layers)   # fc + o, gate, up, down per layer
    assert q["worst_vs_fp8_ref"] < 1e-4
    assert q["worst_vs_bf16_ref"] > 1e-2
