#!/usr/bin/env python3
"""KV-cache fake quantization on CPU: teacher-forced NLL by token segment and a needle test.

Loads a Llama-architecture checkpoint (transformers, float32, eager attention) and replaces
its attention function by one that attends to K/V the way a quantized cache represents them:

  none        K/V unchanged (float32)
  kvarn_*     KVarN (onecard.kvarn.reference: rotate -> normalize -> quantize -> dequant) per
              layer and kv head with the serving semantics of the vLLM backend: tiles
              [1, L // tile) quantized (a query attends to the dequantized K/V of every completed
              tile, its own included, as the prefill path and later decode steps read them);
              tile 0 (sink) and the incomplete last tile fp16 (rotated rows, like the stage)
  int8, int4  vLLM's int8/int4_per_token_head arithmetic on every token (no fp16 tiles):
              int8 symmetric absmax; int4 Hadamard-rotated asymmetric (see _fake_int)

``--only k`` / ``--only v`` quantizes one of K/V (the other stays fp16 rotated rows).
``+selffp16`` lets a query read its own tile in fp16 (what a decoded token sees: its
tile is the partial one) instead of quantized: the serving read rule since b2da41d.
What-if read rules (not in the kernels): ``+winW`` = a recent fp16 window, the query's own tile
and the W-1 completed tiles before it fp16 (``+win1`` = ``+selffp16``); ``+sinkS`` = the first
S tiles fp16 (S = 1 is the format's sink). ``--window-cost`` prints what they would cost on the
27B (bytes per sequence, the CTX=huge pool; onecard.memory).

  kvarn_fakequant_ppl.py --model /tmp/smollm2-135m --configs none,kvarn_k4v2_g128,int8 --needle
Texts: the two repo documents of gpu/jobs/32-kv-quality.py (README.md, docs/wide-verify.md,
6,000 chars each); --text PATH adds others. Prints one table row per (text, config) and the
needle answers; --json writes all numbers.

  kvarn_fakequant_ppl.py --model /tmp/smollm2-135m --served-json kvq-kvarn.json --json out.json
``--served-json``: a served kv_quality JSON (gpu/jobs/32-kv-quality.py measure, e.g. the GPU's
kvarn arm) against CPU none and ``--served-config`` on the very tokens it scored (texts rebuilt
by the job at the JSON's commit; served logprob i = token i+1), one row per text.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SEGMENTS = ((0, 128), (128, 256), (256, 512), (512, 1024), (1024, None))
DOCS = ("README.md", "docs/wide-verify.md")
DOC_CHARS = 6000
SECRET = "PELICAN-7"


class Quant:
    """What the attention hook applies (set per run)."""

    def __init__(self, name: str, only: str | None = None, self_tile: str = "quant",
                 window: int = 1, sinks: int = 1):
        self.name, self.only, self.self_tile = name, only, self_tile
        self.window, self.sinks = window, sinks  # fp16 tiles: recent window (self_tile fp16), sinks


STATE = {"q": Quant("none")}


def _fake_kvarn(k, v, q: Quant):
    """k, v [L, H, D] float32 model space -> (k_fp16path, v_fp16path, k_q, v_q):
    the fp16-stage version of every row and the version the cache serves (quantized tiles
    [q.sinks, L // tile) dequantized, others fp16)."""
    import torch
    from onecard.kvarn import reference as R
    p = preset_of(q.name)
    T = p.tile
    L = k.shape[0]
    hn = R.hadamard(k.shape[-1], torch.float32)
    kr = (k.float() @ hn).half()  # the backend: fp32 matmul, stored fp16
    vr = (v.float() @ hn).half()
    kq, vq = kr.float().clone(), vr.float().clone()
    for t in range(q.sinks, L // T):
        sl = slice(t * T, (t + 1) * T)
        qt = R.quantize_tile(kr[sl], vr[sl], p)
        dk, dv = R.dequant_tile(qt, torch.float32)
        if q.only in (None, "k"):
            kq[sl] = dk.half().float()  # the prefill path dequantizes into fp16 rows
        if q.only in (None, "v"):
            vq[sl] = dv.half().float()
    return (kr.float() @ hn, vr.float() @ hn, kq @ hn, vq @ hn)


def fp16_window_mask(lq: int, lk: int, tile: int, window: int = 1):
    """[lq, lk] bool: key j is read from the fp16 rows by query i (the last lq of lk
    positions) because its tile is the query's own or one of the window-1 tiles before it.
    window 1 = the serving rule's own tile. Causality is the attention mask's business."""
    import torch
    qt = (torch.arange(lk - lq, lk) // tile)[:, None]
    kt = (torch.arange(lk) // tile)[None, :]
    return (kt <= qt) & (kt > qt - window)  # window 1: kt == qt, the +selffp16 mask


def fp16_window_cost(window: int, sinks: int, preset: str = "kvarn_k4v2_g128",
                     max_seqs: int | None = None, max_len: int | None = None,
                     num_spec: int | None = None, prefix_cache: bool = True,
                     attn_layers: int = 16, pool_layers: int | None = None, geom=None,
                     kv_mem: int | None = None, goal: int = 268_169) -> dict:
    """What keeping (window - 1) + (sinks - 1) more tiles per sequence in fp16 costs on the
    27B (onecard.memory.QWEN38_27B: 4 kv heads x 256) at CTX=huge (LONG_KV_MEM pin, 245,760,
    MAX_SEQS 2, MTP k=3, prefix caching). A tile's fp16 copy is one stage slot
    (memory.kvarn_stage_bytes per layer and slot), held beside its packed block.
    extra_bytes_per_seq: over ``attn_layers`` (16); the pool figures take ``pool_layers``
    (default 16 + the MTP layer, which the stage covers too) x max_seqs out of the pin:
    pool_tokens (memory.predict_pool) vs the goal. Pin unchanged instead: pool unchanged, the
    same bytes outside the pin (extra_outside_pin), on top of memory.vram_budget's terms for the
    prepared 27B with SPEC=mtp (card_total_pin_kept, card_fits_pin_kept; 24 GiB card)."""
    from onecard import memory as M
    from onecard.kvarn.stage import default_num_slots
    from onecard.profiles import CTX_PROFILES, SPEC_PROFILES

    if window < 1 or sinks < 1:
        raise ValueError(f"window {window} / sinks {sinks} is not valid; valid: >= 1")
    huge = CTX_PROFILES["huge"]   # unset arguments: the CTX=huge SPEC=mtp launch
    max_seqs = huge.max_seqs if max_seqs is None else max_seqs
    max_len = huge.max_len if max_len is None else max_len
    num_spec = SPEC_PROFILES["mtp"].k_default["huge"] if num_spec is None else num_spec
    kv_mem = huge.kv_mem if kv_mem is None else kv_mem
    geom = geom or M.QWEN38_27B
    pool_layers = geom.num_full_attention + geom.mtp_layers if pool_layers is None else pool_layers
    # costs over the window-1, one-sink stage (the base these what-ifs were measured against;
    # pinned: the server's default became window 3 + two sinks in session 17)
    slot = M.kvarn_stage_bytes(geom, preset, 1, attn_layers=1, window=1, sinks=1) // default_num_slots(1, 1, 1)
    tiles = (window - 1) + (sinks - 1)
    per_seq = tiles * slot * attn_layers
    outside = tiles * slot * pool_layers * max_seqs
    base = M.predict_pool(geom, kv_mem, preset, max_len, num_spec, prefix_cache).pool_tokens
    pool = M.predict_pool(geom, kv_mem - outside, preset, max_len, num_spec, prefix_cache).pool_tokens
    weights, _ = M.target_weight_bytes(None, "mtp", geom)  # the prepared 27B layout, SPEC=mtp
    stage = M.kvarn_reserve_bytes(geom, preset, max_seqs, window=1, sinks=1)
    card = M.vram_budget(kv_mem, weights or 0, kvarn_stage=stage + outside)
    return {"window": window, "sinks": sinks, "extra_tiles_per_seq": tiles,
            "slot_bytes_per_layer": slot, "extra_bytes_per_seq": per_seq,
            "extra_outside_pin": outside, "pool_tokens_base": base, "pool_tokens": pool,
            "goal": goal, "meets_goal": pool >= goal,
            "card_total_pin_kept": card["total"], "card_fits_pin_kept": card["fits"]}


def preset_of(name: str):
    """kvarn_<preset> of onecard.kvarn.format, or any kvarn_k{2,4,8}v{2,4,8}_g<tile> (what-if
    bit budgets with the same algorithm)."""
    import re
    from onecard.kvarn.format import PRESETS, Preset
    short = name[len("kvarn_"):]
    if short in PRESETS:
        return PRESETS[short]
    m = re.fullmatch(r"k(\d)v(\d)_g(\d+)", short)
    if not m:
        raise ValueError(f"config {name!r} is not valid; valid: kvarn_kKvV_gTILE")
    return Preset(short, int(m[1]), int(m[2]), int(m[3]))


def _fake_int(x, bits: int):
    """vLLM 0.27.1's per-token-head modes: int8 = symmetric absmax / 127; int4 = Hadamard
    rotation (vLLM also flips signs first: omitted), asymmetric min/max over the head, an
    integer zero point, 15 levels, un-rotated after dequantization."""
    import torch
    if bits == 8:
        s = x.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
        return torch.clamp(torch.round(x / s), -128, 127) * s
    from onecard.kvarn import reference as R
    hn = R.hadamard(x.shape[-1], torch.float32)
    r = x.float() @ hn
    lo, hi = r.amin(-1, keepdim=True), r.amax(-1, keepdim=True)
    s = ((hi - lo) / 15).clamp_min(1e-6)
    zp = torch.clamp(torch.round(-lo / s), 0, 15)
    return ((torch.clamp(torch.round(r / s + zp), 0, 15) - zp) * s @ hn).to(x.dtype)


def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    """Drop-in for transformers' eager_attention_forward (query [B, Hq, Lq, D], key/value
    [B, Hkv, Lk, D], additive float mask)."""
    import torch
    from transformers.models.llama.modeling_llama import repeat_kv

    q = STATE["q"]
    B, hkv, Lk, D = key.shape
    Lq = query.shape[2]
    same = None
    if q.name.startswith("kvarn"):
        ks_f, vs_f, ks_q, vs_q = [], [], [], []
        for b in range(B):
            kf, vf, kq, vq = _fake_kvarn(key[b].transpose(0, 1), value[b].transpose(0, 1), q)
            ks_f.append(kf.transpose(0, 1))
            vs_f.append(vf.transpose(0, 1))
            ks_q.append(kq.transpose(0, 1))
            vs_q.append(vq.transpose(0, 1))
        k_f, v_f = torch.stack(ks_f).to(query.dtype), torch.stack(vs_f).to(query.dtype)
        key, value = torch.stack(ks_q).to(query.dtype), torch.stack(vs_q).to(query.dtype)
        if q.self_tile == "fp16":  # own tile (and window - 1 tiles before it) fp16, [Lq, Lk]
            same = fp16_window_mask(Lq, Lk, preset_of(q.name).tile, q.window)
    elif q.name in ("int8", "int4"):
        bits = 8 if q.name == "int8" else 4
        if q.only in (None, "k"):
            key = _fake_int(key, bits)
        if q.only in (None, "v"):
            value = _fake_int(value, bits)
    elif q.name != "none":
        raise ValueError(f"config {q.name!r} is not valid")
    g = module.num_key_value_groups
    s = torch.matmul(query, repeat_kv(key, g).transpose(2, 3)) * scaling
    if same is not None:
        s_f = torch.matmul(query, repeat_kv(k_f, g).transpose(2, 3)) * scaling
        s = torch.where(same, s_f, s)
    if attention_mask is not None:
        s = s + attention_mask
    pr = torch.softmax(s, dim=-1, dtype=torch.float32).to(query.dtype)
    if same is not None:
        out = torch.matmul(pr * same, repeat_kv(v_f, g)) + torch.matmul(pr * ~same, repeat_kv(value, g))
    else:
        out = torch.matmul(pr, repeat_kv(value, g))
    return out.transpose(1, 2).contiguous(), pr


def load(model_dir: str):
    import torch
    import transformers.models.llama.modeling_llama as ml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (Path(model_dir) / "config.json").is_file():
        raise SystemExit(f"error: {model_dir}/config.json not found; valid: a converted HF "
                         f"checkpoint directory (onecard.prepare.gguf.convert_gguf)")
    ml.eager_attention_forward = attention  # looked up from module globals at call time
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    if model.config.model_type != "llama":
        raise SystemExit(f"error: model_type {model.config.model_type!r} is not valid; valid: llama")
    return tok, model


def nll(model, ids) -> list[float]:
    """NLL (nats) of tokens 1..n-1 given their prefix (index i-1 of the list = token i)."""
    import torch
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1)
    return (-lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]).tolist()


def segments(tok_nll: list[float]) -> dict:
    n = len(tok_nll) + 1
    out = {}
    for a, b in SEGMENTS:
        b = n if b is None else min(b, n)
        if a >= n:
            continue
        vals = tok_nll[max(a, 1) - 1:b - 1]
        out[f"{a}:{b}"] = sum(vals) / len(vals)
    out["all"] = sum(tok_nll) / len(tok_nll)
    out["past_tile0"] = sum(tok_nll[127:]) / max(1, len(tok_nll[127:]))
    return out


def git_show_bytes(rev: str, rel: str) -> bytes:
    """A repository file at git revision ``rev``, byte-exact (no newline or locale decoding)."""
    import subprocess
    r = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{rel}"], capture_output=True)
    if r.returncode:
        raise SystemExit(f"error: git show {rev}:{rel} failed: "
                         f"{r.stderr.decode(errors='replace').strip().splitlines()[-1:]}")
    return r.stdout


def repo_text(rel: str, rev: str | None = None) -> str:
    """A repository file from the working tree, or at git revision ``rev`` (text: UTF-8,
    universal newlines, as read_text gives the working tree's)."""
    if rev is None:
        return (REPO / rel).read_text(encoding="utf-8")
    return git_show_bytes(rev, rel).decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")


def needle_prompt(chars: int = 9000, rev: str | None = None) -> str:
    """gpu/jobs/61-kvarn-serve.py needle: haystack repeated to ``chars``, passphrase at 40 %."""
    hay = repo_text("bench/prompts/haystack.txt", rev)
    body = ((hay + "\n") * (chars // len(hay) + 1))[:chars]
    cut = body.rfind(". ", 0, int(0.4 * len(body))) + 2
    return (body[:cut] + f"The secret passphrase is {SECRET}. Remember it. " + body[cut:]
            + "\n\nQuestion: what is the secret passphrase?\nAnswer: The secret passphrase is")


def greedy(model, tok, text: str, n: int) -> tuple[str, int]:
    import torch
    ids = tok(text)["input_ids"]
    out = []
    with torch.no_grad():  # the cache holds unquantized K/V; the hook quantizes on every read
        r = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            out.append(int(r.logits[0, -1].argmax()))
            r = model(torch.tensor([[out[-1]]]), past_key_values=r.past_key_values, use_cache=True)
    return tok.decode(out), len(ids)


def parse_config(s: str) -> Quant:
    """NAME[:k|:v][+selffp16][+winW][+sinkS], e.g. kvarn_k4v2_g128:v, kvarn_k4v2_g128+selffp16,
    kvarn_k4v2_g128+win3+sink2 (+winW: own tile + W-1 previous tiles fp16, implies +selffp16;
    +sinkS: first S tiles fp16; both kvarn_* only)."""
    import re
    raw = s
    s, *flags = s.split("+")
    self_tile, window, sinks = "quant", 1, 1
    for f in flags:
        m = re.fullmatch(r"(win|sink)(\d+)", f)
        if f == "selffp16":
            self_tile = "fp16"
        elif m and int(m[2]) >= 1 and s.startswith("kvarn_"):
            if m[1] == "win":
                self_tile, window = "fp16", int(m[2])
            else:
                sinks = int(m[2])
        else:
            raise SystemExit(f"error: config {raw!r}: suffix +{f} is not valid; valid: +selffp16, "
                             f"and for kvarn_* +winW / +sinkS with W, S >= 1")
    name, _, only = s.partition(":")
    valid = ("none", "int8", "int4", "kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k4v2_g64",
             "kvarn_kKvV_gTILE (K, V in 2/4/8 bits)")
    ok = name in ("none", "int8", "int4")
    if name.startswith("kvarn_"):
        try:
            ok = preset_of(name).tile >= 16
        except ValueError:
            ok = False
    if not ok or only not in ("", "k", "v"):
        raise SystemExit(f"error: config {s!r} is not valid; valid: one of {', '.join(valid)}, "
                         f"optionally :k or :v (quantize only K or V) and +selffp16 / +winW / +sinkS")
    return Quant(name, only or None, self_tile, window, sinks)


def kernel_check(model, tok, text: str, layer: int, ntok: int, preset: str) -> float:
    """Real K/V/Q of one layer through the serving code path (stage planner + pack + prefill
    + split-KV decode kernels of onecard.kvarn, chunks 256 / rest / 6 decode steps) vs this
    script's simulation of the read rule (``+selffp16``: float64 attention over _fake_kvarn's
    K/V, each query's own tile fp16, ``reference.own_tile_attention_f64``). Returns the max
    relative error (|got - ref| / max(1, |ref|)); prints one line per step, with the distance
    to the all-tiles-quantized simulation (the pre-2026-12-02 prefill semantics) beside it."""
    import torch
    import transformers.models.llama.modeling_llama as ml
    from onecard.kvarn import kernels as K
    from onecard.kvarn import reference as R
    from onecard.kvarn import stage as S

    cap = {}

    def hook(module, query, key, value, attention_mask, scaling, **kw):
        if module.layer_idx == layer:
            cap.update(q=query[0].transpose(0, 1), k=key[0].transpose(0, 1),
                       v=value[0].transpose(0, 1), scale=scaling)
        return attention(module, query, key, value, attention_mask, scaling, **kw)

    ml.eager_attention_forward = hook
    STATE["q"] = Quant("none")
    ids = tok(text)["input_ids"][:ntok]
    if len(ids) < 256 + 8:
        raise SystemExit(f"error: --kernel-check needs >= 264 tokens; the text has {len(ids)}")
    with torch.no_grad():
        model(torch.tensor([ids]))
    ml.eager_attention_forward = attention
    if not cap:
        raise SystemExit(f"error: layer {layer} is not valid; valid: 0..{model.config.num_hidden_layers - 1}")
    q, k, v, scale = cap["q"].half(), cap["k"].half(), cap["v"].half(), cap["scale"]
    L, hkv, d = k.shape
    hq = q.shape[1]
    p = preset_of("kvarn_" + preset)
    T = p.tile
    chunks = [256, L - 256 - 6] + [1] * 6
    nb, slots = -(-L // T) + 4, 10
    cache = torch.zeros(nb, hkv, p.layout(d).block_bytes, dtype=torch.uint8)
    stage_k = torch.zeros(slots * T, hkv, d, dtype=torch.float16)
    stage_v = torch.zeros_like(stage_k)
    planner = S.StagePlanner(p, slots, 1)
    bt = (torch.randperm(nb - 1, generator=torch.Generator().manual_seed(0)) + 1).to(torch.int32)[None]
    worst, c = 0.0, 0
    for ql in chunks:
        s = c + ql
        tb = S.tile_block_ids(bt, {0: planner.tile_cols(c, s)}, 1)
        plan = planner.plan([c], [s], [0], tb, null_page_blocks=1, prefill_min_q=S.MAX_QUERY_LEN + 1)
        kr, vr = R.rotate(k[c:s], torch.float32).half(), R.rotate(v[c:s], torch.float32).half()
        S.apply_write(plan, kr, vr, stage_k, stage_v, cache, p, K.kvarn_pack_rows)
        out = torch.zeros(ql, hq, d)
        S.apply_attention(plan, q[c:s], out, cache, stage_k, stage_v,
                          block_table=bt[plan.req_index].contiguous(), req_block_table=bt,
                          softmax_scale=scale, preset=p, tiles_per_page=1,
                          attention_rows=K.kvarn_attention_rows, prefill=K.kvarn_prefill,
                          key_rot=kr, val_rot=vr)
        kf, vf, kq, vq = _fake_kvarn(k[:s].float(), v[:s].float(), Quant("kvarn_" + preset))
        ref = R.own_tile_attention_f64(q[c:s], kf.double(), vf.double(), kq.double(), vq.double(),
                                       T, scale)  # the +selffp16 simulation
        old = R.attention_f64(q[c:s], kq.double(), vq.double(), scale)  # own tiles quantized
        exact = R.attention_f64(q[c:s], k[:s].double(), v[:s].double(), scale)
        rel = lambda a, b: float(((a - b).abs() / b.abs().clamp_min(1)).max())  # noqa: E731
        e, eo, eq = rel(out.double(), ref), rel(out.double(), old), rel(ref, exact)
        print(f"layer {layer} step ctx {c} q {ql}: kernels vs +selffp16 simulation {e:.1e} "
              f"(vs all-quantized simulation {eo:.3f}); simulation vs unquantized {eq:.3f}",
              flush=True)
        worst, c = max(worst, e), s
    return worst


MSE_GRID = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)


def shrink_ranges(v_alpha: float | str | None = None, k_alpha: float | str | None = None) -> None:
    """What-ifs for --v-range / --k-range: onecard.kvarn.reference.quantize_tile with each
    rounding group's range (V: a token's row; K: a channel over the tile) shrunk to
    mid +- alpha * (max - min) / 2; values beyond clamp to the end codes. ``"mse"``: per group,
    the alpha of MSE_GRID with the least squared error in real units (V weighted by the
    channel scales squared, K by the token norms squared); None: the preset's own writer
    (Preset.v_clip for V, min..max for K). Same stored parameters: a quantizer choice, not a
    format change."""
    import torch
    from onecard.kvarn import reference as R

    stock = R.quantize_tile

    def pick(x, wt, dim, bits, alpha):
        """x [..] values, wt broadcastable weights; groups along ``dim``. -> (min, scale) fp16."""
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
        mid, half = (hi + lo) / 2, (hi - lo) / 2
        levels = 2 ** bits - 1
        best = None
        for a in (MSE_GRID if alpha == "mse" else (float(alpha),)):
            mn = (mid - half * a).half().to(x.dtype)
            sc = (2 * half * a / levels).clamp_min(R.EPS).half().to(x.dtype)
            err = ((((x - mn) / sc).round().clamp(0, levels) * sc + mn - x) ** 2 * wt).sum(dim, keepdim=True)
            if best is None:
                best = (err, mn, sc)
            else:
                take = err < best[0]
                best = (torch.where(take, err, best[0]), torch.where(take, mn, best[1]),
                        torch.where(take, sc, best[2]))
        return best[1].squeeze(dim).half(), best[2].squeeze(dim).half()

    def quantize_tile(k_rot, v_rot, preset=None, dtype=torch.float32):
        qt = stock(k_rot, v_rot, preset, dtype)
        p = R.get_preset(preset)
        kmn, ksc, vmn, vsc = qt.k_min, qt.k_scale, qt.v_min, qt.v_scale
        if v_alpha is not None:
            w = v_rot.to(dtype) / qt.v_norm.to(dtype)
            vmn, vsc = pick(w, qt.v_norm.to(dtype) ** 2, -1, p.v_bits, v_alpha)
        if k_alpha is not None:
            u = k_rot.to(dtype) / qt.k_norm.to(dtype)[..., None]
            kmn, ksc = pick(u, qt.k_norm.to(dtype)[..., None] ** 2, 0, p.k_bits, k_alpha)
        return R.encode(k_rot, v_rot, R.QuantTile(None, None, ksc, kmn, qt.k_norm, vsc, vmn,
                                                  qt.v_norm), p, dtype)

    R.quantize_tile = quantize_tile


def range_arg(flag: str, value: str) -> float | str:
    try:
        alpha = value if value == "mse" else float(value)
    except ValueError:
        alpha = -1.0
    if alpha != "mse" and not 0.0 < alpha <= 1.0:
        raise SystemExit(f"error: {flag} {value} is not valid; valid: 0 < ALPHA <= 1, or mse")
    return alpha


SERVED_CONFIG = "kvarn_k4v2_g128+selffp16"  # what label "kvarn" served (the read rule since b2da41d)
KVQ_JOB = REPO / "gpu" / "jobs" / "32-kv-quality.py"


def served_texts(rec: dict) -> tuple[list[tuple[str, str]], dict]:
    """The texts of a served kv_quality JSON (gpu/jobs/32-kv-quality.py measure), rebuilt by the
    job's own texts() over the files at the JSON's provenance commit: bench/prompts/*.jsonl and the
    job's LONG_DOCS are written from ``git show`` into a scratch tree and the job module's
    ``__file__`` / onecard.bench.prompts.PROMPTS_DIR point there while texts() runs. Returns
    (texts, info); info["sha_ok"]: the job's texts_id() sha256 equals the provenance's
    prompt_set.sha256 (the byte-identity check of the rebuilt texts)."""
    import importlib.util
    import subprocess
    import tempfile

    prov = rec.get("provenance") or {}
    commit = (prov.get("git") or {}).get("commit")
    if not commit:
        raise SystemExit("error: the served JSON has no provenance.git.commit; valid: a kv_quality "
                         "JSON written by gpu/jobs/32-kv-quality.py measure")
    spec = importlib.util.spec_from_file_location("kvq_job_32", KVQ_JOB)
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    ls = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", commit, "bench/prompts/"],
                        capture_output=True, text=True)
    if ls.returncode:
        raise SystemExit(f"error: git ls-tree {commit} bench/prompts/ failed: {ls.stderr.strip()}")
    same_job = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", commit, "--",
                               str(KVQ_JOB.relative_to(REPO))]).returncode == 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp).resolve()
        for rel in [*(n for n in ls.stdout.split() if n.endswith(".jsonl")), *job.LONG_DOCS]:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(git_show_bytes(commit, rel))
        saved = job.__file__, job.P.PROMPTS_DIR
        job.__file__ = str(root / KVQ_JOB.relative_to(REPO))
        job.P.PROMPTS_DIR = root / "bench" / "prompts"
        try:
            texts, tid = job.texts(), job.texts_id()
        finally:
            job.__file__, job.P.PROMPTS_DIR = saved
    want = (prov.get("prompt_set") or {}).get("sha256")
    return texts, {"commit": commit, "sha256": tid["sha256"], "provenance_sha256": want,
                   "sha_ok": tid["sha256"] == want, "job_code_same_as_commit": same_job}


def clean_positions(cfg: Quant) -> int:
    """Token positions below this read no quantized K/V under ``cfg`` (0: every position may):
    kvarn_* with its own tile fp16 (+selffp16 / +winW) first reads a quantized tile at tile
    sinks + window; with its own tile quantized, at tile sinks; none: never."""
    if cfg.name == "none":
        return 1 << 62
    if not cfg.name.startswith("kvarn_"):
        return 0
    tile = preset_of(cfg.name).tile
    return (cfg.sinks + (cfg.window if cfg.self_tile == "fp16" else 0)) * tile


def _ppl(lps: list[float]) -> float:
    return math.exp(-sum(lps) / len(lps))


def served_row(rid: str, n_ids: int, served: list[float], none: list[float], fq: list[float],
               clean: int) -> dict:
    """One text: served logprob i belongs to token i + 1 of the n_ids-token CPU tokenization
    (echo+logprobs / prompt_logprobs give the first prompt token none), like none/fq (nll()).
    ``clean``: positions below it read no quantized tile (clean_positions)."""
    n = n_ids - 1
    if not (len(served) == len(none) == len(fq) == n):
        raise ValueError(f"{rid}: {len(served)} served / {len(none)} none / {len(fq)} fq logprobs "
                         f"for {n_ids} tokens; valid: {n} each")
    m = max(0, min(n, clean - 1))  # scored tokens at positions 1..clean-1
    p_s, p_n, p_f = _ppl(served), _ppl(none), _ppl(fq)
    ad = lambda a, b, lo, hi: sum(abs(x - y) for x, y in zip(a[lo:hi], b[lo:hi]))  # noqa: E731
    row = {"id": rid, "status": "ok", "tokens": n_ids, "scored": n, "ppl_served": p_s,
           "ppl_cpu_none": p_n, "ppl_cpu_fq": p_f,
           "served_vs_none_pct": 100 * (p_s / p_n - 1), "fq_vs_none_pct": 100 * (p_f / p_n - 1),
           "served_vs_fq_pct": 100 * (p_s / p_f - 1),
           "mean_abs_served_fq": sum(abs(a - b) for a, b in zip(served, fq)) / n,
           "mean_abs_served_none": sum(abs(a - b) for a, b in zip(served, none)) / n,
           "clean_scored": m,
           "sums": {"served": sum(served), "none": sum(none), "fq": sum(fq),
                    "abs_served_fq": sum(abs(a - b) for a, b in zip(served, fq)),
                    "abs_served_none": sum(abs(a - b) for a, b in zip(served, none)),
                    "clean_served": sum(served[:m]), "clean_none": sum(none[:m])}}
    if m:
        row["clean_served_vs_none_pct"] = 100 * (_ppl(served[:m]) / _ppl(none[:m]) - 1)
        row["clean_mean_abs_served_none"] = ad(served, none, 0, m) / m
    if m < n:  # positions that read quantized tiles: does served follow fq or none?
        row["rest_mean_abs_served_none"] = ad(served, none, m, n) / (n - m)
        row["rest_mean_abs_served_fq"] = ad(served, fq, m, n) / (n - m)
        row["rest_mean_abs_fq_none"] = ad(fq, none, m, n) / (n - m)
    return row


def pool_rows(rows: list[dict], clean_only: bool = False) -> dict | None:
    """Token-weighted totals over ok rows (clean_only: over their clean positions only)."""
    ok = [r for r in rows if r["status"] == "ok"]
    if clean_only:
        n = sum(r["clean_scored"] for r in ok)
        if not n:
            return None
        s = sum(r["sums"]["clean_served"] for r in ok)
        b = sum(r["sums"]["clean_none"] for r in ok)
        return {"scored": n, "ppl_served": math.exp(-s / n), "ppl_cpu_none": math.exp(-b / n),
                "served_vs_none_pct": 100 * (math.exp((b - s) / n) - 1)}
    n = sum(r["scored"] for r in ok)
    if not n:
        return None
    s, b, f = (sum(r["sums"][k] for r in ok) for k in ("served", "none", "fq"))
    return {"scored": n, "ppl_served": math.exp(-s / n), "ppl_cpu_none": math.exp(-b / n),
            "ppl_cpu_fq": math.exp(-f / n), "served_vs_none_pct": 100 * (math.exp((b - s) / n) - 1),
            "fq_vs_none_pct": 100 * (math.exp((b - f) / n) - 1),
            "mean_abs_served_fq": sum(r["sums"]["abs_served_fq"] for r in ok) / n,
            "mean_abs_served_none": sum(r["sums"]["abs_served_none"] for r in ok) / n}


def compare_served(rec: dict, texts: list[tuple[str, str]], tokenize, score, config: str,
                   clean: int, log=print) -> dict:
    """Rows of one served JSON vs CPU logprobs on the same tokens. tokenize(text) -> ids;
    score(ids, config) -> logprobs of tokens 1..len(ids)-1 (config "none" and ``config``).
    A row whose served logprob count is not len(ids) - 1 is "not comparable" (no guessing)."""
    by_id = dict(texts)
    out = []
    for r in rec.get("rows", []):
        rid, served = r["id"], r.get("logprobs")
        if "error" in r or served is None:
            out.append({"id": rid, "status": f"not comparable (served error: {r.get('error')})"})
            continue
        if rid not in by_id:
            out.append({"id": rid, "status": "not comparable (no rebuilt text of this id)"})
            continue
        ids = tokenize(by_id[rid])
        if len(served) != len(ids) - 1:
            out.append({"id": rid, "tokens": len(ids), "served_logprobs": len(served),
                        "status": f"not comparable ({len(served)} vs {len(ids) - 1} tokens: served "
                                  f"logprobs vs CPU tokens after the first)"})
            continue
        t0 = time.time()
        none = score(ids, "none")
        fq = none if config == "none" else score(ids, config)
        row = served_row(rid, len(ids), [float(x) for x in served], none, fq, clean)
        row.update(seconds=round(time.time() - t0, 1), method=r.get("method"),
                   first_logprob={"served": served[0], "cpu_none": none[0]},
                   cpu_none_logprobs=none, cpu_fq_logprobs=fq)
        out.append(row)
        log(f"  {rid}: {len(ids)} tokens, {row['seconds']:.0f}s", flush=True)
    return {"label": rec.get("label"), "config": config, "clean_positions": clean, "rows": out,
            "all": pool_rows(out), "clean": pool_rows(out, clean_only=True),
            "calibration": pool_rows([r for r in out if r["status"] == "ok"
                                      and r["clean_scored"] == r["scored"]])}


def format_served(res: dict, header: list[str]) -> list[str]:
    """The printed table of one served JSON (compare_served's result)."""
    cfg = res["config"]
    f = lambda x, nd=3: "-" if x is None else f"{x:.{nd}f}"  # noqa: E731
    lines = list(header)
    lines.append(f"| text | tokens | served ppl | CPU none ppl | CPU {cfg} ppl | served vs CPU none "
                 f"| CPU fq vs none | mean abs(served - CPU fq) logprob |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['id']} | {r.get('tokens', '-')} | {r['status']} | | | | | |")
            continue
        lines.append(f"| {r['id']} | {r['tokens']} | {f(r['ppl_served'])} | {f(r['ppl_cpu_none'])} | "
                     f"{f(r['ppl_cpu_fq'])} | {r['served_vs_none_pct']:+.2f}% | "
                     f"{r['fq_vs_none_pct']:+.2f}% | {f(r['mean_abs_served_fq'], 4)} |")
    a = res["all"]
    if a:
        lines.append(f"| all (token-weighted) | {a['scored']} scored | {f(a['ppl_served'])} | "
                     f"{f(a['ppl_cpu_none'])} | {f(a['ppl_cpu_fq'])} | {a['served_vs_none_pct']:+.2f}% | "
                     f"{a['fq_vs_none_pct']:+.2f}% | {f(a['mean_abs_served_fq'], 4)} |")
    c = res["calibration"]
    short = [r for r in res["rows"] if r["status"] == "ok" and r["clean_scored"] == r["scored"]]
    if c:
        lines.append(f"calibration, rows that read no quantized tile ({', '.join(r['id'] for r in short)}; "
                     f"every position < {res['clean_positions']}): served vs CPU none "
                     f"{c['served_vs_none_pct']:+.2f}% pooled over {c['scored']} tokens (per row "
                     + ", ".join(f"{r['served_vs_none_pct']:+.2f}%" for r in short)
                     + f"), mean abs(served - CPU none) {c['mean_abs_served_none']:.4f}: GPU bf16 vs "
                     f"CPU fp32 arithmetic (CPU fq vs none there "
                     f"{max(abs(r['fq_vs_none_pct']) for r in short):.2f}% at most: fp16 K/V rows only)")
    for r in res["rows"]:
        if r["status"] == "ok" and r["clean_scored"] < r["scored"] and r["clean_scored"]:
            lines.append(f"calibration, {r['id']} positions 1..{r['clean_scored']} (no quantized tile "
                         f"read yet): served vs CPU none {r['clean_served_vs_none_pct']:+.2f}%, mean "
                         f"abs(served - CPU none) {r['clean_mean_abs_served_none']:.4f}; positions "
                         f"{r['clean_scored'] + 1}..{r['scored']}: mean abs(served - CPU none) "
                         f"{r['rest_mean_abs_served_none']:.4f}, (served - CPU fq) "
                         f"{r['rest_mean_abs_served_fq']:.4f}, (CPU fq - CPU none) "
                         f"{r['rest_mean_abs_fq_none']:.4f}")
    return lines


def served_main(a, tok, model) -> int:
    """--served-json: each served kv_quality JSON vs CPU none / --served-config on its tokens."""
    cfg = parse_config(a.served_config)
    clean = clean_positions(cfg)

    def score(ids, raw):
        STATE["q"] = Quant("none") if raw == "none" else cfg
        return [-x for x in nll(model, ids)]

    rc, rec_out = 0, {"model": a.model, "served_config": a.served_config, "served": []}
    for path in a.served_json:
        t0 = time.time()
        rec = json.loads(Path(path).read_text())
        if rec.get("kind") != "kv_quality":
            raise SystemExit(f"error: {path}: kind {rec.get('kind')!r} is not valid; valid: kv_quality")
        texts, info = served_texts(rec)
        if not info["sha_ok"]:
            print(f"{path}: texts rebuilt at {info['commit'][:7]} hash {info['sha256']} != the "
                  f"provenance's {info['provenance_sha256']}: not comparable")
            rec_out["served"].append({"path": str(path), "texts": info, "rows": []})
            rc = 1
            continue
        prov = rec.get("provenance", {})
        gpus = ", ".join(g.get("name", "?") for g in (prov.get("gpu") or {}).get("gpus", [])) or "?"
        methods = sorted({r.get("method") for r in rec["rows"] if r.get("method")})
        print(f"{path} (label {rec.get('label')}): scoring on CPU ...", flush=True)
        res = compare_served(rec, texts, lambda t: tok(t)["input_ids"], score, a.served_config, clean)
        res.update(path=str(path), texts=info, seconds=round(time.time() - t0, 1))
        header = [
            f"served: {path}",
            f"  label {rec.get('label')} = CPU config {a.served_config}; vLLM {prov.get('vllm_version')} "
            f"on {gpus} (bf16 weights and activations), {'/'.join(methods)}, commit {info['commit'][:7]}",
            "  CPU: transformers float32 (eager attention), the same converted checkpoint "
            "(bf16 weights upcast); 'none' = unquantized K/V",
            "  so served vs CPU none mixes GPU-bf16-vs-CPU-fp32 arithmetic with the quantization; "
            "CPU fq vs none is the quantization alone (same arithmetic)",
            f"  texts: rebuilt by {KVQ_JOB.relative_to(REPO)} texts() over git show {info['commit'][:7]} "
            f"files, sha256 {info['sha256']} = provenance ({'same job code' if info['job_code_same_as_commit'] else 'job code changed since; hash still matches'})",
            "  alignment: served logprob i = token i+1 of the CPU tokenization (no BOS added; the "
            "first token has no logprob); ppl = exp(-mean logprob) over those tokens",
        ]
        lines = format_served(res, header)
        lines.append(f"({res['seconds']:.0f}s on CPU)")
        print("\n".join(lines), flush=True)
        res["printed"] = lines
        rec_out["served"].append(res)
        rc |= any(r["status"] != "ok" for r in res["rows"])
    if a.json:
        Path(a.json).write_text(json.dumps(rec_out, indent=1))
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--model", required=True,
                    help="converted HF checkpoint directory (e.g. onecard.prepare.gguf.ensure_smollm2())")
    ap.add_argument("--configs", default="none,kvarn_k4v2_g128,kvarn_k4v4_g128,kvarn_k4v2_g64,int8",
                    help="comma-separated configs (NAME[:k|:v][+selffp16]); put none first "
                         "for the ppl delta column")
    ap.add_argument("--text", action="append", default=[], help="extra text file (whole file)")
    ap.add_argument("--no-docs", action="store_true", help="skip the two repo documents")
    ap.add_argument("--rev", help="read the repo documents (and the haystack) at this git "
                    "revision instead of the working tree (they change: pin them)")
    ap.add_argument("--needle", action="store_true", help="also run the needle prompt (greedy)")
    ap.add_argument("--needle-configs", default="none,kvarn_k4v2_g128",
                    help="configs for the needle (comma-separated)")
    ap.add_argument("--needle-tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--json", help="write all numbers here")
    ap.add_argument("--kernel-check", metavar="LAYER", type=int,
                    help="instead: one layer's real Q/K/V (first --kernel-tokens tokens of the "
                         "README doc) through onecard.kvarn's planner + Triton kernels "
                         "(TRITON_INTERPRET=1 on CPU) vs the simulation; exit 1 above 1e-2")
    ap.add_argument("--kernel-tokens", type=int, default=400)
    ap.add_argument("--kernel-preset", default="k4v2_g128")
    ap.add_argument("--window-cost", action="store_true",
                    help="also print, per kvarn config, the 27B cost of its fp16 tiles beyond the "
                         "own tile and sink (fp16_window_cost: bytes/seq, CTX=huge pool)")
    ap.add_argument("--v-range", metavar="ALPHA|mse",
                    help="what-if, overriding the preset's writer: each token's V rounding range "
                         "is the min..max range shrunk by ALPHA around its midpoint (codes clamp "
                         "at the ends); mse: per token the least-squared-error ALPHA of "
                         f"{MSE_GRID}; 1.0 = min..max. Default: the preset's own writer "
                         "(Preset.v_clip: 0.75 for 2-bit V)")
    ap.add_argument("--k-range", metavar="ALPHA|mse",
                    help="the same for K's per-channel ranges over a tile (default: min..max)")
    ap.add_argument("--served-json", nargs="+", metavar="PATH",
                    help="instead: served kv_quality JSONs (gpu/jobs/32-kv-quality.py measure): "
                         "rebuild their texts at the provenance commit, check token counts, and "
                         "compare the served logprobs with CPU none and --served-config on the same "
                         "tokens (one table per JSON; --json writes all numbers)")
    ap.add_argument("--served-config", default=SERVED_CONFIG,
                    help=f"the CPU config matching the served KV dtype (default {SERVED_CONFIG}: "
                         "label kvarn, kvarn_k4v2_g128 with the serving read rule)")
    a = ap.parse_args(argv)
    v_alpha = None if a.v_range is None else range_arg("--v-range", a.v_range)
    k_alpha = None if a.k_range is None else range_arg("--k-range", a.k_range)
    if (v_alpha, k_alpha) != (None, None):
        shrink_ranges(v_alpha, k_alpha)
    configs = [(c, parse_config(c)) for c in a.configs.split(",") if c]
    needle_cfgs = [(c, parse_config(c)) for c in a.needle_configs.split(",") if c] if a.needle else []
    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    texts = [] if a.no_docs else [(f"doc-{Path(r).stem}", repo_text(r, a.rev)[:DOC_CHARS]) for r in DOCS]
    for path in a.text:
        if not Path(path).is_file():
            raise SystemExit(f"error: --text {path} is not a file")
        texts.append((Path(path).stem, Path(path).read_text()))
    if a.kernel_check is not None:
        import os
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before onecard.kvarn.kernels imports triton
        tok, model = load(a.model)
        worst = kernel_check(model, tok, repo_text(DOCS[0], a.rev)[:DOC_CHARS], a.kernel_check,
                             a.kernel_tokens, a.kernel_preset)
        print(f"max kernels-vs-simulation error {worst:.1e} ({'OK' if worst <= 1e-2 else 'FAIL'})")
        return 0 if worst <= 1e-2 else 1
    tok, model = load(a.model)
    if a.served_json:
        return served_main(a, tok, model)
    rec = {"model": a.model, "rev": a.rev, "v_range": v_alpha, "k_range": k_alpha, "rows": [], "needle": []}
    base: dict = {}
    for tid, text in texts:
        ids = tok(text)["input_ids"]
        for raw, cfg in configs:
            STATE["q"] = cfg
            t0 = time.time()
            seg = segments(nll(model, ids))
            if cfg.name == "none":
                base[tid] = seg
            row = {"text": tid, "tokens": len(ids), "config": raw, "nll": seg,
                   "ppl_delta_pct": (100 * (math.exp(seg["all"] - base[tid]["all"]) - 1)
                                     if tid in base else None)}
            rec["rows"].append(row)
            segs = " ".join(f"[{k}] {v:.3f}" for k, v in seg.items())
            d = "" if row["ppl_delta_pct"] is None else f" ppl {row['ppl_delta_pct']:+.1f}%"
            print(f"{tid} {len(ids)} {raw}: {segs}{d} ({time.time() - t0:.0f}s)", flush=True)
    if a.window_cost:
        rec["window_cost"] = []
        for raw, cfg in configs:
            if not cfg.name.startswith("kvarn_"):
                continue
            c = fp16_window_cost(cfg.window, cfg.sinks, cfg.name)
            rec["window_cost"].append({"config": raw, **c})
            print(f"27B cost {raw}: +{c['extra_tiles_per_seq']} fp16 tiles/seq = "
                  f"{c['extra_bytes_per_seq'] / 2**20:.0f} MiB/seq (16 layers); out of the "
                  f"CTX=huge pin at MAX_SEQS 2 (+MTP layer): pool {c['pool_tokens_base']:,} -> "
                  f"{c['pool_tokens']:,} tokens (goal {c['goal']:,}: "
                  f"{'met' if c['meets_goal'] else 'NOT met'}); pin kept instead: pool unchanged, "
                  f"24 GiB card total {c['card_total_pin_kept'] / 2**30:.2f} GiB "
                  f"({'fits' if c['card_fits_pin_kept'] else 'does NOT fit'})", flush=True)
    if a.needle:
        text = needle_prompt(rev=a.rev)
        for raw, cfg in needle_cfgs:
            STATE["q"] = cfg
            ans, n = greedy(model, tok, text, a.needle_tokens)
            found = SECRET.split("-")[0] in ans
            rec["needle"].append({"config": raw, "prompt_tokens": n, "answer": ans, "found": found})
            print(f"needle ({n} tokens) {raw}: {'FOUND' if found else 'missed'}: {ans!r}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rec, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
