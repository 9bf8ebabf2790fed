# SPDX-License-Identifier: Apache-2.0
# onecard 0080 (DFlash2): the DFlash2 proposer for the V1 runner.
"""DFlash2Proposer: DFlashProposer with the DFlash2 selector and the lookup lane.

One drafter pass per step over ``1 + rows`` query rows per request (rows =
min(k, block_size - 1)); lm_head on the mask rows -> top-``selector_top_k`` candidates per
position -> the selector walk (greedy, or sampled with its q rows when
``draft_sample_method="probabilistic"``) -> ``rows`` drafts. With k = num_speculative_tokens >
rows, positions rows+1..k come from the lookup lane (a suffix match in the request's own
prompt + generated text, ``dflash2_lookup``), or repeat the last draft when it finds nothing.
The [B, k] ids (and the q rows: the walk's, one-hot for lookup/fill tokens) go through vLLM's
verify forward and rejection sampler unchanged, which is what keeps greedy and sampled output
exact. Per-position acceptance is vLLM's own ``spec_decode_num_accepted_tokens_per_pos``
(positions 0..k-1).

Ring mode (ONECARD_DFLASH_RING=1, docs/dflash2-huge.md §3 design (d)): the drafter's layers
have no KV-cache spec (qwen3_dflash2.py), so vLLM's pool and its groups hold the target only.
The proposer then keeps the drafter's K/V itself: one FlashAttention-layout ring tensor per
drafter layer (``max_num_seqs`` slots of ``ring_blocks(window, k)`` blocks of 16 rows, plus a
spare block), a request id -> slot map, a block table per batch gathered from the slots' ring
rows, and one attention group of its own on a synthetic ``SlidingWindowSpec(block_size=16)``.
Context rows the ring cannot hold in one step are given slot -1 (skipped by the cache write).
A slot handed to a new request is cleared, so rows it never wrote (positions a prefix-cache hit
skipped) read as zeros until the window moves past them: drafts only, verification is exact.
"""

from __future__ import annotations

import importlib.util
from copy import copy

import torch
from typing_extensions import override

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.spec_decode.dflash2_lane import (
    GREEDY_EPS,
    RING_BLOCK,
    DeviceLane,
    LaneBook,
    RingSlots,
    assemble_block,
    candidate_probs_to_rows,
    lane_mode,
    one_hot_rows,
    ring_block_table,
    ring_blocks,
    ring_filter_context_slots,
    ring_mode_enabled,
    ring_rows_table,
    ring_total_blocks,
    ring_window,
    selector_walk,
)

logger = init_logger(__name__)


def _unwrap(model):
    while True:
        inner = getattr(model, "unwrap", None)
        if callable(inner):
            model = inner()
            continue
        runnable = getattr(model, "runnable", None)
        if runnable is not None and runnable is not model:
            model = runnable
            continue
        return model


