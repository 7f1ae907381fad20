#!/usr/bin/env bash
# Build the llmpool image here, where no container registry is reachable: set up what is
# missing (dockerd on overlay2, a Debian bookworm base made with mmdebstrap), build with
# BuildKit, prune the build cache, print the image's size and the time taken. Idempotent; runs
# as root (it installs packages and starts dockerd when they are missing).
#
#   bash scripts/build-image.sh                  # builds ghcr.io/llmpool/llmpool:0.1.0
#   IMAGE=llmpool:dev bash scripts/build-image.sh
#
# Settings (environment): IMAGE; BASE_IMAGE (default: the local bookworm base, made once);
# TORCH_INDEX_URL (default: PyTorch's CPU index when it is reachable, else empty, i.e. the
# default package index, whose Linux torch wheels bring the CUDA libraries: a ~7 GB image);
# PIP_CONFIG (default: /etc/pip.conf) and CA_BUNDLE (default: the system bundle), which reach
# the build as BuildKit secrets and never end up in a layer.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-ghcr.io/llmpool/llmpool:0.1.0}
BASE_TAG=llmpool-base:bookworm
BASE_PACKAGES=python3,python3-venv,ca-certificates,passwd
DEBIAN_MIRROR=http://deb.debian.org
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/llmpool-dockerd.log}
PIP_CONFIG=${PIP_CONFIG:-/etc/pip.conf}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}

log() { echo "[build-image] $*" >&2; }

ensure_packages() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}

# The Debian package's client, where there is one: it builds with the daemon's BuildKit without
# the buildx plugin, which a newer client earlier on PATH may lack.
pick_docker_client() {
  if [ -n "${DOCKER:-}" ]; then
    return
  elif [ -x /usr/bin/docker ]; then
    DOCKER=/usr/bin/docker
  else
    DOCKER=docker
  fi
}

ensure_dockerd() {
  if ! "$DOCKER" info >/dev/null 2>&1; then
    log "starting dockerd (overlay2), log in $DOCKERD_LOG"
    setsid dockerd --storage-driver=overlay2 >"$DOCKERD_LOG" 2>&1 </dev/null &
    for _ in $(seq 60); do
      "$DOCKER" info >/dev/null 2>&1 && break
      sleep 1
    done
    "$DOCKER" info >/dev/null 2>&1 || { tail -20 "$DOCKERD_LOG" >&2; exit 1; }
  fi
  # vfs copies every layer in full: this image (several GB) fills the disk with it.
  local driver
  driver=$("$DOCKER" info --format '{{.Driver}}')
  if [ "$driver" != overlay2 ]; then
    log "dockerd uses the $driver storage driver; restart it with --storage-driver=overlay2"
    exit 1
  fi
}

ensure_base_image() {
  if "$DOCKER" image inspect "$BASE_TAG" >/dev/null 2>&1; then
    return
  fi
  log "making $BASE_TAG with mmdebstrap ($BASE_PACKAGES)"
  mmdebstrap --variant=minbase --include="$BASE_PACKAGES" \
    --aptopt='Acquire::Check-Valid-Until "false"' \
    bookworm - \
    "deb $DEBIAN_MIRROR/debian bookworm main" \
    "deb $DEBIAN_MIRROR/debian bookworm-updates main" \
    "deb $DEBIAN_MIRROR/debian-security bookworm-security main" |
    "$DOCKER" import - "$BASE_TAG"
}

default_torch_index() {
  local cpu_index=https://download.pytorch.org/whl/cpu
  if curl -sfI --max-time 10 "$cpu_index/" >/dev/null 2>&1; then
    echo "$cpu_index"
  fi
}

ensure_packages
pick_docker_client
ensure_dockerd
BASE_IMAGE=${BASE_IMAGE:-$BASE_TAG}
[ "$BASE_IMAGE" = "$BASE_TAG" ] && ensure_base_image
TORCH_INDEX_URL=${TORCH_INDEX_URL-$(default_torch_index)}

secrets=()
[ -f "$PIP_CONFIG" ] && secrets+=(--secret "id=pip.conf,src=$PIP_CONFIG")
[ -f "$CA_BUNDLE" ] && secrets+=(--secret "id=ca-certificates.crt,src=$CA_BUNDLE")

log "building $IMAGE from $BASE_IMAGE, torch from ${TORCH_INDEX_URL:-the default index}"
started=$(date +%s)
# The previous image carries its layers' cache keys (inline cache), so after the build cache
# is pruned a rebuild still reuses every layer up to the first changed one.
cache_from=()
previous=$("$DOCKER" image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
[ -n "$previous" ] && cache_from=(--cache-from "$IMAGE")
DOCKER_BUILDKIT=1 "$DOCKER" build \
  --build-arg "BASE_IMAGE=$BASE_IMAGE" \
  --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL" \
  --build-arg BUILDKIT_INLINE_CACHE=1 \
  "${cache_from[@]}" "${secrets[@]}" \
  --tag "$IMAGE" .
seconds=$(($(date +%s) - started))
# The image this build replaced, untagged now (the layers the new one shares stay), then the
# build cache, which holds on to the replaced layers until that image is gone.
built=$("$DOCKER" image inspect --format '{{.Id}}' "$IMAGE")
if [ -n "$previous" ] && [ "$previous" != "$built" ]; then
  "$DOCKER" image rm "$previous" >/dev/null || log "kept the previous image $previous (in use)"
fi
"$DOCKER" builder prune --force >/dev/null
size=$("$DOCKER" image inspect --format '{{.Size}}' "$IMAGE")
log "built $IMAGE in ${seconds}s: $((size / 1000000)) MB; disk:"
df -h / >&2
