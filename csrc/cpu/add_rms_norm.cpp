// add_rms_norm on the CPU: the generic row-normalisation kernels (cpu_norm.h) with the residual
// added first; its backward is rms_norm's plus the gradient reaching residual_out.
#include <optional>
#include <tuple>

#include <torch/csrc/stable/library.h>

#include "fusedops/cpu_norm.h"

namespace fusedops::norm {
namespace {

std::tuple<Tensor, Tensor, Tensor> add_rms_norm_cpu(Tensor input, Tensor residual, std::optional<Tensor> weight,
                                                    double eps, double offset, bool cast_before_weight) {
  const AddProblem p = add_forward_problem("add_rms_norm", input, residual, weight, eps, offset, cast_before_weight);
  const ForwardOutputs o = add_forward_outputs(p, false, "add_rms_norm");
  cpu::add_forward(p, o, "add_rms_norm");
  return {o.out, *o.residual_out, o.rstd};
}

std::tuple<Tensor, Tensor> add_rms_norm_inplace_cpu(Tensor input, Tensor residual, std::optional<Tensor> weight,
                                                    double eps, double offset, bool cast_before_weight) {
  const AddProblem p = add_forward_problem("add_rms_norm_", input, residual, weight, eps, offset, cast_before_weight);
  const ForwardOutputs o = add_forward_outputs(p, true, "add_rms_norm_");
  cpu::add_forward(p, o, "add_rms_norm_");
  finish_in_place(residual, o);
  return {o.out, o.rstd};
}

std::tuple<Tensor, Tensor, Tensor> add_rms_norm_backward_cpu(Tensor grad_output,
                                                             std::optional<Tensor> grad_residual_out,
                                                             Tensor residual_out, std::optional<Tensor> weight,
                                                             Tensor rstd, double offset, bool weight_requires_grad) {
  const BackwardProblem p = add_backward_problem("add_rms_norm_backward", grad_output, grad_residual_out,
                                                 residual_out, weight, rstd, offset, weight_requires_grad);
  const BackwardOutputs o = backward_outputs(p);
  cpu::add_backward(p, o, "add_rms_norm_backward");
  return {o.grad_input, o.grad_residual ? *o.grad_residual : empty_like_device(residual_out, {0}, residual_out.scalar_type()),
          o.grad_weight};
}

}  // namespace
}  // namespace fusedops::norm

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  m.impl("add_rms_norm", TORCH_BOX(&fusedops::norm::add_rms_norm_cpu));
  m.impl("add_rms_norm_", TORCH_BOX(&fusedops::norm::add_rms_norm_inplace_cpu));
  m.impl("add_rms_norm_backward", TORCH_BOX(&fusedops::norm::add_rms_norm_backward_cpu));
}
