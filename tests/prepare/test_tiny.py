"""The tiny Qwen3.5 checkpoint: layout vLLM / transformers expect, determinism, CLI."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from onecard.prepare import tiny

SMALL = tiny.TinySpec(layers=4, hidden=64, intermediate=128, heads=2, kv_heads=1, head_dim=64,
                      linear_key_heads=1, linear_value_heads=3, linear_head_dim=32, vocab=600)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    return tiny.build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", SMALL)


@pytest.fixture(scope="module")
def default_model(tmp_path_factory) -> Path:
    return tiny.ensure_tiny_model(tmp_path_factory.mktemp("models"))


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_same_bytes_twice(small_model, tmp_path):
    again = tiny.build_tiny_model(tmp_path / "again", SMALL)
    assert _files(small_model) == _files(again)


def test_seed_changes_weights_only(small_model, tmp_path):
    from dataclasses import replace

    other = tiny.build_tiny_model(tmp_path / "seed1", replace(SMALL, seed=1))
    a, b = _files(small_model), _files(other)
    assert a["tokenizer.json"] == b["tokenizer.json"]
    assert a["model.safetensors"] != b["model.safetensors"]


def test_layer_pattern_and_config(small_model):
    cfg = json.loads((small_model / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert cfg["model_type"] == "qwen3_5"
    tc = cfg["text_config"]
    assert tc["model_type"] == "qwen3_5_text"
    assert tc["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert tc["mtp_num_hidden_layers"] == 1
    assert tc["vocab_size"] % 128 == 0 and tc["vocab_size"] >= SMALL.vocab
    assert sum(tc["rope_parameters"]["mrope_section"]) == SMALL.head_dim // 8


def test_default_spec_is_real_shaped():
    spec = tiny.DEFAULT_SPEC
    assert spec.layer_types == ["linear_attention"] * 3 + ["full_attention"] + \
        ["linear_attention"] * 3 + ["full_attention"]
    assert spec.head_dim in (128, 256) and spec.linear_head_dim == 128
    assert spec.linear_value_heads == 3 * spec.linear_key_heads   # 48 / 16 in the real model
    cfg = tiny.make_config(spec, {t: i for i, t in enumerate(
        tiny.SPECIAL_TOKENS + tiny.PLAIN_ADDED_TOKENS + tiny.VISION_TOKENS)})
    assert cfg["text_config"]["rope_parameters"]["mrope_section"] == [11, 11, 10]  # as the real one


def test_transformers_config_classes(small_model):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(small_model)
    assert type(cfg).__name__ == "Qwen3_5Config"
    assert cfg.text_config.layer_types[3] == "full_attention"
    assert cfg.text_config.linear_num_value_heads == SMALL.linear_value_heads


def test_vllm_config_class(small_model):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.qwen3_5 import Qwen3_5Config

    raw = json.loads((small_model / "config.json").read_text())
    cfg = Qwen3_5Config(**raw)
    tc = cfg.text_config
    assert tc.layer_types == SMALL.layer_types
    assert (tc.hidden_size, tc.head_dim, tc.num_attention_heads, tc.num_key_value_heads) == (
        SMALL.hidden, SMALL.head_dim, SMALL.heads, SMALL.kv_heads)
    assert tc.mtp_num_hidden_layers == 1   # read by vLLM's SpeculativeConfig for method mtp


def test_safetensors_names_and_shapes(small_model):
    from safetensors import safe_open

    expected = tiny.tensor_shapes(SMALL)
    with safe_open(str(small_model / "model.safetensors"), "pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert got == expected
    assert dtypes == {"BF16"}
    lm = "model.language_model"
    kd, vd = SMALL.linear_key_heads * SMALL.linear_head_dim, SMALL.linear_value_heads * SMALL.linear_head_dim
    # vLLM: conv1d is ColumnParallelLinear(kernel -> 2*key_dim + value_dim) unsqueezed to 3-D.
    assert got[f"{lm}.layers.0.linear_attn.conv1d.weight"] == (2 * kd + vd, 1, SMALL.conv_kernel)
    # vLLM: qkv_proj has total_num_heads * (1 + attn_output_gate) query heads.
    assert got[f"{lm}.layers.3.self_attn.q_proj.weight"] == (2 * SMALL.heads * SMALL.head_dim, SMALL.hidden)
    # vLLM Qwen3_5MultiTokenPredictor: fc (2h -> h), three norms and full-attention layers.
    mtp = {k for k in got if k.startswith("mtp.")}
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.pre_fc_norm_embedding.weight"} <= mtp
    assert got["mtp.fc.weight"] == (SMALL.hidden, 2 * SMALL.hidden)
    assert all(not k.startswith("mtp.layers.") or k.startswith("mtp.layers.0.") for k in mtp)


def test_names_match_vllm_source(vllm_dir):
    """The HF-side names we write are the ones vLLM 0.27.1's Qwen3.5 loaders map from."""
    src = (vllm_dir / "model_executor/models/qwen3_5.py").read_text()
    mtp_src = (vllm_dir / "model_executor/models/qwen3_5_mtp.py").read_text()
    vl_src = (vllm_dir / "model_executor/models/qwen3_vl.py").read_text()
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "linear_attention",
                 "full_attention", '"mtp."'):
        assert name in src, name
    for name in ("pre_fc_norm_hidden", "pre_fc_norm_embedding", "self.fc", 'name.replace("mtp.", "model.")'):
        assert name in mtp_src, name
    for prefix in ('"model.language_model."', '"lm_head."', '"model.visual."'):
        assert prefix in vl_src, prefix
    names = tiny.tensor_shapes(tiny.DEFAULT_SPEC)
    assert all(re.match(r"^(model\.language_model\.|model\.visual\.|lm_head\.|mtp\.)", n) for n in names)


