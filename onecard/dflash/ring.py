"""Geometry of the DFlash2 drafter's K/V rings (CTX=huge + SPEC=dflash2, docs/dflash2-huge.md §3).

In ring mode the drafter's attention layers hand vLLM no KV-cache spec: their K/V live in one
private bf16 tensor per layer, in the attention backend's own KV-cache layout (the same bytes:
K and V of ``blocks x RING_BLOCK`` rows x ``kv_heads`` x ``head_dim``). Each live request owns a slot ``s`` of ``ring_blocks`` blocks; logical block ``j`` of
the request maps to physical block ``s * ring_blocks + (j % ring_blocks)``. The last physical block
is a spare that no slot owns. A sliding-window drafter never reads a position more than
``window - 1`` behind its newest query, so the wrap is invisible as long as one slot holds the
window, the step's query block and the newest context row: ``window + k_max + 1`` rows.

Pure Python (no torch, no vLLM): the launcher's memory model and the vLLM-side proposer both size
the rings from here.
"""
from __future__ import annotations

RING_BLOCK = 16      # rows per ring block: FlashAttention's paged KV needs a multiple of 16
BF16_BYTES = 2
SLIDING = "sliding_attention"


def window_from_config(cfg: dict) -> int:
    """The drafter's sliding window from its config.json, by the rule the server applies
    (patch 0080's dflash2_lane.ring_window; tests/dflash/test_ring_mode.py checks they agree):
    every layer slides when ``dflash_config.use_swa`` or ``use_sliding_window`` is true, or when
    ``layer_types`` lists only sliding layers (a mix is refused); the window is
    ``dflash_config.swa_window_size``, else ``sliding_window``. ValueError (one line) otherwise."""
    dc = cfg.get("dflash_config") or {}
    layer_types = list(cfg.get("layer_types") or [])
    flagged = bool(dc.get("use_swa", False)) or bool(cfg.get("use_sliding_window", False))
    all_sliding = bool(layer_types) and all(t == SLIDING for t in layer_types)
    mixed = SLIDING in layer_types and not all_sliding
    if mixed or not (flagged or all_sliding):
        raise ValueError(f"ring mode needs a drafter whose every layer is sliding-window, but this one has "
                         f"use_sliding_window={cfg.get('use_sliding_window')!r}, dflash_config.use_swa="
                         f"{dc.get('use_swa')!r}, layer_types={layer_types or None!r}; valid: "
                         f"use_sliding_window true (or dflash_config.use_swa true, or layer_types all "
                         f"{SLIDING}) with sliding_window >= 1")
    window = dc.get("swa_window_size", cfg.get("sliding_window"))
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"the drafter's sliding window is {window!r}; valid: dflash_config.swa_window_size "
                         f"or sliding_window, an int >= 1")
    return window


def ring_blocks(window: int, k_max: int) -> int:
    """Blocks of RING_BLOCK rows one request slot needs: the drafter's window, a verify block of
    k_max query rows and the newest context row."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r} is not valid; valid: the drafter's sliding window, an int >= 1")
    if isinstance(k_max, bool) or not isinstance(k_max, int) or not 1 <= k_max <= 64:
        raise ValueError(f"k_max={k_max!r} is not valid; valid: an int in 1..64 (DFLASH_TOKENS)")
    return -(-(window + k_max + 1) // RING_BLOCK)


def ring_total_blocks(slots: int, window: int, k_max: int) -> int:
    """Physical blocks of one layer's ring tensor: ``slots`` request slots plus one spare block."""
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots={slots!r} is not valid; valid: MAX_SEQS, an int >= 1")
    return slots * ring_blocks(window, k_max) + 1


def ring_bytes(layers: int, slots: int, window: int, k_max: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of every drafter layer's ring (K and V, bf16), allocated beside vLLM's KV pool."""
    for name, v in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} is not valid; valid: an int >= 1")
    return (layers * 2 * ring_total_blocks(slots, window, k_max) * RING_BLOCK
            * kv_heads * head_dim * BF16_BYTES)


def physical_block(slot: int, logical_block: int, blocks_per_slot: int) -> int:
    """Where a request's logical block lands in the ring tensor."""
    return slot * blocks_per_slot + logical_block % blocks_per_slot
