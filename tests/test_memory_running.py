"""PoolPrediction.one_sequence_tokens(chunk=...): the longest sequence that runs alone without vLLM
preempting it, against vLLM 0.27.1's own AsyncScheduler and KVCacheManager on the CPU
(tests/mamba_align_sim.py, with the patch series' view: patch 0086 frees the superseded GDN state
blocks). The start-up figure (no chunk) is what vLLM's own check admits; the running one also counts
the block pool's null block and, under async scheduling, one more state block per GDN group while a
step is in flight. A helper's simulation of every profile (2026-12-05) found the headline
CTX=long SPEC=dflash2 at its old MAX_LEN 93,696 preempting prompts above 90,488 tokens 2-10 times:
the plans now cap MAX_LEN at the running figure (90,368)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onecard import memory, patching

SIM = Path(__file__).with_name("mamba_align_sim.py")


def _pool(blocks: int) -> memory.PoolPrediction:
    """The CTX=fast layout the simulation builds: one attention group and 3 GDN groups of 16
    layers on 784-token blocks, 2 state blocks per GDN group (align mode), ``blocks`` in the pool."""
    return memory.PoolPrediction(
        kv="bf16", max_len=65536, num_spec=0, prefix_cache=True, kv_mem_bytes=0, block_size=784, page_bytes=0,
        group_size=16, gdn_groups=3, num_blocks=blocks, blocks_per_request=0, pool_tokens=0, max_concurrency=0.0,
        state_slots_per_seq=6, attn_groups=((1, 784),))


def test_running_figure_counts_the_null_block_the_in_flight_state_and_lookahead():
    p = _pool(30)
    assert p.one_sequence_tokens() == (30 - 6) * 784                      # vLLM's start-up check
    assert p.one_sequence_tokens(chunk=2048) == (30 - 6 - 1 - 3) * 784    # + null block + 3 in-flight states
    assert p.one_sequence_tokens(chunk=512) == (30 - 6 - 1) * 784         # a block over the chunk: no extra
    assert p.one_sequence_tokens(chunk=2048, lookahead=8) == 20 * 784 - 8


@pytest.fixture(scope="module")
def series_site(vllm_dir, tmp_path_factory):
    return patching.overlay(vllm_dir, tmp_path_factory.mktemp("series"))


def _sim(site: Path, model: Path, prompt: int, max_tokens: int, blocks: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(SIM), "--model-dir", str(model), "--prompts", str(prompt), "--async",
                          "--max-tokens", str(max_tokens), "--blocks", str(blocks)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_vllms_async_scheduler_agrees(series_site, tmp_path):
    """30 blocks: the running figure (15,680 tokens) runs without preemption, one block more is
    preempted, and the start-up figure (18,816) would have been admitted and preempted."""
    run = _pool(30).one_sequence_tokens(chunk=2048)
    assert run == 15_680
    fits = _sim(series_site, tmp_path, run - 64, 64, 30)
    assert fits["preemptions"] == {} and fits["unfinished"] == []
    over = _sim(series_site, tmp_path, run + 784 - 64, 64, 30)
    assert over["preemptions"].get("r0", 0) >= 1 and over["unfinished"] == []
