#!/usr/bin/env bash
# Install (or --uninstall) the KVarN 4/2-bit KV cache into the venv's patched vLLM 0.27.1.
# Usage: kvarn/install.sh [--vllm-dir DIR] [--uninstall] [--dry-run] [--status]   (see kvarn/README.md)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${VENV:-$REPO/venv}/bin/python"
[ -x "$PY" ] || PY="$(command -v python3)"
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m onecard.kvarn.installer "$@"
