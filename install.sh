#!/usr/bin/env bash
# Install onecard: venv + pinned vLLM 0.27.1 + patches/series (+ --kvarn, --model) + verify.
# Safe to re-run. Logic: onecard/install.py (standard library only). Options: ./install.sh --help
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here" && PYTHONPATH="$here" exec "${PYTHON:-python3}" -m onecard.install "$@"
