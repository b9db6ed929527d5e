// layer_norm on CUDA: the generic row-normalisation kernels (cuda_norm.cuh), centred, with bias.
#include <optional>
#include <tuple>

#include <torch/csrc/stable/library.h>

#include "fusedops/cuda_norm.cuh"

namespace fusedops::norm {
namespace {

std::tuple<Tensor, Tensor, Tensor> layer_norm_cuda(Tensor input, std::optional<Tensor> weight,
                                                  std::optional<Tensor> bias, double eps) {
  const Problem p = forward_problem("layer_norm", input, weight, bias, eps);
  const ForwardOutputs o = forward_outputs(p, true);
  cuda::forward<true>(p, o, "layer_norm");
  return {o.out, *o.mean, o.rstd};
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_backward_cuda(Tensor grad_output, Tensor input,
                                                           std::optional<Tensor> weight, std::optional<Tensor> bias,
                                                           Tensor mean, Tensor rstd, bool weight_requires_grad,
                                                           bool bias_requires_grad) {
  const BackwardProblem p = backward_problem("layer_norm_backward", "layer_norm", grad_output, input, weight, bias,
                                             mean, rstd, weight_requires_grad, bias_requires_grad);
  const BackwardOutputs o = backward_outputs(p);
  cuda::backward<true>(p, o, "layer_norm_backward");
  return {o.grad_input, o.grad_weight, o.grad_bias};
}

}  // namespace
}  // namespace fusedops::norm

STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("layer_norm", TORCH_BOX(&fusedops::norm::layer_norm_cuda));
  m.impl("layer_norm_backward", TORCH_BOX(&fusedops::norm::layer_norm_backward_cuda));
}
