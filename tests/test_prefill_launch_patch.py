"""Patch 0083 (ONECARD_PREFILL_LAUNCH): vLLM's unified_attention prefill launch with another
BLOCK_M / KV tile / warps / stages computes the same attention. CPU, TRITON_INTERPRET=1 (a child
process: Triton must be imported with the interpreter on): a mixed batch (a 70-token prefill
chunk over a 60-token paged prefix, a decode, a 66-token chunk from position 0), 12 query / 2 KV
heads (6 per KV head, as the 27B), fp16 queries, int8 per-token-head and unquantized caches in
pages of 48 tokens, against the float64 reference over the dequantized cache; the fallback when a
launch does not fit the GPU; the parser's one-line errors."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from onecard import patching
from tests.child_code import TRITON_DRIVER_ACTIVE

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def series_view(vllm_dir, tmp_path_factory):
    return patching.overlay(vllm_dir, tmp_path_factory.mktemp("prefill-launch"))


_CODE = TRITON_DRIVER_ACTIVE + r'''
import torch
import vllm.v1.attention.ops.triton_unified_attention as U
from vllm.v1.kv_cache_interface import KVQuantMode

g = torch.Generator().manual_seed(5)
nq, nkv, hs, bs, nb = 12, 2, 32, 48, 12
ctx, q_lens = [60, 29, 0], [70, 1, 66]
seq = [c + q for c, q in zip(ctx, q_lens)]
perm = torch.randperm(nb - 1, generator=g) + 1
bt = torch.zeros(3, 4, dtype=torch.int32)
i = 0
for s, L in enumerate(seq):
    n = -(-L // bs)
    bt[s, :n] = perm[i:i + n].to(torch.int32)
    i += n
kf = torch.randn(nb, bs, nkv, hs, generator=g) * 1.5 + 0.3
vf = torch.randn(nb, bs, nkv, hs, generator=g)
ks = kf.abs().amax(-1) / 127
vs = vf.abs().amax(-1) / 127
k8 = (kf / ks[..., None]).round().clamp(-127, 127).to(torch.int8)
v8 = (vf / vs[..., None]).round().clamp(-127, 127).to(torch.int8)
q = (torch.randn(sum(q_lens), nq, hs, generator=g) * 1.2).half()
cu = torch.tensor([0, 70, 71, 137], dtype=torch.int32)
sl = torch.tensor(seq, dtype=torch.int32)


def reference(kd, vd):
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(3):
        pos = torch.arange(seq[s])
        kk = kd[bt[s, pos // bs].long(), pos % bs].double()   # [L, nkv, hs]
        vv = vd[bt[s, pos // bs].long(), pos % bs].double()
        for j in range(q_lens[s]):
            t = int(cu[s]) + j
            p = ctx[s] + j
            for h in range(nq):
                sc = (kk[: p + 1, h // (nq // nkv)] @ q[t, h].double()) * hs ** -0.5
                w = torch.softmax(sc, 0)
                out[t, h] = w @ vv[: p + 1, h // (nq // nkv)]
    return out


def run(mode):
    out = torch.full_like(q, float("nan"))
    kw = {}
    if mode == "int8":
        kc, vc = k8, v8
        kw = dict(kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD, k_scale_cache=ks, v_scale_cache=vs)
    else:
        kc, vc = kf.half(), vf.half()
    U.unified_attention(q=q, k=kc, v=vc, out=out, cu_seqlens_q=cu, max_seqlen_q=70, seqused_k=sl,
                        max_seqlen_k=max(seq), softmax_scale=hs ** -0.5, causal=True,
                        window_size=(-1, -1), block_table=bt, softcap=0, q_descale=None,
                        k_descale=None, v_descale=None, **kw)
    return out


refs = {"int8": reference(k8.float() * ks[..., None], v8.float() * vs[..., None]),
        "fp16": reference(kf.half().float(), vf.half().float())}
for launch in ("stock", "auto", "32:32:4:2", "64:16:8:1", "16:64:4:3"):
    U.ONECARD_PREFILL_LAUNCH = U.onecard_parse_prefill_launch(launch)
    for mode in ("int8", "fp16"):
        out = run(mode)
        err = float((out.double() - refs[mode]).abs().max() / refs[mode].abs().max())
        print("LAUNCH", launch, mode, "ERR", err, flush=True)
        assert torch.isfinite(out).all() and err < 5e-3, (launch, mode, err)

# a launch that does not fit: OutOfResources at its first call -> dropped, vLLM's launch runs
real = U.kernel_unified_attention
seen = []


class OutOfResources(Exception):
    pass


class Fake:
    def __getitem__(self, grid):
        def call(**kw):
            seen.append(kw["BLOCK_M"])
            if kw["BLOCK_M"] == 64:
                raise OutOfResources("shared memory, Required: 200000, Hardware limit: 101376")
            return real[grid](**kw)
        return call


U.kernel_unified_attention = Fake()
U.ONECARD_PREFILL_LAUNCH = U.onecard_parse_prefill_launch("64:64:8:2")
out = run("int8")
err = float((out.double() - refs["int8"]).abs().max() / refs["int8"].abs().max())
assert err < 5e-3 and seen == [64, 16], (seen, err)
out = run("int8")  # remembered: straight to vLLM's launch
assert seen == [64, 16, 16], seen
assert len(U._ONECARD_LAUNCH_FAILED) == 1
print("FALLBACK OK", flush=True)

for bad in ("64:64:8", "48:64:8:2", "64:64:3:2", "64:64:8:9", "fast"):
    try:
        U.onecard_parse_prefill_launch(bad)
    except ValueError as e:
        assert "valid:" in str(e) and "\n" not in str(e), e
    else:
        raise AssertionError(bad)
assert U.onecard_parse_prefill_launch(" stock ") is None
assert U.onecard_parse_prefill_launch(None) == "auto" == U.onecard_parse_prefill_launch(" auto ")

# "auto": the launch a call gets, recorded by a kernel stand-in that runs nothing
launches = []


class Record:
    def __getitem__(self, grid):
        def call(**kw):
            launches.append((kw["BLOCK_M"], kw["TILE_SIZE"], kw.get("num_warps"), kw.get("num_stages")))
        return call


def launch_of(mode, head, q_len=70):
    """(BLOCK_M, TILE, warps, stages) of one call: 12 query / 2 KV heads, one sequence."""
    kq = torch.randn(4, bs, nkv, head, generator=g)
    kw = {}
    if mode == "int8":
        kc = vc = kq.to(torch.int8)
        sc = torch.ones(4, bs, nkv)
        kw = dict(kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD, k_scale_cache=sc, v_scale_cache=sc)
    else:
        kc = vc = kq.to(torch.float16 if mode == "fp16" else torch.bfloat16)
    qq = torch.randn(q_len, nq, head, generator=g).to(torch.bfloat16 if mode == "bf16" else torch.float16)
    U.unified_attention(q=qq, k=kc, v=vc, out=torch.empty_like(qq),
                        cu_seqlens_q=torch.tensor([0, q_len], dtype=torch.int32), max_seqlen_q=q_len,
                        seqused_k=torch.tensor([q_len + 30], dtype=torch.int32), max_seqlen_k=q_len + 30,
                        softmax_scale=head ** -0.5, causal=True, window_size=(-1, -1),
                        block_table=torch.tensor([[1, 2, 3]], dtype=torch.int32), softcap=0,
                        q_descale=None, k_descale=None, v_descale=None, **kw)
    return launches.pop()


U.kernel_unified_attention = Record()
U._ONECARD_LAUNCH_FAILED.clear()
U.ONECARD_PREFILL_LAUNCH = "auto"
assert launch_of("int8", 256) == (128, 32, 8, 1), "auto int8 head_dim 256"
assert launch_of("bf16", 256) == (64, 32, 4, 2), "auto bf16 head_dim 256"
assert launch_of("fp16", 256) == (64, 32, 4, 2), "auto fp16 head_dim 256"
U.ONECARD_PREFILL_LAUNCH = None
stock_256 = {m: launch_of(m, 256) for m in ("int8", "bf16")}
stock_32 = launch_of("int8", 32)
stock_short = launch_of("int8", 256, q_len=40)
U.ONECARD_PREFILL_LAUNCH = "auto"
assert stock_256["int8"][0] == 16 and stock_256["bf16"][0] == 16, stock_256  # vLLM's BLOCK_M 16
assert launch_of("int8", 32) == stock_32, "auto keeps vLLM's launch at other head sizes"
assert launch_of("int8", 256, q_len=40) == stock_short, "auto keeps vLLM's launch below 64 queries"
print("AUTO OK", flush=True)
print("OK")
'''


def test_prefill_launch_matches_reference_and_falls_back(series_view):
    env = {**os.environ, "PYTHONPATH": f"{series_view}{os.pathsep}{REPO}", "TRITON_INTERPRET": "1"}
    env.pop("ONECARD_PREFILL_LAUNCH", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_CODE)], env=env, capture_output=True,
                          text=True, timeout=900, cwd=str(series_view))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len([ln for ln in lines if ln.startswith("LAUNCH ")]) == 10, proc.stdout[-3000:]
    assert "FALLBACK OK" in lines and "AUTO OK" in lines and lines[-1] == "OK"


def test_bad_env_value_fails_at_import(series_view):
    env = {**os.environ, "PYTHONPATH": f"{series_view}{os.pathsep}{REPO}", "ONECARD_PREFILL_LAUNCH": "64:64"}
    proc = subprocess.run([sys.executable, "-c", "import vllm.v1.attention.ops.triton_unified_attention"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=str(series_view))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: ONECARD_PREFILL_LAUNCH='64:64' is not valid; valid:"), last


def test_smem_script_compiles_for_sm86(series_view):
    """scripts/prefill_launch_smem.py compiles launches for a 3090 (sm86) without a GPU and
    reports their shared memory; 128:64:8:2 on bf16 cannot fit (> 101,376 bytes)."""
    env = {**os.environ, "PYTHONPATH": f"{series_view}{os.pathsep}{REPO}"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "prefill_launch_smem.py"), "86",
                           "stock,128:64:8:2"], env=env, capture_output=True, text=True, timeout=600,
                          cwd=str(series_view))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("sm86 ")]
    assert len(lines) == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert all("shared" in ln for ln in lines)
    assert "DOES NOT FIT" in next(ln for ln in lines if "bf16" in ln and "128:64:8:2" in ln)
    assert "fits" in next(ln for ln in lines if "int8" in ln and "stock" in ln)
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "prefill_launch_smem.py"), "x"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "valid launches" in bad.stderr
