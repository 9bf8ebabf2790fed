#!/usr/bin/env bash
# One seat, 256k context, int4 per-token-head KV (values: onecard.profiles.SINGLE_USER; docs: README.md).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"; py="$here/venv/bin/python"; [ -x "$py" ] || py=python3
eval "$(cd "$here" && PYTHONPATH="$here" "$py" -c 'from onecard.profiles import single_user_exports as e; print(e())')" || exit 2
exec "$here/start_qwen.sh" "$@"
