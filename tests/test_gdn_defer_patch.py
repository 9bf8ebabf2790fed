"""Patch 0085 (deferred GDN commit, GDN_DEFER=1) on vLLM 0.27.1's own code, on the CPU.

The patch is generated (scripts/make_gdn_defer_patch.py) and must equal its generator's output.
On a patched view of the installed vLLM, in a child process under TRITON_INTERPRET=1, one
speculative step runs twice - stock (the fused_sigmoid_gating kernel writing a state per draft
position into spec blocks, then vLLM's fused align postprocess) and deferred (gdn_defer_verify,
then vLLM's own GPUModelRunner._update_states_after_model_execute: the counts, the same
postprocess with the patch's marker, the one-launch commit) - and every block the next step or the prefix cache
reads must hold the same state: the running block == stock's block of the last accepted token,
a cache-block boundary crossed by the accepted run == stock's boundary copy, the conv window
shifted as stock shifts it. Also: MambaSpec asks for no per-draft blocks, vLLM's temporal copy
spec and fused copy kernel read the running block, the GDN metadata build hands the commit its
rows, several steps in a row stay equal to stock (mamba cache mode none).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PATCH = REPO / "patches" / "0085-gdn-defer-commit.patch"
GEN = REPO / "scripts" / "make_gdn_defer_patch.py"


def test_patch_is_generated(vllm_dir):
    p = subprocess.run([sys.executable, str(GEN), "--check", "--vllm-dir", str(vllm_dir)], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stdout + p.stderr


def test_shipped_files_are_onecards():
    text = PATCH.read_text()
    for rel, src in (("onecard_gdn_defer.py", "gdn_defer.py"), ("onecard_gdn_defer_runtime.py", "gdn_defer_runtime.py")):
        body = (REPO / "onecard" / "kernels" / src).read_text()
        head = f"+++ b/vllm/model_executor/layers/mamba/ops/{rel}\n"
        assert head in text
        hunk = text.split(head, 1)[1].split("\n--- ", 1)[0]
        added = "".join(line[1:] + "\n" for line in hunk.splitlines()[1:] if line.startswith("+"))
        assert added == body, rel


def test_test_oracles_are_not_shipped():
    """The per-layer commit, the torch boundary rule and the float64 references are test oracles
    (tests/gdn_defer_oracle.py): production runs gdn_defer_verify and gdn_defer_commit_all only."""
    text = PATCH.read_text()
    for name in ("def gdn_defer_commit(", "def _gdn_defer_commit_kernel(", "def boundary(",
                 "def gdn_defer_reference_verify(", "def gdn_defer_reference_commit(", "def _ref_step("):
        assert name not in text, name
    for name in ("def gdn_defer_verify(", "def gdn_defer_commit_all(", "class CommitPlan:", "class AlignInputs:",
                 "def _replay_accepted("):
        assert name in text, name


def test_patched_tree_has_the_edits(patched_site):
    v = patched_site / "vllm"
    assert "_onecard_defer" in (v / "model_executor/layers/mamba/abstract.py").read_text()
    gdn = (v / "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py").read_text()
    assert "onecard_gdn_defer.gdn_defer_verify(" in gdn and "onecard_gdn_defer.DeferScratch(" in gdn
    assert "onecard_gdn_defer_runtime.note_step(" in (v / "v1/attention/backends/gdn_attn.py").read_text()
    assert "self._onecard_gdn_defer_commit(num_reqs)" in (v / "v1/worker/gpu_model_runner.py").read_text()


# vLLM swaps Triton for a placeholder when no GPU driver is active: the child makes Triton's
# nvidia driver report active before vLLM is imported (as tests/test_wide_verify_patch.py does);
# kernels then run through TRITON_INTERPRET=1.
_CHILD = r'''
import os, types
os.environ["TRITON_INTERPRET"] = "1"
os.environ["ONECARD_GDN_DEFER"] = "1"
import triton.backends as _tb
_saved = {}
for _name, _b in _tb.backends.items():
    if _b.driver is not None:
        _saved[_name] = _b.driver.is_active
        _b.driver.is_active = staticmethod(lambda n=_name: n == "nvidia")
import torch
from vllm.triton_utils import HAS_TRITON
assert HAS_TRITON, "stock Triton kernels are not runnable in this child"
for _name, _f in _saved.items():   # FLA's module-level device probe must then find no driver
    _tb.backends[_name].driver.is_active = _f
from types import SimpleNamespace as NS
from vllm.model_executor.layers.mamba import mamba_utils as mmu
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.ops import onecard_gdn_defer as kd
from vllm.model_executor.layers.mamba.ops import onecard_gdn_defer_runtime as rt
from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
    fused_sigmoid_gating_delta_rule_update as stock_update)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker import mamba_utils as wmu
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

SEED = int(os.environ["SEED"])
g = torch.Generator().manual_seed(SEED)
H, HV, K, V, KSPEC, B, W = 2, 4, 16, 16, 3, 8, 3   # heads, dims, draft tokens, mamba block, conv width - 1
T = KSPEC + 1
CONV_DIM = 8


def rnd(*shape, dtype=torch.float32, scale=1.0):
    return ((torch.rand(*shape, generator=g) * 2 - 1) * scale).to(dtype)


def close(x, y, what, tol=2e-5):
    err = (x.double() - y.double()).abs().max().item()
    assert err <= tol, f"{what}: max abs error {err} > {tol} (seed {SEED})"


# 1. MambaSpec: no per-draft blocks for a deferring layer; stock count otherwise
cfg = NS(cache_config=NS(mamba_block_size=B, mamba_page_size_padded=None, mamba_cache_mode="align"),
         speculative_config=NS(num_speculative_tokens=KSPEC))
lay = NS(get_state_shape=lambda: ((W + KSPEC, CONV_DIM), (HV, V, K)),
         get_state_dtype=lambda: (torch.bfloat16, torch.float32),
         mamba_type=MambaAttentionBackendEnum.GDN_ATTN, _onecard_defer=object())
assert MambaBase.get_kv_cache_spec(lay, cfg).num_speculative_blocks == 0
lay._onecard_defer = None
assert MambaBase.get_kv_cache_spec(lay, cfg).num_speculative_blocks == KSPEC
print("OK spec")

# 2. the runtime refuses what the commit does not cover, and activates otherwise
for kw, want in ((dict(mamba_cache_mode="all", use_v2_model_runner=False), "mamba_cache_mode='all'"),
                 (dict(mamba_cache_mode="align", use_v2_model_runner=True), "V1 GPU model runner")):
    try:
        rt.check_config(on_cuda=True, num_spec=KSPEC, **kw)
    except ValueError as e:
        assert want in str(e) and "valid:" in str(e), e
    else:
        raise AssertionError(kw)
assert not rt.active()
assert rt.check_config(on_cuda=False, num_spec=KSPEC, mamba_cache_mode="none", use_v2_model_runner=False) is False
assert rt.check_config(on_cuda=True, num_spec=0, mamba_cache_mode="none", use_v2_model_runner=False) is False
assert not rt.active()
# vLLM's non-fused temporal copy spec: stock offset first, then the running block
st = torch.arange(10 * 4, dtype=torch.float32).view(10, 4)
assert mmu.get_temporal_copy_spec(st, [5, 6, 7, 8], 1, 3).start_addr == st[8].data_ptr()
assert rt.check_config(on_cuda=True, num_spec=KSPEC, mamba_cache_mode="align", use_v2_model_runner=False)
assert mmu.get_temporal_copy_spec(st, [5, 6, 7, 8], 1, 3).start_addr == st[6].data_ptr()
print("OK runtime")

# 3. one speculative step, stock vs deferred, in align mode (prefix caching) and none
# rows: (num_computed before the step, accepted count, previous step's accepted count)
ROWS = [(13, 3, 1),   # accepted run ends on a boundary (16) that is not the running block's: store it
        (20, 4, 2),   # boundary at the run's end inside the running block (src == dest)
        (9, 2, 3),    # no boundary
        (14, 4, 1),   # boundary after the 2nd of 4 accepted tokens (mid-run)
        (5, 1, 4)]    # one token accepted
N = len(ROWS)
A_log, dt_bias = rnd(HV), rnd(HV)
q, k, v = rnd(1, N * T, H, K, dtype=torch.bfloat16), rnd(1, N * T, H, K, dtype=torch.bfloat16), \
    rnd(1, N * T, HV, V, dtype=torch.bfloat16)
a_in, b_in = rnd(N * T, HV, dtype=torch.bfloat16), rnd(N * T, HV, dtype=torch.bfloat16)
cu = torch.arange(0, N * T + 1, T, dtype=torch.int32)
c = torch.tensor([r[0] for r in ROWS], dtype=torch.int32)
acc = torch.tensor([r[1] for r in ROWS], dtype=torch.int32)
prev = torch.tensor([r[2] for r in ROWS], dtype=torch.int32)
start = (c + T - 1) // B
COLS = 4   # positional columns (tokens < 32)
base = rnd(N, HV, V, K, scale=0.5)
conv0 = rnd(N, W + KSPEC, CONV_DIM, dtype=torch.bfloat16)


def make_kvc(spec_blocks, mode):
    spec = MambaSpec(block_size=B, shapes=((W + KSPEC, CONV_DIM), (HV, V, K)),
                     dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode=mode,
                     num_speculative_blocks=spec_blocks)
    return NS(kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=["l0"])])


def world(defer, mode):
    """Pools and block tables; the base state where each world's step reads it."""
    extra = 0 if defer else KSPEC
    ncols = (COLS if mode == "align" else 1) + extra
    nb = 1 + N * ncols
    bt = (1 + torch.arange(N * ncols, dtype=torch.int32)).view(N, ncols)
    ssm = torch.full((nb, HV, V, K), float("nan"))
    conv = torch.zeros(nb, W + KSPEC, CONV_DIM, dtype=torch.bfloat16)
    col0 = start if mode == "align" else torch.zeros_like(start)
    for r in range(N):
        off = 0 if defer else int(prev[r]) - 1   # stock reads the previous step's accepted column
        ssm[bt[r, col0[r] + off]] = base[r]
        conv[bt[r, col0[r]]] = conv0[r]
    idx = torch.stack([bt[r, col0[r]:col0[r] + 1 + extra] for r in range(N)])
    layer = NS(kv_cache=[conv, ssm], _onecard_defer=None)
    return layer, bt, idx, col0


