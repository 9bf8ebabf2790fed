"""The KVarN kernels compile for the RTX 3090 (sm_86) at the launches the KVARN backend makes
there, and fit its shared memory, on the CPU.

An sm_86 / sm_89 block may have 99 KiB (101,376 B) of shared memory; a kernel compiled for more
fails at its launch (Triton's OutOfResources). CTX=huge is a 3090 profile, and every H200 run so far
had 227 KiB: session 23 found the prefill kernel of a chunk's own tokens at 102,400 B (so every
CTX=huge prefill would have failed on a 3090) and the verify kernel at 9..16 query tokens at
155,648 B. The first now takes 16 keys per step on a GPU with under 200 KiB per block
(``kernels.prefill_launch``); the second has no setting that fits, so the launcher refuses
DFLASH_TOKENS > 7 with CTX=huge on such a card and the kernel raises a one-line error there.

The child process (no TRITON_INTERPRET) calls the real wrappers on CPU tensors of the 27B's shapes
(24 query / 4 KV heads x 256), with the CUDA defaults the wrappers pick on a GPU (``sub_n`` 32, and
``prefill_launch(256, 101_376)``), intercepts every launch and compiles it with Triton's compiler for
``GPUTarget("cuda", 86, 32)``. Nothing runs on a device.
"""
from __future__ import annotations

import pytest

from tests.sm86 import SM86_SHARED, compile_rows

_BODY = r'''
import onecard.kvarn.kernels as K
from onecard.kvarn import format as fmt
from onecard.kvarn import reference as R

NAMES = ("_kvarn_pack_kernel", "_kvarn_attn_split_kernel", "_kvarn_reduce_kernel", "_kvarn_dequant_kernel",
         "_kvarn_prefill_kernel", "_kvarn_prefill_own_kernel")
gen = torch.Generator().manual_seed(0)
BM, BN, STAGES = K.prefill_launch(256, 101_376)   # num_warps: kvarn_prefill derives it from BM

for preset in fmt.PRESETS:
    p = fmt.get_preset(preset)
    T = p.tile
    for q_len in (1, 2, 4, 5, 8, 16):          # block_q 2, 2, 4, 8, 8, 16; 16 is the refused one
        case = R.make_case(q_lens=[q_len], seq_lens=[3 * T + q_len], num_q_heads=24, num_kv_heads=4,
                           head_dim=256, preset=p, q_dtype=torch.bfloat16, generator=gen)
        out = torch.empty_like(case.q)
        compile_calls(f"{preset} verify q{q_len}", K, NAMES, lambda: K.kvarn_attention(
            case.q, case.cache, case.stage_k, case.stage_v, out, cu_seqlens_q=case.cu_seqlens_q,
            seq_lens=case.seq_lens, packed_tiles=case.packed_tiles, stage_slot=case.stage_slot,
            block_table=case.block_table, max_query_len=case.max_query_len, softmax_scale=case.softmax_scale,
            preset=p, tiles_per_page=case.tiles_per_page, sub_n=min(T, 32)))    # sub_n: the CUDA default
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
    compile_calls(f"{preset} pack", K, NAMES, lambda: K.kvarn_pack_tiles(
        case.stage_k, case.stage_v, case.cache, slots=i32([0]), tiles=i32([1]), blocks=i32([0]), preset=p))
    L, n = 8 * T, 2 * T                        # a chunk of 2 tiles over a packed prefix
    case = R.make_case(q_lens=[n], seq_lens=[L], num_q_heads=24, num_kv_heads=4, head_dim=256, preset=p,
                       q_dtype=torch.bfloat16, generator=gen)
    rows = torch.zeros(3 * T, 4, 256, dtype=torch.float16)
    new = torch.zeros(n, 4, 256, dtype=torch.float16)
    out = torch.empty_like(case.q)
    for window in (1, 2, 3):
        compile_calls(f"{preset} prefill w{window}", K, NAMES, lambda: K.kvarn_prefill(
            case.q, case.cache, rows, rows.clone(), out, block_table_row=case.block_table[0].contiguous(),
            ctx_len=L - n, seq_len=L, packed_tiles=(L - 1) // T, sink_row=0, tail_row=T, ring=T, new_k=new,
            new_v=new.clone(), fp16_window=window, prev_row=2 * T if window > 1 else -1,
            softmax_scale=case.softmax_scale, preset=p, tiles_per_page=case.tiles_per_page,
            block_m=BM, block_n=BN, num_stages=STAGES))
'''


def test_kvarn_launches_on_an_rtx_3090(tmp_path):
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    from onecard import plan as P
    from onecard.kvarn import kernels as K

    rows = compile_rows(_BODY, tmp_path)
    assert {r["kernel"] for r in rows} == {"_kvarn_pack_kernel", "_kvarn_attn_split_kernel", "_kvarn_reduce_kernel",
                                           "_kvarn_dequant_kernel", "_kvarn_prefill_kernel",
                                           "_kvarn_prefill_own_kernel"}
    wide = [r for r in rows if r["kernel"] == "_kvarn_attn_split_kernel" and r["case"].endswith("q16")]
    over = [r for r in rows if r["shared"] > SM86_SHARED and r not in wide]
    assert not over, over
    # the verify block the launcher refuses on such a card: its figure is the one the code names
    assert wide and all(r["shared"] == K.WIDE_VERIFY_SHARED > SM86_SHARED for r in wide), wide
    assert P.KVARN_WIDE_VERIFY_SHARED_KIB == -(-K.WIDE_VERIFY_SHARED // 1024)
    assert P.SHARED_KIB_PER_BLOCK[(8, 6)] * 1024 == SM86_SHARED
    own = [r for r in rows if r["kernel"] == "_kvarn_prefill_own_kernel"]
    assert own and all(r["shared"] <= SM86_SHARED for r in own)
