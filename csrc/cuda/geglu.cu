// geglu and geglu_packed on CUDA: the gated activations' registered functions (gated.h) over the
// CUDA kernels (cuda_gated.cuh).
#include <torch/csrc/stable/library.h>

#include "fusedops/cuda_gated.cuh"

STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  using K = fusedops::gated::cuda::Kernels<true>;
  m.impl("geglu", TORCH_BOX(&fusedops::gated::geglu<K>));
  m.impl("geglu_backward", TORCH_BOX(&fusedops::gated::geglu_backward<K>));
  m.impl("geglu_packed", TORCH_BOX(&fusedops::gated::geglu_packed<K>));
  m.impl("geglu_packed_backward", TORCH_BOX(&fusedops::gated::geglu_packed_backward<K>));
}
