#!/usr/bin/env python3
"""Wide-verify attention on the GPU: correctness at real shapes, then ours vs stock vLLM.

  python3 bench/kernel_verify.py --out DIR            # GPU: checks + table + sweep (~3 min)
  TRITON_INTERPRET=1 python3 bench/kernel_verify.py --smoke --out DIR   # CPU plumbing check

1. Correctness (gates the exit status): ``onecard.kernels.wide_verify`` vs the float64
   reference at 24 q / 4 kv heads, head_dim 256, ragged q_len 1..16, page sizes 16 and 544, for
   bf16 / int8 / int4 (defaults at auto / 1 / 7 splits; ``head_split=2`` at tiles 16 and 32);
   the same inputs through stock ``unified_attention`` (sanity of the inputs); and caches
   written by vLLM's own reshape-and-cache kernels (proves our reading of the int8 / int4
   formats).
2. The table for the first ``--q-lens`` entry (default 16): contexts 8k / 32k / 72k / 128k,
   bf16 / int8 / int4, batch 1 / 4. Median time (triton.testing.do_bench), KV GB/s (K+V+scales
   read once), % of a device-to-device copy's bandwidth (read+write bytes / time) measured in the
   same run, and the speedup over stock. Inputs rotate over several cache copies so L2 does not
   flatter. Each row records the launch config the defaults chose.
3. A launch-config sweep at q=16, 32k, batch 1 per KV dtype (tile, stages, 1 vs 2 waves of
   splits), first row = the sm_90 default; int8 / int4 also tiles 32 and 64 at 2-4 stages, and
   int8 at vLLM's serving page (1584 tokens, where tiles 32 / 64 leave the PAGE_TILES path),
   and int8 / int4 with ``head_split=2`` at tiles 16 / 32 / 64, 2-4 stages (bf16 once; int4's
   default has it since session 25, so its first row is tile 16 / 4 stages / head_split 2). Rows
   past ``--budget-s`` + 20 s are skipped (except each dtype's default).
4. The other q_len rows (default 8) while ``--budget-s`` lasts. The table is printed last.
Benchmarks print figures; nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 24, 4, 256
KV_DTYPES = ("bf16", "int8", "int4")


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------


def bench_ms(fn, device) -> float:
    """Median milliseconds of ``fn()``."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    ts = []
    fn()
    for _ in range(3):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def graph_ms(fn, device) -> float | None:
    """Milliseconds of ``fn()`` replayed from a CUDA graph (triton's do_bench_cudagraph): the
    kernels' own time without the Python wrapper's launches, which is what a server running the
    kernel inside CUDA graphs pays. None off CUDA."""
    if device.type != "cuda":
        return None
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median"))
    except TypeError:  # a Triton without return_mode: its mean
        return float(triton.testing.do_bench_cudagraph(fn, rep=40))


def copy_bandwidth_gbps(device, nbytes: int) -> dict:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    gbps = 2 * nbytes / (ms * 1e-3) / 1e9
    del src, dst
    return {"bytes": nbytes, "ms": ms, "gbps_read_plus_write": gbps}


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------


