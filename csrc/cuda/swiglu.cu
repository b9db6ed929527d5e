// swiglu and swiglu_packed on CUDA: the gated activations' registered functions (gated.h) over the
// CUDA kernels (cuda_gated.cuh).
#include <torch/csrc/stable/library.h>

#include "fusedops/cuda_gated.cuh"

STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  using K = fusedops::gated::cuda::Kernels<false>;
  m.impl("swiglu", TORCH_BOX(&fusedops::gated::swiglu<K>));
  m.impl("swiglu_backward", TORCH_BOX(&fusedops::gated::swiglu_backward<K>));
  m.impl("swiglu_packed", TORCH_BOX(&fusedops::gated::swiglu_packed<K>));
  m.impl("swiglu_packed_backward", TORCH_BOX(&fusedops::gated::swiglu_packed_backward<K>));
}
