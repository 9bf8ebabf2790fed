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
"""

from __future__ import annotations

import importlib.util

import torch
from typing_extensions import override

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.spec_decode.dflash2_lane import (
    GREEDY_EPS,
    LaneBook,
    assemble_block,
    candidate_probs_to_rows,
    one_hot_rows,
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
        self._anchors: torch.Tensor | None = None
        self._sampled: object = None  # this step's sampled ids (GPU [B, k+1] or CPU lists)
        self._valid_counts: torch.Tensor | None = None
        self._prewarmed = False
        k = self.num_speculative_tokens
        logger.info(
            "DFlash2: %d drafter rows + %d lookup positions (lookup %s), selector top-%d",
            min(k, self.block_rows), max(0, k - self.block_rows),
            "on" if self.lookup_enabled else "off", self.selector_top_k,
        )
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
        return out

    @override
    def prepare_next_token_ids_cpu(self, sampled_token_ids, requests, gpu_input_batch,
                                   num_scheduled_tokens):
        self._sampled, self._valid_counts = sampled_token_ids, None
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
        if self.lookup_enabled and self.runner is not None:
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
            # leaves -1 placeholders there: skipped); this step's accepted tokens follow
            lane = self.lanes.lane(
                rid, lambda s=state: list(s.prompt_token_ids or [])
                + list(s.output_token_ids))
            if i < len(new_tokens):
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
