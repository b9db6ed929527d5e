// Cross-entropy over the last (class) dimension (cross_entropy, cross_entropy_,
// cross_entropy_backward, cross_entropy_backward_): argument checks, output allocation and the
// registered functions, written once for the CPU and CUDA kernels (csrc/cpu/cross_entropy.cpp,
// csrc/cuda/cross_entropy.cu). src/fusedops/ops/cross_entropy.py raises the same messages from
// the fake kernels.
//
// What every backend computes (CPU, CUDA and Triton agree). Logits are (..., V), targets (...):
// R = numel(target) rows. Per row, with x_j = softcap * tanh(l_j / softcap) (or l_j), lse the
// log-sum-exp of x, p_j = exp(x_j - lse), t the target, w the class weights (1 without),
// W = sum_j w_j and eps = label_smoothing:
//   ce   = (1 - eps) * w_t * (lse - x_t) + eps / V * (W * lse - sum_j w_j x_j)
//   z    = z_loss * lse^2
// Rows whose target is ignore_index contribute 0 (loss, gradient). The denominators of "mean"
// are Dw = sum of w_t and Dn = the count, over the rows that are not ignored (torch normalises
// the cross-entropy by Dw; the z-term, unweighted, by Dn, as Liger-Kernel does):
//   none: loss_i = ce_i + z_i;  sum: sum_i (ce_i + z_i);  mean: sum_i ce_i / Dw + sum_i z_i / Dn
// The gradient of that loss (grad_output 1) with respect to l, row i, written in the forward:
//   g_j = (p_j * cp - (j == t) * ct - cw * w_j) * (softcap ? 1 - (x_j / softcap)^2 : 1)
//   cp = ((1 - eps) * w_t + eps * W / V) * sw + 2 * z_loss * lse * sn,  ct = (1 - eps) * w_t * sw,
//   cw = eps / V * sw,   sw = 1 / Dw and sn = 1 / Dn under "mean", else 1.
// A target outside [0, V) that is not ignore_index is never used to index anything: its row
// counts with w_t = NaN (its loss is NaN, its gradient row NaN, and under "mean" so is the
// whole loss and gradient), and `bad_target` holds the flat index of the first such row (-1:
// none). The CPU kernel raises instead, naming the value; CUDA eager calls read bad_target
// (ops/cross_entropy.py). Math in float32 (float64 for float64 logits); the loss and lse are
// float32 (float64), the gradient in the logits' dtype. No kernel subtracts from lse once
// rounded: lse - x_t is log(sum) - (x_t - max), p_j is exp(x_j - max) / sum, and the smoothing
// term's W * lse - sum_j w_j x_j is W * log(sum) plus sum_j w_j (max - x_j) (the CUDA kernels
// keep that sum, whose terms are never negative; the Triton kernel sums w_j (x_j - x_t), x_t
// the target's logit; the CPU sums w_j x_j in float64), so logits far from zero keep float32's
// precision (docs/ops/cross_entropy.md).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "fusedops/checks.h"
#include "fusedops/rows.h"
#include "fusedops/tensors.h"

