"""Run INSIDE a patched overlay of vLLM 0.27.1 (PYTHONPATH=<overlay>:<repo>); prints one JSON
object of named results for tests/dflash/test_patch.py. Argument: JSON {"drafter": dir,
"target": dir} (the tiny DFlash2 drafter and a text-only target config for SpeculativeConfig).

Compares what patch 0080 ships (vllm/v1/spec_decode/dflash2_lane.py, the conv of
qwen3_dflash2.py, DFlash2Proposer's block assembly) with onecard.dflash's reference."""
from __future__ import annotations

import json
import random
import sys
import types

import torch

ARGS = json.loads(sys.argv[1])
R: dict[str, object] = {}


def check(name, fn):
    try:
        R[name] = fn()
    except Exception as e:  # noqa: BLE001 - reported, asserted on by the test
        R[name] = f"ERROR {type(e).__name__}: {e}"


torch.manual_seed(0)
from onecard.dflash import drafter as ref_drafter  # noqa: E402
from onecard.dflash import lookup as ref_lookup  # noqa: E402
from onecard.dflash import select as ref_select  # noqa: E402
from onecard.dflash.config import DrafterConfig  # noqa: E402
from vllm.v1.spec_decode import dflash2_lane as lane  # noqa: E402


def walk_equal():
    out = []
    for sampled in (False, True):
        b, t, k, r, v = 5, 7, 8, 16, 300
        unary = torch.randn(b, t, k).sort(-1, descending=True).values
        cand = torch.stack([torch.randperm(v)[:k] for _ in range(b * t)]).view(b, t, k)
        hproj = torch.randn(b, t, r)
        anchors = torch.randint(0, v, (b,))
        pred, succ = torch.randn(v, r), torch.randn(v, r)
        temp = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.0]) if sampled else None
        uni = torch.rand(b, t, dtype=torch.float64) if sampled else None
        got, gp = lane.selector_walk(unary, cand, hproj, anchors, pred, succ, temp, uni)
        want, wp = ref_select.selector_walk_batched(
            unary, cand, hproj, anchors, pred, succ, temperature=temp, uniforms=uni)
        ok = torch.equal(got, want)
        if sampled:
            rows = temp > 0
            ok = ok and torch.allclose(gp[rows], wp[rows].float(), atol=1e-6)
            # greedy rows of a mixed batch carry a one-hot q at their pick
            ok = ok and bool((gp[~rows].sum(-1) == 1).all())
            q = lane.candidate_probs_to_rows(cand, gp, v)
            ok = ok and torch.allclose(q.sum(-1), torch.ones(b, t), atol=1e-5)
            ok = ok and bool((q.gather(2, got.unsqueeze(-1)).squeeze(-1) > 0).all())
        out.append(ok)
    return out


def lane_equal():
    rng = random.Random(1)
    bad = 0
    for trial in range(60):
        vocab = rng.choice([3, 5, 20])
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(0, 200))]
        a = lane.LookupLane(key_len=2, max_match=16)
        b = ref_lookup.LookupLane(key_len=2, max_match=16)
        for i, tok in enumerate(seq):
            a.append(tok)
            b.append(tok)
            if i % 7 == 0:
                drafts = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
                cap, room = rng.randrange(0, 9), rng.choice([None, 3, 100])
                if a.propose(drafts, cap=cap, room=room) != b.propose(drafts, cap=cap, room=room):
                    bad += 1
    return bad


def lanebook():
    book = lane.LaneBook()
    lb = book.lane("r1", lambda: [1, 2, 3, -1, -1])
    again = book.lane("r1", lambda: [9])
    book.prune(lambda r: r != "r1")
    return [lb.ids, again is lb, "r1" in book.lanes]


def assemble():
    return [lane.assemble_block([5, 6, 7], [8, 9], 7), lane.assemble_block([5, 6, 7], [], 5),
            lane.assemble_block([5, 6, 7, 8], [1, 2], 4)]