def buf(*size, dtype):
    return CpuGpuBuffer(*size, dtype=dtype, device=torch.device("cpu"), pin_memory=False)


def align_ctx(layer, kvc, bt):
    ctx = wmu.MambaSpecDecodeGPUContext.create(max_num_reqs=N, kv_cache_config=kvc, num_state_types=2,
                                               device=torch.device("cpu"), make_buffer=buf)
    ctx.initialize_from_forward_context(kvc, {"l0": layer}, (mmu.get_conv_copy_spec, mmu.get_temporal_copy_spec), [bt])
    for name, val in (("mamba_state_idx_buf", start), ("num_scheduled_tokens_buf", torch.full((N,), T)),
                      ("num_computed_tokens_buf", c), ("num_draft_tokens_buf", torch.full((N,), T - 1))):
        getattr(ctx, name).gpu[:N] = val.to(torch.int32)
    return ctx


def postprocess(ctx):
    ctx.run_fused_postprocess(num_reqs=N, num_accepted_tokens_gpu=acc.clone(),
                              mamba_state_idx_gpu=ctx.mamba_state_idx_buf.gpu,
                              num_scheduled_tokens_gpu=ctx.num_scheduled_tokens_buf.gpu,
                              num_computed_tokens_gpu=ctx.num_computed_tokens_buf.gpu,
                              num_draft_tokens_gpu=ctx.num_draft_tokens_buf.gpu)
    return ctx.num_accepted_tokens_out[:N].clone()


