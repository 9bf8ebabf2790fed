#!/usr/bin/env python3
"""Build patches/0085-gdn-defer-commit.patch: deferred GDN commit under speculative decoding.

The patch is generated, never hand-edited. Its base is pristine vLLM 0.27.1 with the series'
patches before it applied (0001 and 0082-0084 change the same files); the few changed lines
are the exact (old -> new) EDITS below, each of which must match that base exactly once, and
two new files are copied from onecard/kernels/ (gdn_defer.py -> onecard_gdn_defer.py,
gdn_defer_runtime.py -> onecard_gdn_defer_runtime.py).

  python3 scripts/make_gdn_defer_patch.py [--vllm-dir DIR] [--check]

writes the patch atomically (--check: exit 1 when the committed patch differs).
tests/test_gdn_defer_patch.py checks the committed patch equals this output.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from onecard.dflash.make_patch import _diff, edited_diffs, write_atomic  # noqa: E402

NAME = "0085-gdn-defer-commit.patch"
PATCH = REPO / "patches" / NAME
OPS = "vllm/model_executor/layers/mamba/ops"
NEW_FILES = {
    f"{OPS}/onecard_gdn_defer.py": REPO / "onecard" / "kernels" / "gdn_defer.py",
    f"{OPS}/onecard_gdn_defer_runtime.py": REPO / "onecard" / "kernels" / "gdn_defer_runtime.py",
}

HEADER = """\
Deferred GDN commit: one state block per sequence under speculative decoding (GDN_DEFER=1)

What:     With ONECARD_GDN_DEFER=1 (the launcher's GDN_DEFER=1), speculation on, on CUDA with
          the V1 runner: a Qwen3.5 Gated-DeltaNet layer asks for no per-draft state blocks
          (MambaSpec.num_speculative_blocks 0; the conv state keeps its k extra columns), its
          verify pass runs ops/onecard_gdn_defer.gdn_defer_verify (stock's math; the initial
          state from the running block, no state written, each token's normalized key,
          value, gate and beta saved in a per-layer scratch of MAX_SEQS x (1 + k) tokens),
          and _update_states_after_model_execute, once the rejection sampler has counted the
          accepted tokens, replays them onto the running block (gdn_defer_commit_all: one
          launch for every GDN layer, block ids and the boundary rule looked up in the kernel).
          With prefix caching ("align") the commit also stores the state at a cache-block
          boundary crossed by the accepted run into the block vLLM's postprocess
          would copy it to, and vLLM's temporal-state copies read the running block with no
          accepted-token offset (conv width -1 marks such a state in the fused copy kernel;
          get_temporal_copy_spec ignores the count). Between steps every state block holds
          what stock keeps in the block of the last accepted token, so prefill, prefix caching
          and preemption are unchanged. mamba_cache_mode "all" and the V2 runner: one error.
Why:      Stock keeps (1 + k) state blocks per sequence and GDN group (2 + k with prefix
          caching): at CTX=long SPEC=dflash2, k = 7, 90 of a sequence's blocks (10 groups x
          9, 17 MB each, about 1.5 GB) - the largest term of the pool after the context
          itself - and writes k + 1 states of 3.1 MB per GDN layer and step (1.2 GB per
          sequence and verify step at k = 7, 2.4 GB at DFLASH_TOKENS=15). Deferred: 20
          blocks per sequence, and one state read + one write per layer and step more than a
          plain decode step.
