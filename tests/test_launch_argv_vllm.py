"""Every launcher profile's argv parses with vLLM 0.27.1's own `vllm serve` parser, and the values
land where we mean them: a wrong flag name fails here, not after a five-minute boot."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden" / "launch"


@pytest.mark.parametrize("golden", sorted(GOLDEN.glob("*.txt")), ids=lambda p: p.stem)
def test_golden_argv_parses_with_vllm(golden, monkeypatch):
    pytest.importorskip("vllm")
    import vllm.config.device as device

    monkeypatch.setattr(device.DeviceConfig, "__post_init__", lambda self: None)  # no GPU here
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = shlex.split(golden.read_text())
    if golden.stem.startswith("huge"):  # KVarN's dtype exists only once kvarn/install.sh patched vLLM
        i = argv.index("--kv-cache-dtype") + 1
        assert argv[i] == "kvarn_k4v2_g128"
        argv[i] = "auto"
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[argv.index("serve") + 1:])
    args = AsyncEngineArgs.from_cli_args(ns)
    assert ns.host == "127.0.0.1" and args.language_model_only
    if golden.stem.endswith("-tp2"):  # TP>1: vLLM's own TP, no per-GPU byte pin, pool from GPU_UTIL
        assert args.tensor_parallel_size == 2 and args.kv_cache_memory_bytes is None
        assert args.gpu_memory_utilization == float(argv[argv.index("--gpu-memory-utilization") + 1])
    else:
        assert args.tensor_parallel_size == 1
        assert args.kv_cache_memory_bytes == int(argv[argv.index("--kv-cache-memory-bytes") + 1])
    assert args.max_model_len == int(argv[argv.index("--max-model-len") + 1])
    assert args.enable_prefix_caching and args.mamba_cache_mode == "align"
    if "--speculative-config" in argv:
        assert args.speculative_config == json.loads(argv[argv.index("--speculative-config") + 1])
    if golden.stem.startswith("long"):
        assert args.kv_cache_dtype == "int8_per_token_head"
        assert str(args.attention_backend).endswith("TRITON_ATTN")
    assert ns.tool_call_parser == "qwen3_coder" and ns.reasoning_parser == "qwen3"
