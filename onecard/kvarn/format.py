# SPDX-License-Identifier: Apache-2.0
"""The KVarN cache format as data: presets and the paged block layout (one place).

Per attention layer, per kv head, the cache stores each token's K and V as follows (all
statistics in float32, stored as float16; rounding is floor(x + 0.5), clamped to the code range):

1. Rotation. ``r = x @ Hn`` with ``Hn = H / sqrt(D)`` the Sylvester Walsh-Hadamard matrix of
   order D = head_dim (a power of two). Hn is symmetric and orthonormal (its own inverse), so
   ``q . k == (q @ Hn) . (k @ Hn)``: attention rotates the query instead of un-rotating K and
   un-rotates the output once. Rotation happens when a token enters the fp16 staging area;
   the stage always holds rotated rows.
2. Tiles. Tokens are grouped in tiles of ``tile`` tokens (128 by default); one tile is one
   paged block. Statistics below are per (tile, kv head).
3. Variance normalization, then asymmetric rounding:
   * K (``k_bits``, 4): per-token normalizer ``kn[t] = rms_c r[t, c]`` (the token's RMS, so
     outlier tokens do not widen the per-channel ranges); ``u = r / kn[t]``; per channel c over
     the tile: ``kmn[c] = min_t u``, ``ksc[c] = (max_t u - min_t u) / (2**k_bits - 1)``;
     ``code = round((u - kmn[c]) / ksc[c])``.  Dequant: ``kn[t] * (code * ksc[c] + kmn[c])``.
   * V (``v_bits``, 2): per-channel normalizer ``vg[c] = rms_t r[t, c]`` over the tile (equal
     channel variance before per-token rounding); ``w = r / vg[c]``; per token t:
     ``vmn[t] = min_c w``, ``vsc[t] = (max_c w - min_c w) / (2**v_bits - 1)``;
     ``code = round((w - vmn[t]) / vsc[t])``.  Dequant: ``vg[c] * (code * vsc[t] + vmn[t])``.
   Normalizers are clamped to >= ``EPS`` and scales to >= ``EPS`` (a constant tile dequantizes
   to its value within fp16 precision).
4. fp16 staging. The first tile of every sequence (attention sink) and the tile(s) being
   written stay in fp16: a per-sequence stage of ``3 * tile`` rows per kv head, rows
   ``[0, tile)`` the first tile (copied there when tile 0 is packed), rows
   ``tile + (p % (2 * tile))`` a two-tile ring holding positions ``p >= packed * tile`` (the
   unpacked tail, at most 2 tiles long, so a verify block that crosses a tile boundary or
   drafts that are later rejected never force an early pack). Tile 0 is packed too (its block
   exists like any other), but attention reads it from the stage.

Paged block (one tile, one kv head), byte offsets in this order, all float16 fields 2-aligned:

    k_codes  [tile, D * k_bits / 8] uint8   token-major; channel c of a token sits in byte
                                            c // (8 / k_bits) at bit (c % (8 / k_bits)) * k_bits
    v_codes  [tile, D * v_bits / 8] uint8   same packing rule with v_bits
    k_scale  [D]    fp16    per channel (ksc)
    k_min    [D]    fp16    per channel (kmn, the asymmetric zero point as an offset)
    k_norm   [tile] fp16    per token (kn)
    v_scale  [tile] fp16    per token (vsc)
    v_min    [tile] fp16    per token (vmn)
    v_norm   [D]    fp16    per channel (vg)

The cache of one layer is a uint8 tensor ``[num_blocks, num_kv_heads, block_bytes]`` (a vLLM
page of B tokens, B a multiple of ``tile``, is B / tile consecutive blocks). Pure Python, no
torch: the memory model imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

EPS = 1e-4  # floor of normalizers and scales (fp16-representable, far below real K/V spread)
FP16 = 2

# The serving read rule's fp16 window (onecard.kvarn.stage): a query reads the last WINDOW tiles
# up to its own in fp16 (1: its own tile only; 2: its own and the previous one), tile 0 from the
# fp16 sink, every other tile packed. 2 is the default: on SmolLM2 the 2-bit V error of the
# previous tile is most of the perplexity loss (served on an H200, 2026-12-04: +1.275 % -> +0.435 %
# vs bf16; kvarn/README.md "fp16 window"). Chosen per server with ONECARD_KVARN_WINDOW (the
# launcher's KVARN_WINDOW); it changes the stage's slot count, not the paged cache.
# Window 3 and a second sink tile (SINK_TILES, ONECARD_KVARN_SINKS / KVARN_SINKS: tiles 0 .. S - 1
# read from fp16 slots) are the default since 2026-12-04 (session 17): served on an H200 (job 61,
# SmolLM2-135M, 6 texts) at +0.413 % perplexity vs bf16 against +0.649 % for window 2 + one sink in
# the same run (the goal: <= 0.5 %); SPEC=mtp on it stayed exact (job 63). Cost: two more
# fp16 tiles per sequence in the stage (+34 MiB at the 27B's MAX_SEQS 2), the paged cache unchanged.
FP16_WINDOWS = (1, 2, 3)
DEFAULT_WINDOW = 3
WINDOW_ENV = "ONECARD_KVARN_WINDOW"
SINK_TILES = (1, 2)
DEFAULT_SINKS = 2
SINKS_ENV = "ONECARD_KVARN_SINKS"
MAX_SINKS = max(SINK_TILES)  # columns of the per-row sink rows (kernels, stage.uniform_rows)
MAX_PREV = max(FP16_WINDOWS) - 1  # columns of the per-row previous-tile rows


def _int_from_env(name: str, valid: tuple, default: int, environ=None) -> int:
    import os

    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return default
    if raw not in {str(w) for w in valid}:
        raise ValueError(f"{name}={raw!r} is not valid; valid: {'|'.join(map(str, valid))}")
    return int(raw)


def window_from_env(environ=None) -> int:
    """The fp16 window the server runs with: ``ONECARD_KVARN_WINDOW`` (1|2|3), default 2."""
    return _int_from_env(WINDOW_ENV, FP16_WINDOWS, DEFAULT_WINDOW, environ)


def sinks_from_env(environ=None) -> int:
    """The fp16 sink tiles the server runs with: ``ONECARD_KVARN_SINKS`` (1|2), default 1."""
    return _int_from_env(SINKS_ENV, SINK_TILES, DEFAULT_SINKS, environ)


@dataclass(frozen=True)
class Preset:
    name: str
    k_bits: int
    v_bits: int
    tile: int  # tokens per tile = tokens per paged block
    # V's per-token rounding range: mid +- v_clip * (max - min) / 2 of the normalized row (values
    # beyond it take the end codes). 1.0 = min..max. A choice of the writer, not of the layout:
    # readers see only the stored min and scale. 2-bit V uses 0.75 (kvarn/README.md, "Range
    # clipping": SmolLM2 perplexity delta +3.1 -> +2.4 % at 4k tokens, +2.4 -> +1.4 % and
    # +1.1 -> +0.5 % on the two shorter texts).
    v_clip: float = 1.0

    def __post_init__(self):
        for b in (self.k_bits, self.v_bits):
            if b not in (2, 4, 8):
                raise ValueError(f"bits {b} is not valid; valid: 2, 4, 8")
        if not 0.0 < self.v_clip <= 1.0:
            raise ValueError(f"v_clip {self.v_clip} is not valid; valid: 0 < v_clip <= 1")
        if self.tile < 16 or self.tile & (self.tile - 1):
            raise ValueError(f"tile {self.tile} is not valid; valid: a power of two >= 16")

    @property
    def cache_dtype(self) -> str:
        """The --kv-cache-dtype value the vLLM integration will register."""
        return f"kvarn_{self.name}"

    def layout(self, head_dim: int) -> "BlockLayout":
        return BlockLayout.build(self, head_dim)

    def bytes_per_token(self, head_dim: int) -> float:
        """Bytes one token of one kv head occupies in the paged cache (K + V + scales, zero
        points and normalizers, amortized over the tile)."""
        return self.layout(head_dim).block_bytes / self.tile


PRESETS: dict[str, Preset] = {
    "k4v2_g128": Preset("k4v2_g128", 4, 2, 128, v_clip=0.75),
    "k4v4_g128": Preset("k4v4_g128", 4, 4, 128),
    "k4v2_g64": Preset("k4v2_g64", 4, 2, 64, v_clip=0.75),
}
DEFAULT_PRESET = "k4v2_g128"


def get_preset(name: str | Preset | None = None) -> Preset:
    if isinstance(name, Preset):
        return name
    name = name or DEFAULT_PRESET
    if name.startswith("kvarn_"):
        name = name[len("kvarn_"):]
    if name not in PRESETS:
        raise ValueError(f"KVarN preset {name!r} is not valid; valid: {', '.join(PRESETS)}")
    return PRESETS[name]


@dataclass(frozen=True)
class BlockLayout:
    """Byte offsets of one (block, kv head) record. Offsets of fp16 fields are even."""

    preset: Preset
    head_dim: int
    k_codes: int
    v_codes: int
    k_scale: int
    k_min: int
    k_norm: int
    v_scale: int
    v_min: int
    v_norm: int
    block_bytes: int

    @property
    def tile(self) -> int:
        return self.preset.tile

    @property
    def k_row_bytes(self) -> int:
        return self.head_dim * self.preset.k_bits // 8

    @property
    def v_row_bytes(self) -> int:
        return self.head_dim * self.preset.v_bits // 8

    @classmethod
    def build(cls, preset: Preset, head_dim: int) -> "BlockLayout":
        d, t = head_dim, preset.tile
        if d < 16 or d & (d - 1):
            raise ValueError(f"head_dim {d} is not valid; valid: a power of two >= 16")
        off = 0
        fields = {}
        for name, size in (
            ("k_codes", t * d * preset.k_bits // 8),
            ("v_codes", t * d * preset.v_bits // 8),
            ("k_scale", d * FP16), ("k_min", d * FP16), ("k_norm", t * FP16),
            ("v_scale", t * FP16), ("v_min", t * FP16), ("v_norm", d * FP16),
        ):
            fields[name] = off
            off += size
        assert all(v % 2 == 0 for v in fields.values()) and off % 2 == 0
        return cls(preset=preset, head_dim=d, block_bytes=off, **fields)


def bytes_per_token_layer(num_kv_heads: int, head_dim: int, preset: str | Preset | None = None) -> int:
    """Bytes one token occupies in ONE attention layer's paged KVarN cache (all kv heads),
    rounded up to a whole byte (exact for head_dim 256 / tile 64 or 128)."""
    p = get_preset(preset)
    blk = p.layout(head_dim).block_bytes * num_kv_heads
    return -(-blk // p.tile)


def staging_bytes_per_seq_layer(num_kv_heads: int, head_dim: int, preset: str | Preset | None = None) -> int:
    """The fp16 stage of one sequence in one layer: K and V, 3 tiles (sink + 2-tile ring).
    A fixed per-sequence reserve outside the paged pool (the integration allocates it per
    request slot)."""
    p = get_preset(preset)
    return 2 * 3 * p.tile * num_kv_heads * head_dim * FP16


# kernels.kvarn_prefill (the prefill path): the prefix is dequantized once per group of
# PREFILL_QUERY_GROUP query tokens (one group per chunk up to that size) into an fp16 window of
# PREFILL_WINDOW_TOKENS keys; a flash kernel carries an fp32 state across windows.
PREFILL_WINDOW_TOKENS = 16384  # 16k x 4 kv heads x 256 x 2 (K, V) x 2 B = 64 MiB
PREFILL_QUERY_GROUP = 2048  # fp32 state 2048 x 24 heads x 256 x 4 B = 48 MiB (+ fp16 q 24 MiB)


def prefill_scratch_bytes(num_q_heads: int, num_kv_heads: int, head_dim: int,
                          window_tokens: int = PREFILL_WINDOW_TOKENS,
                          query_group: int = PREFILL_QUERY_GROUP) -> int:
    """Peak device memory of one prefill call (one per process: layers run one after another):
    fp16 K/V window + fp16 rotated queries + fp32 state (acc, max, sum) of one query group."""
    window = 2 * window_tokens * num_kv_heads * head_dim * FP16
    group = query_group * num_q_heads * (head_dim * FP16 + head_dim * 4 + 2 * 4)
    return window + group


def format_table(head_dim: int = 256, num_kv_heads: int = 4) -> list[dict]:
    """Rows for docs: bytes per token per kv head and per layer, vs bf16."""
    rows = []
    for p in PRESETS.values():
        per_head = p.bytes_per_token(head_dim)
        rows.append({
            "preset": p.name, "k_bits": p.k_bits, "v_bits": p.v_bits, "tile": p.tile,
            "block_bytes_per_head": p.layout(head_dim).block_bytes,
            "bytes_per_token_head": per_head,
            "bytes_per_token_layer": bytes_per_token_layer(num_kv_heads, head_dim, p),
            "vs_bf16": per_head / (4 * head_dim),
        })
    return rows
