#!/usr/bin/env bash
# The project's one test command (README; .ci/run calls exactly this). On a machine without a
# GPU: builds .venv-test inside the clone (pinned vLLM on the local CPU torch, onecard[test]),
# leaves its vLLM pristine (tests patch a symlinked view of it), then runs pytest; GPU tests
# (-m gpu) are deselected by pyproject's addopts. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PYTHONPATH="$root" "${PYTHON:-python3}" -m onecard.install --venv "$root/.venv-test" --extras test --pristine --no-verify
exec "$root/.venv-test/bin/python" -m pytest "$@"
