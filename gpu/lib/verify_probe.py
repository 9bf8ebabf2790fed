"""Wide-verify kernel probe for a short lease: no vLLM needed (the image's torch + Triton, this tree).

  PYTHONPATH=. python3 gpu/lib/verify_probe.py [--out DIR] [--smoke] [--arms NAME,...]

1. correctness of the probed launches against the float64 reference at the model's head
   geometry (24 q / 4 kv heads, head_dim 256), bf16 / int8 / int4 KV;
2. the q=16 verify kernel at 32k (batch 1 and 4) and 128k (batch 1): each arm's launches, same
   split count (one wave of programs), CUDA-event medians (triton.testing.do_bench).
int4 needs vLLM's Hadamard sign vector; without vLLM a stand-in (fixed random +-1 signs, the same
for the kernel and the reference) is installed, which changes nothing in the timing.
Prints one line per row and writes verify_probe.json (each row as it lands) under --out. The full
comparison (stock, the sweep) is job 30's; this is the quick look when the budget is short.
Session 26 built it for row_split (slower: docs/wide-verify.md), session 27 for flat_words
(-33 % on int8, measured in session 28), session 28 added the occupancy arm, session 29 the qkint8 arm.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_D8 = {"tile_n": 16, "num_warps": 8, "num_stages": 4}
# arm -> [(kv, launch kwargs), ...]; the first launch of an arm is its baseline
ARMS = {
    # session 27: int8 / int4 tiles staged flat (no 16-way bank conflicts) vs the 2-D load
    "flat": [("int8", {**_D8, "flat_words": False}), ("int8", {**_D8, "flat_words": True}),
             ("int8", {**_D8, "head_split": 2, "flat_words": True}),
             ("int8", {**_D8, "flat_words": True, "lazy_rescale": True}),
             ("int8", {"tile_n": 32, "num_warps": 8, "num_stages": 3, "flat_words": True}),
             ("int4", {**_D8, "head_split": 2, "flat_words": False}),
             ("int4", {**_D8, "head_split": 2, "flat_words": True}),
             ("int4", {**_D8, "head_split": 1, "flat_words": False}),
             ("int4", {**_D8, "head_split": 1, "flat_words": True}),
             ("bf16", {"tile_n": 32, "num_warps": 8, "num_stages": 4})],
    # the same question in five launches (a lease with ~5 minutes left)
    "flat-lean": [("int8", {**_D8, "flat_words": False}), ("int8", {**_D8, "flat_words": True}),
                  ("int4", {**_D8, "head_split": 1, "flat_words": False}),
                  ("int4", {**_D8, "head_split": 1, "flat_words": True}),
                  ("int4", {**_D8, "head_split": 2, "flat_words": True})],
    # session 28, after flat words: the kernel now waits on its MMAs at 1 program of 8 warps per
    # SM (255 registers, 131 KiB of shared memory, occupancy 12.5 %). Do two programs per SM (row
    # split, 4 warps, fewer stages) win now that the shared-memory pipe is free? The int8
    # head_split 2 row a third time (5-7 % in session 28, under the 10 % a default moves on).
    "occupancy": [("int8", {**_D8, "flat_words": True}),
                  ("int8", {"tile_n": 16, "num_warps": 4, "num_stages": 3, "row_split": 2, "flat_words": True}),
                  ("int8", {"tile_n": 16, "num_warps": 4, "num_stages": 2, "row_split": 2, "flat_words": True}),
                  ("int8", {"tile_n": 16, "num_warps": 4, "num_stages": 3, "row_split": 2, "head_split": 2,
                            "flat_words": True}),
                  ("int8", {**_D8, "head_split": 2, "flat_words": True}),
                  ("int8", {"tile_n": 16, "num_warps": 8, "num_stages": 2, "flat_words": True}),
                  ("int4", {**_D8, "head_split": 2, "flat_words": True}),
                  ("int4", {"tile_n": 16, "num_warps": 4, "num_stages": 3, "row_split": 2, "head_split": 2,
                            "flat_words": True})],
    # session 29: Q.K^T as an int8 dot of the row-quantized query with the key bytes as stored
    # (qk_int8). The compiler (sm_90, Triton 3.9): 8 IGMMA instead of 16 HGMMA a tile, no K
    # unpack or bf16 store of K, tile loop 592 -> 506 instructions (head_split 2: 579 -> 521).
    # Correctness here is against the plain reference: the rel err shows what the query's
    # quantization costs at the model's geometry.
    "qkint8": [("int8", {**_D8, "flat_words": True}),
               ("int8", {**_D8, "flat_words": True, "qk_int8": True}),
               ("int8", {**_D8, "head_split": 2, "flat_words": True}),
               ("int8", {**_D8, "head_split": 2, "flat_words": True, "qk_int8": True})],
    # session 33: the launches a CTX=long server makes (the wrapper's defaults, int8 KV), with and
    # without qk_int8; run with --q 1,4 --shapes 32768x1,73728x1 to split SPEC=mtp's step at depth
    # into its verify attention (q 4: MTP's block of 1 + 3 drafts) and a plain step's (q 1)
    "server": [("int8", {}), ("int8", {"qk_int8": True})],
    # session 33: every KV dtype at the wrapper's defaults (what a server runs), for issue #7's
    # table with % of the copy bandwidth (--shapes 8192x1,...,131072x4 --q 1,8,16)
    "defaults": [("bf16", {}), ("int8", {}), ("int4", {})],
    # session 26: row_split 2 (4 warps, two programs an SM) vs each default
    "rowsplit": [("int8", dict(_D8)),
                 ("int8", {"tile_n": 16, "num_warps": 4, "num_stages": 3, "row_split": 2}),
                 ("bf16", {"tile_n": 32, "num_warps": 8, "num_stages": 4}),
                 ("bf16", {"tile_n": 32, "num_warps": 4, "num_stages": 2, "row_split": 2})],
}


def install_rht_stub() -> bool:
    """Without vLLM: a stand-in for ``vllm.v1.attention.ops.int4_per_token_head._get_rht_signs``
    (fixed random +-1 signs per (d, seed)), so int4 runs and its reference agrees. True if
    installed."""
    try:
        from vllm.v1.attention.ops.int4_per_token_head import _get_rht_signs  # noqa: F401
        return False
    except Exception:  # noqa: BLE001 - no vLLM, or one that lacks the helper
        pass
    import types

    import torch

    cache: dict = {}

    def _get_rht_signs(d, seed, device):
        key = (int(d), int(seed), str(device))
        if key not in cache:
            g = torch.Generator().manual_seed(4242 + int(seed))
            cache[key] = (torch.randint(0, 2, (int(d),), generator=g) * 2 - 1).float().to(device)
        return cache[key]

    names = ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops")
    for name in names:
        sys.modules.setdefault(name, types.ModuleType(name))
    mod = types.ModuleType("vllm.v1.attention.ops.int4_per_token_head")
    mod._get_rht_signs = _get_rht_signs
    sys.modules[mod.__name__] = mod
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU interpreter)")
    ap.add_argument("--arms", default="flat",
                    help="comma-separated; valid: " + ", ".join(ARMS) + " (or none: '' with --decode-check)")
    ap.add_argument("--decode-check", action="store_true",
                    help="first, one-token decode (and 4-token) launches as a server makes them (auto "
                         "splits, default launch) for bf16 / int8 / int4 at SmolLM2's head geometry "
                         "(9 q / 3 kv heads, d 64) and the model's, ragged contexts, NaN past the end")
    ap.add_argument("--q", default="16", help="comma-separated query tokens per sequence to time (1..16)")
    ap.add_argument("--shapes", default="32768x1,32768x4,131072x1",
                    help="comma-separated CONTEXTxBATCH to time (the --smoke run times 64x1)")
    a = ap.parse_args(argv)
    try:
        qs = [int(x) for x in a.q.split(",") if x]
        shapes = [(int(c), int(b)) for c, b in (x.split("x") for x in a.shapes.split(",") if x)]
        if not qs or not shapes or any(not 1 <= x <= 16 for x in qs) or any(c < 1 or b < 1 for c, b in shapes):
            raise ValueError
    except ValueError:
        ap.error(f"--q {a.q!r} / --shapes {a.shapes!r}: expected e.g. --q 1,4,16 (each 1..16) "
                 "--shapes 32768x1,73728x4 (context x batch, each >= 1)")
    arms = [x for x in a.arms.split(",") if x]
    bad = [x for x in arms if x not in ARMS]
    if bad or not (arms or a.decode_check):
        ap.error(f"--arms {a.arms!r} is not valid; valid: {', '.join(ARMS)}")
    stub = install_rht_stub()
    import torch

    from bench.kernel_verify import (HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, error_text, rel_err,
                                     run_ours, time_config)
    from onecard.kernels.reference import make_verify_case
    from onecard.kernels.wide_verify import _sm_count, choose_num_splits

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(26)  # make_verify_case builds on the CPU
    # timing_case fills its caches on the device: a generator of that device
    tgen = torch.Generator(device=dev).manual_seed(26)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "rht_signs": "stand-in (no vLLM)" if stub else "vLLM", "arms": arms,
           "correctness": [], "timing": [], "recheck": [], "decode_check": []}

    def save():
        tmp = out_dir / "verify_probe.json.tmp"
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(out_dir / "verify_probe.json")

    if a.decode_check:
        res["decode_check"] = decode_check(dev, gen, smoke=a.smoke)
        save()

    def launch(kw):
        if a.smoke:  # the interpreter ignores warps / stages; keep the compile-shaping knobs
            return {k: v for k, v in kw.items() if k not in ("num_warps", "num_stages")}
        return kw

    launches = [(kv, kw) for arm in arms for kv, kw in ARMS[arm]]
    heads, d = ((6, 2), 32) if a.smoke else ((NUM_Q_HEADS, NUM_KV_HEADS), HEAD_DIM)
    lens = ([16, 3], [70, 21]) if a.smoke else ([16, 9, 1, 16], [1000, 4099, 37, 8192])
    cases = {}
    for kv, kw in launches:
        if kv not in cases:
            # page 16: PAGE_TILES holds for tile 16 only; tile 32 takes the per-key path here
            # (the timing cases below use page 64)
            c = make_verify_case(q_lens=lens[0], seq_lens=lens[1], num_q_heads=heads[0],
                                 num_kv_heads=heads[1], head_dim=d, block_size=16, kv_dtype=kv,
                                 device=dev, generator=gen)
            cases[kv] = (c, c.reference())
        c, ref = cases[kv]
        o = torch.full_like(c.q, float("nan"))
        try:  # one launch that does not compile (a new option on the device's Triton) is its own row
            run_ours(c, o, **launch({**kw, "num_splits": 7}))
        except Exception as exc:  # noqa: BLE001
            err = error_text(exc)
            res["correctness"].append({"kv": kv, "kw": kw, "error": err, "ok": False})
            print(f"correctness {kv} {kw}: ERROR {err}", flush=True)
            continue
        e = rel_err(o, ref)
        ok = e <= 3e-2 and not bool(torch.isnan(o).any())
        res["correctness"].append({"kv": kv, "kw": kw, "rel_err": e, "ok": ok})
        print(f"correctness {kv} {kw}: rel err {e:.4f} {'OK' if ok else 'FAILED'}", flush=True)
    save()

    if a.smoke:
        shapes = [(64, 1)]
    copy_gbps = None
    if dev.type == "cuda":  # device-to-device copy, read + write, as job 30 measures it
        from bench.kernel_verify import copy_bandwidth_gbps

        res["copy"] = copy_bandwidth_gbps(dev, 1 << 30)
        copy_gbps = res["copy"]["gbps_read_plus_write"]
        print(f"copy bandwidth {copy_gbps:.0f} GB/s (read + write)", flush=True)
        save()
    block = 16 if a.smoke else 64
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size if dev.type == "cuda" else 2 ** 20

    def timed(q, ctx, b, kv, kw, key="timing"):
        ns = choose_num_splits(ctx, b, NUM_KV_HEADS, _sm_count(dev))
        r = time_config(q, ctx, b, kv, device=dev, gen=tgen, block_size=block, l2_bytes=l2,
                        have_stock=False, ours_kw={**launch(kw), "num_splits": ns}, with_stock=False)
        r.pop("case", None)
        if "ours_ms" in r:
            r["kv_gbps"] = r["kv_bytes"] / (r["ours_ms"] * 1e-3) / 1e9
            if copy_gbps:
                r["pct_copy"] = 100.0 * r["kv_gbps"] / copy_gbps
        res[key].append(r)
        save()
        t = f"{r['ours_ms'] * 1e3:8.1f} us" if "ours_ms" in r else (r.get("ours_error") or "?").strip().splitlines()[-1][:120]
        if "pct_copy" in r:
            t += f", {r['kv_gbps']:.0f} GB/s of KV, {r['pct_copy']:.1f} % of copy"
        print(f"{'recheck ' if key == 'recheck' else ''}q{q} ctx {ctx} b{b} {kv} {kw} splits {ns}: {t}", flush=True)

    order = [(q, ctx, b) for ctx, b in shapes for q in qs]
    for q, ctx, b in order:
        for kv, kw in launches:
            timed(q, ctx, b, kv, kw)
    # the first shape once more, last: session 33's first b1 rows of a process disagreed with every
    # other measurement of the same launch (int8 32k b1 148 us vs 95-97 us); a recheck row that
    # differs from its first row marks that row as suspect in the process's own output
    if len(order) > 1:
        for kv, kw in launches:
            timed(*order[0], kv, kw, key="recheck")
    print(f"verify_probe.json in {out_dir}")
    return 0 if all(x["ok"] for x in res["correctness"] + res["decode_check"]) else 1


# contexts around tile / page edges and the lengths of job 32's texts (SmolLM2: 21-31 prompt tokens
# and ~1,920-2,070 with 96 generated), four ragged sequences a launch
DECODE_LENS = [[1, 15, 16, 17], [27, 28, 31, 33], [63, 64, 65, 100], [123, 127, 128, 129],
               [1920, 1921, 2016, 2047]]


def decode_check(dev, gen, smoke: bool = False) -> list[dict]:
    """One-token (and 4-token) launches with the wrapper's defaults (auto splits from max_seq_len,
    default launch, as patch 0070 calls it), NaN poison past the end, vs the float64 reference."""
    from bench.kernel_verify import error_text, rel_err, run_ours
    from onecard.kernels.reference import make_verify_case

    import torch

    geoms = [(9, 3, 64)] if smoke else [(9, 3, 64), (24, 4, 256)]
    lens_sets = DECODE_LENS[:2] if smoke else DECODE_LENS
    rows = []
    for kv in ("int4", "int8", "bf16"):
        for hq, hk, d in geoms:
            for q_len in (1, 4):
                for lens in lens_sets:
                    lens_q = [min(q_len, sl) for sl in lens]
                    c = make_verify_case(q_lens=lens_q, seq_lens=lens, num_q_heads=hq, num_kv_heads=hk,
                                         head_dim=d, block_size=16, kv_dtype=kv, device=dev, generator=gen)
                    c.poison_past_the_end()
                    ref = c.reference()
                    o = torch.full_like(c.q, float("nan"))
                    row = {"kv": kv, "heads": [hq, hk], "head_dim": d, "q_len": q_len, "seq_lens": lens}
                    try:
                        run_ours(c, o)
                        row["rel_err"] = rel_err(o, ref)
                        row["nan"] = bool(torch.isnan(o).any())
                        row["ok"] = row["rel_err"] <= 3e-2 and not row["nan"]
                    except Exception as exc:  # noqa: BLE001
                        row.update(error=error_text(exc), ok=False)
                    rows.append(row)
                    if not row["ok"]:
                        print(f"decode-check FAILED {row}", flush=True)
    n_bad = sum(not r["ok"] for r in rows)
    print(f"decode-check: {len(rows) - n_bad}/{len(rows)} launches OK", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
