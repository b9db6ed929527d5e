// rms_norm: argument checks and output allocation shared by the CPU and CUDA kernels.
// The Python fake kernels (src/fusedops/ops/rms_norm.py) raise the same messages.
#pragma once

#include <cmath>
#include <optional>
#include <vector>

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "fusedops/checks.h"
#include "fusedops/rows.h"
#include "fusedops/tensors.h"

namespace fusedops::rms_norm {

// Everything a forward or backward kernel needs, after checking.
struct Problem {
  Tensor input;                 // last dimension has unit stride
  std::optional<Tensor> weight;  // contiguous, or absent
  RowLayout rows;               // how to find each row of `input`
  int64_t num_rows = 0;
  int64_t n = 0;                // the normalised (last) dimension

  bool empty() const { return num_rows == 0 || n == 0; }
};

// The backward's inputs beyond the forward's: grad_output's rows and a contiguous rstd.
struct BackwardProblem : Problem {
  Tensor grad_output;
  RowLayout grad_rows;
  Tensor rstd;
  bool want_grad_weight = false;
};

// Leading-dimension sizes of `t`, i.e. the shape of rstd.
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

// Makes the rows of `t` addressable by a RowLayout, copying only when the last dimension is
// strided or the leading dimensions cannot be collapsed to RowLayout::kMaxDims.
inline Tensor with_row_layout(const Tensor& t, RowLayout& rows) {
  if ((t.size(-1) <= 1 || t.stride(-1) == 1) && collapse_rows(t, rows)) return t;
  Tensor c = torch::stable::contiguous(t);
  collapse_rows(c, rows);
  return c;
}

inline Problem make_problem(const Tensor& input, const std::optional<Tensor>& weight) {
  Problem p;
  p.input = with_row_layout(input, p.rows);
  if (weight.has_value()) p.weight = as_contiguous(*weight);
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

inline void check_weight(const char* op, const Tensor& input, const std::optional<Tensor>& weight) {
  if (!weight.has_value()) return;
  const Tensor& w = *weight;
  const int64_t n = input.size(-1);
  FUSEDOPS_CHECK(w.dim() == 1 && w.size(0) == n, op, ": weight must be a 1-D tensor of size ", n,
                 " (the size of input's last dimension), got shape ", shape_str(w));
  const ScalarType xt = input.scalar_type(), wt = w.scalar_type();
  const bool narrow = xt == ScalarType::BFloat16 || xt == ScalarType::Half;
  FUSEDOPS_CHECK(wt == xt || (narrow && wt == ScalarType::Float), op, ": weight dtype ", dtype_name(wt),
                 " does not go with input dtype ", dtype_name(xt),
                 ": use the input's dtype, or float32 with bfloat16/float16 input");
  FUSEDOPS_CHECK(w.get_device() == input.get_device() && w.is_cpu() == input.is_cpu(), op,
                 ": weight is on ", device_str(w), " but input is on ", device_str(input));
}

inline Problem forward_problem(const Tensor& input, const std::optional<Tensor>& weight, double eps) {
  check_input("rms_norm", input);
  check_weight("rms_norm", input, weight);
  FUSEDOPS_CHECK(std::isfinite(eps) && eps >= 0, "rms_norm: eps must be a finite number >= 0, got ", eps);
  return make_problem(input, weight);
}

// Checks the backward arguments against each other.
inline BackwardProblem backward_problem(const Tensor& grad_output, const Tensor& input,
                                        const std::optional<Tensor>& weight, const Tensor& rstd,
                                        bool weight_requires_grad) {
  const char* op = "rms_norm_backward";
  check_input(op, input);
  check_weight(op, input, weight);
  FUSEDOPS_CHECK(shape_of(grad_output) == shape_of(input), op, ": grad_output shape ",
                 shape_str(grad_output), " does not match input shape ", shape_str(input));
  FUSEDOPS_CHECK(grad_output.scalar_type() == input.scalar_type(), op, ": grad_output dtype ",
                 dtype_name(grad_output.scalar_type()), " does not match input dtype ",
                 dtype_name(input.scalar_type()));
  FUSEDOPS_CHECK(shape_of(rstd) == row_shape(input) && rstd.scalar_type() == acc_dtype(input.scalar_type()),
                 op, ": rstd must be a ", dtype_name(acc_dtype(input.scalar_type())),
                 " tensor of input's leading shape (as returned by rms_norm), got ",
                 dtype_name(rstd.scalar_type()), " of shape ", shape_str(rstd));
  FUSEDOPS_CHECK(grad_output.get_device() == input.get_device() && grad_output.is_cpu() == input.is_cpu(),
                 op, ": grad_output is on ", device_str(grad_output), " but input is on ", device_str(input));
  FUSEDOPS_CHECK(rstd.get_device() == input.get_device() && rstd.is_cpu() == input.is_cpu(), op,
                 ": rstd is on ", device_str(rstd), " but input is on ", device_str(input));
  BackwardProblem p;
  static_cast<Problem&>(p) = make_problem(input, weight);
  p.grad_output = with_row_layout(grad_output, p.grad_rows);
  p.rstd = as_contiguous(rstd);
  p.want_grad_weight = weight.has_value() && weight_requires_grad;
  return p;
}

// output (input's shape and dtype) and rstd (leading shape, accumulation dtype).
inline std::tuple<Tensor, Tensor> forward_outputs(const Tensor& input) {
  const ScalarType xt = input.scalar_type();
  return {empty_like_device(input, shape_of(input), xt), empty_like_device(input, row_shape(input), acc_dtype(xt))};
}

// grad_input, and grad_weight: (n,) in weight's dtype when wanted (zeros if there is nothing to
// sum), else an empty tensor.
inline std::tuple<Tensor, Tensor> backward_outputs(const BackwardProblem& p, const Tensor& input) {
  const ScalarType xt = input.scalar_type();
  Tensor grad_input = empty_like_device(input, shape_of(input), xt);
  if (!p.want_grad_weight)
    return {grad_input, empty_like_device(input, {0}, p.weight ? p.weight->scalar_type() : xt)};
  Tensor grad_weight = empty_like_device(input, {p.n}, p.weight->scalar_type());
  if (p.empty()) torch::stable::zero_(grad_weight);
  return {grad_input, grad_weight};
}

}  // namespace fusedops::rms_norm
