// layer_norm on the CPU: the generic row-normalisation kernels (cpu_norm.h), centred, with bias.
#include <optional>
#include <tuple>

#include <torch/csrc/stable/library.h>

#include "fusedops/cpu_norm.h"

namespace fusedops::norm {
namespace {

std::tuple<Tensor, Tensor, Tensor> layer_norm_cpu(Tensor input, std::optional<Tensor> weight,
                                                  std::optional<Tensor> bias, double eps) {
  auto [out, mean, rstd] = cpu::forward<true>("layer_norm", input, weight, bias, eps);
  return {out, *mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_backward_cpu(Tensor grad_output, Tensor input,
                                                           std::optional<Tensor> weight, std::optional<Tensor> bias,
                                                           Tensor mean, Tensor rstd, bool weight_requires_grad,
                                                           bool bias_requires_grad) {
  const BackwardProblem p = backward_problem("layer_norm_backward", "layer_norm", grad_output, input, weight, bias,
                                             mean, rstd, weight_requires_grad, bias_requires_grad);
  return cpu::backward<true>(p, "layer_norm_backward");
}

}  // namespace
}  // namespace fusedops::norm

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  m.impl("layer_norm", TORCH_BOX(&fusedops::norm::layer_norm_cpu));
  m.impl("layer_norm_backward", TORCH_BOX(&fusedops::norm::layer_norm_backward_cpu));
}
