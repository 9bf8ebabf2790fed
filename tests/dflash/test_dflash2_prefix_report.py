"""tests/gpu/test_dflash2.py's cached-pass prefix report and sampled checks on the CPU: hits read from /metrics beside
the whole-block prediction, a shortfall said as a finding."""
from __future__ import annotations

import sys
from pathlib import Path

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "gpu"))
import test_dflash2 as T  # noqa: E402
from gpu_suite_lib import ideal_prefix_hit  # noqa: E402


class FakeServer:
    def __init__(self, tmp: Path, name: str, block: int, hits: float):
        self.log = tmp / f"server-{name}.log"
        self.log.write_text(f"INFO [interface.py:911] Setting attention block size to {block} tokens to ...\n")
        self.hits = hits

    def metrics_text(self) -> str:
        return f'vllm:prefix_cache_hits_total{{engine="0"}} {self.hits}\nvllm:prefix_cache_queries_total 1e6\n'


def test_prompts_reach_two_blocks_so_speculation_still_hits():
    lens = [T.BASE_LEN + i for i in range(128)]
    assert sorted(L % 128 for L in lens) == list(range(128))
    # the tiny model's block is 208; a length that is a whole number of blocks cannot hit (the
    # last token is recomputed, the GDN state sits one block back): 1040 here
    assert [L for L in lens if ideal_prefix_hit(L, 208, True) == 0] == [1040]


def test_prefix_report_prints_hits_beside_the_prediction(tmp_path, capsys):
    prompts = [[1] * (T.BASE_LEN + i) for i in range(128)]
    # patch 0081: DFlash2 hits keep their last block, at the scheduler block (832 = 4 x 208:
    # the tiny drafter's KV group has 4x the block), so every prompt of 1024..1151 hits 832
    import collections

    from onecard import memory as m
    from onecard.dflash.tiny_drafter import DEFAULT_DRAFTER as D
    from onecard.prepare import tiny

    geom = m.ModelGeometry.from_config(tiny.make_config(tiny.DEFAULT_SPEC, collections.defaultdict(int)))
    drafter = m.DrafterVRAM(0, D.layers, "tiny", kv_heads=D.kv_heads, head_dim=D.head_dim).pool_kw()
    groups = {"off": m.predict_pool(geom, 3 << 30, "bf16", 2048, 0, True).attn_groups,
              "d2k7": m.predict_pool(geom, 3 << 30, "bf16", 2048, 7, True, **drafter).attn_groups,
              "d2k15": m.predict_pool(geom, 3 << 30, "bf16", 2048, 15, True, **drafter).attn_groups}
    assert groups["d2k7"] == ((1, 208), (1, 832)) and T.scheduler_block(208, groups["d2k7"]) == 832
    want = {n: sum(ideal_prefix_hit(len(p), 208 if n == "off" else 832, False) for p in prompts)
            for n in T.SERVERS}
    assert want["d2k7"] == 128 * 832
    servers = {n: FakeServer(tmp_path, n, 208, want[n] + 5 if n != "d2k15" else 0.0) for n in T.SERVERS}
    hits0 = {n: 5.0 if n != "d2k15" else 0.0 for n in T.SERVERS}
    rec: dict = {"servers": {n: {"attn_groups": groups[n]} for n in T.SERVERS}}
    T.prefix_report(rec, servers, prompts, hits0)
    out = capsys.readouterr().out
    assert rec["prefix_cache_pass2"]["off"] == {"hits": want["off"], "block": 208, "predicted": want["off"]}
    assert rec["prefix_cache_pass2"]["d2k7"] == {"hits": want["d2k7"], "block": 832, "predicted": want["d2k7"]}
    assert rec["prefix_cache_pass2"]["d2k15"]["hits"] == 0
    assert "finding: fewer hits than whole blocks allow on d2k15" in out
    assert "d2k7" not in out.split("finding:")[1]


def test_sampled_checks_pool_two_off_samples(capsys):
    """The sampled check: each DFlash2 arm against two independent off samples pooled; off vs
    off2 and d2k7 vs d2k15 printed only. Same distribution everywhere: no failure; one arm that
    puts its token-2 mass on another token: failures at token 2 for that arm only."""
    import random

    rng = random.Random(5)

    def draws(n, bias=False):
        out = []
        for _ in range(n):
            row = [rng.randrange(8) for _ in range(4)]
            if bias and rng.random() < 0.3:
                row[1] = 7
            out.append(row)
        return out

    rec = {"sampled": {}, "failures": []}
    T.sampled_checks(rec, {"off": draws(1200), "off2": draws(1200), "d2k7": draws(1200), "d2k15": draws(1200)})
    assert rec["failures"] == [] and rec["sampled"]["d2k7-pos2"]["n"] == [2400, 1200]
    assert "off-vs-off2-pos2" in rec["sampled"] and "d2k7-vs-d2k15-pos3" in rec["sampled"]
    rec = {"sampled": {}, "failures": []}
    T.sampled_checks(rec, {"off": draws(1200), "off2": draws(1200), "d2k7": draws(1200, bias=True),
                           "d2k15": draws(1200)})
    assert [f.split(":")[0] for f in rec["failures"]] == ["sampled d2k7 token 2"]
    assert "two samples pooled" in capsys.readouterr().out