def fake_runner(layer, kvc, bt, mode, ctx=None):
    """What GPUModelRunner._update_states_after_model_execute and the commit read of self."""
    fake = NS(kv_cache_config=kvc, cache_config=NS(mamba_cache_mode=mode),
              speculative_config=NS(num_speculative_tokens=KSPEC), model_config=NS(is_hybrid=True),
              _get_mamba_bufs=lambda: NS(postprocess_align=ctx),
              input_batch=NS(block_table={0: NS(get_device_tensor=lambda n: bt[:n], max_num_reqs=bt.shape[0])},
                             num_accepted_tokens_cpu_tensor=torch.zeros(N + 3, dtype=torch.int32)),
              compilation_config=NS(static_forward_context={"l0": layer}),
              model=NS(get_mamba_state_copy_func=lambda: (mmu.get_conv_copy_spec, mmu.get_temporal_copy_spec)),
              num_accepted_tokens_event=NS(record=lambda: None),
              num_accepted_tokens=NS(gpu=torch.zeros(N + 3, dtype=torch.int32)))
    fake._onecard_gdn_defer_commit = lambda n: GPUModelRunner._onecard_gdn_defer_commit(fake, n)
    return fake


def sampled(acc):
    """The rejection sampler's output rows for these accepted counts (-1 past them)."""
    out = torch.full((len(acc), T), -1, dtype=torch.int64)
    for r, a in enumerate(acc.tolist()):
        out[r, :a] = 11
    return out


