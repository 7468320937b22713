#!/usr/bin/env bash
# The GPU device kit's device side: bash bench/gpu/run_device.sh PHASE, from the checkout's root.
#
#   build  (device call 1): unpack the trimmed llama-cpp-python source, build it with CUDA for
#          sm_90 on every core, install the carried wheels, build ngramspec's kernels in place,
#          keep model part 1; then measure c(k, L) of the random-shape models.
#   live   (device call 2, within the idle window after call 1): join the embedded model from
#          part 1 (kept by call 1) and part 2, then calibrate it, run generate's comparisons,
#          the Python driver's time per step, the server load run, and the modeled replay
#          priced by the measured 8B curve.
#   all    both, one after the other (the CPU dry run: everything is carried there).
#
# State that call 2 needs stays in $GPU_KIT_STATE (default /tmp/ngramspec-gpukit), outside the
# checkout, whose copy the device tool refreshes each call. Results: $OUT/gpu.json and gpu.md
# after every step (a time-out still returns what was measured), logs in $OUT/PHASE.log.
#
# GPU_KIT_CPU=1: the CPU dry run: build without CUDA, tiny shapes, short runs; $OUT defaults to
# bench/gpu/kit/dry-out. GPU_KIT_PYTHON: the interpreter (default python3: the device's, which
# holds numpy, Cython, scikit-build-core, cmake, ninja). bench/gpu/README.md has the calls.
set -uo pipefail
PHASE=${1:?usage: run_device.sh build|live|all}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
KIT=bench/gpu/kit
export GPU_KIT_CPU=${GPU_KIT_CPU:-0}
export GPU_KIT_STATE=${GPU_KIT_STATE:-/tmp/ngramspec-gpukit}
if [ -z "${OUT:-}" ]; then
  OUT=$ROOT/$KIT/dry-out
fi
export OUT
PY=${GPU_KIT_PYTHON:-python3}
STATE=$GPU_KIT_STATE
mkdir -p "$STATE" "$OUT"
export PYTHONUNBUFFERED=1
export GPU_KIT_T0=${GPU_KIT_T0:-$(date +%s)}   # the call's clock (measure.py's budget)
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
# the carried wheels and the built llama_cpp, ahead of the interpreter's own packages
export PYTHONPATH=$STATE/llama:$STATE/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
# faulthandler into $OUT/faults.txt for every Python the steps start: llama-cpp-python's quiet
# model load puts /dev/null on fd 1 and 2, so a crash inside it printed nothing on the first
# device run (README §5); a file opened before the load keeps the Python frames of the crash
mkdir -p "$STATE/faults"
cat > "$STATE/faults/sitecustomize.py" <<'PYEOF'
import faulthandler
import os
faulthandler.enable(file=open(os.path.join(os.environ["OUT"], "faults.txt"), "a"), all_threads=True)
PYEOF
export PYTHONPATH=$STATE/faults:$PYTHONPATH
export NGRAMSPEC_CACHE_DIR=$STATE/cache
export NGRAMSPEC_SHARED=$ROOT/$KIT      # bench's trace folder: $KIT/traces
# every layer on the GPU (llama-server's variable; ngramspec's load_llama reads it)
[ "$GPU_KIT_CPU" = 1 ] || export LLAMA_ARG_N_GPU_LAYERS=${LLAMA_ARG_N_GPU_LAYERS:--1}

log() { echo "[$(date -u +%H:%M:%S)] $*"; }

# What ggml-cuda links besides the runtime: cuBLAS and the driver (libcuda). An image whose CUDA
# toolkit is the compiler and runtime alone (as this project's CPU host has: no cuBLAS, no driver
# stubs) still has them elsewhere: cuBLAS in the Python packages' nvidia/*/lib (PyTorch's
# nvidia-cublas), the driver where ldconfig or /usr/local/nvidia finds it. CMake then gets the
# files (and cuBLAS's headers) explicitly, and the loader cuBLAS's folder. Sets CUDA_LIB_ARGS;
# GPU_KIT_CUBLAS_DIR / GPU_KIT_LIBCUDA name them by hand.
cuda_libs() {
  CUDA_LIB_ARGS=""
  local cuda lib=${GPU_KIT_CUBLAS_DIR:-} drv=${GPU_KIT_LIBCUDA:-}
  cuda=$(dirname "$(dirname "$(command -v nvcc)")")
  if [ -z "$lib" ] && ! ls "$cuda"/lib64/libcublas.so* "$cuda"/targets/*/lib/libcublas.so* \
       >/dev/null 2>&1; then
    lib=$("$PY" -c 'import glob, os, site
for d in site.getsitepackages():
    for f in sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libcublas.so.*"))):
        print(os.path.dirname(f)); raise SystemExit' 2>/dev/null)
    [ -n "$lib" ] || log "no libcublas in the CUDA toolkit nor in the Python packages"
  fi
  if [ -n "$lib" ]; then
    local inc=$STATE/cublas-include
    mkdir -p "$inc" && ln -sf "$lib"/../include/cublas*.h "$inc"/
    CUDA_LIB_ARGS="-DCUDA_cublas_LIBRARY=$(ls "$lib"/libcublas.so.* | head -1) -DCUDA_cublasLt_LIBRARY=$(ls "$lib"/libcublasLt.so.* | head -1) -DCMAKE_CUDA_FLAGS=-I$inc -DCMAKE_CXX_FLAGS=-I$inc"
    export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    log "cuBLAS from $lib"
  fi
  if [ -z "$drv" ] && ! ls "$cuda"/lib64/stubs/libcuda.so "$cuda"/targets/*/lib/stubs/libcuda.so \
       >/dev/null 2>&1; then
    drv=$( (ldconfig -p 2>/dev/null | awk '/libcuda\.so/ {print $NF}'; \
            ls /usr/local/nvidia/lib64/libcuda.so* /usr/lib/x86_64-linux-gnu/libcuda.so* \
            2>/dev/null) | head -1)
  fi
  if [ -n "$drv" ]; then
    CUDA_LIB_ARGS="$CUDA_LIB_ARGS -DCUDA_cuda_driver_LIBRARY=$drv"
    log "CUDA driver library $drv"
  fi
}
[ "$GPU_KIT_CPU" = 1 ] || cuda_libs

