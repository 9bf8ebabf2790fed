"""Probe: the DFlash2 drafter's non-causal attention (27B drafter shape: 32 q / 8 kv heads x 128,
8 rows, page 1616), the wide-verify kernel vs stock unified_attention, int8 and bf16 KV."""
import torch
import triton.testing

from onecard.kernels.reference import make_verify_case
from onecard.kernels.wide_verify import wide_verify_attention
from vllm.v1.attention.ops.triton_unified_attention import unified_attention
from vllm.v1.kv_cache_interface import KVQuantMode

g = torch.Generator().manual_seed(1)
for kv in ("int8", "bf16"):
    for ctx in (8192, 32768):
        c = make_verify_case(q_lens=[8], seq_lens=[ctx], num_q_heads=32, num_kv_heads=8, head_dim=128,
                             block_size=1616, kv_dtype=kv, device="cuda", generator=g)
        out, out2 = torch.empty_like(c.q), torch.empty_like(c.q)
        one = torch.ones(1, 8, dtype=torch.float32, device="cuda")
        mode = KVQuantMode.INT8_PER_TOKEN_HEAD if kv == "int8" else KVQuantMode.NONE

        def ours():
            wide_verify_attention(c.q, c.key_cache, c.value_cache, out, cu_seqlens_q=c.cu_seqlens_q,
                                  seq_lens=c.seq_lens, block_table=c.block_table, max_query_len=8,
                                  softmax_scale=c.softmax_scale, kv_mode=kv, k_scale_cache=c.k_scale_cache,
                                  v_scale_cache=c.v_scale_cache, max_seq_len=ctx, causal=False)

        def stock():
            unified_attention(q=c.q, k=c.key_cache, v=c.value_cache, out=out2, cu_seqlens_q=c.cu_seqlens_q,
                              max_seqlen_q=8, seqused_k=c.seq_lens, max_seqlen_k=ctx,
                              softmax_scale=c.softmax_scale, causal=False, window_size=(-1, -1),
                              block_table=c.block_table, softcap=0.0, q_descale=None,
                              k_descale=None if kv == "int8" else one, v_descale=None if kv == "int8" else one,
                              kv_quant_mode=mode, k_scale_cache=c.k_scale_cache, v_scale_cache=c.v_scale_cache)

        a = triton.testing.do_bench(ours, warmup=10, rep=40, return_mode="median")
        b = triton.testing.do_bench(stock, warmup=10, rep=40, return_mode="median")
        d = (out.float() - out2.float()).abs().max().item()
        print(f"drafter attn {kv} ctx {ctx} q 8, 32q/8kv/128, non-causal: ours {a * 1e3:.1f} us, "
              f"stock {b * 1e3:.1f} us, x{b / a:.1f}, max|ours - stock| {d:.2e}", flush=True)
