#!/usr/bin/env python3
"""Decode and TTFT at context depths: `bench/depth.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from onecard.bench.cli import main  # noqa: E402

raise SystemExit(main(["depth", *sys.argv[1:]]))
