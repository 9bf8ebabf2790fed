#!/usr/bin/env python3
"""Concurrency ladder: `bench/conc_ladder.py --n 1,2,4,8 --out 256 --reps 2 [--shared]`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from onecard.bench.cli import main  # noqa: E402

raise SystemExit(main(["ladder", *sys.argv[1:]]))
