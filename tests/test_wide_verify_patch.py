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
from tests.child_code import TRITON_ATTN_BUILDER, TRITON_DRIVER_ACTIVE, run_child

REPO = Path(__file__).resolve().parent.parent
_NAME = "0070-wide-verify-triton-attn.patch"
PATCH = REPO / "patches" / _NAME
KERNEL = REPO / "onecard" / "kernels" / "wide_verify.py"
TARGET = "vllm/v1/attention/ops/onecard_wide_verify.py"


def test_listed_in_series():
    assert _NAME in [p.name for p in patching.read_series()]


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
    env = {k: v for k, v in os.environ.items() if k not in ("ONECARD_WIDE_VERIFY", "ONECARD_WIDE_DECODE")}
    env["PYTHONPATH"] = str(patched_view) + os.pathsep + str(REPO)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, cwd=str(patched_view))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "OK" in proc.stdout
    assert str(patched_view) in proc.stdout  # the overlay, not the pristine install, was imported


# Stock unified_attention under the CPU interpreter: vLLM disables its Triton wrapper when no GPU
# driver is active, so the child makes Triton's nvidia driver report active before vLLM is
# imported (kernels then run through TRITON_INTERPRET=1). fp16 queries: the interpreter
# mis-multiplies bf16 dot operands in the stock kernel (our kernel upcasts on CPU).
_CHILD_PRELUDE = TRITON_DRIVER_ACTIVE + """
import types, torch
import vllm.v1.attention.backends.triton_attn as t
from vllm.triton_utils import HAS_TRITON
assert HAS_TRITON, "stock Triton kernels are not runnable in this child"
from vllm.v1.attention.backend import CommonAttentionMetadata
from onecard.kernels.reference import make_verify_case
""" + TRITON_ATTN_BUILDER + """
def common(q_lens, seq_lens, prefilling, block_table=None, cu=None, sl=None, causal=True):
    cu = cu if cu is not None else torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(),
                                                dtype=torch.int32)
    sl = sl if sl is not None else torch.tensor(seq_lens, dtype=torch.int32)
    n = int(cu[-1])
    return CommonAttentionMetadata(
        query_start_loc=cu, query_start_loc_cpu=cu, seq_lens=sl, num_reqs=len(q_lens),
        num_actual_tokens=n, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table if block_table is not None else torch.zeros(len(q_lens), 4, dtype=torch.int32),
        slot_mapping=torch.zeros(n, dtype=torch.int64), causal=causal,
        is_prefilling=None if prefilling is None else torch.tensor(prefilling, dtype=torch.bool))
"""


def _run_child(patched_view, code: str, env_extra=None):
    proc = run_child(patched_view, _CHILD_PRELUDE + textwrap.dedent(code), env_extra)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "OK" in proc.stdout
    return proc.stdout


def test_builder_marks_only_spec_verify_batches(patched_view):
    """The dispatch condition, decided once per batch in build(): max query length 2..16 and no
    request in its prompt. Pure decode, a prefill chunk of <= 16 tokens (alone or next to
    verify rows), 17 tokens, unknown is_prefilling and the knob off are all stock."""
    _run_child(patched_view, """
        b = builder()
        assert t._ONECARD_WIDE_DECODE is None  # unset -> auto (every KV dtype on ours)
        t._ONECARD_WIDE_DECODE = False         # the verify-only rule first
        def mark(q_lens, prefilling, knob=True):
            t._ONECARD_WIDE_VERIFY = knob
            return b.build(0, common(q_lens, [40] * len(q_lens), prefilling)).onecard_verify
        assert mark([4, 4], [False, False]) is True            # verify, k=3
        assert mark([4, 1, 2], [False, False, False]) is True  # ragged verify (async / rejections)
        assert mark([16], [False]) is True
        assert mark([1, 1], [False, False]) is False           # plain decode: stock 3D path
        assert mark([17], [False]) is False                    # longer than the kernel's block
        assert mark([4, 9], [False, True]) is False            # a 9-token prefill chunk in the batch
        assert mark([5], [True]) is False                      # a short prompt alone
        assert mark([4, 4], None) is False                     # runner gave no is_prefilling
        assert mark([4, 4], [False, False], knob=False) is False
        # a DFlash drafter's block: non-causal, 1 + k rows per request, built by the proposer
        # without is_prefilling
        def mark_nc(q_lens, knob=True):
            t._ONECARD_WIDE_VERIFY = knob
            return b.build(0, common(q_lens, [40] * len(q_lens), None, causal=False)).onecard_verify
        assert mark_nc([8, 8]) is True and mark_nc([16]) is True
        assert mark_nc([17]) is False and mark_nc([1, 1]) is False
        assert mark_nc([8], knob=False) is False
        # ONECARD_WIDE_DECODE: a plain decode batch is marked too, never a prompt's 1-token chunk
        t._ONECARD_WIDE_DECODE = True
        assert mark([1, 1], [False, False]) is True and mark([1], [False]) is True
        assert mark([1, 1], [False, True]) is False and mark([1], None) is False
        assert mark([1, 1], [False, False], knob=False) is False   # needs WIDE_VERIFY
        assert mark([4, 1], [False, False]) is True and mark([17], [False]) is False
        t._ONECARD_WIDE_DECODE = None   # auto marks decode batches too; forward picks by KV dtype
        assert mark([1, 1], [False, False]) is True and mark([1], [False, True]) is False
        t._ONECARD_WIDE_DECODE = False
        assert mark([1, 1], [False, False]) is False
        print("OK")
    """)


