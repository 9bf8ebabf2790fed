#!/usr/bin/env bash
# Benchmark suites against a running server (default http://127.0.0.1:8000, or $ONECARD_BENCH_URL):
#   bench/run_benchmarks.sh single|batch [--prefill] [--long] [--url URL] [--model NAME] [--results DIR]
#                           [--size smoke] [--label NAME]   (smoke: every single-user axis, small sizes)
# Every result JSON carries provenance and a fairness verdict; a markdown report is written last.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$( [ -x "$here/venv/bin/python" ] && echo "$here/venv/bin/python" || echo python3)}"
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m onecard bench suite "$@"
