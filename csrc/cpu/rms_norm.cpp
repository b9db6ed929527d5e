// rms_norm on the CPU: the row normalisations' registered functions (norm_ops.h) over the CPU
// kernels (cpu_norm.h).
#include <torch/csrc/stable/library.h>

#include "fusedops/cpu_norm.h"
#include "fusedops/norm_ops.h"

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  using K = fusedops::norm::cpu::Kernels;
  m.impl("rms_norm", TORCH_BOX(&fusedops::norm::rms_norm<K>));
  m.impl("rms_norm_backward", TORCH_BOX(&fusedops::norm::rms_norm_backward<K>));
}
