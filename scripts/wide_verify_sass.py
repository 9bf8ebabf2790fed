#!/usr/bin/env python3
"""Compile the wide-verify kernels for sm_90 (or sm_86) without a GPU and report resources.

  TRITON_DEFAULT_FP_FUSION=1 python3 scripts/wide_verify_sass.py [--kv bf16,int8,int4]
      [--tile 32,64] [--warps 8] [--stages 2] [--arch 90|86] [--q-len 16] [--page 64]
      [--keep DIR] [--json F]

For each configuration the real wrapper (``wide_verify_attention``) is called on small CPU
tensors laid out exactly like the benchmark's / vLLM's paged cache (24 q / 4 kv heads, head_dim
256); the kernel launch is intercepted and its arguments are specialized the way Triton's JIT
specializes them (pointer and integer divisibility by 16, ints == 1). The kernel is then compiled
with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` and the cubin read
back: registers, spill stores/loads and stack (ptxas -v on the PTX), shared memory, and an
instruction histogram of the SASS (global loads by width, cp.async, local memory, conversions,
wgmma, shuffles), for the whole kernel and ("tile loop") for its largest loop alone - the K/V
tile loop, from the target of the longest backward branch to that branch: static counts of one
loop body, i.e. instructions per TILE_N keys. Nothing runs on a device.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 24, 4, 256


def _tools():
    import triton

    nv = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = nv / "ptxas-blackwell"  # newest bundled ptxas: reads Triton's PTX ISA version
    if not ptxas.exists():
        ptxas = nv / "ptxas"
    return str(ptxas), str(nv / "cuobjdump"), str(nv / "nvdisasm")


class _Capture:
    """Stands in for a @triton.jit kernel: records the launch instead of running it."""

    def __init__(self, jit_fn):
        self.fn = jit_fn
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
        return launch


def _specialize(jit_fn, args, kwargs):
    """signature / constexprs / attrs as Triton's JIT would build them for these arguments."""
    import inspect

    import torch
    import triton.language as tl

    params = list(inspect.signature(jit_fn.fn).parameters.values())
    bound = dict(zip([p.name for p in params], args))
    bound.update(kwargs)
    launch = {k: bound.pop(k) for k in ("num_warps", "num_stages") if k in bound}
    sig, constexprs, attrs = {}, {}, {}
    tdt = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
           torch.int8: "*i8", torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64"}
    for i, p in enumerate(params):
        v = bound[p.name] if p.name in bound else p.default
        if p.annotation is tl.constexpr or "constexpr" in str(p.annotation):
            sig[p.name] = "constexpr"
            constexprs[(i,)] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = tdt[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        elif isinstance(v, int):
            annotated = "int64" in str(p.annotation)
            if v == 1 and not annotated:
                sig[p.name] = "constexpr"
                constexprs[(i,)] = 1
                continue
            sig[p.name] = "i64" if annotated else "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"argument {p.name}: {type(v)}")
    return sig, constexprs, attrs, launch


_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)")