def conv_equal():
    from vllm.model_executor.models import qwen3_dflash2 as m

    cfg = DrafterConfig.load(ARGS["drafter"])
    w = ref_drafter.load_weights(ARGS["drafter"], cfg, dtype=torch.float64)
    name = "layers.0.attention_conv"
    rows, blocks = 8, 3
    h = torch.randn(rows * blocks, cfg.hidden_size, dtype=torch.float64)
    fake = types.SimpleNamespace(kernel=cfg.conv_kernel_size, group_size=cfg.conv_group_size,
                                 groups=cfg.conv_groups, base_kernel=w[name + ".base_kernel"])
    fake.kernel_projection = lambda x: x @ w[name + ".kernel_projection.weight"].T
    c_in, c_out = m.DFlash2BlockConv.coefficients(fake, h)
    ok = True
    for blk in range(blocks):
        hb = h[blk * rows:(blk + 1) * rows]
        r_in, r_out = ref_drafter.conv_coefficients(w, name, hb, cfg)
        sl = slice(blk * rows, (blk + 1) * rows)
        ok = ok and torch.allclose(c_in[sl], r_in) and torch.allclose(c_out[sl], r_out)
        got = m.block_conv(h, c_in, rows)[sl]
        ok = ok and torch.allclose(got, ref_drafter.block_conv(hb, r_in))
    return ok


def proposer_extend():
    """DFlash2Proposer._extend/_lookup_rows on a fake runner: drafter rows + lookup + fill,
    q rows extended with one-hot rows."""
    from vllm.v1.spec_decode.dflash2 import DFlash2Proposer

    p = object.__new__(DFlash2Proposer)
    p.lookup_enabled = True
    p.lanes = lane.LaneBook()
    p.max_model_len = 1000
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    state = types.SimpleNamespace(prompt_token_ids=prompt, output_token_ids=[])
    other = types.SimpleNamespace(prompt_token_ids=[1, 2, 3], output_token_ids=[])
    p.runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(req_ids=["a", "b"]),
        requests={"a": state, "b": other})
    # this step: request a accepted [10, 11] after its prompt; b accepted nothing new
    p._sampled = torch.tensor([[10, 11, -1], [-1, -1, -1]])
    p._valid_counts = torch.tensor([2, 0])
    drafts = torch.tensor([[12, 13, 14], [7, 7, 8]])
    v = 40
    p._last_draft_probs = lane.one_hot_rows(drafts, v)
    full = p._extend(drafts, 7)
    q = p._last_draft_probs
    lane_a = p.lanes.lanes["a"].ids
    # without lookup: the last draft repeated
    p2 = object.__new__(DFlash2Proposer)
    p2.lookup_enabled, p2.runner, p2._last_draft_probs = False, None, None
    plain = p2._extend(drafts, 5)
    return [full.tolist(), list(q.shape), bool((q.argmax(-1) == full).all()), lane_a[-3:],
            plain.tolist()]


def proposer_sample():
    """DFlash2Proposer._sample_draft_tokens (lm_head -> top-k -> walk) on a fake model equals
    onecard.dflash.select.draft_from_pass per request (greedy), and the sampled walk's q rows
    sum to 1 with the draft inside its support."""
    from vllm.v1.spec_decode.dflash2 import DFlash2Proposer

    cfg = DrafterConfig.load(ARGS["drafter"])
    w = ref_drafter.load_weights(ARGS["drafter"], cfg, dtype=torch.float32)
    v, hsz, rows, b = cfg.vocab_size, cfg.hidden_size, 7, 3
    lm_head = torch.randn(v, hsz) / hsz ** 0.5
    sel = types.SimpleNamespace(
        hidden_projection=lambda h: h @ w["candidate_selector.hidden_projection.weight"].T,
        predecessor_codebook=w["candidate_selector.predecessor_codebook"],
        successor_codebook=w["candidate_selector.successor_codebook"])
    p = object.__new__(DFlash2Proposer)
    p.model = types.SimpleNamespace(compute_logits=lambda h: h @ lm_head.T,
                                    model=types.SimpleNamespace(candidate_selector=sel))
    p.selector_top_k = cfg.selector_top_k
    p.num_speculative_tokens = rows
    p._enable_probabilistic_draft_probs = False
    anchors = torch.randint(0, v, (b,))
    p._anchors = anchors.to(torch.int32)
    hidden = torch.randn(b * rows, hsz)
    md = types.SimpleNamespace(all_greedy=True, temperature=None)
    toks, probs = p._sample_draft_tokens(hidden, md)
    ok = probs is None and list(toks.shape) == [b * rows]
    for i in range(b):
        h_i = torch.cat([torch.zeros(1, hsz), hidden[i * rows:(i + 1) * rows]])
        ref = ref_select.draft_from_pass(cfg, w, h_i, h_i[1:] @ lm_head.T, int(anchors[i]))
        ok = ok and toks[i * rows:(i + 1) * rows].tolist() == ref.tokens.tolist()
    p._enable_probabilistic_draft_probs = True
    md = types.SimpleNamespace(all_greedy=False, temperature=torch.tensor([0.0, 0.8, 1.0]))
    toks, probs = p._sample_draft_tokens(hidden, md)
    ok = ok and list(probs.shape) == [b * rows, v]
    ok = ok and torch.allclose(probs.sum(-1), torch.ones(b * rows), atol=1e-5)
    ok = ok and bool((probs.gather(1, toks.unsqueeze(1)) > 0).all())
    return ok


