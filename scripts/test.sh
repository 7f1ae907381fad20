#!/usr/bin/env bash
# Everything CI checks: lint, format, types, unit and integration tests, then the e2e suite on a
# real control plane. Run scripts/setup.sh first (the README's test command does both).
# CI=true (the default here) turns every skip that is not allow-listed in conftest.py into a
# failure, so a missing tool fails the run instead of hiding the tests that need it.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
export CI="${CI:-true}"
ruff check .
ruff format --check .
bash scripts/typecheck.sh
# The chart tests run helm: build it with the e2e binaries (cached after the first run).
helm="$(e2e/cluster build | grep '/helm$')"
PATH="$(dirname "$helm"):$PATH"
pytest tests
bash e2e/run-tests.sh