class DFlash2Proposer(DFlashProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.runner = runner  # the base class does not keep it; the lookup lane reads it
        sc = self.speculative_config
        dc = self.dflash_config
        self.block_rows = int(dc["block_size"]) - 1
        self.selector_top_k = int(dc["selector_top_k"])
        self.lookup_enabled = bool(getattr(sc, "dflash2_lookup", True))
        self.lanes = LaneBook(
            key_len=int(getattr(sc, "dflash2_lookup_key_len", 2)),
            max_match=int(getattr(sc, "dflash2_lookup_max_match", 16)),
        )
        # where the lane's suffix match runs: "device" (no host sync) or "host" (LookupLane)
        self.lane_mode = lane_mode()
        self.device_lane: DeviceLane | None = None  # built at the first step that needs it
        self._anchors: torch.Tensor | None = None
        self._sampled: object = None  # this step's sampled ids (GPU [B, k+1] or CPU lists)
        self._valid_counts: torch.Tensor | None = None
        self._prewarmed = False
        k = self.num_speculative_tokens
        logger.info(
            "DFlash2: %d drafter rows + %d lookup positions (lookup %s), selector top-%d",
            min(k, self.block_rows), max(0, k - self.block_rows),
            f"on, {self.lane_mode} lane" if self.lookup_enabled else "off",
            self.selector_top_k,
        )
        self.ring_mode = ring_mode_enabled()
        if self.ring_mode:
            self._ring_init()
        if importlib.util.find_spec("flashinfer") is None:
            logger.warning(
                "DFlash2: FlashInfer is NOT installed - vLLM's sampler (top-k/top-p of "
                "sampled requests) runs its PyTorch fallback: +0.15 ms per step for one sampled "
                "request over FlashInfer's (+0.25-0.52 ms for 4-32) at the 27B's 248,320-token "
                "vocabulary on an H200, about 1.3% of a 27B decode step there; greedy requests "
                "and the drafter's candidate top-k (torch.topk either way) are unaffected. "
                "docs/dflash2.md."
            )

    # ------------------------------------------------------------------ inputs
    @override
    def prepare_next_token_ids_padded(self, sampled_token_ids, requests, gpu_input_batch,
                                      discard_request_mask):
        out = super().prepare_next_token_ids_padded(
            sampled_token_ids, requests, gpu_input_batch, discard_request_mask)
        self._sampled, self._valid_counts = sampled_token_ids, out[1]
        self._lane_feed(sampled_token_ids, out[1], requests, gpu_input_batch)
        return out

    @override
    def prepare_next_token_ids_cpu(self, sampled_token_ids, requests, gpu_input_batch,
                                   num_scheduled_tokens):
        self._sampled, self._valid_counts = sampled_token_ids, None
        self._lane_feed(sampled_token_ids, None, requests, gpu_input_batch)
        return super().prepare_next_token_ids_cpu(
            sampled_token_ids, requests, gpu_input_batch, num_scheduled_tokens)

    # ------------------------------------------------------------------ propose
    @override
    def propose(self, num_speculative_tokens, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, token_indices_to_sample,
                common_attn_metadata, sampling_metadata, mm_embed_inputs=None,
                num_rejected_tokens_gpu=None, slot_mappings=None) -> torch.Tensor:
        k = int(num_speculative_tokens)
        rows = min(k, self.block_rows)
        self._anchors = next_token_ids
        drafts = super().propose(
            rows, target_token_ids, target_positions, target_hidden_states,
            next_token_ids, token_indices_to_sample, common_attn_metadata,
            sampling_metadata, mm_embed_inputs=mm_embed_inputs,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu, slot_mappings=slot_mappings,
        )
        self.num_speculative_tokens = k
        if k > rows and rows > 0:
            drafts = self._extend(drafts, k)
        self._sampled = self._valid_counts = None
        return drafts

    def _extend(self, drafts: torch.Tensor, k: int) -> torch.Tensor:
        """[B, rows] drafts -> [B, k]: lookup tokens, else the last draft repeated."""
        b, rows = drafts.shape
        if self.lookup_enabled and self.runner is not None and self.lane_mode == "device":
            full = self._device_lane_rows(drafts, k)
        elif self.lookup_enabled and self.runner is not None:
            full = torch.tensor(self._lookup_rows(drafts, k), dtype=drafts.dtype,
                                device=drafts.device)
        else:
            full = torch.cat([drafts, drafts[:, -1:].expand(b, k - rows)], 1)
        q = self._last_draft_probs
        if q is not None:
            self._last_draft_probs = torch.cat(
                [q, one_hot_rows(full[:, rows:], q.shape[-1]).to(q.dtype)], 1
            ).contiguous()
        return full

    # ------------------------------------------------------------------ device lane
    def _lane_on(self) -> bool:
        k = int(self.speculative_config.num_speculative_tokens)
        return self.lookup_enabled and self.lane_mode == "device" and k > self.block_rows

    def _lane(self, device) -> DeviceLane:
        if self.device_lane is None:
            self.device_lane = DeviceLane(
                slots=int(self.vllm_config.scheduler_config.max_num_seqs),
                max_model_len=int(self.max_model_len),
                k_max=int(self.speculative_config.num_speculative_tokens),
                key_len=self.lanes.params[0], max_match=self.lanes.params[1], device=device)
            logger.info("DFlash2 lookup lane on the device: %.2f MiB of token history",
                        self.device_lane.nbytes / 2**20)
        return self.device_lane

    def _lane_bind(self, lane: DeviceLane, requests, batch, b: int) -> None:
        req_ids = [batch.req_ids[i] if i < len(batch.req_ids) else None for i in range(b)]
        req_ids = [r if r is not None and r in requests else None for r in req_ids]

        def history(rid: str) -> list[int]:
            # prompt + outputs known so far (async scheduling's -1 placeholders are skipped)
            state = requests[rid]
            return list(state.prompt_token_ids or []) + list(state.output_token_ids)

        lane.bind(req_ids, lambda r: r in requests, history)

    def _lane_feed(self, sampled, valid, requests, batch) -> None:
        """Each step's accepted tokens into the device histories, from prepare_next_token_ids_*
        (the runner calls one of them every speculative step, also on steps whose batch does
        not fit the drafter and gets no propose). Padded path (a GPU tensor, before vLLM's
        bookkeeping): a request seen for the first time is seeded with prompt + outputs so far,
        then this step's tokens are appended. CPU path (lists, after the bookkeeping): the
        outputs already hold this step's tokens, so a freshly seeded row appends nothing."""
        if not self._lane_on():
            return
        if isinstance(sampled, torch.Tensor):
            lane = self._lane(sampled.device)
            b = sampled.shape[0]
            self._lane_bind(lane, requests, batch, b)
            if sampled.numel():
                lane.append(sampled, valid)
            return
        lane = self._lane(self.device)
        b = len(sampled)
        self._lane_bind(lane, requests, batch, b)
        rows = [[] if i in lane.fresh_rows else list(r) for i, r in enumerate(sampled)]
        width = max((len(r) for r in rows), default=0)
        if width:
            padded = [r + [-1] * (width - len(r)) for r in rows]
            lane.append(lane.upload(padded, torch.int64).view(b, width), None)

    def _device_lane_rows(self, drafts: torch.Tensor, k: int) -> torch.Tensor:
        """The lookup lane without a host sync (DeviceLane): the suffix match over the device
        histories fed by _lane_feed. Host work only when the batch's request ids change."""
        lane = self._lane(drafts.device)
        self._lane_bind(lane, self.runner.requests, self.runner.input_batch, drafts.shape[0])
        return lane.rows(drafts, k)

    def _lookup_rows(self, drafts: torch.Tensor, k: int) -> list[list[int]]:
        """One D2H sync per step: drafts + this step's accepted tokens -> lanes -> rows."""
        batch = self.runner.input_batch
        requests = self.runner.requests
        d_cpu = drafts.tolist()
        sampled = self._sampled
        if isinstance(sampled, torch.Tensor):
            s_cpu = sampled.tolist()
            counts = (self._valid_counts.tolist() if self._valid_counts is not None
                      else [sum(1 for t in r if t >= 0) for r in s_cpu])
            new_tokens = [s_cpu[i][: int(counts[i])] for i in range(len(s_cpu))]
        elif isinstance(sampled, list):
            new_tokens = [list(r) for r in sampled]
        else:
            new_tokens = [[] for _ in d_cpu]
        out = []
        rows = drafts.shape[1]
        for i, row in enumerate(d_cpu):
            rid = batch.req_ids[i] if i < len(batch.req_ids) else None
            state = requests.get(rid) if rid is not None else None
            if state is None:
                out.append(assemble_block(row, [], k))
                continue
            # a new lane is seeded with prompt + outputs known so far (async scheduling
            # leaves -1 placeholders there: skipped); this step's accepted tokens follow, except
            # on the CPU path (lists, after vLLM's bookkeeping), where the seed already holds them
            fresh = rid not in self.lanes.lanes
            lane = self.lanes.lane(
                rid, lambda s=state: list(s.prompt_token_ids or [])
                + list(s.output_token_ids))
            if i < len(new_tokens) and not (fresh and isinstance(sampled, list)):
                lane.extend(t for t in new_tokens[i] if t >= 0)
            room = self.max_model_len - len(lane) - rows - 1
            out.append(assemble_block(row, lane.propose(row, cap=k - rows, room=room), k))
        if len(self.lanes.lanes) > 2 * max(1, len(batch.req_ids)):
            self.lanes.prune(lambda r: r in requests)
        return out

    # ------------------------------------------------------------------ drafting
    def _selector(self):
        return _unwrap(self.model).model.candidate_selector

    @override
    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        """lm_head on the mask rows -> top-k -> selector walk -> drafts (+ q rows)."""
        assert self._anchors is not None
        rows = self.num_speculative_tokens
        b = hidden_states.shape[0] // rows
        sel = self._selector()
        logits = self.model.compute_logits(hidden_states)
        unary, cand = torch.topk(logits.float(), self.selector_top_k, dim=-1)
        hproj = sel.hidden_projection(hidden_states)
        temperature = uniforms = None
        if self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy \
                and sampling_metadata.temperature is not None:
            temperature = sampling_metadata.temperature[:b]
            uniforms = torch.rand(b, rows, device=logits.device, dtype=torch.float64)
        tokens, cprobs = selector_walk(
            unary.view(b, rows, -1), cand.view(b, rows, -1), hproj.view(b, rows, -1),
            self._anchors[:b], sel.predecessor_codebook, sel.successor_codebook,
            temperature=temperature, uniforms=uniforms,
        )
        probs = None
        if cprobs is not None:
            probs = candidate_probs_to_rows(cand.view(b, rows, -1), cprobs,
                                            logits.shape[-1]).view(b * rows, -1)
        return tokens.view(-1), probs

    # ------------------------------------------------------------------ ring mode
    def _ring_init(self) -> None:
        """Ring geometry (onecard/dflash/ring.py's formula) and the slot map; the tensors come
        with initialize_attn_backend, once the KV cache is configured."""
        self.ring_window = ring_window(self.draft_model_config.hf_config)
        if self.ring_window <= self.block_rows:
            # FlashAttention makes the window symmetric for the non-causal block: a window
            # narrower than the block would hide block rows from each other
            raise ValueError(
                f"DFlash2 ring mode: sliding window {self.ring_window} is not wider than the "
                f"drafter's {self.block_rows} block rows; valid: a window > {self.block_rows}")
        self.ring_k = int(self.num_speculative_tokens)         # k = DFLASH_TOKENS
        self.ring_slots = int(self.vllm_config.scheduler_config.max_num_seqs)
        self.ring_blocks_per_slot = ring_blocks(self.ring_window, self.ring_k)
        self.ring_rows = self.ring_blocks_per_slot * RING_BLOCK
        self.ring_num_blocks = ring_total_blocks(self.ring_slots, self.ring_window, self.ring_k)
        # the table covers every position a request can reach (its query block included): the
        # input kernel clamps a block index to the table's width
        self.ring_width = -(-(self.max_model_len + self.ring_k + 2) // RING_BLOCK) + 1
        self.ring_book = RingSlots(self.ring_slots)
        self.ring_caches: dict[str, torch.Tensor] = {}
        self._ring_table: torch.Tensor | None = None
        self._ring_key: tuple | None = None
        self._ring_bt: torch.Tensor | None = None
        logger.info(
            "DFlash2 ring mode: drafter K/V outside vLLM's pool, window %d, k %d, %d slots x "
            "%d blocks of %d rows (+1 spare) per layer", self.ring_window, self.ring_k,
            self.ring_slots, self.ring_blocks_per_slot, RING_BLOCK,
        )

    @override
    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        if getattr(self.speculative_config, "dflash2_draft_quant", None) and torch.cuda.is_available():
            # vLLM's online FP8 leaves a layer's bf16 copy and its quantization scratch (about
            # 1.8 GB for the 27B drafter's gate_up) in the caching allocator; with a KV pin
            # nothing empties it before the pool is allocated, and on a 24 GB card the pool's
            # large blocks may not fit beside those cached ones
            torch.cuda.empty_cache()
        if not self.ring_mode:
            return
        # the base class keeps only layers with a KV-cache spec; ring layers have none
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
        names = {n for n, layer in layers.items() if getattr(layer, "dflash2_ring", False)}
        if not names:
            raise RuntimeError(
                "DFlash2 ring mode: the drafter has no ring attention layers; valid: a "
                "DFlash2 drafter built with ONECARD_DFLASH_RING=1 in the server environment")
        self._draft_attn_layer_names = names

    @override
    def validate_same_kv_cache_group(self, kv_cache_config) -> None:
        if not self.ring_mode:
            super().validate_same_kv_cache_group(kv_cache_config)
        # ring mode: the drafter's layers are in no KV-cache group

    @override
    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        if not self.ring_mode:
            super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
            return
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        from vllm.v1.kv_cache_interface import AttentionSpec, SlidingWindowSpec
        from vllm.v1.worker.utils import AttentionGroup

        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
        names = sorted(self._draft_attn_layer_names)
        first = layers[names[0]]
        backend = first.get_attn_backend()
        for n in names:
            layer = layers[n]
            same = (layer.get_attn_backend() is backend
                    and (layer.num_kv_heads, layer.head_size, layer.kv_cache_torch_dtype)
                    == (first.num_kv_heads, first.head_size, first.kv_cache_torch_dtype))
            if not same:
                raise ValueError(
                    f"DFlash2 ring mode: drafter layer {n} differs from {names[0]} in backend "
                    "or K/V shape; valid: one backend, head count, head size and dtype for "
                    "every drafter layer")
        spec = SlidingWindowSpec(
            block_size=RING_BLOCK, num_kv_heads=first.num_kv_heads,
            head_size=first.head_size, dtype=first.kv_cache_torch_dtype,
            sliding_window=self.ring_window,
        )
        # the runner hands the proposer the common metadata of group kv_cache_gid: any group
        # carries the batch's query_start_loc / seq_lens; the block table is replaced per step
        groups = kv_cache_config.kv_cache_groups
        self.kv_cache_gid = next(
            (g for g, grp in enumerate(groups) if isinstance(grp.kv_cache_spec, AttentionSpec)),
            0)
        group = AttentionGroup(backend=backend, layer_names=names, kv_cache_spec=spec,
                               kv_cache_group_id=self.kv_cache_gid)
        group.create_metadata_builders(self.vllm_config, self.device)
        self.draft_attn_groups = [group]
        self.block_size = RING_BLOCK
        self._ring_allocate(layers, names, backend)

    def _ring_allocate(self, layers, names, backend) -> None:
        """One zeroed ring per drafter layer, in the backend's KV-cache layout (as the runner
        lays out its own pages), bound as the layer's kv_cache. Kept across a second call."""
        from vllm.config import set_current_vllm_config

        first = layers[names[0]]
        shape = backend.get_kv_cache_shape(self.ring_num_blocks, RING_BLOCK,
                                           first.num_kv_heads, first.head_size,
                                           cache_dtype_str="auto")
        # the block index's dim in this backend's logical shape (0 for FlashAttention in 0.27.1;
        # K/V-first layouts put it at 1): _ring_clear zeroes a slot's blocks along it
        self._ring_block_dim = backend.get_kv_cache_block_dim(
            RING_BLOCK, first.num_kv_heads, first.head_size, cache_dtype_str="auto")
        try:
            with set_current_vllm_config(self.vllm_config):
                order = tuple(backend.get_kv_cache_stride_order())
            assert len(order) == len(shape)
        except (AttributeError, NotImplementedError):
            order = tuple(range(len(shape)))
        physical = tuple(shape[i] for i in order)
        inverse = [order.index(i) for i in range(len(order))]
        for n in names:
            cache = self.ring_caches.get(n)
            if cache is None or tuple(cache.shape) != tuple(shape):
                cache = torch.zeros(physical, dtype=first.kv_cache_torch_dtype,
                                    device=self.device).permute(*inverse)
                self.ring_caches[n] = cache
            layers[n].bind_kv_cache(cache)
        if self._ring_table is None:
            # row ``ring_slots`` maps every block to the spare block: the batch's padding rows
            self._ring_table = ring_rows_table(self.ring_slots, self.ring_blocks_per_slot,
                                               self.ring_width, device=self.device,
                                               spare_row=True)
        total = sum(t.numel() * t.element_size() for t in self.ring_caches.values())
        logger.info("DFlash2 ring mode: %d ring tensors %s, %.1f MiB beside the KV pool",
                    len(names), tuple(shape), total / 2**20)

    def _ring_clear(self, slot: int) -> None:
        lo, hi = slot * self.ring_blocks_per_slot, (slot + 1) * self.ring_blocks_per_slot
        for cache in self.ring_caches.values():
            cache.narrow(self._ring_block_dim, lo, hi - lo).zero_()

    def _ring_block_table(self, batch_size: int) -> torch.Tensor:
        """This batch's drafter block table, [batch_size, width]: each request's slot rows, and
        the spare row for padding rows past the runner's requests (the runner may pad the batch
        for CUDA graphs). Slots are (re)assigned only when the batch's request ids change
        (arrivals, finishes, reorders; one small host-to-device copy then, none in steady
        decoding); fresh slots are cleared first."""
        if self.runner is None or self._ring_table is None:
            raise RuntimeError("DFlash2 ring mode: no runner or no rings yet; valid: propose "
                               "after the runner's KV-cache initialization")
        req_ids = tuple(self.runner.input_batch.req_ids[:batch_size])
        key = (req_ids, batch_size)
        if key != self._ring_key or self._ring_bt is None:
            requests = self.runner.requests
            slots, fresh = self.ring_book.assign(list(req_ids), alive=lambda r: r in requests)
            for slot in fresh:
                self._ring_clear(slot)
            slots += [self.ring_slots] * (batch_size - len(slots))   # the spare row
            slot_ids = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
            self._ring_bt = ring_block_table(self._ring_table, slot_ids)
            self._ring_key = key
        return self._ring_bt

    @override
    def set_inputs_first_pass(self, target_token_ids, next_token_ids, target_positions,
                              target_hidden_states, token_indices_to_sample, cad,
                              num_rejected_tokens_gpu):
        if not self.ring_mode:
            return super().set_inputs_first_pass(
                target_token_ids, next_token_ids, target_positions, target_hidden_states,
                token_indices_to_sample, cad, num_rejected_tokens_gpu)
        batch_size = cad.batch_size()
        cad = copy(cad)
        cad.block_table_tensor = self._ring_block_table(batch_size)
        out = super().set_inputs_first_pass(
            target_token_ids, next_token_ids, target_positions, target_hidden_states,
            token_indices_to_sample, cad, num_rejected_tokens_gpu)
        num_context = target_token_ids.shape[0]
        ring_filter_context_slots(
            self._context_slot_mapping_buffer[:num_context],
            self._context_positions_buffer[:num_context], cad.query_start_loc,
            self.positions, batch_size, 1 + self.num_speculative_tokens, self.ring_k,
            self.ring_rows)
        return out

    # ------------------------------------------------------------------ boot
    @override
    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, use_cudagraphs: bool = True,
                  is_graph_capturing: bool = False, slot_mappings=None) -> None:
        super().dummy_run(num_tokens, use_cudagraphs=use_cudagraphs,
                          is_graph_capturing=is_graph_capturing, slot_mappings=slot_mappings)
        if not is_graph_capturing and not self._prewarmed:
            self._prewarmed = True
            self._prewarm()

    def _prewarm(self) -> None:
        """Run the selector walk once at boot (first dummy run), so the first request does
        not pay its first-use costs; failures only warn."""
        try:
            rows = min(self.num_speculative_tokens, self.block_rows)
            sel = self._selector()
            h = torch.zeros(rows, sel.hidden_projection.input_size, device=self.device,
                            dtype=self.dtype)
            logits = self.model.compute_logits(h)
            unary, cand = torch.topk(logits.float(), self.selector_top_k, dim=-1)
            hproj = sel.hidden_projection(h)
            selector_walk(unary.view(1, rows, -1), cand.view(1, rows, -1),
                          hproj.view(1, rows, -1),
                          torch.zeros(1, dtype=torch.long, device=self.device),
                          sel.predecessor_codebook, sel.successor_codebook,
                          temperature=torch.ones(1, device=self.device),
                          uniforms=torch.rand(1, rows, device=self.device,
                                              dtype=torch.float64))
        except Exception as e:  # noqa: BLE001 - prewarm must never stop a boot
            logger.warning("DFlash2: selector prewarm failed (%s); the first step pays it", e)
        if self._lane_on() and self.device.type == "cuda":
            # the device lane's history is allocated here, at the first dummy run (vLLM's memory
            # profile sees it), and its Triton match is compiled for this server's one shape
            lane = self._lane(self.device)
            k = int(self.speculative_config.num_speculative_tokens)
            rows = min(k, self.block_rows)
            try:
                lane.bind([None], lambda r: False, lambda r: [])
                lane.rows(torch.zeros(1, rows, dtype=torch.long, device=self.device), k)
            except Exception as e:  # noqa: BLE001 - fall back to the plain-torch match
                lane.use_triton = False
                logger.warning("DFlash2: the lookup lane's Triton match failed to build (%s); "
                               "it runs as plain torch ops (more memory and launches per step)", e)
