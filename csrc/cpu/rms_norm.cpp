// rms_norm on the CPU: the generic row-normalisation kernels (cpu_norm.h), uncentred, no bias.
#include <optional>
#include <tuple>

#include <torch/csrc/stable/library.h>

#include "fusedops/cpu_norm.h"

namespace fusedops::norm {
namespace {

std::tuple<Tensor, Tensor> rms_norm_cpu(Tensor input, std::optional<Tensor> weight, double eps, double offset,
                                        bool cast_before_weight, bool /*save_output: autograd's*/) {
  const Problem p = forward_problem("rms_norm", input, weight, std::nullopt, eps, offset, cast_before_weight);
  const ForwardOutputs o = forward_outputs(p, false);
  cpu::forward<false>(p, o, "rms_norm");
  return {o.out, o.rstd};
}

std::tuple<Tensor, Tensor> rms_norm_backward_cpu(Tensor grad_output, Tensor saved, std::optional<Tensor> weight,
                                                 Tensor rstd, double offset, bool saved_is_output,
                                                 bool weight_requires_grad) {
  const BackwardProblem p = backward_problem("rms_norm_backward", "rms_norm", grad_output, saved, weight,
                                             std::nullopt, std::nullopt, rstd, weight_requires_grad, false, offset,
                                             saved_is_output);
  const BackwardOutputs o = backward_outputs(p);
  cpu::backward<false>(p, o, "rms_norm_backward");
  return {o.grad_input, o.grad_weight};
}

}  // namespace
}  // namespace fusedops::norm

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  m.impl("rms_norm", TORCH_BOX(&fusedops::norm::rms_norm_cpu));
  m.impl("rms_norm_backward", TORCH_BOX(&fusedops::norm::rms_norm_backward_cpu));
}
