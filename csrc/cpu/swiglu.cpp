// swiglu and swiglu_packed on the CPU: the gated activations' registered functions (gated.h) over
// the CPU kernels (cpu_gated.h).
#include <torch/csrc/stable/library.h>

#include "fusedops/cpu_gated.h"

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  using K = fusedops::gated::cpu::Kernels<false>;
  m.impl("swiglu", TORCH_BOX(&fusedops::gated::swiglu<K>));
  m.impl("swiglu_backward", TORCH_BOX(&fusedops::gated::swiglu_backward<K>));
  m.impl("swiglu_packed", TORCH_BOX(&fusedops::gated::swiglu_packed<K>));
  m.impl("swiglu_packed_backward", TORCH_BOX(&fusedops::gated::swiglu_packed_backward<K>));
}
