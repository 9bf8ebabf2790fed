"""One wide-verify launch configuration, called a few times, for gpu/lib/ncu_probe.sh.

  PYTHONPATH=. python3 gpu/lib/ncu_launch.py --list
  PYTHONPATH=. python3 gpu/lib/ncu_launch.py --label int8-default [--ctx 32768] [--calls 3]

q=16 verify blocks, batch 1, the model's heads (24 q / 4 kv, head_dim 256), page 64, the split
count the wrapper picks for one wave. The profiler skips the first calls (compile, warm-up) and
measures one; the output is checked against the float64 reference at the end, so a wrong launch
cannot pass for a fast one.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO, Path(__file__).resolve().parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

LAUNCHES = {
    "int8-default": ("int8", {"tile_n": 16, "num_warps": 8, "num_stages": 4, "flat_words": False}),
    "int8-flat": ("int8", {"tile_n": 16, "num_warps": 8, "num_stages": 4, "flat_words": True}),
    "int4-default": ("int4", {"tile_n": 16, "num_warps": 8, "num_stages": 4, "head_split": 2,
                              "flat_words": False}),
    "int4-hs1": ("int4", {"tile_n": 16, "num_warps": 8, "num_stages": 4, "head_split": 1,
                          "flat_words": False}),
    "bf16-default": ("bf16", {"tile_n": 32, "num_warps": 8, "num_stages": 4}),
    # session 28's question: two programs per SM once the words' bank conflicts are gone
    "int8-rs2-flat": ("int8", {"tile_n": 16, "num_warps": 4, "num_stages": 3, "row_split": 2,
                               "flat_words": True}),
    # session 29: Q.K^T as an int8 dot (IGMMA on the key bytes as stored; no K unpack)
    "int8-qk8": ("int8", {"tile_n": 16, "num_warps": 8, "num_stages": 4, "flat_words": True,
                          "qk_int8": True}),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the labels and exit")
    ap.add_argument("--label", choices=sorted(LAUNCHES))
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args(argv)
    if a.list:
        print(" ".join(LAUNCHES))
        return 0
    if a.label is None:
        ap.error("--label is required (valid: " + ", ".join(sorted(LAUNCHES)) + ")")
    from verify_probe import install_rht_stub  # int4 without vLLM: fixed +-1 signs

    install_rht_stub()
    import torch

    from bench.kernel_verify import NUM_KV_HEADS, rel_err, run_ours, timing_case
    from onecard.kernels.wide_verify import _sm_count, choose_num_splits

    kv, kw = LAUNCHES[a.label]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: TRITON_INTERPRET smoke
    gen = torch.Generator(device=dev).manual_seed(27)  # timing_case fills on the device
    case = timing_case(q_len=16, ctx=a.ctx, batch=1, kv_dtype=kv, block_size=64, device=dev, gen=gen)
    ns = choose_num_splits(a.ctx, 1, NUM_KV_HEADS, _sm_count(dev))
    out = torch.empty_like(case.q)
    for _ in range(a.calls):
        run_ours(case, out, num_splits=ns, **kw)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    err = rel_err(out, case.reference())
    print(f"{a.label}: {kw} splits {ns}, rel err {err:.4f}")
    return 0 if err <= 3e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
