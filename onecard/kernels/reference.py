"""Plain-torch references for onecard's Triton kernels, and builders of paged KV test cases.

``reference_verify_attention`` computes the wide-verify attention in float64 straight from
vLLM 0.27.1's paged cache layout (TRITON_ATTN backend), dequantizing int8 / int4 per-token-head
entries with the formats described in ``onecard.kernels.wide_verify``.

``make_verify_case`` builds a random batch the way the TRITON_ATTN backend lays it out: one
packed allocation of logical shape (num_blocks, num_kv_heads, block_size, 2 * padded_head)
split into K and V views [num_blocks, block_size, num_kv_heads, padded_head], float32 scale
views carved from the padding bytes, a shuffled block table and ragged sequence lengths. The
quantizers here mirror vLLM's write path (int8: absmax / 127, round half away from zero; int4:
randomized Hadamard rotation, asymmetric 4-bit with the zero point hidden in the scale's low
mantissa bits) so the data has realistic statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

KV_DTYPES = ("bf16", "int8", "int4")
WRITERS = ("onecard", "vllm")  # VerifyCase.append_tokens: the reference quantizers, or vLLM's write op


def interpreted_vllm_triton() -> None:
    """On a machine with no GPU driver, vLLM replaces Triton with a placeholder when it is first
    imported, so its own kernels (the cache write ops) cannot run under ``TRITON_INTERPRET=1``.
    Call this, with ``TRITON_INTERPRET=1`` set, before vLLM's first import: Triton's nvidia driver
    reports active while ``vllm.triton_utils`` is imported, then reverts. No-op once vLLM was
    imported with a real Triton."""
    import os
    import sys

    if "vllm.triton_utils" in sys.modules:
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:
            raise RuntimeError("vLLM was imported before interpreted_vllm_triton(): its Triton is a "
                               "placeholder; call it before the first vLLM import")
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("interpreted_vllm_triton() needs TRITON_INTERPRET=1 before Triton is imported")
    import triton.backends as tb

    saved = {}
    for name, b in tb.backends.items():
        if b.driver is not None:
            saved[name] = b.driver.is_active
            b.driver.is_active = staticmethod(lambda n=name: n == "nvidia")
    try:
        import vllm.triton_utils  # noqa: F401
    finally:
        for name, f in saved.items():
            tb.backends[name].driver.is_active = f


def _hadamard(d: int, dtype=torch.float64, device="cpu") -> torch.Tensor:
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _rht_signs(d: int, device) -> torch.Tensor:
    from vllm.v1.attention.ops.int4_per_token_head import _get_rht_signs

    return _get_rht_signs(d, 0, torch.device("cpu")).to(device=device, dtype=torch.float64)


def rht_forward(x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """H . (signs * x) along the last dim, unnormalized (vLLM ``single_rht``)."""
    d = x.shape[-1]
    x = x.to(dtype) * _rht_signs(d, x.device).to(dtype)
    return x @ _hadamard(d, dtype=dtype, device=x.device)


def rht_inverse(y: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rht_forward` (signs * H . y / d), in float64."""
    d = y.shape[-1]
    return (y.double() @ _hadamard(d, device=y.device)) * _rht_signs(d, y.device) / d


