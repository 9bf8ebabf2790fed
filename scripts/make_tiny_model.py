#!/usr/bin/env python3
"""Build the tiny random Qwen3.5 test checkpoint (thin CLI over onecard.prepare.tiny)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onecard.prepare.tiny import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
