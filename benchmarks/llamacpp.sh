#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama-cpp-python sdist's vendored sources, once, and
# serve a GGUF of the model llmpool serves with it: the peer for `llmpool bench serve --against`.
#
#   benchmarks/llamacpp.sh build            # prints the binary's path; a second run does nothing
#   benchmarks/llamacpp.sh gguf [q4_1|bf16] [FOLDER]   # prints the GGUF's path, converting once
#   benchmarks/llamacpp.sh serve [PORT] [PARALLEL] [q4_1|bf16|FILE.gguf] [extra llama-server args...]
#
# q4_1 (the default) is the built-in model's own GGUF, the file llmpool dequantizes at first use.
# bf16 is the same-precision peer: llama.cpp's own `convert_hf_to_gguf.py --outtype bf16` run on
# the very HF folder `llmpool serve` serves (FOLDER, default the built-in model's), so both servers
# hold the same weights at the same precision. The converter runs in a venv of its own under the
# cache (the project's torch and transformers, plus the sentencepiece it imports for every llama
# model); the GGUF is keyed by the folder's `llmpool digest`.
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
# ggml's AMX kernels (GGML_AMX_*, for Q4_1 and the other small quantized types) stay off: in this
# version they die of SIGILL at their first tile instruction on an AMX Xeon (the worker threads'
# tile permission and config are not set up: llama.cpp pull request 26954), so on AMX CPUs the
# Q4_1 peer runs its AVX-512 VNNI kernels.
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) stops the script too

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
# What the converter's requirements file allows (>=0.1.98,<0.3.0); pinned so conversions repeat.
SENTENCEPIECE_VERSION=0.2.1
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

root() {
    # One build folder per version and instruction-set flags.
    local key
    key="$(printf '%s\n' "$VERSION" "$(cpu_flags)" | sha256sum | cut -c1-12)"
    echo "$CACHE/llama-cpp-python-$VERSION-$key"
}

sources() {
    # The sdist's sources, fetched and unpacked once; prints the folder they are in.
    local root
    root="$(root)"
    if [[ ! -d "$root/src" ]]; then
        mkdir -p "$root"
        local sdist
        sdist="$(find "$root" -maxdepth 1 -name 'llama_cpp_python-*.tar.gz' | head -n1)"
        if [[ -z "$sdist" ]]; then
            "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps --dest "$root" \
                "llama-cpp-python==$VERSION" >&2
            sdist="$(find "$root" -maxdepth 1 -name 'llama_cpp_python-*.tar.gz' | head -n1)"
        fi
        mkdir -p "$root/src.partial"
        tar -xzf "$sdist" -C "$root/src.partial" --strip-components=1
        mv "$root/src.partial" "$root/src"
    fi
    echo "$root/src"
}

build() {
    mapfile -t flags < <(cpu_flags)
    local root
    root="$(root)"
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
    local src
    src="$(sources)"
    echo "llama.cpp build flags: ${flags[*]}" >&2
    cmake -S "$src/vendor/llama.cpp" -B "$root/build" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=OFF "${flags[@]}" -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
    cmake --build "$root/build" --target llama-server -j "$JOBS" >&2
    echo "$binary"
}

converter_python() {
    # A venv for convert_hf_to_gguf.py: the project's packages through a .pth, plus sentencepiece.
    local venv="$CACHE/convert-venv-$VERSION"
    if [[ ! -x "$venv/bin/python" ]]; then
        "$PYTHON" -m venv "$venv.partial"
        "$PYTHON" -c 'import site; print(site.getsitepackages()[0])' \
            >"$("$venv.partial/bin/python" -c 'import site; print(site.getsitepackages()[0])')/llmpool.pth"
        # Away from the repository root, whose operator/ folder would shadow the stdlib module.
        (cd "$CACHE" && "$venv.partial/bin/python" -m pip install --quiet \
            "sentencepiece==$SENTENCEPIECE_VERSION" >&2)
        rm -rf "$venv" && mv "$venv.partial" "$venv"
    fi
    echo "$venv/bin/python"
}

builtin_folder() {
    "$PYTHON" -c 'from llmpool.engine.model_source import resolve; print(resolve(None).folder)'
}

gguf() {
    local kind="${1:-q4_1}" folder="${2:-}"
    case "$kind" in
        q4_1)
            [[ -z "$folder" ]] || { echo "$0: q4_1 is the built-in model's own GGUF; convert other folders with bf16" >&2; exit 2; }
            "$PYTHON" -c 'from llmpool.engine.builtin_model import gguf_path; print(gguf_path())'
            ;;
        bf16)
            folder="${folder:-$(builtin_folder)}"
            local digest out
            digest="$("$PYTHON" -m llmpool.cli digest "$folder" | cut -d' ' -f1)"
            digest="${digest#sha256:}"
            out="$CACHE/gguf/$(basename "$folder")-${digest:0:16}-bf16.gguf"
            if [[ ! -f "$out" ]]; then
                local python
                python="$(converter_python)"
                mkdir -p "$CACHE/gguf"
                local converter
                converter="$(sources)/vendor/llama.cpp/convert_hf_to_gguf.py"
                (cd "$CACHE" && "$python" "$converter" "$folder" --outtype bf16 \
                    --outfile "$out.partial" >&2)
                mv "$out.partial" "$out"
            fi
            echo "$out"
            ;;
        *) echo "$0: gguf kind must be q4_1 or bf16, got $kind" >&2; exit 2 ;;
    esac
}

serve() {
    local port="${1:-8081}" parallel="${2:-64}" model="${3:-q4_1}"
    shift $(($# < 3 ? $# : 3))
    local binary
    binary="$(build)"
    [[ "$model" == *.gguf ]] || model="$(gguf "$model")"
    # Continuous batching over PARALLEL slots, each with the whole 2,048-token context of the
    # workload's longest request (512 words in + 256 out fits in far less), on 2 threads.
    exec "$binary" --model "$model" --alias "$(basename "$model" .gguf)" --host 127.0.0.1 --port "$port" --threads 2 \
        --threads-batch 2 --parallel "$parallel" --cont-batching \
        --ctx-size $((parallel * 2048)) --no-webui "$@"
}

case "${1:-}" in
    build) build ;;
    gguf) shift && gguf "$@" ;;
    serve) shift && serve "$@" ;;
    *)
        echo "usage: $0 build | gguf [q4_1|bf16] [FOLDER] | serve [PORT] [PARALLEL] [q4_1|bf16|FILE.gguf] [llama-server args...]" >&2
        exit 2
        ;;
esac
