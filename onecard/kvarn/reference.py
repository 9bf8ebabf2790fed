# SPDX-License-Identifier: Apache-2.0
"""Torch reference of the KVarN format (onecard.kvarn.format) and of attention over it.

* ``hadamard`` / ``rotate``: the normalized Walsh-Hadamard rotation (its own inverse).
* ``quantize_tile`` (rotate -> normalize -> quantize) and ``pack_codes``; ``write_block`` /
  ``read_block`` move a quantized tile in and out of one paged block's bytes; ``dequant_tile``
  (unpack -> dequantize -> unnormalize) returns rotated rows, ``rotate`` again un-rotates.
* ``stage_write``: tokens entering the fp16 stage (rotated there).
* ``reference_attention``: float64 causal decode/verify attention over a paged KVarN cache
  (packed tiles dequantized, sink tile and tail read from the fp16 stage), GQA.
* ``make_case``: a random paged batch laid out the way the kernels read it.

Quantization statistics are computed in float32 in the same order as the Triton pack kernel so
that its integer codes can be compared exactly; dequantization and attention run in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .format import EPS, BlockLayout, Preset, get_preset

_H_CACHE: dict = {}


def hadamard(d: int, dtype=torch.float64, device="cpu") -> torch.Tensor:
    """Hn = H / sqrt(d), H the Sylvester Walsh-Hadamard matrix (symmetric, Hn @ Hn = I)."""
    key = (d, dtype, str(device))
    if key not in _H_CACHE:
        if d < 1 or d & (d - 1):
            raise ValueError(f"head_dim {d} is not valid; valid: a power of two")
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _H_CACHE[key] = (h / math.sqrt(d)).to(dtype=dtype, device=device)
    return _H_CACHE[key]


def rotate(x: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """x @ Hn along the last dim (also the inverse rotation)."""
    return x.to(dtype) @ hadamard(x.shape[-1], dtype, x.device)


def _round(x: torch.Tensor) -> torch.Tensor:
    return torch.floor(x + 0.5)


@dataclass
class QuantTile:
    """One tile of one or more kv heads: codes [T, H, D] int32, fp16 parameters."""

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_scale: torch.Tensor  # [H, D]
    k_min: torch.Tensor  # [H, D]
    k_norm: torch.Tensor  # [T, H]
    v_scale: torch.Tensor  # [T, H]
    v_min: torch.Tensor  # [T, H]
    v_norm: torch.Tensor  # [H, D]


def quantize_tile(k_rot: torch.Tensor, v_rot: torch.Tensor, preset: str | Preset | None = None,
                  dtype=torch.float32) -> QuantTile:
    """Rotated rows [T, H, D] (one full tile) -> QuantTile (normalize, asymmetric rounding)."""
    p = get_preset(preset)
    T, H, D = k_rot.shape
    if T != p.tile:
        raise ValueError(f"a tile has {p.tile} tokens, got {T}")
    kmax, vmax = 2 ** p.k_bits - 1, 2 ** p.v_bits - 1
    r = k_rot.to(dtype)
    kn = torch.sqrt((r * r).sum(-1) / D).clamp_min(EPS).half()  # [T, H]
    u = r / kn.to(dtype)[..., None]
    kmn = u.amin(0).half()  # [H, D]
    ksc = ((u.amax(0) - u.amin(0)) / kmax).clamp_min(EPS).half()
    r = v_rot.to(dtype)
    vg = torch.sqrt((r * r).sum(0) / T).clamp_min(EPS).half()  # [H, D]
    w = r / vg.to(dtype)
    lo, hi = w.amin(-1), w.amax(-1)  # [T, H]
    if p.v_clip != 1.0:  # the writer's range: mid +- v_clip * (max - min) / 2 (Preset.v_clip)
        half = (hi - lo) * (0.5 * p.v_clip)
        lo, rng = (hi + lo) * 0.5 - half, 2.0 * half
    else:
        rng = hi - lo
    vmn = lo.half()
    vsc = (rng / vmax).clamp_min(EPS).half()
    return encode(k_rot, v_rot, QuantTile(None, None, ksc, kmn, kn, vsc, vmn, vg), p, dtype)


def encode(k_rot: torch.Tensor, v_rot: torch.Tensor, params: QuantTile, preset=None,
           dtype=torch.float32, exact_values: bool = False):
    """Integer codes of rotated rows given a tile's fp16 parameters (the rounding step alone);
    returns a QuantTile with the codes filled in, or with ``exact_values`` the pre-rounding
    values (k, v) instead (to find rounding ties)."""
    p = get_preset(preset)
    kmax, vmax = 2 ** p.k_bits - 1, 2 ** p.v_bits - 1
    u = k_rot.to(dtype) / params.k_norm.to(dtype)[..., None]
    xk = (u - params.k_min.to(dtype)) / params.k_scale.to(dtype)
    w = v_rot.to(dtype) / params.v_norm.to(dtype)
    xv = (w - params.v_min.to(dtype)[..., None]) / params.v_scale.to(dtype)[..., None]
    if exact_values:
        return xk, xv
    kc = _round(xk).clamp(0, kmax).to(torch.int32)
    vc = _round(xv).clamp(0, vmax).to(torch.int32)
    return QuantTile(kc, vc, params.k_scale, params.k_min, params.k_norm, params.v_scale,
                     params.v_min, params.v_norm)


def dequant_tile(qt: QuantTile, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """QuantTile -> rotated K, V rows [T, H, D] in ``dtype``."""
    k = qt.k_norm.to(dtype)[..., None] * (qt.k_codes.to(dtype) * qt.k_scale.to(dtype) + qt.k_min.to(dtype))
    v = qt.v_norm.to(dtype) * (qt.v_codes.to(dtype) * qt.v_scale.to(dtype)[..., None]
                               + qt.v_min.to(dtype)[..., None])
    return k, v


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D] integer codes -> [..., D * bits / 8] uint8; code c sits in byte c // (8/bits)
    at bit (c % (8/bits)) * bits."""
    per = 8 // bits
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    c = (packed.to(torch.int32)[..., None] >> shifts) & (2 ** bits - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _f16(buf: torch.Tensor, off: int, n: int) -> torch.Tensor:
    return buf[off:off + 2 * n].view(torch.float16)


def write_block(cache: torch.Tensor, block: int, qt: QuantTile, layout: BlockLayout) -> None:
    """Serialize a QuantTile (all kv heads) into ``cache[block]`` ([nb, H, block_bytes] uint8)."""
    p, T, D = layout.preset, layout.tile, layout.head_dim
    for h in range(cache.shape[1]):
        rec = cache[block, h]
        rec[layout.k_codes:layout.k_codes + T * layout.k_row_bytes] = pack_codes(
            qt.k_codes[:, h], p.k_bits).reshape(-1)
        rec[layout.v_codes:layout.v_codes + T * layout.v_row_bytes] = pack_codes(
            qt.v_codes[:, h], p.v_bits).reshape(-1)
        for name, val in (("k_scale", qt.k_scale[h]), ("k_min", qt.k_min[h]),
                          ("k_norm", qt.k_norm[:, h]), ("v_scale", qt.v_scale[:, h]),
                          ("v_min", qt.v_min[:, h]), ("v_norm", qt.v_norm[h])):
            off = getattr(layout, name)
            rec[off:off + 2 * val.numel()] = val.half().contiguous().view(torch.uint8)


def read_block(cache: torch.Tensor, block: int, layout: BlockLayout) -> QuantTile:
    p, T, D = layout.preset, layout.tile, layout.head_dim
    parts = {n: [] for n in QuantTile.__dataclass_fields__}
    for h in range(cache.shape[1]):
        rec = cache[block, h].contiguous()
        parts["k_codes"].append(unpack_codes(
            rec[layout.k_codes:layout.k_codes + T * layout.k_row_bytes].reshape(T, -1), p.k_bits))
        parts["v_codes"].append(unpack_codes(
            rec[layout.v_codes:layout.v_codes + T * layout.v_row_bytes].reshape(T, -1), p.v_bits))
        for name, n in (("k_scale", D), ("k_min", D), ("k_norm", T), ("v_scale", T),
                        ("v_min", T), ("v_norm", D)):
            parts[name].append(_f16(rec, getattr(layout, name), n))
    dim = {"k_codes": 1, "v_codes": 1, "k_norm": 1, "v_scale": 1, "v_min": 1}
    return QuantTile(**{n: torch.stack(v, dim=dim.get(n, 0)) for n, v in parts.items()})


def ring_row(pos, tile: int):
    """Stage row of sequence position ``pos`` in the 2-tile ring (rows [tile, 3 * tile))."""
    return tile + pos % (2 * tile)


def stage_write(stage_k: torch.Tensor, stage_v: torch.Tensor, slot: int, pos: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, preset: str | Preset | None = None) -> None:
    """Tokens at positions ``pos`` [N] (K, V [N, H, D], model space) enter the fp16 stage of
    ``slot``, rotated."""
    p = get_preset(preset)
    rows = ring_row(pos.long(), p.tile)
    stage_k[slot, rows] = rotate(k, torch.float32).to(stage_k.dtype)
    stage_v[slot, rows] = rotate(v, torch.float32).to(stage_v.dtype)


def pack_tile_from_stage(stage_k, stage_v, cache, *, slot: int, tile_idx: int, block: int,
                         preset: str | Preset | None = None) -> QuantTile:
    """Reference of the pack kernel: ring half of ``tile_idx`` -> ``cache[block]``; tile 0 is
    also copied to the sink rows."""
    p = get_preset(preset)
    T = p.tile
    rows = torch.arange(T) + T + (tile_idx % 2) * T
    kr, vr = stage_k[slot, rows].float(), stage_v[slot, rows].float()
    qt = quantize_tile(kr, vr, p)
    write_block(cache, block, qt, p.layout(stage_k.shape[-1]))
    if tile_idx == 0:
        stage_k[slot, :T] = stage_k[slot, rows]
        stage_v[slot, :T] = stage_v[slot, rows]
    return qt


def tile_block(block_table: torch.Tensor, seq: int, t: int, tiles_per_page: int) -> int:
    return int(block_table[seq, t // tiles_per_page]) * tiles_per_page + t % tiles_per_page


def gather_kv(case: "KvarnCase", seq: int, dtype=torch.float64, sink: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated K, V [L, H, D] of one sequence exactly as the cache represents them (``sink``:
    tile 0 from the stage's fp16 sink rows, else dequantized from its block)."""
    p, T = case.preset, case.preset.tile
    L, packed, slot = int(case.seq_lens[seq]), int(case.packed_tiles[seq]), int(case.stage_slot[seq])
    layout = p.layout(case.head_dim)
    ks, vs = [], []
    for t in range(packed):
        if t == 0 and sink:
            ks.append(case.stage_k[slot, :T].to(dtype))
            vs.append(case.stage_v[slot, :T].to(dtype))
        else:
            k, v = dequant_tile(read_block(case.cache, tile_block(
                case.block_table, seq, t, case.tiles_per_page), layout), dtype)
            ks.append(k)
            vs.append(v)
    pos = torch.arange(packed * T, L)
    rows = ring_row(pos, T)
    ks.append(case.stage_k[slot, rows].to(dtype))
    vs.append(case.stage_v[slot, rows].to(dtype))
    return torch.cat(ks), torch.cat(vs)


def attention_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float):
    """Causal block attention of q [ql, Hq, D] against k, v [L, Hkv, D] (last ql keys are the
    queries' own), float64 -> [ql, Hq, D]."""
    ql, hq, _ = q.shape
    L, hkv, _ = k.shape
    g = hq // hkv
    k = k.double().repeat_interleave(g, dim=1)
    v = v.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * softmax_scale
    limit = L - ql + torch.arange(ql) + 1
    mask = torch.arange(L)[None, :] >= limit[:, None]
    probs = torch.softmax(scores.masked_fill(mask[None], float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def quantized_view(k_rot: torch.Tensor, v_rot: torch.Tensor, preset: str | Preset | None = None,
                   dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated fp16 rows [L, H, D] -> the same rows with every full tile quantized and
    dequantized (``quantize_tile`` + ``dequant_tile``); the partial last tile unchanged."""
    T = get_preset(preset).tile
    ks, vs = [], []
    L = k_rot.shape[0]
    for t in range(L // T):
        a, b = dequant_tile(quantize_tile(k_rot[t * T:(t + 1) * T].float(),
                                          v_rot[t * T:(t + 1) * T].float(), preset), dtype)
        ks.append(a)
        vs.append(b)
    ks.append(k_rot[L // T * T:].to(dtype))
    vs.append(v_rot[L // T * T:].to(dtype))
    return torch.cat(ks), torch.cat(vs)


def own_tile_attention_f64(q: torch.Tensor, k_fp: torch.Tensor, v_fp: torch.Tensor,
                           k_q: torch.Tensor, v_q: torch.Tensor, tile: int, softmax_scale: float,
                           sink: bool | int = True, window: int = 1, sinks: int = 1) -> torch.Tensor:
    """THE READ RULE of KVarN, in float64. Queries q [ql, Hq, D] are the last ql positions of
    the L keys; ``k_fp``/``v_fp`` [L, Hkv, D] are the fp16 rows, ``k_q``/``v_q`` the same keys
    as the packed tiles represent them (any linear space, the same for all four). A query at
    position p in tile T(p) = p // tile reads:
    * keys of its fp16 window, tiles T(p) - window + 1 .. T(p) (up to p), from the fp16 rows
      (``window`` 1: its own tile; the server's default is format.DEFAULT_WINDOW = 3);
    * keys of the ``sinks`` first tiles (tiles 0 .. sinks - 1; the default 1: tile 0) from the
      fp16 rows when ``sink`` is True (their sink slots live); an int ``sink`` is the number of
      leading sink tiles whose slots live (a lost sink tile is read quantized, and so is every
      sink tile after it), False none;
    * keys of every other tile before the window quantized (k_q / v_q).
    So a position's attention does not depend on how the tokens were batched into steps
    (prefill chunks, verify blocks, one-token decode): teacher-forced scoring equals generation.
    """
    ql, L = q.shape[0], k_fp.shape[0]
    out = torch.zeros(q.shape, dtype=torch.float64)
    pos = torch.arange(L - ql, L)
    for t in sorted(set((pos // tile).tolist())):
        sel = (pos // tile == t).nonzero().flatten()
        a, b = int(sel[0]), int(sel[-1]) + 1
        hi = int(pos[b - 1]) + 1
        k = k_q[:hi].double().clone()
        v = v_q[:hi].double().clone()
        w0 = max(t - window + 1, 0) * tile
        k[w0:] = k_fp[w0:hi].double()
        v[w0:] = v_fp[w0:hi].double()
        n_sink = (sinks if sink else 0) if isinstance(sink, bool) else min(int(sink), sinks)
        if n_sink:
            k[:n_sink * tile] = k_fp[:min(n_sink * tile, hi)].double()
            v[:n_sink * tile] = v_fp[:min(n_sink * tile, hi)].double()
        out[a:b] = attention_f64(q[a:b], k, v, softmax_scale)
    return out


def reference_attention(case: "KvarnCase", exact: bool = False, sink: bool = True) -> torch.Tensor:
    """Float64 attention [Tq, Hq, D] in model space. ``exact=False``: over the cache's
    dequantized K/V (what the kernel must match); ``exact=True``: over the unquantized K/V the
    case was built from (the quantization error)."""
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    cu = case.cu_seqlens_q.tolist()
    for s in range(len(case.seq_lens)):
        if exact:
            k, v = case.k_true[s].double(), case.v_true[s].double()
        else:
            k, v = (rotate(x) for x in gather_kv(case, s, sink=sink))  # un-rotate (Hn is its own inverse)
        out[cu[s]:cu[s + 1]] = attention_f64(case.q[cu[s]:cu[s + 1]].cpu(), k.cpu(), v.cpu(),
                                             case.softmax_scale)
    return out


def prefill_windows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                    window_tokens: int, query_group: int) -> torch.Tensor:
    """Reference of ``kernels.kvarn_prefill``'s algorithm in float64: queries (the last ql
    positions of k/v [L, Hkv, D]) in groups of ``query_group``; per group, the keys it sees in
    windows of ``window_tokens``, each window's causal attention merged by log-sum-exp. Equals
    ``attention_f64`` (the test of the merge itself)."""
    ql, hq, _ = q.shape
    L, hkv, _ = k.shape
    g = hq // hkv
    ctx = L - ql
    out = torch.zeros(q.shape, dtype=torch.float64)
    for g0 in range(0, ql, query_group):
        g1 = min(ql, g0 + query_group)
        qq = q[g0:g1].double()
        pos = ctx + torch.arange(g0, g1)
        lse = torch.full((hq, g1 - g0), float("-inf"), dtype=torch.float64)
        acc = torch.zeros((hq, g1 - g0, q.shape[-1]), dtype=torch.float64)
        for w0 in range(0, ctx + g1, window_tokens):
            w1 = min(ctx + g1, w0 + window_tokens)
            kw = k[w0:w1].double().repeat_interleave(g, dim=1)
            vw = v[w0:w1].double().repeat_interleave(g, dim=1)
            s = torch.einsum("qhd,khd->hqk", qq, kw) * softmax_scale
            s = s.masked_fill(torch.arange(w0, w1)[None, None, :] > pos[None, :, None], float("-inf"))
            lw = torch.logsumexp(s, -1)  # [hq, q]; -inf where the window is all masked
            ow = torch.einsum("hqk,khd->hqd", torch.softmax(s, -1).nan_to_num(0.0), vw)
            new = torch.logaddexp(lse, lw)
            a = torch.exp(lse - new).nan_to_num(0.0)[..., None]
            b = torch.exp(lw - new).nan_to_num(0.0)[..., None]
            acc, lse = acc * a + ow * b, new
        out[g0:g1] = acc.permute(1, 0, 2)
    return out


@dataclass
class KvarnCase:
    preset: Preset
    head_dim: int
    q: torch.Tensor  # [Tq, Hq, D]
    cache: torch.Tensor  # [nb, Hkv, block_bytes] uint8
    stage_k: torch.Tensor  # [slots, 3T, Hkv, D] fp16 (rotated rows)
    stage_v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    packed_tiles: torch.Tensor
    stage_slot: torch.Tensor
    block_table: torch.Tensor  # in pages of tiles_per_page tiles
    tiles_per_page: int
    softmax_scale: float
    max_query_len: int
    k_true: list = field(repr=False, default_factory=list)  # per seq [L, Hkv, D] model space
    v_true: list = field(repr=False, default_factory=list)

    def to(self, device) -> "KvarnCase":
        d = {}
        for n in self.__dataclass_fields__:
            val = getattr(self, n)
            d[n] = val.to(device) if isinstance(val, torch.Tensor) else val
        return KvarnCase(**d)

    @property
    def kv_bytes(self) -> int:
        """Bytes attention reads once (packed blocks + fp16 stage rows)."""
        T, nkv, D = self.preset.tile, self.cache.shape[1], self.head_dim
        blk = self.preset.layout(D).block_bytes * nkv
        total = 0
        for L, pk in zip(self.seq_lens.tolist(), self.packed_tiles.tolist()):
            fp16_tok = (T if pk else 0) + L - pk * T
            total += max(pk - 1, 0) * blk + fp16_tok * nkv * D * 2 * 2
        return total


def make_case(*, q_lens, seq_lens, num_q_heads: int, num_kv_heads: int, head_dim: int,
              preset: str | Preset | None = None, packed_tiles=None, tiles_per_page: int = 1,
              extra_slots: int = 1, q_dtype=torch.float16, generator=None,
              k_scale: float = 1.5, k_bias: float = 0.3, outlier_channels: int = 2) -> KvarnCase:
    """A random batch: per sequence, K/V [L, Hkv, D] drawn fresh (K with a bias and a few
    outlier channels, like real keys), written through the reference stage + pack path; every
    unused byte of the cache and stage is random too. ``packed_tiles`` defaults to full tiles
    but keeps 0..16 trailing tokens of a full tile unpacked at random (as a verify block would)."""
    p = get_preset(preset)
    T, D, g = p.tile, head_dim, generator
    layout = p.layout(D)
    if packed_tiles is None:
        packed_tiles = []
        for L in seq_lens:
            full = L // T
            lag = int(torch.randint(0, 2, (1,), generator=g)) if full and L % T < 16 else 0
            packed_tiles.append(full - lag)
    for L, pk in zip(seq_lens, packed_tiles):
        if not (0 <= pk <= L // T and L - pk * T <= 2 * T):
            raise ValueError(f"packed_tiles {pk} is not valid for seq_len {L} (tail <= 2 tiles)")
    pages = [math.ceil(max(math.ceil(L / T), 1) / tiles_per_page) for L in seq_lens]
    num_pages = sum(pages) + 2
    perm = torch.randperm(num_pages, generator=g)
    block_table = torch.full((len(seq_lens), max(pages) + 1), int(perm[-1]), dtype=torch.int32)
    i = 0
    for s, n in enumerate(pages):
        block_table[s, :n] = perm[i:i + n].to(torch.int32)
        i += n
    nb = num_pages * tiles_per_page
    cache = torch.randint(0, 256, (nb, num_kv_heads, layout.block_bytes), dtype=torch.uint8,
                          generator=g)
    slots = len(seq_lens) + extra_slots
    stage_k = torch.randn(slots, 3 * T, num_kv_heads, D, generator=g).half()
    stage_v = torch.randn(slots, 3 * T, num_kv_heads, D, generator=g).half()
    slot_perm = torch.randperm(slots, generator=g)[: len(seq_lens)]
    chan = torch.ones(D)
    chan[torch.randperm(D, generator=g)[:outlier_channels]] = 6.0
    k_true, v_true = [], []
    for s, (L, pk) in enumerate(zip(seq_lens, packed_tiles)):
        slot = int(slot_perm[s])
        k = ((torch.randn(L, num_kv_heads, D, generator=g) * k_scale + k_bias) * chan).half()
        v = torch.randn(L, num_kv_heads, D, generator=g).half()
        k_true.append(k)
        v_true.append(v)
        for t in range(max(pk, math.ceil(L / T))):
            pos = torch.arange(t * T, min((t + 1) * T, L))
            stage_write(stage_k, stage_v, slot, pos, k[pos], v[pos], p)
            if t < pk:
                pack_tile_from_stage(stage_k, stage_v, cache, slot=slot, tile_idx=t, preset=p,
                                     block=tile_block(block_table, s, t, tiles_per_page))
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = (torch.randn(sum(q_lens), num_q_heads, D, generator=g) * 1.2).to(q_dtype)
    return KvarnCase(
        preset=p, head_dim=D, q=q, cache=cache, stage_k=stage_k, stage_v=stage_v,
        cu_seqlens_q=cu, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        packed_tiles=torch.tensor(packed_tiles, dtype=torch.int32),
        stage_slot=slot_perm.to(torch.int32), block_table=block_table,
        tiles_per_page=tiles_per_page, softmax_scale=D ** -0.5, max_query_len=max(q_lens),
        k_true=k_true, v_true=v_true)