def test_transformers_loads_every_weight_and_generates_varied(default_model):
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(
        default_model, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], sorted(info["missing_keys"])[:5]
    assert not info["mismatched_keys"]
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"])   # HF has no MTP module
    tok = AutoTokenizer.from_pretrained(default_model)
    text = tok.apply_chat_template([{"role": "user", "content": "What is Python?"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    assert len(set(out)) >= 8, out   # greedy is varied, not one token repeated


def test_tokenizer_special_tokens_and_template(small_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(small_model)
    assert len(tok) == SMALL.vocab
    for t in tiny.SPECIAL_TOKENS + tiny.PLAIN_ADDED_TOKENS:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1, (t, ids)
    assert tok.eos_token == "<|im_end|>"
    # byte-level: any text round-trips
    s = "déjà vu 123 — λx: x**2\n\ttab"
    assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "use the tool",
             "tool_calls": [{"type": "function",
                             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny"}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert "<tools>\n{" in text
    assert "<think>\nuse the tool\n</think>" in text
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" \
           "</function>\n</tool_call><|im_end|>" in text
    assert "<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                    add_generation_prompt=True)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_qwen3_coder_parser_reads_template_format(small_model):
    """What the template teaches is what vLLM's qwen3_coder parser extracts."""
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    tok = AutoTokenizer.from_pretrained(small_model)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    req = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "x"}], tools=tools)
    parser = ToolParserManager.get_tool_parser("qwen3_coder")(tok, tools=req.tools)
    out = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
           "</function>\n</tool_call>")
    info = parser.extract_tool_calls(out, request=req)
    assert info.tools_called
    assert info.tool_calls[0].function.name == "get_weather"
    assert json.loads(info.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_bad_spec_is_one_clear_error():
    with pytest.raises(ValueError, match="head_dim 40 invalid"):
        tiny.TinySpec(head_dim=40).validate()
    with pytest.raises(ValueError, match="multiple of full_attention_interval"):
        tiny.TinySpec(layers=6).validate()


def test_ensure_is_cached_and_root_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("MODELS", str(tmp_path / "m"))
    monkeypatch.delenv("ONECARD_HOME", raising=False)
    assert tiny.models_root() == tmp_path / "m"
    monkeypatch.delenv("MODELS")
    monkeypatch.setenv("ONECARD_HOME", str(tmp_path / "h"))
    assert tiny.models_root() == tmp_path / "h" / "models"
    monkeypatch.delenv("ONECARD_HOME")
    assert tiny.models_root() == Path(tiny.__file__).resolve().parents[2] / "models"
    assert tiny.tiny_model_dir(tmp_path) == tmp_path / "qwen35-tiny"
    assert tiny.tiny_model_dir(tmp_path, SMALL).name == f"qwen35-tiny-{SMALL.key()}"
    p = tiny.ensure_tiny_model(tmp_path, SMALL)
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    assert tiny.ensure_tiny_model(tmp_path, SMALL) == p
    assert (p / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [q for q in tmp_path.iterdir() if q.name.startswith(".")]   # no temp dirs left


def test_cli_and_script(tmp_path, capsys):
    from onecard.cli import main

    args = ["prepare", "tiny", "--out", str(tmp_path / "c"), "--layers", "4", "--hidden", "64",
            "--intermediate", "128", "--heads", "2", "--kv-heads", "1", "--head-dim", "64",
            "--linear-key-heads", "1", "--linear-value-heads", "3", "--linear-head-dim", "32",
            "--vocab", "600"]
    assert main(args) == 0
    assert (tmp_path / "c" / "model.safetensors").is_file()
    assert "tiny model:" in capsys.readouterr().out
    assert main(["prepare", "tiny", "--out", str(tmp_path / "d"), "--head-dim", "40"]) == 2
    assert "head_dim 40 invalid" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_ensure_rebuilds_a_stale_build(tmp_path, monkeypatch):
    """A cached tiny model built by another version of the builder is rebuilt, not reused
    (seen on the H200: a model cached before a builder change was served by later jobs)."""
    from onecard.prepare import tiny

    path = tiny.ensure_tiny_model(tmp_path)
    assert (path / tiny.STAMP).read_text().strip() == tiny.build_fingerprint(tiny.DEFAULT_SPEC)
    assert tiny.ensure_tiny_model(tmp_path) == path  # current: reused
    (path / tiny.STAMP).write_text("0000000000000000\n")
    (path / "config.json").write_text("{}")
    tiny.ensure_tiny_model(tmp_path)
    assert (path / "config.json").read_text() != "{}"
