"""scripts/kvarn_fakequant_ppl.py --served-json arithmetic: served logprob i = token i + 1 of the
CPU tokenization, per-row / pooled perplexities and deltas, the "not comparable" rows. A tiny
fabricated kv_quality JSON, a fake tokenizer and scorer: no model, no torch, no git."""

from __future__ import annotations

import importlib.util
import math

import pytest

from tests.conftest import REPO
_spec = importlib.util.spec_from_file_location("kvarn_fakequant_ppl_served",
                                               REPO / "scripts" / "kvarn_fakequant_ppl.py")
F = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(F)

TEXTS = [("a", "w x y z"), ("b", "p q r s t u"), ("c", "m n o")]
NONE = {"a": [-1.0, -2.0, -3.0], "b": [-0.5] * 5}
FQ = {"a": [-1.5, -2.0, -3.0], "b": [-0.5, -0.5, -0.5, -1.0, -1.0]}


def tokenize(text):
    return text.split()  # one token a word; the first token gets no served logprob


def score(ids, cfg):
    key = {4: "a", 6: "b"}[len(ids)]
    return list((NONE if cfg == "none" else FQ)[key])


def fabricated():
    return {"kind": "kv_quality", "label": "kvarn", "rows": [
        {"id": "a", "method": "echo+logprobs", "logprobs": [-1.25, -2.0, -2.5]},
        {"id": "b", "method": "echo+logprobs", "logprobs": [-0.5, -0.5, -0.5, -0.75, -1.0]},
        {"id": "c", "method": "echo+logprobs", "logprobs": [-1.0, -1.0, -1.0]},  # 3 vs 2
        {"id": "d", "error": "ReadTimeout: boom"},
    ]}


def run(clean=3):
    return F.compare_served(fabricated(), TEXTS, tokenize, score, "kvarn_k4v2_g128+selffp16",
                            clean, log=lambda *a, **k: None)


def test_row_alignment_and_ppl():
    res = run()
    a = res["rows"][0]
    assert a["status"] == "ok" and a["tokens"] == 4 and a["scored"] == 3
    assert a["ppl_served"] == pytest.approx(math.exp(5.75 / 3))
    assert a["ppl_cpu_none"] == pytest.approx(math.exp(2.0))
    assert a["ppl_cpu_fq"] == pytest.approx(math.exp(6.5 / 3))
    assert a["served_vs_none_pct"] == pytest.approx(100 * (math.exp(-0.25 / 3) - 1))
    assert a["fq_vs_none_pct"] == pytest.approx(100 * (math.exp(0.5 / 3) - 1))
    assert a["mean_abs_served_fq"] == pytest.approx((0.25 + 0 + 0.5) / 3)
    assert a["mean_abs_served_none"] == pytest.approx((0.25 + 0 + 0.5) / 3)
    assert a["first_logprob"] == {"served": -1.25, "cpu_none": -1.0}
    # clean = 3: positions 1, 2 read no quantized tile -> the first 2 scored tokens
    assert a["clean_scored"] == 2
    assert a["clean_served_vs_none_pct"] == pytest.approx(100 * (math.exp(0.25 / 2) - 1))
    assert a["rest_mean_abs_served_fq"] == pytest.approx(0.5)
    assert a["rest_mean_abs_fq_none"] == pytest.approx(0.0)


def test_not_comparable_rows_are_not_guessed():
    rows = {r["id"]: r for r in run()["rows"]}
    assert rows["c"]["status"] == "not comparable (3 vs 2 tokens: served logprobs vs CPU tokens after the first)"
    assert rows["d"]["status"].startswith("not comparable (served error")
    fake = fabricated()
    fake["rows"].append({"id": "zz", "logprobs": [-1.0]})
    res = F.compare_served(fake, TEXTS, tokenize, score, "none", 3, log=lambda *a, **k: None)
    assert res["rows"][-1]["status"] == "not comparable (no rebuilt text of this id)"


def test_pooled_token_weighted_and_calibration():
    res = run(clean=100)  # every position clean: all ok rows are calibration rows
    s = -(5.75 + 3.25)
    n = -(6.0 + 2.5)
    f = -(6.5 + 3.5)
    al = res["all"]
    assert al["scored"] == 8
    assert al["ppl_served"] == pytest.approx(math.exp(-s / 8))
    assert al["served_vs_none_pct"] == pytest.approx(100 * (math.exp((n - s) / 8) - 1))
    assert al["fq_vs_none_pct"] == pytest.approx(100 * (math.exp((n - f) / 8) - 1))
    assert al["mean_abs_served_fq"] == pytest.approx((0.75 + 0.25) / 8)
    assert res["calibration"]["scored"] == 8
    assert run(clean=3)["calibration"] is None  # a and b both read a quantized tile past 2
    lines = F.format_served(res, ["hdr"])
    assert lines[0] == "hdr" and lines[-3].startswith("| d | - | not comparable")
    assert lines[-2].startswith("| all (token-weighted) | 8 scored |")
    assert lines[-1].startswith("calibration, rows that read no quantized tile (a, b;")
    doc = F.format_served(run(clean=3), [])[-2:]  # a, b: positions past 2 read quantized tiles
    assert [x.split(" positions")[0] for x in doc] == ["calibration, a", "calibration, b"]


def test_served_row_rejects_misaligned_lists():
    with pytest.raises(ValueError):
        F.served_row("x", 4, [-1.0] * 4, [-1.0] * 3, [-1.0] * 3, 0)


def test_clean_positions():
    assert F.clean_positions(F.Quant("kvarn_k4v2_g128", self_tile="fp16")) == 256
    assert F.clean_positions(F.Quant("kvarn_k4v2_g128")) == 128
    assert F.clean_positions(F.Quant("kvarn_k4v2_g128", self_tile="fp16", window=3, sinks=2)) == 640
    assert F.clean_positions(F.Quant("int8")) == 0
