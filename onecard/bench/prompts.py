"""Prompt sets: small JSONL files in bench/prompts/ (one ``{"id": ..., "prompt": ...}`` a line).

A set is identified by its id (file stem) and a sha256 over its prompts (order-sensitive), so
two results are comparable only when they used byte-identical prompts. ``salt`` prefixes a
unique line to defeat prefix caching on prefill axes (the salt policy is recorded).
"""
from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "prompts"
CLASSES = ("prose", "code", "copy", "chat")


@dataclass(frozen=True)
class PromptSet:
    id: str
    path: str
    prompts: tuple[str, ...]
    ids: tuple[str, ...]

    @property
    def hash(self) -> str:
        return prompts_hash(self.prompts)

    def record(self, salted: bool = False) -> dict:
        return {"id": self.id, "hash": self.hash, "n": len(self.prompts), "path": self.path,
                "salted": salted}

    def cycle(self, n: int) -> list[str]:
        return [self.prompts[i % len(self.prompts)] for i in range(n)]


def prompts_hash(prompts) -> str:
    return hashlib.sha256(json.dumps(list(prompts), ensure_ascii=False).encode()).hexdigest()


def available() -> list[str]:
    return sorted(p.stem for p in PROMPTS_DIR.glob("*.jsonl"))


def load(name_or_path: str) -> PromptSet:
    p = Path(name_or_path)
    if not p.suffix:
        p = PROMPTS_DIR / f"{name_or_path}.jsonl"
    if not p.is_file():
        raise ValueError(f"prompt set {name_or_path!r} not found; valid: {', '.join(available())} "
                         "or a path to a .jsonl file")
    prompts, ids = [], []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            prompts.append(str(obj["prompt"]))
            ids.append(str(obj.get("id", n)))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{p}:{n}: each line must be a JSON object with a 'prompt' ({exc})") from None
    if not prompts:
        raise ValueError(f"prompt set {p} is empty")
    return PromptSet(id=p.stem, path=str(p), prompts=tuple(prompts), ids=tuple(ids))


def salt(prompt: str, token: str | None = None) -> str:
    """A unique first line: the prefix cache cannot match anything beyond it."""
    return f"[run {token or uuid.uuid4().hex}]\n{prompt}"


def haystack_text() -> str:
    return (PROMPTS_DIR / "haystack.txt").read_text(encoding="utf-8")
