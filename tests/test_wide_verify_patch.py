"""The wide-verify patch: it ships exactly onecard's kernel, applies to pristine vLLM 0.27.1 after
the current series, and the patched TRITON_ATTN backend imports and reads ONECARD_WIDE_VERIFY."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from onecard import patching

REPO = Path(__file__).resolve().parent.parent
_NAME = "0070-wide-verify-triton-attn.patch"
# patches/pending/ holds it until the lead lists it in patches/series and moves it to patches/
PATCH = next((p for p in (REPO / "patches" / _NAME, REPO / "patches" / "pending" / _NAME)
              if p.is_file()), REPO / "patches" / _NAME)
KERNEL = REPO / "onecard" / "kernels" / "wide_verify.py"
TARGET = "vllm/v1/attention/ops/onecard_wide_verify.py"


def test_shipped_kernel_is_identical_to_onecard_kernel():
    patch = patching.parse_patch(PATCH)
    for key in ("What", "Why", "Test", "Upstream"):
        assert patch.header.get(key), f"header lacks {key}:"
    files = {fd.path: fd for fd in patch.files}
    assert set(files) == {TARGET, "vllm/v1/attention/backends/triton_attn.py"}
    fd = files[TARGET]
    assert fd.created, f"{TARGET} must be created by the patch"
    shipped = "".join(fd.hunks[0].new)
    assert shipped == KERNEL.read_text(encoding="utf-8"), (
        "run: python3 scripts/make_wide_verify_patch.py " + str(PATCH.relative_to(REPO)))


@pytest.fixture(scope="module")
def patched_view(vllm_dir, tmp_path_factory):
    """The current series plus this patch (if the series does not list it yet), overlaid."""
    tmp = tmp_path_factory.mktemp("wv-series")
    names = [p.name for p in patching.read_series()]
    for name in names:
        shutil.copy2(REPO / "patches" / name, tmp / name)
    if PATCH.name not in names:
        names.append(PATCH.name)
    shutil.copy2(PATCH, tmp / PATCH.name)
    (tmp / "series").write_text("\n".join(names) + "\n")
    dest = tmp_path_factory.mktemp("wv-site")
    return patching.overlay(vllm_dir, dest, series=tmp / "series")


def test_patched_backend_imports_and_reads_knob(patched_view):
    code = textwrap.dedent(
        """
        import os
        import vllm.v1.attention.backends.triton_attn as t
        from vllm.v1.attention.ops import onecard_wide_verify as k
        assert t._ONECARD_WIDE_VERIFY is True, "default must be on"
        for val, want in (("off", False), ("0", False), ("auto", True), ("1", True)):
            os.environ["ONECARD_WIDE_VERIFY"] = val
            assert t._onecard_wide_verify_setting() is want, val
        os.environ["ONECARD_WIDE_VERIFY"] = "sometimes"
        try:
            t._onecard_wide_verify_setting()
        except ValueError as exc:
            assert "valid: auto, 1, on, 0, off" in str(exc), exc
        else:
            raise AssertionError("bad value accepted")
        assert k.MAX_QUERY_LEN == 16
        print("OK", t.__file__)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "ONECARD_WIDE_VERIFY"}
    env["PYTHONPATH"] = str(patched_view) + os.pathsep + str(REPO)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, cwd=str(patched_view))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "OK" in proc.stdout
    assert str(patched_view) in proc.stdout  # the overlay, not the pristine install, was imported


def test_patched_forward_routes_verify_batches(patched_view):
    """TritonAttentionImpl.forward of the patched vLLM on CPU (Triton interpreter): a verify batch
    (max_query_len 2..16) goes through the wide-verify kernel and matches the float64 reference
    for bf16 / int8 / int4 caches in the backend's own packed layout; decode batches
    (max_query_len 1) and the knob off go to stock unified_attention."""
    code = textwrap.dedent(
        """
        import types, torch
        import vllm.v1.attention.backends.triton_attn as t
        from onecard.kernels.reference import make_verify_case

        calls = []
        t.unified_attention = lambda **kw: calls.append(kw["max_seqlen_q"])
        g = torch.Generator().manual_seed(torch.seed() % 2**31)
        layer = types.SimpleNamespace(_k_scale=torch.ones(1), _v_scale=torch.ones(1),
                                      _q_scale=torch.ones(1))

        def run(kv, q_lens, seq_lens, knob=True):
            c = make_verify_case(q_lens=q_lens, seq_lens=seq_lens, num_q_heads=4,
                                 num_kv_heads=2, head_dim=32, block_size=16, kv_dtype=kv,
                                 generator=g)
            t._ONECARD_WIDE_VERIFY = knob
            impl = t.TritonAttentionImpl(
                num_heads=4, head_size=32, scale=c.softmax_scale, num_kv_heads=2,
                alibi_slopes=None, sliding_window=None,
                kv_cache_dtype={"bf16": "auto", "int8": "int8_per_token_head",
                                "int4": "int4_per_token_head"}[kv])
            kv_cache = c.kv_cache
            if kv != "bf16":  # the backend sets scales to 1.0 on first sight: do that first
                saved = kv_cache.clone()
                impl._ensure_scale_caches(kv_cache)
                kv_cache.copy_(saved)
            n = c.q.shape[0]
            md = t.TritonAttentionMetadata(
                num_actual_tokens=n, max_query_len=max(q_lens), query_start_loc=c.cu_seqlens_q,
                max_seq_len=max(seq_lens), seq_lens=c.seq_lens, block_table=c.block_table,
                slot_mapping=torch.zeros(n, dtype=torch.int64), seq_threshold_3D=0,
                num_par_softmax_segments=0, softmax_segm_output=None, softmax_segm_max=None,
                softmax_segm_expsum=None, causal=True, use_cascade=False, common_prefix_len=0,
                cu_prefix_query_lens=None, prefix_kv_lens=None, suffix_kv_lens=None)
            out = torch.full_like(c.q, float("nan"))
            impl.forward(layer, c.q, c.q, c.q, kv_cache, md, out)
            return c, out

        for kv in ("bf16", "int8", "int4"):
            c, out = run(kv, [3, 5], [40, 21])
            ref = c.reference()
            err = float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0))
            assert err < 3e-2, (kv, err)
            print(kv, "rel err", err)
        assert calls == [], calls
        run("int8", [1, 1], [40, 21])
        assert calls == [1], calls
        run("bf16", [3, 5], [40, 21], knob=False)
        assert calls == [1, 5], calls
        print("OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "ONECARD_WIDE_VERIFY"}
    env["PYTHONPATH"] = str(patched_view) + os.pathsep + str(REPO)
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, cwd=str(patched_view))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "OK" in proc.stdout
