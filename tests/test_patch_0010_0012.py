"""Patches 0010-0012: a checkpoint requantized by onecard.prepare loads into vLLM's Qwen3.5 classes.

- The embedding gather-dequant kernel vLLM 0.27.1 uses for a pack-quantized embed_tokens
  (``compressed_tensors_embedding._dequant_gather_kernel``, run from its source under Triton's
  CPU interpreter) equals the torch reference of onecard.prepare.quant, int8 and int4, group 128.
- The draft-vocabulary file parser of patch 0012 (taken from the patched file): accepted
  files, and one clear error per bad input.
- The tiny Qwen3.5 model requantized by onecard.prepare (int8 lm_head / embed_tokens / MTP) plus
  its draft vocabulary: in a child process the patched classes are built on the CPU and every
  checkpoint tensor loads (tests/prepare/vllm_cpu_load.py); the drafter's draft head holds
  exactly lm_head's rows of the draft ids and scores them like the full head; with
  ONECARD_DRAFT_VOCAB=0 there is no draft head and the drafter scores like the target.
  What this cannot show (no GPU): the Marlin kernels on these layers, CUDA graphs/compile, the
  proposer end to end: gpu/jobs/21-requant.sh.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.interpret import child_rerun, enable, inproc_mark

_PREIMPORTED = enable()  # before the first `import triton` (tests/interpret.py)

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parent.parent
EMBED_SRC = "model_executor/layers/quantization/compressed_tensors/compressed_tensors_embedding.py"
MTP_SRC = "model_executor/models/qwen3_5_mtp.py"

inproc = inproc_mark(_PREIMPORTED)
# Attention's KV-cache scales (compressed-tensors creates them, defaults; no checkpoint tensor)
KV_SCALES = re.compile(r"\.attn\.[qkv]_(scale|zero_point)$")


def unloaded(params, loaded_names) -> set[str]:
    return {n for n in set(params) - set(loaded_names) if not KV_SCALES.search(n)}
test_in_child_process = child_rerun(__file__, _PREIMPORTED)


# ------------------------------------------------------------------ the gather-dequant kernel

def _functions_from(path: Path, names: set[str], namespace: dict) -> dict:
    """Exec the named top-level functions of a source file in ``namespace`` (decorators kept)."""
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in body} == names, f"{path}: missing {names - {n.name for n in body}}"
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def gather(vllm_dir):
    pytest.importorskip("triton")
    import triton
    import triton.language as tl

    ns = _functions_from(vllm_dir / EMBED_SRC, {"_dequant_gather_kernel", "_dequant_gather_triton"},
                         {"triton": triton, "tl": tl, "torch": torch})
    return ns["_dequant_gather_triton"]


@inproc
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("hidden", [256, 384])
def test_embedding_gather_dequant_equals_torch_reference(gather, bits, hidden):
    from onecard.prepare import quant

    g = torch.Generator().manual_seed(bits * 1000 + hidden)
    vocab = 301
    w = torch.randn(vocab, hidden, generator=g) * 0.05
    t, _err = quant.quantize_tensor(w, bits=bits)
    packed, scale = t["weight_packed"], t["weight_scale"]
    ids = torch.tensor([0, 300, 7, 7, 150, 299, 1], dtype=torch.long)
    ref = quant.dequantize(packed, scale, bits, (vocab, hidden))[ids]  # float32
    # float32 scales: the kernel's q * scale is exactly the reference
    out32 = gather(ids, packed, scale.float(), hidden, bits)
    assert out32.dtype == torch.float32 and out32.shape == (len(ids), hidden)
    assert torch.equal(out32, ref)
    # bf16 scales (the checkpoint's): output in bf16, within one bf16 rounding of the reference
    # (the CPU interpreter's float32 -> bf16 cast may truncate where the GPU rounds to nearest)
    out = gather(ids, packed, scale, hidden, bits)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).abs() <= ref.abs() * 2.0 ** -7 + 1e-30).all()
    # and the dequantized rows are the rows of the weight within the quantization error
    assert quant.relative_error(w[ids], out32) < quant.DEFAULT_MAX_REL_ERROR[bits]


# ------------------------------------------------------------------ draft vocabulary file

@pytest.fixture(scope="module")
def draft_ids_fn(patched_site):
    src = patched_site / "vllm" / MTP_SRC
    tree = ast.parse(src.read_text())
    keep = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name == "onecard_draft_vocab_ids")
            or (isinstance(n, ast.Assign) and any(getattr(t, "id", "").startswith("DRAFT_VOCAB") for t in n.targets))]
    ns: dict = {"json": json, "os": os, "Path": Path}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(src), "exec"), ns)
    return ns["onecard_draft_vocab_ids"]


def test_draft_vocab_file_is_used_when_present(draft_ids_fn, tmp_path):
    assert draft_ids_fn(str(tmp_path), 100, env="") is None  # no file, env unset: full head
    (tmp_path / "draft_vocab.json").write_text(json.dumps({"ids": [5, 1, 99], "size": 3}))
    assert draft_ids_fn(str(tmp_path), 100, env="") == ([1, 5, 99], str(tmp_path / "draft_vocab.json"))
    assert draft_ids_fn(str(tmp_path), 100, env="1")[0] == [1, 5, 99]
    assert draft_ids_fn(str(tmp_path), 100, env="0") is None
    other = tmp_path / "other.json"
    other.write_text("[3, 4]")
    assert draft_ids_fn(str(tmp_path), 100, env=str(other)) == ([3, 4], str(other))


@pytest.mark.parametrize("content", ['{"ids": [1, 1]}', '{"ids": [100]}', '{"ids": [-1]}', '{"ids": []}',
                                     '{"ids": [1.5]}', '{"id": [1]}', "not json", '{"ids": [true]}'])
def test_draft_vocab_bad_file_is_one_clear_error(draft_ids_fn, tmp_path, content):
    (tmp_path / "draft_vocab.json").write_text(content)
    with pytest.raises(ValueError, match=r"not a draft vocabulary; valid: JSON .* distinct token ids in \[0, 100\)"):
        draft_ids_fn(str(tmp_path), 100, env="")


def test_draft_vocab_env_names_a_missing_file(draft_ids_fn, tmp_path):
    with pytest.raises(ValueError, match="ONECARD_DRAFT_VOCAB=1: no draft vocabulary file .* valid: 0"):
        draft_ids_fn(str(tmp_path), 100, env="1")
    with pytest.raises(ValueError, match="valid: 0 \\(off\\)"):
        draft_ids_fn(str(tmp_path), 100, env=str(tmp_path / "nope.json"))


# ------------------------------------------------------------------ the requantized tiny model loads

@pytest.fixture(scope="module")
def requantized_tiny(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from onecard.prepare import draft_vocab, requant
    from onecard.prepare.tiny import build_tiny_model

    d = build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen35-tiny-rq")
    for target in ("lm_head", "embed", "mtp"):
        requant.requantize(d, target, bits=8, log=lambda *a: None)
    assert requant.validate(d) == []
    res = draft_vocab.build(d, draft_vocab.builtin_corpus()[:50], size=1000)
    draft_vocab.write(res, d / "draft_vocab.json")
    return d


@pytest.fixture(scope="module")
def loaded(patched_site, requantized_tiny, tmp_path_factory):
    pytest.importorskip("vllm")
    sys.path.insert(0, str(REPO / "tests" / "prepare"))
    import vllm_cpu_load

    work = tmp_path_factory.mktemp("vllm-cpu")
    stub = vllm_cpu_load.write_sitecustomize(work / "stub")
    out = work / "out.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([stub, str(patched_site), str(REPO)]),
           "PROBE_PORT": str(29500 + os.getpid() % 400), "TRITON_INTERPRET": "0"}
    env.pop("ONECARD_DRAFT_VOCAB", None)
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "prepare" / "vllm_cpu_load.py"),
                           str(requantized_tiny), str(out)], env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-6000:]
    return json.loads(out.read_text())


def test_every_target_tensor_loads_and_embed_is_quantized(loaded):
    assert loaded["quant_config"] == "CompressedTensorsConfig"
    assert loaded["target_embed_method"] == "CompressedTensorsEmbeddingWNA16Int"
    assert loaded["target_embed_equal"] is True
    p = loaded["target_params"]
    for name in ("language_model.model.embed_tokens", "language_model.lm_head"):
        assert p[f"{name}.weight_packed"][1] == "int32" and f"{name}.weight" not in p
    # every parameter of the language model was loaded from the checkpoint
    assert unloaded(p, loaded["target_loaded"]) == set()
    # (every checkpoint tensor mapped to a parameter: AutoWeightsLoader raises on any other name)
    assert any(n.endswith("embed_tokens.weight_packed") for n in loaded["checkpoint"])


def test_mtp_drafter_loads_quantized_layers(loaded):
    d = loaded["draft"]["unset"]
    assert d["embed_method"] == "CompressedTensorsEmbeddingWNA16Int"
    p = d["params"]
    for name in ("model.fc", "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
                 "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj", "model.embed_tokens",
                 "lm_head"):
        assert p[f"{name}.weight_packed"][1] == "int32", name
        assert f"{name}.weight" not in p, name
    assert unloaded(p, d["loaded"]) == set()
    mtp_ckpt = [n for n in loaded["checkpoint"] if n.startswith("mtp.")]
    assert all(n.replace("mtp.", "model.", 1) in d["loaded"] for n in mtp_ckpt if "_proj." not in n)


def test_draft_head_holds_lm_head_rows_and_scores_like_it(loaded):
    d = loaded["draft"]["unset"]
    assert d["draft_vocab"].endswith("draft_vocab.json")
    p = d["params"]
    assert p["draft_lm_head.weight_packed"] == [[1024, 64], "int32"]  # 1000 ids, padded to 64
    assert d["rows_equal_weight_packed"] and d["rows_equal_weight_scale"]
    assert d["logits_shape"][1] == 4096
    assert d["outside_all_neg_inf"]
    assert d["inside_max_abs_diff"] <= 0.02  # same rows, bf16 logits (one rounding step apart at most)
    assert d["top_equal_argmax"]


def test_draft_vocab_off_scores_with_the_full_head(loaded):
    d = loaded["draft"]["0"]
    assert d["draft_vocab"] is None
    assert not any(n.startswith("draft_lm_head") for n in d["params"])
    assert d["logits_max_abs_diff_vs_target"] == 0.0
