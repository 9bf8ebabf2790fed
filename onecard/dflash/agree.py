"""An "agreeing pair": a tiny Qwen3.5 target and a tiny DFlash2 drafter that both always predict
the same single token X, whatever the input (GPU job 72: the lookup lane's acceptance).

Target (a copy of ``onecard.prepare.tiny``'s model, tokenizer / config files identical):

- every ``embed_tokens`` row is the same vector e;
- every residual writer is zeroed: full-attention ``self_attn.o_proj``, Gated DeltaNet
  ``linear_attn.out_proj``, MLP ``mlp.down_proj`` (the tiny model is dense: no shared experts),
  so the residual stream after the last layer is e at every position;
- the final norm (vLLM's ``GemmaRMSNorm``, ``(1 + w) * x / rms``) gets w = 0, so its output is
  n = e / rms(e); ``lm_head`` row X is set to ``ALIGN * e``, so logits = lm_head @ n is one
  constant vector whose argmax is X by a wide margin (asserted in float32 from the written bf16
  tensors, exactly as the model computes them).

Drafter (``onecard.dflash.tiny_drafter``'s weights for that target, then): attention ``o_proj``
and MLP ``down_proj`` zeroed, so whatever the v2 conv_in / conv_out branches do, the residual stays
the input embedding e (every row: the anchor and the mask rows share the target's embedding);
final ``norm.weight`` = 1 (plain ``w * x / rms``, same eps), so its output is the target's n and
every drafted row's unary logits are the target's; the DFlash2 selector's
``candidate_selector.hidden_projection`` is zeroed, so the walk's scores are the unary logits and
it picks X at every position.

``ensure_agreeing_pair()`` caches it as ``<models root>/qwen35-tiny-agree`` (+ ``-dflash2``
beside it, where ``tiny_drafter_dir`` looks), with ``agree.json`` ({"token": X, "margin": ...}).
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from onecard.prepare.atomic import building_dir

AGREE_NAME = "qwen35-tiny-agree"
STAMP = "onecard-build.txt"
INFO = "agree.json"
ALIGN = 0.25              # lm_head row X = ALIGN * e: top logit ~ ALIGN * hidden
SEED = 1234
MIN_MARGIN_ULPS = 64      # top logit over the second, in bf16 ulps of the top logit
ZEROED_TARGET = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight")
ZEROED_DRAFTER = ("self_attn.o_proj.weight", "mlp.down_proj.weight",
                  "candidate_selector.hidden_projection.weight")


def pick_token(tokenizer_json: Path, vocab: int) -> int:
    """An ordinary word-piece id: "Ġthe" when the tokenizer has it, else the first purely
    alphabetic piece of >= 3 letters; never an added/special token, away from the top ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    added = set(tok.get_added_tokens_decoder())
    limit = min(vocab, tok.get_vocab_size()) - 300
    for piece in ("Ġthe", "the", "Ġof"):
        i = tok.token_to_id(piece)
        if i is not None and i not in added and 10 <= i < limit:
            return i
    for i in range(10, limit):
        s = tok.id_to_token(i) or ""
        core = s[1:] if s.startswith("Ġ") else s
        if i not in added and len(core) >= 3 and core.isascii() and core.isalpha():
            return i
    raise RuntimeError("agree: no ordinary word-piece token found")


def target_logits(w: dict, eps: float):
    """float32 logits of the target for any input, from the (bf16) tensors as written: the
    residual is embed row 0 (all rows equal), final GemmaRMSNorm (1 + w), then lm_head."""
    import torch

    lm = "model.language_model"
    e = w[f"{lm}.embed_tokens.weight"][0].float()
    n = e * torch.rsqrt(e.pow(2).mean() + eps) * (1.0 + w[f"{lm}.norm.weight"].float())
    n = n.to(torch.bfloat16).float()            # the norm's output is bf16 in the model
    return w["lm_head.weight"].float() @ n


def margin_of(logits) -> tuple[int, float, float]:
    """(argmax, top - second, that gap in bf16 ulps of the top logit)."""
    import math

    import torch

    vals, ids = torch.topk(logits, 2)
    top, second = float(vals[0]), float(vals[1])
    ulp = 2.0 ** (math.floor(math.log2(abs(top))) - 7) if top else 2.0 ** -133
    return int(ids[0]), top - second, (top - second) / ulp


def _fingerprint(target_dir: Path) -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(Path(__file__).with_name("tiny_drafter.py").read_bytes())
    for name in ("onecard-build.txt", "config.json"):
        p = Path(target_dir) / name
        h.update(p.read_bytes() if p.is_file() else b"")
    return h.hexdigest()[:16]


