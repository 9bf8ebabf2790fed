"""EMBED_HOST (patch 0013): the target's embed_tokens in pinned host memory, read through a UVA
view. CPU: the patch's helper run from its own text over stand-in parameters, the launcher knob,
its server variable, the memory model's saving, the notes, and the WSL refusal. Not yet run on a
GPU (gpu/README.md)."""
from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest

from onecard import memory
from onecard import plan as P
from tests.conftest import patch_added_source

REPO = Path(__file__).resolve().parents[1]
PATCH = REPO / "patches" / "0013-qwen35-embed-host.patch"


def _helper():
    """_onecard_embed_to_host as the patch adds it."""
    return patch_added_source(PATCH.name, "def _onecard_embed_to_host(lm: nn.Module) -> None:")


class FakeTensor:
    """Just what the helper touches: .to("cpu"), .pin_memory(), .numel(), .element_size(), .device."""

    def __init__(self, n, device="cuda", pinned=False):
        self.n, self.device, self.pinned = n, types.SimpleNamespace(type=device), pinned

    def to(self, device):
        return FakeTensor(self.n, device)

    def pin_memory(self):
        return FakeTensor(self.n, "cpu", pinned=True)

    def numel(self):
        return self.n

    def element_size(self):
        return 1


class FakeParam:
    def __init__(self, n):
        self.data = FakeTensor(n)

    @property
    def device(self):
        return self.data.device


class FakeEmbed:
    def __init__(self):
        self.params = [FakeParam(1000), FakeParam(10)]

    def parameters(self):
        return iter(self.params)


def _run(monkeypatch, lm, uva=True, env="1"):
    import os
    import sys

    calls = {"views": 0, "empty": 0}

    def view(host):
        assert host.pinned
        calls["views"] += 1
        return FakeTensor(host.n, "cuda")

    fake_platform = types.ModuleType("vllm.utils.platform_utils")
    fake_platform.is_uva_available = lambda: uva
    fake_torch_utils = types.ModuleType("vllm.utils.torch_utils")
    fake_torch_utils.get_accelerator_view_from_cpu_tensor = view
    for name, mod in (("vllm", types.ModuleType("vllm")), ("vllm.utils", types.ModuleType("vllm.utils")),
                      ("vllm.utils.platform_utils", fake_platform), ("vllm.utils.torch_utils", fake_torch_utils)):
        monkeypatch.setitem(sys.modules, name, mod)
    if env is None:
        monkeypatch.delenv("ONECARD_EMBED_HOST", raising=False)
    else:
        monkeypatch.setenv("ONECARD_EMBED_HOST", env)
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(empty_cache=lambda: calls.__setitem__("empty", calls["empty"] + 1)))
    ns = {"os": os, "torch": torch, "nn": types.SimpleNamespace(Module=object), "PPMissingLayer": type("PPMissingLayer", (), {}),
          "logger": logging.getLogger("embed-host-test")}
    exec(compile(_helper(), "0013-qwen35-embed-host", "exec"), ns)
    ns["_onecard_embed_to_host"](lm)
    return calls


def test_helper_moves_every_parameter_once(monkeypatch, caplog):
    embed = FakeEmbed()
    lm = types.SimpleNamespace(model=types.SimpleNamespace(embed_tokens=embed), lm_head=object())
    with caplog.at_level(logging.INFO, logger="embed-host-test"):
        calls = _run(monkeypatch, lm)
    assert calls == {"views": 2, "empty": 1}
    for p in embed.params:
        assert p._onecard_host and p._onecard_host_tensor.pinned and p.data.device.type == "cuda"
    assert "embed_tokens in pinned host memory (EMBED_HOST=1)" in caplog.text
    assert _run(monkeypatch, lm) == {"views": 0, "empty": 0}      # a second load_weights: nothing again


@pytest.mark.parametrize("case", ["tied", "no-uva", "unset", "zero"])
def test_helper_leaves_the_table_alone(monkeypatch, caplog, case):
    embed = FakeEmbed()
    lm = types.SimpleNamespace(model=types.SimpleNamespace(embed_tokens=embed),
                               lm_head=embed if case == "tied" else object())
    with caplog.at_level(logging.WARNING, logger="embed-host-test"):
        calls = _run(monkeypatch, lm, uva=case != "no-uva", env={"unset": None, "zero": "0"}.get(case, "1"))
    assert calls == {"views": 0, "empty": 0}
    assert not any(hasattr(p, "_onecard_host") for p in embed.params)
    if case in ("tied", "no-uva"):
        assert "EMBED_HOST=1 ignored" in caplog.text


def test_knob_server_variable_and_memory_model(tmp_path, monkeypatch):
    off = P.make_plan({"CTX": "long", "SPEC": "mtp", "CARD_GIB": "24"}, tmp_path, python="python3")
    on = P.make_plan({"CTX": "long", "SPEC": "mtp", "CARD_GIB": "24", "EMBED_HOST": "1"}, tmp_path, python="python3")
    assert off.child_env["ONECARD_EMBED_HOST"] == "0" and on.child_env["ONECARD_EMBED_HOST"] == "1"
    embed = 248_320 * 5_120 + 248_320 * 4      # int8 rows + one fp32 scale per row (the prepared layout)
    assert memory.target_embed_bytes(memory.target_tensors(None, memory.QWEN38_27B)[0]) == embed
    w_off, _ = memory.target_weight_bytes(None, "mtp", memory.QWEN38_27B)
    w_on, src = memory.target_weight_bytes(None, "mtp", memory.QWEN38_27B, embed_host=True)
    assert w_off - w_on == embed and "embed in host memory" in src
    assert off.prediction["vram"]["total"] - on.prediction["vram"]["total"] == embed
    assert "EMBED_HOST=1 (frees 1.19 GiB)" in off.child_env["ONECARD_OOM_HINT"]
    assert "EMBED_HOST" not in on.child_env["ONECARD_OOM_HINT"].split("Try")[1]
    monkeypatch.setattr(P, "in_wsl", lambda: True)
    with pytest.raises(P.PlanError) as e:
        P.make_plan({"EMBED_HOST": "1"}, tmp_path, python="python3")
    assert "valid on WSL: EMBED_HOST=0" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(P.PlanError, match="valid: 0, 1|0\\|1"):
        P.make_plan({"EMBED_HOST": "yes"}, tmp_path, python="python3")


def test_does_not_fit_note_names_embed_host(tmp_path):
    """A plan over the card that EMBED_HOST=1 would bring under it says so."""
    plan = P.make_plan({"CTX": "long", "SPEC": "mtp", "CARD_GIB": "21.5", "VRAM_CHECK": "0"}, tmp_path, python="python3")
    note = next(n for n in plan.notes if n.startswith("VRAM on one GPU"))
    assert "does NOT fit" in note and "or EMBED_HOST=1 (embed_tokens in pinned host memory: 1.19 GiB less" in note
