"""Prefix caching of the hybrid model in vLLM 0.27.1 (--mamba-cache-mode align), on CPU.

Drives vLLM's own KVCacheManager (hybrid coordinator, FullAttentionManager, MambaManager in
'align' mode, BlockPool) and the scheduler's own chunk splitter
(``Scheduler._mamba_block_aligned_split``) the way the scheduler does for job 10's residue sweep
(tests/gpu/test_serve_suite.py: 128 prompts of 512..639 tokens sent at once, 20 greedy tokens
each, then all again), with the pools onecard.memory predicts for the tiny model at KV_MEM=512M.
It reproduces the GPU finding of 2026-12-02 (docs/prefix-cache.md):

* int8 KV, SPEC=off: 51,200 hit tokens in pass 2 (one 400-token block per prompt), as on the H200;
* SPEC=mtp, int8 KV: 0 by construction (EAGLE drop: prompts <= 2 blocks never hit);
* SPEC=mtp, bf16 KV and bf16 SPEC=off: hits possible (29,536 / 55,952 tokens with an unbounded
  pool), but the 420 / 630-block pools are smaller than pass 1's cached footprint, and a resend
  of a working set larger than an LRU cache evicts each prompt's blocks before it comes back.
"""
from __future__ import annotations

import collections
import random
import sys
import types
from pathlib import Path

import pytest

from onecard import memory
from onecard import plan as P
from onecard.prepare.tiny import DEFAULT_SPEC, make_config

torch = pytest.importorskip("torch")
vllm_kvm = pytest.importorskip("vllm.v1.core.kv_cache_manager")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from gpu_suite_lib import ideal_prefix_hit  # noqa: E402  (the GPU suite's hit rule)
sys.path.pop(0)

SWEEP_BASE, MODULUS, SWEEP_TOKENS = 512, 128, 20     # tests/gpu/test_serve_suite.py
KV_MEM = 512 * memory.MiB                            # tests/gpu/conftest.py TINY_KNOBS
UNBOUNDED = 100_000


def tiny_geometry() -> memory.ModelGeometry:
    ids = {t: i for i, t in enumerate(["<|im_end|>", "<|image_pad|>", "<|video_pad|>",
                                       "<|vision_start|>", "<|vision_end|>"])}
    return memory.ModelGeometry.from_config(make_config(DEFAULT_SPEC, ids))


def job10_pool(kv: str, k: int) -> memory.PoolPrediction:
    return memory.predict_pool(tiny_geometry(), KV_MEM, kv, 2048, k, prefix_cache=True)


def sweep_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)     # distinct random ids: prompts share no prefix, as in the job
    return [[rng.randrange(10, 4000) for _ in range(SWEEP_BASE + r)] for r in range(MODULUS)]


