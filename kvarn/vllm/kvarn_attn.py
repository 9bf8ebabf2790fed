# SPDX-License-Identifier: Apache-2.0
"""KVARN attention backend: the KVarN 4/2-bit paged KV cache (onecard, issue 9).

Installed by onecard's kvarn/install.sh as vllm/v1/attention/backends/kvarn_attn.py; the
kernels, format and stage planner are copied verbatim from onecard/kvarn/ into
vllm/v1/attention/ops/kvarn/. Selected for --kv-cache-dtype kvarn_k4v2_g128 / kvarn_k4v4_g128 /
kvarn_k4v2_g64 (no other backend accepts them).

Cache of one layer: uint8 [num_blocks, block_size // tile, num_kv_heads, block_bytes] (a vLLM
page of block_size tokens is block_size // tile KVarN tiles; block_size is a multiple of 128).
Per step the metadata builder plans (onecard/kvarn/stage.py): which new rows go to the fp16
stage (tile 0 and the tail; slots keyed by the tile's physical block), which tiles are full and
get packed, the pseudo-sequences (<= 16 queries) of decode / verify, and the prefill jobs (query
runs of more than 16 tokens). The forward then: rotates K/V (Walsh-Hadamard), writes the stage,
packs full tiles (Triton), runs the split-KV attention kernel for decode and verify queries, and
the prefill kernel for each prefill chunk (kernels.kvarn_prefill: the prefix is dequantized once
per chunk into a bounded fp16 window scratch, then a flash kernel with a log-sum-exp merge over
windows; then each query's fp16 window from this step's rows and the stage). The read rule is
the same for all paths: a query reads its fp16 window (its own tile, and with the default
window 2 the previous tile too; ONECARD_KVARN_WINDOW=1|2|3, the launcher's KVARN_WINDOW) in fp16,
the sink tiles fp16 (tile 0; ONECARD_KVARN_SINKS=2, the launcher's KVARN_SINKS: tiles 0 and 1),
older tiles quantized.

CUDA graphs: uniform batches. Without speculation single-token decode
(UNIFORM_SINGLE_TOKEN_DECODE), with it the verify batches of 1 + k queries per request
(UNIFORM_BATCH); vLLM then captures whole steps, GDN layers included (FULL_AND_PIECEWISE). For
such a batch the builder lays its plan out in fixed-size persistent device buffers
(stage.uniform_rows: one pseudo-sequence row per decode token, two per verify block, padding
rows empty, pack jobs padded with block -1, unstaged rows to a trash stage row -- the planner
keeps the stage's last slot for it), so the captured kernels replay with the next step's plan.
Other batches (prefill, mixed, a drafter's ragged ones) run eagerly inside piecewise graphs.
ONECARD_KVARN_GRAPHS=0 turns full graphs off (support NEVER: piecewise only, the behaviour
before 2026-12-04). The planner needs seq_lens and block ids on the host: without speculation it
takes vLLM's host seq_lens and, with onecard patch 0084, the host block table
(cam.block_table_cpu), so a step makes no device-to-host copy; otherwise it copies the device
tensors (a sync). Uniform rows go up through pinned staging buffers.
With speculation (async scheduling: vLLM has no exact host seq_lens) the target's build copies
seq_lens (one sync per step); the MTP drafter's k builds (build_for_drafting, draft_index 0..k-1)
reuse it: index 0 takes the target build's copy (same device rows, untouched since), index 1
copies (the rejection happened on the device), later indices add the proposer's known +1
(ONECARD_KVARN_DRAFT_HOST=1, launcher KVARN_DRAFT_HOST=1, the default since 2026-12-04 session 17:
H200 job 31 at 8k 19.7 vs 24.5 ms per step, job 63 exact; 0 copies in every drafter build). Patch
0084 carries block_table_cpu into the proposer's own metadata.

Limits (one-line errors): decoder self-attention only; no sliding window, ALiBi, soft cap,
KV sharing, sinks, or fp8 output quantization.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.config.cache import CacheDType
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.ops.kvarn import format as kvarn_format
from vllm.v1.attention.ops.kvarn import kernels as kvarn_kernels
from vllm.v1.attention.ops.kvarn import stage as kvarn_stage

logger = init_logger(__name__)

KVARN_CACHE_DTYPES = tuple(p.cache_dtype for p in kvarn_format.PRESETS.values())
PAGE_ALIGN = 128  # block sizes are multiples of the largest tile
# Query tokens per split-KV launch (decode / verify pseudo-sequences): bounds its fp32 partials
# (tokens x heads x parts x head_dim). Prefill chunks take kvarn_prefill, whose scratch is
# format.prefill_scratch_bytes (~137 MiB at 24 q / 4 kv heads of 256, counted in onecard.memory).
MAX_TOKENS_PER_LAUNCH = 1024
_ACTIVE: dict[str, str] = {}  # "cache_dtype": the kvarn dtype of this process
GRAPHS_ENV = "ONECARD_KVARN_GRAPHS"  # 1 (default): full CUDA graphs for decode; 0: piecewise only


# 1: drafter builds reuse exact host seq_lens; 0 (default until it has run on a GPU): each copies
DRAFT_HOST_ENV = "ONECARD_KVARN_DRAFT_HOST"


def draft_host_enabled() -> bool:
    val = os.environ.get(DRAFT_HOST_ENV, "1").strip()
    if val not in ("0", "1"):
        raise ValueError(f"{DRAFT_HOST_ENV}={val!r} is not valid; valid: 0, 1")
    return val == "1"


def _dev_key(t: torch.Tensor) -> tuple:
    """Where a device tensor's values live (storage, offset, stride): two views of the same
    buffer rows compare equal; with ``_version`` (bumped by every in-place torch op on any view
    of the storage) it says 'the same values as when copied', except after raw kernel writes."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.stride()))