def timing_case(*, q_len, ctx, batch, kv_dtype, block_size, device, gen):
    """A batch whose every sequence has ``ctx`` keys (incl. the verify block) and ``q_len``
    queries; random cache content (timing does not depend on the values), shuffled pages."""
    import torch

    from onecard.kernels.reference import VerifyCase, paged_views

    blocks = math.ceil(ctx / block_size)
    nb = blocks * batch + 1
    padded, cdt = {"bf16": (HEAD_DIM, torch.bfloat16), "int8": (HEAD_DIM + 4, torch.int8),
                   "int4": (HEAD_DIM // 2 + 4, torch.uint8)}[kv_dtype]
    kv = torch.empty(nb, NUM_KV_HEADS, block_size, 2 * padded, dtype=cdt, device=device)
    if kv_dtype == "bf16":
        kv.normal_(generator=gen)
    else:
        kv.view(torch.uint8).random_(0, 256, generator=gen)
    k, v, ks, vs = paged_views(kv, HEAD_DIM, kv_dtype)
    if ks is not None:
        for s in (ks, vs):
            val = torch.empty(s.shape, device=device).uniform_(0.01, 0.05, generator=gen)
            if kv_dtype == "int4":
                bits = (val.view(torch.int32) & -16) | torch.randint(
                    0, 16, s.shape, device=device, dtype=torch.int32, generator=gen)
                val = bits.view(torch.float32)
            s.copy_(val)
    perm = torch.randperm(nb, device=device, generator=gen).to(torch.int32)
    bt = perm[: blocks * batch].view(batch, blocks).contiguous()
    q = torch.randn(q_len * batch, NUM_Q_HEADS, HEAD_DIM, device=device,
                    generator=gen).to(torch.bfloat16)
    cu = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * q_len
    return VerifyCase(q=q, key_cache=k, value_cache=v, k_scale_cache=ks, v_scale_cache=vs,
                      cu_seqlens_q=cu,
                      seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
                      block_table=bt, softmax_scale=HEAD_DIM ** -0.5, kv_dtype=kv_dtype,
                      max_query_len=q_len, max_seq_len=ctx, kv_cache=kv)


def run_ours(case, out, **kw):
    from onecard.kernels.wide_verify import wide_verify_attention

    return wide_verify_attention(
        case.q, case.key_cache, case.value_cache, out, cu_seqlens_q=case.cu_seqlens_q,
        seq_lens=case.seq_lens, block_table=case.block_table, max_query_len=case.max_query_len,
        softmax_scale=case.softmax_scale, kv_mode=case.kv_dtype, k_scale_cache=case.k_scale_cache,
        v_scale_cache=case.v_scale_cache, max_seq_len=case.max_seq_len, **kw)


def run_stock(case, out):
    """The stock TRITON_ATTN call (vLLM 0.27.1 ``unified_attention``) on the same inputs."""
    import torch

    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.v1.kv_cache_interface import KVQuantMode

    mode = {"bf16": KVQuantMode.NONE, "int8": KVQuantMode.INT8_PER_TOKEN_HEAD,
            "int4": KVQuantMode.INT4_PER_TOKEN_HEAD}[case.kv_dtype]
    n = case.seq_lens.shape[0]
    if mode == KVQuantMode.NONE:
        one = torch.ones(1, dtype=torch.float32, device=case.q.device)
        kd = vd = one.expand(n, NUM_KV_HEADS)
    else:
        kd = vd = None
    unified_attention(
        q=case.q, k=case.key_cache, v=case.value_cache, out=out,
        cu_seqlens_q=case.cu_seqlens_q, max_seqlen_q=case.max_query_len,
        seqused_k=case.seq_lens, max_seqlen_k=case.max_seq_len,
        softmax_scale=case.softmax_scale, causal=True, window_size=(-1, -1),
        block_table=case.block_table, softcap=0.0, q_descale=None, k_descale=kd, v_descale=vd,
        kv_quant_mode=mode, k_scale_cache=case.k_scale_cache, v_scale_cache=case.v_scale_cache)
    return out


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def error_text(exc: BaseException, limit: int = 1500) -> str:
    """An exception for a result row: its type and the *tail* of its message. Triton's
    CompilationError starts with the kernel's whole source and ends with the failing line and
    its cause (session 30: a 300-character head named nothing but the kernel's arguments)."""
    msg = str(exc)
    return f"{type(exc).__name__}: {msg[-limit:] if len(msg) > limit else msg}"


def rel_err(out, ref) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0))


# ------------------------------------------------------------------------------------------------
# 1. correctness
# ------------------------------------------------------------------------------------------------


