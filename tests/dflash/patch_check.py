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

    def proposer(mode):
        p = object.__new__(DFlash2Proposer)
        p.lookup_enabled = True
        p.lanes = lane.LaneBook()
        p.lane_mode, p.device_lane = mode, None
        p.vllm_config = types.SimpleNamespace(
            scheduler_config=types.SimpleNamespace(max_num_seqs=4))
        p.speculative_config = types.SimpleNamespace(num_speculative_tokens=7)
        p.block_rows, p.device = 3, torch.device("cpu")
        p.max_model_len = 1000
        prompt = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
        state = types.SimpleNamespace(prompt_token_ids=prompt, output_token_ids=[])
        other = types.SimpleNamespace(prompt_token_ids=[1, 2, 3], output_token_ids=[])
        p.runner = types.SimpleNamespace(
            input_batch=types.SimpleNamespace(req_ids=["a", "b"]),
            requests={"a": state, "b": other})
        return p

    def step(p, sampled, valid, drafts):
        p._sampled, p._valid_counts = sampled, valid
        # what prepare_next_token_ids_padded / _cpu do for the device lane
        p._lane_feed(sampled, valid, p.runner.requests, p.runner.input_batch)
        p._last_draft_probs = lane.one_hot_rows(drafts, v)
        return p._extend(drafts, 7)

    v = 40
    p, pd = proposer("host"), proposer("device")
    # this step: request a accepted [10, 11] after its prompt; b accepted nothing new
    sampled, valid = torch.tensor([[10, 11, -1], [-1, -1, -1]]), torch.tensor([2, 0])
    drafts = torch.tensor([[12, 13, 14], [7, 7, 8]])
    full = step(p, sampled, valid, drafts)
    q = p._last_draft_probs
    lane_a = list(p.lanes.lanes["a"].ids)
    # the device lane picks the same tokens, this step and the next (the host path's list
    # form of sampled ids included), without a host lane
    same = [step(pd, sampled, valid, drafts).tolist() == full.tolist(),
            bool((pd._last_draft_probs == q).all()), not pd.lanes.lanes]
    nxt = ([[12, 13], [1, 2]], None, torch.tensor([[20, 21, 22], [3, 1, 2]]))
    same.append(step(pd, *nxt).tolist() == step(p, *nxt).tolist())
    # the CPU path runs after vLLM's bookkeeping: a request seen for the first time already has
    # this step's token in its outputs, so seeding covers it and nothing is appended twice
    pc = proposer("device")
    pc.runner.requests["a"].output_token_ids = [9]
    pc._lane_feed([[9], []], None, pc.runner.requests, pc.runner.input_batch)
    lane_c = pc.device_lane
    slot = lane_c.slots.owner["a"]
    same.append(lane_c.hist[slot, :15].tolist() == list(range(10, 23)) + [9, 0]
                and int(lane_c.count[slot]) == 14)
    pc._lane_feed([[9, 4], [5]], None, pc.runner.requests, pc.runner.input_batch)
    same.append(int(lane_c.count[slot]) == 16 and int(lane_c.count[lane_c.slots.owner["b"]]) == 4)
    # the host lane (LOOKUP_LANE=host) on the same CPU-path first step: no double count either
    ph = proposer("host")
    ph.runner.requests["a"].output_token_ids = [9]
    ph._sampled, ph._valid_counts = [[9], []], None
    ph._lookup_rows(torch.tensor([[1, 2, 3], [4, 5, 6]]), 7)
    same.append(ph.lanes.lanes["a"].ids == list(range(10, 23)) + [9])
    # without lookup: the last draft repeated
    p2 = object.__new__(DFlash2Proposer)
    p2.lookup_enabled, p2.runner, p2._last_draft_probs = False, None, None
    plain = p2._extend(drafts, 5)
    return [full.tolist(), list(q.shape), bool((q.argmax(-1) == full).all()), lane_a[-3:],
            plain.tolist(), same]


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


