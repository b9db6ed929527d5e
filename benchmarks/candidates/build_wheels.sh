#!/usr/bin/env bash
# Builds the wheels that benchmarks/candidates/measure.sh compares, on a machine without a GPU:
# one of HEAD into dist/head/ and one of HEAD with each candidate patch applied into
# dist/<patch name>/ (every patch here, or the ones named). All builds share one scratch clone,
# so each after the first recompiles only the files its patch touches: on the 2-core
# development VM (2026-12-08) the first took 7.5 minutes and each patch's about 4.5.
#
#   PYTHON=/tmp/venv-cuda/bin/python CUDA_HOME=/usr/local/cuda-13.0 \
#       bash benchmarks/candidates/build_wheels.sh [benchmarks/candidates/NAME.patch ...]
#
# PYTHON: an interpreter with the CUDA torch to compile against and the build tools
# (docs/install.md, "Building from source"; torch 2.14.1+cu130 here); CUDA_HOME: the toolkit's
# root, which torch guesses wrong on these machines (DESIGN.md §2). TORCH_CUDA_ARCH_LIST
# defaults to 9.0, MAX_JOBS to 2.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
python=${PYTHON:-python3}
patches=()
for patch in "$@"; do patches+=("$(realpath "$patch")"); done
[ ${#patches[@]} -gt 0 ] || patches=("$root"/benchmarks/candidates/*.patch)
[ -e "${patches[0]}" ] || { echo "no candidate patches to build" >&2; exit 2; }
scratch=${SCRATCH:-/tmp/fusedops-candidates}
rm -rf "$scratch"
git clone -q "$root" "$scratch"

build() {  # the scratch tree as it stands, into dist/$1/
  rm -rf "$root/dist/$1"
  (cd "$scratch" && PATH="$(dirname "$python"):$PATH" FUSEDOPS_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
    MAX_JOBS=${MAX_JOBS:-2} "$python" -m pip wheel -q --no-build-isolation --no-deps -w "$root/dist/$1" .)
  echo "dist/$1/: $(cd "$root/dist/$1" && ls *.whl) ($(date +%H:%M:%S))"
}

build head
for patch in "${patches[@]}"; do
  git -C "$scratch" checkout -q -- . && git -C "$scratch" clean -fdq  # (keeps the ignored build/)
  git -C "$scratch" apply "$patch"
  build "$(basename "$patch" .patch)"
done
