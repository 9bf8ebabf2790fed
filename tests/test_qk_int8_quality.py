"""bench/qk_int8_quality.py: the teacher-forced quality study of the wide-verify kernel's
qk_int8, on a random tiny Llama (the CPU, no Triton)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "gpu" / "lib"))

pytest.importorskip("transformers")


def test_bf16_arm_is_the_models_own_attention():
    """The replaced attention in its bf16 arm gives the model's eager logits (the study measures
    quantization, not a different attention)."""
    import torch
    from transformers import AttentionInterface

    import qk_int8_quality as Q
    from kv_decode_probe import tiny_llama

    model = tiny_llama(torch.device("cpu"), torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.config._attn_implementation = "eager"
        for layer in model.model.layers:
            layer.self_attn.config._attn_implementation = "eager"
        want = model(input_ids=ids, use_cache=False).logits
        AttentionInterface.register("onecard_cache_attention_t", Q.CacheAttention())
        model.config._attn_implementation = "onecard_cache_attention_t"
        for layer in model.model.layers:
            layer.self_attn.config._attn_implementation = "onecard_cache_attention_t"
        got = model(input_ids=ids, use_cache=False).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), float((got - want).abs().max())


def test_query_rows_are_quantized_only_in_the_int8qk_arm():
    import torch

    import qk_int8_quality as Q

    att = Q.CacheAttention()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 6, 5, 64, generator=g)
    k = torch.randn(1, 2, 5, 64, generator=g)
    v = torch.randn(1, 2, 5, 64, generator=g)
    outs = {}
    for arm in Q.ARMS:
        att.arm = arm
        outs[arm] = att(None, q, k, v, None, 0.125)[0]
    assert torch.allclose(outs["sdpa"], outs["bf16"], atol=1e-5)  # float32 inputs: the same attention
    assert not torch.equal(outs["int8"], outs["int8qk"])  # the query's quantization shows
    assert (outs["int8"] - outs["bf16"]).abs().max() < 0.05  # int8 K/V: close to the plain values
    assert (outs["int8qk"] - outs["int8"]).abs().max() < 0.05
    # causal: the first position reads only its own value row
    att.arm = "bf16"
    first = att(None, q, k, v, None, 0.125)[0][0, 0]  # [Hq, D] of token 0
    assert torch.allclose(first, v[0, :, 0].repeat_interleave(3, 0), atol=1e-6)


def test_tiny_run_writes_every_arm_and_pair(tmp_path):
    import qk_int8_quality as Q

    assert Q.main(["--tiny", "--texts", "prose-00,code-00", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "qk_int8_quality.json").read_text())
    assert set(res["texts"]) == {"prose-00", "code-00"}
    s = res["summary"]
    assert set(s["ppl"]) == set(Q.ARMS)
    assert set(s["pairs"]) == {"int8 vs bf16", "int8qk vs bf16", "int4 vs bf16", "int8qk vs int8", "sdpa vs bf16"}
    for r in s["pairs"].values():
        assert r["tokens"] == 2 * 47 and 0 <= r["top1_differs"] <= 1
    # int4's error is the largest of the three
    assert s["pairs"]["int4 vs bf16"]["mean_abs_delta_logprob"] > s["pairs"]["int8 vs bf16"]["mean_abs_delta_logprob"]


@pytest.mark.parametrize("args, needle", [(["--arms", "int8,int8qk"], "that includes bf16"),
                                          (["--arms", "bf16,fp8"], "valid: a comma-separated subset"),
                                          (["--texts", "nope"], "valid: prose-00")])
def test_bad_arguments_name_the_valid_ones(tmp_path, capsys, args, needle):
    import qk_int8_quality as Q

    with pytest.raises(SystemExit) as e:
        Q.main(["--tiny", "--out", str(tmp_path), *args])
    assert e.value.code == 2 and needle in capsys.readouterr().err