def correctness(device, gen, smoke: bool, have_stock: bool) -> list[dict]:
    import torch

    from onecard.kernels.reference import make_verify_case, paged_views, reference_verify_attention

    rows = []
    cpu_gen = torch.Generator().manual_seed(int(gen.initial_seed()))  # cases are built on CPU
    if smoke:
        shapes = [dict(q_lens=[3, 1], seq_lens=[40, 17], block_size=16, heads=(6, 2), d=32)]
    else:
        shapes = [
            dict(q_lens=[16, 9, 1, 16], seq_lens=[1000, 4099, 37, 8192], block_size=16,
                 heads=(NUM_Q_HEADS, NUM_KV_HEADS), d=HEAD_DIM),
            dict(q_lens=[8, 16], seq_lens=[5000, 1088], block_size=544,
                 heads=(NUM_Q_HEADS, NUM_KV_HEADS), d=HEAD_DIM),
        ]
    for kv in KV_DTYPES:
        for sh in shapes:
            c = make_verify_case(q_lens=sh["q_lens"], seq_lens=sh["seq_lens"],
                                 num_q_heads=sh["heads"][0], num_kv_heads=sh["heads"][1],
                                 head_dim=sh["d"], block_size=sh["block_size"], kv_dtype=kv,
                                 device=device, generator=cpu_gen)
            ref = c.reference()
            row = {"kv": kv, "q_lens": sh["q_lens"], "seq_lens": sh["seq_lens"],
                   "block_size": sh["block_size"]}
            # the defaults at 3 split counts, then the head_split=2 variant of the sweep (its
            # default tile, and tile 32: the per-key path in pages of 16, PAGE_TILES in 544)
            hs2_t32 = {"tile_n": 32, "num_warps": 8, "num_stages": 3} if not smoke else {
                "tile_n": 32}
            for key, kw in (("ours_splits_auto", {"num_splits": None}),
                            ("ours_splits_1", {"num_splits": 1}),
                            ("ours_splits_7", {"num_splits": 7}),
                            ("ours_head_split2_splits_7", {"num_splits": 7, "head_split": 2}),
                            ("ours_head_split2_tile32_splits_7",
                             {"num_splits": 7, "head_split": 2, **hs2_t32}),
                            # the sweep's row_split=2 (4 warps; with int4's head split too)
                            ("ours_row_split2_splits_7",
                             {"num_splits": 7, "row_split": 2, "tile_n": 16,
                              **({} if smoke else {"num_warps": 4, "num_stages": 3})}),
                            ("ours_row_split2_head_split2_splits_1",
                             {"num_splits": 1, "row_split": 2, "head_split": 2, "tile_n": 16})):
                out = torch.full_like(c.q, float("nan"))
                try:
                    run_ours(c, out, **kw)
                    e = rel_err(out, ref)
                    row[key] = e
                    row.setdefault("nan", False)
                    row["nan"] = row["nan"] or bool(torch.isnan(out).any())
                except Exception as exc:  # noqa: BLE001
                    row[key] = f"ERROR {exc!r}"[:300]
                    traceback.print_exc()
            if have_stock:
                out = torch.full_like(c.q, float("nan"))
                try:
                    run_stock(c, out)
                    row["stock"] = rel_err(out, ref)
                except Exception as exc:  # noqa: BLE001
                    row["stock"] = f"ERROR {exc!r}"[:300]
            rows.append(row)
            log("correctness", json.dumps(row))
        # caches written by vLLM's own write path (GPU only): our kernel vs reference on them
        if have_stock and kv != "bf16":
            rows.append(vllm_written_check(kv, device, gen))
    return rows


