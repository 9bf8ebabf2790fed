"""Fixtures for the DFlash2 CPU tests (helpers live in dflash_helpers.py)."""
from __future__ import annotations

import copy

import pytest
from dflash_helpers import PUBLISHED


@pytest.fixture
def published() -> dict:
    return copy.deepcopy(PUBLISHED)


@pytest.fixture(autouse=True)
def _one_thread():
    """These tests run many tiny float64 ops: one intra-op thread is ~10x faster on a shared
    2-core box (thread hand-off dominates). Restored after each test."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
