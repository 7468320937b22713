#!/usr/bin/env bash
# Build llama.cpp's llama-server from the llama.cpp that the installed llama-cpp-python vendors
# (bench only: the side-by-side comparisons of bench/e2e_report.py and bench/serve_load.py).
#   bash bench/build_llama_server.sh [PYTHON]   ->  bench/build/llama-server/bin/llama-server
# Needs cmake and a C++ compiler; about 10 minutes on 2 cores. Downloads the llama-cpp-python
# source distribution of the installed version (pip download), so the ggml kernels are the same.
set -euo pipefail
PY=${1:-python}
HERE=$(cd "$(dirname "$0")" && pwd)
OUT="$HERE/build/llama-server"
VERSION=$("$PY" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')
SRC="$HERE/build/llama-cpp-python-src"
mkdir -p "$SRC" "$OUT"
if [ ! -d "$SRC/llama_cpp_python-$VERSION" ]; then
  "$PY" -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$SRC"
  tar xzf "$SRC/llama_cpp_python-$VERSION.tar.gz" -C "$SRC"
fi
LLAMA="$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$LLAMA" -B "$OUT" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DBUILD_SHARED_LIBS=OFF
cmake --build "$OUT" --target llama-server -j "$(nproc)"
echo "$OUT/bin/llama-server (llama-cpp-python $VERSION's llama.cpp)"