def _main_loop(sass: str) -> str:
    """The SASS lines of the largest loop of the split kernel: from the target of the backward
    branch that spans the most instructions to that branch (the K/V tile loop)."""
    lines = sass.splitlines()
    best = (0, 0, 0)
    addr_line = {}
    for i, line in enumerate(lines):
        m = _INSN.search(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        addr_line[addr] = i
        if m.group(2) == "BRA":
            tgt = re.search(r"0x([0-9a-f]+)", m.group(3))
            if tgt:
                ta = int(tgt.group(1), 16)
                if ta < addr and addr - ta > best[1] - best[0]:
                    best = (ta, addr, i)
    if best == (0, 0, 0) or best[0] not in addr_line:
        return ""
    return "\n".join(lines[addr_line[best[0]]:best[2] + 1])


def _sass_histogram(sass: str) -> dict:
    h = collections.Counter()
    for line in sass.splitlines():
        m = _INSN.search(line)
        if not m:
            continue
        op = m.group(2)
        base = op.split(".")[0]
        if base in ("LDG", "STG", "LDGSTS", "LDS", "STS", "LDSM"):
            width = next((w for w in ("128", "64", "U8", "S8", "U16", "S16") if f".{w}" in op),
                         "32")
            h[f"{base}.{width}"] += 1
        elif base in ("LDL", "STL", "I2F", "F2F", "F2FP", "I2FP", "HGMMA", "HMMA", "IGMMA", "IMMA",
                      "F2I", "MUFU", "SHFL",
                      "BAR", "PRMT", "LOP3", "IMAD", "FMUL", "FFMA", "FADD", "BSSY", "SYNCS",
                      "UTMALDG", "WARPGROUP", "IADD3", "LEA", "ISETP", "SEL", "SHF", "IABS",
                      "VIADD"):
            h[base] += 1
        h["total"] += 1
    return dict(sorted(h.items()))


def compile_config(kv: str, *, tile_n: int, num_warps: int, num_stages: int, q_len: int,
                   page: int, splits: int, keep: Path | None, arch: int = 90,
                   lazy: bool = False, head_split: int | None = None, row_split: int = 1,
                   flat_words: bool | None = None, qk_int8: bool = False) -> dict:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bench.kernel_verify import timing_case
    from onecard.kernels import wide_verify as wv

    gen = torch.Generator().manual_seed(0)
    case = timing_case(q_len=q_len, ctx=4 * page, batch=1, kv_dtype=kv, block_size=page,
                       device=torch.device("cpu"), gen=gen)
    cap = _Capture(wv._wide_verify_split_kernel)
    saved = wv._wide_verify_split_kernel, wv._wide_verify_reduce_kernel, wv._rht_rows_kernel
    wv._wide_verify_split_kernel, wv._wide_verify_reduce_kernel = cap, _Capture(saved[1])
    wv._rht_rows_kernel = _Capture(saved[2])  # int4's query rotation (a separate small kernel)
    try:
        out = torch.empty_like(case.q)
        wv.wide_verify_attention(
            case.q, case.key_cache, case.value_cache, out, cu_seqlens_q=case.cu_seqlens_q,
            seq_lens=case.seq_lens, block_table=case.block_table,
            max_query_len=case.max_query_len, softmax_scale=case.softmax_scale, kv_mode=kv,
            k_scale_cache=case.k_scale_cache, v_scale_cache=case.v_scale_cache,
            max_seq_len=case.max_seq_len, num_splits=splits, tile_n=tile_n,
            num_warps=num_warps, num_stages=num_stages, lazy_rescale=lazy,
            head_split=head_split, row_split=row_split, flat_words=flat_words, qk_int8=qk_int8)
    finally:
        wv._wide_verify_split_kernel, wv._wide_verify_reduce_kernel, wv._rht_rows_kernel = saved
    grid, args, kwargs = cap.calls[0]
    kwargs = {**kwargs, "DOT_F32": False}  # the wrapper saw CPU tensors
    sig, constexprs, attrs, launch = _specialize(saved[0], args, kwargs)
    src = ASTSource(saved[0], sig, constexprs, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch)
    ptxas, cuobjdump, nvdisasm = _tools()
    row = {"arch": arch, "kv": kv, "tile_n": tile_n, "num_warps": launch.get("num_warps"),
           "num_stages": launch.get("num_stages"), "q_len": q_len, "page": page,
           "shared_bytes": k.metadata.shared,
           "div16": [list(sig)[i] for (i,) in attrs]}
    with tempfile.TemporaryDirectory() as td:
        d = Path(keep) if keep else Path(td)
        d.mkdir(parents=True, exist_ok=True)
        stem = d / f"{kv}_t{tile_n}_w{row['num_warps']}_s{row['num_stages']}_q{q_len}"
        (stem.with_suffix(".ptx")).write_text(k.asm["ptx"])
        (stem.with_suffix(".ttgir")).write_text(k.asm["ttgir"])
        (stem.with_suffix(".cubin")).write_bytes(k.asm["cubin"])
        sm = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        rep = subprocess.run([ptxas, f"-arch={sm}", "-v", str(stem.with_suffix(".ptx")),
                              "-o", os.devnull], capture_output=True, text=True).stderr
        for key, pat in (("regs", r"Used (\d+) registers"), ("stack", r"(\d+) bytes stack frame"),
                         ("spill_stores", r"(\d+) bytes spill stores"),
                         ("spill_loads", r"(\d+) bytes spill loads")):
            m = re.search(pat, rep)
            row[key] = int(m.group(1)) if m else None
        sass = subprocess.run([cuobjdump, "-sass", str(stem.with_suffix(".cubin"))],
                              capture_output=True, text=True).stdout
        if keep:
            stem.with_suffix(".sass").write_text(sass)
        row["sass"] = _sass_histogram(sass)
        row["loop"] = _sass_histogram(_main_loop(sass))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", default="bf16,int8,int4")
    ap.add_argument("--tile", default="32")
    ap.add_argument("--warps", default="8")
    ap.add_argument("--stages", default="2")
    ap.add_argument("--q-len", type=int, default=16)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--splits", type=int, default=4, help="> 1: the split (not direct) variant")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90, 86)")
    ap.add_argument("--keep", default=None, help="write ptx/ttgir/cubin/sass here")
    ap.add_argument("--lazy", action="store_true", help="the lazy-rescale variant (lazy_rescale=True)")
    ap.add_argument("--head-split", type=int, default=None, help="1 or 2 (default: the wrapper's)")
    ap.add_argument("--row-split", type=int, default=1, help="1 or 2 (the wrapper's row_split)")
    ap.add_argument("--flat-words", type=int, choices=(0, 1), default=None,
                    help="int8 / int4: load a tile's words flat (1) or 2-D (0); default: the wrapper's")
    ap.add_argument("--qk-int8", action="store_true", help="int8: Q.K^T as an int8 dot (qk_int8=True)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = []
    for kv in a.kv.split(","):
        for t in map(int, a.tile.split(",")):
            for w in map(int, a.warps.split(",")):
                for s in map(int, a.stages.split(",")):
                    r = compile_config(kv, tile_n=t, num_warps=w, num_stages=s, q_len=a.q_len,
                                       page=a.page, splits=a.splits,
                                       keep=Path(a.keep) if a.keep else None, arch=a.arch,
                                       lazy=a.lazy, head_split=a.head_split,
                                       row_split=a.row_split,
                                       flat_words=None if a.flat_words is None else bool(a.flat_words),
                                       qk_int8=a.qk_int8)
                    rows.append(r)
                    h = r["sass"]
                    print(f"sm_{a.arch} {kv:>5} tile {t:>3} warps {w:>2} stages {s} | "
                          f"regs {r['regs']} "
                          f"spill st/ld {r['spill_stores']}/{r['spill_loads']} B "
                          f"smem {r['shared_bytes']} | "
                          + " ".join(f"{k}={v}" for k, v in h.items()
                                     if k.split(".")[0] in ("LDG", "LDGSTS", "STL", "LDL", "I2F",
                                                            "F2F", "F2FP", "HGMMA", "IGMMA", "IMMA", "HMMA",
                                                            "STS", "LDS", "LDSM", "total")),
                          flush=True)
                    lp = r["loop"]
                    print("    tile loop: " + " ".join(
                        f"{k}={v}" for k, v in lp.items()
                        if k.split(".")[0] in ("IMAD", "LEA", "IADD3", "ISETP", "SEL", "SHF",
                                               "IABS", "LOP3", "PRMT", "FADD", "FMUL", "F2FP",
                                               "I2F", "LDGSTS", "LDG", "STS", "LDS", "STL", "LDL",
                                               "HGMMA", "IGMMA", "IMMA", "HMMA", "SHFL", "BAR",
                                               "total")),
                          flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
