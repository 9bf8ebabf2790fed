"""GPU job 20 (27B-geometry checkpoint + its DFlash2 drafter) run on CPU, scaled down, without the
serve step: both are built into $MODELS, the summary names the drafter's size and time, a second
run skips what is there."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GEOM_SMALL = ("--device cpu --layers 4 --hidden 256 --intermediate 512 --heads 2 --kv-heads 1 "
              "--linear-key-heads 2 --linear-value-heads 6 --vocab 8192")
DRAFT_SMALL = "--device cpu --layers 2 --heads 4 --kv-heads 2 --head-dim 32 --intermediate 512 --selector-rank 16"


def test_job20_builds_the_geometry_drafter(tmp_path):
    models = tmp_path / "models"
    env = {**os.environ, "JOB_OUT": str(tmp_path / "out"), "MODELS": str(models), "PYTHONPATH": str(REPO),
           # the job calls python3: this interpreter's (torch, safetensors, tokenizers)
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "GEOM_SERVE": "0", "GEOM_EXTRA": GEOM_SMALL, "DRAFT_EXTRA": DRAFT_SMALL}
    r = subprocess.run(["bash", str(REPO / "gpu/jobs/20-geometry.sh")], env=env, capture_output=True, text=True,
                       timeout=300, cwd=str(REPO))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    d = models / "qwen38-27b-geom-dflash2"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and (d / "model.safetensors").is_file()
    # built against the (scaled-down, 4-layer) checkpoint job 20 built just before
    assert cfg["hidden_size"] == 256 and cfg["vocab_size"] == 8192 and cfg["dflash_config"]["target_layer_ids"] == [1, 2]
    rep = json.loads((tmp_path / "out" / "drafter.json").read_text())
    assert rep["skipped"] is False and rep["device"] == "cpu"
    assert "drafter: rc=0" in r.stdout and f"{rep['params']} params" in r.stdout
    r = subprocess.run(["bash", str(REPO / "gpu/jobs/20-geometry.sh")], env=env, capture_output=True, text=True,
                       timeout=300, cwd=str(REPO))
    assert r.returncode == 0 and "(present, skipped)" in r.stdout, r.stdout[-3000:]
    assert "geometry model exists" in r.stdout
