#!/usr/bin/env python3
"""Markdown report from result JSONs: `bench/report.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from onecard.bench.cli import main  # noqa: E402

raise SystemExit(main(["report", *sys.argv[1:]]))
