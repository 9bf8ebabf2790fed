#!/usr/bin/env python3
"""Build the full-geometry random W4A16 test checkpoint (see onecard.prepare.geometry)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from onecard.prepare.geometry import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
