#!/usr/bin/env python3
"""Download (Hub id) or take (path) a checkpoint, requantize it, build its draft vocabulary
(see onecard.prepare.model; the same as `onecard prepare model`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from onecard.prepare.model import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
