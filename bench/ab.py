#!/usr/bin/env python3
"""Boot-per-arm A/B driving start_qwen.sh, with the boot floor: `bench/ab.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from onecard.bench.cli import main  # noqa: E402

raise SystemExit(main(["ab", *sys.argv[1:]]))
