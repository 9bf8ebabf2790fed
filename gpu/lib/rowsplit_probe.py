"""Row-split probe for a short lease: no vLLM needed (the image's torch + Triton, this tree).

  PYTHONPATH=. python3 gpu/lib/rowsplit_probe.py [--out DIR] [--smoke]

1. correctness of ``row_split=2`` against the float64 reference at the model's head geometry
   (24 q / 4 kv heads, head_dim 256), bf16 and int8 KV (int4 needs vLLM's RHT signs: job 30);
2. the q=16 verify kernel at 32k, batch 1 and 4: each dtype's default launch vs row_split 2,
   same splits (one wave of 8-warp programs), CUDA-event medians (triton.testing.do_bench).
Prints one line per row and writes rowsplit.json (each row as it lands) under --out. The full
comparison (int4, stock, the sweep) is job 30's; this is the quick look when the budget is short.
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


# row_split 2 launches (4 warps: two programs per SM on sm_90; docs/wide-verify.md "row split")
RS2 = {"bf16": {"tile_n": 32, "num_warps": 4, "num_stages": 2, "row_split": 2},
       "int8": {"tile_n": 16, "num_warps": 4, "num_stages": 3, "row_split": 2}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU interpreter)")
    a = ap.parse_args(argv)
    import torch

    from bench.kernel_verify import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, rel_err, run_ours, time_config
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
           "correctness": [], "timing": []}

    def save():
        tmp = out_dir / "rowsplit.json.tmp"
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(out_dir / "rowsplit.json")

    heads, d = ((6, 2), 32) if a.smoke else ((NUM_Q_HEADS, NUM_KV_HEADS), HEAD_DIM)
    lens = ([16, 3], [70, 21]) if a.smoke else ([16, 9, 1, 16], [1000, 4099, 37, 8192])
    for kv in ("bf16", "int8"):
        c = make_verify_case(q_lens=lens[0], seq_lens=lens[1], num_q_heads=heads[0],
                             num_kv_heads=heads[1], head_dim=d, block_size=16, kv_dtype=kv,
                             device=dev, generator=gen)
        ref = c.reference()
        # the timing arms' launches (one compile each: num_splits is not specialized)
        rs2 = dict(RS2[kv])
        if a.smoke:
            rs2 = {k: v for k, v in rs2.items() if k not in ("num_warps", "num_stages")}
        for kw in ({}, {**rs2, "num_splits": 7}):
            o = torch.full_like(c.q, float("nan"))
            run_ours(c, o, **kw)
            e = rel_err(o, ref)
            ok = e <= 3e-2 and not bool(torch.isnan(o).any())
            res["correctness"].append({"kv": kv, "kw": kw, "rel_err": e, "ok": ok})
            print(f"correctness {kv} {kw}: rel err {e:.4f} {'OK' if ok else 'FAILED'}", flush=True)
    save()

    q, ctxs, batches = (16, (64,), (1,)) if a.smoke else (16, (32768,), (1, 4))
    block = 16 if a.smoke else 64
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size if dev.type == "cuda" else 2 ** 20
    # each dtype's default first, then row_split 2 at the stage counts and head splits whose sm_90
    # compiles fit two programs an SM (scripts/wide_verify_sass.py --row-split 2)
    rs = {"tile_n": 16, "num_warps": 4, "row_split": 2}
    arms = {"int8": [{"tile_n": 16, "num_warps": 8, "num_stages": 4}, RS2["int8"],
                     {**rs, "num_stages": 2}, {**rs, "num_stages": 4},
                     {**rs, "num_stages": 3, "head_split": 2},
                     {**rs, "tile_n": 32, "num_stages": 2, "head_split": 2}],
            "bf16": [{"tile_n": 32, "num_warps": 8, "num_stages": 4}, RS2["bf16"]]}
    for ctx in ctxs:
        for b in batches:
            ns = choose_num_splits(ctx, b, NUM_KV_HEADS, _sm_count(dev))
            for kv, kws in arms.items():
                for kw in kws:
                    if a.smoke:
                        kw = {k: v for k, v in kw.items() if k not in ("num_warps", "num_stages")}
                    r = time_config(q, ctx, b, kv, device=dev, gen=tgen, block_size=block, l2_bytes=l2,
                                    have_stock=False, ours_kw={**kw, "num_splits": ns}, with_stock=False)
                    r.pop("case", None)
                    res["timing"].append(r)
                    save()
                    t = f"{r['ours_ms'] * 1e3:8.1f} us" if "ours_ms" in r else r.get("ours_error", "?")[:80]
                    print(f"q{q} ctx {ctx} b{b} {kv} {kw} splits {ns}: {t}", flush=True)
    print(f"rowsplit.json in {out_dir}")
    return 0 if all(x["ok"] for x in res["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
