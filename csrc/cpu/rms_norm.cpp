// rms_norm on the CPU: the generic row-normalisation kernels (cpu_norm.h), uncentred, no bias.
#include <optional>
#include <tuple>

#include <torch/csrc/stable/library.h>

#include "fusedops/cpu_norm.h"

namespace fusedops::norm {
namespace {

std::tuple<Tensor, Tensor> rms_norm_cpu(Tensor input, std::optional<Tensor> weight, double eps) {
  auto [out, mean, rstd] = cpu::forward<false>("rms_norm", input, weight, std::nullopt, eps);
  return {out, rstd};
}

std::tuple<Tensor, Tensor> rms_norm_backward_cpu(Tensor grad_output, Tensor input, std::optional<Tensor> weight,
                                                 Tensor rstd, bool weight_requires_grad) {
  const BackwardProblem p = backward_problem("rms_norm_backward", "rms_norm", grad_output, input, weight,
                                             std::nullopt, std::nullopt, rstd, weight_requires_grad, false);
  auto [grad_input, grad_weight, grad_bias] = cpu::backward<false>(p, "rms_norm_backward");
  return {grad_input, grad_weight};
}

}  // namespace
}  // namespace fusedops::norm

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  m.impl("rms_norm", TORCH_BOX(&fusedops::norm::rms_norm_cpu));
  m.impl("rms_norm_backward", TORCH_BOX(&fusedops::norm::rms_norm_backward_cpu));
}
