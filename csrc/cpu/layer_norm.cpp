// layer_norm on the CPU: the row normalisations' registered functions (norm_ops.h) over the CPU
// kernels (cpu_norm.h).
#include <torch/csrc/stable/library.h>

#include "fusedops/cpu_norm.h"
#include "fusedops/norm_ops.h"

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  using K = fusedops::norm::cpu::Kernels;
  m.impl("layer_norm", TORCH_BOX(&fusedops::norm::layer_norm<K>));
  m.impl("layer_norm_backward", TORCH_BOX(&fusedops::norm::layer_norm_backward<K>));
}
