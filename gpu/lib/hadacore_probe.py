"""Does vLLM's hadacore Hadamard transform return what it should, for every row count?

Hypothesis (2026-12-06, read from vLLM 0.27.1's csrc/.../hadacore/hadamard_transform_cuda.cu):
for a head size <= 256 and more than 256 elements, run_fht launches two 256-element chunks per
warp; with an odd chunk count the last warp runs the masked kernel, whose cp.async.wait_group is
chosen by `switch (k + diff_num_chunks)` = case -1, which matches nothing: the warp reads its
shared memory before the copy of its chunk has landed. Its 256 elements (4 rows of 64, 2 of 128,
1 of 256) then come out of whatever the shared memory last held. For SmolLM2 (head_dim 64, 9 query
and 3 KV heads) every decode step's query (9 x 64 = 576 elements -> 3 chunks) is such a call.

Result (H100, 2026-12-06): the kernel alone was right in all 120 cases, the 53 predicted ones
included, with and without vLLM; in a server the same calls made stock int4 decode return NaN in
8 of 8 texts, and padding them removed it (docs/measurements.md, session 32). So the calls are
the culprit; the race above is a candidate mechanism that this probe does not reproduce.

The probe fills the shared memory with NaN first (a hadacore call over a NaN tensor large enough
to cover every SM), then transforms random rows and compares with a float64 reference, for head
sizes 64 / 128 / 256 and 1..ROWS rows, three ways: hadacore as vLLM calls it; hadacore on the
rows padded to chunk pairs (what patch 0021 does); and, when vLLM imports, through vLLM's
`fast_hadamard_transform` (the wrapper int4 KV calls: patched or not, whichever PYTHONPATH gives).
Prints one line per bad case, a summary, and writes JSON to --out.

    PYTHONPATH=/var/tmp/site python3 gpu/lib/hadacore_probe.py --out /var/tmp/out/hadacore
    python3 gpu/lib/hadacore_probe.py --so _C_stable_libtorch.abi3.so   # the op alone, no vLLM
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO, REPO / "gpu" / "lib"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from jobutil import write_json  # noqa: E402  (gpu/lib/jobutil.py: atomic)
from onecard.kernels.reference import _hadamard  # noqa: E402  (imports torch only)


def predicted_bad(rows: int, d: int) -> bool:
    """The launch the hypothesis blames: more than 256 elements, an odd count of 256-element
    chunks after hadacore's own padding to a multiple of 256, head size <= 256."""
    n = rows * d
    chunks = -(-n // 256)
    return d <= 256 and n > 256 and chunks % 2 == 1


def padded(x: torch.Tensor) -> torch.Tensor:
    """hadacore over x's rows padded with zero rows to a whole number of 512-element chunk pairs
    (patch 0021's rule), the padding dropped."""
    d = x.shape[-1]
    rows = x.numel() // d
    if d > 256 or rows * d <= 256 or rows % (512 // d) == 0:
        return torch.ops._C.hadacore_transform(x, True)
    per = 512 // d
    x2 = torch.cat([x.reshape(rows, d), x.new_zeros(-(-rows // per) * per - rows, d)])
    return torch.ops._C.hadacore_transform(x2, True)[:rows].reshape(x.shape)


def reference(x: torch.Tensor) -> torch.Tensor:
    """x @ (H / sqrt(d)) in float64, H the Sylvester Hadamard matrix (hadacore's convention)."""
    d = x.shape[-1]
    return x.double() @ _hadamard(d, device=x.device) / math.sqrt(d)


def check(y: torch.Tensor, x: torch.Tensor, tol: float) -> dict:
    ref = reference(x)
    y = y.double().reshape(ref.shape)
    nan = int((~torch.isfinite(y)).sum())
    diff = (y - ref).abs().nan_to_num(float("inf"))
    err = float(diff.max() / ref.abs().max().clamp_min(1e-30))
    rows_bad = [int(i) for i in torch.nonzero((diff > tol * ref.abs().max()).any(-1)).flatten()]
    return {"nonfinite": nan, "rel_err": err, "bad_rows": rows_bad, "ok": nan == 0 and err <= tol}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=40, help="row counts 1..ROWS per head size")
    ap.add_argument("--sizes", default="64,128,256", help="head sizes (powers of two <= 256)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prime", default="nan", help="valid: nan, none (what the shared memory holds first)")
    ap.add_argument("--tol", type=float, default=0.02, help="relative error allowed (bf16 rounding)")
    ap.add_argument("--so", default=None, help="load the op from this vLLM library instead of "
                    "importing vLLM (the wheel's vllm/_C_stable_libtorch.abi3.so)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.prime not in ("nan", "none"):
        ap.error(f"--prime {a.prime!r}: valid: nan, none")
    if not torch.cuda.is_available():
        print("hadacore_probe: needs a CUDA GPU (hadacore is a CUDA kernel)", file=sys.stderr)
        return 2
    i4, patched = None, None
    if a.so:
        torch.ops.load_library(a.so)
    else:
        from vllm import _custom_ops  # noqa: F401  (registers torch.ops._C)
        from vllm.v1.attention.ops import int4_per_token_head as i4
        patched = "_onecard_hadacore" in open(i4.__file__).read()
    if not hasattr(torch.ops._C, "hadacore_transform"):
        print("hadacore_probe: this vLLM build has no _C.hadacore_transform", file=sys.stderr)
        return 2
    hadacore = torch.ops._C.hadacore_transform
    paths = ["hadacore", "padded"] + (["fast_hadamard_transform"] if i4 is not None else [])
    dev = torch.device("cuda")
    sizes = [int(s) for s in a.sizes.split(",")]
    gen = torch.Generator(device=dev).manual_seed(1234)
    big = torch.full((1 << 16, 256), float("nan"), dtype=torch.bfloat16, device=dev)

    def prime():
        if a.prime == "nan":
            hadacore(big.clone(), True)

    cases = []
    t0 = time.time()
    for d in sizes:
        for rows in range(1, a.rows + 1):
            for path in paths:
                fails, worst = 0, {}
                for _ in range(a.repeats):
                    x = torch.randn(rows, d, generator=gen, device=dev).to(torch.bfloat16)
                    prime()
                    if path == "hadacore":
                        y = hadacore(x.clone(), True)
                    elif path == "padded":
                        y = padded(x.clone())
                    else:  # the wrapper returns the unnormalized H x: scale back to hadacore's
                        y = i4.fast_hadamard_transform(x.clone()) / math.sqrt(d)
                    torch.cuda.synchronize()
                    r = check(y, x.float(), a.tol)
                    if not r["ok"]:
                        fails += 1
                        if not worst or r["rel_err"] > worst["rel_err"]:
                            worst = r
                case = {"d": d, "rows": rows, "path": path, "predicted_bad": predicted_bad(rows, d),
                        "failed": fails, "repeats": a.repeats, "worst": worst or None}
                cases.append(case)
                if fails:
                    print(f"BAD {path} d={d} rows={rows} ({rows * d} elements): {fails}/{a.repeats} "
                          f"failed, rel err {worst['rel_err']:.3g}, non-finite {worst['nonfinite']}, "
                          f"rows {worst['bad_rows']}; predicted {'bad' if case['predicted_bad'] else 'ok'}")
    raw = [c for c in cases if c["path"] == "hadacore"]
    pad = [c for c in cases if c["path"] == "padded"]
    wrapped = [c for c in cases if c["path"] == "fast_hadamard_transform"]
    summary = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "prime": a.prime,
        "wrapper_patched": patched, "seconds": round(time.time() - t0, 1),
        "hadacore_bad": sum(1 for c in raw if c["failed"]),
        "hadacore_predicted_bad": sum(1 for c in raw if c["predicted_bad"]),
        "hadacore_matches_prediction": all(bool(c["failed"]) == c["predicted_bad"] for c in raw),
        "padded_bad": sum(1 for c in pad if c["failed"]),
        "wrapper_bad": sum(1 for c in wrapped if c["failed"]) if wrapped else None, "cases": len(raw),
    }
    print(json.dumps(summary))
    if a.out:
        write_json(Path(a.out) / "hadacore_probe.json", {"summary": summary, "cases": cases})
    return 0


if __name__ == "__main__":
    sys.exit(main())
