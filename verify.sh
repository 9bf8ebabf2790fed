#!/usr/bin/env bash
# Check the installation (--no-server) or a running server. Logic: onecard/verify.py.
# Python: $VENV/bin/python when VENV is set, else ./venv/bin/python, else python3 (as ./start_qwen.sh).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -n "${VENV:-}" ]; then
  py="$VENV/bin/python"
  [ -x "$py" ] || { echo "onecard verify: VENV=$VENV has no bin/python; valid: a venv made by ./install.sh --venv DIR, or VENV unset for $here/venv" >&2; exit 2; }
else
  py="$here/venv/bin/python"; [ -x "$py" ] || py=python3
fi
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m onecard.verify "$@"
