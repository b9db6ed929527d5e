// Row normalisations (rms_norm, layer_norm): argument checks and output allocation shared by
// their CPU and CUDA kernels. The Python fake kernels (src/fusedops/ops/_norm.py) raise the
// same messages.
#pragma once

#include <cmath>
#include <optional>
#include <vector>

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "fusedops/checks.h"
#include "fusedops/rows.h"
#include "fusedops/tensors.h"

namespace fusedops::norm {

// Everything a forward or backward kernel needs, after checking.
struct Problem {
  Tensor input;                  // last dimension has unit stride
  std::optional<Tensor> weight;  // contiguous, or absent
  std::optional<Tensor> bias;    // contiguous, or absent (layer_norm only)
  RowLayout rows;                // how to find each row of `input`
  int64_t num_rows = 0;
  int64_t n = 0;                 // the normalised (last) dimension

  bool empty() const { return num_rows == 0 || n == 0; }
  // The dtype of the affine parameters (weight and bias share it), else the input's.
  ScalarType param_dtype() const {
    return weight ? weight->scalar_type() : bias ? bias->scalar_type() : input.scalar_type();
  }
};

// The backward's inputs beyond the forward's: grad_output's rows and the saved statistics.
struct BackwardProblem : Problem {
  Tensor grad_output;
  RowLayout grad_rows;
  std::optional<Tensor> mean;  // layer_norm only
  Tensor rstd;
  bool want_grad_weight = false;
  bool want_grad_bias = false;
};

// Leading-dimension sizes of `t`, i.e. the shape of the per-row statistics.
inline std::vector<int64_t> row_shape(const Tensor& t) {
  std::vector<int64_t> s;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) s.push_back(t.size(d));
  return s;
}

inline std::vector<int64_t> shape_of(const Tensor& t) {
  std::vector<int64_t> s;
  for (int64_t d = 0; d < t.dim(); ++d) s.push_back(t.size(d));
  return s;
}

inline bool same_device(const Tensor& a, const Tensor& b) {
  return a.get_device() == b.get_device() && a.is_cpu() == b.is_cpu();
}

// Makes the rows of `t` addressable by a RowLayout, copying only when the last dimension is
// strided or the leading dimensions cannot be collapsed to RowLayout::kMaxDims.
inline Tensor with_row_layout(const Tensor& t, RowLayout& rows) {
  if ((t.size(-1) <= 1 || t.stride(-1) == 1) && collapse_rows(t, rows)) return t;
  Tensor c = torch::stable::contiguous(t);
  collapse_rows(c, rows);
  return c;
}

inline Problem make_problem(const Tensor& input, const std::optional<Tensor>& weight,
                            const std::optional<Tensor>& bias) {
  Problem p;
  p.input = with_row_layout(input, p.rows);
  if (weight.has_value()) p.weight = as_contiguous(*weight);
  if (bias.has_value()) p.bias = as_contiguous(*bias);
  p.n = input.size(-1);
  p.num_rows = 1;
  for (int64_t d = 0; d + 1 < input.dim(); ++d) p.num_rows *= input.size(d);
  return p;
}

inline void check_input(const char* op, const Tensor& input) {
  FUSEDOPS_CHECK(input.dim() >= 1, op, ": input must have at least 1 dimension, got a 0-dimensional tensor");
  FUSEDOPS_CHECK(is_float_dtype(input.scalar_type()), op,
                 ": input dtype must be float32, bfloat16, float16 or float64, got ",
                 dtype_name(input.scalar_type()));
}

// An affine parameter (`name` is "weight" or "bias"): (n,), in input's dtype or float32 with a
// 16-bit input, on input's device.
inline void check_param(const char* op, const char* name, const Tensor& input, const std::optional<Tensor>& param) {
  if (!param.has_value()) return;
  const Tensor& w = *param;
  const int64_t n = input.size(-1);
  FUSEDOPS_CHECK(w.dim() == 1 && w.size(0) == n, op, ": ", name, " must be a 1-D tensor of size ", n,
                 " (the size of input's last dimension), got shape ", shape_str(w));
  const ScalarType xt = input.scalar_type(), wt = w.scalar_type();
  const bool narrow = xt == ScalarType::BFloat16 || xt == ScalarType::Half;
  FUSEDOPS_CHECK(wt == xt || (narrow && wt == ScalarType::Float), op, ": ", name, " dtype ", dtype_name(wt),
                 " does not go with input dtype ", dtype_name(xt),
                 ": use the input's dtype, or float32 with bfloat16/float16 input");
  FUSEDOPS_CHECK(same_device(w, input), op, ": ", name, " is on ", device_str(w), " but input is on ",
                 device_str(input));
}

