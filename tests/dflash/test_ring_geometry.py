"""onecard.dflash.ring: the drafter K/V ring's sizes (pure Python)."""
from __future__ import annotations

import pytest

from onecard.dflash import ring


def test_ring_holds_window_block_and_newest_row():
    # 27B drafter (docs/dflash2-huge.md): window 2048, DFLASH_TOKENS up to 15
    assert ring.ring_blocks(2048, 15) == 129            # 2064 rows -> 129 blocks of 16
    assert ring.ring_blocks(2048, 7) == 129             # 2056 rows -> 129
    assert ring.ring_blocks(64, 7) == 5                 # tiny drafter: 72 rows -> 80
    assert ring.ring_blocks(2046, 1) == 128             # exactly 2048 rows
    assert ring.ring_total_blocks(2, 2048, 7) == 2 * 129 + 1


def test_ring_bytes_27b_drafter_at_max_seqs_2():
    # 5 layers x 2 (K, V) x 259 blocks x 16 rows x 8 heads x 128 x 2 B
    assert ring.ring_bytes(5, 2, 2048, 7, 8, 128) == 5 * 2 * 259 * 16 * 8 * 128 * 2 == 84_869_120


def test_physical_block_wraps_inside_its_slot():
    assert [ring.physical_block(1, j, 5) for j in range(7)] == [5, 6, 7, 8, 9, 5, 6]


@pytest.mark.parametrize("call", [
    lambda: ring.ring_blocks(0, 7), lambda: ring.ring_blocks(True, 7), lambda: ring.ring_blocks(64, 0),
    lambda: ring.ring_total_blocks(0, 64, 7), lambda: ring.ring_bytes(5, 2, 64, 7, 0, 128),
])
def test_bad_values_name_what_is_valid(call):
    with pytest.raises(ValueError, match="valid"):
        call()
