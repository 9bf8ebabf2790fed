#!/usr/bin/env python3
"""Speculation acceptance per position by prompt class: `bench/spec_accept.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from onecard.bench.cli import main  # noqa: E402

raise SystemExit(main(["spec", *sys.argv[1:]]))
