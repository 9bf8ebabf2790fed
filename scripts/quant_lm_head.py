#!/usr/bin/env python3
"""Requantize the lm_head tensors of a checkpoint in place (see onecard.prepare.requant)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from onecard.prepare.requant import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], target="lm_head"))
