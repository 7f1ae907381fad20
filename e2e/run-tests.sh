#!/usr/bin/env bash
# CI entry point of the e2e stage: build the control plane (or take it from the cache),
# then run the e2e tests against a freshly started cluster. Exits non-zero on failure.
# Extra arguments go to pytest.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
python="${LLMPOOL_E2E_PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
export LLMPOOL_E2E_PYTHON="$python"
cd "$root"

started=$(date +%s)
"$here/cluster" build
echo "e2e: binaries ready after $(( $(date +%s) - started ))s"
"$python" -m pytest e2e -m e2e "$@"
echo "e2e: stage took $(( $(date +%s) - started ))s"
