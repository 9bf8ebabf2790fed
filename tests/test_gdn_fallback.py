"""Patch 0001: the GDN prefill resolver falls back to Triton when FlashInfer's kernel cannot load.

Runs the resolver of the patched view (and, for contrast, of the pristine install) in one
subprocess each, with a fake Hopper CUDA platform and a fake `flashinfer` per scenario.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import json, sys, types
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as m

    plat = m.current_platform
    plat.__class__.is_cuda = lambda self=None: True
    plat.__class__.is_device_capability = lambda self, cap=None: cap == 90
    plat.__class__.is_device_capability_family = lambda self, fam=None: False

    def fake_flashinfer(scenario):
        # The kernel symbol present, or None as FlashInfer leaves it when its optional
        # CUTLASS DSL import fails; or the whole module unimportable.
        fi = types.ModuleType("flashinfer"); fi.__path__ = []
        kernels = types.ModuleType("flashinfer.gdn_kernels")
        prefill = types.ModuleType("flashinfer.gdn_prefill")
        prefill.chunk_gated_delta_rule = lambda *a, **k: None
        kernels.chunk_gated_delta_rule_sm90 = object() if scenario == "present" else None
        fi.gdn_kernels, fi.gdn_prefill = kernels, prefill
        sys.modules["flashinfer"] = fi
        sys.modules["flashinfer.gdn_kernels"] = kernels
        sys.modules["flashinfer.gdn_prefill"] = None if scenario == "import-error" else prefill
        sys.modules["cutlass"] = None

    results = {}
    for scenario, requested in [("missing", None), ("import-error", "flashinfer"), ("present", None)]:
        fake_flashinfer(scenario)
        probe = getattr(m, "_flashinfer_gdn_prefill_missing", None)
        if probe is not None:
            probe.cache_clear()
        cfg = types.SimpleNamespace(
            additional_config={"gdn_prefill_backend": requested} if requested else {},
            model_config=types.SimpleNamespace(hf_text_config=types.SimpleNamespace(linear_key_head_dim=128)),
        )
        results[scenario] = m._resolve_gdn_prefill_backend(cfg)
    print("RESULT", json.dumps(results))
""")


def resolve(site_path: str | None) -> tuple[dict, str]:
    env = dict(os.environ)
    if site_path:
        env["PYTHONPATH"] = site_path + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):]), out.stdout + out.stderr


@pytest.fixture(scope="module")
def patched(patched_site):
    return resolve(str(patched_site))


def test_patched_falls_back_when_kernel_missing(patched):
    results, log = patched
    assert results["missing"] == ["auto", "triton"]
    assert "FlashInfer GDN prefill is unavailable" in log and "CUTLASS DSL not importable" in log


def test_patched_falls_back_when_import_fails_even_if_requested(patched):
    assert patched[0]["import-error"] == ["flashinfer", "triton"]


def test_patched_keeps_flashinfer_when_kernel_present(patched):
    assert patched[0]["present"] == ["auto", "flashinfer"]


def test_stock_selects_the_missing_kernel(vllm_dir):
    """The bug the patch fixes: stock 0.27.1 picks FlashInfer although its kernel is absent."""
    results, _ = resolve(None)
    assert results["missing"] == ["auto", "flashinfer"]
