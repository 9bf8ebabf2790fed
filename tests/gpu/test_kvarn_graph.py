"""KVarN's CUDA-graph decode path on the GPU, through the installed backend (needs kvarn/install.sh's
files on the path: gpu/jobs/62-kvarn-decode.sh runs this file with /var/tmp/site-kvarn first).

A uniform step's forward -- single-token decode, and a speculative verify block of 4 queries per
request -- is captured once in a torch.cuda.graph (padded like vLLM pads a FULL batch: two
requests, two empty ones), then each later step only rebuilds the metadata (the builder rewrites
its persistent buffers) and replays; the verify steps reject drafts (the next block starts after
the first accepted token). Per step the replay must equal an eager
forward of the same step on a copy of the cache and stage bit for bit, and the float64
reference under the read rule within the bf16 tolerance; the steps cross tile boundaries (tile 0
of one request fills and becomes the sink, a middle tile of the other fills and is packed).
Real geometry: k4v2_g128, 24 q / 4 kv heads of 256, pages of 2 tiles; read rules (fp16 window,
sink tiles) (2, 1), the default, and (3, 2) (ONECARD_KVARN_WINDOW / ONECARD_KVARN_SINKS).
Run: PYTHONPATH=<repo>:/var/tmp/site-kvarn:/var/tmp/site python3 -m pytest -m gpu tests/gpu/test_kvarn_graph.py
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DT, D, H, HQ, T, BS = "kvarn_k4v2_g128", 256, 4, 24, 128, 256
PAD_REQS = 4  # requests of the captured batch: 2 + 2 padding


def _reference(R, K, V, s, q, window, sinks=1):
    kr = R.rotate(K[:s].half(), torch.float32).half()
    vr = R.rotate(V[:s].half(), torch.float32).half()
    kq, vq = R.quantized_view(kr, vr, DT)
    return R.own_tile_attention_f64(q.float(), R.rotate(kr), R.rotate(vr), R.rotate(kq),
                                    R.rotate(vq), T, D ** -0.5, window=window, sinks=sinks)


@pytest.mark.parametrize("rule", ["2,1", "3,2"])  # fp16 window, sink tiles (the server's env)
@pytest.mark.parametrize("q_len", [1, 4])
def test_uniform_rows_replay_equals_eager_and_reference(q_len, rule, monkeypatch):
    KA = pytest.importorskip("vllm.v1.attention.backends.kvarn_attn")
    from onecard.kvarn import reference as R

    w, n = rule.split(",")
    monkeypatch.setenv("ONECARD_KVARN_WINDOW", w)  # read by the builder and the impl below
    monkeypatch.setenv("ONECARD_KVARN_SINKS", n)

    dev = torch.device("cuda")
    torch.manual_seed(0)
    PAD = PAD_REQS * q_len
    cfg = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(cache_dtype=DT),
        scheduler_config=types.SimpleNamespace(max_num_seqs=2),
        compilation_config=types.SimpleNamespace(max_cudagraph_capture_size=PAD),
        speculative_config=types.SimpleNamespace(num_speculative_tokens=q_len - 1) if q_len > 1 else None)
    builder = KA.KvarnMetadataBuilder(types.SimpleNamespace(block_size=BS), ["l0"], cfg, dev)
    impl = KA.KvarnAttentionImpl(HQ, D, D ** -0.5, H, kv_cache_dtype=DT)
    shape = KA.KvarnAttentionBackend.get_kv_cache_shape(16, BS, H, D, DT)
    kv_cache = torch.randint(0, 256, shape, dtype=torch.uint8, device=dev)
    layer = torch.nn.Module()
    bt = torch.tensor([[3, 5, 9, 0], [6, 1, 7, 0]], dtype=torch.int32, device=dev)
    bt_pad = torch.cat([bt, torch.zeros(PAD_REQS - 2, bt.shape[1], dtype=torch.int32, device=dev)])
    K = [torch.zeros(0, H, D, device=dev) for _ in range(2)]
    V = [torch.zeros(0, H, D, device=dev) for _ in range(2)]
    window, sinks = builder.planner.window, builder.planner.sinks
    assert (window, sinks) == (int(w), int(n))

    def cam_for(step, padded):
        cu = [0]
        for _, m in step:
            cu.append(cu[-1] + m)
        seq = [c + m for c, m in step]
        if padded:
            return types.SimpleNamespace(
                num_reqs=PAD_REQS, seq_lens=torch.tensor(seq + [0] * (PAD_REQS - 2), device=dev),
                query_start_loc_cpu=torch.tensor(cu + [cu[-1]] * (PAD_REQS - 2)),
                block_table_tensor=bt_pad, num_actual_tokens=PAD)
        return types.SimpleNamespace(num_reqs=2, seq_lens=torch.tensor(seq, device=dev),
                                     query_start_loc_cpu=torch.tensor(cu), block_table_tensor=bt,
                                     num_actual_tokens=cu[-1])

    def new_rows(step):
        n = sum(m for _, m in step)
        q = (torch.randn(n, HQ * D, device=dev) * 1.2).bfloat16()
        k = (torch.randn(n, H * D, device=dev) * 1.5 + 0.3).bfloat16()
        v = torch.randn(n, H * D, device=dev).bfloat16()
        at = 0
        for r, (c, m) in enumerate(step):
            K[r] = torch.cat([K[r][:c], k[at:at + m].view(m, H, D).float()])
            V[r] = torch.cat([V[r][:c], v[at:at + m].view(m, H, D).float()])
            at += m
        return q, k, v

    # prefill (general path, eager): contexts 381 and 125 -> decode crosses 384 and 128
    prefill = [(0, 381), (0, 125)]
    q, k, v = new_rows(prefill)
    md = builder.build(0, cam_for(prefill, False))
    assert md.decode is None
    out = torch.empty(q.shape[0], HQ * D, dtype=torch.bfloat16, device=dev)
    impl.forward(layer, q, k, v, kv_cache, md, output=out)

    static_q = torch.zeros(PAD, HQ * D, dtype=torch.bfloat16, device=dev)
    static_k = torch.zeros(PAD, H * D, dtype=torch.bfloat16, device=dev)
    static_v = torch.zeros(PAD, H * D, dtype=torch.bfloat16, device=dev)
    static_out = torch.zeros(PAD, HQ * D, dtype=torch.bfloat16, device=dev)
    graph = None
    if q_len == 1:
        decode_steps = [[(381 + i, 1), (125 + i, 1)] for i in range(6)]
    else:  # blocks of 4 crossing 384 / 128, then 1 or 3 accepted per step
        decode_steps = [[(381, 4), (125, 4)], [(382, 4), (126, 4)], [(385, 4), (129, 4)],
                        [(386, 4), (130, 4)], [(389, 4), (131, 4)]]
    worst = 0.0
    for i, step in enumerate(decode_steps):
        q, k, v = new_rows(step)
        md = builder.build(0, cam_for(step, True))
        assert md.decode is not None and md.num_actual_tokens == PAD
        n = 2 * q_len
        static_q[:n].copy_(q)
        static_k[:n].copy_(k)
        static_v[:n].copy_(v)
        if graph is None:  # warm up (compiles; idempotent writes of this step), then capture
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                impl.forward(layer, static_q, static_k, static_v, kv_cache, md, output=static_out)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                impl.forward(layer, static_q, static_k, static_v, kv_cache, md, output=static_out)
        # the same step eagerly on copies of the cache and the stage
        twin = torch.nn.Module()
        twin._kvarn_stage = tuple(t.clone() for t in layer._kvarn_stage)
        cache_copy = kv_cache.clone()
        eager_out = torch.zeros_like(static_out)
        impl.forward(twin, static_q, static_k, static_v, cache_copy, md, output=eager_out)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out[:n], eager_out[:n]), f"step {i}: replay != eager"
        assert torch.equal(kv_cache, cache_copy), f"step {i}: replay wrote a different cache"
        for r, (c, m) in enumerate(step):
            rows = slice(r * q_len, (r + 1) * q_len)
            ref = _reference(R, K[r].cpu(), V[r].cpu(), c + m, q[rows].view(m, HQ, D).cpu(), window, sinks)
            got = static_out[rows].view(m, HQ, D).double().cpu()
            assert torch.isfinite(got).all()
            worst = max(worst, float(((got - ref).abs() / ref.abs().clamp_min(1)).max()))
    print(f"KVarN uniform rows (q_len {q_len}, window {window}, sinks {sinks}) graph: {len(decode_steps)} replays, worst rel. error vs "
          f"float64 {worst:.2e}")
    assert worst < 3e-2
