// add_rms_norm on CUDA: the row normalisations' registered functions (norm_ops.h) over the CUDA
// kernels (cuda_norm.cuh).
#include <torch/csrc/stable/library.h>

#include "fusedops/cuda_norm.cuh"
#include "fusedops/norm_ops.h"

STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  using K = fusedops::norm::cuda::Kernels;
  m.impl("add_rms_norm", TORCH_BOX(&fusedops::norm::add_rms_norm<K>));
  m.impl("add_rms_norm_", TORCH_BOX(&fusedops::norm::add_rms_norm_inplace<K>));
  m.impl("add_rms_norm_backward", TORCH_BOX(&fusedops::norm::add_rms_norm_backward<K>));
}
