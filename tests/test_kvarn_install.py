"""kvarn/install.sh (onecard.kvarn.installer) on a patched view of the pinned vLLM 0.27.1:
install puts files + patch + marker in, a second install is a no-op, uninstall gives back the
exact bytes; the patched vLLM accepts the kvarn dtypes and computes our bytes per token."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onecard import memory, patching
from onecard.kvarn import format as fmt
from onecard.kvarn import installer as kin

REPO = Path(__file__).resolve().parent.parent
KVARN_PATCH = patching.read_series(kin.SERIES)


def _also() -> tuple[str, ...]:
    return tuple({p for patch in KVARN_PATCH for p in patch.paths} | set(kin.sources()) | {kin.MARKER})


def _snapshot(root: Path) -> dict[str, object]:
    """Every entry under root without following links: file bytes or link targets."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_file():
                out[rel] = p.read_bytes()
            else:
                out[rel] = "dir"
    return out


@pytest.fixture
def site(vllm_dir, tmp_path):
    return patching.overlay(vllm_dir, tmp_path / "site", also=_also())


def test_series_and_patch_are_well_formed():
    assert [p.name for p in KVARN_PATCH] == ["0001-kvarn-kv-cache.patch"]
    assert not [f for f in patching.HEADER_FIELDS if not KVARN_PATCH[0].header.get(f)]
    main = {p for patch in patching.read_series() for p in patch.paths}
    assert not main & set(KVARN_PATCH[0].paths)  # no file in both series
    assert (REPO / "kvarn" / "install.sh").stat().st_mode & 0o111


def test_install_idempotent_uninstall_exact(site, vllm_dir, capsys):
    vdir = site / "vllm"
    before = _snapshot(vdir)
    st = kin.state(vdir)
    assert st["patch"] == patching.NOT_APPLIED and st["marker"] == "missing"
    assert kin.main(["--vllm-dir", str(vdir), "--dry-run"]) == 0
    assert _snapshot(vdir) == before
    assert kin.main(["--vllm-dir", str(vdir)]) == 0
    st = kin.state(vdir)
    assert st["patch"] == patching.APPLIED and st["marker"] == "ok"
    assert set(st["files"].values()) == {"ok"}  # kernels copied verbatim (byte-equal)
    for rel, src in kin.sources().items():
        assert (site / rel).read_bytes() == src.read_bytes()
    assert kin.main(["--vllm-dir", str(vdir), "--status"]) == 0
    installed = _snapshot(vdir)
    capsys.readouterr()
    assert kin.main(["--vllm-dir", str(vdir)]) == 0  # second install: no-op
    assert "already installed" in capsys.readouterr().out
    assert _snapshot(vdir) == installed
    # the main series is still exactly applied; the audit knows the kvarn series
    assert patching.status(vdir).all_applied
    assert patching.audit(vdir, extra=(kin.SERIES,)) == []
    assert any("cache.py" in p for p in patching.audit(vdir))
    # the real test-venv vLLM was never written through a link
    assert not (vllm_dir / "kvarn_installed.txt").exists()
    assert not (vllm_dir / "v1/attention/ops/kvarn").exists()
    assert kin.main(["--vllm-dir", str(vdir), "--uninstall"]) == 0
    assert _snapshot(vdir) == before
    capsys.readouterr()
    assert kin.main(["--vllm-dir", str(vdir), "--uninstall"]) == 0
    assert "not installed" in capsys.readouterr().out
    assert kin.main(["--vllm-dir", str(vdir), "--status"]) == 1


