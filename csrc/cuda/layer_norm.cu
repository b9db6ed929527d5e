// layer_norm on CUDA: the row normalisations' registered functions (norm_ops.h) over the CUDA
// kernels (cuda_norm.cuh).
#include <torch/csrc/stable/library.h>

#include "fusedops/cuda_norm.cuh"
#include "fusedops/norm_ops.h"

STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  using K = fusedops::norm::cuda::Kernels;
  m.impl("layer_norm", TORCH_BOX(&fusedops::norm::layer_norm<K>));
  m.impl("layer_norm_backward", TORCH_BOX(&fusedops::norm::layer_norm_backward<K>));
}
