#!/usr/bin/env bash
# Everything CI checks: lint, format, types, unit and integration tests, then the image and the
# e2e suite on a real control plane. Run scripts/setup.sh first (the README's test command does
# both). docs/testing.md says what each stage holds and what it costs.
#
#   bash scripts/test.sh          everything, as .ci/run runs it
#   bash scripts/test.sh --fast   lint, format, types and the tests not marked slow: the edit loop
#
# CI=true (the default of the full run) turns every skip that is not allow-listed in conftest.py
# into a failure, so a missing tool fails the run instead of hiding the tests that need it.
# Each stage's wall time is printed as it ends and kept, with each pytest stage's JUnit XML,
# under build/test-times (LLMPOOL_TEST_TIMES); `python benchmarks/suite_times.py` sums them.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
fast=false
if [[ "${1:-}" == "--fast" ]]; then
  fast=true
  shift
fi
if $fast; then export CI="${CI:-false}"; else export CI="${CI:-true}"; fi
times=$(realpath -m "${LLMPOOL_TEST_TIMES:-build/test-times}")
rm -rf "$times" && mkdir -p "$times"
export LLMPOOL_TEST_TIMES="$times"
began=$SECONDS
# The run's times, summed by stage, test file and test, whatever stage it ended in.
trap 'python benchmarks/suite_times.py --times "$times" || true' EXIT

# stage NAME COMMAND...: run COMMAND, print and record its wall time; its exit status stands.
stage() {
  local name=$1 started=$SECONDS status=0
  shift
  "$@" || status=$?
  printf '%s\t%s\t%s\n' "$name" $((SECONDS - started)) "$status" >>"$times/stages.tsv"
  echo "[test.sh] $name: $((SECONDS - started))s (exit $status; $((SECONDS - began))s in all)"
  return "$status"
}

# The e2e binaries (helm too, which the chart tests run) build from the Go module proxy: on a
# cold cache that is minutes of compiling on every core. The full run builds them in the
# background from the start, beside lint, types and the image's build (downloads and layer
# writes, mostly), and the tests start once they are there: tests beside a compiler on 2 cores
# run slower in all and make the timing-sensitive ones flaky (docs/testing.md has the numbers).
if ! $fast; then
  e2e/cluster build >"$times/binaries.log" 2>&1 &
  binaries=$!
fi
stage lint ruff check .
stage format ruff format --check .
stage types bash scripts/typecheck.sh
if $fast; then
  stage unit pytest tests -m "not slow and not image" --junitxml="$times/unit.xml" "$@"
  exit 0
fi
stage image-build bash scripts/build-image.sh
export LLMPOOL_IMAGE_BUILT=1  # e2e/run-tests.sh takes this image instead of building it again
stage binaries-wait wait "$binaries" || { cat "$times/binaries.log" >&2; exit 1; }
grep '^\[e2e build\]' "$times/binaries.log" || true
stage unit pytest tests --junitxml="$times/unit.xml"
stage e2e bash e2e/run-tests.sh