def test_failed_patch_leaves_nothing(site, monkeypatch, capsys):
    vdir = site / "vllm"
    before = _snapshot(vdir)

    def boom(*a, **k):
        raise patching.PatchError("simulated failure")

    monkeypatch.setattr(patching, "apply", boom)
    assert kin.main(["--vllm-dir", str(vdir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nothing was left changed" in err
    assert _snapshot(vdir) == before


def test_patch_that_does_not_fit_is_one_line(site, capsys):
    vdir = site / "vllm"
    cache_py = site / "vllm/config/cache.py"
    cache_py.write_text(cache_py.read_text().replace('    "nvfp4",\n]', '    "nvfp4", "x",\n]'))
    before = _snapshot(vdir)
    assert kin.main(["--vllm-dir", str(vdir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not fit" in err and "valid:" in err
    assert _snapshot(vdir) == before


_PROBE = r"""
import json, torch, pydantic
from vllm.config.cache import CacheConfig
from vllm.v1.attention.backends.kvarn_attn import KvarnAttentionBackend, bytes_per_token_head
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import TQFullAttentionSpec
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
out = {}
for d in ("kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k4v2_g64"):
    assert CacheConfig(cache_dtype=d).cache_dtype == d
    spec = TQFullAttentionSpec(block_size=256, num_kv_heads=4, head_size=256, head_size_v=256,
                               dtype=STR_DTYPE_TO_TORCH_DTYPE[d], tq_slot_size=bytes_per_token_head(d, 256))
    out[d] = {"page": spec.page_size_bytes,
              "shape": KvarnAttentionBackend.get_kv_cache_shape(10, 256, 4, 256, d),
              "supported": KvarnAttentionBackend.supports_kv_cache_dtype(d)}
try:
    CacheConfig(cache_dtype="kvarn_k3v3_g128")
    out["bogus"] = "accepted"
except pydantic.ValidationError as e:
    out["bogus"] = str(e).splitlines()[0]
out["enum"] = AttentionBackendEnum.KVARN.get_path()
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
out["triton_takes_kvarn"] = TritonAttentionBackend.supports_kv_cache_dtype("kvarn_k4v2_g128")
from vllm.platforms.interface import DeviceCapability
kw = dict(dtype=torch.bfloat16, kv_cache_dtype="kvarn_k4v2_g128", use_mla=False, has_sink=False,
          use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False, attn_type="decoder")
out["invalid"] = {f"{hs}/{bs}/{cap}": KvarnAttentionBackend.validate_configuration(
    head_size=hs, block_size=bs, device_capability=DeviceCapability(*cap), **kw)
    for hs, bs, cap in ((256, None, (9, 0)), (64, None, (8, 6)), (256, 3968, (8, 6)), (256, 16, (9, 0)))}
print("JSON" + json.dumps(out))
"""


def test_patched_vllm_accepts_dtypes_and_page_size_matches(site):
    vdir = site / "vllm"
    assert kin.main(["--vllm-dir", str(vdir)]) == 0
    env = {**os.environ, "PYTHONPATH": f"{site}:{REPO}", "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env,
                       cwd=site, timeout=600)
    line = [l for l in r.stdout.splitlines() if l.startswith("JSON")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    out = json.loads(line[0][4:])
    g = memory.QWEN38_27B
    for d in ("kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k4v2_g64"):
        per_token_layer = out[d]["page"] // 256
        assert per_token_layer == fmt.bytes_per_token_layer(4, 256, d) == memory.attn_bytes_per_token(g, d)
        p = fmt.get_preset(d)
        assert out[d]["shape"] == [10, 256 // p.tile, 4, p.layout(256).block_bytes]
        assert out[d]["supported"]
    assert out["kvarn_k4v2_g128"]["page"] == 840 * 256
    assert out["bogus"] != "accepted" and "validation error" in out["bogus"]
    assert out["enum"].endswith("kvarn_attn.KvarnAttentionBackend")
    assert out["triton_takes_kvarn"] is False
    inv = out["invalid"]
    assert inv["256/None/(9, 0)"] == [] and inv["64/None/(8, 6)"] == [] and inv["256/3968/(8, 6)"] == []
    assert inv["256/16/(9, 0)"] == ["block_size not supported"]
    # CUDA's non-MLA priority lists end with KVARN (platforms.cuda needs libcuda to import)
    cuda_py = (site / "vllm/platforms/cuda.py").read_text()
    assert cuda_py.count("AttentionBackendEnum.TURBOQUANT,\n                AttentionBackendEnum.KVARN,") == 2


_GLUE = r"""
import json, math, types
import torch
import vllm.v1.attention.backends.kvarn_attn as KA
from vllm.v1.attention.backends.kvarn_attn import (KvarnAttentionBackend, KvarnAttentionImpl,
                                                    KvarnMetadataBuilder)
KA.MAX_TOKENS_PER_LAUNCH = 40  # several launches per prefill step
from onecard.kvarn import reference as R

torch.manual_seed(0)
DT, D, H, HQ, T, BS = GEOMETRY
cfg = types.SimpleNamespace(cache_config=types.SimpleNamespace(cache_dtype=DT),
                            scheduler_config=types.SimpleNamespace(max_num_seqs=2),
                            compilation_config=types.SimpleNamespace(max_cudagraph_capture_size=PAD),
                            speculative_config=types.SimpleNamespace(num_speculative_tokens=SPECK) if SPECK else None)
QU = 1 + SPECK
builder = KvarnMetadataBuilder(types.SimpleNamespace(block_size=BS), ["l0"], cfg, torch.device("cpu"))
impl = KvarnAttentionImpl(HQ, D, D ** -0.5, H, kv_cache_dtype=DT)
shape = KvarnAttentionBackend.get_kv_cache_shape(8, BS, H, D, "auto")  # preset from the impl
kv_cache = torch.randint(0, 256, shape, dtype=torch.uint8)
layer = torch.nn.Module()
bt = torch.tensor([[3, 5, 2, 0], [6, 1, 7, 0]], dtype=torch.int32)
prefill_jobs = 0
decode_steps, ptrs = 0, set()
K = [torch.zeros(0, H, D) for _ in range(2)]
V = [torch.zeros(0, H, D) for _ in range(2)]
errs = []
for step in STEPS:
    ql = [s for _, s in step]
    n = sum(ql)
    q = (torch.randn(n, HQ, D) * 1.2).bfloat16()
    k = (torch.randn(n, H, D) * 1.5 + 0.3).bfloat16()
    v = torch.randn(n, H, D).bfloat16()
    cu = [0]
    for r, (c, m) in enumerate(step):
        K[r] = torch.cat([K[r][:c], k[cu[-1]:cu[-1] + m].float()])
        V[r] = torch.cat([V[r][:c], v[cu[-1]:cu[-1] + m].float()])
        cu.append(cu[-1] + m)
    seq_lens, qsl, btab, nact = [c + m for c, m in step], list(cu), bt, n
    if PAD and ql == [QU, QU]:  # a FULL-graph uniform batch as vLLM pads it: empty requests, tokens
        padr = PAD // QU
        seq_lens += [0] * (padr - 2)
        qsl += [n] * (padr - 2)
        btab = torch.cat([bt, torch.zeros(padr - 2, bt.shape[1], dtype=bt.dtype)])
        nact = PAD
    cam = types.SimpleNamespace(num_reqs=len(seq_lens), seq_lens=torch.tensor(seq_lens),
                                query_start_loc_cpu=torch.tensor(qsl), block_table_tensor=btab,
                                num_actual_tokens=nact)
    if HOSTCOPIES:  # vLLM's host seq_lens and patch 0084's host block table: no .to("cpu")
        cam._seq_lens_cpu, cam.block_table_cpu = torch.tensor(seq_lens), btab.clone()
        cam.seq_lens = torch.full_like(cam.seq_lens, -7)  # must not be read on the host
        _to = torch.Tensor.to

        def _no_host_copy(self, *a, **kw):
            assert not (a and a[0] == "cpu"), "a device-to-host copy in build()"
            return _to(self, *a, **kw)

        torch.Tensor.to = _no_host_copy
    try:
        md = builder.build(0, cam)
    finally:
        if HOSTCOPIES:
            torch.Tensor.to = _to
    prefill_jobs += len(md.plan.prefill)
    if md.decode is not None:
        decode_steps += 1
        ptrs.add(md.decode.seq_lens.data_ptr())
    out = torch.full((nact + 3, HQ * D), float("nan"), dtype=torch.bfloat16)  # padded like vLLM
    pad = lambda x: torch.cat([x.reshape(n, -1), torch.randn(nact - n + 3, x[0].numel()).to(x.dtype)])
    impl.forward(layer, pad(q), pad(k), pad(v), kv_cache, md, output=out)
    for r, (c, m) in enumerate(step):
        s = c + m
        kr = R.rotate(K[r][:s].half(), torch.float32).half()
        vr = R.rotate(V[r][:s].half(), torch.float32).half()
        kq, vq = R.quantized_view(kr, vr, DT)  # the read rule: fp16 window + sink fp16
        ref = R.own_tile_attention_f64(q[cu[r]:cu[r] + m].float(), R.rotate(kr), R.rotate(vr),
                                       R.rotate(kq), R.rotate(vq), T, D ** -0.5,
                                       window=builder.planner.window, sinks=builder.planner.sinks)
        got = out[cu[r]:cu[r] + m].view(m, HQ, D).double()
        errs.append(float(((got - ref).abs() / ref.abs().clamp_min(1)).max()))
print("JSON" + json.dumps({"errs": errs, "shape": list(shape), "prefill_jobs": prefill_jobs,
                          "finite": bool(torch.isfinite(out[:n]).all()),
                          "window": builder.planner.window, "slots": builder.planner.num_slots,
                          "sinks": builder.planner.sinks,
                          "impl_slots": impl.num_slots, "decode_steps": decode_steps,
                          "buffers": len(ptrs),
                          "cg": KvarnMetadataBuilder.get_cudagraph_support(cfg, None).name}))
"""


def _run_glue(site, geometry: str, steps: str, window: str | None = None, pad: int = 0,
              graphs: str | None = None, spec_k: int = 0, host_copies: bool = False,
              sinks: str | None = None) -> dict:
    vdir = site / "vllm"
    assert kin.main(["--vllm-dir", str(vdir)]) == 0
    env = {**os.environ, "PYTHONPATH": f"{site}:{REPO}", "TRITON_INTERPRET": "1"}
    env.pop(fmt.WINDOW_ENV, None)
    env.pop(fmt.SINKS_ENV, None)
    env.pop("ONECARD_KVARN_GRAPHS", None)
    if window is not None:
        env[fmt.WINDOW_ENV] = window
    if sinks is not None:
        env[fmt.SINKS_ENV] = sinks
    if graphs is not None:
        env["ONECARD_KVARN_GRAPHS"] = graphs
    script = (_GLUE.replace("GEOMETRY", geometry).replace("STEPS", steps).replace("PAD", str(pad))
              .replace("SPECK", str(spec_k)).replace("HOSTCOPIES", str(bool(host_copies))))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                       cwd=site, timeout=900)
    line = [l for l in r.stdout.splitlines() if l.startswith("JSON")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    return json.loads(line[0][4:])


def test_backend_glue_against_reference(site):
    """KvarnMetadataBuilder.build + KvarnAttentionImpl.forward (as vLLM calls them, padded
    batch, bf16) over three steps: prefill chunk / decode / verify, 2 requests, at fp16 window 1
    chosen through the server's environment (ONECARD_KVARN_WINDOW=1 with ONECARD_KVARN_SINKS=1:
    3 x 2 + 4 stage slots)."""
    out = _run_glue(site, '"kvarn_k4v2_g64", 64, 2, 4, 64, 128',
                    "([(0, 150), (0, 40)], [(150, 1), (40, 4)], [(151, 4), (42, 16)])", window="1", sinks="1")
    assert (out["window"], out["slots"], out["impl_slots"]) == (1, 9, 28)  # impl: no config, 8 seqs
    assert out["shape"] == [8, 2, 2, fmt.get_preset("k4v2_g64").layout(64).block_bytes]
    assert out["prefill_jobs"] == 2  # 150 and 40 queries: the prefill kernel
    assert out["finite"] and max(out["errs"]) < 3e-2, out["errs"]  # bf16 output rounding


def test_backend_long_prefill_in_chunks_against_reference(site):
    """A 700-token prompt in scheduler chunks of 256 / 256 / 188 through the installed backend
    (the default preset k4v2_g128, pages of 2 tiles, GQA 4 kv x 6 heads), another request
    prefilling and decoding in the same batches, then decode: equals the float64 reference
    under the read rule (the default since session 17: each query's fp16 window of its own and
    the two previous tiles, the two sink tiles fp16, older tiles quantized)."""
    out = _run_glue(site, '"kvarn_k4v2_g128", 64, 4, 24, 128, 256',
                    "([(0, 256), (0, 40)], [(256, 256), (40, 1)], [(512, 188), (41, 1)],"
                    " [(700, 1), (42, 1)])")
    assert (out["window"], out["slots"], out["impl_slots"]) == (3, 17, 60)  # impl: no config, 8 seqs
    assert out["prefill_jobs"] == 4  # chunks 256, 40, 256, 188; the decodes stay split-KV
    assert out["finite"] and max(out["errs"]) < 3e-2, out["errs"]


def test_backend_decode_rows_across_tile_boundaries_padded_like_a_full_graph(site):
    """Single-token decode batches take the CUDA-graph-safe decode rows (fixed-size persistent
    buffers, one pseudo-sequence per token): padded as vLLM pads a FULL-graph batch (two empty
    requests and two tokens past the last request), across the steps where tile 0 of one
    request and tile 1 of the other fill and get packed (the pack job padded with block -1)
    at fp16 window 1, so the next queries read the tile that the decode path packed: equals the
    float64 reference under the read rule."""
    out = _run_glue(site, '"kvarn_k4v2_g64", 64, 2, 4, 64, 128',
                    "([(0, 126), (0, 62)], [(126, 1), (62, 1)], [(127, 1), (63, 1)],"
                    " [(128, 1), (64, 1)], [(129, 1), (65, 1)])", pad=4, window="1")
    assert out["decode_steps"] == 4 and out["buffers"] == 1  # one persistent buffer, every step
    assert out["cg"] == "UNIFORM_SINGLE_TOKEN_DECODE"
    assert out["finite"] and max(out["errs"]) < 3e-2, out["errs"]


def test_backend_verify_rows_with_rejections_padded_like_a_full_graph(site):
    """With speculation (k = 3) the uniform verify batches (4 queries per request) take the
    CUDA-graph-safe rows too: two pseudo-sequence rows per request, padded as vLLM pads a FULL
    batch (two empty requests), blocks that cross a tile boundary (126..129 and 190..193), then
    rejected drafts (the next block starts after the first accepted token) across the packed
    tile, with packed tiles read through each request's own block-table row: equals the float64
    reference under the read rule at fp16 window 1 and 2."""
    steps = ("([(0, 126), (0, 190)], [(126, 4), (190, 4)], [(127, 4), (191, 4)], [(130, 4), (194, 4)],"
             " [(131, 4), (198, 4)])")
    for window in ("1", "2"):
        out = _run_glue(site, '"kvarn_k4v2_g64", 64, 2, 4, 64, 128', steps, pad=16, window=window,
                        spec_k=3)
        assert out["decode_steps"] == 4 and out["buffers"] == 1
        assert out["cg"] == "UNIFORM_BATCH"
        assert out["finite"] and max(out["errs"]) < 3e-2, (window, out["errs"])


def test_backend_rows_window3_two_sinks(site):
    """ONECARD_KVARN_WINDOW=3 + ONECARD_KVARN_SINKS=2 through the installed backend: a prefill,
    then the CUDA-graph-safe uniform rows -- single-token decode padded like a FULL batch, and
    with speculation (k = 3) verify blocks crossing tile boundaries (318..321 over 320, 250..253
    over 256) with rejected drafts -- equal the float64 read rule (tiles 0 and 1 from their
    sink slots, the two tiles before the own one from theirs, tile 2 on packed)."""
    geo = '"kvarn_k4v2_g64", 64, 2, 4, 64, 128'
    out = _run_glue(site, geo, "([(0, 317), (0, 253)], [(317, 1), (253, 1)], [(318, 1), (254, 1)],"
                    " [(319, 1), (255, 1)], [(320, 1), (256, 1)], [(321, 1), (257, 1)])", pad=4,
                    window="3", sinks="2")
    assert (out["window"], out["sinks"], out["slots"]) == (3, 2, 2 * 7 + 4 - 1)
    assert out["impl_slots"] == 8 * 7 + 4 and out["decode_steps"] == 5 and out["buffers"] == 1
    assert out["finite"] and max(out["errs"]) < 3e-2, out["errs"]
    out = _run_glue(site, geo, "([(0, 318), (0, 250)], [(318, 4), (250, 4)], [(319, 4), (251, 4)],"
                    " [(322, 4), (254, 4)], [(323, 4), (258, 4)])", pad=16, window="3", sinks="2",
                    spec_k=3)
    assert out["decode_steps"] == 4 and out["cg"] == "UNIFORM_BATCH"
    assert out["finite"] and max(out["errs"]) < 3e-2, out["errs"]


def test_backend_plans_from_host_copies(site):
    """Without speculation, given vLLM's host seq_lens and patch 0084's host block table, the
    builder makes no device-to-host copy (prefill chunks and decode steps alike) and still
    equals the float64 reference; the device seq_lens it is given are garbage."""
    out = _run_glue(site, '"kvarn_k4v2_g64", 64, 2, 4, 64, 128',
                    "([(0, 100), (0, 40)], [(100, 1), (40, 1)], [(101, 1), (41, 1)])",
                    pad=4, host_copies=True)
    assert out["decode_steps"] == 2
    assert out["finite"] and max(out["errs"]) < 3e-2, out["errs"]


_DRAFT = r"""
import json, os, types
import torch
from vllm.v1.attention.backends.kvarn_attn import KvarnMetadataBuilder, DRAFT_HOST_ENV

T, BS, MAXLEN = 64, 128, 122
cfg = types.SimpleNamespace(cache_config=types.SimpleNamespace(cache_dtype="kvarn_k4v2_g64"),
                            scheduler_config=types.SimpleNamespace(max_num_seqs=2),
                            compilation_config=types.SimpleNamespace(max_cudagraph_capture_size=16),
                            model_config=types.SimpleNamespace(max_model_len=MAXLEN),
                            speculative_config=types.SimpleNamespace(num_speculative_tokens=3))
mk = lambda: KvarnMetadataBuilder(types.SimpleNamespace(block_size=BS), ["l0"], cfg, torch.device("cpu"))
target, d_on, d_off = mk(), mk(), mk()  # the runner's builder; the MTP drafter's (knob on / off)
SEQ = torch.zeros(4, dtype=torch.int32)  # the runner's persistent device seq_lens
BT = torch.tensor([[3, 5, 2, 0], [6, 1, 7, 4], [0] * 4, [0] * 4], dtype=torch.int32)
_to, copies = torch.Tensor.to, []


def _count(self, *a, **kw):
    if a and a[0] == "cpu":
        copies.append(1)
    return _to(self, *a, **kw)


torch.Tensor.to = _count


def cam(qsl, seq_dev, n, nt):
    return types.SimpleNamespace(num_reqs=n, seq_lens=seq_dev, query_start_loc_cpu=torch.tensor(qsl),
                                 block_table_tensor=BT[:n], block_table_cpu=BT[:n].clone(),
                                 num_actual_tokens=nt)


def fields(md):
    p = md.plan
    d = {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in p.__dict__.items()
         if k != "prefill"}
    d["prefill"] = [repr(j) for j in p.prefill]
    if md.decode is not None:
        d["rows"] = {k: v.tolist() for k, v in md.decode.__dict__.items() if isinstance(v, torch.Tensor)}
    return d


def draft(c, j):
    # the same device tensors for both drafter builders; the knob-off one copies every time
    os.environ[DRAFT_HOST_ENV] = "0"
    ref = d_off.build_for_drafting(c, j)
    os.environ[DRAFT_HOST_ENV] = "1"
    del copies[:]
    got = d_on.build_for_drafting(c, j)
    return len(copies), fields(got) == fields(ref)


# (ctx of each request, query len, rejected drafts per request or None for a prefill step, bump)
STEPS = [([0, 0], [100, 60], None, False), ([100, 60], [4, 4], [3, 1], False),
         ([101, 63], [4, 4], [0, 2], False), ([105, 65], [4, 4], [2, 0], True),
         ([107, 69], [4, 4], [1, 1], False), ([110, 72], [4, 4], [0, 0], False),
         ([114, 72], [4, 4], [0, 3], False),
         ([118, 73], [4, 4], [1, 0], False)]  # request 0: draft 1 at seq 122 = MAXLEN
out = []
for ctx, ql, rej, bump in STEPS:
    seq = [c + q for c, q in zip(ctx, ql)]
    SEQ[:2] = torch.tensor(seq, dtype=torch.int32)  # _prepare_inputs (a torch write: _version)
    SEQ[2:].fill_(0)
    qsl = [0, ql[0], ql[0] + ql[1]]
    padded = rej is not None  # a FULL-graph verify batch: padded to 4 requests (16 tokens)
    tc = cam(qsl + [qsl[-1]] * 2, SEQ[:4], 4, 16) if padded else cam(qsl, SEQ[:2], 2, qsl[-1])
    del copies[:]
    target.build(0, tc)
    row = {"target": len(copies)}
    if bump:  # something writes seq_lens between the target's build and the drafter's (torch op)
        SEQ[:2] += 0
    dc = cam(qsl, SEQ[:2], 2, qsl[-1])  # unpadded + prepare_inputs_padded: another view, same rows
    row["d0"] = draft(dc, 0)
    if rej is not None:  # propose(): seq_lens -= num_rejected_tokens_gpu (in place)
        dc.seq_lens -= torch.tensor(rej, dtype=torch.int32)
    dc.query_start_loc_cpu, dc.num_actual_tokens = torch.arange(3, dtype=torch.int32), 2
    for j in (1, 2):
        # eagle_step_slot_mapping_metadata_kernel: seq_lens + 1 (1 past max_model_len), a raw
        # kernel write (no _version bump)
        s = dc.seq_lens
        s.data.copy_(torch.where(s >= MAXLEN, torch.ones_like(s), torch.clamp(s + 1, max=MAXLEN)))
        row[f"d{j}"] = draft(dc, j)
    row["seq_d2"] = dc.seq_lens.tolist()
    out.append(row)
torch.Tensor.to = _to
print("JSON" + json.dumps(out))
"""


def test_backend_drafter_builds_reuse_exact_host_seq_lens(site):
    """SPEC=mtp: vLLM's MTP proposer builds the drafter's metadata k times per step (draft index
    0 over the verify batch, then one single-token step per further draft); with async
    scheduling vLLM has no exact host seq_lens. Draft index 0 reuses the target build's copy
    (same device rows, no write since), index 1 copies once (the rejection is on the device),
    index 2 derives +1: one device-to-host copy per drafter instead of k, and every plan equals
    the plan of a builder that copies each time (ONECARD_KVARN_DRAFT_HOST=0), over a prefill
    step and verify steps (graph-padded, rejections, tile crossings). A torch write to seq_lens
    after the target's build, or a row at max_model_len (the kernel wraps), makes it copy."""
    vdir = site / "vllm"
    assert kin.main(["--vllm-dir", str(vdir)]) == 0
    env = {**os.environ, "PYTHONPATH": f"{site}:{REPO}"}
    env.pop("ONECARD_KVARN_GRAPHS", None)
    r = subprocess.run([sys.executable, "-c", _DRAFT], capture_output=True, text=True, env=env,
                       cwd=site, timeout=600)
    line = [l for l in r.stdout.splitlines() if l.startswith("JSON")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    rows = json.loads(line[0][4:])
    assert all(row["target"] == 1 for row in rows)  # the target's verify build: one copy
    for i, row in enumerate(rows):
        assert row["d0"][1] and row["d1"][1] and row["d2"][1], (i, row)  # plans identical
        want0 = 1 if i == 3 else 0  # step 3: seq_lens written after the target's build
        want2 = 1 if i == len(rows) - 1 else 0  # last step: a row reached max_model_len
        assert (row["d0"][0], row["d1"][0], row["d2"][0]) == (want0, 1, want2), (i, row)
    assert rows[-1]["seq_d2"][0] == 1  # the kernel's wrap past max_model_len was exercised


def test_backend_graphs_off_is_never(site):
    """ONECARD_KVARN_GRAPHS=0: the builder reports no CUDA-graph support (vLLM runs piecewise)."""
    out = _run_glue(site, '"kvarn_k4v2_g64", 64, 2, 4, 64, 128', "([(0, 3), (0, 2)], [(3, 1), (2, 1)])",
                    graphs="0")
    assert out["cg"] == "NEVER" and out["decode_steps"] == 1
    assert out["finite"] and max(out["errs"]) < 3e-2, out["errs"]


def test_patches_cli_audit_with_the_kvarn_series(site, capsys):
    from onecard import cli

    vdir = site / "vllm"
    assert kin.main(["--vllm-dir", str(vdir)]) == 0
    capsys.readouterr()
    assert cli.main(["patches", "audit", "--vllm-dir", str(vdir)]) == 1  # kvarn's files differ
    assert cli.main(["patches", "audit", "--vllm-dir", str(vdir), "--also-series", str(kin.SERIES)]) == 0


def test_launcher_refuses_a_stale_install(site):
    """A `git pull` that changes kvarn/ leaves the old kernels in vLLM until kvarn/install.sh runs
    again: the launcher's real-launch check (plan.kvarn_install_problem) names what differs."""
    from onecard import plan as P

    vdir = site / "vllm"
    assert "marker missing" in P.kvarn_install_problem(vdir)
    assert kin.main(["--vllm-dir", str(vdir)]) == 0
    assert P.kvarn_install_problem(vdir) is None
    rel, _ = next(iter(kin.sources().items()))
    target = site / rel
    target.unlink()   # installed files may be links into the overlay's source: replace, not write through
    target.write_text("# an older kernel\n")
    why = P.kvarn_install_problem(vdir)
    assert f"{rel.rsplit('/', 1)[-1]} differs" in why
