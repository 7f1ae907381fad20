#!/usr/bin/env bash
# CI entry point of the e2e stage: build the cluster's binaries (or take them from the cache)
# and the project's image, then run the e2e tests against a freshly started cluster. Exits
# non-zero on failure.
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
# The node's runtime and network plugins come from Debian's packages: install what is missing.
missing=()
command -v containerd >/dev/null || missing+=(containerd)
command -v runc >/dev/null || missing+=(runc)
command -v iptables >/dev/null || missing+=(iptables)
[[ -x /usr/lib/cni/bridge || -x /opt/cni/bin/bridge ]] || missing+=(containernetworking-plugins)
if (( ${#missing[@]} )); then
  echo "e2e: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
"$here/cluster" build
echo "e2e: binaries ready after $(( $(date +%s) - started ))s"
# The pods run the project's image: build it (only the changed layers; the session fixture
# loads it into the node unless the node has that very image), and run it under docker as the
# chart's pods run it.
# scripts/test.sh builds it in a stage of its own and says so (LLMPOOL_IMAGE_BUILT=1): once a run.
if [[ "${LLMPOOL_IMAGE_BUILT:-}" != 1 ]]; then
  bash "$root/scripts/build-image.sh"
fi
echo "e2e: image ready after $(( $(date +%s) - started ))s"
# Under scripts/test.sh each pytest run's JUnit XML goes beside its stage times.
junit() { if [[ -n "${LLMPOOL_TEST_TIMES:-}" ]]; then echo "--junitxml=$LLMPOOL_TEST_TIMES/$1.xml"; fi; }
"$python" -m pytest tests/image -m image $(junit image)
"$python" -m pytest e2e -m e2e $(junit e2e) "$@"
echo "e2e: stage took $(( $(date +%s) - started ))s"
