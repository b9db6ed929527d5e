#!/usr/bin/env bash
# Compiles and links the CUDA kernels against torch 2.14.1+cu130 for sm_90, as the GPU build
# would, without a GPU: catches CUDA compile errors on machines that cannot run them.
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
if [ ! -x "$CUDA_HOME/bin/nvcc" ]; then
  echo "no CUDA toolkit at $CUDA_HOME: set CUDA_HOME" >&2
  exit 1
fi
[ -x .venv-cuda/bin/python ] || python3 -m venv .venv-cuda
.venv-cuda/bin/pip install -q torch==2.14.1 "cmake>=3.26" ninja
rm -rf build/cuda-check
.venv-cuda/bin/cmake -S . -B build/cuda-check -G Ninja -DCMAKE_MAKE_PROGRAM="$PWD/.venv-cuda/bin/ninja" \
  -DPython_EXECUTABLE="$PWD/.venv-cuda/bin/python" -DFUSEDOPS_CUDA=1 \
  -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" -DCMAKE_CUDA_ARCHITECTURES=90-real >/dev/null
.venv-cuda/bin/cmake --build build/cuda-check 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" || true
test -f build/cuda-check/_C_cuda.abi3.so
echo "CUDA compile check passed: build/cuda-check/_C_cuda.abi3.so"