def spec_config():
    import vllm.config.device as device

    device.DeviceConfig.__post_init__ = lambda self: None
    from vllm.config import ModelConfig
    from vllm.config.parallel import ParallelConfig
    from vllm.config.speculative import SpeculativeConfig

    tgt = ModelConfig(model=ARGS["target"], skip_tokenizer_init=True, max_model_len=2048)

    def make(**kw):
        base = dict(method="dflash2", model=ARGS["drafter"], num_speculative_tokens=7,
                    target_model_config=tgt, target_parallel_config=ParallelConfig())
        base.update(kw)
        return SpeculativeConfig(**base)

    out = {}
    for k in (7, 15):
        sc = make(num_speculative_tokens=k, dflash2_lookup=(k == 15))
        out[f"ok{k}"] = [sc.method, sc.dflash2, sc.num_speculative_tokens, sc.parallel_drafting,
                         sc.use_dflash(), sc.dflash2_lookup,
                         sc.draft_model_config.hf_config.dflash_config.get("causal")]
    errors = {}
    for name, kw in {"k16": dict(num_speculative_tokens=16),
                     "key_len": dict(dflash2_lookup_key_len=0),
                     "max_match": dict(dflash2_lookup_max_match=99),
                     "no_model": dict(model=None),
                     "lookup_without_dflash2": dict(method="ngram", model=None,
                                                   prompt_lookup_max=3,
                                                   dflash2_lookup=False)}.items():
        try:
            make(**kw)
            errors[name] = "ACCEPTED"
        except Exception as e:  # noqa: BLE001
            # pydantic wraps our one-line ValueError; keep the line that carries it
            lines = [ln for ln in str(e).splitlines() if "speculative_config:" in ln]
            errors[name] = lines[0].split("Value error, ", 1)[-1] if lines else str(e)
    out["errors"] = errors
    # the speculative configs the launcher goldens and the GPU job emit, as vLLM builds them
    built = []
    for cfg in ARGS.get("configs", []):
        sc = make(**{**cfg, "model": ARGS["drafter"]})
        built.append([sc.method, sc.dflash2, sc.num_speculative_tokens, sc.dflash2_lookup,
                      sc.draft_sample_method])
    out["configs"] = built
    return out