def block_attention(cfg, rows: int) -> type:
    """A stand-in for vLLM's Attention on CPU (no backend here): plain non-causal attention inside
    each request's block of ``rows`` query rows, GQA over the drafter's heads."""
    import math

    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

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

    return BlockAttention


def model_forward():
    """DFlash2Qwen3ForCausalLM built by vLLM's code (attention swapped for a plain non-causal
    block attention: no backend on CPU), the tiny drafter loaded through its load_weights, run
    in float32 with every CustomOp on forward_native: the final hidden rows equal
    onecard.dflash.drafter.forward with an empty context, for two requests of 1 + rows rows."""
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
    rows = 1 + min(15, cfg.block_size - 1)
    q.Attention = block_attention(cfg, rows)
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
        # names stored under a "model." prefix (0.27.1's DFlash loader alone would refuse them)
        m2 = DFlash2Qwen3ForCausalLM(vllm_config=vc, prefix="draft2")
        m2.load_weights(("model." + k, v) for k, v in w.items())
        p2 = dict(m2.named_parameters())
        # (embed_tokens and lm_head are the target's, shared at load_model: uninitialized here)
        prefixed = sorted(p2) == sorted(params) and all(
            torch.equal(p2[n], params[n]) for n in params
            if not n.endswith(("embed_tokens.weight", "lm_head.weight")))
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
    return [type(m.model).__name__, m.model.layers[0].block_rows, loaded, worst, prop_state, prefixed]


