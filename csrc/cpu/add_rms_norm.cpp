// add_rms_norm on the CPU: the row normalisations' registered functions (norm_ops.h) over the CPU
// kernels (cpu_norm.h).
#include <torch/csrc/stable/library.h>

#include "fusedops/cpu_norm.h"
#include "fusedops/norm_ops.h"

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  using K = fusedops::norm::cpu::Kernels;
  m.impl("add_rms_norm", TORCH_BOX(&fusedops::norm::add_rms_norm<K>));
  m.impl("add_rms_norm_", TORCH_BOX(&fusedops::norm::add_rms_norm_inplace<K>));
  m.impl("add_rms_norm_backward", TORCH_BOX(&fusedops::norm::add_rms_norm_backward<K>));
}
