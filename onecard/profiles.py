"""Every launcher default, as data. One place to read what a knob does and what it defaults to.

CTX picks the context profile, SPEC the speculation method; the tables below give the values
each one implies. `onecard.plan` is the only reader of the environment; nothing else reads
these knobs. `render_readme()` writes single-user/README.md from this module.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from onecard import memory

GiB = 1024**3


@dataclass(frozen=True)
class CtxProfile:
    name: str
    kv: str  # key of onecard.memory.KV_DTYPES
    max_len: int
    max_seqs: int
    attention_backend: str | None
    kv_mem: int  # --kv-cache-memory-bytes pin for a 24 GB card (3090)
    needs: str | None  # feature that must be installed, else the plan refuses
    doc: str


CTX_PROFILES: dict[str, CtxProfile] = {
    "fast": CtxProfile(
        "fast", "bf16", 65_536, 8, None,
        memory.FAST_KV_MEM,
        None, "bf16 KV, 64k context; public 3090 pool 68,605-72,992 tokens"),
    "long": CtxProfile(
        "long", "int8_per_token_head", 131_072, 4, "TRITON_ATTN", memory.LONG_KV_MEM,
        None, "int8 per-token-head KV on TRITON_ATTN, 128k; public 3090 pool 136,429 tokens"),
    "huge": CtxProfile(
        "huge", "kvarn", 245_760, 2, None, memory.LONG_KV_MEM,
        "kvarn", "KVarN 4/2-bit KV, 245,760 context; public 3090 pool 268,169 tokens"),
}


@dataclass(frozen=True)
class SpecProfile:
    name: str
    method: str | None  # speculative_config["method"]
    k_default: dict[str, int]  # per CTX
    k_range: tuple[int, int]
    needs: str | None
    kv_mem: dict[str, int] = field(default_factory=dict)  # CTX -> pin override
    doc: str = ""


SPEC_PROFILES: dict[str, SpecProfile] = {
    "off": SpecProfile("off", None, {"fast": 0, "long": 0, "huge": 0}, (0, 0), None, doc="no speculation"),
    "mtp": SpecProfile("mtp", "mtp", {"fast": 4, "long": 3, "huge": 3}, (1, 7), None,
                       doc="the checkpoint's MTP layer drafts k tokens"),
    # method "dflash2" exists once patches/0080-dflash2.patch is applied (it also leaves the
    # marker vllm/dflash2_installed.txt). DFLASH_TOKENS 8..15: the drafter fills 7 positions,
    # the lookup lane (LOOKUP=1) the rest.
    "dflash2": SpecProfile(
        "dflash2", "dflash2", {"fast": 7, "long": 7, "huge": 7}, (7, 15), "dflash2",
        kv_mem={"fast": memory.FAST_DFLASH_KV_MEM,
                "long": memory.LONG_KV_MEM, "huge": memory.LONG_KV_MEM},
        doc="DFlash2 block drafter (DRAFT path), DFLASH_TOKENS 7..15 (8..15: lookup lane)"),
}

SINGLE_USER = {"CTX": "long", "KV": "int4_per_token_head", "MAX_LEN": "256000", "MAX_SEQS": "1",
               "KV_MEM": str(memory.INT4_KV_MEM), "SSM_DTYPE": "bfloat16"}
# SSM_DTYPE=bfloat16: the public 256k pool fits a bf16 GDN state (onecard.memory docstring); with
# the checkpoint's float32 state the same pin holds ~240k and the preflight would cap MAX_LEN.


@dataclass(frozen=True)
class Knob:
    name: str
    default: str
    valid: str  # human description of valid values
    doc: str
    choices: tuple[str, ...] = ()


BOOL = ("0", "1")
KNOBS: dict[str, Knob] = {k.name: k for k in [
    Knob("CTX", "fast", "fast|long|huge", "context profile (KV dtype, max_len, MAX_SEQS, KV_MEM pin)", tuple(CTX_PROFILES)),
    Knob("SPEC", "mtp", "off|mtp|dflash2", "speculative decoding method", tuple(SPEC_PROFILES)),
    Knob("SPEC_K", "", "1..7 (mtp)", "draft tokens per step; default per profile (mtp 4 fast / 3 long+huge)"),
    Knob("DFLASH_TOKENS", "", "7..15", "DFlash2 block size (draft tokens), default 7; with CTX=huge, 8..15 "
         "needs 152 KiB of shared memory per block for KVarN's verify kernel (H100 / H200 / A100; an RTX 3090 "
         "/ 4090 has 99 KiB, and a real launch there refuses it)"),
    Knob("LOOKUP", "1", "0|1", "DFlash2 lookup lane: with DFLASH_TOKENS 8..15, positions past the drafter's 7 "
         "come from suffix matches in prompt + generated text (0: the last draft repeated)", BOOL),
    Knob("LOOKUP_LANE", "device", "device|host", "where the lookup lane's suffix match runs: device (the GPU, "
         "no host sync per step) or host (the CPU lane of earlier releases: one device-to-host copy and wait "
         "per step with DFLASH_TOKENS 8..15). Both propose tokens the target verifies, so output is exact "
         "either way; device considers every earlier occurrence of the key, host the 8 most recent. "
         "Passed to the server as ONECARD_DFLASH_LANE", ("device", "host")),
    Knob("DFLASH_RING", "auto", "auto|0|1", "SPEC=dflash2: 1: the drafter's attention K/V live in per-request "
         "rings of its sliding window outside vLLM's KV pool (84.9 MB beside the pin for the 27B drafter at "
         "MAX_SEQS 2), so the pool is the target's alone (docs/dflash2-huge.md section 3); needs a drafter whose "
         "layers are all sliding-window; 0: the drafter's layers hold KV for the whole context in the pool; "
         "auto: 1 with CTX=huge (whose KVarN pool cannot take the drafter's layers), else 0. Run on a GPU with "
         "CTX=huge (H100, 2026-12-05), not yet with CTX=fast|long. No effect with SPEC=off|mtp. Passed to the server as ONECARD_DFLASH_RING",
         ("auto", "0", "1")),
    Knob("DRAFT_QUANT", "auto", "auto|bf16|fp8", "SPEC=dflash2: bf16 = the drafter's weights as stored; fp8 = its "
         "fc, o_proj and MLP quantized to FP8 while it loads (the published 27B drafter 3.58 -> 2.14 GiB; Marlin "
         "W8A16 on an RTX 3090, a W8A8 kernel on sm_89+ GPUs, untested there); auto = fp8 exactly when the plan with "
         "bf16 does not fit the card (every dflash2 profile on 24 GiB). The target verifies every token: FP8 "
         "changes speed, not the output distribution. Run on the tiny model (job 70): greedy output equal to "
         "SPEC=off (H200), sampled output passing a chi-square test against it (H100, Marlin FP8); acceptance "
         "with the real drafter not yet measured (docs/dflash2.md, \"FP8 drafter\")",
         ("auto", "bf16", "fp8")),
    Knob("KV", "", "bf16|fp8|int8_per_token_head|int4_per_token_head", "override the profile's KV cache dtype",
         ("bf16", "fp8", "int8_per_token_head", "int4_per_token_head")),
    Knob("SSM_DTYPE", "auto", "auto|bfloat16|float32",
         "GDN recurrent-state dtype (auto: the checkpoint's mamba_ssm_dtype, float32 for Qwen3.5; "
         "the public 3090 pools fit bfloat16)", ("auto", "bfloat16", "float32")),
    Knob("PREFIX_CACHE", "1", "0|1", "prefix caching (+ --mamba-cache-mode align); with SPEC=mtp|dflash2 align mode "
         "waits on the previous step each step: 0 made a DFlash2 k=7 step at 8k 17 % faster on the H200 "
         "(docs/dflash2.md), at the cost of every prefix-cache hit", BOOL),
    Knob("MAX_SEQS", "", "1..256", "max concurrent sequences; default per profile"),
    Knob("PREFILL_CHUNK", "2048", "256..65536", "tokens one engine step may schedule (--max-num-batched-tokens): "
         "the prefill chunk. 2048 is what vLLM picks on its own for a GPU under 70 GiB; pinned, so every card "
         "runs (and the preflight sizes) the same plan. Larger chunks need more activation memory (the preflight "
         "scales its activation reserve with it); must be at least MAX_SEQS x (1 + draft tokens)"),
    Knob("EMBED_HOST", "0", "0|1", "1: the target's embed_tokens table (1.19 GiB at int8 for the 27B) stays in pinned "
         "host memory and the GPU reads the rows a step needs over PCIe (patch 0013, vLLM's UVA views); the "
         "preflight counts that much less VRAM. Not yet run on a GPU; refused on WSL (no pinned memory)", BOOL),
    Knob("KV_MEM", "", "bytes, or with K/M/G suffix, or 'auto'", "KV pool pin (--kv-cache-memory-bytes); 'auto' uses GPU_UTIL"),
    Knob("GPU_UTIL", "0.92", "0.10..0.99", "gpu_memory_utilization when KV_MEM=auto; with a KV_MEM pin, only the free-memory bar vLLM checks at boot"),
    Knob("TP", "1", "1|2|4|8", "GPUs of one host through vLLM's own tensor parallelism (--tensor-parallel-size; "
         "or -tp in EXTRA_ARGS); >1 drops the KV_MEM pin and sizes the pool from GPU_UTIL (docs/multi-gpu.md)",
         ("1", "2", "4", "8")),
    Knob("MAX_LEN", "", "256..1048576", "max model length; default per profile, capped (with a note) to the "
         "checkpoint's max context (config.json max_position_embeddings, as vLLM derives it); an explicit MAX_LEN "
         "above that is refused unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 is in the environment"),
    Knob("PORT", "18020", "1..65535", "listen port"),
    Knob("HOST", "127.0.0.1", "address", "listen address; beyond loopback needs an API key"),
    Knob("MODEL", "models/qwen38-27b", "path, or 'tiny'", "checkpoint directory; 'tiny' builds the CPU-sized test model"),
    Knob("SERVED_NAME", "qwen3.8-27b", "name", "model name clients use"),
    Knob("DRAFT", "models/dflash2-drafter", "path", "DFlash2 drafter checkpoint (SPEC=dflash2); with MODEL=tiny "
         "the tiny DFlash2 drafter beside the tiny model"),
    Knob("VISION", "0", "0|1", "1: serve images too (loads the vision tower and its encoder cache, "
         "VRAM the KV pool then lacks); 0: --language-model-only, text only", BOOL),
    Knob("TOOLS", "1", "0|1", "auto tool choice", BOOL),
    Knob("TOOL_PARSER", "qwen3_coder", "qwen3_coder|qwen3_xml|hermes", "tool-call parser",
         ("qwen3_coder", "qwen3_xml", "hermes")),
    Knob("REASONING_PARSER", "qwen3", "qwen3|none", "reasoning parser", ("qwen3", "none")),
    Knob("THINKING", "1", "0|1", "default enable_thinking in the chat template", BOOL),
    Knob("GDN_PREFILL", "", "triton|''", "GDN prefill backend (additional-config); set triton on H100/H200", ("", "triton")),
    Knob("WIDE_VERIFY", "1", "0|1", "1: spec-decode verify batches on TRITON_ATTN (int8/int4 KV) run the split-KV "
         "wide-verify kernel (patch 0070, docs/wide-verify.md); 0: stock kernel. Passed to the server as "
         "ONECARD_WIDE_VERIFY", BOOL),
    Knob("WIDE_DECODE", "auto", "auto|0|1", "plain decode batches (one token per request, none in its prompt) "
         "on TRITON_ATTN with int8/int4 KV also run the wide-verify kernel instead of stock unified_attention's "
         "decode path (H100, SPEC=off, int8 KV, 27B geometry: 16.88 -> 12.44 ms per step at 32k, 24.01 -> "
         "14.19 ms at 72k, the same greedy text; docs/wide-verify.md). auto / 1: int8 and int4 (stock int4 "
         "decode returned NaN on SmolLM2 until patch 0021 padded vLLM's hadacore calls; with it, 8 of 8 "
         "texts on an H100, 2026-12-06); 0: stock decode. Needs WIDE_VERIFY=1. Passed to the server as "
         "ONECARD_WIDE_DECODE (patch 0070)",
         ("auto", "0", "1")),
    Knob("MTP_DRAFT_WIDE", "1", "0|1", "SPEC=mtp: 1: the MTP layer's draft passes (its first pass of 1 + k "
         "tokens over the whole context, and with WIDE_DECODE its one-token steps) run the wide-verify kernel "
         "(patch 0087 hands the proposer the runner's is_prefilling; before it every draft pass ran stock "
         "unified_attention, 1.07 ms a step at 8k on an H200, growing with depth; H100, 27B geometry: 19.88 -> "
         "16.17 ms per step at 32k, 27.94 -> 18.83 ms at 72k, the same text); 0: stock, the A/B. Passed to the "
         "server as ONECARD_MTP_DRAFT_WIDE", BOOL),
    Knob("VERIFY_ROW_SPLIT", "auto", "auto|1|2", "wide-verify kernel: 2: a verify block of 9..16 tokens in two "
         "programs of half the query rows over the same keys, 4 warps each (two share an SM on Hopper; "
         "docs/wide-verify.md \"row split\": measured slower on an H100, int8 32k 243 vs 183 us); 1: one program; "
         "auto: 1. Passed to the server as ONECARD_VERIFY_ROW_SPLIT", ("auto", "1", "2")),
    Knob("VERIFY_FLAT_WORDS", "auto", "auto|0|1", "wide-verify kernel, int8/int4 KV: 1: a tile's K/V words "
         "loaded as one flat vector, staged in shared memory without the 16-way bank conflicts of the 2-D load "
         "(docs/wide-verify.md \"bank conflicts\"; H100 int8 32k: 182 -> 122 us a layer); 0: the 2-D load; "
         "auto: 1 on Hopper-class GPUs, 0 on sm_8x (a 3090 has not timed it; its flat launch spills a little "
         "more). Passed to the server as ONECARD_VERIFY_FLAT_WORDS", ("auto", "0", "1")),
    Knob("VERIFY_QK_INT8", "auto", "auto|0|1", "wide-verify kernel, int8 KV: 1: Q.K^T as an int8 x int8 dot "
         "(each query row quantized to int8 once, the key tile used as stored: no unpack of K, the int8 tensor "
         "rate; docs/wide-verify.md \"int8 Q.K^T\"). It adds a second quantization error beside the cache's, so "
         "greedy text may differ from 0. auto: 1 on Hopper-class GPUs (H100, 27B geometry, CTX=long: SPEC=mtp "
         "16.37 -> 14.70 ms per step at 32k, 17.67 -> 16.20 at 72k, SPEC=off 14.10 -> 13.43 at 72k, the same "
         "greedy text), 0 on sm_8x (a 3090 has not timed it: there 1 is the A/B); 0: the bf16 dot. Passed to "
         "the server as ONECARD_VERIFY_QK_INT8", ("auto", "0", "1")),
    Knob("GDN_SHARED_META", "1", "0|1", "1: one GDN attention-metadata build per step serves every GDN KV cache "
         "group (patch 0082; 10 groups beside a DFlash2 drafter, 3 otherwise); 0: stock, a build per group. "
         "Passed to the server as ONECARD_GDN_SHARED_META", BOOL),
    Knob("GDN_DEFER", "auto", "auto|0|1", "SPEC=mtp|dflash2: 1: the verify step keeps no GDN state per draft "
         "position (a small kernel commits the accepted state after the rejection sampler, patch 0085), so each "
         "resident sequence holds GDN groups x (1|2) state blocks instead of GDN groups x (1|2 + draft tokens) "
         "(CTX=long SPEC=dflash2: 20 instead of 90) and the pool holds KV in the blocks saved (the 3090 pin's "
         "CTX=long SPEC=dflash2 pool 71,140 -> 93,998 tokens); costs a verify scratch beside the KV pin (32 MB for "
         "the 27B at MAX_SEQS 4, 7 draft tokens), which the preflight counts; exact against SPEC=off and 2 % "
         "faster per step on an H100 (docs/gdn-defer.md); 0: stock vLLM, a state per draft position; auto: 1 "
         "with speculation on one GPU, 0 at TP>1 (not yet run on two GPUs). No effect with SPEC=off. Passed to "
         "the server as ONECARD_GDN_DEFER", ("auto", "0", "1")),
    Knob("KVARN_WINDOW", "3", "1|2|3", "KVarN KV (CTX=huge): tiles each query reads in fp16 up to its own (3: its own "
         "and the two previous ones; with KVARN_SINKS=2 served at +0.41 % perplexity vs bf16 on SmolLM2, H200, "
         "2026-12-04, against +0.65 % for 2 and 1; 2: its own and the previous one; 1: its own only; each step "
         "costs one fp16 tile per sequence in the stage, kvarn/README.md). Passed to the server as "
         "ONECARD_KVARN_WINDOW", ("1", "2", "3")),
    Knob("KVARN_SINKS", "2", "1|2", "KVarN KV (CTX=huge): leading tiles kept in fp16 as attention sinks (2: tiles 0 "
         "and 1; 1: tile 0 only, one fp16 tile per sequence less; kvarn/README.md). Passed to the server as "
         "ONECARD_KVARN_SINKS", ("1", "2")),
    Knob("KVARN_GRAPHS", "1", "0|1", "KVarN KV (CTX=huge): 1: single-token decode steps run as full CUDA graphs "
         "(the GDN layers too; 1.37x / 1.21x / 1.09x piecewise at 8k / 32k / 120k on the H200, 2026-12-04 session "
         "15); 0: piecewise graphs only, KVarN attention eager. Passed to the server as ONECARD_KVARN_GRAPHS", BOOL),
    Knob("KVARN_DRAFT_HOST", "1", "0|1", "KVarN KV (CTX=huge) with SPEC=mtp: 1: the MTP drafter's KVarN builds "
         "reuse the step's exact host seq_lens (2 device-to-host copies per step instead of 7; H200, 27B geometry, "
         "8k, 2026-12-04: 19.7 vs 24.5 ms per step, SPEC=mtp output still equal to SPEC=off on the tiny model); "
         "0: every drafter build copies seq_lens from the device. Passed to the server as "
         "ONECARD_KVARN_DRAFT_HOST", BOOL),
    Knob("PREFILL_LAUNCH", "auto", "auto|stock|BLOCK_M:TILE:WARPS:STAGES", "prefill launch of vLLM's Triton "
         "attention (TRITON_ATTN with int8 or bf16 KV) for query runs of >= 64 tokens (patch 0083): auto = the "
         "measured launch at head_dim 256 (128:32:8:1 int8, 64:32:4:2 bf16; CTX=long int8 TTFT at 120k tokens "
         "34.6 s against 132 s with vLLM's launch on the H200, 2026-12-04; both fit a 3090's shared memory), "
         "vLLM's elsewhere; stock = vLLM's (BLOCK_M 16 at head_dim 256); or one launch for every shape: BLOCK_M "
         "and TILE powers of two 16..256, WARPS 2|4|8|16, STAGES 1..5 (a launch that does not fit the GPU falls "
         "back to vLLM's with a warning). Passed to the server as ONECARD_PREFILL_LAUNCH"),
    Knob("KVARN_PRESET", "k4v2_g128", "k4v2_g128|k4v4_g128|k4v2_g64", "KVarN KV (CTX=huge) bit widths and "
         "group: k4v2_g128 (default; 4-bit K, 2-bit V, the largest pool) or k4v4_g128 (4-bit V: SmolLM2 ppl "
         "-0.015 % vs bf16 served on a GPU, k4v2_g128 +0.55 % in the same run; ~20 % fewer pool tokens; "
         "docs/measurements.md, 2026-12-04 session 14); the server gets --kv-cache-dtype kvarn_<preset>",
         ("k4v2_g128", "k4v4_g128", "k4v2_g64")),
    Knob("WARMUP", "1", "0|1", "1: once the server answers /health the launcher's detached helper sends a few "
         "greedy and sampled requests (short ones, and twice a prompt of 1.5 prefill chunks: the prefill over a "
         "cached prefix and a prefix-cache hit), so the first real request does not compile vLLM's or onecard's "
         "Triton kernels (onecard/warmup.py); 0: none", BOOL),
    Knob("CARD_GIB", "", "1..2048, or '' (ask nvidia-smi at launch)",
         "the GPU's memory the preflight fits the plan into (weights + drafter + reserves + KV pin); '': "
         "nvidia-smi's memory.total of the first visible GPU at a real launch, less what other processes "
         "already hold there (memory.used: a desktop, another server; 64 MiB or more), a 24 GiB note in --dry-run"),
    Knob("VRAM_CHECK", "1", "0|1", "1: when the plan does not fit the card (CARD_GIB or nvidia-smi), a profile's "
         "KV_MEM pin is lowered to what fits and an explicit KV_MEM is refused; 0: a note only (the reserves "
         "are 3090 estimates)", BOOL),
    Knob("EXTRA_ARGS", "", "shell words", "appended last to vllm serve"),
    Knob("VLLM_API_KEY", "", "string", "API key (or .env, or api_key.txt mode 0600); never printed"),
]}


# The GEMM kernels an RTX 3090 (sm_86) runs, chosen on a Hopper GPU (the lent H200) for side-by-side
# figures: vLLM 0.27.1 picks Machete for the W4A16 GEMMs on sm_90 (Marlin on a 3090), and for FP8
# linears (DRAFT_QUANT=fp8) a block-scaled W8A8 kernel (DeepGEMM / CUTLASS) where a 3090 runs
# Marlin's W8A16 (model_executor/kernels/linear: is_supported_and_can_implement_kernel reads
# VLLM_DISABLED_KERNELS; MarlinFP8ScaledMMLinearKernel needs VLLM_TEST_FORCE_FP8_MARLIN=1 on
# sm_89+; it also sends FP8 / NVFP4 MoE layers to Marlin, which the dense 27B has none of). Used by
# GPU jobs 41 (FIT_GEMM=marlin), 80 (REF_GEMM=marlin), 31 (an arm's GEMM=ampere) and 70 (d2k7).
AMPERE_GEMM_ENV: dict[str, str] = {
    "VLLM_DISABLED_KERNELS": "MacheteLinearKernel,FlashInferFp8DeepGEMMDynamicBlockScaledKernel,"
                             "DeepGemmFp8BlockScaledMMKernel,CutlassFp8BlockScaledMMKernel",
    "VLLM_TEST_FORCE_FP8_MARLIN": "1",
}


# Knobs the launcher hands to the server under a variable of its own (onecard.plan sets these in the
# child environment, so an exported variable of the same name never wins over the knob).
SERVER_ENV: dict[str, str] = {
    "WIDE_VERIFY": "ONECARD_WIDE_VERIFY", "WIDE_DECODE": "ONECARD_WIDE_DECODE",
    "MTP_DRAFT_WIDE": "ONECARD_MTP_DRAFT_WIDE",
    "VERIFY_ROW_SPLIT": "ONECARD_VERIFY_ROW_SPLIT", "VERIFY_FLAT_WORDS": "ONECARD_VERIFY_FLAT_WORDS",
    "VERIFY_QK_INT8": "ONECARD_VERIFY_QK_INT8",
    "GDN_SHARED_META": "ONECARD_GDN_SHARED_META",
    "PREFILL_LAUNCH": "ONECARD_PREFILL_LAUNCH", "DFLASH_RING": "ONECARD_DFLASH_RING",
    "LOOKUP_LANE": "ONECARD_DFLASH_LANE", "KVARN_WINDOW": "ONECARD_KVARN_WINDOW",
    "KVARN_SINKS": "ONECARD_KVARN_SINKS", "KVARN_GRAPHS": "ONECARD_KVARN_GRAPHS",
    "KVARN_DRAFT_HOST": "ONECARD_KVARN_DRAFT_HOST", "EMBED_HOST": "ONECARD_EMBED_HOST",
    "GDN_DEFER": "ONECARD_GDN_DEFER",
}


def knob_overrides(words, what: str = "knob override") -> dict[str, str]:
    """``KNOB=VALUE`` words (launcher knobs laid over a job's own, e.g. SPEC_KV_KNOBS of
    tests/gpu/spec_kv_sweep.py, an arm's fields in gpu/jobs/61-kvarn-serve.py) -> {knob: value},
    the last word winning. The one rule for such words: KNOB is a name of KNOBS and VALUE is not
    empty (the plan checks the value itself, with its own one-line error). Otherwise ValueError,
    one line: ``<what> '<word>' is not valid; valid: ...`` naming every knob."""
    out = {}
    for word in words:
        k, sep, v = word.partition("=")
        if not sep or not v or k not in KNOBS:
            raise ValueError(f"{what} {word!r} is not valid; valid: KNOB=VALUE with a non-empty VALUE and KNOB "
                             f"a launcher knob ({', '.join(KNOBS)})")
        out[k] = v
    return out


# Server environment at TP > 1: NVLink multicast off in NCCL, PyTorch's symmetric memory and
# NVSHMEM, and vLLM's symm-mem all-reduce (its only user of multicast) not tried. Why: the lent
# multi-GPU hosts require it (/work/.library/device/KINDS.md, nvidia-h200-x2: "a program that uses
# it can put the host's GPUs, which others share, out of service for a day or more"), and vLLM
# 0.27.1 would otherwise create multicast objects itself (distributed/device_communicators/
# symm_mem.py and custom_all_reduce.py call torch symm_mem.rendezvous, which makes one unless
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1). On consumer cards there is no NVLink multicast to lose.
TP_CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}

FEATURE_MARKERS = {"kvarn": "kvarn_installed.txt", "dflash2": "dflash2_installed.txt"}
FEATURE_INSTALL = {  # what is missing and how to get it, for the launcher's one-line refusal
    "kvarn": "the KVarN KV cache is not installed into this vLLM: run ./install.sh --kvarn (or kvarn/install.sh)",
    "dflash2": "patch 0080 (DFlash2) is not applied to this vLLM: run ./install.sh (it applies patches/series; or venv/bin/onecard patches apply)",
}


def _feature_marker(name: str):
    """Path of the feature's marker inside the installed vllm package, or None. Found with
    importlib.util.find_spec: vllm is not imported."""
    import importlib.util
    from pathlib import Path

    marker = FEATURE_MARKERS[name]
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return next((Path(p) / marker for p in spec.submodule_search_locations if (Path(p) / marker).is_file()), None)


def vllm_importable() -> bool:
    """Whether this Python finds a ``vllm`` package at all (importlib.util.find_spec; not imported)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    return spec is not None


def no_vllm_message() -> str:
    """The one-line refusal when this Python has no vLLM: which Python, and how to point at one."""
    import sys

    return (f"no vLLM is installed for {sys.executable or 'python3'}: run ./install.sh (it makes ./venv, which "
            "./start_qwen.sh uses), or set VENV=DIR for a venv made with ./install.sh --venv DIR")


def feature_installed(name: str) -> bool:
    """A later feature (KVarN, DFlash2) is present when its installer left the marker file
    ``vllm/<name>_installed.txt`` inside the installed vllm package (kvarn/install.sh writes
    ``kvarn_installed.txt``)."""
    return _feature_marker(name) is not None


@contextmanager
def pretend_installed(directory):
    """Inside the block every optional feature (KVarN, DFlash2) counts as installed into vLLM, for
    this process only: each feature's marker file in ``directory`` (KVarN's with the current
    installer's text, so it is not stale) and ``importlib.util.find_spec("vllm")`` answering with
    that directory; every other lookup is the real one. For dry runs and tests on a machine
    without them (scripts/profile_table.py, gpu/lib/fit.py, tests/conftest.py fake_features)."""
    import importlib.util
    import types
    from pathlib import Path

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for name, marker in FEATURE_MARKERS.items():
        text = "1"
        if name == "kvarn":
            try:  # KVarN's marker records hashes of its patch series, which takes unidiff to read
                from onecard.kvarn.installer import marker_text

                text = marker_text()
            except ImportError:
                continue  # without unidiff KVarN stays 'not installed' (CTX=huge refused)
        (d / marker).write_text(text)
    fake = types.SimpleNamespace(submodule_search_locations=[str(d)])
    real = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a, **k: fake if name == "vllm" else real(name, *a, **k)
    try:
        yield d
    finally:
        importlib.util.find_spec = real


def feature_stale(name: str) -> str:
    """What of an installed feature differs from this checkout ('' when nothing does, or when it
    is not installed). Only KVarN's marker records its sources (a hash per copied file and of
    kvarn/series): after an update of onecard the vLLM copy keeps running the old code until
    kvarn/install.sh runs again."""
    if name != "kvarn":
        return ""
    marker = _feature_marker(name)
    if marker is None:
        return ""
    from onecard.kvarn.installer import marker_text

    have, want = marker.read_text(encoding="utf-8", errors="replace"), marker_text()
    if have == want:
        return ""
    diff = set(have.splitlines()) ^ set(want.splitlines())
    names = sorted({line.split()[-1].rsplit("/", 1)[-1] for line in diff if "  vllm/" in line})
    if any(line.startswith("series ") for line in diff):
        names.append("kvarn/series")
    return ", ".join(names) or "its marker"


def kvarn_installed() -> bool:
    return feature_installed("kvarn")


def render_readme() -> str:
    """single-user/README.md, generated (tests check the committed file equals this)."""
    lines = [
        "# single-user: one seat, 256k context",
        "",
        "<!-- generated by onecard.profiles.render_readme(); edit profiles.py, then run",
        "     python -c 'from onecard.profiles import write_readme; write_readme()' -->",
        "",
        "`alternative.sh` starts the server with int4 per-token-head KV and MAX_LEN 256,000 for",
        "a single user:",
        "",
        "| knob | value |",
        "|---|---|",
    ]
    lines += [f"| `{k}` | `{v}` |" for k, v in SINGLE_USER.items()]
    lines += ["", "Any knob below can still be set in the environment or in `.env`.", "",
              "## Every knob", "", "| knob | default | valid | what |", "|---|---|---|---|"]
    for k in KNOBS.values():
        lines.append(f"| `{k.name}` | `{k.default}` | {k.valid} | {k.doc} |")
    lines += ["", "## CTX profiles", "", "| CTX | KV | max_len | MAX_SEQS | backend | KV_MEM pin | needs | note |",
              "|---|---|---|---|---|---|---|---|"]
    for p in CTX_PROFILES.values():
        lines.append(f"| {p.name} | {p.kv} | {p.max_len:,} | {p.max_seqs} | {p.attention_backend or 'default'} | "
                     f"{p.kv_mem:,} | {p.needs or '-'} | {p.doc} |")
    lines += ["", "## SPEC profiles", "", "| SPEC | method | k (fast/long/huge) | k range | needs | note |",
              "|---|---|---|---|---|---|"]
    for s in SPEC_PROFILES.values():
        ks = "/".join(str(s.k_default[c]) for c in CTX_PROFILES)
        lines.append(f"| {s.name} | {s.method or '-'} | {ks} | {s.k_range[0]}..{s.k_range[1]} | {s.needs or '-'} | {s.doc} |")
    return "\n".join(lines) + "\n"


def write_readme(path: str = "single-user/README.md") -> None:
    import os
    import tempfile

    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".readme.")
    with os.fdopen(fd, "w") as f:
        f.write(render_readme())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def single_user_exports() -> str:
    """Shell lines for single-user/alternative.sh: each SINGLE_USER value unless already set."""
    import shlex

    return "\n".join(f': "${{{k}:={shlex.quote(v)}}}"; export {k}' for k, v in SINGLE_USER.items())
