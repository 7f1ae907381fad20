#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama-cpp-python sdist's vendored sources, once, and
# serve the built-in model's GGUF with it: the peer for `llmpool bench serve --against`.
#
#   benchmarks/llamacpp.sh build            # prints the binary's path; a second run does nothing
#   benchmarks/llamacpp.sh serve [PORT] [PARALLEL] [extra llama-server args...]
#
# On an idle machine run both servers with OpenMP's defaults. On one shared with other work,
# OMP_WAIT_POLICY=passive kept llama.cpp's spinning threads from taking seconds per token on
# oversubscribed cores, but it also makes every torch parallel region wake sleeping workers,
# which about doubles llmpool's per-token time on 2 cores: compare on an idle machine.
#
# Everything lives under ${LLMPOOL_BENCH_CACHE:-~/.cache/llmpool-bench}, outside the repository.
# GGML_NATIVE is off (a -march=native build can fail on these VMs) and the instruction-set flags
# come from /proc/cpuinfo, so the binary never uses AVX-512 on an AVX2-only machine; the cache
# directory is keyed by the version and those flags, so a binary built elsewhere is not reused.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${LLMPOOL_BENCH_CACHE:-$HOME/.cache/llmpool-bench}"
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}"

cpu_flags() {
    # cmake option -> /proc/cpuinfo flag; ON only where the CPU has it.
    local flags
    flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    local pairs=(
        GGML_AVX:avx GGML_AVX2:avx2 GGML_FMA:fma GGML_F16C:f16c GGML_AVX_VNNI:avx_vnni
        GGML_AVX512:avx512f GGML_AVX512_VBMI:avx512vbmi GGML_AVX512_VNNI:avx512_vnni
        GGML_AVX512_BF16:avx512_bf16
    )
    local pair option flag
    for pair in "${pairs[@]}"; do
        option="${pair%%:*}"
        flag="${pair#*:}"
        if [[ "$flags" == *" $flag "* ]]; then echo "-D$option=ON"; else echo "-D$option=OFF"; fi
    done
}

build() {
    mapfile -t flags < <(cpu_flags)
    local key
    key="$(printf '%s\n' "$VERSION" "${flags[@]}" | sha256sum | cut -c1-12)"
    local root="$CACHE/llama-cpp-python-$VERSION-$key"
    local binary="$root/build/bin/llama-server"
    if [[ -x "$binary" ]]; then
        echo "$binary"
        return
    fi
    local tool
    for tool in cmake g++ make; do
        command -v "$tool" >/dev/null || {
            echo "$0: $tool is missing (Debian: apt-get install cmake g++ make)" >&2
            exit 1
        }
    done
    mkdir -p "$root"
    local sdist
    sdist="$(find "$root" -maxdepth 1 -name 'llama_cpp_python-*.tar.gz' | head -n1)"
    if [[ -z "$sdist" ]]; then
        "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps --dest "$root" \
            "llama-cpp-python==$VERSION" >&2
        sdist="$(find "$root" -maxdepth 1 -name 'llama_cpp_python-*.tar.gz' | head -n1)"
    fi
    if [[ ! -d "$root/src" ]]; then
        mkdir -p "$root/src.partial"
        tar -xzf "$sdist" -C "$root/src.partial" --strip-components=1
        mv "$root/src.partial" "$root/src"
    fi
    echo "llama.cpp build flags: ${flags[*]}" >&2
    cmake -S "$root/src/vendor/llama.cpp" -B "$root/build" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=OFF "${flags[@]}" -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
    cmake --build "$root/build" --target llama-server -j "$JOBS" >&2
    echo "$binary"
}

gguf() {
    "$PYTHON" -c 'from llmpool.engine.builtin_model import gguf_path; print(gguf_path())'
}

serve() {
    local port="${1:-8081}" parallel="${2:-64}"
    shift $(($# < 2 ? $# : 2))
    local binary model
    binary="$(build)"
    model="$(gguf)"
    # Continuous batching over PARALLEL slots, each with the whole 2,048-token context of the
    # workload's longest request (512 words in + 256 out fits in far less), on 2 threads.
    exec "$binary" --model "$model" --alias "$(basename "$model" .gguf)" --host 127.0.0.1 --port "$port" --threads 2 \
        --threads-batch 2 --parallel "$parallel" --cont-batching \
        --ctx-size $((parallel * 2048)) --no-webui "$@"
}

case "${1:-}" in
    build) build ;;
    serve) shift && serve "$@" ;;
    *)
        echo "usage: $0 build | serve [PORT] [PARALLEL] [llama-server args...]" >&2
        exit 2
        ;;
esac
