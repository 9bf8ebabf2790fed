"""A reduced draft vocabulary for the MTP head: the most frequent token ids of a corpus.

The MTP drafter proposes tokens; scoring only ``size`` rows of lm_head (default 40,960 of
248,320) makes each draft step cheaper, at the cost of never proposing a token outside the
set (the target model still verifies, so output is unchanged; only acceptance can drop).

Selection, in order: every added/special token of the tokenizer (chat, think, tool, vision
markers), every token whose text contains ``think`` / ``tool`` markup, the 256 byte-level
base tokens (so any text stays representable), then the most frequent ids of the training
part of the corpus until ``size``. Coverage = the share of token occurrences of the held-out
part (every ``holdout_every``-th document) whose id is in the set.

Output: a JSON file ``{"ids": [...sorted...], "size", "vocab_size", "tokenizer_sha256",
"coverage_heldout", "corpus": {...}}``, written atomically.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from pathlib import Path

DEFAULT_SIZE = 40960
MARKUP = ("think", "tool_call", "tool_response", "<function", "<parameter")


def builtin_corpus() -> list[str]:
    """Text available on any CPython here: pydoc topics plus a few stdlib modules' sources."""
    import sysconfig

    texts: list[str] = []
    try:
        from pydoc_data.topics import topics  # type: ignore[import-not-found]
        texts += [topics[k] for k in sorted(topics)]
    except Exception:  # noqa: BLE001
        pass
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for p in sorted(stdlib.glob("*.py"))[:200]:
        try:
            texts.append(p.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
    return texts


def read_corpus(paths: list[Path]) -> list[str]:
    """Documents from files (.txt/.md/.py...: one document per file; .jsonl: a "text" field per line)."""
    docs: list[str] = []
    for p in paths:
        p = Path(p)
        files = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
        if not files:
            raise ValueError(f"corpus path {p} has no files; valid: text files, .jsonl, or directories of them")
        for f in files:
            if f.suffix == ".jsonl":
                for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
                    if line.strip():
                        obj = json.loads(line)
                        docs.append(obj["text"] if isinstance(obj, dict) else str(obj))
            else:
                docs.append(f.read_text(encoding="utf-8", errors="replace"))
    return docs


def _load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    path = Path(path)
    f = path / "tokenizer.json" if path.is_dir() else path
    if not f.is_file():
        raise ValueError(f"no tokenizer.json at {path}; valid: a model directory or a tokenizer.json file")
    return Tokenizer.from_file(str(f)), hashlib.sha256(f.read_bytes()).hexdigest()


def always_included(tok) -> set[int]:
    ids = set(tok.get_added_tokens_decoder().keys())
    vocab = tok.get_vocab(with_added_tokens=True)
    for text, i in vocab.items():
        if any(m in text for m in MARKUP):
            ids.add(i)
    try:
        from tokenizers import pre_tokenizers

        for ch in pre_tokenizers.ByteLevel.alphabet():
            if ch in vocab:
                ids.add(vocab[ch])
    except Exception:  # noqa: BLE001
        pass
    return ids


def build(tokenizer: Path, docs: list[str], size: int = DEFAULT_SIZE, holdout_every: int = 10) -> dict:
    if size < 1:
        raise ValueError(f"size {size} invalid; valid: a positive number of ids")
    if not docs:
        raise ValueError("empty corpus; valid: at least one document")
    tok, sha = _load_tokenizer(tokenizer)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    train, held = Counter(), Counter()
    enc = tok.encode_batch(docs, add_special_tokens=False)
    for n, e in enumerate(enc):
        (held if holdout_every and n % holdout_every == holdout_every - 1 else train).update(e.ids)
    must = sorted(always_included(tok))
    chosen = list(dict.fromkeys(must))[:size]
    have = set(chosen)
    for i, _ in sorted(train.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if i not in have:
            chosen.append(i)
            have.add(i)
    if len(chosen) < size:  # fill with the lowest unused ids (the corpus did not reach size)
        for i in range(vocab_size):
            if len(chosen) >= size:
                break
            if i not in have:
                chosen.append(i)
                have.add(i)
    total = sum(held.values())
    covered = sum(c for i, c in held.items() if i in have)
    return {
        "ids": sorted(chosen),
        "size": len(chosen),
        "vocab_size": vocab_size,
        "tokenizer_sha256": sha,
        "always_included": len(must),
        "coverage_heldout": (covered / total) if total else None,
        "corpus": {"documents": len(docs), "train_tokens": sum(train.values()), "heldout_tokens": total,
                   "holdout_every": holdout_every},
    }


def write(result: dict, out: Path) -> None:
    from onecard.prepare.st import atomic_write_text

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result) + "\n")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("tokenizer", type=Path, help="model directory or tokenizer.json")
    parser.add_argument("--corpus", type=Path, nargs="*", default=None,
                        help="text/.jsonl files or directories (default: text shipped with Python)")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE)
    parser.add_argument("--holdout-every", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True, help="output JSON")


def run(args) -> int:
    try:
        docs = read_corpus(args.corpus) if args.corpus else builtin_corpus()
        res = build(args.tokenizer, docs, args.size, args.holdout_every)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write(res, args.out)
    cov = res["coverage_heldout"]
    cov_s = f"{cov:.4f}" if cov is not None else "n/a (no held-out tokens)"
    print(f"draft vocab: {res['size']} of {res['vocab_size']} ids ({res['always_included']} always included), "
          f"held-out coverage {cov_s} -> {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="build_draft_vocab", description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))