class Sweep:
    """vLLM's KV cache manager for one pool, driven like the scheduler (decode first, then
    admissions FIFO up to max_seqs, chunks split by the scheduler's own align splitter, one
    token per decode step: a random tiny model's drafts are rejected)."""

    def __init__(self, pool: memory.PoolPrediction, max_seqs: int, num_blocks: int | None = None,
                 budget: int = 2048):
        init_none_hash(sha256)
        self.k = pool.num_spec
        self.block = pool.block_size
        attn = KVCacheGroupSpec(["attn"], FullAttentionSpec(block_size=self.block, num_kv_heads=2,
                                                            head_size=256, dtype=torch.bfloat16))
        gdn = [KVCacheGroupSpec([f"gdn{g}"], MambaSpec(
            block_size=self.block, shapes=((16,),), dtypes=(torch.float32,),
            mamba_cache_mode="align", num_speculative_blocks=self.k)) for g in range(pool.gdn_groups)]
        cfg = KVCacheConfig(num_blocks=num_blocks or pool.num_blocks, kv_cache_tensors=[],
                            kv_cache_groups=[attn, *gdn])
        # Scheduler.__init__ passes use_eagle=SpeculativeConfig.use_eagle() (True for mtp and
        # dflash); no group of this model is flagged is_eagle_group, so all groups get the drop.
        self.m = vllm_kvm.KVCacheManager(cfg, max_model_len=2048, scheduler_block_size=self.block,
                                         hash_block_size=self.block, enable_caching=True,
                                         use_eagle=self.k > 0, log_stats=True)
        self.fake_sched = types.SimpleNamespace(
            cache_config=types.SimpleNamespace(block_size=self.block), use_eagle=self.k > 0,
            max_num_scheduled_tokens=budget, hash_block_size=self.block, mamba_partial_cache_hit=False,
            scheduler_config=types.SimpleNamespace(long_prefill_token_threshold=0))
        self.hasher = get_request_block_hasher(self.block, sha256)
        self.max_seqs, self.budget = max_seqs, budget
        self.chunks: dict[str, list[int]] = {}

    def split(self, r: Request, n: int, hit: int) -> int:
        return Scheduler._mamba_block_aligned_split(self.fake_sched, r, n, hit)

    def one_pass(self, prompts: list[list[int]], tag: str) -> list[int]:
        """Every prompt queued at once; returns the prefix-cache hit tokens of each."""
        m, k = self.m, self.k
        waiting = collections.deque(
            Request(f"{tag}-{i}", ids, SamplingParams(max_tokens=SWEEP_TOKENS), None, block_hasher=self.hasher)
            for i, ids in enumerate(prompts))
        running: list[Request] = []
        hits: dict[str, int] = {}
        while waiting or running:
            m.new_step_starts()
            tokens, sched = self.budget, []
            for r in running:
                if r.num_computed_tokens >= r.num_prompt_tokens:        # decode: 1 + k tokens
                    assert m.allocate_slots(r, 1 + k, num_lookahead_tokens=k) is not None
                    sched.append((r, 1 + k))
                    tokens -= 1 + k
                else:                                                    # next prefill chunk
                    n = self.split(r, min(r.num_tokens - r.num_computed_tokens, tokens), 0)
                    if n > 0 and m.allocate_slots(r, n, num_lookahead_tokens=k) is not None:
                        sched.append((r, n))
                        tokens -= n
            while waiting and len(running) < self.max_seqs and tokens > 0:
                r = waiting[0]
                blocks, hit, _ = m.get_computed_blocks(r)
                n = self.split(r, min(r.num_tokens - hit, tokens), hit)
                if n <= 0 or m.allocate_slots(r, n, hit, blocks, num_lookahead_tokens=k) is None:
                    break
                waiting.popleft()
                r.status = RequestStatus.RUNNING
                hits[r.request_id] = hit
                r.num_computed_tokens = hit
                self.chunks[r.request_id] = []
                running.append(r)
                sched.append((r, n))
                tokens -= n
            for r, n in sched:
                if r.num_computed_tokens >= r.num_prompt_tokens:
                    r.num_computed_tokens += 1                           # drafts rejected
                    r.append_output_token_ids(7)
                else:
                    self.chunks[r.request_id].append(n)
                    r.num_computed_tokens += n
                    if r.num_computed_tokens >= r.num_prompt_tokens:
                        r.append_output_token_ids(7)
            for r in [r for r in running if len(r.output_token_ids) >= SWEEP_TOKENS]:
                running.remove(r)
                m.free(r)
        return [hits[f"{tag}-{i}"] for i in range(len(prompts))]

    def cached_blocks(self) -> int:
        return sum(b.block_hash is not None for b in self.m.block_pool.blocks)


def ideal_hit(L: int, block: int, eagle: bool) -> int:
    """What a resend of a prompt of L tokens can hit in 0.27.1 align mode with nothing evicted:
    the GPU suite's rule (tests/gpu/gpu_suite_lib.ideal_prefix_hit), which these tests check
    against vLLM's own manager."""
    return ideal_prefix_hit(L, block, eagle)


def run_job10(kv: str, k: int, max_seqs: int, num_blocks: int | None = None) -> tuple[Sweep, list[int], list[int]]:
    s = Sweep(job10_pool(kv, k), max_seqs, num_blocks)
    prompts = sweep_prompts()
    return s, s.one_pass(prompts, "p1"), s.one_pass(prompts, "p2")


# --------------------------------------------------------------------------- the pools