def model_forward():
    """DFlash2Qwen3ForCausalLM built by vLLM's code (attention swapped for a plain non-causal
    block attention: no backend on CPU), the tiny drafter loaded through its load_weights, run
    in float32 with every CustomOp on forward_native: the final hidden rows equal
    onecard.dflash.drafter.forward with an empty context, for two requests of 1 + rows rows."""
    import math
    import os
    import socket

    import vllm.config.device as device

    device.DeviceConfig.__post_init__ = lambda self: None
    from safetensors.torch import load_file

    import vllm.model_executor.models.qwen3_dflash as q
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.config.parallel import ParallelConfig
    from vllm.config.speculative import SpeculativeConfig
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.custom_op import CustomOp

    tgt = ModelConfig(model=ARGS["target"], skip_tokenizer_init=True, max_model_len=2048)
    sc = SpeculativeConfig(method="dflash2", model=ARGS["drafter"], num_speculative_tokens=15,
                           target_model_config=tgt, target_parallel_config=ParallelConfig())
    vc = VllmConfig(model_config=tgt, speculative_config=sc)
    cfg = DrafterConfig.load(ARGS["drafter"])
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rows = 1 + min(15, cfg.block_size - 1)

    class BlockAttention(torch.nn.Module):
        def __init__(self, *a, **k):
            super().__init__()

        def forward(self, qq, kk, vv):
            n = qq.shape[0]
            qq = qq.view(n // rows, rows, nh, hd)
            kk = kk.view(n // rows, rows, nkv, hd).repeat_interleave(nh // nkv, 2)
            vv = vv.view(n // rows, rows, nkv, hd).repeat_interleave(nh // nkv, 2)
            sc_ = torch.einsum("bqhd,bkhd->bhqk", qq, kk) / math.sqrt(hd)
            return torch.einsum("bhqk,bkhd->bqhd", sc_.softmax(-1), vv).reshape(n, nh * hd)

    q.Attention = BlockAttention
    with socket.socket() as s_:
        s_.bind(("127.0.0.1", 0))
        port = s_.getsockname()[1]
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
        from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

        m = DFlash2Qwen3ForCausalLM(vllm_config=vc, prefix="draft")
        w = load_file(os.path.join(ARGS["drafter"], "model.safetensors"))
        m.load_weights(w.items())
        params = dict(m.named_parameters())
        loaded = torch.equal(params["model.candidate_selector.successor_codebook"].data,
                             w["candidate_selector.successor_codebook"])
        m = m.float()
        for mod in m.modules():
            if isinstance(mod, CustomOp):
                mod._forward_method = mod.forward_native
        emb = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.5
        m.model.embed_tokens.weight.data.copy_(emb)
        anchors = [5, 77]
        ids = torch.tensor([a if j == 0 else cfg.mask_token_id for a in anchors
                            for j in range(rows)])
        pos = torch.arange(rows).repeat(len(anchors))
        with torch.no_grad():
            got = q.DFlashQwen3Model.forward(m.model, ids, pos)
    wts = {k: v.float() for k, v in w.items()}
    worst = 0.0
    for i, a in enumerate(anchors):
        ref = ref_drafter.forward(cfg, wts, target_hidden=torch.zeros(0, cfg.fc_in),
                                  block_ids=ref_drafter.block_ids_for(cfg, a, rows),
                                  block_start=0, embed=emb,
                                  lm_head=torch.zeros(1, cfg.hidden_size))
        worst = max(worst, (got[i * rows:(i + 1) * rows] - ref.hidden).abs().max().item())
    # the proposer's constructor on this config (CPU: no pinned memory)
    import vllm.v1.spec_decode.llm_base_proposer as lbp
    from vllm.v1.spec_decode.dflash2 import DFlash2Proposer

    lbp.PIN_MEMORY = False
    with set_current_vllm_config(vc):
        prop = DFlash2Proposer(vc, torch.device("cpu"), runner="RUNNER")
    prop_state = [prop.block_rows, prop.selector_top_k, prop.lookup_enabled,
                  prop.num_speculative_tokens, prop.runner, prop.parallel_drafting,
                  prop.dflash_causal]
    return [type(m.model).__name__, m.model.layers[0].block_rows, loaded, worst, prop_state]


check("walk_equal", walk_equal)
check("lane_mismatches", lane_equal)
check("lanebook", lanebook)
check("assemble", assemble)
check("conv_equal", conv_equal)
check("proposer_extend", proposer_extend)
check("proposer_sample", proposer_sample)
if ARGS.get("target"):
    check("spec_config", spec_config)
    check("model_forward", model_forward)
print("PATCH_CHECK " + json.dumps(R, default=str))