for mode in ("align", "none"):
    rt.reset()
    assert rt.check_config(on_cuda=True, num_spec=KSPEC, mamba_cache_mode=mode, use_v2_model_runner=False)
    kvc_s, kvc_d = make_kvc(KSPEC, mode), make_kvc(0, mode)
    ls, bt_s, idx_s, col0 = world(False, mode)
    ld, bt_d, idx_d, _ = world(True, mode)
    ld._onecard_defer = kd.DeferScratch(N + 2, T, H, HV, K, V, torch.bfloat16, torch.device("cpu"))
    o_s, _ = stock_update(A_log=A_log, a=a_in, b=b_in, dt_bias=dt_bias, q=q, k=k, v=v,
                          initial_state=ls.kv_cache[1], inplace_final_state=True, cu_seqlens=cu,
                          ssm_state_indices=idx_s, num_accepted_tokens=prev, use_qk_l2norm_in_kernel=True)
    before = ld.kv_cache[1].clone()
    o_d = kd.gdn_defer_verify(A_log, a_in, b_in, dt_bias, q, k, v, initial_state=ld.kv_cache[1], cu_seqlens=cu,
                              ssm_state_indices=idx_d, scratch=ld._onecard_defer, use_qk_l2norm_in_kernel=True)
    assert torch.equal(before.nan_to_num(7.0), ld.kv_cache[1].nan_to_num(7.0)), "verify wrote a state"
    close(o_d, o_s, f"{mode}: verify outputs")
    ctx_d = None
    if mode == "align":
        out_s = postprocess(align_ctx(ls, kvc_s, bt_s))
        ctx_d = align_ctx(ld, kvc_d, bt_d)
        assert ctx_d.state_conv_widths.tolist() == [W + KSPEC, -1]   # the marker on the temporal state
    # the build of the step hands the commit its rows (all spec rows here); then vLLM's own
    # _update_states_after_model_execute: counts, align postprocess, the commit
    rt.note_step(torch.ones(N + 2, dtype=torch.bool), N)
    fake = fake_runner(ld, kvc_d, bt_d, mode, ctx_d)
    GPUModelRunner._update_states_after_model_execute(fake, sampled(acc), None)
    assert rt._STATE.spec_mask is None   # consumed
    assert torch.equal(fake.num_accepted_tokens.gpu[:N], acc)
    if mode == "align":   # the next step's counts are stock's
        assert torch.equal(fake.input_batch.num_accepted_tokens_cpu_tensor[:N], out_s), out_s
    ssm_s, ssm_d = ls.kv_cache[1], ld.kv_cache[1]
    stored = 0
    for r in range(N):
        close(ssm_d[bt_d[r, col0[r]]], ssm_s[bt_s[r, col0[r] + acc[r] - 1]], f"{mode} row {r}: committed state")
        if mode == "align":
            new = int(c[r] + acc[r])
            aligned = new // B * B
            dest = aligned // B - 1
            if aligned >= c[r] + 1 and dest != start[r]:
                close(ssm_d[bt_d[r, dest]], ssm_s[bt_s[r, dest]], f"row {r}: boundary block {dest}")
                stored += 1
            for col in range(COLS):   # conv windows: stock's shifts, untouched by the patch
                assert torch.equal(ld.kv_cache[0][bt_d[r, col]], ls.kv_cache[0][bt_s[r, col]]), (r, col)
    if mode == "align":
        assert stored == 2, stored
        # the next step moved to a new block: vLLM's fused pre-copy (src column + accepted
        # offset in stock) must carry the committed state and the shifted conv window over
        src_col = start.to(torch.int32)
        dst_col = src_col + 1
        ctx_s = align_ctx(ls, kvc_s, bt_s)
        for ctx, layer, bt in ((ctx_s, ls, bt_s), (ctx_d, ld, bt_d)):
            ctx.run_fused_precopy(num_reqs=N, state_idx_gpu=dst_col, src_col_gpu=src_col,
                                  token_bias_gpu=acc - 1, idx_mapping=None)
        for r in range(N):
            dst = int(dst_col[r])
            close(ld.kv_cache[1][bt_d[r, dst]], ls.kv_cache[1][bt_s[r, dst]], f"row {r}: pre-copied state")
            assert torch.equal(ld.kv_cache[0][bt_d[r, dst]], ls.kv_cache[0][bt_s[r, dst]]), r
    print(f"OK step {mode}")