def test_job10_pools_as_predicted():
    """Block sizes as the H200 logged them (208 bf16, 400 int8); the block counts the tests use."""
    got = {(kv, k): (p.block_size, p.num_blocks, p.gdn_groups)
           for kv, k in (("bf16", 0), ("bf16", 4), ("int8_per_token_head", 0), ("int8_per_token_head", 3))
           for p in [job10_pool(kv, k)]}
    assert got == {("bf16", 0): (208, 630, 3), ("bf16", 4): (208, 420, 2),
                   ("int8_per_token_head", 0): (400, 645, 3), ("int8_per_token_head", 3): (400, 430, 2)}


def test_ideal_hits_formula():
    lengths = range(SWEEP_BASE, SWEEP_BASE + MODULUS)
    assert sum(ideal_hit(L, 208, False) for L in lengths) == 55_952      # ~269 blocks
    assert sum(ideal_hit(L, 400, False) for L in lengths) == 51_200      # one block each
    assert sum(ideal_hit(L, 208, True) for L in lengths) == 29_536
    assert sum(ideal_hit(L, 400, True) for L in lengths) == 0            # <= 2 blocks: never


# --------------------------------------------------------------------------- vLLM's manager

@pytest.mark.parametrize("kv,k,max_seqs,eagle_chunk", [("bf16", 0, 8, 416), ("bf16", 4, 8, 208)])
def test_unbounded_pool_hits_exactly_the_ideal(kv, k, max_seqs, eagle_chunk):
    """With room for everything, vLLM's manager hits exactly ideal_hit per prompt; the first
    prefill chunk stops at the one cached GDN boundary (one block earlier under speculation)."""
    s, p1, p2 = run_job10(kv, k, max_seqs, UNBOUNDED)
    assert sum(p1) == 0
    assert p2 == [ideal_hit(L, s.block, k > 0) for L in range(SWEEP_BASE, SWEEP_BASE + MODULUS)]
    assert s.chunks["p1-0"] == [eagle_chunk, SWEEP_BASE - eagle_chunk]


def test_int8_off_job10_pool_hits_one_block_per_prompt():
    """The H200 figure: 51,200 = 128 x 400. Pass 1's cached footprint (1 attention block + 3 GDN
    states per prompt = 512 blocks) fits the 645-block pool."""
    s, _, p2 = run_job10("int8_per_token_head", 0, 4)
    assert p2 == [400] * MODULUS and sum(p2) == 51_200


def test_mtp_int8_never_hits():
    """SPEC=mtp (k=3), int8 KV, 400-token blocks: 0 as on the H200, with any pool size."""
    for blocks in (None, UNBOUNDED):
        _, _, p2 = run_job10("int8_per_token_head", 3, 4, blocks)
        assert sum(p2) == 0


@pytest.mark.parametrize("kv,k,ideal", [("bf16", 0, 55_952), ("bf16", 4, 29_536)])
def test_bf16_job10_pools_thrash(kv, k, ideal):
    """bf16, 208-token blocks: pass 1 leaves more cached blocks than the pool has, so the
    in-order resend finds (almost) every prompt evicted: H200 2,496 (off) and 0 (mtp); here 0 for
    both (the order of 128 concurrent HTTP requests is not modelled). A pool ~30% larger hits the
    ideal: an LRU cliff, not a missing feature."""
    s, _, p2 = run_job10(kv, k, 8)
    assert sum(p2) <= 0.05 * ideal
    big, _, p2_big = run_job10(kv, k, 8, 2 * s.m.block_pool.num_gpu_blocks)
    assert sum(p2_big) == ideal
    # the cached footprint of one pass exceeds the job-10 pool
    one = Sweep(job10_pool(kv, k), 8, UNBOUNDED)
    one.one_pass(sweep_prompts(), "p1")
    assert one.cached_blocks() > job10_pool(kv, k).num_blocks


# --------------------------------------------------------------------------- preflight notes