def _split_scale_bits(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bits = scale.contiguous().view(torch.int32)
    zp = (bits & 0xF).double()
    sc = (bits & -16).view(torch.float32).double()
    return sc, zp


def dequant_tokens(data: torch.Tensor, scale: torch.Tensor | None, kv_dtype: str,
                   head_dim: int) -> torch.Tensor:
    """[N, H, D_store] cache rows (+ [N, H] float32 scales) -> [N, H, head_dim] float64 in
    the model's domain (int4 rows are rotated back)."""
    if kv_dtype == "bf16":
        return data[..., :head_dim].double()
    if kv_dtype == "int8":
        return data[..., :head_dim].double() * scale.double()[..., None]
    if kv_dtype == "int4":
        packed = data[..., : head_dim // 2].to(torch.int32)
        nib = torch.stack([packed & 0xF, (packed >> 4) & 0xF], dim=-1).reshape(
            *packed.shape[:-1], head_dim).double()
        sc, zp = _split_scale_bits(scale)
        return rht_inverse((nib - zp[..., None]) * sc[..., None])
    raise ValueError(f"kv_dtype {kv_dtype!r} is not valid; valid: {', '.join(KV_DTYPES)}")


def reference_verify_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    kv_dtype: str = "bf16",
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Float64 verify attention, causal (default) or not (every query sees all seq_len keys);
    returns [T, Hq, D] float64 (rows of tokens outside every sequence are left zero)."""
    num_tokens, num_q_heads, head_dim = q.shape
    page = key_cache.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float64, device=q.device)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q0, q1 = cu[s], cu[s + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        blk = block_table[s, pos // page].long()
        slot = pos % page
        ks = k_scale_cache[blk, slot] if k_scale_cache is not None else None
        vs = v_scale_cache[blk, slot] if v_scale_cache is not None else None
        k = dequant_tokens(key_cache[blk, slot], ks, kv_dtype, head_dim)  # [L, Hkv, D]
        v = dequant_tokens(value_cache[blk, slot], vs, kv_dtype, head_dim)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        qs = q[q0:q1].double()  # [ql, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * softmax_scale
        limit = seq_len - q_len + torch.arange(q_len, device=q.device) + 1
        if not causal:
            limit = torch.full_like(limit, seq_len)
        mask = pos[None, :] >= limit[:, None]
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


# ---------------------------------------------------------------------------------------------
# Random cases in vLLM's layout
# ---------------------------------------------------------------------------------------------


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, halves away from zero (the kernels' and vLLM's quantizers)."""
    return torch.where(x >= 0, x + 0.5, x - 0.5).trunc()


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> int8 data, float32 scale (absmax / 127, round half away from zero)."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / 127.0).clamp_min(1e-6)
    y = xf / scale[..., None]
    y = _round_half_away(y).clamp(-128, 127)
    return y.to(torch.int8), scale


def quantize_query_rows_int8(q: torch.Tensor) -> torch.Tensor:
    """The query as the wide-verify kernel's ``qk_int8`` sees it, float64: each [D] row scaled
    by 127 / its absmax in float32, rounded half away from zero to -127..127, times absmax / 127
    (an all-zero row stays zero). Feed it to :func:`reference_verify_attention` in place of q."""
    qf = q.float()
    amax = qf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    y = qf * inv
    codes = _round_half_away(y)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return codes.double() * scale.double()


def quantize_int4(x: torch.Tensor, rotated_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> packed uint8 [..., D/2] (rotated, asymmetric) and float32 scale with zp bits.
    ``rotated_dtype``: round the rotated rows to it before quantizing, as vLLM's
    ``reshape_and_cache_int4`` does (``single_rht(key.float()).to(key.dtype)``)."""
    r = rht_forward(x.float(), torch.float32)
    if rotated_dtype is not None:
        r = r.to(rotated_dtype).float()
    lo, hi = r.amin(-1), r.amax(-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-6)
    z = -lo / scale
    zp = _round_half_away(z).clamp(0, 15)
    nib = (r / scale[..., None] + zp[..., None])
    nib = _round_half_away(nib).clamp(0, 15).to(torch.int32)
    packed = (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)
    bits = (scale.contiguous().view(torch.int32) & -16) | zp.to(torch.int32)
    return packed, bits.view(torch.float32)


@dataclass
class VerifyCase:
    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    k_scale_cache: torch.Tensor | None
    v_scale_cache: torch.Tensor | None
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    softmax_scale: float
    kv_dtype: str
    max_query_len: int
    max_seq_len: int
    kv_cache: torch.Tensor = field(repr=False, default=None)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K/V (+ scales) a kernel must read once for this batch."""
        nkv, d = self.key_cache.shape[2], self.q.shape[2]
        per_head = {"bf16": 2 * d, "int8": d + 4, "int4": d // 2 + 4}[self.kv_dtype]
        return int(self.seq_lens.sum().item()) * nkv * 2 * per_head

    def append_tokens(self, k: torch.Tensor, v: torch.Tensor, writer: str = "onecard") -> None:
        """Write keys / values ``k``, ``v`` [n, Hkv, D] (the model's dtype) at positions
        seq_len..seq_len+n-1 of the first sequence and extend it: what a server's cache write does
        at each prefill chunk and decode step. ``writer`` "onecard": the reference quantizers
        (int4: rotated, rounded to the model's dtype, quantized, as vLLM does); "vllm": vLLM's own
        write op (``triton_reshape_and_cache_flash_per_token_head_quant``; on CUDA its int4 path
        rotates with hadacore), over a slot mapping as the model runner builds it."""
        if writer not in WRITERS:
            raise ValueError(f"writer {writer!r} is not valid; valid: {', '.join(WRITERS)}")
        bs = self.key_cache.shape[1]
        start = int(self.seq_lens[0])
        n = k.shape[0]
        if (start + n + bs - 1) // bs > self.block_table.shape[1]:
            raise ValueError(f"{start + n} tokens do not fit the block table's "
                             f"{self.block_table.shape[1]} pages of {bs}")
        pos = torch.arange(start, start + n, device=self.key_cache.device)
        blk, slot = self.block_table[0, pos // bs].long(), pos % bs
        if writer == "vllm" and self.kv_dtype != "bf16":
            from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
                triton_reshape_and_cache_flash_per_token_head_quant as vllm_write)
            from vllm.v1.kv_cache_interface import KVQuantMode

            mode = (KVQuantMode.INT8_PER_TOKEN_HEAD if self.kv_dtype == "int8"
                    else KVQuantMode.INT4_PER_TOKEN_HEAD)
            vllm_write(k, v, self.key_cache, self.value_cache, self.k_scale_cache,
                       self.v_scale_cache, blk * bs + slot, mode)
        elif self.kv_dtype == "bf16":
            self.key_cache[blk, slot] = k.to(self.key_cache.dtype)
            self.value_cache[blk, slot] = v.to(self.value_cache.dtype)
        else:
            for src, dst, sdst in ((k, self.key_cache, self.k_scale_cache),
                                   (v, self.value_cache, self.v_scale_cache)):
                data, scale = (quantize_int8(src) if self.kv_dtype == "int8"
                               else quantize_int4(src, rotated_dtype=src.dtype))
                rows = dst[blk, slot]
                rows[..., : data.shape[-1]] = data.to(dst.dtype)
                dst[blk, slot] = rows
                sdst[blk, slot] = scale
        self.seq_lens[0] = start + n
        self.max_seq_len = start + n

    def poison_slots(self, blk, slot) -> None:
        """Fill cache slots ``[blk, slot]`` (ints or slices, so the write lands in the cache) with
        what an allocation vLLM never wrote may hold: NaN scales and 0xFF codes for int8 / int4
        (patch 0020 leaves scale views unfilled), NaN values for bf16. A kernel must not let them
        reach any output."""
        if self.kv_dtype == "bf16":
            self.key_cache[blk, slot] = float("nan")
            self.value_cache[blk, slot] = float("nan")
            return
        d = self.q.shape[-1]
        n = d if self.kv_dtype == "int8" else d // 2
        for half, sc in ((self.key_cache, self.k_scale_cache), (self.value_cache, self.v_scale_cache)):
            sc[blk, slot] = float("nan")
            half[blk, slot].view(torch.uint8)[..., :n] = 0xFF

    def poison_past_the_end(self, spare_blocks: bool = True) -> None:
        """``poison_slots`` on every slot past each sequence's end in its last page and, with
        ``spare_blocks``, on every block no sequence owns."""
        bs = self.key_cache.shape[1]
        owned = set()
        for s, sl in enumerate(self.seq_lens.tolist()):
            if sl <= 0:
                continue
            nb = -(-sl // bs)
            owned.update(int(b) for b in self.block_table[s, :nb].tolist())
            last = int(self.block_table[s, nb - 1])
            if sl % bs:
                self.poison_slots(last, slice(sl % bs, bs))
        if spare_blocks:
            for blk in range(self.key_cache.shape[0]):
                if blk not in owned:
                    self.poison_slots(blk, slice(None))

    def reference(self, causal: bool = True) -> torch.Tensor:
        return reference_verify_attention(
            self.q, self.key_cache, self.value_cache, cu_seqlens_q=self.cu_seqlens_q,
            seq_lens=self.seq_lens, block_table=self.block_table,
            softmax_scale=self.softmax_scale, kv_dtype=self.kv_dtype,
            k_scale_cache=self.k_scale_cache, v_scale_cache=self.v_scale_cache, causal=causal)


def paged_views(kv_cache: torch.Tensor, head_dim: int, kv_dtype: str):
    """TRITON_ATTN's views of one packed allocation of logical shape
    (num_blocks, nkv, block_size, 2 * padded): K, V [nb, bs, nkv, padded] and, for int8/int4,
    float32 scale views [nb, bs, nkv] over the bytes after the data of each half."""
    nb, nkv, bs, content = kv_cache.shape
    padded = content // 2
    k, v = kv_cache.transpose(1, 2).split(padded, dim=-1)
    if kv_dtype == "bf16":
        return k, v, None, None
    esz = kv_cache.element_size()
    data = padded - 4 // esz
    base = torch.tensor([], dtype=torch.float32, device=kv_cache.device).set_(
        kv_cache.untyped_storage())
    st = [s * esz // 4 for s in kv_cache.stride()]
    off = kv_cache.storage_offset() * esz // 4
    size, stride = (nb, bs, nkv), (st[0], st[2], st[1])
    ks = torch.as_strided(base, size, stride, off + data * esz // 4)
    vs = torch.as_strided(base, size, stride, off + (padded + data) * esz // 4)
    return k, v, ks, vs


def make_verify_case(
    *,
    q_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    kv_dtype: str,
    extra_blocks: int = 3,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
) -> VerifyCase:
    """Random verify batch; data drawn fresh from ``generator`` (never zeros)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r} is not valid; valid: {', '.join(KV_DTYPES)}")
    if len(q_lens) != len(seq_lens) or any(ql > sl or ql < 1 for ql, sl in zip(q_lens, seq_lens)):
        raise ValueError("need one q_len per sequence with 1 <= q_len <= seq_len")
    gen = generator
    blocks_per_seq = [math.ceil(sl / block_size) for sl in seq_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(seq_lens), max_blocks + 1, dtype=torch.int32)
    i = 0
    for s, nb in enumerate(blocks_per_seq):
        block_table[s, :nb] = perm[i:i + nb].to(torch.int32)
        block_table[s, nb:] = perm[-1].item()  # unused slots point at a real (unused) block
        i += nb
    if kv_dtype == "bf16":
        padded, cdt = head_dim, dtype
    elif kv_dtype == "int8":
        padded, cdt = head_dim + 4, torch.int8
    else:
        padded, cdt = head_dim // 2 + 4, torch.uint8
    kv_cache = torch.empty(num_blocks, num_kv_heads, block_size, 2 * padded, dtype=cdt)
    k_c, v_c, ks_c, vs_c = paged_views(kv_cache, head_dim, kv_dtype)
    # fill every slot (also unused ones) with random content
    k_full = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_full = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    k_full = (k_full * 1.5 + 0.3).to(dtype)
    v_full = v_full.to(dtype)
    if kv_dtype == "bf16":
        k_c.copy_(k_full)
        v_c.copy_(v_full)
    else:
        quant = quantize_int8 if kv_dtype == "int8" else quantize_int4
        for src, dst, sdst in ((k_full, k_c, ks_c), (v_full, v_c, vs_c)):
            data, scale = quant(src)
            dst[..., : data.shape[-1]].copy_(data)
            sdst.copy_(scale)
    total_q = sum(q_lens)
    q = (torch.randn(total_q, num_q_heads, head_dim, generator=gen) * 1.2).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    dev = torch.device(device)
    kv_cache = kv_cache.to(dev)
    k_c, v_c, ks_c, vs_c = paged_views(kv_cache, head_dim, kv_dtype)
    return VerifyCase(
        q=q.to(dev), key_cache=k_c, value_cache=v_c, k_scale_cache=ks_c, v_scale_cache=vs_c,
        cu_seqlens_q=cu.to(dev), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_table=block_table.to(dev), softmax_scale=head_dim ** -0.5, kv_dtype=kv_dtype,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), kv_cache=kv_cache)


def case_from_tokens(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kv_dtype: str,
    softmax_scale: float,
    block_size: int = 16,
    extra_blocks: int = 2,
    capacity: int = 0,
    writer: str = "onecard",
    generator: torch.Generator | None = None,
) -> VerifyCase:
    """One sequence of given keys / values ``k``, ``v`` [S, Hkv, D] (the model's dtype) whose last
    ``q.shape[0]`` positions are the query rows ``q`` [T, Hq, D], written into vLLM's layout the
    way vLLM writes it (``VerifyCase.append_tokens`` with ``writer``), with a shuffled block table
    of pages for max(S, ``capacity``) tokens (later tokens: ``append_tokens``). The slots past the
    end and the spare blocks hold what an unfilled allocation may: NaN scales and 0xFF codes
    (bf16: NaN). On ``q``'s device."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r} is not valid; valid: {', '.join(KV_DTYPES)}")
    seq_len, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or q.shape[0] > seq_len or q.shape[2] != head_dim:
        raise ValueError(f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} are not valid; "
                         "valid: k, v [S, Hkv, D] and q [T <= S, Hq, D]")
    if writer not in WRITERS:
        raise ValueError(f"writer {writer!r} is not valid; valid: {', '.join(WRITERS)}")
    dev = q.device
    nb = math.ceil(max(seq_len, capacity) / block_size)
    num_blocks = nb + extra_blocks
    perm = torch.randperm(num_blocks, generator=generator)
    block_table = perm[:nb].to(torch.int32)[None].to(dev)
    padded, cdt = {"bf16": (head_dim, k.dtype), "int8": (head_dim + 4, torch.int8),
                   "int4": (head_dim // 2 + 4, torch.uint8)}[kv_dtype]
    kv_cache = torch.empty(num_blocks, num_kv_heads, block_size, 2 * padded, dtype=cdt, device=dev)
    k_c, v_c, ks_c, vs_c = paged_views(kv_cache, head_dim, kv_dtype)
    t = q.shape[0]
    case = VerifyCase(
        q=q, key_cache=k_c, value_cache=v_c, k_scale_cache=ks_c, v_scale_cache=vs_c,
        cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([0], dtype=torch.int32, device=dev), block_table=block_table,
        softmax_scale=softmax_scale, kv_dtype=kv_dtype, max_query_len=t, max_seq_len=0,
        kv_cache=kv_cache)
    case.poison_slots(slice(None), slice(None))  # every slot, before the tokens are written
    case.append_tokens(k, v, writer)
    return case
