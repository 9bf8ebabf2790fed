"""Deferred GDN commit under speculative decoding: the runner's side (onecard patch 0085).

Shipped verbatim into vLLM as vllm/model_executor/layers/mamba/ops/onecard_gdn_defer_runtime.py
(scripts/make_gdn_defer_patch.py); it imports torch and, lazily, the kernels of
onecard_gdn_defer.py, nothing of vLLM, so tests run it on the CPU as it is.

Stock vLLM 0.27.1 verifies a block of 1 + k tokens through a Gated-DeltaNet layer by writing
the recurrent state after every token into its own state block (1 + k blocks per sequence and
GDN group, k + 1 state writes per layer and step), and the next step reads the block of the
last accepted token. With ONECARD_GDN_DEFER=1 a GDN layer keeps one state block per sequence
(two with prefix caching): the verify kernel reads the committed state, writes none, and saves
each token's normalized key, value, gate and beta in a small per-layer scratch; once the
rejection sampler has counted the accepted tokens ``a`` of every row, :func:`commit` replays
those ``a`` tokens onto the committed state, in place. Between two steps every state block
therefore holds what stock would hold in the block of the last accepted token, so prefill,
prefix caching and preemption read ordinary states.

With prefix caching (mamba_cache_mode "align") a verify block may cross a cache block
boundary. Stock then copies the state at the boundary (one of the per-token states) into the
block that becomes cacheable; here the commit stores the state after the boundary's token on
its way (``boundary_count``), and vLLM's own copy of the temporal state reads the committed
column with no accepted-token offset (patch 0085's edits in vllm/v1/worker/mamba_utils.py and
model_executor/layers/mamba/mamba_utils.py). The conv state is untouched: stock keeps its
k extra columns inside the one block and shifts them by the accepted count as before.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

ENV = "ONECARD_GDN_DEFER"
# inside vLLM this is a child of the "vllm" logger, so the line lands in the server log
logger = logging.getLogger(__name__)


def requested() -> bool:
    """ONECARD_GDN_DEFER=1 (the launcher's GDN_DEFER=1)."""
    return os.environ.get(ENV, "0") == "1"


@dataclass
class _State:
    active: bool = False  # some GDN layer built its scratch (CUDA, speculation on)
    # the GDN metadata build of the current step: device mask of batch rows verified through
    # the spec path (may be longer than the batch: FULL-graph buffers pad with False)
    spec_mask: torch.Tensor | None = None
    num_spec_decodes: int = 0
    # (layer, index of its mamba group among the runner's mamba groups), found at first commit
    layers: list = field(default_factory=list)
    group_ids: list = field(default_factory=list)
    plan: object = None  # the kernels' CommitPlan, built at the first commit
    plan_key: tuple = ()


_STATE = _State()


def check_config(*, on_cuda: bool, num_spec: int, mamba_cache_mode: str, use_v2_model_runner: bool) -> bool:
    """Whether a GDN layer with this configuration defers its commit (ONECARD_GDN_DEFER=1 and
    speculation on, on CUDA); raises one line for a configuration the commit does not cover."""
    if not requested() or num_spec <= 0 or not on_cuda:
        return False
    if mamba_cache_mode not in ("none", "align"):
        raise ValueError(f"{ENV}=1 with mamba_cache_mode={mamba_cache_mode!r}; valid: 'none' "
                         "(prefix caching off) or 'align' (prefix caching on), or ONECARD_GDN_DEFER=0")
    if use_v2_model_runner:
        raise ValueError(f"{ENV}=1 needs vLLM's V1 GPU model runner (its commit hook is there); "
                         "valid: VLLM_USE_V2_MODEL_RUNNER unset or 0, or ONECARD_GDN_DEFER=0")
    if not _STATE.active:
        logger.info("onecard 0085: %s=1: Gated-DeltaNet layers keep one state block per sequence under "
                    "speculation (%d draft tokens, mamba cache mode %s); the accepted tokens are committed "
                    "after the rejection sampler", ENV, num_spec, mamba_cache_mode)
    _STATE.active = True
    return True


def active() -> bool:
    return _STATE.active


def note_step(spec_mask: torch.Tensor | None, num_spec_decodes: int) -> None:
    """Called by the GDN metadata build of every step: which rows verify a draft block."""
    _STATE.spec_mask = spec_mask if num_spec_decodes > 0 else None
    _STATE.num_spec_decodes = int(num_spec_decodes)


def _kernels():
    """The kernel module beside this one: onecard_gdn_defer inside vLLM, gdn_defer in onecard."""
    try:
        from . import onecard_gdn_defer as k  # noqa: PLC0415
    except ImportError:
        from . import gdn_defer as k  # noqa: PLC0415
    return k


def _bind(forward_context: dict, kv_cache_config, mamba_group_ids: list[int]) -> None:
    if _STATE.layers:
        return
    for local, gid in enumerate(mamba_group_ids):
        for name in kv_cache_config.kv_cache_groups[gid].layer_names:
            layer = forward_context[name]
            if getattr(layer, "_onecard_defer", None) is not None:
                _STATE.layers.append((layer, local))
    _STATE.group_ids = list(mamba_group_ids)


@dataclass
class AlignInputs:
    """Batch-ordered device tensors of the step (vLLM's MambaSpecDecodeGPUContext buffers), for
    gdn_defer_commit_all's prefix-cache boundary rule (in torch: boundary() of onecard's test
    oracle tests/gdn_defer_oracle.py)."""

    state_idx: torch.Tensor  # running block column per row
    num_scheduled: torch.Tensor
    num_computed: torch.Tensor  # before the step
    num_draft: torch.Tensor
    block_size: int


def commit(*, forward_context: dict, kv_cache_config, mamba_group_ids: list[int],
           block_tables: list[torch.Tensor], num_reqs: int, num_accepted: torch.Tensor,
           align: AlignInputs | None = None) -> bool:
    """Replay each verified row's accepted tokens onto its committed state, in every deferring
    GDN layer, in one launch (gdn_defer_commit_all; the block ids and the boundary rule are
    looked up in the kernel). ``block_tables[i]``: the whole persistent device block table
    ([max_num_reqs, columns], batch order) of ``mamba_group_ids[i]``; ``num_accepted``: the
    rejection sampler's counts per batch row (>= 1 for a verified row). Launches nothing (and
    returns False) when no row verified a draft block this step."""
    if not _STATE.active or _STATE.spec_mask is None or num_reqs == 0:
        return False
    k = _kernels()
    _bind(forward_context, kv_cache_config, mamba_group_ids)
    # the plan holds the addresses of the pools, scratches and block tables: rebuilt if any moved
    key = (tuple((bt.data_ptr(), tuple(bt.shape)) for bt in block_tables),
           tuple(layer.kv_cache[1].data_ptr() for layer, _ in _STATE.layers))
    if _STATE.plan is None or _STATE.plan_key != key:
        _STATE.plan = k.CommitPlan([layer.kv_cache[1] for layer, _ in _STATE.layers],
                                   [layer._onecard_defer for layer, _ in _STATE.layers],
                                   [local for _, local in _STATE.layers], list(block_tables))
        _STATE.plan_key = key
        scratch = sum(layer._onecard_defer.nbytes for layer, _ in _STATE.layers)
        logger.info("onecard 0085: GDN commit plan: %d layers in %d KV cache groups, verify scratch %.1f MiB",
                    len(_STATE.layers), len(block_tables), scratch / 2**20)
    if align is None:
        k.gdn_defer_commit_all(_STATE.plan, spec_mask=_STATE.spec_mask, num_accepted=num_accepted,
                               num_rows=num_reqs)
    else:
        k.gdn_defer_commit_all(_STATE.plan, spec_mask=_STATE.spec_mask, num_accepted=num_accepted,
                               num_rows=num_reqs, running_col=align.state_idx, num_computed=align.num_computed,
                               num_scheduled=align.num_scheduled, num_draft=align.num_draft,
                               block_size=align.block_size)
    _STATE.spec_mask = None  # one commit per build: a stale mask is never replayed
    return True


def reset() -> None:
    """Forget the bound layers and the step (tests; a new engine in the same process)."""
    global _STATE
    _STATE = _State()
