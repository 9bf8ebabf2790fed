#!/usr/bin/env bash
# Start the server: environment knobs (see single-user/README.md) -> plan -> preflight -> vllm serve.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"; py="$here/venv/bin/python"; [ -x "$py" ] || py=python3
cd "$here" && PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m onecard.launch "$@"
