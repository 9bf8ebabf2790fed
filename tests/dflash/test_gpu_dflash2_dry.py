"""CPU dry run of the GPU job 70-dflash2 (tests/gpu/test_dflash2.py --dry-run): the tiny model and
drafter build, every server argv comes from the launcher plan and parses with vLLM 0.27.1's own
serve parser, and the analysis (2-ulp near-tie rule, /metrics parsing, chi-square) self-checks."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import check_job_contract

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "gpu" / "test_dflash2.py"
JOB = REPO / "gpu" / "jobs" / "70-dflash2.sh"


def test_job_header_and_syntax():
    check_job_contract(JOB)


@pytest.fixture(scope="module")
def dry(tmp_path_factory, patched_site):
    """The driver on the patched overlay (the series with 0080: the dflash2 marker exists)."""
    if not (patched_site / "vllm" / "dflash2_installed.txt").is_file():
        pytest.skip("patches/series does not list 0080-dflash2.patch")
    d = tmp_path_factory.mktemp("dry")
    env = dict(os.environ, MODELS=str(d / "models"),
               PYTHONPATH=os.pathsep.join([str(patched_site), str(REPO)]))
    p = subprocess.run([sys.executable, str(DRIVER), "--dry-run", "--out", str(d / "out")],
                       env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    return p


def test_dry_run_passes(dry):
    assert dry.returncode == 0, dry.stdout[-3000:] + dry.stderr[-3000:]
    assert "[dflash2] dry run PASS" in dry.stdout


def test_server_argv_parse_with_vllm(dry, monkeypatch):
    pytest.importorskip("vllm")
    import vllm.config.device as device

    monkeypatch.setattr(device.DeviceConfig, "__post_init__", lambda self: None)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    lines = {m.group(1): m.group(2) for m in re.finditer(r"^\[dflash2\] argv (\S+): (.*)$",
                                                         dry.stdout, re.M)}
    assert set(lines) == {"off", "d2k7", "d2k15"}
    for name, line in lines.items():
        argv = shlex.split(line)
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[argv.index("serve") + 1:])
        args = AsyncEngineArgs.from_cli_args(ns)
        assert args.enable_prefix_caching and args.mamba_cache_mode == "align"
        assert args.language_model_only and args.additional_config == {"gdn_prefill_backend": "triton"}
        if name == "off":
            assert args.speculative_config is None
        else:
            sc = args.speculative_config
            assert sc["method"] == "dflash2" and sc["model"].endswith("qwen35-tiny-dflash2")
            assert sc["num_speculative_tokens"] == (7 if name == "d2k7" else 15)
            assert sc.get("draft_sample_method", "greedy") == (
                "probabilistic" if name == "d2k15" else "greedy")
            # d2k7: the FP8 drafter (DRAFT_QUANT=fp8); d2k15 keeps the stored bf16
            assert sc.get("dflash2_draft_quant") == ("fp8_per_block" if name == "d2k7" else None)
