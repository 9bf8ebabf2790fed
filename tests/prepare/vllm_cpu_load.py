"""Build vLLM 0.27.1's Qwen3.5 model classes on a CPU box and load a checkpoint into them.

Run as a script in a child process (``python vllm_cpu_load.py MODEL_DIR OUT.json``) with the
patched view of vLLM first on PYTHONPATH. What it takes to get there without a GPU:
- the CPU platform is forced, with ``is_cpu()`` false so that layers do not bind the
  ``torch.ops._C`` CPU kernels this wheel lacks (SiluAndMul);
- transformers' Qwen2-VL image processor imports torchvision unconditionally: a
  ``sitecustomize`` (written by :func:`write_sitecustomize`) imports transformers' image
  utilities first (so torchvision counts as absent) and then stubs the one import;
- the WNA16 linear kernel choice is replaced by a torch reference kernel (dequantize the
  packed weight, matmul) so quantized layers build, load and run ``compute_logits``.
Nothing runs on a device; the GDN / attention kernels are never called.

Prints nothing useful; writes OUT.json: parameter shapes, loaded names, draft-head checks.
"""
from __future__ import annotations

import json
import os
import sys

SITECUSTOMIZE = '''\
import importlib.machinery, sys, types
import transformers.image_utils, transformers.video_utils  # noqa: F401  (torchvision seen as absent)
for _n in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
           "torchvision.transforms.v2.functional"):
    if _n not in sys.modules:
        _m = types.ModuleType(_n)
        _m.__spec__ = importlib.machinery.ModuleSpec(_n, None, is_package=True)
        _m.__path__ = []
        sys.modules[_n] = _m
sys.modules["torchvision.transforms.v2"].functional = sys.modules["torchvision.transforms.v2.functional"]
sys.modules["torchvision.transforms"].v2 = sys.modules["torchvision.transforms.v2"]
sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]
'''


def write_sitecustomize(directory) -> str:
    from pathlib import Path

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return str(d)


def main(model: str, out_path: str) -> int:
    import torch

    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    class _CpuNoOps(CpuPlatform):
        def is_cpu(self) -> bool:  # type: ignore[override]
            return False

    platforms._current_platform = _CpuNoOps()

    from safetensors.torch import load_file

    from onecard.prepare import quant
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    import vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 as wna16

    class TorchWNA16Kernel:
        """Reference for the WNA16 kernels: dequantize the packed weight, then matmul."""

        def __init__(self, config, **names):
            self.config = config

        def process_weights_after_loading(self, layer):
            pass

        def apply_weights(self, layer, x, bias=None):
            cols = int(layer.weight_shape[1])
            rows = layer.weight_packed.shape[0]
            bits = 32 * layer.weight_packed.shape[1] // cols
            w = quant.dequantize(layer.weight_packed, layer.weight_scale, bits, (rows, cols))
            y = x.float() @ w.t()
            return (y if bias is None else y + bias.float()).to(x.dtype)

    wna16.choose_mp_linear_kernel = lambda config: TorchWNA16Kernel

    args = EngineArgs(model=model, language_model_only=True, enforce_eager=True, max_model_len=512,
                      dtype="bfloat16", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    cfg = args.create_engine_config()
    result: dict = {"quant_config": type(cfg.quant_config).__name__ if cfg.quant_config else None}
    ckpt = {}
    for f in sorted(os.listdir(model)):
        if f.endswith(".safetensors"):
            ckpt.update(load_file(os.path.join(model, f)))
    result["checkpoint"] = sorted(ckpt)

    def params(m):
        return {n: [list(p.shape), str(p.dtype).replace("torch.", "")] for n, p in m.named_parameters()}

    from vllm.model_executor.model_loader.utils import initialize_model

    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{os.environ.get('PROBE_PORT', '29533')}")
        initialize_model_parallel(1, 1)
        target = initialize_model(cfg, model_config=cfg.model_config)
        result["target_params"] = params(target)
        result["target_loaded"] = sorted(target.load_weights(ckpt.items()))
        lm = target.language_model
        emb = lm.model.embed_tokens
        result["target_embed_method"] = type(emb.quant_method).__name__
        if hasattr(emb, "weight_packed"):
            n = ckpt["model.language_model.embed_tokens.weight_packed"].shape[0]
            result["target_embed_equal"] = bool(
                torch.equal(emb.weight_packed[:n], ckpt["model.language_model.embed_tokens.weight_packed"]))

        drafts = {}
        for env in ("", "0"):
            os.environ["ONECARD_DRAFT_VOCAB"] = env
            ctx = cfg.compilation_config.static_forward_context  # drop the previous drafter's layers
            for name in [n for n in ctx if n.startswith("mtp.")]:
                del ctx[name]
            draft = initialize_model(cfg, model_config=cfg.speculative_config.draft_model_config)
            d = {"params": params(draft), "loaded": sorted(draft.load_weights(ckpt.items())),
                 "embed_method": type(draft.model.embed_tokens.quant_method).__name__,
                 "draft_vocab": draft.draft_vocab[1] if draft.draft_vocab else None}
            # the proposer shares the target's lm_head with the drafter after loading
            own_head = draft.lm_head
            draft.lm_head = lm.lm_head
            torch.manual_seed(0)
            h = torch.randn(3, lm.config.hidden_size).to(torch.bfloat16)
            full = lm.compute_logits(h).float()
            logits = draft.compute_logits(h).float()
            d["logits_shape"] = list(logits.shape)
            if draft.draft_vocab is not None:
                ids = draft.draft_ids
                for part in ("weight_packed", "weight_scale", "weight"):
                    if hasattr(draft.draft_lm_head, part):
                        src = getattr(own_head, part)
                        d[f"rows_equal_{part}"] = bool(torch.equal(
                            getattr(draft.draft_lm_head, part)[: len(ids)], src[ids]))
                mask = torch.ones(logits.shape[1], dtype=torch.bool)
                mask[ids] = False
                d["outside_all_neg_inf"] = bool(torch.isneginf(logits[:, mask]).all())
                d["inside_max_abs_diff"] = float((logits[:, ids] - full[:, ids]).abs().max())
                top = draft.get_top_tokens(h)
                d["top_tokens"] = top.tolist()
                d["top_equal_argmax"] = top.tolist() == logits.argmax(-1).tolist()
                d["top_equal_restricted_full_argmax"] = top.tolist() == ids[full[:, ids].argmax(-1)].tolist()
            else:
                d["logits_max_abs_diff_vs_target"] = float((logits - full).abs().max())
            drafts[env or "unset"] = d
        result["draft"] = drafts
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
