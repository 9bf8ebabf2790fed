#!/usr/bin/env bash
# The reference performance run (issue 11): the 27B-geometry checkpoint on stock and patched vLLM,
# same GPU, 3090 KV pins; JSON + markdown table (docs/performance.md) with ratios and roofline.
#   bench/reference.sh --tier quick|lease|full [--model DIR] [--out DIR] [--md FILE] [--arm stock=PYTHONPATH]
# Arms default to $PYTHONPATH (patched) and $STOCK_PYTHONPATH (stock). `--help` lists every option.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$( [ -x "$here/venv/bin/python" ] && echo "$here/venv/bin/python" || echo python3)}"
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m onecard.bench.reference "$@"