# 4. several steps in a row (mode none): the deferred world stays equal to stock
rt.reset()
assert rt.check_config(on_cuda=True, num_spec=KSPEC, mamba_cache_mode="none", use_v2_model_runner=False)
ls, bt_s, idx_s, _ = world(False, "none")
ld, bt_d, idx_d, _ = world(True, "none")
for r in range(N):   # both start from the base state in column 0
    ls.kv_cache[1][bt_s[r, 0]] = base[r]
kvc_d = make_kvc(0, "none")
ld._onecard_defer = kd.DeferScratch(N, T, H, HV, K, V, torch.bfloat16, torch.device("cpu"))
prev_acc = torch.ones(N, dtype=torch.int32)
for step in range(4):
    q, k, v = rnd(1, N * T, H, K, dtype=torch.bfloat16), rnd(1, N * T, H, K, dtype=torch.bfloat16), \
        rnd(1, N * T, HV, V, dtype=torch.bfloat16)
    a_in, b_in = rnd(N * T, HV, dtype=torch.bfloat16), rnd(N * T, HV, dtype=torch.bfloat16)
    o_s, _ = stock_update(A_log=A_log, a=a_in, b=b_in, dt_bias=dt_bias, q=q, k=k, v=v,
                          initial_state=ls.kv_cache[1], inplace_final_state=True, cu_seqlens=cu,
                          ssm_state_indices=idx_s, num_accepted_tokens=prev_acc, use_qk_l2norm_in_kernel=True)
    o_d = kd.gdn_defer_verify(A_log, a_in, b_in, dt_bias, q, k, v, initial_state=ld.kv_cache[1], cu_seqlens=cu,
                              ssm_state_indices=idx_d, scratch=ld._onecard_defer, use_qk_l2norm_in_kernel=True)
    close(o_d, o_s, f"step {step}: outputs", tol=5e-5)
    acc = 1 + torch.randint(0, T, (N,), generator=g, dtype=torch.int32)
    rt.note_step(torch.ones(N, dtype=torch.bool), N)
    GPUModelRunner._update_states_after_model_execute(fake_runner(ld, kvc_d, bt_d, "none"), sampled(acc), None)
    prev_acc = acc
for r in range(N):
    close(ld.kv_cache[1][bt_d[r, 0]], ls.kv_cache[1][bt_s[r, acc[r] - 1]], f"row {r} after 4 steps", tol=5e-5)
print("OK steps")

# 5. rows without drafts in the batch (a prefill row beside spec rows) are not committed
rt.note_step(torch.tensor([True, False, True, False, False]), 2)
keep = ld.kv_cache[1].clone()
GPUModelRunner._update_states_after_model_execute(fake_runner(ld, kvc_d, bt_d, "none"), sampled(acc), None)
changed = [r for r in range(N) if not torch.equal(ld.kv_cache[1][bt_d[r, 0]], keep[bt_d[r, 0]])]
assert changed == [0, 2] or all(acc[r] == 0 for r in (0, 2)), changed
rt.note_step(None, 0)
assert rt.commit(forward_context={}, kv_cache_config=None, mamba_group_ids=[0], block_tables=[],
                 num_reqs=N, num_accepted=acc) is False   # no spec rows this step: nothing launched
print("OK rows")

