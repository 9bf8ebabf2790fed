#!/usr/bin/env python3
"""Same document, 3 turns, TTFT each: `bench/prefix_turns.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from onecard.bench.cli import main  # noqa: E402

raise SystemExit(main(["prefix-turns", *sys.argv[1:]]))