Test:     tests/test_gdn_defer_kernels.py (TRITON_INTERPRET=1: verify outputs == stock's
          fused_sigmoid_gating kernel, no state written; commit == stock's state at the
          accepted column, over multi-step runs with random accepted counts, boundary stores,
          padded rows, page-strided pools); tests/test_gdn_defer_patch.py (generated ==
          committed, applies on the series, the edits in place, the runner-side commit
          driven through vLLM's own block tables and align rule on the CPU); GPU:
          gpu/jobs/75-gdn-defer.sh (greedy SPEC=mtp/dflash2 == SPEC=off on the tiny model
          with GDN_DEFER=1, none and align; verify ms/step and pool tokens vs GDN_DEFER=0 on
          the 27B geometry). First GPU run (H100, 2026-12-05): job 75 exact, job 31 the same
          text, pool as predicted, 17.28 vs 17.69 ms/step at 8k (docs/measurements.md).
Upstream: not upstream (vLLM 0.27.1 stores every draft position's state). Drop if vLLM
          commits GDN states after rejection itself.
Generated: python3 scripts/make_gdn_defer_patch.py (from onecard/kernels/gdn_defer*.py)
Applies-To: vllm 0.27.1
"""

_INIT_ANCHOR = "        self.gqa_interleaved_layout = gqa_interleaved_layout\n"
_INIT_NEW = _INIT_ANCHOR + """\
        # onecard 0085: deferred GDN commit under speculation (ONECARD_GDN_DEFER=1)
        self._onecard_defer = None
        if onecard_gdn_defer_runtime.check_config(
            on_cuda=current_platform.is_cuda(),
            num_spec=self.num_spec,
            mamba_cache_mode=vllm_config.cache_config.mamba_cache_mode,
            use_v2_model_runner=vllm_config.use_v2_model_runner,
        ):
            self._onecard_defer = onecard_gdn_defer.DeferScratch(
                vllm_config.scheduler_config.max_num_seqs,
                self.num_spec + 1,
                self.num_k_heads // self.tp_size,
                self.num_v_heads // self.tp_size,
                self.head_k_dim,
                self.head_v_dim,
                vllm_config.model_config.dtype,
                torch.get_default_device(),
            )
"""

_SPEC_OLD = """\
        # 2.1: Process the multi-query part
        if spec_sequence_masks is not None:
            core_attn_out_spec, last_recurrent_state = (
"""
_SPEC_NEW = """\
        # 2.1: Process the multi-query part
        if spec_sequence_masks is not None and self._onecard_defer is not None:
            # onecard 0085: no per-token state writes; the runner commits the accepted
            # tokens after rejection (onecard_gdn_defer_runtime.commit)
            core_attn_out_spec = onecard_gdn_defer.gdn_defer_verify(
                self.A_log,
                a,
                b,
                self.dt_bias,
                query_spec,
                key_spec,
                value_spec,
                initial_state=ssm_state,
                cu_seqlens=spec_query_start_loc[  # type: ignore[index]
                    : attn_metadata.num_spec_decodes + 1
                ],
                ssm_state_indices=spec_state_indices_tensor,
                scratch=self._onecard_defer,
                use_qk_l2norm_in_kernel=True,
            )
            last_recurrent_state = None
        elif spec_sequence_masks is not None:
            core_attn_out_spec, last_recurrent_state = (
"""

# the end of _update_states_after_model_execute: the commit goes after every stock postprocess
_RUNNER_ANCHOR = (
    "            if self.cache_config.mamba_cache_mode == \"all\":\n"
    "                mamba_utils.postprocess_mamba_all(\n"
    "                    scheduler_output,\n"
    "                    self.kv_cache_config,\n"
    "                    self.input_batch,\n"
    "                    self.requests,\n"
    "                    self.mamba_state_idx,\n"
    "                    self.num_spec_tokens,\n"
    "                    num_reqs,\n"
    "                )\n"
)

EDITS: list[tuple[str, str, str]] = [
    ("vllm/model_executor/layers/mamba/abstract.py",
     "            num_speculative_blocks=(\n"
     "                vllm_config.speculative_config.num_speculative_tokens\n"
     "                if vllm_config.speculative_config\n"
     "                else 0\n"
     "            ),\n",
     "            num_speculative_blocks=(\n"
     "                # onecard 0085: a GDN layer deferring its commit keeps no per-draft state\n"
     "                0\n"
     "                if getattr(self, \"_onecard_defer\", None) is not None\n"
     "                else vllm_config.speculative_config.num_speculative_tokens\n"
     "                if vllm_config.speculative_config\n"
     "                else 0\n"
     "            ),\n"),
    ("vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py",
     "from vllm.model_executor.layers.mamba.ops.causal_conv1d import (\n"
     "    causal_conv1d_fn,\n"
     "    causal_conv1d_update,\n"
     ")\n",
     "from vllm.model_executor.layers.mamba.ops import (\n"
     "    onecard_gdn_defer,\n"
     "    onecard_gdn_defer_runtime,\n"
     ")\n"
     "from vllm.model_executor.layers.mamba.ops.causal_conv1d import (\n"
     "    causal_conv1d_fn,\n"
     "    causal_conv1d_update,\n"
     ")\n"),
    ("vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py", _INIT_ANCHOR, _INIT_NEW),
    ("vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py",
     "                query_start_loc=spec_query_start_loc,\n"
     "                max_query_len=spec_state_indices_tensor.size(-1),\n",
     "                query_start_loc=spec_query_start_loc,\n"
     "                # onecard 0085: a deferring layer's state table has one column\n"
     "                max_query_len=self.num_spec + 1\n"
     "                if self._onecard_defer is not None\n"
     "                else spec_state_indices_tensor.size(-1),\n"),
    ("vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py", _SPEC_OLD, _SPEC_NEW),
    ("vllm/v1/attention/backends/gdn_attn.py",
     "from vllm.config import VllmConfig\n",
     "from vllm.config import VllmConfig\n"
     "from vllm.model_executor.layers.mamba.ops import onecard_gdn_defer_runtime\n"),
    ("vllm/v1/attention/backends/gdn_attn.py",
     "        attn_metadata = GDNAttentionMetadata(\n",
     "        if onecard_gdn_defer_runtime.active():\n"
     "            # onecard 0085: the rows whose accepted tokens the runner commits after\n"
     "            # this step's rejection\n"
     "            onecard_gdn_defer_runtime.note_step(spec_sequence_masks, num_spec_decodes)\n"
     "        attn_metadata = GDNAttentionMetadata(\n"),
    ("vllm/model_executor/layers/mamba/mamba_utils.py",
     "    src_block_id = block_ids[cur_block_idx + num_accepted_tokens - 1]\n",
     "    from vllm.model_executor.layers.mamba.ops import onecard_gdn_defer_runtime\n"
     "\n"
     "    if onecard_gdn_defer_runtime.active():\n"
     "        # onecard 0085: a deferred GDN commit leaves the accepted state in the running\n"
     "        # block itself\n"
     "        num_accepted_tokens = 1\n"
     "    src_block_id = block_ids[cur_block_idx + num_accepted_tokens - 1]\n"),
    ("vllm/v1/worker/mamba_utils.py",
     "    actual_src_block_id = tl.load(block_table_base + src_col + token_bias).to(tl.int64)\n",
     "    # onecard 0085: conv width -1 marks a GDN state whose accepted state the deferred\n"
     "    # commit left in src_col itself\n"
     "    if conv_width < 0:\n"
     "        token_bias = token_bias * 0\n"
     "    actual_src_block_id = tl.load(block_table_base + src_col + token_bias).to(tl.int64)\n"),
    ("vllm/v1/worker/mamba_utils.py",
     "                        self.state_conv_widths[idx] = 0\n",
     "                        # onecard 0085: -1 = deferred GDN commit (no accepted offset)\n"
     "                        self.state_conv_widths[idx] = (\n"
     "                            -1\n"
     "                            if getattr(attention, \"_onecard_defer\", None) is not None\n"
     "                            else 0\n"
     "                        )\n"),
    ("vllm/v1/worker/gpu_model_runner.py", _RUNNER_ANCHOR,
     _RUNNER_ANCHOR + "\n"
     "        # onecard 0085: GDN layers deferring their commit replay the accepted tokens now,\n"
     "        # after the align postprocess (whose temporal copies the commit's boundary store\n"
     "        # overwrites)\n"
     "        self._onecard_gdn_defer_commit(num_reqs)\n"
     "\n"
     "    def _onecard_gdn_defer_commit(self, num_reqs: int) -> None:\n"
     "        from vllm.model_executor.layers.mamba.ops import (\n"
     "            onecard_gdn_defer_runtime as defer,\n"
     "        )\n"
     "\n"
     "        if not defer.active():\n"
     "            return\n"
     "        group_ids, _ = mamba_utils.get_mamba_groups(self.kv_cache_config)\n"
     "        align = None\n"
     "        if self.cache_config.mamba_cache_mode == \"align\":\n"
     "            ctx = self._get_mamba_bufs().postprocess_align\n"
     "            assert ctx is not None and ctx.mamba_state_idx_buf is not None\n"
     "            assert ctx.num_scheduled_tokens_buf is not None\n"
     "            assert ctx.num_computed_tokens_buf is not None\n"
     "            assert ctx.num_draft_tokens_buf is not None\n"
     "            align = defer.AlignInputs(\n"
     "                state_idx=ctx.mamba_state_idx_buf.gpu,\n"
     "                num_scheduled=ctx.num_scheduled_tokens_buf.gpu,\n"
     "                num_computed=ctx.num_computed_tokens_buf.gpu,\n"
     "                num_draft=ctx.num_draft_tokens_buf.gpu,\n"
     "                block_size=ctx.block_size,\n"
     "            )\n"
     "        defer.commit(\n"
     "            forward_context=self.compilation_config.static_forward_context,\n"
     "            kv_cache_config=self.kv_cache_config,\n"
     "            mamba_group_ids=group_ids,\n"
     "            block_tables=[  # whole persistent tables: the commit plan keeps their addresses\n"
     "                bt.get_device_tensor(bt.max_num_reqs)\n"
     "                for bt in (self.input_batch.block_table[gid] for gid in group_ids)\n"
     "            ],\n"
     "            num_reqs=num_reqs,\n"
     "            num_accepted=self.num_accepted_tokens.gpu,\n"
     "            align=align,\n"
     "        )\n"),
]


def _base_series(tmp: Path) -> Path:
    """A series file naming the committed series' patches that come before this one."""
    from onecard.patching import DEFAULT_SERIES

    lines = []
    for line in DEFAULT_SERIES.read_text(encoding="utf-8").splitlines():
        name = line.strip()
        if name and not name.startswith("#") and name >= NAME:
            break
        lines.append(line)
    out = tmp / "series"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    for p in DEFAULT_SERIES.parent.glob("*.patch"):
        (tmp / p.name).symlink_to(p)
    return out


def build(vllm_dir: Path) -> str:
    from onecard.patching import overlay

    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        (td / "s").mkdir()
        files = tuple(sorted({path for path, _, _ in EDITS}))
        site = overlay(vllm_dir, td / "site", series=_base_series(td / "s"), also=files)
        parts = [HEADER, "\n", *edited_diffs(site, EDITS, f"the series before {NAME}", "make_gdn_defer_patch")]
    for path, src in sorted(NEW_FILES.items()):
        parts.append(_diff(path, "", src.read_text(encoding="utf-8")))
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--vllm-dir", help="a pristine vLLM 0.27.1 package directory (default: the importable one)")
    ap.add_argument("--check", action="store_true", help="exit 1 when the committed patch differs")
    args = ap.parse_args(argv)
    from onecard.patching import locate_vllm

    text = build(locate_vllm(args.vllm_dir))
    if args.check:
        same = PATCH.is_file() and PATCH.read_text(encoding="utf-8") == text
        print(f"{PATCH.relative_to(REPO)}: {'up to date' if same else 'DIFFERS: run scripts/make_gdn_defer_patch.py'}")
        return 0 if same else 1
    write_atomic(PATCH, text)
    print(f"wrote {PATCH.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
