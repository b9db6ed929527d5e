// The row normalisations' registered functions (rms_norm, add_rms_norm, layer_norm and their
// backwards), written once for both native backends: check the arguments and allocate the
// outputs (norm.h), then run the backend's kernels. `K` is cpu::Kernels (cpu_norm.h) or
// cuda::Kernels (cuda_norm.cuh); csrc/cpu/<op>.cpp and csrc/cuda/<op>.cu only register these.
#pragma once

#include <optional>
#include <tuple>

#include "fusedops/norm.h"

namespace fusedops::norm {

template <class K>
std::tuple<Tensor, Tensor> rms_norm(Tensor input, std::optional<Tensor> weight, double eps, double offset,
                                    bool cast_before_weight, bool /*save_output: autograd's*/) {
  const Problem p = forward_problem("rms_norm", input, weight, std::nullopt, eps, offset, cast_before_weight);
  const ForwardOutputs o = forward_outputs(p, false);
  K::template forward<false>(p, o, "rms_norm");
  return {o.out, o.rstd};
}

template <class K>
std::tuple<Tensor, Tensor> rms_norm_backward(Tensor grad_output, Tensor saved, std::optional<Tensor> weight,
                                             Tensor rstd, double offset, bool saved_is_output,
                                             bool weight_requires_grad) {
  check_given("rms_norm_backward", "saved", saved);  // (the shared checks call it input or output)
  const BackwardProblem p = backward_problem("rms_norm_backward", "rms_norm", grad_output, saved, weight, std::nullopt,
                                             std::nullopt, rstd, weight_requires_grad, false, offset, saved_is_output);
  const BackwardOutputs o = backward_outputs(p);
  K::template backward<false>(p, o, "rms_norm_backward");
  return {o.grad_input, o.grad_weight};
}

template <class K>
std::tuple<Tensor, Tensor, Tensor> add_rms_norm(Tensor input, Tensor residual, std::optional<Tensor> weight,
                                                double eps, double offset, bool cast_before_weight) {
  const AddProblem p = add_forward_problem("add_rms_norm", input, residual, weight, eps, offset, cast_before_weight);
  const ForwardOutputs o = add_forward_outputs(p, false, "add_rms_norm");
  K::add_forward(p, o, "add_rms_norm");
  return {o.out, *o.residual_out, o.rstd};
}

template <class K>
std::tuple<Tensor, Tensor> add_rms_norm_inplace(Tensor input, Tensor residual, std::optional<Tensor> weight,
                                                double eps, double offset, bool cast_before_weight) {
  const AddProblem p = add_forward_problem("add_rms_norm_", input, residual, weight, eps, offset, cast_before_weight);
  // Elements sharing memory would be written by several threads at once (torch's in-place ops
  // refuse such tensors too). The caller's residual, not p.residual: that may be a copy.
  FUSEDOPS_CHECK(residual.numel() == 0 || !may_overlap(residual),
                 "add_rms_norm_: residual has rows that share memory (an expanded tensor?), so it cannot be written "
                 "in place; pass a contiguous residual");
  // Rows written before later rows read the weight: eager and compiled (functionalised) calls
  // would disagree.
  FUSEDOPS_CHECK(!weight || overlap(*weight, residual) == Overlap::kNone,
                 "add_rms_norm_: weight shares memory with residual, which is updated in place; pass a weight that "
                 "does not overlap residual (a clone)");
  const ForwardOutputs o = add_forward_outputs(p, true, "add_rms_norm_");
  K::add_forward(p, o, "add_rms_norm_");
  finish_in_place(residual, o);
  return {o.out, o.rstd};
}

template <class K>
std::tuple<Tensor, Tensor, Tensor> add_rms_norm_backward(Tensor grad_output, std::optional<Tensor> grad_residual_out,
                                                         Tensor residual_out, std::optional<Tensor> weight, Tensor rstd,
                                                         double offset, bool weight_requires_grad) {
  const BackwardProblem p = add_backward_problem("add_rms_norm_backward", grad_output, grad_residual_out, residual_out,
                                                 weight, rstd, offset, weight_requires_grad);
  const BackwardOutputs o = backward_outputs(p);
  K::add_backward(p, o, "add_rms_norm_backward");
  // (empty when grad_input, in the same dtype, is the residual's gradient too)
  Tensor grad_residual = o.grad_residual ? *o.grad_residual : empty_like_device(residual_out, {0}, residual_out.scalar_type());
  return {o.grad_input, grad_residual, o.grad_weight};
}

template <class K>
std::tuple<Tensor, Tensor, Tensor> layer_norm(Tensor input, std::optional<Tensor> weight, std::optional<Tensor> bias,
                                              double eps) {
  const Problem p = forward_problem("layer_norm", input, weight, bias, eps);
  const ForwardOutputs o = forward_outputs(p, true);
  K::template forward<true>(p, o, "layer_norm");
  return {o.out, *o.mean, o.rstd};
}

template <class K>
std::tuple<Tensor, Tensor, Tensor> layer_norm_backward(Tensor grad_output, Tensor input, std::optional<Tensor> weight,
                                                       std::optional<Tensor> bias, Tensor mean, Tensor rstd,
                                                       bool weight_requires_grad, bool bias_requires_grad) {
  const BackwardProblem p = backward_problem("layer_norm_backward", "layer_norm", grad_output, input, weight, bias, mean,
                                             rstd, weight_requires_grad, bias_requires_grad);
  const BackwardOutputs o = backward_outputs(p);
  K::template backward<true>(p, o, "layer_norm_backward");
  return {o.grad_input, o.grad_weight, o.grad_bias ? *o.grad_bias : param_grad(p, p.bias, false)};
}

}  // namespace fusedops::norm
