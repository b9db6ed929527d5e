// Row normalisations (rms_norm, add_rms_norm, layer_norm): argument checks and output
// allocation shared by their CPU and CUDA kernels. The Python fake kernels
// (src/fusedops/ops/_norm.py) raise the same messages.
//
// What every backend computes (CPU, CUDA and Triton agree). acc = float32 (float64 for float64
// input); T = input dtype; W = weight dtype (T, or float32 with 16-bit T); R = residual dtype
// (T, or float32 with 16-bit T).
//
// rms_norm(x, weight?, eps, offset, cast_before_weight) -> (output, rstd)
//   rstd = 1 / sqrt(mean_j x^2 + eps); xhat = x * rstd, rounded to T and back when
//   cast_before_weight (LLaMA); output = round_T(xhat * (offset + w)) (xhat without a weight,
//   where offset must be 0).
// rms_norm_backward(dy, saved, weight?, rstd, offset, saved_is_output, weight_requires_grad)
//   xhat = saved * rstd, or saved / (offset + w) when `saved` is the forward's output;
//   g = dy * (offset + w); dx = rstd * (g - xhat * mean_j(g * xhat)); dw = sum_rows dy * xhat
//   (the casting mode's rounding counts as the identity).
// add_rms_norm(x, residual, weight?, eps, offset, cast_before_weight)
//   -> (output in T, residual_out in R, rstd): h = round_R(x + residual) is residual_out, and
//   output is rms_norm of that rounded h. add_rms_norm_ writes h into residual itself.
// add_rms_norm_backward(dy, grad_residual_out?, residual_out, weight?, rstd, offset, ...)
//   dh = rms_norm_backward(dy, h) + grad_residual_out; grad_input = round_T(dh), and
//   grad_residual = round_R(dh) only when R is wider than T.
// layer_norm centres the row first and adds a bias; it has none of these options.
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
  // The uncentred norms' options (layer_norm keeps the defaults): the weight scales as
  // (offset + weight), Gemma's 1 + weight; cast_before_weight rounds the normalised row to the
  // output dtype before the weight multiply, as LLaMA-style models do.
  double eps = 0;
  double offset = 0;
  bool cast_before_weight = false;

  bool empty() const { return num_rows == 0 || n == 0; }
  // The dtype of the affine parameters (weight and bias share it), else the input's.
  ScalarType param_dtype() const {
    return weight ? weight->scalar_type() : bias ? bias->scalar_type() : input.scalar_type();
  }
};

// add_rms_norm's forward: `residual` (input's dtype, or float32 with 16-bit input) is added to
// `input` first; the sum is rounded to residual's dtype, written to `residual_out` and
// normalised. The output keeps input's dtype.
struct AddProblem : Problem {
  Tensor residual;
  RowLayout residual_rows;
};

// What a forward writes. `out` is contiguous in input's dtype; `residual_out` (add_rms_norm)
// is laid out by residual_out_rows: contiguous, or the residual itself for the in-place form.
struct ForwardOutputs {
  Tensor out;
  std::optional<Tensor> mean;  // layer_norm only
  Tensor rstd;
  std::optional<Tensor> residual_out;
  RowLayout residual_out_rows;
};

// The backward's inputs beyond the forward's: grad_output's rows and the saved statistics.
// For add_rms_norm, `input` is the saved residual_out and grad_output has the forward output's
// dtype (the forward input's), which may be narrower than residual_out's.
struct BackwardProblem : Problem {
  Tensor grad_output;
  RowLayout grad_rows;
  std::optional<Tensor> mean;  // layer_norm only
  Tensor rstd;
  bool want_grad_weight = false;
  bool want_grad_bias = false;
  // rms_norm's memory-saving backward: `input` holds the forward's output y, and the kernels
  // recover xhat = y / (offset + weight) instead of x * rstd.
  bool saved_is_output = false;
  // add_rms_norm: the gradient reaching residual_out, added to the input gradient (absent: zero).
  std::optional<Tensor> grad_residual_out;
  RowLayout grad_residual_rows;
};