def _fp8_block_dequant(w: torch.Tensor) -> torch.Tensor:
    """w through FP8 e4m3 with one scale per 128 x 128 block, back in float64: the reference for
    vLLM's online fp8_per_block, written here. The scale is amax / 448 and the quantized value
    float32 w * (1 / scale), as vLLM computes them: bf16 weights often sit exactly halfway
    between two FP8 values, so x / scale in float64 rounds some of them the other way."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.float64)
    for i in range(0, n, 128):
        for j in range(0, k, 128):
            blk = w[i:i + 128, j:j + 128].float()
            scale = blk.abs().amax().clamp(min=1e-4) / 448.0
            fp8 = (blk * (1.0 / scale)).to(torch.float8_e4m3fn)
            out[i:i + 128, j:j + 128] = fp8.double() * scale.double()
    return out


def draft_quant():
    """dflash2_draft_quant="fp8_per_block": the patched drafter built and loaded by vLLM's code
    with vLLM's online FP8 method (its FP8 GEMM replaced by a torch stand-in that multiplies by
    the block scales: no FP8 kernel on CPU). Which linear layers are FP8 and which stay bf16;
    the forward equals onecard.dflash.drafter.forward over weights put through FP8 blocks here
    (and differs from the bf16 forward); bad values are one-line errors."""
    import os
    import socket

    import vllm.config.device as device

    device.DeviceConfig.__post_init__ = lambda self: None
    from safetensors.torch import load_file

    import vllm.model_executor.layers.quantization.online.fp8 as online_fp8
    import vllm.model_executor.models.qwen3_dflash as q
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.config.parallel import ParallelConfig
    from vllm.config.speculative import SpeculativeConfig
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.custom_op import CustomOp

    class Fp8StandIn:
        def __init__(self, **kw):
            self.kw = kw

        def process_weights_after_loading(self, layer):
            pass

        def apply_weights(self, layer, x, bias=None):
            w = layer.weight.to(torch.float32)
            s = layer.weight_scale_inv.to(torch.float32)  # a scale per block: [N/128, K/128]
            s = s.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
            w = w * s
            return torch.nn.functional.linear(x, w.to(x.dtype), bias)

    tgt = ModelConfig(model=ARGS["target"], skip_tokenizer_init=True, max_model_len=2048)

    def make(**kw):
        return SpeculativeConfig(method="dflash2", model=ARGS["drafter"], num_speculative_tokens=7,
                                 target_model_config=tgt, target_parallel_config=ParallelConfig(), **kw)

    errors = {}
    for name, kw in {"bad": dict(dflash2_draft_quant="fp8_per_tensor"),
                     "without_dflash2": dict(method="ngram", model=None, prompt_lookup_max=3,
                                             dflash2_draft_quant="fp8_per_block")}.items():
        try:
            (SpeculativeConfig(num_speculative_tokens=3, target_model_config=tgt,
                               target_parallel_config=ParallelConfig(), **kw)
             if name == "without_dflash2" else make(**kw))
            errors[name] = "ACCEPTED"
        except Exception as e:  # noqa: BLE001
            lines = [ln for ln in str(e).splitlines() if "speculative_config:" in ln]
            errors[name] = lines[0].split("Value error, ", 1)[-1] if lines else str(e)
    cfg = DrafterConfig.load(ARGS["drafter"])
    rows = 1 + min(7, cfg.block_size - 1)
    attention, kernel = q.Attention, online_fp8.init_fp8_linear_kernel
    q.Attention = block_attention(cfg, rows)
    online_fp8.init_fp8_linear_kernel = lambda **kw: Fp8StandIn(**kw)
    # the compile cache is keyed by the config hash: bf16 and FP8 drafters must not share a key
    out = {"errors": errors,
           "hash": [make().compute_hash() == make().compute_hash(),
                    make().compute_hash() != make(dflash2_draft_quant="fp8_per_block").compute_hash()]}
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            with socket.socket() as s_:
                s_.bind(("127.0.0.1", 0))
                port = s_.getsockname()[1]
            with set_current_vllm_config(VllmConfig(model_config=tgt, speculative_config=make())):
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{port}")
                initialize_model_parallel(1, 1)
        from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

        w = load_file(os.path.join(ARGS["drafter"], "model.safetensors"))
        emb = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.5
        anchors = [5, 77]
        ids = torch.tensor([a if j == 0 else cfg.mask_token_id for a in anchors for j in range(rows)])
        pos = torch.arange(rows).repeat(len(anchors))

        def build(scheme):
            vc = VllmConfig(model_config=tgt, speculative_config=make(dflash2_draft_quant=scheme))
            with set_current_vllm_config(vc):
                m = DFlash2Qwen3ForCausalLM(vllm_config=vc, prefix="draft")
                kinds = {n: type(mod.quant_method).__name__ for n, mod in m.named_modules()
                         if "Linear" in type(mod).__name__}
                m.load_weights(w.items())
                dtypes = {n: str(mod.weight.dtype).removeprefix("torch.")
                          for n, mod in m.named_modules() if "Linear" in type(mod).__name__}
                m = m.float()
                for mod in m.modules():
                    if isinstance(mod, CustomOp):
                        mod._forward_method = mod.forward_native
                m.model.embed_tokens.weight.data.copy_(emb)
                with torch.no_grad():
                    hid = q.DFlashQwen3Model.forward(m.model, ids, pos)
            return kinds, dtypes, hid

        def reference(wts):
            worst = []
            for i, a in enumerate(anchors):
                ref = ref_drafter.forward(cfg, wts, target_hidden=torch.zeros(0, cfg.fc_in),
                                          block_ids=ref_drafter.block_ids_for(cfg, a, rows),
                                          block_start=0, embed=emb,
                                          lm_head=torch.zeros(1, cfg.hidden_size))
                worst.append(ref.hidden)
            return torch.cat(worst)

        kinds, dtypes, hid = build("fp8_per_block")
        fp8_names = [k for k in w if k == "fc.weight" or k.endswith(
            ("self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
             "mlp.down_proj.weight"))]
        wq = {k: (_fp8_block_dequant(v.float()).float() if k in fp8_names else v.float())
              for k, v in w.items()}
        ref_q = reference(wq)
        ref_bf16 = reference({k: v.float() for k, v in w.items()})
        # vLLM's own loader (get_model: DefaultModelLoader, its online-quant finalize and its
        # every-weight-loaded check), as the proposer loads the drafter
        from vllm.model_executor.model_loader import get_model

        vcq = VllmConfig(model_config=tgt, speculative_config=make(dflash2_draft_quant="fp8_per_block"))
        vcq.device_config.device = torch.device("cpu")
        with set_current_vllm_config(vcq):
            ml = get_model(vllm_config=vcq, model_config=vcq.speculative_config.draft_model_config,
                           load_config=vcq.speculative_config.draft_load_config)
        out["loader"] = [sorted(n for n, mod in ml.named_modules() if "Linear" in type(mod).__name__
                                and mod.weight.dtype == torch.float8_e4m3fn) == sorted(
                                    n for n, d in dtypes.items() if d == "float8_e4m3fn"),
                         str(ml.model._fused_kv_weight.dtype).removeprefix("torch.")]
        out["fp8_per_block"] = {
            "fp8": sorted(n for n, d in dtypes.items() if d == "float8_e4m3fn"),
            "kept": sorted(n for n, d in dtypes.items() if d != "float8_e4m3fn"),
            "methods": sorted(set(kinds.values())),
            "n_fp8_tensors": len(fp8_names),
            "worst_vs_fp8_ref": (hid - ref_q).abs().max().item(),
            "worst_vs_bf16_ref": (hid - ref_bf16).abs().max().item(),
        }
    finally:
        q.Attention, online_fp8.init_fp8_linear_kernel = attention, kernel
    return out


class _KernelStandIn:
    """copy_and_expand_dflash_inputs_kernel in plain torch (no Triton on this CPU): the same
    per-request loops over context and query rows, for DFlashProposer.set_inputs_first_pass."""

    def __getitem__(self, grid):
        return self.run

    @staticmethod
    def run(*, next_token_ids_ptr, target_positions_ptr, out_input_ids_ptr,
            out_context_positions_ptr, out_query_positions_ptr, out_context_slot_mapping_ptr,
            out_query_slot_mapping_ptr, out_token_indices_ptr, block_table_ptr,
            block_table_stride, query_start_loc_ptr, num_rejected_tokens_ptr,
            parallel_drafting_token_id, block_size, num_query_per_req, num_speculative_tokens,
            total_input_tokens, BLOCK_SIZE, HAS_NUM_REJECTED):
        b = query_start_loc_ptr.shape[0] - 1
        for r in range(b):
            c0, c1 = int(query_start_loc_ptr[r]), int(query_start_loc_ptr[r + 1])
            rej = int(num_rejected_tokens_ptr[r]) if HAS_NUM_REJECTED else 0
            last = int(target_positions_ptr[c1 - rej - 1])

            def slot(pos):
                blk = min(pos // block_size, block_table_stride - 1)
                return int(block_table_ptr[r, blk]) * block_size + pos % block_size

            for i in range(c0, c1):
                pos = int(target_positions_ptr[i])
                out_context_positions_ptr[i] = pos
                out_context_slot_mapping_ptr[i] = slot(pos)
            for j in range(num_query_per_req):
                out = r * num_query_per_req + j
                out_query_positions_ptr[out] = last + 1 + j
                out_query_slot_mapping_ptr[out] = slot(last + 1 + j)
                out_input_ids_ptr[out] = (int(next_token_ids_ptr[r]) if j == 0
                                          else parallel_drafting_token_id)
                if j > 0:
                    out_token_indices_ptr[r * num_speculative_tokens + j - 1] = out


def ring_mode():
    """ONECARD_DFLASH_RING=1 on the tiny pair: the model's layers (spec None, window, cache
    dtype "auto"), the proposer's geometry, rings in FlashAttention's layout, the slot map, and
    set_inputs_first_pass (vLLM's own, with a torch stand-in for its Triton kernel) reading the
    ring block table and filtering context slots."""
    import os

    import vllm.config.device as device

    device.DeviceConfig.__post_init__ = lambda self: None
    import vllm.model_executor.models.qwen3_dflash as q
    import vllm.v1.spec_decode.dflash as dflash_mod
    import vllm.v1.spec_decode.llm_base_proposer as lbp
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.config.parallel import ParallelConfig
    from vllm.config.speculative import SpeculativeConfig
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    out = {}
    os.environ["ONECARD_DFLASH_RING"] = "1"
    try:
        tgt = ModelConfig(model=ARGS["target"], skip_tokenizer_init=True, max_model_len=2048)
        sc = SpeculativeConfig(method="dflash2", model=ARGS["drafter"], num_speculative_tokens=7,
                               target_model_config=tgt, target_parallel_config=ParallelConfig())
        vc = VllmConfig(model_config=tgt, speculative_config=sc)
        vc.cache_config.cache_dtype = "fp8"       # the target's cache: not the drafter's
        seen = []

        class Recorder(torch.nn.Module):
            def __init__(self, num_heads, head_size, scale, num_kv_heads=None,
                         cache_config=None, per_layer_sliding_window=None, prefix="", **kw):
                super().__init__()
                seen.append([prefix, per_layer_sliding_window, cache_config.cache_dtype])

            def get_kv_cache_spec(self, vllm_config):
                return "A SPEC"

        real_attention = q.Attention
        q.Attention = Recorder
        try:
            from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

            # ring off first (ONECARD_DFLASH_RING=0): today's layers, on a config of its own
            os.environ["ONECARD_DFLASH_RING"] = "0"
            sc0 = SpeculativeConfig(method="dflash2", model=ARGS["drafter"],
                                    num_speculative_tokens=7, target_model_config=tgt,
                                    target_parallel_config=ParallelConfig())
            vc0 = VllmConfig(model_config=tgt, speculative_config=sc0)
            vc0.cache_config.cache_dtype = "fp8"
            with set_current_vllm_config(vc0):
                m0 = DFlash2Qwen3ForCausalLM(vllm_config=vc0, prefix="offdraft")
            off_seen, seen[:] = list(seen), []
            out["ring_off"] = [off_seen, [type(layer.self_attn.attn).__name__
                                          for layer in m0.model.layers],
                               "use_swa" in sc0.draft_model_config.hf_config.dflash_config]
            os.environ["ONECARD_DFLASH_RING"] = "1"
            with set_current_vllm_config(vc):
                m = DFlash2Qwen3ForCausalLM(vllm_config=vc, prefix="ringdraft")
        finally:
            q.Attention = real_attention
        attns = [layer.self_attn.attn for layer in m.model.layers]
        dc = sc.draft_model_config.hf_config.dflash_config
        out["model"] = [seen, [type(a).__name__ for a in attns],
                        [a.get_kv_cache_spec(vc) for a in attns],
                        [getattr(a, "dflash2_ring", False) for a in attns],
                        vc.cache_config.cache_dtype, dc.get("use_swa"), dc.get("swa_window_size")]

        lbp.PIN_MEMORY = False
        vc.scheduler_config.max_num_seqs = 3
        runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=[]),
                                       requests={})
        from vllm.v1.spec_decode.dflash2 import DFlash2Proposer

        with set_current_vllm_config(vc):
            prop = DFlash2Proposer(vc, torch.device("cpu"), runner=runner)
        out["geometry"] = [prop.ring_mode, prop.ring_window, prop.ring_k, prop.ring_slots,
                           prop.ring_blocks_per_slot, prop.ring_rows, prop.ring_num_blocks,
                           prop.ring_width]
        out["validate_noop"] = prop.validate_same_kv_cache_group(None) is None

        # rings in FlashAttention's layout, bound to (stand-in) layers
        cfg = DrafterConfig.load(ARGS["drafter"])
        nkv, hd = cfg.num_kv_heads, cfg.head_dim
        fake_layers = {f"l{i}": types.SimpleNamespace(num_kv_heads=nkv, head_size=hd,
                                                      kv_cache_torch_dtype=torch.bfloat16)
                       for i in range(2)}
        for layer in fake_layers.values():
            layer.bind_kv_cache = (lambda lay: lambda t: setattr(lay, "kv_cache", t))(layer)
        prop._ring_allocate(fake_layers, sorted(fake_layers), FlashAttentionBackend)
        cache = fake_layers["l0"].kv_cache
        out["rings"] = [list(cache.shape), cache.dtype == torch.bfloat16,
                        cache.permute(0, 2, 1, 3).is_contiguous(),
                        cache is prop.ring_caches["l0"],
                        fake_layers["l1"].kv_cache is not cache,
                        list(prop._ring_table.shape)]
        prop._ring_allocate(fake_layers, sorted(fake_layers), FlashAttentionBackend)
        out["rings_kept"] = prop.ring_caches["l0"] is cache

        # slot map through the runner's batch; a fresh slot is cleared
        for t in prop.ring_caches.values():
            t.fill_(1)
        runner.input_batch.req_ids = ["a", "b"]
        runner.requests = {"a": 1, "b": 1}
        bt = prop._ring_block_table(2)
        same = prop._ring_block_table(2) is bt
        bps = prop.ring_blocks_per_slot
        cleared = [bool((t[:2 * bps] == 0).all()) and bool((t[2 * bps:] == 1).all())
                   for t in prop.ring_caches.values()]
        padded = prop._ring_block_table(3)      # a batch padded past the runner's requests
        out["slots"] = [bt[:, :7].tolist(), same, cleared, dict(prop.ring_book.owner),
                        padded[:, :7].tolist()]

        # a backend whose logical shape puts K/V first (block index at dim 1): a fresh slot is
        # cleared along the block dim, not along K/V
        class _KVFirst(FlashAttentionBackend):
            @staticmethod
            def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                                   cache_dtype_str="auto"):
                return (2, num_blocks, block_size, num_kv_heads, head_size)

            @staticmethod
            def get_kv_cache_stride_order(include_num_layers_dimension=False):
                return (0, 1, 2, 3, 4)

        kv_layers = {k: types.SimpleNamespace(**{a: getattr(v, a) for a in
                                                 ("num_kv_heads", "head_size", "kv_cache_torch_dtype")})
                     for k, v in fake_layers.items()}
        for layer in kv_layers.values():
            layer.bind_kv_cache = (lambda lay: lambda t: setattr(lay, "kv_cache", t))(layer)
        saved = (dict(prop.ring_caches), prop._ring_key, prop._ring_bt, prop.ring_book,
                 runner.input_batch.req_ids, runner.requests)
        prop.ring_caches = {}
        prop._ring_allocate(kv_layers, sorted(kv_layers), _KVFirst)
        for t in prop.ring_caches.values():
            t.fill_(1)
        prop.ring_book = type(prop.ring_book)(prop.ring_slots)
        prop._ring_key = None
        runner.input_batch.req_ids = ["c"]
        runner.requests = {"c": 1}
        prop._ring_block_table(1)                 # slot 0, fresh: cleared
        out["kv_first_clear"] = [prop._ring_block_dim,
                                 all(bool((t[:, :bps] == 0).all()) and bool((t[:, bps:] == 1).all())
                                     for t in prop.ring_caches.values())]
        (prop.ring_caches, prop._ring_key, prop._ring_bt, prop.ring_book,
         runner.input_batch.req_ids, runner.requests) = saved
        for n, t in prop.ring_caches.items():
            fake_layers[n].bind_kv_cache(t)

        # initialize_attn_backend: one FA group on SlidingWindowSpec(16, window), the first
        # attention group's id, block size 16, rings bound (the FA builder itself needs a GPU:
        # create_metadata_builders is recorded, not run)
        import vllm.config as vconfig
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
        from vllm.v1.worker.utils import AttentionGroup

        for layer in fake_layers.values():
            layer.get_attn_backend = lambda: FlashAttentionBackend
        built = []
        real_get, real_create = vconfig.get_layers_from_vllm_config, \
            AttentionGroup.create_metadata_builders
        vconfig.get_layers_from_vllm_config = lambda *a, **k: dict(fake_layers)
        AttentionGroup.create_metadata_builders = \
            lambda self, *a, **k: built.append((self.kv_cache_spec, a, k))
        try:
            prop._draft_attn_layer_names = set(fake_layers)
            mamba = MambaSpec(block_size=16, shapes=((2, 2),), dtypes=(torch.float32,))
            full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8,
                                     dtype=torch.bfloat16)
            kvc = types.SimpleNamespace(kv_cache_groups=[
                types.SimpleNamespace(kv_cache_spec=mamba, layer_names=["t.0"]),
                types.SimpleNamespace(kv_cache_spec=full, layer_names=["t.1"])])
            prop.initialize_attn_backend(kvc, [16, 16])
        finally:
            vconfig.get_layers_from_vllm_config = real_get
            AttentionGroup.create_metadata_builders = real_create
        grp = prop.draft_attn_groups[0]
        spec = built[0][0]
        out["attn_backend"] = [len(prop.draft_attn_groups), grp.layer_names, grp.backend.get_name(),
                               type(spec).__name__, spec.block_size, spec.sliding_window,
                               spec.num_kv_heads == nkv, spec.head_size == hd,
                               prop.kv_cache_gid, prop.block_size,
                               fake_layers["l0"].kv_cache is prop.ring_caches["l0"]]

        # set_inputs_first_pass: request a decodes (8 verify rows, 3 rejected) at position 300,
        # request b prefills 150 rows from position 0 (longer than its 80-row ring)
        dflash_mod.copy_and_expand_dflash_inputs_kernel = _KernelStandIn()
        prop.num_speculative_tokens = 7
        prop.block_size = 16          # initialize_attn_backend's (its FA builder needs a GPU)
        pos = torch.cat([torch.arange(300, 308), torch.arange(0, 150)])
        qsl = torch.tensor([0, 8, 158], dtype=torch.int32)
        seq_lens = torch.tensor([308, 150], dtype=torch.int32)
        rejected = torch.tensor([3, 0], dtype=torch.int32)
        target_bt = torch.full((2, 64), 7, dtype=torch.int32)
        cad = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens,
            num_reqs=2, num_actual_tokens=158, max_query_len=150, max_seq_len=308,
            block_table_tensor=target_bt, slot_mapping=torch.zeros(158, dtype=torch.int64),
            causal=False, seq_lens_cpu_upper_bound=seq_lens.clone())
        n, _, new_cad = prop.set_inputs_first_pass(
            target_token_ids=torch.zeros(158, dtype=torch.int32),
            next_token_ids=torch.tensor([11, 12]), target_positions=pos,
            target_hidden_states=torch.zeros(158, 4), token_indices_to_sample=None, cad=cad,
            num_rejected_tokens_gpu=rejected)
        ctx_slots = prop._context_slot_mapping_buffer[:158].tolist()
        qslots = new_cad.slot_mapping.tolist()
        rows = prop.ring_rows
        want_a = [(0 * bps + (p // 16) % bps) * 16 + p % 16 for p in range(300, 308)]
        keep_b = [p for p in range(150) if p >= 150 + 7 + 1 - rows]
        want_b = [((1 * bps + (p // 16) % bps) * 16 + p % 16) if p in keep_b else -1
                  for p in range(150)]
        want_q = ([(0 * bps + (p // 16) % bps) * 16 + p % 16 for p in range(305, 313)]
                  + [(1 * bps + (p // 16) % bps) * 16 + p % 16 for p in range(150, 158)])
        out["first_pass"] = [n, new_cad.block_table_tensor is prop._ring_bt
                             and torch.equal(new_cad.block_table_tensor, bt),
                             cad.block_table_tensor is target_bt,
                             ctx_slots[:8] == want_a, ctx_slots[8:] == want_b,
                             qslots == want_q, len(keep_b),
                             new_cad.seq_lens.tolist()]
    finally:
        os.environ.pop("ONECARD_DFLASH_RING", None)
    return out


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
    check("ring_mode", ring_mode)
    check("draft_quant", draft_quant)
print("PATCH_CHECK " + json.dumps(R, default=str))
