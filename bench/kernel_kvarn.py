#!/usr/bin/env python3
"""KVarN kernels on the GPU: correctness at the real shape, then a timing table vs wide-verify.

  python3 bench/kernel_kvarn.py --out DIR            # GPU (~2 min)
  TRITON_INTERPRET=1 python3 bench/kernel_kvarn.py --smoke --out DIR   # CPU plumbing check

1. Correctness (gates the exit status), 24 q / 4 kv heads, head_dim 256 (smoke: 4/2/64):
   * the pack kernel vs the torch reference for every preset: parameters within an fp16 ulp,
     integer codes exactly the rounding under the kernel's parameters (ties excepted), sink copy;
   * attention (onecard.kvarn.kernels.kvarn_attention) vs the float64 reference on the
     dequantized K/V for decode and verify batches (ragged q_len 1..16, lagging packs, pages of
     1 and 16 tiles, 1 / 7 / auto splits), every preset; the error vs unquantized K/V is printed.
2. Timing (informational): KVarN k4v2_g128 attention vs our wide-verify kernel on bf16 and int8
   per-token-head caches (page 64), contexts 8k / 32k / 128k, q per sequence 1 and 16, batch 1;
   median us (triton.testing.do_bench), bytes read once (packed blocks + fp16 stage; bf16/int8:
   K+V+scales), GB/s, speedup of KVarN over each. Plus the pack kernel's time per tile batch.
3. Prefill (informational; correctness rows above gate): onecard.kvarn.kernels.kvarn_prefill,
   one chunk of 2,048 queries over prefixes of 8k / 32k / 128k (k4v2_g128), vs the split-KV
   path it replaced (the chunk as 128 pseudo-sequences of 16 queries, launches of 1,024 tokens)
   and torch SDPA on bf16 K/V of the same length (no mask: a yardstick, not equal work); median
   ms, TFLOP/s of the causal work, tokens/s of prefill.
Writes DIR/kernel_kvarn.json. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for p in (str(REPO), str(REPO / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

SHAPE = {"hq": 24, "hkv": 4, "d": 256}


def log(*a):
    print(*a, flush=True)


def rel_max(out, ref) -> float:
    return float((out.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1.0))


def check_pack(preset, device, gen_cpu) -> dict:
    import torch

    from onecard.kvarn import format as fmt
    from onecard.kvarn import kernels as K
    from onecard.kvarn import reference as R

    p = fmt.get_preset(preset)
    T, H, D = p.tile, SHAPE["hkv"], SHAPE["d"]
    lay = p.layout(D)
    sk = (torch.randn(3, 3 * T, H, D, generator=gen_cpu) * 1.5 + 0.2)
    sk[..., 7] *= 8
    sk, sv = sk.half(), torch.randn(3, 3 * T, H, D, generator=gen_cpu).half()
    cache = torch.randint(0, 256, (4, H, lay.block_bytes), dtype=torch.uint8, generator=gen_cpu)
    jobs = [(1, 0, 2), (2, 3, 0)]
    wc, wk, wv = cache.clone(), sk.clone(), sv.clone()
    for slot, tile, blk in jobs:
        R.pack_tile_from_stage(wk, wv, wc, slot=slot, tile_idx=tile, block=blk, preset=p)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    gk, gv, gc = sk.to(device), sv.to(device), cache.to(device)
    K.kvarn_pack_tiles(gk, gv, gc, slots=i32([j[0] for j in jobs]), tiles=i32([j[1] for j in jobs]),
                       blocks=i32([j[2] for j in jobs]), preset=p)
    gc, gk, gv = gc.cpu(), gk.cpu(), gv.cpu()
    row = {"what": "pack", "preset": p.name, "ok": True, "tie_mismatches": 0}
    row["untouched_ok"] = bool(torch.equal(gc[[1, 3]], wc[[1, 3]]))
    row["sink_ok"] = bool(torch.equal(gk, wk) and torch.equal(gv, wv))
    worst = 0.0
    for slot, tile, blk in jobs:
        got, want = R.read_block(gc, blk, lay), R.read_block(wc, blk, lay)
        for name in ("k_scale", "k_min", "k_norm", "v_scale", "v_min", "v_norm"):
            a, b = getattr(got, name).float(), getattr(want, name).float()
            worst = max(worst, float(((a - b).abs() / b.abs().clamp_min(1e-3)).max()))
        rows = torch.arange(T) + T + (tile % 2) * T
        enc = R.encode(wk[slot, rows], wv[slot, rows], got, p)
        xk, xv = R.encode(wk[slot, rows], wv[slot, rows], got, p, exact_values=True)
        for c, w, x in ((got.k_codes, enc.k_codes, xk), (got.v_codes, enc.v_codes, xv)):
            diff = c != w
            tie = ((x - x.floor()) - 0.5).abs() < 1e-3
            row["off_tie_mismatches"] = row.get("off_tie_mismatches", 0) + int((diff & ~tie).sum())
            row["tie_mismatches"] += int((diff & tie).sum())
    row["param_rel_err"] = worst
    row["ok"] = (row["untouched_ok"] and row["sink_ok"] and worst <= 2e-3
                 and row["off_tie_mismatches"] == 0)
    return row


def check_attention(name, preset, q_lens, seq_lens, tpp, splits, device, gen_cpu) -> dict:
    import torch

    from onecard.kvarn import kernels as K
    from onecard.kvarn import reference as R

    case = R.make_case(q_lens=q_lens, seq_lens=seq_lens, num_q_heads=SHAPE["hq"],
                       num_kv_heads=SHAPE["hkv"], head_dim=SHAPE["d"], preset=preset,
                       tiles_per_page=tpp, generator=gen_cpu)
    dev = case.to(device)
    out = torch.full(dev.q.shape, float("nan"), dtype=dev.q.dtype, device=device)
    K.kvarn_attention(dev.q, dev.cache, dev.stage_k, dev.stage_v, out,
                      cu_seqlens_q=dev.cu_seqlens_q, seq_lens=dev.seq_lens,
                      packed_tiles=dev.packed_tiles, stage_slot=dev.stage_slot,
                      block_table=dev.block_table, max_query_len=dev.max_query_len,
                      softmax_scale=dev.softmax_scale, preset=preset, tiles_per_page=tpp,
                      num_splits=splits)
    if device.type == "cuda":
        torch.cuda.synchronize()
    ref = R.reference_attention(case)
    exact = R.reference_attention(case, exact=True)
    o = out.double().cpu()
    row = {"what": "attention", "name": name, "preset": preset, "q_lens": q_lens,
           "seq_lens": seq_lens, "packed": case.packed_tiles.tolist(), "tiles_per_page": tpp,
           "splits": splits, "nan": bool(torch.isnan(o).any())}
    row["err_vs_dequant"] = rel_max(o, ref)
    row["rel_fro_vs_unquantized"] = float((o - exact).norm() / exact.norm())
    row["ok"] = (not row["nan"]) and row["err_vs_dequant"] <= 1e-2
    return row


def check_prefill(name, preset, q_len, seq_len, tpp, window, group, device, gen_cpu) -> dict:
    import torch

    from onecard.kvarn import kernels as K
    from onecard.kvarn import reference as R

    T = R.get_preset(preset).tile
    case = R.make_case(q_lens=[q_len], seq_lens=[seq_len], num_q_heads=SHAPE["hq"],
                       num_kv_heads=SHAPE["hkv"], head_dim=SHAPE["d"], preset=preset,
                       packed_tiles=[seq_len // T], tiles_per_page=tpp, generator=gen_cpu)
    slot = int(case.stage_slot[0])
    # the read rule: own tiles fp16 (this step's rows new_k / new_v; the rows of the tile
    # holding ctx before ctx from the stage ring), sink fp16, older tiles packed
    ctx = seq_len - q_len
    kr = R.rotate(case.k_true[0], torch.float32).half()
    vr = R.rotate(case.v_true[0], torch.float32).half()
    pos = torch.arange(ctx // T * T, ctx)
    case.stage_k[slot, R.ring_row(pos, T)] = kr[pos]
    case.stage_v[slot, R.ring_row(pos, T)] = vr[pos]
    dev = case.to(device)
    out = torch.full(dev.q.shape, float("nan"), dtype=dev.q.dtype, device=device)
    K.kvarn_prefill(dev.q, dev.cache, dev.stage_k.flatten(0, 1), dev.stage_v.flatten(0, 1), out,
                    block_table_row=dev.block_table[0].contiguous(), ctx_len=ctx,
                    seq_len=seq_len, packed_tiles=seq_len // T, sink_row=slot * 3 * T,
                    tail_row=slot * 3 * T + T, ring=2 * T, softmax_scale=case.softmax_scale,
                    new_k=kr[ctx:].contiguous().to(device), new_v=vr[ctx:].contiguous().to(device),
                    preset=preset, tiles_per_page=tpp, window_tokens=window, query_group=group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    o = out.double().cpu()
    kq, vq = R.gather_kv(case, 0, sink=False)
    ref = R.own_tile_attention_f64(case.q.cpu(), R.rotate(kr), R.rotate(vr), R.rotate(kq),
                                   R.rotate(vq), T, case.softmax_scale)
    row = {"what": "prefill", "name": name, "preset": preset, "q_len": q_len, "seq_len": seq_len,
           "tiles_per_page": tpp, "window": window, "query_group": group,
           "nan": bool(torch.isnan(o).any())}
    row["err_vs_dequant"] = rel_max(o, ref)
    row["ok"] = (not row["nan"]) and row["err_vs_dequant"] <= 1e-2
    return row


def correctness(device, smoke: bool) -> list[dict]:
    import torch

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    rows = []
    presets = ["k4v2_g128", "k4v4_g128", "k4v2_g64"]
    for p in presets:
        rows.append(check_pack(p, device, gen))
    if smoke:
        att = [("smoke-verify", "k4v2_g64", [1, 5], [70, 200], 1, 2)]
    else:
        att = [
            ("decode-ragged", "k4v2_g128", [1, 1, 1, 1], [5, 128, 1000, 4133], 1, None),
            ("verify-ragged-q16", "k4v2_g128", [16, 8, 3, 1], [4133, 1500, 300, 17], 1, 7),
            ("verify-pages-16-tiles", "k4v2_g128", [16, 4], [5000, 2100], 16, None),
            ("verify-k4v4", "k4v4_g128", [16, 1], [3000, 700], 1, None),
            ("verify-g64", "k4v2_g64", [8, 16], [2000, 129], 1, 1),
        ]
    if smoke:
        pre = [("smoke-prefill-windows", "k4v2_g64", 70, 200, 1, 64, 32)]
    else:
        pre = [
            ("prefill-prefix0", "k4v2_g128", 700, 700, 1, 16384, 2048),
            ("prefill-midtile-windows-groups", "k4v2_g128", 333, 1000, 16, 256, 128),
            ("prefill-k4v4", "k4v4_g128", 200, 900, 1, 16384, 2048),
        ]
    for what, check, cases in (("attention", check_attention, att), ("prefill", check_prefill, pre)):
        for a in cases:
            try:
                rows.append(check(*a, device=device, gen_cpu=gen))
            except Exception as exc:  # noqa: BLE001
                rows.append({"what": what, "name": a[0], "ok": False, "error": repr(exc)[:400],
                             "trace": traceback.format_exc()[-1500:]})
    for r in rows:
        log(json.dumps({k: v for k, v in r.items() if k != "trace"}))
        if "trace" in r:
            log(r["trace"])
    return rows


def kvarn_timing_case(*, q_len, ctx, batch, device, gen, preset="k4v2_g128", tiles_per_page=1):
    """A batch with ``ctx`` keys per sequence; packed tiles = all full tiles before the last
    40 tokens (a realistic lagging tail); random codes, sane fp16 parameters."""
    import torch

    from onecard.kvarn import format as fmt
    from onecard.kvarn.reference import KvarnCase

    p = fmt.get_preset(preset)
    T, H, D, hq = p.tile, SHAPE["hkv"], SHAPE["d"], SHAPE["hq"]
    lay = p.layout(D)
    packed = max(0, (ctx - 40) // T)
    tiles = max(1, math.ceil(ctx / T))
    pages = math.ceil(tiles / tiles_per_page)
    nb = (pages * batch + 1) * tiles_per_page
    cache = torch.empty(nb, H, lay.block_bytes, dtype=torch.uint8, device=device)
    cache.random_(0, 256, generator=gen)
    params = cache[:, :, lay.k_scale:].view(torch.float16)
    params.uniform_(0.01, 0.05, generator=gen)
    stage_k = torch.randn(batch + 1, 3 * T, H, D, device=device, generator=gen).half()
    stage_v = torch.randn(batch + 1, 3 * T, H, D, device=device, generator=gen).half()
    perm = torch.randperm(pages * batch + 1, device=device, generator=gen).to(torch.int32)
    bt = perm[: pages * batch].view(batch, pages).contiguous()
    q = torch.randn(q_len * batch, hq, D, device=device, generator=gen).to(torch.bfloat16)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return KvarnCase(
        preset=p, head_dim=D, q=q, cache=cache, stage_k=stage_k, stage_v=stage_v,
        cu_seqlens_q=torch.arange(0, batch + 1, device=device, dtype=torch.int32) * q_len,
        seq_lens=i32([ctx] * batch), packed_tiles=i32([packed] * batch),
        stage_slot=i32(list(range(batch))), block_table=bt, tiles_per_page=tiles_per_page,
        softmax_scale=D ** -0.5, max_query_len=q_len)


def time_row(q_len, ctx, *, device, gen, l2_bytes, batch=1, tiles_per_page=1) -> dict:
    import torch

    import kernel_verify as kv  # bench/kernel_verify.py: bench_ms, timing_case, run_ours

    from onecard.kvarn import kernels as K

    row = {"q_len": q_len, "ctx": ctx, "batch": batch, "tiles_per_page": tiles_per_page}
    first = kvarn_timing_case(q_len=q_len, ctx=ctx, batch=batch, device=device, gen=gen,
                              tiles_per_page=tiles_per_page)
    n_copies = max(1, min(6, math.ceil(4 * l2_bytes / max(1, first.kv_bytes))))
    cases = [first] + [kvarn_timing_case(q_len=q_len, ctx=ctx, batch=batch, device=device,
                                         gen=gen, tiles_per_page=tiles_per_page)
                       for _ in range(n_copies - 1)]
    outs = [torch.empty_like(c.q) for c in cases]
    row["kvarn_bytes"] = first.kv_bytes
    it = [0]
    max_packed = int(first.packed_tiles.max())

    def ours():
        i = it[0] = (it[0] + 1) % n_copies
        c = cases[i]
        K.kvarn_attention(c.q, c.cache, c.stage_k, c.stage_v, outs[i],
                          cu_seqlens_q=c.cu_seqlens_q, seq_lens=c.seq_lens,
                          packed_tiles=c.packed_tiles, stage_slot=c.stage_slot,
                          block_table=c.block_table, max_query_len=q_len,
                          softmax_scale=c.softmax_scale, preset=c.preset,
                          tiles_per_page=c.tiles_per_page, max_packed_tiles=max_packed)

    try:
        row["kvarn_ms"] = kv.bench_ms(ours, device)
    except Exception as exc:  # noqa: BLE001
        row["kvarn_error"] = repr(exc)[:300]
    if "kvarn_ms" in row:
        # the same calls replayed from a CUDA graph: the kernels without the wrapper's ~10 torch
        # ops and two launches (a server runs them inside its CUDA graphs, KVARN_GRAPHS=1)
        try:
            if (g := kv.graph_ms(ours, device)) is not None:
                row["kvarn_graph_ms"] = g
        except Exception as exc:  # noqa: BLE001
            row["kvarn_graph_error"] = repr(exc)[:300]
    row["splits"] = K.choose_num_splits(max_packed, batch, SHAPE["hkv"], K._sm_count(device))
    del cases, outs
    for dt in ("bf16", "int8"):
        try:
            r = kv.time_config(q_len, ctx, batch, dt, device=device, gen=gen, block_size=64,
                               l2_bytes=l2_bytes, have_stock=False, with_stock=False, graph=True)
            row[f"{dt}_ms"] = r.get("ours_ms")
            if "ours_graph_ms" in r:
                row[f"{dt}_graph_ms"] = r["ours_graph_ms"]
            row[f"{dt}_bytes"] = r["kv_bytes"]
            if "ours_error" in r:
                row[f"{dt}_error"] = r["ours_error"]
        except Exception as exc:  # noqa: BLE001
            row[f"{dt}_error"] = repr(exc)[:300]
    return row


def time_pack(device, gen, n_tiles: int) -> dict:
    import torch

    import kernel_verify as kv

    from onecard.kvarn import format as fmt
    from onecard.kvarn import kernels as K

    p = fmt.get_preset()
    T, H, D = p.tile, SHAPE["hkv"], SHAPE["d"]
    sk = torch.randn(n_tiles, 3 * T, H, D, device=device, generator=gen).half()
    sv = torch.randn_like(sk)
    cache = torch.zeros(n_tiles, H, p.layout(D).block_bytes, dtype=torch.uint8, device=device)
    ar = torch.arange(n_tiles, dtype=torch.int32, device=device)
    ms = kv.bench_ms(lambda: K.kvarn_pack_tiles(sk, sv, cache, slots=ar, tiles=ar + 1,
                                                blocks=ar, preset=p), device)
    return {"tiles": n_tiles, "ms": ms, "us_per_tile": ms * 1e3 / n_tiles}


def prefill_row(chunk, prefix, *, device, gen, with_old=True, with_sdpa=True) -> dict:
    """One prefill chunk of ``chunk`` queries after ``prefix`` keys: kvarn_prefill vs the
    split-KV pseudo-sequence path (what the backend ran before) vs bf16 SDPA (no mask)."""
    import torch

    import kernel_verify as kv

    from onecard.kvarn import kernels as K

    seq = prefix + chunk
    c = kvarn_timing_case(q_len=chunk, ctx=seq, batch=1, device=device, gen=gen)
    T, hq, hkv, d = c.preset.tile, SHAPE["hq"], SHAPE["hkv"], SHAPE["d"]
    packed = seq // T
    rows_k, rows_v = c.stage_k.flatten(0, 1), c.stage_v.flatten(0, 1)
    out = torch.empty_like(c.q)
    bt_row = c.block_table[0].contiguous()
    row = {"chunk": chunk, "prefix": prefix,
           "flops": 4 * chunk * (prefix + (chunk + 1) / 2) * d * hq}

    nk = torch.randn(chunk, hkv, d, device=device).half()  # this step's rows (own tiles)
    nv = torch.randn_like(nk)

    def new():
        K.kvarn_prefill(c.q, c.cache, rows_k, rows_v, out, block_table_row=bt_row,
                        ctx_len=prefix, seq_len=seq, packed_tiles=packed, sink_row=0,
                        tail_row=T, ring=2 * T, softmax_scale=c.softmax_scale, preset=c.preset,
                        new_k=nk, new_v=nv)

    try:
        row["kvarn_ms"] = kv.bench_ms(new, device)
    except Exception as exc:  # noqa: BLE001
        row["kvarn_error"] = repr(exc)[:300]
    # the launch an RTX 3090 / 4090 gets (K.prefill_launch under 200 KiB per block: 16 keys per
    # step, to fit 99 KiB of shared memory; session 23), timed on this GPU beside its own default
    bm, bn, ns = K.prefill_launch(d, 101_376)
    try:
        row["kvarn_sm8x_ms"] = kv.bench_ms(lambda: K.kvarn_prefill(
            c.q, c.cache, rows_k, rows_v, out, block_table_row=bt_row, ctx_len=prefix, seq_len=seq,
            packed_tiles=packed, sink_row=0, tail_row=T, ring=2 * T, softmax_scale=c.softmax_scale,
            preset=c.preset, new_k=nk, new_v=nv, block_m=bm, block_n=bn, num_stages=ns), device)
    except Exception as exc:  # noqa: BLE001
        row["kvarn_sm8x_error"] = repr(exc)[:300]
    if with_old:  # the chunk as pseudo-sequences of 16 (stage.py without prefill jobs)
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        n16 = -(-chunk // 16)
        si = [prefix + min(16 * (i + 1), chunk) for i in range(n16)]
        part = seq // T
        pk = [part if seq % T and s > part * T else -(-s // T) for s in si]
        tail = [T if seq % T and s > part * T else -1 for s in si]
        cu = [0] + [min(16 * (i + 1), chunk) for i in range(n16)]
        bt = c.block_table[:1].expand(n16, -1).contiguous()
        sl, pkt, snk, tl_, cut = i32(si), i32(pk), i32([0] * n16), i32(tail), i32(cu)

        def old():
            for i0 in range(0, n16, 64):  # MAX_TOKENS_PER_LAUNCH 1024 = 64 pseudo-sequences
                i1 = min(n16, i0 + 64)
                t0, t1 = cu[i0], cu[i1]
                K.kvarn_attention_rows(
                    c.q[t0:t1], c.cache, rows_k, rows_v, out[t0:t1],
                    cu_seqlens_q=cut[i0:i1 + 1] - t0, seq_lens=sl[i0:i1], packed_tiles=pkt[i0:i1],
                    sink_rows=snk[i0:i1], tail_rows=tl_[i0:i1], ring=2 * T, block_table=bt[i0:i1],
                    max_query_len=16, softmax_scale=c.softmax_scale, preset=c.preset,
                    max_packed_tiles=max(pk))

        try:
            row["old_ms"] = kv.bench_ms(old, device)
        except Exception as exc:  # noqa: BLE001
            row["old_error"] = repr(exc)[:300]
    if with_sdpa:
        try:
            import torch.nn.functional as F

            qq = c.q.view(1, chunk, hq, d).transpose(1, 2)
            kk = torch.randn(1, hkv, seq, d, device=device, dtype=torch.bfloat16)
            vv = torch.randn_like(kk)
            row["sdpa_bf16_ms"] = kv.bench_ms(
                lambda: F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True), device)
            del kk, vv
        except Exception as exc:  # noqa: BLE001
            row["sdpa_error"] = repr(exc)[:300]
    del c
    return row


def fmt_prefill(rows) -> str:
    head = (f"{'chunk':>6} {'prefix':>7} {'kvarn ms':>9} {'TFLOP/s':>8} {'tok/s':>8} "
            f"{'old ms':>9} {'x old':>6} {'sdpa bf16 ms':>12}")
    lines = [head, "-" * len(head)]
    nan = float("nan")
    for r in rows:
        k, o, sd = r.get("kvarn_ms"), r.get("old_ms"), r.get("sdpa_bf16_ms")
        lines.append(
            f"{r['chunk']:>6} {r['prefix']:>7} {(k or nan):>9.2f} "
            f"{(r['flops'] / (k * 1e-3) / 1e12 if k else nan):>8.1f} "
            f"{(r['chunk'] / (k * 1e-3) if k else nan):>8.0f} {(o or nan):>9.2f} "
            f"{(o / k if k and o else nan):>6.1f} {(sd or nan):>12.2f}"
            + (f"  sm8x launch {r['kvarn_sm8x_ms']:.2f} ms ({r['kvarn_sm8x_ms'] / k:.2f}x)"
               if k and r.get("kvarn_sm8x_ms") else "")
            + "".join(f"  {key}={r[key][:60]}" for key in r if key.endswith("_error")))
    return "\n".join(lines)


def fmt_table(rows) -> str:
    head = (f"{'q':>3} {'ctx':>7} {'B':>2} {'tpp':>3} {'spl':>3} {'kvarn us':>9} {'bf16 us':>9} "
            f"{'int8 us':>9} {'x bf16':>6} {'x int8':>6} {'kvarn GB/s':>10} {'int8 GB/s':>9} "
            f"{'MB kvarn/int8':>14}")
    lines = [head, "-" * len(head)]
    nan = float("nan")
    for r in rows:
        k, b, i = r.get("kvarn_ms"), r.get("bf16_ms"), r.get("int8_ms")
        kg = r["kvarn_bytes"] / 1e9 / (k * 1e-3) if k else nan
        ig = r.get("int8_bytes", 0) / 1e9 / (i * 1e-3) if i else nan
        lines.append(
            f"{r['q_len']:>3} {r['ctx']:>7} {r['batch']:>2} {r['tiles_per_page']:>3} "
            f"{r.get('splits', '-'):>3} {(k or nan) * 1e3:>9.1f} {(b or nan) * 1e3:>9.1f} "
            f"{(i or nan) * 1e3:>9.1f} {(b / k if k and b else nan):>6.2f} "
            f"{(i / k if k and i else nan):>6.2f} {kg:>10.0f} {ig:>9.0f} "
            f"{r['kvarn_bytes'] / 1e6:>6.1f}/{r.get('int8_bytes', 0) / 1e6:<7.1f}"
            + (f"  graph: kvarn {r['kvarn_graph_ms'] * 1e3:.1f} us, int8 {r['int8_graph_ms'] * 1e3:.1f} us "
               f"(x int8 {r['int8_graph_ms'] / r['kvarn_graph_ms']:.2f})"
               if r.get("kvarn_graph_ms") and r.get("int8_graph_ms") else "")
            + "".join(f"  {key}={r[key][:60]}" for key in r if key.endswith("_error")))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run under TRITON_INTERPRET=1")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="stop starting new timing rows after this many seconds")
    ap.add_argument("--prefill-budget-s", type=float, default=30.0,
                    help="extra seconds after --budget-s for the prefill rows")
    args = ap.parse_args(argv)
    t0 = time.time()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        log("no CUDA device: run with TRITON_INTERPRET=1 --smoke for a CPU plumbing check")
        return 2
    import triton

    if args.smoke:
        SHAPE.update(hq=4, hkv=2, d=64)
        import kernel_verify as kv
        kv.NUM_Q_HEADS, kv.NUM_KV_HEADS, kv.HEAD_DIM = 4, 2, 64
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "shape": dict(SHAPE)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["sms"] = props.multi_processor_count
        info["l2_bytes"] = getattr(props, "L2_cache_size", 50 * 2**20)
    log("== env", json.dumps(info))
    result = {"info": info}
    try:
        from onecard.bench import provenance
        result["provenance"] = provenance.build(token_count_source="n/a (kernel benchmark)",
                                                warmup={"do_bench": "warmup=10ms rep=40ms"})
    except Exception as exc:  # noqa: BLE001
        result["provenance"] = {"error": repr(exc)[:200]}
    from onecard.kvarn import format as fmt
    result["format"] = fmt.format_table(256, 4)

    def save():
        (out_dir / "kernel_kvarn.json").write_text(json.dumps(result, indent=1, default=str))

    log("== 1. correctness vs the torch / float64 reference")
    try:
        result["correctness"] = correctness(device, args.smoke)
    except Exception as exc:  # noqa: BLE001
        result["correctness"] = [{"ok": False, "error": repr(exc)[:400]}]
        log(traceback.format_exc())
    ok = all(r.get("ok") for r in result["correctness"])
    result["correctness_ok"] = ok
    log(f"correctness: {'OK' if ok else 'FAILED'} ({time.time() - t0:.0f}s)")
    save()

    log("== 2. timing: KVarN k4v2_g128 vs wide-verify bf16 / int8 (page 64), batch 1")
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(os.urandom(4), "little"))
    l2 = info.get("l2_bytes", 2**20)
    if args.smoke:
        grid = [(1, 200, 1), (4, 300, 2)]
    else:
        grid = [(q, c, 1) for q in (16, 1) for c in (8192, 32768, 131072)] + [(16, 131072, 16)]
    rows = []
    for q_len, ctx, tpp in grid:
        if time.time() - t0 > args.budget_s:
            log(f"budget reached; skipped q={q_len} ctx={ctx} tpp={tpp}")
            continue
        try:
            rows.append(time_row(q_len, ctx, device=device, gen=gen, l2_bytes=l2,
                                 tiles_per_page=tpp))
        except Exception as exc:  # noqa: BLE001
            log(f"row q={q_len} ctx={ctx}: {exc!r}"[:300])
        result["table"] = rows
        save()
    log(fmt_table(rows))
    log("== 3. prefill: kvarn_prefill vs the pseudo-sequence path vs bf16 SDPA, batch 1")
    prows = []
    pgrid = [(64, 128), (64, 256)] if args.smoke else [(2048, 8192), (2048, 32768), (2048, 131072)]
    for chunk, prefix in pgrid:
        if time.time() - t0 > args.budget_s + args.prefill_budget_s:
            log(f"budget reached; skipped prefill chunk={chunk} prefix={prefix}")
            continue
        try:
            prows.append(prefill_row(chunk, prefix, device=device, gen=gen))
        except Exception as exc:  # noqa: BLE001
            log(f"prefill chunk={chunk} prefix={prefix}: {exc!r}"[:300])
        result["prefill"] = prows
        save()
    log(fmt_prefill(prows))
    try:
        result["pack"] = [time_pack(device, gen, n) for n in ((1, 4) if args.smoke else (1, 64))]
        for r in result["pack"]:
            log(f"pack: {r['tiles']} tiles in {r['ms'] * 1e3:.1f} us ({r['us_per_tile']:.2f} us/tile)")
    except Exception as exc:  # noqa: BLE001
        log(f"pack timing: {exc!r}"[:300])
    save()
    log(f"== done in {time.time() - t0:.0f}s; correctness {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