def vllm_written_check(kv, device, gen) -> dict:
    import torch

    from onecard.kernels.reference import (
        VerifyCase, paged_views, quantize_int4, quantize_int8)
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        triton_reshape_and_cache_flash_per_token_head_quant)
    from vllm.v1.kv_cache_interface import KVQuantMode

    row = {"kv": kv, "check": "vllm-written cache"}
    try:
        bs, seq_len, q_len = 16, 300, 12
        nb = math.ceil(seq_len / bs) + 2
        padded, cdt = (HEAD_DIM + 4, torch.int8) if kv == "int8" else (HEAD_DIM // 2 + 4,
                                                                       torch.uint8)
        cache = torch.zeros(nb, NUM_KV_HEADS, bs, 2 * padded, dtype=cdt, device=device)
        k_c, v_c, ks, vs = paged_views(cache, HEAD_DIM, kv)
        key = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, device=device,
                          generator=gen).to(torch.bfloat16)
        val = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, device=device,
                          generator=gen).to(torch.bfloat16)
        blocks = torch.randperm(nb, device=device, generator=gen)[: math.ceil(seq_len / bs)]
        pos = torch.arange(seq_len, device=device)
        slots = (blocks[pos // bs] * bs + pos % bs).long()
        mode = KVQuantMode.INT8_PER_TOKEN_HEAD if kv == "int8" else KVQuantMode.INT4_PER_TOKEN_HEAD
        triton_reshape_and_cache_flash_per_token_head_quant(key, val, k_c, v_c, ks, vs, slots, mode)
        quant = quantize_int8 if kv == "int8" else quantize_int4
        mine_d, mine_s = quant(key)
        theirs_d = k_c[blocks[pos // bs], pos % bs][..., : mine_d.shape[-1]]
        row["torch_quantizer_bytes_equal_frac"] = float((mine_d == theirs_d).float().mean())
        c = VerifyCase(
            q=torch.randn(q_len, NUM_Q_HEADS, HEAD_DIM, device=device,
                          generator=gen).to(torch.bfloat16),
            key_cache=k_c, value_cache=v_c, k_scale_cache=ks, v_scale_cache=vs,
            cu_seqlens_q=torch.tensor([0, q_len], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
            block_table=blocks.to(torch.int32)[None].contiguous(),
            softmax_scale=HEAD_DIM ** -0.5, kv_dtype=kv, max_query_len=q_len,
            max_seq_len=seq_len, kv_cache=cache)
        ref = c.reference()
        out = torch.full_like(c.q, float("nan"))
        run_ours(c, out)
        row["ours"] = rel_err(out, ref)
        # and the reference's dequantization vs the original bf16 data (format reading)
        from onecard.kernels.reference import dequant_tokens
        deq = dequant_tokens(k_c[blocks[pos // bs], pos % bs], ks[blocks[pos // bs], pos % bs],
                             kv, HEAD_DIM)
        row["dequant_rel_err_vs_bf16"] = float((deq - key.double()).norm() / key.double().norm())
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        row["error"] = repr(exc)[:300]
    log("correctness", json.dumps(row))
    return row


def correctness_ok(rows) -> bool:
    ok = True
    for r in rows:
        for key, val in r.items():
            if key.startswith("ours"):
                if not isinstance(val, float) or not val <= 3e-2:
                    ok = False
        if r.get("nan") or "error" in r:
            ok = False
        if "dequant_rel_err_vs_bf16" in r and not r["dequant_rel_err_vs_bf16"] < (
                0.02 if r["kv"] == "int8" else 0.2):
            ok = False
    return ok


# ------------------------------------------------------------------------------------------------
# 2./3. timing
# ------------------------------------------------------------------------------------------------


def time_config(q_len, ctx, batch, kv, *, device, gen, block_size, l2_bytes, have_stock,
                ours_kw=None, with_stock=True, graph=False) -> dict:
    import torch

    first = timing_case(q_len=q_len, ctx=ctx, batch=batch, kv_dtype=kv, block_size=block_size,
                        device=device, gen=gen)
    kv_bytes = first.kv_bytes
    n_copies = max(1, min(6, math.ceil(4 * l2_bytes / max(1, kv_bytes))))
    cases = [first] + [timing_case(q_len=q_len, ctx=ctx, batch=batch, kv_dtype=kv,
                                   block_size=block_size, device=device, gen=gen)
                       for _ in range(n_copies - 1)]
    outs = [torch.empty_like(c.q) for c in cases]
    row = {"q_len": q_len, "ctx": ctx, "batch": batch, "kv": kv, "kv_bytes": kv_bytes,
           "copies": n_copies, "block_size": block_size, "ours_kw": ours_kw or {}}
    it = [0]

    def ours():
        i = it[0] = (it[0] + 1) % n_copies
        run_ours(cases[i], outs[i], **(ours_kw or {}))

    def stock():
        i = it[0] = (it[0] + 1) % n_copies
        run_stock(cases[i], outs[i])

    try:
        row["ours_ms"] = bench_ms(ours, device)
    except Exception as exc:  # noqa: BLE001
        row["ours_error"] = error_text(exc)
    if graph and "ours_ms" in row:
        try:
            if (g := graph_ms(ours, device)) is not None:
                row["ours_graph_ms"] = g
        except Exception as exc:  # noqa: BLE001
            row["ours_graph_error"] = repr(exc)[:300]
    if have_stock and with_stock:
        try:
            row["stock_ms"] = bench_ms(stock, device)
        except Exception as exc:  # noqa: BLE001
            row["stock_error"] = repr(exc)[:300]
    from onecard.kernels.wide_verify import (KV_MODES, _sm_count, choose_num_splits, default_head_split,
                                             default_launch)
    row["splits"] = (ours_kw or {}).get("num_splits") or choose_num_splits(
        ctx, batch, NUM_KV_HEADS, _sm_count(device))
    block_m = max(16, triton_next_pow2(q_len) * triton_next_pow2(NUM_Q_HEADS // NUM_KV_HEADS))
    row["launch"] = dict(zip(("tile_n", "num_warps", "num_stages"),
                             default_launch(KV_MODES[kv], block_m, HEAD_DIM, device)))
    row["launch"]["head_split"] = default_head_split(KV_MODES[kv], block_m, HEAD_DIM, device)
    row["launch"].update({k: v for k, v in (ours_kw or {}).items() if k != "num_splits"})
    del cases, outs
    return row


def fmt_table(rows, copy_gbps) -> str:
    head = (f"{'q':>3} {'ctx':>7} {'kv':>5} {'B':>2} {'spl':>3} {'ours us':>9} {'stock us':>9} "
            f"{'x stock':>7} {'ours GB/s':>9} {'%copy':>6} {'stock GB/s':>10} {'graph us':>9} {'%copy g':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        o, s = r.get("ours_ms"), r.get("stock_ms")
        gb = r["kv_bytes"] / 1e9
        o_gbps = gb / (o * 1e-3) if o else None
        s_gbps = gb / (s * 1e-3) if s else None
        lines.append(
            f"{r['q_len']:>3} {r['ctx']:>7} {r['kv']:>5} {r['batch']:>2} {r.get('splits', '-'):>3} "
            f"{(o * 1e3 if o else float('nan')):>9.1f} {(s * 1e3 if s else float('nan')):>9.1f} "
            f"{(s / o if o and s else float('nan')):>7.2f} "
            f"{(o_gbps or float('nan')):>9.0f} "
            f"{(100 * o_gbps / copy_gbps if o_gbps and copy_gbps else float('nan')):>6.1f} "
            f"{(s_gbps or float('nan')):>10.0f}"
            # the same calls replayed from a CUDA graph (no wrapper launches: what a server pays)
            + (f" {r['ours_graph_ms'] * 1e3:>9.1f} {100 * gb / (r['ours_graph_ms'] * 1e-3) / copy_gbps:>7.1f}"
               if r.get("ours_graph_ms") and copy_gbps else "")
            + (f"  ours_error={r['ours_error'][:60]}" if "ours_error" in r else "")
            + (f"  stock_error={r['stock_error'][:60]}" if "stock_error" in r else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for kernel_verify.json")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny CPU run under TRITON_INTERPRET=1 (plumbing only, no stock)")
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="stop starting new table rows after this many seconds (default 200)")
    ap.add_argument("--block-size", type=int, default=64,
                    help="KV page size for the timing table (multiple of 16; default 64)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-config sweep")
    ap.add_argument("--q-lens", default="16,8",
                    help="queries per sequence for the table, in order (default 16,8)")
    args = ap.parse_args(argv)
    args.q_lens = [int(x) for x in args.q_lens.split(",") if x]
    if args.block_size % 16:
        ap.error(f"--block-size {args.block_size} is not valid; valid: a multiple of 16")

    t_start = time.time()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        log("no CUDA device: run with TRITON_INTERPRET=1 --smoke for a CPU plumbing check")
        return 2
    import triton

    have_stock = device.type == "cuda"
    gen = torch.Generator(device=device)
    seed = int.from_bytes(os.urandom(4), "little")
    gen.manual_seed(seed)
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "seed": seed}
    try:
        import vllm
        info["vllm"] = vllm.__version__
        info["vllm_path"] = str(Path(vllm.__file__).parent)
    except Exception as exc:  # noqa: BLE001
        info["vllm"] = f"unavailable: {exc!r}"[:200]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["sms"] = props.multi_processor_count
        info["l2_bytes"] = getattr(props, "L2_cache_size", 50 * 2**20)
    log("== env", json.dumps(info))

    result = {"info": info, "correctness": [], "sweep": [], "table": [], "copy": None}
    try:
        from onecard.bench import provenance
        result["provenance"] = provenance.build(token_count_source="n/a (kernel benchmark)",
                                                warmup={"do_bench": "warmup=10ms rep=40ms"})
    except Exception as exc:  # noqa: BLE001
        result["provenance"] = {"error": repr(exc)[:200]}

    def save():
        from onecard.bench.results import atomic_write_json
        atomic_write_json(out_dir / "kernel_verify.json", result)

    # 1. correctness
    log("== 1. correctness vs float64 reference")
    result["correctness"] = correctness(device, gen, args.smoke, have_stock)
    ok = correctness_ok(result["correctness"])
    result["correctness_ok"] = ok
    log(f"correctness: {'OK' if ok else 'FAILED'}")
    save()

    # copy bandwidth
    copy_bytes = 2 * 2**30 if device.type == "cuda" else 2**20
    result["copy"] = copy_bandwidth_gbps(device, copy_bytes)
    copy_gbps = result["copy"]["gbps_read_plus_write"]
    log(f"== device-to-device copy: {copy_gbps:.0f} GB/s (read+write) over {copy_bytes >> 20} MiB")
    l2 = info.get("l2_bytes", 2**20)

    if args.smoke:
        grid = [(4, 64, 1, kv) for kv in KV_DTYPES]
        sweep = {kv: [{"tile_n": 16, "num_warps": 4, "num_stages": 1},
                      {"tile_n": 16, "num_warps": 4, "num_stages": 1, "lazy_rescale": True},
                      {"tile_n": 16, "num_warps": 4, "num_stages": 1, "head_split": 2},
                      {"tile_n": 16, "num_warps": 4, "num_stages": 1, "row_split": 2},
                      {"tile_n": 16, "num_warps": 4, "num_stages": 1, "flat_words": True}]
                 for kv in KV_DTYPES}
        sweep_at = (4, 64, 1)
    else:
        # q=16 first: if the budget runs out, the q=8 rows go
        grid = [(q, ctx, b, kv) for q in args.q_lens for kv in KV_DTYPES
                for ctx in (8192, 32768, 73728, 131072) for b in (1, 4)]
        # the first entry per dtype is the sm_90 default of ``default_launch`` (also timed at 2
        # waves of splits); the others: one knob away from it, plus the old 2-stage choice
        wide = {"tile_n": 32, "num_warps": 8}
        # the default again with lazy_rescale (the accumulator rescaled only when a running max
        # grows by > 2^8): an A/B the compiler's static counts cannot price (docs/wide-verify.md)
        sweep = {
            # {**wide, "num_stages": 1}: the sm_8x default at q 9..16 since session 23 (2 stages
            # did not fit a 3090's 99 KiB of shared memory): its cost against the stages here
            "bf16": [{**wide, "num_stages": 4}, {**wide, "num_stages": 1},
                     {**wide, "num_stages": 4, "lazy_rescale": True}, {**wide, "num_stages": 3},
                     {"tile_n": 64, "num_warps": 8, "num_stages": 2}, {**wide, "num_stages": 2}],
            "int8": [{"tile_n": 16, "num_warps": 8, "num_stages": 4},
                     {"tile_n": 16, "num_warps": 8, "num_stages": 4, "lazy_rescale": True},
                     {"tile_n": 16, "num_warps": 8, "num_stages": 6},
                     {"tile_n": 16, "num_warps": 8, "num_stages": 3},
                     {**wide, "num_stages": 4}, {**wide, "num_stages": 3},
                     {**wide, "num_stages": 2},
                     {"tile_n": 64, "num_warps": 8, "num_stages": 3},
                     {"tile_n": 64, "num_warps": 8, "num_stages": 2}],
        }
        # int8 / int4 larger tiles (2026-12-04, issue #7): the tile loop is latency-bound per
        # tile (q=8 is no faster than q=16), so a larger tile could amortize the per-tile chain
        # (unpack -> shared -> barrier -> wgmma, twice) if its spills stay out of the loop; the
        # sweep's page (--block-size, 64) keeps every tile on the PAGE_TILES path. vLLM's int8
        # page on the 27B is 1584 tokens = 16 x 99: tile 32 / 64 do not divide it, so in serving
        # they run the per-key (masked, division per key) path. Rows with "block_size": 1584 time
        # exactly that, next to the default at the same page.
        sweep["int4"] = [kw for kw in sweep["int8"]]
        sweep["int8"] += [{"tile_n": 16, "num_warps": 8, "num_stages": 4, "block_size": 1584},
                          {**wide, "num_stages": 3, "block_size": 1584},
                          {"tile_n": 64, "num_warps": 8, "num_stages": 2, "block_size": 1584}]
        # head_split=2 (2026-12-04, docs/wide-verify.md "head split"): the head dim in halves
        # (two K dots summed, two 128 x 128 accumulators), so a tile's unpacked K / V is half as
        # wide; sm_90 compile: int4 tile 16 244 -> 218 registers, tiles 32 / 64 fit like today's
        # tile 16, but 9 instead of 5 barriers per tile. Tiles 16 / 32 / 64 at 4 / 3 / 2 stages
        # for int8 and int4 (best guesses first); bf16 once, at its default.
        # (session 26: trimmed to the tiles / stages within 10 % of the best in sessions 24-25,
        # to leave time for the row-split rows below)
        hs2 = [{"tile_n": t, "num_warps": 8, "num_stages": s, "head_split": 2}
               for t in (16, 32) for s in (4, 3)]
        sweep["int8"] += hs2
        sweep["int4"] += hs2
        sweep["bf16"].append({**wide, "num_stages": 4, "head_split": 2})
        # int4's sm_90 default has head_split 2 since session 25 (default_head_split: -20 % twice):
        # it leads the int4 list; every other row names its head_split (1 unless it says 2), so a
        # row means the same launch whatever the default
        new_default = {"tile_n": 16, "num_warps": 8, "num_stages": 4, "head_split": 2}
        sweep["int4"] = [new_default] + [kw for kw in sweep["int4"] if kw != new_default]
        # row_split=2 (session 26, docs/wide-verify.md "row split"): the verify block's 128 query
        # rows in two programs of 64 over the same keys, 4 warps each. The tile loop is
        # latency-bound at one 8-warp program per SM (int8 ~2.9 us per 16-key tile, 25 % issue
        # use); a 64-row program fits twice per SM (sm_90 compile: 255 registers x 128 threads,
        # 64 KiB of shared memory at tile 16 / 2-4 stages; bf16 tile 32: 96 KiB at 2 stages, 128
        # at 3), so one program's waits overlap the other's work. Right after each dtype's
        # default, so the budget never drops them.
        rs2 = {"int8": [{"tile_n": 16, "num_warps": 4, "num_stages": s, "row_split": 2} for s in (3, 2, 4)]
                       + [{"tile_n": 16, "num_warps": 4, "num_stages": 3, "row_split": 2, "head_split": 2}],
               "int4": [{"tile_n": 16, "num_warps": 4, "num_stages": s, "row_split": 2, "head_split": 2}
                        for s in (3, 4)]
                       + [{"tile_n": 16, "num_warps": 4, "num_stages": s, "row_split": 2} for s in (3, 2)],
               "bf16": [{"tile_n": 32, "num_warps": 4, "num_stages": 2, "row_split": 2},
                        {"tile_n": 16, "num_warps": 4, "num_stages": 4, "row_split": 2}]}
        for kv in sweep:
            sweep[kv] = sweep[kv][:1] + rs2[kv] + sweep[kv][1:]
        # flat_words (session 27, docs/wide-verify.md "bank conflicts"): int8 / int4 words loaded
        # as one flat vector, so Triton stages them row-major instead of key-fastest (a 16-way
        # bank conflict on every cp.async store and LDS of the words, ncu). The default with it
        # toggled comes right after the default; every row names its flat_words from here on.
        from onecard.kernels.wide_verify import KV_MODES, default_flat_words
        for kv in ("int8", "int4"):
            flat = default_flat_words(KV_MODES[kv], device)
            first = sweep[kv][0]
            sweep[kv] = [first, {**first, "flat_words": not flat}] + sweep[kv][1:]
            sweep[kv] = [{"flat_words": flat, **kw} for kw in sweep[kv]]
        for kv in sweep:
            sweep[kv] = [{"head_split": 1, **kw} for kw in sweep[kv]]
        sweep_at = (16, 32768, 1)

    def table_rows(rows):
        skipped = 0
        for q, ctx, b, kv in rows:
            if time.time() - t_start > args.budget_s:
                skipped += 1
                continue
            r = time_config(q, ctx, b, kv, device=device, gen=gen, block_size=args.block_size,
                            l2_bytes=l2, have_stock=have_stock, graph=True)
            result["table"].append(r)
            log("row", json.dumps({k: v for k, v in r.items() if k != "ours_kw"}))
            save()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return skipped

    # 2. the table for the first q_len (the one that matters most), 3. the sweep, 4. the rest
    # the lent GPU idles at 345 MHz: keep it busy for a few seconds so the first rows are not
    # measured on a ramping clock (2026-12-02: the first q=16 rows read up to 1.7x slower than the
    # same shape in the sweep a minute later)
    spin_s = 3.0 if device.type == "cuda" else 0.0
    t_spin = time.time()
    if spin_s:
        a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        while time.time() - t_spin < spin_s:
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    log(f"== 2. table, q={args.q_lens[0]} (after a {spin_s:.0f} s clock warm-up)")
    first = [g for g in grid if g[0] == args.q_lens[0]]
    skipped = table_rows(first)
    if not args.no_sweep:
        log("== 3. launch-config sweep (ours only)")
        from onecard.kernels.wide_verify import _sm_count, choose_num_splits
        sweep_skipped = 0
        for kv in KV_DTYPES:
            for j, kw in enumerate(sweep[kv]):
                if j and time.time() - t_start > args.budget_s + 20:
                    # job 30 kills the bench at 195 s: past the budget only the defaults run
                    sweep_skipped += 1
                    continue
                for waves in ((1.0, 2.0) if j == 0 else (1.0,)):
                    q, ctx, b = sweep_at
                    ns = choose_num_splits(ctx, b, NUM_KV_HEADS, _sm_count(device), waves=waves)
                    launch = {k: v for k, v in kw.items() if k != "block_size"}
                    r = time_config(q, ctx, b, kv, device=device, gen=gen,
                                    block_size=kw.get("block_size", args.block_size), l2_bytes=l2,
                                    have_stock=False, ours_kw={**launch, "num_splits": ns},
                                    with_stock=False)
                    r["waves"] = waves
                    result["sweep"].append(r)
                    log("sweep", kv, kw, f"waves={waves} splits={ns}",
                        f"{r['ours_ms'] * 1e3:.1f} us" if "ours_ms" in r else r.get("ours_error"))
                    if "ours_error" in r:
                        break  # other wave counts of a failing config fail the same way
        if sweep_skipped:
            log(f"{sweep_skipped} sweep rows skipped "
                f"(over --budget-s {args.budget_s:.0f} + 20 s)")
        result["skipped_sweep_rows_over_budget"] = sweep_skipped
        save()
    log("== 4. table, other q_len (within --budget-s)")
    skipped += table_rows([g for g in grid if g[0] != args.q_lens[0]])
    result["skipped_rows_over_budget"] = skipped
    result["elapsed_s"] = time.time() - t_start
    save()

    # summary
    log("")
    log(f"== wide-verify attention ({info['device']}, {NUM_Q_HEADS}q/{NUM_KV_HEADS}kv heads, "
        f"head_dim {HEAD_DIM}, page {args.block_size}; copy {copy_gbps:.0f} GB/s)")
    if result["sweep"]:
        log(f"sweep at q={sweep_at[0]} ctx={sweep_at[1]} batch={sweep_at[2]} "
            "(first row per dtype = the sm_90 default):")
        for r in result["sweep"]:
            kw = r["ours_kw"]
            t = (f"{r['ours_ms'] * 1e3:9.1f} us" if "ours_ms" in r
                 else f"ERROR {r['ours_error'][:60]}")
            gbps = (r["kv_bytes"] / (r["ours_ms"] * 1e-3) / 1e9) if "ours_ms" in r else None
            pct = f"{100 * gbps / copy_gbps:5.1f} %copy" if gbps and copy_gbps else ""
            log(f"  {r['kv']:>5} tile {kw.get('tile_n')} warps {kw.get('num_warps')} stages "
                f"{kw.get('num_stages')} splits {kw.get('num_splits')} (waves {r['waves']})"
                f"{' lazy' if kw.get('lazy_rescale') else ''}"
                f"{' head_split %d' % kw['head_split'] if kw.get('head_split', 1) != 1 else ''}"
                f"{' row_split %d' % kw['row_split'] if kw.get('row_split', 1) != 1 else ''}"
                f"{' flat_words %d' % kw['flat_words'] if 'flat_words' in kw else ''}"
                f"{'' if r['block_size'] == args.block_size else ' page %d' % r['block_size']}"
                f": {t} {pct}")
    long_rows = [r for r in result["table"] if r["ctx"] >= 32768 and "ours_ms" in r
                 and "stock_ms" in r]
    if long_rows:
        sp = [r["stock_ms"] / r["ours_ms"] for r in long_rows]
        bw = [r["kv_bytes"] / (r["ours_ms"] * 1e-3) / 1e9 / copy_gbps * 100 for r in long_rows]
        log(f"ctx >= 32k: speedup over stock min {min(sp):.2f}x median {statistics.median(sp):.2f}x;"
            f" %copy-bandwidth min {min(bw):.0f}% median {statistics.median(bw):.0f}%"
            f" (goal >= 2x, >= 70%)")
        bwg = [r["kv_bytes"] / (r["ours_graph_ms"] * 1e-3) / 1e9 / copy_gbps * 100 for r in long_rows
               if r.get("ours_graph_ms")]
        if bwg:
            log(f"ctx >= 32k, CUDA-graph replay: %copy-bandwidth min {min(bwg):.0f}% median "
                f"{statistics.median(bwg):.0f}% max {max(bwg):.0f}%")
    if skipped:
        log(f"{skipped} table rows skipped (over --budget-s {args.budget_s:.0f})")
    log(f"correctness: {'OK' if ok else 'FAILED'}; results: {out_dir / 'kernel_verify.json'}")
    log(fmt_table(result["table"], copy_gbps))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