def test_patched_forward_routes_and_matches_stock(patched_view):
    """TritonAttentionImpl.forward of the patched vLLM on CPU (Triton interpreter), batches built
    by the real build(): a verify batch goes through the wide-verify kernel, a decode batch, a
    batch with a prefill chunk and the knob off go to stock unified_attention (the real kernel,
    spied on); for bf16 (fp16 here) / int8 / int4 caches in the backend's own packed layout the
    two routes agree with each other and with the float64 reference."""
    _run_child(patched_view, """
        import vllm.v1.attention.ops.onecard_wide_verify as wv
        calls = []
        stock = t.unified_attention
        def spy_stock(**kw):
            calls.append(("stock", kw["max_seqlen_q"]))
            return stock(**kw)
        ours = wv.wide_verify_attention
        def spy_ours(*a, **kw):
            calls.append(("ours", kw["max_query_len"]))
            return ours(*a, **kw)
        t.unified_attention = spy_stock
        wv.wide_verify_attention = spy_ours
        g = torch.Generator().manual_seed(1234)
        layer = types.SimpleNamespace(_k_scale=torch.ones(1), _v_scale=torch.ones(1),
                                      _q_scale=torch.ones(1))
        b = builder()
        t._ONECARD_WIDE_DECODE = False  # verify-only routing first (on by default: see below)

        def run(kv, q_lens, seq_lens, prefilling, knob=True, causal=True):
            c = make_verify_case(q_lens=q_lens, seq_lens=seq_lens, num_q_heads=4,
                                 num_kv_heads=2, head_dim=32, block_size=16, kv_dtype=kv,
                                 generator=g, dtype=torch.float16)
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
            md = b.build(0, common(q_lens, seq_lens, prefilling, c.block_table,
                                   c.cu_seqlens_q, c.seq_lens, causal=causal))
            out = torch.full_like(c.q, float("nan"))
            impl.forward(layer, c.q, c.q, c.q, kv_cache, md, out)
            ref = c.reference(causal=causal)
            err = float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0))
            return out, err

        for kv in ("bf16", "int8", "int4"):
            calls.clear()
            g.manual_seed(7)
            ours_out, e1 = run(kv, [3, 5], [40, 21], [False, False])
            assert calls == [("ours", 5)], calls
            g.manual_seed(7)
            stock_out, e2 = run(kv, [3, 5], [40, 21], [False, False], knob=False)
            assert calls == [("ours", 5), ("stock", 5)], calls
            diff = float((ours_out.double() - stock_out.double()).abs().max())
            print(kv, "ours vs ref", e1, "stock vs ref", e2, "ours vs stock", diff)
            assert e1 < 1e-2 and e2 < 1e-2 and diff < 1e-2, (kv, e1, e2, diff)
        calls.clear()
        run("int8", [1, 1], [40, 21], [False, False])
        run("bf16", [3, 5], [40, 21], [False, True])   # second row is a 5-token prefill chunk
        assert calls == [("stock", 1), ("stock", 5)], calls
        # ONECARD_WIDE_DECODE: a plain decode batch goes through ours, equal to stock's 3D path
        for kv in ("bf16", "int8", "int4"):
            calls.clear()
            t._ONECARD_WIDE_DECODE = True
            g.manual_seed(5)
            ours_out, e1 = run(kv, [1, 1, 1], [40, 21, 77], [False, False, False])
            t._ONECARD_WIDE_DECODE = False
            g.manual_seed(5)
            stock_out, e2 = run(kv, [1, 1, 1], [40, 21, 77], [False, False, False])
            assert calls == [("ours", 1), ("stock", 1)], calls
            diff = float((ours_out.double() - stock_out.double()).abs().max())
            print(kv, "decode: ours vs ref", e1, "stock vs ref", e2, "ours vs stock", diff)
            assert e1 < 1e-2 and e2 < 1e-2 and diff < 1e-2, (kv, e1, e2, diff)
        # auto (the default): every KV dtype's decode on ours, int4 included again since session
        # 31 (stock int4 decode returned NaN log-probabilities on an H100 where ours did not);
        # an int4 verify block goes to ours too
        t._ONECARD_WIDE_DECODE = None
        for kv, want in (("bf16", "ours"), ("int8", "ours"), ("int4", "ours")):
            calls.clear()
            g.manual_seed(5)
            _, e = run(kv, [1, 1, 1], [40, 21, 77], [False, False, False])
            assert calls == [(want, 1)] and e < 1e-2, (kv, calls, e)
        calls.clear()
        run("int4", [3, 5], [40, 21], [False, False])
        assert calls == [("ours", 5)], calls
        t._ONECARD_WIDE_DECODE = False
        # a DFlash drafter's non-causal block (8 rows per request, no is_prefilling): ours,
        # equal to stock's non-causal path and to the float64 reference
        for kv in ("bf16", "int8"):
            calls.clear()
            g.manual_seed(11)
            ours_out, e1 = run(kv, [8, 8], [40, 19], None, causal=False)
            g.manual_seed(11)
            stock_out, e2 = run(kv, [8, 8], [40, 19], None, knob=False, causal=False)
            assert calls == [("ours", 8), ("stock", 8)], calls
            diff = float((ours_out.double() - stock_out.double()).abs().max())
            print(kv, "non-causal: ours vs ref", e1, "stock vs ref", e2, "ours vs stock", diff)
            assert e1 < 1e-2 and e2 < 1e-2 and diff < 1e-2, (kv, e1, e2, diff)
        print("OK")
    """)
