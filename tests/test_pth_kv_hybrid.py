"""int8 / int4 per-token-head KV on TRITON_ATTN in a hybrid (attention + GDN) model with
speculative verify: what stock vLLM 0.27.1 gets right, and the one thing it gets wrong.

1. Patch 0020: on first sight of its KV cache, stock `TritonAttentionImpl._ensure_scale_caches`
   wrote 1.0 into the scale slot of EVERY page. In a hybrid model the raw tensor of attention
   layer i is shared with GDN layer i of every other KV cache group (kv_cache_utils, "General
   case": one tensor per index, shared_by one layer of each group; the block pool hands each
   group different blocks), so that fill lands in pages that hold live GDN conv/SSM state. The
   first sight comes at capture time with FULL CUDA graphs, but at the first real step in eager
   mode (--enforce-eager), i.e. after the first request's GDN layers stored their state.
   The test builds that sharing with vLLM's own view functions and checks the state page.
2. Stock is already correct (no patch) for a multi-token verify block (ragged q_len up to 16,
   per-sequence causal; the int4 path too) over int8 / int4 caches written by vLLM's own
   per-token-head write kernels into PADDED pages (AttentionSpec.page_size_padded, the strided
   view vLLM builds when a drafter's page forces padding) with a hybrid-style block size
   (48 = 3 x 16, not a power of two); the wide-verify route of patch 0070 agrees on the same
   views. Stock kernels run under the CPU interpreter (fp16 queries; see
   tests/test_wide_verify_patch.py for why).
"""
from __future__ import annotations

import os
import shutil
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
    """The current patches/series applied to an overlay of the installed (pristine) vLLM."""
    dest = tmp_path_factory.mktemp("pth-series")
    return patching.overlay(vllm_dir, dest)


def _child(site: Path, code: str, prelude: str = "") -> str:
    env = {k: v for k, v in os.environ.items() if k != "ONECARD_WIDE_VERIFY"}
    env["PYTHONPATH"] = str(site) + os.pathsep + str(REPO)
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=str(site))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


_SHARED = """
import torch
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, get_kv_quant_mode
from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

def shared_views(cache_dtype, nkv=2, hs=32, bs=48, num_blocks=6, pad=0):
    dt = torch.uint8 if cache_dtype.startswith("int4") else torch.int8
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=nkv, head_size=hs, dtype=dt,
                             kv_quant_mode=get_kv_quant_mode(cache_dtype))
    page = spec.page_size_bytes + pad
    if pad:
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=nkv, head_size=hs, dtype=dt,
                                 kv_quant_mode=get_kv_quant_mode(cache_dtype), page_size_padded=page)
    # a GDN layer of another group, its page padded to the attention page (as vLLM does)
    mamba = MambaSpec(block_size=bs, shapes=((page // 8,),), dtypes=(torch.float32,), page_size_padded=page)
    assert mamba.page_size_bytes == spec.page_size_bytes == page
    raw = torch.zeros(page * num_blocks, dtype=torch.int8)   # one KVCacheTensor, shared_by both
    shape = TritonAttentionBackend.get_kv_cache_shape(num_blocks, bs, nkv, hs, cache_dtype_str=cache_dtype)
    order = (0, 2, 1, 3)  # get_kv_cache_stride_order() for the default NHD layout (needs a vllm config)
    attn = _reshape_attention_kv_cache(raw, spec, shape, order, num_blocks, None)
    state = raw[: num_blocks * page].view(num_blocks, 1, 1, page)   # gpu_model_runner's Mamba view
    return spec, attn, state
"""


def test_scale_views_leave_shared_state_pages_alone(vllm_dir, series_view):
    """Stock (fails the invariant, asserted as the bug) vs the series (patch 0020: holds)."""
    code = """
      for cache_dtype in ("int8_per_token_head", "int4_per_token_head"):
        spec, attn, state = shared_views(cache_dtype)
        # block 2 belongs to the GDN group: live recurrent state
        live = torch.randn(state.shape[-1] // 4, generator=torch.Generator().manual_seed(0))
        state[2, 0, 0].view(torch.float32).copy_(live)
        before = state[2].clone()
        impl = TritonAttentionImpl(num_heads=4, head_size=32, scale=0.17, num_kv_heads=2,
                                   alibi_slopes=None, sliding_window=None, kv_cache_dtype=cache_dtype)
        impl._ensure_scale_caches(attn)      # first sight (first real step in eager mode)
        changed = int((state[2] != before).sum())
        print(cache_dtype, "CHANGED", changed)
        # the views still address the right bytes: scale of (block 3, slot 5, head 1)
        impl._k_scale_cache[3, 5, 1] = 2.5
        k, v = attn.transpose(1, 2).split(attn.shape[-1] // 2, dim=-1)
        data = k.shape[-1] - 4
        assert float(k[3, 5, 1, data:].contiguous().view(torch.float32)) == 2.5
    """
    stock = _child(vllm_dir.parent, code, _SHARED)
    patched = _child(series_view, code, _SHARED)
    assert stock.count("CHANGED") == 2 and "CHANGED 0" not in stock, "stock no longer writes the pages: drop patch 0020"
    assert patched.count("CHANGED 0") == 2, patched


