"""Shared fixtures. Tests that need the pinned vLLM skip cleanly where it is not installed."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def check_job_contract(job: Path, driver: str = r"\w+") -> str:
    """A GPU job script keeps gpu/README.md's contract: a `# timeout:` header within one device
    call (600 s), its `run_driver TAG END_S` ending inside that header, valid bash. ``driver``:
    a regex the run_driver line must show after END_S. Returns the script's text."""
    text = job.read_text()
    m = re.search(r"^# timeout: (\d+)$", text, re.M)
    assert m and int(m.group(1)) <= 600, job               # one device call's limit
    inner = re.search(rf"^run_driver \w+ (\d+) {driver}", text, re.M)  # gpu/lib/job.sh: END_S
    assert inner and int(inner.group(1)) < int(m.group(1)), job    # the driver ends inside the header
    assert subprocess.run(["bash", "-n", str(job)]).returncode == 0, job
    return text


def patch_added_source(patch: str, first_line: str) -> str:
    """The source of a function a patch adds: its ``+`` lines from ``first_line`` (the ``def``
    line without the ``+``) to the first line that is not an addition. Tests run it over
    stand-ins, so the shipped text is what is tested."""
    lines = (Path(__file__).resolve().parents[1] / "patches" / patch).read_text().splitlines()
    start = lines.index("+" + first_line)
    body = []
    for line in lines[start:]:
        if not line.startswith("+"):
            break
        body.append(line[1:])
    return "\n".join(body)


def _vllm_dir() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).resolve()


# resolved when the tests are collected, before any fixture pretends features are installed
# (profiles.pretend_installed puts a fake vllm dir first on the path: a session fixture first asked
# inside one would hand every later test the fake)
_REAL_VLLM_DIR = _vllm_dir()


@pytest.fixture(scope="session")
def vllm_dir() -> Path:
    path = _REAL_VLLM_DIR
    if path is None:
        pytest.skip("vllm is not installed in this environment")
    return path


@pytest.fixture(scope="session")
def patched_site(vllm_dir, tmp_path_factory) -> Path:
    """A patched view of the installed vLLM (symlinks + patched copies); the install stays pristine."""
    from onecard.patching import overlay

    return overlay(vllm_dir, tmp_path_factory.mktemp("patched-site"))


def copy_subset(vllm_dir: Path, rels: set[str], dest: Path) -> Path:
    """Copy the named files of a vLLM install (plus _version.py and dist-info) to dest/vllm."""
    site = vllm_dir.parent
    for rel in set(rels) | {"vllm/__init__.py", "vllm/_version.py"}:
        if (site / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(site / rel, dest / rel)
    for info in site.glob("vllm-*.dist-info"):
        shutil.copytree(info, dest / info.name)
    return dest / "vllm"


@pytest.fixture
def gen(request):
    """A seeded torch.Generator for the randomized kernel tests. The seed is fixed per test (from
    its node id), so CI gives the same verdict on every run; ONECARD_TEST_SEED=<n> picks one,
    ONECARD_TEST_SEED=random a fresh one (to look for rare cases). The seed is printed (pytest
    shows it with a failure) and kept in the test's report."""
    import os
    import random
    import zlib

    import torch

    want = os.environ.get("ONECARD_TEST_SEED", "")
    if want == "random":
        seed = random.SystemRandom().randrange(2**31)
    elif want:
        try:
            seed = int(want)
        except ValueError:
            raise pytest.UsageError(f"ONECARD_TEST_SEED={want!r} is not valid; valid: an integer or 'random'")
    else:
        seed = zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF
    request.node.user_properties.append(("seed", seed))
    print(f"gen seed {seed} (ONECARD_TEST_SEED={seed} reproduces it)")
    return torch.Generator().manual_seed(seed)


from onecard import plan as _plan  # noqa: E402

REAL_CARD_MEMORY = _plan.card_memory  # tests/test_preflight.py tests the real one
REAL_CARD_CAPABILITY = _plan.card_capability  # and this one
REAL_CARD_IN_USE = _plan.card_in_use  # and this one


@pytest.fixture(autouse=True)
def _no_gpu_probe(monkeypatch):
    """The preflight's card (plan.card_memory asks nvidia-smi at a real launch) is unknown in every
    test, so a developer's GPU does not change the plans tests check; tests set CARD_GIB instead."""
    monkeypatch.setattr(_plan, "card_memory", lambda environ, probe=True: (None, "tests: no GPU probe"))
    monkeypatch.setattr(_plan, "card_capability", lambda environ, probe=True: (None, "tests: no GPU probe"))
    monkeypatch.setattr(_plan, "card_in_use", lambda environ, probe=True: (None, "tests: no GPU probe"))


@pytest.fixture(autouse=True)
def _no_real_warmup(monkeypatch):
    """No test may fork the launcher's real warm-up helper (it would poll a port for 30 min):
    onecard.warmup.fork_warmup records its calls instead (tests/test_warmup.py reads them)."""
    import onecard.warmup as warmup

    calls: list = []
    monkeypatch.setattr(warmup, "fork_warmup", lambda *a, **k: calls.append((a, k)) or True)
    return calls


@pytest.fixture
def fake_features(tmp_path) -> Path:
    """Pretend every optional feature (KVarN, DFlash2, ...) is installed into vLLM
    (onecard.profiles.pretend_installed: marker files in a fake vllm dir that importlib finds)."""
    from onecard.profiles import pretend_installed

    with pretend_installed(tmp_path / "fakevllm") as d:
        yield d


@pytest.fixture(scope="module")
def drafter_27b(tmp_path_factory) -> Path:
    """The published 27B DFlash2 drafter's config.json (5 layers, 32 q / 8 KV heads x 128,
    use_sliding_window, window 2048), no weights; built once per module, read-only (a test that
    edits it copies it first)."""
    from onecard.dflash.tiny_drafter import build_geometry_drafter

    d = tmp_path_factory.mktemp("d27") / "drafter-27b"
    build_geometry_drafter(d, config_only=True, log=lambda *a, **k: None)
    return d


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """The tiny Qwen3.5 target and its tiny DFlash2 drafter, built once per module."""
    from onecard.dflash.tiny_drafter import build_tiny_drafter
    from onecard.prepare.tiny import build_tiny_model

    d = tmp_path_factory.mktemp("pair")
    target = build_tiny_model(d / "qwen35-tiny")
    return target, build_tiny_drafter(target, d / "qwen35-tiny-dflash2")
