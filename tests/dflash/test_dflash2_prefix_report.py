"""tests/gpu/test_dflash2.py's cached-pass prefix report on the CPU: hits read from /metrics beside
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
    assert T.drafter_block_ratio() == 4
    want = {n: sum(ideal_prefix_hit(len(p), 208 if n == "off" else 832, False) for p in prompts)
            for n in T.SERVERS}
    assert want["d2k7"] == 128 * 832
    servers = {n: FakeServer(tmp_path, n, 208, want[n] + 5 if n != "d2k15" else 0.0) for n in T.SERVERS}
    hits0 = {n: 5.0 if n != "d2k15" else 0.0 for n in T.SERVERS}
    rec: dict = {}
    T.prefix_report(rec, servers, prompts, hits0)
    out = capsys.readouterr().out
    assert rec["prefix_cache_pass2"]["off"] == {"hits": want["off"], "block": 208, "predicted": want["off"]}
    assert rec["prefix_cache_pass2"]["d2k7"] == {"hits": want["d2k7"], "block": 832, "predicted": want["d2k7"]}
    assert rec["prefix_cache_pass2"]["d2k15"]["hits"] == 0
    assert "finding: fewer hits than whole blocks allow on d2k15" in out
    assert "d2k7" not in out.split("finding:")[1]
