#!/usr/bin/env bash
# Start the server: environment knobs (see single-user/README.md) -> plan -> preflight -> vllm serve.
# Python: $VENV/bin/python when VENV is set (as ./install.sh --venv DIR / VENV=DIR made it), else
# ./venv/bin/python, else python3.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -n "${VENV:-}" ]; then
  py="$VENV/bin/python"
  [ -x "$py" ] || { echo "onecard launch: VENV=$VENV has no bin/python; valid: a venv made by ./install.sh --venv DIR, or VENV unset for $here/venv" >&2; exit 2; }
else
  py="$here/venv/bin/python"; [ -x "$py" ] || py=python3
fi
cd "$here" && PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m onecard.launch "$@"
