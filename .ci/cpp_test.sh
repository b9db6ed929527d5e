#!/usr/bin/env bash
# The CMake path for C++ users: build fusedops as plain shared libraries against libtorch found
# through torch.utils.cmake_prefix_path (the CPU torch of .venv), and run the C++ program that
# calls the ops through the dispatcher (tests/cpp/dispatcher_test.cpp), and the CPU kernels' dtype
# conversions checked against c10's (tests/cpp/convert_test.cpp), under ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(mktemp -d /tmp/fusedops-cpp.XXXXXX)
trap 'rm -rf "$build"' EXIT
prefix=$(.venv/bin/python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
.venv/bin/cmake -S . -B "$build" -G Ninja -DCMAKE_MAKE_PROGRAM="$PWD/.venv/bin/ninja" -DFUSEDOPS_PYTHON=OFF \
  -DFUSEDOPS_BUILD_TESTS=ON -DFUSEDOPS_CUDA=0 -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
.venv/bin/cmake --build "$build" 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" || true
(cd "$build" && "$OLDPWD/.venv/bin/ctest" --output-on-failure)
