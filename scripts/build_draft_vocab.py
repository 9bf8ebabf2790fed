#!/usr/bin/env python3
"""Build the reduced MTP draft vocabulary (see onecard.prepare.draft_vocab)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from onecard.prepare.draft_vocab import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
