"""Compile our Triton kernels for the RTX 3090 (sm_86) on the CPU, at the launches a wrapper makes.

Used by tests/test_wide_verify_compile.py and tests/test_kvarn_compile.py: a child process without
TRITON_INTERPRET runs ``PRELUDE`` + a test's body. The body calls a real wrapper (on CPU tensors)
inside ``compile_calls(label, module, names, fn)``: the named ``@triton.jit`` kernels of ``module``
are replaced by launch captures while ``fn`` runs, and every distinct launch is then specialized as
Triton's JIT would (scripts/wide_verify_sass.py) and compiled with Triton's own compiler for
``GPUTarget("cuda", 86, 32)``; one ``ROW{json}`` line per compiled launch (kernel, launch options,
shared memory). Nothing runs on a device.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SM86_SHARED = 101_376   # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_86 / sm_89 (RTX 3090 / 4090)

PRELUDE = r'''
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, "scripts")
import wide_verify_sass as W          # the launch capture and Triton's JIT specialization

TARGET = GPUTarget("cuda", 86, 32)
_seen = set()


def compile_calls(label, module, names, fn):
    kernels = {n: getattr(module, n) for n in names}
    caps = {n: W._Capture(k) for n, k in kernels.items()}
    for n, c in caps.items():
        setattr(module, n, c)
    try:
        fn()
    finally:
        for n, k in kernels.items():
            setattr(module, n, k)
    for n, c in caps.items():
        for grid, args, kwargs in c.calls:
            kw = {**kwargs, "DOT_F32": False} if "DOT_F32" in kwargs else kwargs   # the wrapper saw CPU tensors
            sig, constexprs, attrs, launch = W._specialize(kernels[n], args, kw)
            key = (n, tuple(sorted(sig.items())), tuple(sorted((k, str(v)) for k, v in constexprs.items())),
                   tuple(sorted(launch.items())))
            if key in _seen:
                continue
            _seen.add(key)
            k = triton.compile(ASTSource(kernels[n], sig, constexprs, attrs), target=TARGET, options=launch)
            assert k.asm.get("cubin"), (label, n)
            print("ROW" + json.dumps({"case": label, "kernel": n, "launch": launch, "shared": k.metadata.shared}),
                  flush=True)
'''


def compile_rows(body: str, tmp_path: Path, timeout: int = 900) -> list[dict]:
    """Run PRELUDE + body in a child without TRITON_INTERPRET; the ROW lines it printed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), TRITON_DEFAULT_FP_FUSION="1")
    p = subprocess.run([sys.executable, "-c", PRELUDE + body], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=str(REPO))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads(x[3:]) for x in p.stdout.splitlines() if x.startswith("ROW")]