namespace fusedops::cross_entropy {

enum class Reduction { kNone = 0, kMean = 1, kSum = 2 };

struct Problem {
  Tensor logits;                 // (..., V), unit stride over V (a copy otherwise; never in place)
  Tensor target;                 // (...), contiguous
  std::optional<Tensor> weight;  // (V,), contiguous
  RowLayout rows;                // logits' rows
  int64_t R = 0, V = 0;          // rows, classes
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::kMean;
  double label_smoothing = 0, z_loss = 0, softcap = 0;  // softcap 0: none
  bool compute_grad = false;
  ScalarType dtype = ScalarType::Float;
  int32_t device_index = 0;
};

// Where the kernels write. grad (when wanted) is a new contiguous (R, V) tensor or, in place,
// the logits themselves (grad_rows: their layout).
struct Outputs {
  Tensor loss;  // (R,) for none, () otherwise; float32 (float64)
  Tensor lse;   // (R,)
  std::optional<Tensor> grad;
  RowLayout grad_rows;
  Tensor bad_target;  // () int64
};

inline Reduction parse_reduction(const char* op, const std::string& r) {
  if (r == "mean") return Reduction::kMean;
  if (r == "sum") return Reduction::kSum;
  if (r == "none") return Reduction::kNone;
  fail(op, ": reduction must be 'mean', 'sum' or 'none', got '", r, "'");
}

inline bool same_device(const Tensor& a, const Tensor& b) {
  return a.get_device() == b.get_device() && a.is_cpu() == b.is_cpu();
}

inline std::string leading_shape(const Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d + 1 < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

// The options reach the GPU kernels as float32 (a pair of them, for float64 logits): a value
// past float32's range would arrive as inf there, so every backend refuses one alike.
inline void check_float32_range(const char* op, const char* name, double value) {
  FUSEDOPS_CHECK(value <= double(std::numeric_limits<float>::max()), op, ": ", name,
                 " must be at most float32's largest value, 3.40282e+38, got ", value);
}

inline void check_softcap(const char* op, std::optional<double> softcap) {
  if (!softcap) return;
  FUSEDOPS_CHECK(*softcap > 0.0 && std::isfinite(*softcap), op, ": softcap must be a finite number > 0 (or None), got ",
                 *softcap);
  check_float32_range(op, "softcap", *softcap);
}

inline Problem make_problem(const char* op, const Tensor& logits, const Tensor& target,
                            const std::optional<Tensor>& weight, int64_t ignore_index, const std::string& reduction,
                            double label_smoothing, double z_loss, std::optional<double> softcap, bool compute_grad,
                            bool in_place) {
  check_given(op, "logits", logits);
  check_given(op, "target", target);
  FUSEDOPS_CHECK(logits.dim() >= 1, op,
                 ": logits must have at least 1 dimension (..., classes), got a 0-dimensional tensor");
  FUSEDOPS_CHECK(is_float_dtype(logits.scalar_type()), op,
                 ": logits dtype must be float32, bfloat16, float16 or float64, got ", dtype_name(logits.scalar_type()));
  const ScalarType tt = target.scalar_type();
  FUSEDOPS_CHECK(!is_float_dtype(tt), op, ": target must hold class indices (int64 or int32); probability (",
                 dtype_name(tt), ") targets are not supported");
  FUSEDOPS_CHECK(tt == ScalarType::Long || tt == ScalarType::Int, op, ": target dtype must be int64 or int32, got ",
                 dtype_name(tt));
  bool shape_ok = target.dim() == logits.dim() - 1;
  for (int64_t d = 0; shape_ok && d < target.dim(); ++d) shape_ok = target.size(d) == logits.size(d);
  FUSEDOPS_CHECK(shape_ok, op, ": target shape ", shape_str(target), " does not match logits shape ", shape_str(logits),
                 " without its last (class) dimension: expected ", leading_shape(logits));
  FUSEDOPS_CHECK(same_device(target, logits), op, ": target is on ", device_str(target), " but logits is on ",
                 device_str(logits));
  const int64_t V = logits.size(-1);
  FUSEDOPS_CHECK(V >= 1, op, ": logits must have at least one class (logits.size(-1) is 0)");
  FUSEDOPS_CHECK(V < (int64_t(1) << 31), op, ": too many classes (", V, ")");
  if (weight) {
    FUSEDOPS_CHECK(weight->dim() == 1 && weight->size(0) == V, op,
                   ": weight must be a 1-D tensor of logits.size(-1) = ", V, " class weights, got shape ",
                   shape_str(*weight));
    const ScalarType wt = weight->scalar_type();
    FUSEDOPS_CHECK(wt == logits.scalar_type() || wt == ScalarType::Float, op, ": weight dtype ", dtype_name(wt),
                   " does not go with logits dtype ", dtype_name(logits.scalar_type()),
                   ": use logits' dtype or float32");
    FUSEDOPS_CHECK(same_device(*weight, logits), op, ": weight is on ", device_str(*weight), " but logits is on ",
                   device_str(logits));
  }
  Problem p;
  p.reduction = parse_reduction(op, reduction);
  FUSEDOPS_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op, ": label_smoothing must be in [0, 1], got ",
                 label_smoothing);
  FUSEDOPS_CHECK(z_loss >= 0.0 && std::isfinite(z_loss), op, ": z_loss must be a finite number >= 0, got ", z_loss);
  check_float32_range(op, "z_loss", z_loss);
  check_softcap(op, softcap);
  if (in_place) {
    FUSEDOPS_CHECK(V == 1 || logits.stride(-1) == 1, op,
                   ": logits must have a contiguous last dimension (stride 1) to receive the gradient in place, got "
                   "stride ", logits.stride(-1));
    FUSEDOPS_CHECK(logits.numel() == 0 || !may_overlap(logits), op,
                   ": logits has elements that share memory (an expanded tensor?), so it cannot receive the gradient "
                   "in place");
  }
  p.V = V;
  p.R = logits.numel() / V;
  p.ignore_index = ignore_index;
  p.label_smoothing = label_smoothing;
  p.z_loss = z_loss;
  p.softcap = softcap ? *softcap : 0.0;
  p.compute_grad = compute_grad || in_place;
  p.dtype = logits.scalar_type();
  p.device_index = logits.is_cpu() ? 0 : logits.get_device_index();
  p.logits = V == 1 || logits.stride(-1) == 1 ? logits : torch::stable::contiguous(logits);
  if (!collapse_rows(p.logits, p.rows)) {  // more than RowLayout::kMaxDims leading dimensions
    p.logits = torch::stable::contiguous(p.logits);
    collapse_rows(p.logits, p.rows);
  }
  p.target = as_contiguous(target);
  if (weight) p.weight = as_contiguous(*weight);
  return p;
}

inline std::vector<int64_t> target_sizes(const Tensor& target) {
  std::vector<int64_t> s;
  for (int64_t d = 0; d < target.dim(); ++d) s.push_back(target.size(d));
  return s;
}

inline Outputs new_outputs(const Problem& p, const Tensor& logits, const Tensor& target) {
  Outputs o;
  const ScalarType acc = acc_dtype(p.dtype);
  const std::vector<int64_t> ts = target_sizes(target);
  o.loss = empty_like_device(logits, p.reduction == Reduction::kNone ? ts : std::vector<int64_t>{}, acc);
  o.lse = empty_like_device(logits, ts, acc);
  o.bad_target = empty_like_device(logits, {}, ScalarType::Long);
  return o;
}

// The registered functions. `K` is the backend: K::forward(p, o, op) fills the outputs (and
// bad_target), K::scale(grad_output, grad, rows, out, out_rows, in_place, op) the backward.
template <class K>
std::tuple<Tensor, Tensor, Tensor, Tensor> cross_entropy(Tensor logits, Tensor target, std::optional<Tensor> weight,
                                                         int64_t ignore_index, std::string reduction,
                                                         double label_smoothing, double z_loss,
                                                         std::optional<double> softcap, bool compute_grad) {
  const char* op = "cross_entropy";
  const Problem p = make_problem(op, logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap,
                                 compute_grad, false);
  Outputs o = new_outputs(p, logits, target);
  if (compute_grad) {
    std::vector<int64_t> sizes;
    for (int64_t d = 0; d < logits.dim(); ++d) sizes.push_back(logits.size(d));
    o.grad = empty_like_device(logits, sizes, p.dtype);
    collapse_rows(*o.grad, o.grad_rows);
  }
  K::forward(p, o, op);
  const Tensor grad = o.grad ? *o.grad : empty_like_device(logits, {0}, p.dtype);
  return {o.loss, o.lse, grad, o.bad_target};
}

template <class K>
std::tuple<Tensor, Tensor, Tensor> cross_entropy_inplace(Tensor logits, Tensor target, std::optional<Tensor> weight,
                                                         int64_t ignore_index, std::string reduction,
                                                         double label_smoothing, double z_loss,
                                                         std::optional<double> softcap) {
  const char* op = "cross_entropy_";
  const Problem p = make_problem(op, logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap,
                                 true, true);
  Outputs o = new_outputs(p, logits, target);
  // Into logits itself, or (leading dimensions that do not collapse) into the copy the
  // kernels read, copied back.
  o.grad = p.logits;
  o.grad_rows = p.rows;
  K::forward(p, o, op);
  if (p.logits.get() != logits.get()) torch::stable::copy_(logits, p.logits);
  return {o.loss, o.lse, o.bad_target};
}

struct ScaleProblem {
  Tensor grad_output;  // () or (R,) contiguous
  bool per_row = false;
  Tensor grad;  // (..., V), unit stride over V
  RowLayout rows;
  int64_t R = 0, V = 0;
  ScalarType dtype = ScalarType::Float;
  int32_t device_index = 0;
};

inline ScaleProblem make_scale_problem(const char* op, const Tensor& grad_output, const Tensor& grad_logits,
                                       bool in_place) {
  check_given(op, "grad_output", grad_output);
  check_given(op, "grad_logits", grad_logits);
  FUSEDOPS_CHECK(grad_logits.dim() >= 1 && is_float_dtype(grad_logits.scalar_type()), op,
                 ": grad_logits must be a floating-point tensor of at least 1 dimension, got ",
                 grad_logits.dim() == 0 ? std::string("a 0-dimensional tensor")
                                        : std::string(dtype_name(grad_logits.scalar_type())));
  FUSEDOPS_CHECK(is_float_dtype(grad_output.scalar_type()), op, ": grad_output dtype must be floating point, got ",
                 dtype_name(grad_output.scalar_type()));
  FUSEDOPS_CHECK(same_device(grad_output, grad_logits), op, ": grad_output is on ", device_str(grad_output),
                 " but grad_logits is on ", device_str(grad_logits));
  ScaleProblem s;
  s.V = grad_logits.size(-1);
  s.R = s.V == 0 ? 0 : grad_logits.numel() / s.V;
  bool rows_shape = grad_output.dim() == grad_logits.dim() - 1;
  for (int64_t d = 0; rows_shape && d < grad_output.dim(); ++d) rows_shape = grad_output.size(d) == grad_logits.size(d);
  FUSEDOPS_CHECK(grad_output.dim() == 0 || rows_shape, op,
                 ": grad_output must be a 0-dimensional tensor (reduction 'mean' or 'sum') or have shape ",
                 leading_shape(grad_logits), " (reduction 'none'), got shape ", shape_str(grad_output));
  if (in_place) {
    FUSEDOPS_CHECK(s.V <= 1 || grad_logits.stride(-1) == 1, op,
                   ": grad_logits must have a contiguous last dimension to be scaled in place");
    FUSEDOPS_CHECK(grad_logits.numel() == 0 || !may_overlap(grad_logits), op,
                   ": grad_logits has elements that share memory, so it cannot be scaled in place");
  }
  s.per_row = grad_output.dim() > 0;
  s.grad_output = as_contiguous(grad_output);
  s.grad = s.V <= 1 || grad_logits.stride(-1) == 1 ? grad_logits : torch::stable::contiguous(grad_logits);
  if (!collapse_rows(s.grad, s.rows)) {
    s.grad = torch::stable::contiguous(s.grad);
    collapse_rows(s.grad, s.rows);
  }
  s.dtype = grad_logits.scalar_type();
  s.device_index = grad_logits.is_cpu() ? 0 : grad_logits.get_device_index();
  return s;
}

template <class K>
Tensor cross_entropy_backward(Tensor grad_output, Tensor grad_logits) {
  const char* op = "cross_entropy_backward";
  const ScaleProblem s = make_scale_problem(op, grad_output, grad_logits, false);
  std::vector<int64_t> sizes;
  for (int64_t d = 0; d < grad_logits.dim(); ++d) sizes.push_back(grad_logits.size(d));
  Tensor out = empty_like_device(grad_logits, sizes, s.dtype);
  RowLayout out_rows;
  collapse_rows(out, out_rows);
  if (s.R > 0 && s.V > 0) K::scale(s, out, out_rows, false, op);
  return out;
}

template <class K>
void cross_entropy_backward_inplace(Tensor grad_output, Tensor grad_logits) {
  const char* op = "cross_entropy_backward_";
  const ScaleProblem s = make_scale_problem(op, grad_output, grad_logits, true);
  if (s.R == 0 || s.V == 0) return;
  K::scale(s, s.grad, s.rows, true, op);
  // Leading dimensions that do not collapse were scaled in a copy: write it back.
  if (s.grad.get() != grad_logits.get()) torch::stable::copy_(grad_logits, s.grad);
}

// ---- slices of the classes: the building blocks of linear_cross_entropy(low_memory=True) ----
//
// That mode makes the logits one slice of the vocabulary at a time, twice: a first walk over
// the slices gathers every row's statistics, a second turns each slice into its gradient. Here
// logits (R, S) hold classes [class_start, class_start + S) of R rows whose targets are
// `target` (R,); `weight` (when given) is the whole (V,) class-weight vector; x is the logits
// soft-capped. Rows whose target is ignore_index are not read.
//   cross_entropy_slice_stats_: merges the slice into `stats` (R, 4), per row the running
//     (max of x, sum of exp(x - max), sum of w_j x_j [only with smoothing], x of the target
//     [written by the slice holding it]); the caller starts it at (-inf, 0, 0, 0). The sum of
//     w_j x_j is absolute, so this path keeps the rounded-sum precision of the smoothing term
//     for logits far from zero (docs/ops/cross_entropy.md).
//   cross_entropy_slice_grad_: overwrites the logits with the gradient, given per row
//     `coefs` (R, 4) = (base, scale, ct, cw), the coefficients of the file's header (grad_output
//     and the "mean" denominators already in them) with exp(x_j - lse) cp written as
//     exp(x_j - base) scale; linear_cross_entropy passes base = the row's max and scale = cp / its
//     sum of exp(x - max), so that no rounded lse is subtracted:
//       g_j = (exp(x_j - base) scale - [class_start + j == t] ct - [smoothing] cw w_j) softcap'(x_j)
//     and zeros for ignored rows.
// Math in float32 (float64 for float64 logits), as above; stats and coefs in that type.
struct SliceProblem {
  Tensor logits;  // (R, S), unit stride over S
  RowLayout rows;
  Tensor target;  // (R,), contiguous
  std::optional<Tensor> weight;
  Tensor state;  // stats or coefs: (R, 4), contiguous
  int64_t R = 0, S = 0, class_start = 0, ignore_index = -100;
  double softcap = 0;  // 0: none
  bool smoothing = false;
  ScalarType dtype = ScalarType::Float;
  int32_t device_index = 0;
};

inline SliceProblem make_slice_problem(const char* op, const Tensor& logits, const Tensor& target,
                                       const std::optional<Tensor>& weight, int64_t class_start, int64_t ignore_index,
                                       std::optional<double> softcap, bool smoothing, const Tensor& state,
                                       const char* state_name, bool in_place) {
  check_given(op, "logits", logits);
  check_given(op, "target", target);
  check_given(op, state_name, state);
  FUSEDOPS_CHECK(logits.dim() == 2, op, ": logits must be 2-D (rows, a slice of the classes), got shape ",
                 shape_str(logits));
  FUSEDOPS_CHECK(is_float_dtype(logits.scalar_type()), op,
                 ": logits dtype must be float32, bfloat16, float16 or float64, got ", dtype_name(logits.scalar_type()));
  const int64_t R = logits.size(0), S = logits.size(1);
  FUSEDOPS_CHECK(S <= 1 || logits.stride(1) == 1, op, ": logits must have a contiguous last dimension (stride 1), got "
                 "stride ", logits.stride(1));
  if (in_place)
    FUSEDOPS_CHECK(logits.numel() == 0 || !may_overlap(logits), op,
                   ": logits has elements that share memory, so it cannot receive the gradient in place");
  const ScalarType tt = target.scalar_type();
  FUSEDOPS_CHECK(tt == ScalarType::Long || tt == ScalarType::Int, op, ": target dtype must be int64 or int32, got ",
                 dtype_name(tt));
  FUSEDOPS_CHECK(target.dim() == 1 && target.size(0) == R, op, ": target must have shape [", R,
                 "] (one class index per row of logits), got shape ", shape_str(target));
  FUSEDOPS_CHECK(same_device(target, logits), op, ": target is on ", device_str(target), " but logits is on ",
                 device_str(logits));
  FUSEDOPS_CHECK(class_start >= 0, op, ": class_start must be >= 0, got ", class_start);
  if (weight) {
    FUSEDOPS_CHECK(weight->dim() == 1 && class_start + S <= weight->size(0), op,
                   ": weight must be a 1-D tensor of the class weights of every class, at least class_start + "
                   "logits.size(1) = ", class_start + S, " of them, got shape ", shape_str(*weight));
    const ScalarType wt = weight->scalar_type();
    FUSEDOPS_CHECK(wt == logits.scalar_type() || wt == ScalarType::Float, op, ": weight dtype ", dtype_name(wt),
                   " does not go with logits dtype ", dtype_name(logits.scalar_type()), ": use logits' dtype or float32");
    FUSEDOPS_CHECK(same_device(*weight, logits), op, ": weight is on ", device_str(*weight), " but logits is on ",
                   device_str(logits));
  }
  check_softcap(op, softcap);
  const ScalarType acc = acc_dtype(logits.scalar_type());
  FUSEDOPS_CHECK(state.dim() == 2 && state.size(0) == R && state.size(1) == 4, op, ": ", state_name,
                 " must have shape [", R, ", 4], got shape ", shape_str(state));
  FUSEDOPS_CHECK(state.scalar_type() == acc, op, ": ", state_name, " dtype must be ", dtype_name(acc), " for ",
                 dtype_name(logits.scalar_type()), " logits, got ", dtype_name(state.scalar_type()));
  FUSEDOPS_CHECK(state.numel() == 0 || state.is_contiguous(), op, ": ", state_name, " must be contiguous");
  FUSEDOPS_CHECK(same_device(state, logits), op, ": ", state_name, " is on ", device_str(state), " but logits is on ",
                 device_str(logits));
  SliceProblem s;
  s.logits = logits;
  collapse_rows(logits, s.rows);  // (one leading dimension: always fits)
  s.target = as_contiguous(target);
  if (weight) s.weight = as_contiguous(*weight);
  s.state = state;
  s.R = R;
  s.S = S;
  s.class_start = class_start;
  s.ignore_index = ignore_index;
  s.softcap = softcap ? *softcap : 0.0;
  s.smoothing = smoothing;
  s.dtype = logits.scalar_type();
  s.device_index = logits.is_cpu() ? 0 : logits.get_device_index();
  return s;
}

// The registered functions; K::slice_stats(s) and K::slice_grad(s) run the backend's kernels.
template <class K>
void cross_entropy_slice_stats(Tensor logits, Tensor target, std::optional<Tensor> weight, int64_t class_start,
                               int64_t ignore_index, std::optional<double> softcap, bool smoothing, Tensor stats) {
  const SliceProblem s = make_slice_problem("cross_entropy_slice_stats_", logits, target, weight, class_start,
                                            ignore_index, softcap, smoothing, stats, "stats", false);
  if (s.R > 0 && s.S > 0) K::slice_stats(s);
}

template <class K>
void cross_entropy_slice_grad(Tensor logits, Tensor target, std::optional<Tensor> weight, int64_t class_start,
                              int64_t ignore_index, std::optional<double> softcap, bool smoothing, Tensor coefs) {
  const SliceProblem s = make_slice_problem("cross_entropy_slice_grad_", logits, target, weight, class_start,
                                            ignore_index, softcap, smoothing, coefs, "coefs", true);
  if (s.R > 0 && s.S > 0) K::slice_grad(s);
}

}  // namespace fusedops::cross_entropy