# 6. the GDN metadata build (vLLM's builder, patch 0082's shared path): hands the commit the rows
# that verify a draft block, and its spec state table has the one running column (in FULL-graph
# buffers every column holds it)
import itertools
import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as qg
import vllm.utils.torch_utils as tu
import vllm.v1.attention.backends.utils as bu
import vllm.v1.attention.backends.gdn_attn as ga
from vllm.v1.attention.backend import CommonAttentionMetadata

qg._resolve_gdn_prefill_backend = lambda cfg: ("triton", "triton")
tu.PIN_MEMORY = bu.PIN_MEMORY = False   # CPU: no pinned host memory to stage through
for mode in ("none", "align"):
    for full in (True, False):
        rt.reset()
        assert rt.check_config(on_cuda=True, num_spec=KSPEC, mamba_cache_mode=mode, use_v2_model_runner=False)
        cfg = NS(compilation_config=NS(cudagraph_mode=NS(has_full_cudagraphs=lambda f=full: f),
                                       max_cudagraph_capture_size=None),
                 speculative_config=NS(num_speculative_tokens=KSPEC, parallel_drafting=False),
                 scheduler_config=NS(max_num_seqs=8), cache_config=NS(mamba_cache_mode=mode),
                 parallel_config=NS(decode_context_parallel_size=1), additional_config={})
        spec = MambaSpec(block_size=B, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode=mode,
                         num_speculative_blocks=0)
        bld = ga.GDNAttentionMetadataBuilder(spec, ["l0"], cfg, torch.device("cpu"))
        for q_lens, drafts in (([T, T, T], [KSPEC] * 3), ([T, 7, T], [KSPEC, -1, KSPEC]), ([5, 3], [-1, -1])):
            n = len(q_lens)
            seq_lens = [40 + 3 * i for i in range(n)]
            bt = torch.randint(1, 1000, (n, 60 // B + 1 if mode == "align" else 1), dtype=torch.int32)
            cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
            sl = torch.tensor(seq_lens, dtype=torch.int32)
            m = CommonAttentionMetadata(
                query_start_loc=cu, query_start_loc_cpu=cu.clone(), seq_lens=sl, num_reqs=n,
                num_actual_tokens=int(cu[-1]), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                block_table_tensor=bt, slot_mapping=torch.zeros(int(cu[-1]), dtype=torch.int64), causal=True,
                _seq_lens_cpu=sl.clone(), _num_computed_tokens_cpu=sl - torch.tensor(q_lens, dtype=torch.int32))
            md = bld.build(0, m, num_accepted_tokens=torch.ones(n, dtype=torch.int32),
                           num_decode_draft_tokens_cpu=torch.tensor(drafts, dtype=torch.int32))
            want = torch.tensor([d >= 0 for d in drafts])
            if not want.any():
                assert rt._STATE.spec_mask is None and md.spec_state_indices_tensor is None
                continue
            assert torch.equal(rt._STATE.spec_mask[:n].cpu(), want), (mode, full, drafts)
            col = (sl - 1) // B if mode == "align" else torch.zeros(n, dtype=torch.int64)
            run = bt[torch.arange(n), col.long()][want]
            idx = md.spec_state_indices_tensor[: int(want.sum())]
            assert torch.equal(idx[:, 0], run), (mode, full, idx, run)
            assert all(torch.equal(idx[:, c], run) for c in range(idx.shape[1])), idx
print("OK build")
'''


def test_one_step_stock_vs_deferred(patched_site, gen):
    pytest.importorskip("triton")
    seed = int(torch_seed(gen))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(patched_site), str(REPO)]), "SEED": str(seed),
           "TRITON_INTERPRET": "1", "ONECARD_GDN_DEFER": "1"}
    p = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600,
                       cwd=str(REPO))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    for name in ("spec", "runtime", "step align", "step none", "steps", "rows", "build"):
        assert f"OK {name}" in p.stdout, out
    # the server log says the scheme is on, and what the commit covers
    assert "onecard 0085: ONECARD_GDN_DEFER=1: Gated-DeltaNet layers keep one state block" in out, out
    assert "onecard 0085: GDN commit plan: 1 layers in 1 KV cache groups" in out, out


def torch_seed(gen) -> int:
    return gen.initial_seed()
