#!/usr/bin/env bash
# Check the installation (--no-server) or a running server. Logic: onecard/verify.py.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${VENV:-$here/venv}/bin/python"; [ -x "$py" ] || py=python3
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m onecard.verify "$@"