def build_agreeing_pair(target_dir: Path, out_dir: Path) -> tuple[Path, Path, int]:
    """Write the agreeing target to ``out_dir`` and its drafter to ``tiny_drafter_dir(out_dir)``
    (each atomically; the drafter first, the target's stamp last). Returns (model, drafter, X)."""
    import torch
    from safetensors.torch import load_file, save_file

    from onecard.dflash.config import DrafterConfig
    from onecard.dflash.tiny_drafter import (DEFAULT_DRAFTER, iter_weights, make_config,
                                             tiny_drafter_dir)

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    config = json.loads((target_dir / "config.json").read_text())
    tc = config.get("text_config", config)
    eps, hidden, vocab = float(tc["rms_norm_eps"]), tc["hidden_size"], tc["vocab_size"]
    if tc.get("tie_word_embeddings") or config.get("tie_word_embeddings"):
        raise RuntimeError("agree: the tiny target ties lm_head to embed_tokens; it must not")
    x = pick_token(target_dir / "tokenizer.json", vocab)

    w = load_file(str(target_dir / "model.safetensors"))
    lm = "model.language_model"
    g = torch.Generator().manual_seed(SEED)
    e = torch.randn(hidden, generator=g).to(torch.bfloat16)
    w[f"{lm}.embed_tokens.weight"] = e[None].expand(vocab, hidden).contiguous()
    zeroed = []
    for name in list(w):
        if name.startswith(f"{lm}.layers.") and name.endswith(ZEROED_TARGET):
            w[name] = torch.zeros_like(w[name])
            zeroed.append(name)
    n_layers = tc["num_hidden_layers"]
    if len(zeroed) != 2 * n_layers:     # one attention/GDN output + one down_proj per layer
        raise RuntimeError(f"agree: zeroed {len(zeroed)} residual writers, expected {2 * n_layers}")
    w[f"{lm}.norm.weight"] = torch.zeros_like(w[f"{lm}.norm.weight"])
    head = w["lm_head.weight"].clone()
    head[x] = (ALIGN * e.float()).to(torch.bfloat16)
    w["lm_head.weight"] = head
    top, margin, ulps = margin_of(target_logits(w, eps))
    if top != x or ulps < MIN_MARGIN_ULPS:
        raise RuntimeError(f"agree: target argmax {top} (want {x}), margin {margin:.3f} = "
                           f"{ulps:.0f} bf16 ulps (need >= {MIN_MARGIN_ULPS})")

    # drafter: the tiny drafter's weights for this target, residual writers and selector zeroed
    dcfg_json = make_config(config, DEFAULT_DRAFTER)
    dcfg = DrafterConfig.from_dict(dcfg_json)
    dw = {}
    for name, t in iter_weights(dcfg, DEFAULT_DRAFTER.seed):
        if name.endswith(ZEROED_DRAFTER):
            t = torch.zeros_like(t)
        elif name == "norm.weight":
            t = torch.ones_like(t)
        dw[name] = t
    if dcfg.rms_norm_eps != eps:
        raise RuntimeError(f"agree: drafter eps {dcfg.rms_norm_eps} != target eps {eps}")

    fp = _fingerprint(target_dir)
    info = {"token": x, "margin": round(margin, 4), "margin_bf16_ulps": round(ulps, 1),
            "top_logit": round(float(target_logits(w, eps)[x]), 4),
            "source": str(target_dir), "seed": SEED, "align": ALIGN}
    draft_dir = tiny_drafter_dir(out_dir)
    with building_dir(draft_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(dcfg_json, indent=2, sort_keys=True) + "\n")
        save_file(dw, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / INFO).write_text(json.dumps(info, indent=2) + "\n")
        (tmp / STAMP).write_text(fp + "\n")
        (tmp / "README.md").write_text(
            "# onecard agreeing DFlash2 drafter\n\nBuilt by onecard.dflash.agree: drafts token "
            f"{x} at every row, as its target {out_dir.name} always predicts.\n")
    with building_dir(out_dir) as tmp:
        for p in sorted(target_dir.iterdir()):
            if p.is_file() and p.name not in ("model.safetensors", STAMP, "README.md"):
                shutil.copy2(p, tmp / p.name)
        save_file(w, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / INFO).write_text(json.dumps(info, indent=2) + "\n")
        (tmp / "README.md").write_text(
            "# onecard agreeing tiny Qwen3.5 (not a language model)\n\nBuilt by "
            f"onecard.dflash.agree from {target_dir.name}: predicts token {x} for every input "
            f"(margin {margin:.2f}); its drafter {draft_dir.name} drafts {x} at every row.\n")
        (tmp / STAMP).write_text(fp + "\n")
    return out_dir, draft_dir, x


def agree_dir(root: Path | None = None) -> Path:
    from onecard.prepare.tiny import models_root

    return models_root(root) / AGREE_NAME


def ensure_agreeing_pair(root: Path | None = None) -> tuple[Path, Path, int]:
    """(model dir, drafter dir, X) under the models root, built once (rebuilt when this builder,
    the tiny drafter builder or the tiny model changed: the stamps record which)."""
    from onecard.dflash.tiny_drafter import tiny_drafter_dir
    from onecard.prepare.tiny import ensure_tiny_model

    target = ensure_tiny_model(root)
    out = agree_dir(root)
    draft = tiny_drafter_dir(out)
    fp = _fingerprint(target)
    ok = all((d / "model.safetensors").is_file() and (d / STAMP).is_file()
             and (d / STAMP).read_text().strip() == fp for d in (out, draft))
    if ok:
        return out, draft, int(json.loads((out / INFO).read_text())["token"])
    return build_agreeing_pair(target, out)


def main(argv: list[str] | None = None) -> int:
    model, draft, x = ensure_agreeing_pair()
    info = json.loads((model / INFO).read_text())
    print(f"agreeing pair: {model} + {draft}: token {x}, margin {info['margin']} "
          f"({info['margin_bf16_ulps']} bf16 ulps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
