#!/usr/bin/env python3
"""Teacher-forced perplexity (echo + logprobs): `bench/perplexity.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from onecard.bench.cli import main  # noqa: E402

raise SystemExit(main(["perplexity", *sys.argv[1:]]))