inline void check_params(const char* op, const Tensor& input, const std::optional<Tensor>& weight,
                         const std::optional<Tensor>& bias) {
  check_param(op, "weight", input, weight);
  check_param(op, "bias", input, bias);
  if (weight && bias)
    FUSEDOPS_CHECK(weight->scalar_type() == bias->scalar_type(), op, ": bias dtype ",
                   dtype_name(bias->scalar_type()), " does not match weight dtype ",
                   dtype_name(weight->scalar_type()));
}

inline void check_eps(const char* op, double eps) {
  FUSEDOPS_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be a finite number >= 0, got ", eps);
}

inline Problem forward_problem(const char* op, const Tensor& input, const std::optional<Tensor>& weight,
                               const std::optional<Tensor>& bias, double eps) {
  check_input(op, input);
  check_params(op, input, weight, bias);
  check_eps(op, eps);
  return make_problem(input, weight, bias);
}

// A saved statistic (`name`: "rstd" or "mean") as the forward op `forward_op` returned it.
inline void check_stat(const char* op, const char* forward_op, const char* name, const Tensor& input,
                       const Tensor& stat) {
  const ScalarType acc = acc_dtype(input.scalar_type());
  FUSEDOPS_CHECK(shape_of(stat) == row_shape(input) && stat.scalar_type() == acc, op, ": ", name, " must be a ",
                 dtype_name(acc), " tensor of input's leading shape (as returned by ", forward_op, "), got ",
                 dtype_name(stat.scalar_type()), " of shape ", shape_str(stat));
  FUSEDOPS_CHECK(same_device(stat, input), op, ": ", name, " is on ", device_str(stat), " but input is on ",
                 device_str(input));
}

// Checks the backward arguments against each other.
inline BackwardProblem backward_problem(const char* op, const char* forward_op, const Tensor& grad_output,
                                        const Tensor& input, const std::optional<Tensor>& weight,
                                        const std::optional<Tensor>& bias, const std::optional<Tensor>& mean,
                                        const Tensor& rstd, bool weight_requires_grad, bool bias_requires_grad) {
  check_input(op, input);
  check_params(op, input, weight, bias);
  FUSEDOPS_CHECK(shape_of(grad_output) == shape_of(input), op, ": grad_output shape ",
                 shape_str(grad_output), " does not match input shape ", shape_str(input));
  FUSEDOPS_CHECK(grad_output.scalar_type() == input.scalar_type(), op, ": grad_output dtype ",
                 dtype_name(grad_output.scalar_type()), " does not match input dtype ",
                 dtype_name(input.scalar_type()));
  FUSEDOPS_CHECK(same_device(grad_output, input), op, ": grad_output is on ", device_str(grad_output),
                 " but input is on ", device_str(input));
  if (mean) check_stat(op, forward_op, "mean", input, *mean);
  check_stat(op, forward_op, "rstd", input, rstd);
  BackwardProblem p;
  static_cast<Problem&>(p) = make_problem(input, weight, bias);
  p.grad_output = with_row_layout(grad_output, p.grad_rows);
  if (mean) p.mean = as_contiguous(*mean);
  p.rstd = as_contiguous(rstd);
  p.want_grad_weight = weight.has_value() && weight_requires_grad;
  p.want_grad_bias = bias.has_value() && bias_requires_grad;
  return p;
}

// A new tensor of input's shape and dtype.
inline Tensor output_like(const Tensor& input) {
  return empty_like_device(input, shape_of(input), input.scalar_type());
}

// One statistic per row, in the accumulation dtype.
inline Tensor row_stat(const Tensor& input) {
  return empty_like_device(input, row_shape(input), acc_dtype(input.scalar_type()));
}

// The gradient of an affine parameter: (n,) in its dtype when wanted (zeros if there is nothing
// to sum), else an empty tensor.
inline Tensor param_grad(const BackwardProblem& p, const std::optional<Tensor>& param, bool wanted) {
  if (!wanted) return empty_like_device(p.input, {0}, param ? param->scalar_type() : p.input.scalar_type());
  Tensor g = empty_like_device(p.input, {p.n}, param->scalar_type());
  if (p.empty()) torch::stable::zero_(g);
  return g;
}

}  // namespace fusedops::norm