def test_preflight_note_spec(tmp_path):
    plan = P.make_plan({"CTX": "fast", "SPEC": "mtp"}, tmp_path, python="python3")
    note = [n for n in plan.notes if n.startswith("PREFIX_CACHE=1 with SPEC=mtp")]
    b = memory.attention_block_size(memory.QWEN38_27B, "bf16", 4)
    assert len(note) == 1 and f"prompts of <= {2 * b:,} tokens never hit" in note[0]
    off = P.make_plan({"CTX": "fast", "SPEC": "off"}, tmp_path, python="python3")
    assert not [n for n in off.notes if n.startswith("PREFIX_CACHE=1 with SPEC")]
    nocache = P.make_plan({"CTX": "fast", "SPEC": "mtp", "PREFIX_CACHE": "0"}, tmp_path, python="python3")
    assert not [n for n in nocache.notes if "prefix" in n.lower()]


def test_preflight_note_capacity(tmp_path):
    plan = P.make_plan({"CTX": "fast", "SPEC": "off"}, tmp_path, python="python3")
    pred = plan.prediction
    cap = [n for n in plan.notes if n.startswith("prefix cache:")]
    per = 4096 // pred["block_size"] + pred["gdn_groups"]
    assert len(cap) == 1 and f"about {pred['num_blocks'] // per} prompts of 4,096 tokens" in cap[0]


def test_capacity_note_matches_job10_outcome():
    """The note's rule (floor(L/B) attention blocks + G state blocks per cached prompt) puts the
    job-10 int8 sweep (~1 + 3 blocks) inside its pool and the bf16 one (~2.2 + 3) outside."""
    for kv, fits in (("int8_per_token_head", True), ("bf16", False)):
        p = job10_pool(kv, 0)
        need = sum(L // p.block_size + p.gdn_groups for L in range(SWEEP_BASE, SWEEP_BASE + MODULUS))
        assert (need <= p.num_blocks) is fits


# --------------------------------------------------------------------------- the GPU suite's sweep
def _suite_constants() -> tuple[int, int]:
    """SWEEP_BASE of tests/gpu/test_serve_suite.py and KV_MEM (GiB) of tests/gpu/conftest.py, read
    from the files (importing them needs the GPU suite's fixtures)."""
    import re

    gpu = Path(__file__).resolve().parent / "gpu"
    base = int(re.search(r"^SWEEP_BASE = (\d+)", (gpu / "test_serve_suite.py").read_text(), re.M)[1])
    kv = int(re.search(r'"KV_MEM": "(\d+)G"', (gpu / "conftest.py").read_text())[1])
    return base, kv


@pytest.mark.parametrize("kv,k,max_seqs", [("bf16", 0, 8), ("bf16", 4, 8),
                                           ("int8_per_token_head", 0, 4), ("int8_per_token_head", 3, 4)])
def test_gpu_suite_sweep_hits_its_ideal(kv, k, max_seqs, monkeypatch):
    """The suite's residue sweep as it is configured now: every bf16/int8 server, SPEC=mtp
    included, hits its ideal in pass 2 (no LRU cliff, and prompts long enough that speculation
    still leaves a block), and the suite's own prediction (test_serve_suite.predicted_hit_tokens,
    read here from its rule) equals ideal_hit."""
    base, kv_gib = _suite_constants()
    monkeypatch.setattr(sys.modules[__name__], "SWEEP_BASE", base)
    pool = memory.predict_pool(tiny_geometry(), kv_gib << 30, kv, 2048, k, prefix_cache=True)
    s = Sweep(pool, max_seqs)
    prompts = sweep_prompts()
    s.one_pass(prompts, "p1")
    hits = s.one_pass(prompts, "p2")
    ideal = [ideal_hit(len(p), pool.block_size, k > 0) for p in prompts]
    assert hits == ideal and sum(ideal) > 0


def test_suite_prediction_is_the_ideal_rule():
    """tests/gpu/test_serve_suite.predicted_hit_tokens (what the GPU suite prints next to the
    measured hits) is ideal_hit summed, for both block sizes and with/without speculation."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
    try:
        import test_serve_suite as suite
    finally:
        sys.path.pop(0)
    lengths = list(range(300, 1400, 7)) + [416, 832, 1040, 1200]
    for block in (112, 208, 400, 416):
        for spec in (False, True):
            assert suite.predicted_hit_tokens(lengths, block, spec) == \
                sum(ideal_hit(n, block, spec) for n in lengths)
    assert suite.predicted_hit_tokens(lengths, None, True) is None
