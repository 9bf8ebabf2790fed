"""Patch 0081 (DFlash prefix caching) with vLLM 0.27.1's own Scheduler and KV cache manager on CPU.

The reproduction of docs/results/2026-12-03-dflash-prefix-cpu (repro_dflash.py) builds the KV
cache config the way the H200's tiny DFlash2 server did (tiny target + tiny DFlash2 drafter,
prefix caching, align mode, block 208) and sends prompts twice with fake model outputs (every
draft rejected). Stock 0.27.1 + the series without 0081 hits 0 tokens in the second pass, as the
H200 did (job 70, 2026-12-03); with 0081 every prompt hits its whole scheduler blocks (832: the
drafter's 4x block, the LCM of the groups' block sizes). SPEC=mtp is unchanged by the patch.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from onecard import patching

REPO = Path(__file__).resolve().parent.parent
REPRO = REPO / "docs" / "results" / "2026-12-03-dflash-prefix-cpu" / "repro_dflash.py"
PATCH = "0081-dflash-prefix-cache.patch"
LENS = (1024, 1039)  # 16 prompts: each holds one 832-token scheduler block below L - 1


def _overlay(vllm_dir, tmp_path_factory, with_patch: bool) -> Path:
    tmp = tmp_path_factory.mktemp("series-0081" if with_patch else "series-no0081")
    names = [p.name for p in patching.read_series() if with_patch or p.name != PATCH]
    for name in names:
        shutil.copy2(REPO / "patches" / name, tmp / name)
    (tmp / "series").write_text("\n".join(names) + "\n")
    return patching.overlay(vllm_dir, tmp_path_factory.mktemp("site"), series=tmp / "series")


@pytest.fixture(scope="module")
def setup(vllm_dir, tmp_path_factory):
    from onecard.dflash.tiny_drafter import build_tiny_drafter
    from onecard.prepare.tiny import ensure_tiny_model

    sys.path.insert(0, str(REPO / "tests" / "prepare"))
    import vllm_cpu_load

    models = tmp_path_factory.mktemp("models")
    target = ensure_tiny_model(models)
    drafter = build_tiny_drafter(target, models / "qwen35-tiny-dflash2")
    stub = vllm_cpu_load.write_sitecustomize(tmp_path_factory.mktemp("stub"))
    return {"models": models, "drafter": drafter, "stub": stub,
            "stock": _overlay(vllm_dir, tmp_path_factory, False),
            "patched": _overlay(vllm_dir, tmp_path_factory, True)}


def _hits(setup, site: str, *args: str) -> tuple[int, str]:
    env = {**os.environ, "MODELS": str(setup["models"]),
           "PYTHONPATH": os.pathsep.join([str(setup[site]), setup["stub"], str(REPO)])}
    proc = subprocess.run([sys.executable, str(REPRO), "--lens", f"{LENS[0]}-{LENS[1]}",
                           "--drafter", str(setup["drafter"]), *args],
                          env=env, capture_output=True, text=True, timeout=600, cwd=str(REPO))
    out = proc.stdout + proc.stderr
    m = re.search(r"pass2: prefix_cache hits=(\d+)", out)
    assert proc.returncode == 0 and m, out[-4000:]
    return int(m.group(1)), out


def test_dflash_second_pass_hits_whole_scheduler_blocks(setup):
    stock, out0 = _hits(setup, "stock", "--spec", "dflash", "--k", "7")
    assert "scheduler.use_eagle=True" in out0 and "scheduler_block_size=832" in out0
    assert stock == 0  # the H200's zero
    patched, out1 = _hits(setup, "patched", "--spec", "dflash", "--k", "7")
    assert "scheduler.use_eagle=False" in out1
    assert patched == 832 * (LENS[1] - LENS[0] + 1)


def test_mtp_keeps_its_drop(setup):
    stock, _ = _hits(setup, "stock", "--spec", "mtp", "--k", "4")
    patched, out = _hits(setup, "patched", "--spec", "mtp", "--k", "4")
    assert stock == patched and "scheduler.use_eagle=True" in out