build() {
  local t0=$SECONDS
  local sdist
  sdist=$(ls "$KIT"/src/llama_cpp_python-*.tar.gz 2>/dev/null | head -1)
  [ -n "$sdist" ] || { log "no $KIT/src/llama_cpp_python-*.tar.gz: run python bench gpu-prepare and carry $KIT/src"; return 2; }
  if [ -f "$STATE/llama/llama_cpp/__init__.py" ] && [ "$STATE/built-from" -nt "$sdist" ] \
       && [ "$(cat "$STATE/built-from")" = "$(basename "$sdist") cpu=$GPU_KIT_CPU" ]; then
    log "llama-cpp-python already built in $STATE/llama"
  else
    # unpacked once per kit: unpacking again would give every file a new time, and a rerun
    # after a call that ran out mid-build would compile everything again instead of the rest
    if [ "$(cat "$STATE/src/.from" 2>/dev/null)" != "$(basename "$sdist")" ]; then
      rm -rf "$STATE/src" && mkdir -p "$STATE/src" && tar xzf "$sdist" -C "$STATE/src" \
        && basename "$sdist" > "$STATE/src/.from"
    fi
    local args="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF"
    if [ "$GPU_KIT_CPU" = 1 ]; then
      export CMAKE_ARGS="$args"
    else
      # FA off: 39 of the 144 CUDA objects are FlashAttention's templates, compiled then with
      # empty kernel bodies (GGML_CUDA_NO_FA): less compile time in a call of at most 10
      # minutes, and the verify batches here are short. NCCL: one GPU; the image may lack it.
      export CMAKE_ARGS="$args -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${GPU_KIT_CUDA_ARCH:-90} -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_FA=${GPU_KIT_CUDA_FA:-OFF} $CUDA_LIB_ARGS"
    fi
    log "building llama-cpp-python ($CMAKE_ARGS) on $CMAKE_BUILD_PARALLEL_LEVEL jobs"
    # -v: the compile's progress goes to the returned log, also when the call runs out
    "$PY" -m pip install -v --no-build-isolation --no-deps --no-index --no-cache-dir \
      --no-compile --target "$STATE/llama" --upgrade -C build-dir="$STATE/build" \
      "$STATE"/src/llama_cpp_python-* || return 1
    echo "$(basename "$sdist") cpu=$GPU_KIT_CPU" > "$STATE/built-from"
    echo $((SECONDS - t0)) > "$STATE/build-seconds"
  fi
  if [ "$GPU_KIT_CPU" = 1 ]; then
    log "dry run: the interpreter's own packages stand in for the carried wheels (cp312)"
  elif ls "$KIT"/wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$STATE/site" "$KIT"/wheels/*.whl || return 1
  fi
  "$PY" setup.py -q build_ext --inplace -j "$CMAKE_BUILD_PARALLEL_LEVEL" >/dev/null || return 1
  mkdir -p "$STATE/model"
  cp "$KIT"/model1/*.part1 "$STATE/model/" 2>/dev/null || true
  log "build done in $((SECONDS - t0)) s"
}

case "$PHASE" in
  # diag.py (about a minute): where the CLI steps' SIGSEGV of the first device run comes from
  build) { build && { "$PY" bench/gpu/diag.py; "$PY" bench/gpu/measure.py build; }; } 2>&1 \
           | tee "$OUT/build.log" ;;
  live) "$PY" bench/gpu/measure.py live 2>&1 | tee "$OUT/live.log" ;;
  all) { build && "$PY" bench/gpu/measure.py build && "$PY" bench/gpu/measure.py live; } 2>&1 \
         | tee "$OUT/all.log" ;;
  *) echo "usage: run_device.sh build|live|all" >&2; exit 2 ;;
esac