_DRIVER = TRITON_DRIVER_ACTIVE + """
import types
"""


@pytest.mark.parametrize("cache_dtype", ["int8_per_token_head", "int4_per_token_head"])
def test_verify_block_on_hybrid_pages_stock_and_wide(vllm_dir, series_view, cache_dtype):
    """A ragged verify batch (q_len 16 / 1 / 7) over K/V written by vLLM's own per-token-head
    write path (do_kv_cache_update) into padded or unpadded pages of block size 48: stock
    unified_attention (pristine vLLM) and the series' route (patch 0070: wide-verify kernel)
    both equal the float64 attention over the dequantized cache."""
    code = f"""
      import vllm.v1.attention.backends.triton_attn as t
      from vllm.v1.attention.backend import CommonAttentionMetadata
      from onecard.kernels.reference import reference_verify_attention
      g = torch.Generator().manual_seed(11)
      nq, nkv, hs, bs = 4, 2, 32, 48
      q_lens, seq_lens = [16, 1, 7], [100, 49, 16]
      nb = 9
      for pad in (0, 64):
        spec, attn, state = shared_views({cache_dtype!r}, nkv, hs, bs, nb, pad=pad)
        impl = t.TritonAttentionImpl(num_heads=nq, head_size=hs, scale=hs ** -0.5, num_kv_heads=nkv,
                                     alibi_slopes=None, sliding_window=None, kv_cache_dtype={cache_dtype!r})
        layer = types.SimpleNamespace(_k_scale=torch.ones(1), _v_scale=torch.ones(1), _q_scale=torch.ones(1))
        perm = torch.randperm(nb - 1, generator=g) + 1          # block 0 is the null block
        bt = torch.zeros(3, 3, dtype=torch.int32)
        i = 0
        for s, L in enumerate(seq_lens):
            n = -(-L // bs)
            bt[s, :n] = perm[i:i + n].to(torch.int32)
            i += n
        slots = torch.cat([bt[s, torch.arange(L) // bs].long() * bs + torch.arange(L) % bs
                           for s, L in enumerate(seq_lens)])
        T = slots.numel()
        key = (torch.randn(T, nkv, hs, generator=g) * 1.5 + 0.3).half()
        val = torch.randn(T, nkv, hs, generator=g).half()
        impl.do_kv_cache_update(layer, key, val, attn, slots)   # vLLM's write kernels
        kc, vc = impl._pth_key_value_caches(attn)
        q = (torch.randn(sum(q_lens), nq, hs, generator=g) * 1.2).half()
        cu = torch.tensor([0, 16, 17, 24], dtype=torch.int32)
        sl = torch.tensor(seq_lens, dtype=torch.int32)
        kvd = "int8" if {cache_dtype!r}.startswith("int8") else "int4"
        ref = reference_verify_attention(q, kc, vc, cu_seqlens_q=cu, seq_lens=sl, block_table=bt,
                                         softmax_scale=hs ** -0.5, kv_dtype=kvd,
                                         k_scale_cache=impl._k_scale_cache, v_scale_cache=impl._v_scale_cache)
        b = object.__new__(t.TritonAttentionMetadataBuilder)
        b.device = torch.device("cpu"); b.seq_threshold_3D = 8; b.num_par_softmax_segments = 16
        b.softmax_segm_output = torch.empty(8, nq, 16, hs); b.softmax_segm_max = torch.empty(8, nq, 16)
        b.softmax_segm_expsum = torch.empty(8, nq, 16); b.rswa_window = None
        cm = CommonAttentionMetadata(query_start_loc=cu, query_start_loc_cpu=cu, seq_lens=sl, num_reqs=3,
            num_actual_tokens=24, max_query_len=16, max_seq_len=100, block_table_tensor=bt,
            slot_mapping=torch.zeros(24, dtype=torch.int64), causal=True,
            is_prefilling=torch.zeros(3, dtype=torch.bool))
        md = b.build(0, cm)
        out = torch.full_like(q, float("nan"))
        impl.forward(layer, q, q, q, attn, md, out)
        err = float((out.double() - ref).abs().max() / ref.abs().max())
        route = "wide" if getattr(md, "onecard_verify", False) else "stock"
        print("ROUTE", route, "PAD", pad, "ERR", err)
        assert err < 5e-3, err
      print("OK")
    """
    stock = _child(vllm_dir.parent, code, _DRIVER + _SHARED)
    assert stock.count("ROUTE stock") == 2 and "OK" in stock, stock
    ours = _child(series_view, code, _DRIVER + _SHARED)
    assert ours.count("ROUTE wide") == 2 and "OK" in ours, ours