@dataclass
class _SeqRecord:
    """The exact host seq_lens a build copied or derived (speculation: vLLM has no exact host
    copy), with where they came from, for the drafter's next build to reuse."""

    key: tuple  # _dev_key(seq_lens)
    version: int  # seq_lens._version at the copy
    qsl: list  # query_start_loc_cpu[: n + 1]
    seq: list  # [n]
    draft_index: int | None  # None: the target's build


def graphs_enabled() -> bool:
    val = os.environ.get(GRAPHS_ENV, "1").strip()
    if val not in ("0", "1"):
        raise ValueError(f"{GRAPHS_ENV}={val!r} is not valid; valid: 0, 1")
    return val == "1"


def is_kvarn(cache_dtype: str | None) -> bool:
    return isinstance(cache_dtype, str) and cache_dtype.startswith("kvarn_")


def bytes_per_token_head(cache_dtype: str, head_size: int) -> int:
    """Bytes one token of one kv head occupies in the paged cache (exact for valid shapes)."""
    p = kvarn_format.get_preset(cache_dtype)
    blk = p.layout(head_size).block_bytes
    if blk % p.tile:
        raise ValueError(f"KVarN {cache_dtype} with head_size {head_size} has {blk} bytes per "
                         f"{p.tile}-token block, not a whole number per token; valid head_size: "
                         f"a power of two >= 64")
    return blk // p.tile


def _resolve(cache_dtype_str: str | None) -> str:
    if is_kvarn(cache_dtype_str):
        return cache_dtype_str  # type: ignore[return-value]
    if "cache_dtype" in _ACTIVE:
        return _ACTIVE["cache_dtype"]
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    if cfg is not None and is_kvarn(cfg.cache_config.cache_dtype):
        return cfg.cache_config.cache_dtype
    raise ValueError(f"KVARN backend without a kvarn cache dtype; valid: {', '.join(KVARN_CACHE_DTYPES)}")


class KvarnAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = list(KVARN_CACHE_DTYPES)  # type: ignore[assignment]

    @staticmethod
    def get_name() -> str:
        return "KVARN"

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [MultipleOf(PAGE_ALIGN)]

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: CacheDType | None) -> bool:
        return kv_cache_dtype in KVARN_CACHE_DTYPES

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size >= 64 and head_size & (head_size - 1) == 0

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True

    @staticmethod
    def get_impl_cls() -> type["KvarnAttentionImpl"]:
        return KvarnAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["KvarnMetadataBuilder"]:
        return KvarnMetadataBuilder

    @staticmethod
    def use_cascade_attention(*args, **kwargs) -> bool:
        return False

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        p = kvarn_format.get_preset(_resolve(cache_dtype_str))
        if block_size % p.tile:
            raise ValueError(f"KVarN block_size {block_size} is not valid; valid: a multiple of {p.tile}")
        return (num_blocks, block_size // p.tile, num_kv_heads, p.layout(head_size).block_bytes)


@dataclass
class KvarnDecodeRows:
    """A uniform step's plan in persistent device buffers (views of the builder's, fixed
    addresses: what a captured CUDA graph reads). Fields as stage.DECODE_FIELDS over the
    step's pseudo-sequence rows (cu_seqlens_q one longer; pack_rows / pack_blocks one per
    request); stage_dst int64 [num_tokens]; q_len the queries per request."""

    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    packed_tiles: torch.Tensor
    sink_rows: torch.Tensor  # [rows, MAX_SINKS] (a strided view of the sink_rows* fields)
    tail_rows: torch.Tensor
    prev_rows: torch.Tensor  # [rows, MAX_PREV] (the prev_rows* fields)
    req_index: torch.Tensor
    pack_rows: torch.Tensor
    pack_blocks: torch.Tensor
    stage_dst: torch.Tensor
    q_len: int = 1


@dataclass
class KvarnMetadata(AttentionMetadata):
    plan: kvarn_stage.StepPlan  # on the device (on the host for a decode-rows step)
    block_table: torch.Tensor  # [pseudo-sequences, pages] ([requests, pages] for decode rows)
    num_actual_tokens: int
    tiles_per_page: int
    cu_cpu: list  # the plan's cu_seqlens_q on the host (launch grouping)
    req_block_table: torch.Tensor | None = None  # [requests, pages] (prefill jobs' rows)
    decode: KvarnDecodeRows | None = None  # set: the CUDA-graph-safe decode path


class KvarnMetadataBuilder(AttentionMetadataBuilder[KvarnMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # the last target (non-drafting) build's exact host seq_lens under speculation; the MTP
    # drafter's builder is another instance (its own attention group), hence a class attribute
    _target_seq: ClassVar[_SeqRecord | None] = None

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if not graphs_enabled():
            return AttentionCGSupport.NEVER
        if getattr(vllm_config, "speculative_config", None) is not None:
            return AttentionCGSupport.UNIFORM_BATCH  # verify blocks of 1 + k (uniform rows)
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.preset = kvarn_format.get_preset(vllm_config.cache_config.cache_dtype)
        self.tiles_per_page = kv_cache_spec.block_size // self.preset.tile
        window = kvarn_format.window_from_env()
        sinks = kvarn_format.sinks_from_env()
        max_seqs = vllm_config.scheduler_config.max_num_seqs
        stage_slots = kvarn_stage.default_num_slots(max_seqs, window, sinks)
        # the stage's last slot is the trash row of decode rows (never planned)
        self.planner = kvarn_stage.StagePlanner(self.preset, stage_slots - 1, self.tiles_per_page,
                                                window=window, sinks=sinks)
        self.trash_row = (stage_slots - 1) * self.preset.tile
        comp = getattr(vllm_config, "compilation_config", None)
        # uniform rows: single-token decode, or with speculation verify blocks of 1 + k queries
        # (vLLM's uniform_decode_query_len); capacity in tokens
        spec = getattr(vllm_config, "speculative_config", None)
        k = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
        self.uniform_q = 1 + k
        self.decode_capacity = max(int(max_seqs) * self.uniform_q,
                                   int(getattr(comp, "max_cudagraph_capture_size", 0) or 0))
        if self.uniform_q > kvarn_stage.MAX_QUERY_LEN:
            self.decode_capacity = 0  # not a pseudo-sequence block: general path only
        self._rows_i32 = torch.zeros((len(kvarn_stage.DECODE_FIELDS), 2 * self.decode_capacity + 1),
                                     dtype=torch.int32, device=device)
        self._rows_dst = torch.zeros(self.decode_capacity, dtype=torch.int64, device=device)
        # pinned host staging for the rows (two sets, each reused only after its last copy
        # finished: an event per set), so the upload never waits on the GPU
        self._staging: list = []
        if torch.device(device).type == "cuda":
            self._staging = [[self._rows_i32.cpu().pin_memory(), self._rows_dst.cpu().pin_memory(), None]
                             for _ in range(2)]
        self._staging_next = 0
        # vLLM's host seq_lens are exact without speculation (optimistic with it)
        self._host_seq_lens = spec is None
        self.max_model_len = int(getattr(getattr(vllm_config, "model_config", None), "max_model_len", 0) or 0)
        self._draft_index: int | None = None  # set while build_for_drafting runs
        self._draft_seq: _SeqRecord | None = None  # this builder's last drafting build
        logger.info_once("KVarN %s: fp16 window %d tile(s) per query, %d sink tile(s), %d stage "
                         "slots per layer (one is the decode trash row); decode CUDA graphs %s",
                         self.preset.cache_dtype, window, sinks, stage_slots,
                         "on" if graphs_enabled() else f"off ({GRAPHS_ENV}=0)")

    def build_for_drafting(self, common_attn_metadata: CommonAttentionMetadata, draft_index: int
                           ) -> KvarnMetadata:
        """vLLM's proposer (EAGLE / MTP) builds once per draft step: draft_index 0 over the
        target's query layout, then one single-token step per further draft token."""
        self._draft_index = int(draft_index)
        try:
            return self.build(0, common_attn_metadata, fast_build=True)
        finally:
            self._draft_index = None

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KvarnMetadata:
        cam = common_attn_metadata
        n = cam.num_reqs
        seq = self._host_seq(cam, n)
        qsl = cam.query_start_loc_cpu[: n + 1].tolist()
        q_lens = [qsl[i + 1] - qsl[i] for i in range(n)]
        # A uniform batch (vLLM pads a FULL-graph batch with requests of no query and seq_len 0
        # and with tokens past the last request): the fixed-size uniform rows.
        Q = self.uniform_q
        nt = cam.num_actual_tokens
        if 0 < nt <= self.decode_capacity and nt % Q == 0 and max(q_lens, default=0) == Q \
                and all(q_lens[r] == 0 or (qsl[r] == r * Q and seq[r] >= Q) for r in range(n)):
            return self._build_decode(cam, n, seq, q_lens)
        ctx = [s - (qsl[i + 1] - qsl[i]) for i, s in enumerate(seq)]
        plan = self._plan(ctx, seq, qsl[:n], self._host_block_table(cam, n))
        dev_plan = plan.to(self.device)
        bt = cam.block_table_tensor[:n].index_select(0, dev_plan.req_index)
        return KvarnMetadata(plan=dev_plan, block_table=bt, num_actual_tokens=cam.num_actual_tokens,
                             tiles_per_page=self.tiles_per_page, cu_cpu=plan.cu_seqlens_q.tolist(),
                             req_block_table=cam.block_table_tensor[:n])

    def _build_decode(self, cam: CommonAttentionMetadata, n: int, seq: list, q_lens: list
                      ) -> KvarnMetadata:
        Q = self.uniform_q
        act = [r for r in range(n) if q_lens[r] == Q]  # request r's tokens start at r * Q
        plan = self._plan([seq[r] - Q for r in act], [seq[r] for r in act], [r * Q for r in act],
                          self._host_block_table(cam, n)[act])
        nt = cam.num_actual_tokens
        i32, dst = kvarn_stage.uniform_rows(plan, Q, nt, self.decode_capacity, self.trash_row)
        # padding requests past the block table's rows (if vLLM padded tokens beyond its
        # requests) read nothing: any valid row keeps the verify path's gather in bounds
        i32[kvarn_stage.DECODE_FIELDS.index("req_index")].clamp_(max=max(n - 1, 0))
        self._upload(i32, dst)
        f = {name: self._rows_i32[i] for i, name in enumerate(kvarn_stage.DECODE_FIELDS)}
        n_req = nt // Q
        n_rows = n_req * kvarn_stage.rows_per_request(Q)

        def cols(names):  # consecutive fields -> a [n_rows, len(names)] view (fixed address)
            i = kvarn_stage.DECODE_FIELDS.index(names[0])
            return self._rows_i32[i:i + len(names), :n_rows].t()

        rows = KvarnDecodeRows(
            cu_seqlens_q=f["cu_seqlens_q"][: n_rows + 1],
            **{name: f[name][:n_rows] for name in ("seq_lens", "packed_tiles", "tail_rows", "req_index")},
            sink_rows=cols(kvarn_stage.SINK_FIELDS), prev_rows=cols(kvarn_stage.PREV_FIELDS),
            pack_rows=f["pack_rows"][:n_req], pack_blocks=f["pack_blocks"][:n_req],
            stage_dst=self._rows_dst[:nt], q_len=Q)
        return KvarnMetadata(plan=plan, block_table=cam.block_table_tensor, num_actual_tokens=nt,
                             tiles_per_page=self.tiles_per_page, cu_cpu=[], decode=rows)


    def _plan(self, ctx: list, seq: list, q_starts: list, bt_cpu: torch.Tensor) -> kvarn_stage.StepPlan:
        """The planner's step plan for requests given by rows of ``bt_cpu`` (host block table)."""
        cols = {r: self.planner.tile_cols(ctx[r], seq[r]) for r in range(len(ctx))}
        tb = kvarn_stage.tile_block_ids(bt_cpu, cols, self.tiles_per_page)
        return self.planner.plan(ctx, seq, q_starts, tb, null_page_blocks=self.tiles_per_page,
                                 prefill_min_q=kvarn_stage.MAX_QUERY_LEN + 1)

    def _host_seq(self, cam: CommonAttentionMetadata, n: int) -> list:
        host = getattr(cam, "_seq_lens_cpu", None) if self._host_seq_lens else None
        if host is not None:
            return host[:n].tolist()
        dev = cam.seq_lens[:n]
        j = self._draft_index
        qsl = cam.query_start_loc_cpu[: n + 1].tolist()
        seq = self._draft_host_seq(dev, n, qsl, j) if j is not None and draft_host_enabled() else None
        if seq is None:
            seq = dev.to("cpu").tolist()  # exact lengths (async spec-decode safe): a sync
        rec = _SeqRecord(_dev_key(dev), dev._version, qsl, seq, j)
        if j is None:
            KvarnMetadataBuilder._target_seq = rec
        else:
            self._draft_seq = rec
        return seq

    def _draft_host_seq(self, dev: torch.Tensor, n: int, qsl: list, j: int) -> list | None:
        """The drafter's exact host seq_lens without a device-to-host copy, where vLLM 0.27.1's
        proposer (llm_base_proposer.propose) fixes them; None: copy them (a sync).
        - draft_index 0 runs over the target's batch with the target's seq_lens tensor, which
          nothing writes in between: the target build's copy (same rows, same query layout,
          no in-place torch op since). Used once.
        - draft_index 1 follows the rejection (seq_lens -= rejected, on the device): unknown on
          the host, copied.
        - draft_index j >= 2: eagle_step_slot_mapping_metadata_kernel added 1 to every row
          (raw kernel write: no _version bump) since draft_index j - 1; exact while every row is
          below max_model_len (the kernel wraps there: then copied)."""
        key, ver = _dev_key(dev), dev._version
        if j == 0:
            rec, KvarnMetadataBuilder._target_seq = KvarnMetadataBuilder._target_seq, None
            if (rec is not None and rec.key == key and rec.version == ver and len(rec.seq) >= n
                    and rec.qsl[: n + 1] == qsl):
                return rec.seq[:n]
            return None
        rec = self._draft_seq
        if (j >= 2 and rec is not None and rec.draft_index == j - 1 and rec.key == key
                and rec.version == ver and len(rec.seq) == n and self.max_model_len > 0
                and all(0 < s < self.max_model_len for s in rec.seq)):
            return [s + 1 for s in rec.seq]
        return None

    @staticmethod
    def _host_block_table(cam: CommonAttentionMetadata, n: int) -> torch.Tensor:
        host = getattr(cam, "block_table_cpu", None)  # patch 0084
        if host is not None:
            return host[:n]
        return cam.block_table_tensor[:n].to("cpu")  # a sync

    def _upload(self, i32: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the rows into the persistent device buffers, stream-ordered after the previous
        step's kernels that read them."""
        if not self._staging:
            self._rows_i32.copy_(i32)
            self._rows_dst.copy_(dst)
            return
        st = self._staging[self._staging_next]
        self._staging_next ^= 1
        if st[2] is not None:
            st[2].synchronize()  # its copy two builds ago (long done in practice)
        st[0].copy_(i32)
        st[1].copy_(dst)
        self._rows_i32.copy_(st[0], non_blocking=True)
        self._rows_dst.copy_(st[1], non_blocking=True)
        st[2] = torch.cuda.Event()
        st[2].record()


class KvarnAttentionImpl(AttentionImpl[KvarnMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks=None, **kwargs) -> None:
        bad = [name for name, val in (("alibi_slopes", alibi_slopes), ("sliding_window", sliding_window),
                                      ("logits_soft_cap", logits_soft_cap or None),
                                      ("kv_sharing_target_layer_name", kv_sharing_target_layer_name),
                                      ("sinks", sinks)) if val is not None]
        if bad or attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"KVARN attention does not support {', '.join(bad) or attn_type}; "
                                      f"valid: decoder self-attention without them")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.preset = kvarn_format.get_preset(kv_cache_dtype)
        self.layout = self.preset.layout(head_size)
        _ACTIVE["cache_dtype"] = self.preset.cache_dtype
        from vllm.config import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()
        max_seqs = cfg.scheduler_config.max_num_seqs if cfg is not None else 8
        self.num_slots = kvarn_stage.default_num_slots(max_seqs, kvarn_format.window_from_env(),
                                                       kvarn_format.sinks_from_env())

    def _stage(self, layer, device):
        st = getattr(layer, "_kvarn_stage", None)
        if st is None or st[0].device != device:
            shape = (self.num_slots * self.preset.tile, self.num_kv_heads, self.head_size)
            st = (torch.zeros(shape, dtype=torch.float16, device=device),
                  torch.zeros(shape, dtype=torch.float16, device=device))
            layer._kvarn_stage = st
        return st

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("KVARN attention does not support fused output quantization; "
                                      "valid: unquantized output")
        assert output is not None
        stage_k, stage_v = self._stage(layer, query.device)  # allocated in the profile run
        if attn_metadata is None:
            return output
        if attn_metadata.decode is not None:
            return self._forward_decode(query, key, value, kv_cache, attn_metadata, output,
                                        stage_k, stage_v)
        n = attn_metadata.num_actual_tokens
        plan = attn_metadata.plan
        if n == 0 or plan.num_tokens == 0:
            return output
        if plan.num_tokens != n:
            if plan.all_null:  # a dummy run whose query_start_loc and token count disagree
                output[:n].zero_()
                return output
            raise RuntimeError(f"KVarN plan covers {plan.num_tokens} tokens, the batch has {n}; "
                               f"valid: query_start_loc_cpu[-1] == num_actual_tokens")
        h, d = self.num_kv_heads, self.head_size
        tpp = attn_metadata.tiles_per_page
        cache = self._cache_view(kv_cache, tpp)
        hn = kvarn_kernels._hadamard(d, query.device)
        k_rot = (key[:n].reshape(-1, d).float() @ hn).to(torch.float16).view(n, h, d)
        v_rot = (value[:n].reshape(-1, d).float() @ hn).to(torch.float16).view(n, h, d)
        kvarn_stage.apply_write(plan, k_rot, v_rot, stage_k, stage_v, cache, self.preset,
                                kvarn_kernels.kvarn_pack_rows)
        q = query[:n].view(n, self.num_heads, d)
        out = output[:n].view(n, self.num_heads, d)
        kvarn_stage.apply_attention(
            plan, q, out, cache, stage_k, stage_v, block_table=attn_metadata.block_table,
            req_block_table=attn_metadata.req_block_table, softmax_scale=self.scale,
            preset=self.preset, tiles_per_page=tpp, attention_rows=kvarn_kernels.kvarn_attention_rows,
            prefill=kvarn_kernels.kvarn_prefill, max_tokens_per_launch=MAX_TOKENS_PER_LAUNCH,
            cu_cpu=attn_metadata.cu_cpu, key_rot=k_rot, val_rot=v_rot)
        return output

    @staticmethod
    def _cache_view(kv_cache: torch.Tensor, tpp: int) -> torch.Tensor:
        if kv_cache.shape[1] != tpp or kv_cache.stride(0) != tpp * kv_cache.stride(1):
            raise NotImplementedError(f"KVarN cache layout {tuple(kv_cache.shape)} strides "
                                      f"{kv_cache.stride()} is not valid; valid: contiguous pages "
                                      f"of {tpp} tiles")
        return kv_cache.flatten(0, 1)

    def _forward_decode(self, query, key, value, kv_cache, md: KvarnMetadata, output,
                        stage_k, stage_v):
        """The uniform-rows path: fixed launches over ``num_actual_tokens`` tokens whose plan
        lives in the builder's persistent buffers (replayable by a captured CUDA graph)."""
        rows = md.decode
        n = md.num_actual_tokens
        h, d = self.num_kv_heads, self.head_size
        cache = self._cache_view(kv_cache, md.tiles_per_page)
        hn = kvarn_kernels._hadamard(d, query.device)
        k_rot = (key[:n].reshape(-1, d).float() @ hn).to(torch.float16).view(n, h, d)
        v_rot = (value[:n].reshape(-1, d).float() @ hn).to(torch.float16).view(n, h, d)
        stage_k.index_copy_(0, rows.stage_dst, k_rot)  # unstaged rows go to the trash row
        stage_v.index_copy_(0, rows.stage_dst, v_rot)
        kvarn_kernels.kvarn_pack_rows(stage_k, stage_v, cache, src_rows=rows.pack_rows,
                                      blocks=rows.pack_blocks, preset=self.preset)
        # decode: row r is request r; verify: two rows per request, each reads its request's row
        bt = md.block_table if rows.q_len == 1 else md.block_table.index_select(0, rows.req_index)
        kvarn_kernels.kvarn_attention_rows(
            query[:n].view(n, self.num_heads, d), cache, stage_k, stage_v,
            output[:n].view(n, self.num_heads, d), cu_seqlens_q=rows.cu_seqlens_q,
            seq_lens=rows.seq_lens, packed_tiles=rows.packed_tiles, sink_rows=rows.sink_rows,
            tail_rows=rows.tail_rows, ring=self.preset.tile, prev_rows=rows.prev_rows,
            block_table=bt, max_query_len=rows.q_len, softmax_scale=self.scale,
            preset=self.preset, tiles_per_page=md.tiles_per_page)
        return output
