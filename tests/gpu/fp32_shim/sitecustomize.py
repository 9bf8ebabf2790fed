"""GPU suite, float32 strict-exactness servers only: lift one float32 refusal in vLLM 0.27.1.

Never part of the product: tests/gpu/conftest.py puts this directory first on PYTHONPATH of the
``--dtype float32`` servers only (and of their engine subprocesses, which inherit it).

vLLM 0.27.1 serves Qwen3.5 in float32 everywhere except the Gated DeltaNet *prefill*: the
Triton/FLA ``chunk_gated_delta_rule`` (third_party/flash_linear_attention/ops/chunk.py) asserts
``q.dtype != torch.float32`` (FlashInfer's GDN prefill, the other backend, is bf16/fp16 and
needs the CUTLASS DSL). This wrapper calls the same ``ChunkGatedDeltaRuleFunction`` without that
assertion when q is float32. If the float32 kernels cannot run (a Triton compile or resource
error), it falls back once, loudly, to the bf16 kernels for the prefill only (q/k/v rounded to
bf16, the output cast back), so the server still serves; the suite reads which one ran from the
server log markers below and reports it.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGETS = ("vllm.third_party.flash_linear_attention.ops",
           "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn")
MARK = "onecard-fp32-shim:"
_said: set[str] = set()


def _say(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        print(f"{MARK} {msg}", file=sys.stderr, flush=True)


def _make_wrapper(chunk_mod, original):
    import torch

    Fn = chunk_mod.ChunkGatedDeltaRuleFunction

    @torch.compiler.disable
    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                               output_final_state=False, cu_seqlens=None, chunk_indices=None,
                               chunk_offsets=None, use_qk_l2norm_in_kernel=False,
                               core_attn_out=None):
        kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        if q.dtype != torch.float32:
            return original(q, k, v, g, beta, core_attn_out=core_attn_out, **kw)
        if "fallback" not in _state:
            try:
                s = k.shape[-1] ** -0.5 if scale is None else scale
                o, final = Fn.apply(q, k, v, g, beta, s, initial_state, output_final_state,
                                    cu_seqlens, chunk_indices, chunk_offsets,
                                    use_qk_l2norm_in_kernel, core_attn_out)
                _say("GDN chunk prefill ran in float32")
                return o, final
            except Exception as e:  # Triton compile / out-of-resources: raised before launch
                _state["fallback"] = repr(e)[:300]
                _say(f"GDN chunk prefill FELL BACK to bf16 kernels ({_state['fallback']})")
        bf = torch.bfloat16
        o, final = original(q.to(bf), k.to(bf), v.to(bf), g, beta, **kw)
        o = o.to(q.dtype)
        if core_attn_out is not None:
            core_attn_out.reshape(-1)[: o.numel()].copy_(o.reshape(-1))
        return o, final

    return chunk_gated_delta_rule


_state: dict = {}


def _patch(name: str, module) -> None:
    try:
        if name == TARGETS[0]:
            chunk_mod = sys.modules[name + ".chunk"]
            if "wrapper" not in _state:
                _state["wrapper"] = _make_wrapper(chunk_mod, chunk_mod.chunk_gated_delta_rule)
            module.chunk_gated_delta_rule = _state["wrapper"]
            chunk_mod.chunk_gated_delta_rule = _state["wrapper"]
            _say("FLA chunk_gated_delta_rule float32 refusal lifted (test-only shim)")
        elif "wrapper" in _state and hasattr(module, "fla_chunk_gated_delta_rule"):
            module.fla_chunk_gated_delta_rule = _state["wrapper"]
    except Exception as e:  # never break the server's imports; the suite sees the missing mark
        _say(f"shim NOT applied to {name}: {e!r}")


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, name):
        self.inner, self.name = inner, name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch(self.name, module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, name)
        return spec


sys.meta_path.insert(0, _Finder())


def _chain() -> None:
    """Run the sitecustomize this one shadows (if any), as Python would have."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        try:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        except Exception as e:
            _say(f"shadowed sitecustomize {spec.origin} raised {e!r}")


import importlib.util  # noqa: E402

_chain()
