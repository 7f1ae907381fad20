#!/usr/bin/env bash
# Everything CI checks: lint, format, types, unit and integration tests, then the e2e suite on a
# real control plane. Run scripts/setup.sh first (the README's test command does both).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
ruff check .
ruff format --check .
bash scripts/typecheck.sh
pytest tests
bash e2e/run-tests.sh
