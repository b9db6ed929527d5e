// Every fusedops schema, in one place. Kernels register against these names from
// csrc/cpu/<op>.cpp and csrc/cuda/<op>.cu; fake kernels, autograd and autocast rules from
// src/fusedops/ops/<op>.py. tests/test_schemas.py freezes this list: a change here is an ABI
// change and shows up there as a deliberate diff.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(fusedops, m) {
  // RMSNorm over the last dimension. Returns the output (input's dtype) and the reciprocal
  // root-mean-square of each row (float32; float64 for float64 input), which backward reuses.
  m.def("rms_norm(Tensor input, Tensor? weight, float eps) -> (Tensor output, Tensor rstd)");
  // grad_weight is an empty tensor unless weight is given and weight_requires_grad is true.
  m.def(
      "rms_norm_backward(Tensor grad_output, Tensor input, Tensor? weight, Tensor rstd, "
      "bool weight_requires_grad) -> (Tensor grad_input, Tensor grad_weight)");

  // LayerNorm over the last dimension, with optional weight and bias (same dtype). Returns the
  // output (input's dtype) and each row's mean and reciprocal standard deviation (float32;
  // float64 for float64 input), which backward reuses.
  m.def("layer_norm(Tensor input, Tensor? weight, Tensor? bias, float eps) -> (Tensor output, Tensor mean, Tensor rstd)");
  // grad_weight / grad_bias are empty tensors unless that parameter is given and requires grad.
  m.def(
      "layer_norm_backward(Tensor grad_output, Tensor input, Tensor? weight, Tensor? bias, Tensor mean, "
      "Tensor rstd, bool weight_requires_grad, bool bias_requires_grad) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
}
