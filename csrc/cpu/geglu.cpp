// geglu and geglu_packed on the CPU: the gated activations' registered functions (gated.h) over
// the CPU kernels (cpu_gated.h).
#include <torch/csrc/stable/library.h>

#include "fusedops/cpu_gated.h"

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  using K = fusedops::gated::cpu::Kernels<true>;
  m.impl("geglu", TORCH_BOX(&fusedops::gated::geglu<K>));
  m.impl("geglu_backward", TORCH_BOX(&fusedops::gated::geglu_backward<K>));
  m.impl("geglu_packed", TORCH_BOX(&fusedops::gated::geglu_packed<K>));
  m.impl("geglu_packed_backward", TORCH_BOX(&fusedops::gated::geglu_packed_backward<K>));
}