// What a backward writes: grad_input (contiguous, grad_output's dtype) and, for add_rms_norm
// with a residual wider than the input, grad_residual (contiguous, residual_out's dtype; absent
// when grad_input serves both). Parameter gradients are empty tensors when not wanted.
struct BackwardOutputs {
  Tensor grad_input;
  std::optional<Tensor> grad_residual;
  Tensor grad_weight;
  std::optional<Tensor> grad_bias;  // only when wanted (layer_norm's op returns an empty one otherwise)
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

inline bool is_narrow(ScalarType t) { return t == ScalarType::BFloat16 || t == ScalarType::Half; }

// `name` is "input" (or "residual_out", the input of add_rms_norm's backward).
inline void check_input(const char* op, const Tensor& input, const char* name = "input") {
  check_given(op, name, input);
  FUSEDOPS_CHECK(input.dim() >= 1, op, ": ", name, " must have at least 1 dimension, got a 0-dimensional tensor");
  FUSEDOPS_CHECK(is_float_dtype(input.scalar_type()), op, ": ", name,
                 " dtype must be float32, bfloat16, float16 or float64, got ", dtype_name(input.scalar_type()));
}

// A tensor that goes with `input` element for element: same shape and device, and `dtype_ok`.
// (Callers check_given `t` first: computing `dtype_ok` asks it for its dtype.)
inline void check_like_input(const char* op, const char* name, const Tensor& t, const char* input_name,
                             const Tensor& input, bool dtype_ok, const char* dtype_rule) {
  FUSEDOPS_CHECK(shape_of(t) == shape_of(input), op, ": ", name, " shape ", shape_str(t), " does not match ",
                 input_name, " shape ", shape_str(input));
  FUSEDOPS_CHECK(dtype_ok, op, ": ", name, " dtype ", dtype_name(t.scalar_type()), " does not go with ",
                 input_name, " dtype ", dtype_name(input.scalar_type()), dtype_rule);
  FUSEDOPS_CHECK(same_device(t, input), op, ": ", name, " is on ", device_str(t), " but ", input_name, " is on ",
                 device_str(input));
}

// An affine parameter (`name` is "weight" or "bias"): (n,), in the dtype of `like` (the input,
// or what stands for it in a backward: `like_name`) or float32 with a 16-bit `like`, on its device.
inline void check_param(const char* op, const char* name, const Tensor& like, const std::optional<Tensor>& param,
                        const char* like_name) {
  if (!param.has_value()) return;
  const Tensor& w = *param;
  const int64_t n = like.size(-1);
  FUSEDOPS_CHECK(w.dim() == 1 && w.size(0) == n, op, ": ", name, " must be a 1-D tensor of size ", n, " (the size of ",
                 like_name, "'s last dimension), got shape ", shape_str(w));
  const ScalarType xt = like.scalar_type(), wt = w.scalar_type();
  FUSEDOPS_CHECK(wt == xt || (is_narrow(xt) && wt == ScalarType::Float), op, ": ", name, " dtype ", dtype_name(wt),
                 " does not go with ", like_name, " dtype ", dtype_name(xt), ": use the ", like_name,
                 "'s dtype, or float32 with bfloat16/float16 ", like_name);
  FUSEDOPS_CHECK(same_device(w, like), op, ": ", name, " is on ", device_str(w), " but ", like_name, " is on ",
                 device_str(like));
}

inline void check_params(const char* op, const Tensor& like, const std::optional<Tensor>& weight,
                         const std::optional<Tensor>& bias, const char* like_name = "input") {
  check_param(op, "weight", like, weight, like_name);
  check_param(op, "bias", like, bias, like_name);
  if (weight && bias)
    FUSEDOPS_CHECK(weight->scalar_type() == bias->scalar_type(), op, ": bias dtype ",
                   dtype_name(bias->scalar_type()), " does not match weight dtype ",
                   dtype_name(weight->scalar_type()));
}

inline void check_eps(const char* op, double eps) {
  FUSEDOPS_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be a finite number >= 0, got ", eps);
}

inline void check_offset(const char* op, double offset, const std::optional<Tensor>& weight) {
  FUSEDOPS_CHECK(std::isfinite(offset), op, ": offset must be a finite number, got ", offset);
  FUSEDOPS_CHECK(offset == 0 || weight.has_value(), op, ": offset scales the weight (offset + weight), so it needs a weight; got offset ",
                 offset, " without one");
}

// layer_norm, or rms_norm with its options.
inline Problem forward_problem(const char* op, const Tensor& input, const std::optional<Tensor>& weight,
                               const std::optional<Tensor>& bias, double eps, double offset = 0,
                               bool cast_before_weight = false) {
  check_input(op, input);
  check_params(op, input, weight, bias);
  check_eps(op, eps);
  check_offset(op, offset, weight);
  Problem p = make_problem(input, weight, bias);
  p.eps = eps;
  p.offset = offset;
  p.cast_before_weight = cast_before_weight;
  return p;
}

// The residual of add_rms_norm: input's dtype, or float32 under a 16-bit input.
inline bool residual_dtype_ok(ScalarType residual, ScalarType input) {
  return residual == input || (is_narrow(input) && residual == ScalarType::Float);
}
constexpr const char* kResidualDtypeRule = ": use the input's dtype, or float32 with bfloat16/float16 input";

inline AddProblem add_forward_problem(const char* op, const Tensor& input, const Tensor& residual,
                                      const std::optional<Tensor>& weight, double eps, double offset,
                                      bool cast_before_weight) {
  AddProblem p;
  static_cast<Problem&>(p) = forward_problem(op, input, weight, std::nullopt, eps, offset, cast_before_weight);
  check_given(op, "residual", residual);
  check_like_input(op, "residual", residual, "input", input,
                   residual_dtype_ok(residual.scalar_type(), input.scalar_type()), kResidualDtypeRule);
  p.residual = with_row_layout(residual, p.residual_rows);
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

// The statistics of empty rows (n == 0): mean 0 and variance 0.
inline void fill_empty_row_stats(const Problem& p, ForwardOutputs& o) {
  if (p.num_rows == 0 || p.n != 0) return;
  torch::stable::fill_(o.rstd, 1.0 / std::sqrt(p.eps));
  if (o.mean) torch::stable::zero_(*o.mean);
}

// The outputs of rms_norm / layer_norm (`centered`: with the row means).
inline ForwardOutputs forward_outputs(const Problem& p, bool centered) {
  ForwardOutputs o;
  o.out = output_like(p.input);
  o.rstd = row_stat(p.input);
  if (centered) o.mean = row_stat(p.input);
  fill_empty_row_stats(p, o);
  return o;
}

// The outputs of add_rms_norm: with `in_place`, residual_out is `residual` itself (which the
// caller copies back into the user's tensor with finish_in_place when p.residual is a copy).
inline ForwardOutputs add_forward_outputs(const AddProblem& p, bool in_place, const char* op) {
  if (in_place)
    // Elements written before another row reads them as input. (The same tensor as both is
    // fine: each element is read before it is written, by the thread that writes it.)
    FUSEDOPS_CHECK(overlap(p.input, p.residual) != Overlap::kPartial, op,
                   ": residual and input share part of their memory (overlapping views of one buffer?), so residual "
                   "cannot be updated in place; pass tensors that do not overlap");
  ForwardOutputs o = forward_outputs(p, false);
  if (in_place) {
    o.residual_out = p.residual;
    o.residual_out_rows = p.residual_rows;
  } else {
    o.residual_out = empty_like_device(p.input, shape_of(p.residual), p.residual.scalar_type());
    collapse_rows(*o.residual_out, o.residual_out_rows);
  }
  return o;
}

// add_rms_norm_: when the residual could not be updated where it lies (its rows needed a
// contiguous copy), copies the result back into it.
inline void finish_in_place(Tensor residual, const ForwardOutputs& o) {
  if (o.residual_out->get() != residual.get()) torch::stable::copy_(residual, *o.residual_out);
}

// A saved statistic (`name`: "rstd" or "mean") as the forward op `forward_op` returned it.
inline void check_stat(const char* op, const char* forward_op, const char* name, const Tensor& input,
                       const Tensor& stat) {
  check_given(op, name, stat);
  const ScalarType acc = acc_dtype(input.scalar_type());
  FUSEDOPS_CHECK(shape_of(stat) == row_shape(input) && stat.scalar_type() == acc, op, ": ", name, " must be a ",
                 dtype_name(acc), " tensor of input's leading shape (as returned by ", forward_op, "), got ",
                 dtype_name(stat.scalar_type()), " of shape ", shape_str(stat));
  FUSEDOPS_CHECK(same_device(stat, input), op, ": ", name, " is on ", device_str(stat), " but input is on ",
                 device_str(input));
}

// Checks the backward arguments against each other. `input` is what the forward saved: its
// input, or (rms_norm with saved_is_output) its output.
inline BackwardProblem backward_problem(const char* op, const char* forward_op, const Tensor& grad_output,
                                        const Tensor& input, const std::optional<Tensor>& weight,
                                        const std::optional<Tensor>& bias, const std::optional<Tensor>& mean,
                                        const Tensor& rstd, bool weight_requires_grad, bool bias_requires_grad,
                                        double offset = 0, bool saved_is_output = false) {
  const char* saved_name = saved_is_output ? "output" : "input";
  check_input(op, input, saved_name);
  check_params(op, input, weight, bias, saved_name);
  check_offset(op, offset, weight);
  check_given(op, "grad_output", grad_output);
  check_like_input(op, "grad_output", grad_output, saved_name, input,
                   grad_output.scalar_type() == input.scalar_type(), "");
  if (mean) check_stat(op, forward_op, "mean", input, *mean);
  check_stat(op, forward_op, "rstd", input, rstd);
  BackwardProblem p;
  static_cast<Problem&>(p) = make_problem(input, weight, bias);
  p.offset = offset;
  p.saved_is_output = saved_is_output;
  p.grad_output = with_row_layout(grad_output, p.grad_rows);
  if (mean) p.mean = as_contiguous(*mean);
  p.rstd = as_contiguous(rstd);
  p.want_grad_weight = weight.has_value() && weight_requires_grad;
  p.want_grad_bias = bias.has_value() && bias_requires_grad;
  return p;
}

// add_rms_norm's backward: `residual_out` is what the forward saved; grad_output has the
// forward output's dtype (residual_out's, or narrower under a float32 residual), which is also
// the dtype the weight goes with.
inline BackwardProblem add_backward_problem(const char* op, const Tensor& grad_output,
                                            const std::optional<Tensor>& grad_residual_out,
                                            const Tensor& residual_out, const std::optional<Tensor>& weight,
                                            const Tensor& rstd, double offset, bool weight_requires_grad) {
  check_input(op, residual_out, "residual_out");
  check_given(op, "grad_output", grad_output);
  FUSEDOPS_CHECK(is_float_dtype(grad_output.scalar_type()), op,
                 ": grad_output dtype must be float32, bfloat16, float16 or float64, got ",
                 dtype_name(grad_output.scalar_type()));
  check_like_input(op, "grad_output", grad_output, "residual_out", residual_out,
                   residual_dtype_ok(residual_out.scalar_type(), grad_output.scalar_type()),
                   ": it must be residual_out's dtype, or bfloat16/float16 under a float32 residual_out");
  if (grad_residual_out)
    check_like_input(op, "grad_residual_out", *grad_residual_out, "residual_out", residual_out,
                     grad_residual_out->scalar_type() == residual_out.scalar_type(), "");
  check_params(op, grad_output, weight, std::nullopt, "grad_output");
  check_offset(op, offset, weight);
  check_stat(op, "add_rms_norm", "rstd", residual_out, rstd);
  BackwardProblem p;
  static_cast<Problem&>(p) = make_problem(residual_out, weight, std::nullopt);
  p.offset = offset;
  p.grad_output = with_row_layout(grad_output, p.grad_rows);
  if (grad_residual_out) p.grad_residual_out = with_row_layout(*grad_residual_out, p.grad_residual_rows);
  p.rstd = as_contiguous(rstd);
  p.want_grad_weight = weight.has_value() && weight_requires_grad;
  return p;
}

// The gradient of an affine parameter: (n,) in its dtype when wanted (zeros if there is nothing
// to sum), else an empty tensor.
inline Tensor param_grad(const BackwardProblem& p, const std::optional<Tensor>& param, bool wanted) {
  if (!wanted) return empty_like_device(p.input, {0}, param ? param->scalar_type() : p.input.scalar_type());
  Tensor g = empty_like_device(p.input, {p.n}, param->scalar_type());
  if (p.empty()) torch::stable::zero_(g);
  return g;
}

// grad_input in grad_output's dtype; grad_residual only where add_rms_norm's residual_out is
// wider than grad_output (otherwise grad_input is the gradient of both).
inline BackwardOutputs backward_outputs(const BackwardProblem& p) {
  BackwardOutputs o;
  o.grad_input = empty_like_device(p.input, shape_of(p.input), p.grad_output.scalar_type());
  if (p.grad_output.scalar_type() != p.input.scalar_type()) o.grad_residual = output_like(p.input);
  o.grad_weight = param_grad(p, p.weight, p.want_grad_weight);
  // (rms_norm's and add_rms_norm's ops return no bias gradient: nothing to allocate for them,
  // which a small call's host time feels)
  if (p.want_grad_bias) o.grad_bias = param_grad(p, p.bias, true);
  return o;
}

}  // namespace fusedops::norm
