#!/usr/bin/env bash
# Installs the CUDA compiler and runtime headers (no driver) into a manylinux_2_28 container
# (AlmaLinux 8) for cibuildwheel's before-all: `bash .ci/install_cuda_toolkit.sh 13-0`.
set -euo pipefail
version=${1:?usage: install_cuda_toolkit.sh <major-minor, e.g. 13-0>}
case "$(uname -m)" in
  x86_64) repo_arch=x86_64 ;;
  aarch64) repo_arch=sbsa ;;
  *) echo "unsupported architecture $(uname -m)" >&2; exit 1 ;;
esac
dnf install -y dnf-plugins-core
dnf config-manager --add-repo "https://developer.download.nvidia.com/compute/cuda/repos/rhel8/${repo_arch}/cuda-rhel8.repo"
dnf install -y "cuda-nvcc-${version}" "cuda-cudart-devel-${version}" "cuda-cccl-${version}"
ln -sfn "/usr/local/cuda-${version/-/.}" /usr/local/cuda
/usr/local/cuda/bin/nvcc --version
