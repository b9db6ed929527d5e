// Gated activations (swiglu, geglu and their packed forms): argument checks, operand layout and
// the registered functions, written once for both native backends over a per-backend Kernels
// type K (cpu_gated.h, cuda_gated.cuh). csrc/{cpu,cuda}/<op> only register them. The Python
// fake kernels (src/fusedops/ops/_gated.py) raise the same messages.
//
// What every backend computes (CPU, CUDA and Triton agree), in float32 (float64 for float64):
//   y = act(g) * u                                        (rounded to the inputs' dtype)
//   dg = dy * u * act'(g),  du = dy * act(g)               (each rounded once)
// with act = silu (swiglu), gelu with erf (geglu, approximate="none") or gelu's tanh form
// (approximate="tanh"), written as g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3), which is
// the same function as 0.5 g (1 + tanh z) without tanh's cancellation near -1.
//
// An operand is addressed as base + col0 + rows.offset(r) + j: the unpacked forms read gate
// and up with their own leading strides; the packed forms read both halves of gate_up through
// gate_up's layout, up at col0 = n. Outputs are contiguous: element (r, j) of an output is at
// base + col0 + r * out_row_stride + j, which lets the packed backward write grad_gate and
// grad_up as the two halves of one (..., 2n) buffer. When every operand is contiguous (and not
// packed) the whole tensor is one row of numel elements, which the kernels split freely.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "fusedops/checks.h"
#include "fusedops/rows.h"
#include "fusedops/tensors.h"

namespace fusedops::gated {

enum class Act { kSilu, kGelu, kGeluTanh };

// A strided operand of the kernels.
struct Operand {
  Tensor t;
  int64_t col0 = 0;
  RowLayout rows;
};

struct Problem {
  Act act = Act::kSilu;
  ScalarType dtype = ScalarType::Float;
  int64_t num_rows = 0;
  int64_t n = 0;  // elements per row of the output (half of gate_up's last dimension)
  Operand gate, up, grad;  // grad: the backward's grad_output
  bool empty() const { return num_rows == 0 || n == 0; }
};

// Where the kernels write: `a` (the output, or grad_gate) and `b` (grad_up; the forward has
// none), both contiguous rows of out_row_stride elements.
struct Outputs {
  Tensor a, b;
  int64_t a_col0 = 0, b_col0 = 0;
  int64_t out_row_stride = 0;
};

inline Act parse_approximate(const char* op, const std::string& approximate) {
  if (approximate == "none") return Act::kGelu;
  if (approximate == "tanh") return Act::kGeluTanh;
  fail(op, ": approximate must be \"none\" or \"tanh\", got \"", approximate, "\"");
}

inline void check_input(const char* op, const Tensor& t, const char* name) {
  check_given(op, name, t);
  FUSEDOPS_CHECK(t.dim() >= 1, op, ": ", name, " must have at least 1 dimension, got a 0-dimensional tensor");
  FUSEDOPS_CHECK(is_float_dtype(t.scalar_type()), op, ": ", name,
                 " dtype must be float32, bfloat16, float16 or float64, got ", dtype_name(t.scalar_type()));
}

inline bool same_shape(const Tensor& a, const Tensor& b, int64_t last_b_times = 1) {
  if (a.dim() != b.dim()) return false;
  for (int64_t d = 0; d < a.dim(); ++d)
    if (a.size(d) * (d + 1 == a.dim() ? last_b_times : 1) != b.size(d)) return false;
  return true;
}

// `t` goes with `ref` element for element (shape given by the caller's test), dtype and device.
inline void check_like(const char* op, const Tensor& t, const char* name, const Tensor& ref, const char* ref_name,
                       bool shape_ok, const std::string& ref_shape) {
  FUSEDOPS_CHECK(shape_ok, op, ": ", name, " shape ", shape_str(t), " does not match ", ref_name, " shape ",
                 ref_shape);
  FUSEDOPS_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " dtype ", dtype_name(t.scalar_type()),
                 " does not match ", ref_name, " dtype ", dtype_name(ref.scalar_type()));
  FUSEDOPS_CHECK(t.is_cuda() == ref.is_cuda() && t.get_device_index() == ref.get_device_index(), op, ": ", name,
                 " is on ", device_str(t), " but ", ref_name, " is on ", device_str(ref));
}

inline void check_packed_width(const char* op, const Tensor& gate_up) {
  const int64_t w = gate_up.size(-1);
  FUSEDOPS_CHECK(w % 2 == 0, op, ": gate_up's last dimension must be even (it holds [gate | up]), got ", w);
}

// The shape of a packed form's output: gate_up's with the last dimension halved.
inline std::vector<int64_t> half_sizes(const Tensor& gate_up) {
  std::vector<int64_t> s(gate_up.dim());
  for (int64_t d = 0; d < gate_up.dim(); ++d) s[d] = gate_up.size(d);
  s.back() /= 2;
  return s;
}

inline std::vector<int64_t> sizes_of(const Tensor& t) {
  std::vector<int64_t> s(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) s[d] = t.size(d);
  return s;
}

inline std::string sizes_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t d = 0; d < s.size(); ++d) out += (d ? ", " : "") + std::to_string(s[d]);
  return out + "]";
}

// An operand the kernels can address: the tensor itself, unless its last dimension is strided
// or its leading dimensions do not collapse to RowLayout::kMaxDims (then a contiguous copy: the
// only copies these ops make).
inline Operand operand(const Tensor& t) {
  Operand o;
  o.t = t;
  if ((t.size(-1) <= 1 || t.stride(-1) == 1) && collapse_rows(t, o.rows)) return o;
  o.t = torch::stable::contiguous(t);
  collapse_rows(o.t, o.rows);
  return o;
}

// Unpacked operands all contiguous: one row of numel elements.
inline void flatten_if_contiguous(Problem& p, std::initializer_list<Operand*> ops) {
  for (const Operand* o : ops)
    if (!o->t.is_contiguous()) return;
  p.n = p.num_rows * p.n;
  p.num_rows = p.n > 0 ? 1 : 0;
  for (Operand* o : ops) o->rows = RowLayout{};
}

inline int64_t leading_rows(const Tensor& t) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return rows;
}

inline Problem unpacked_problem(const char* op, Act act, const Tensor& gate, const Tensor& up,
                                const std::optional<Tensor>& grad) {
  check_input(op, gate, "gate");
  check_given(op, "up", up);
  if (grad) check_given(op, "grad_output", *grad);
  check_like(op, up, "up", gate, "gate", same_shape(up, gate), shape_str(gate));
  if (grad) check_like(op, *grad, "grad_output", gate, "gate", same_shape(*grad, gate), shape_str(gate));
  Problem p;
  p.act = act;
  p.dtype = gate.scalar_type();
  p.n = gate.size(-1);
  p.num_rows = leading_rows(gate);
  if (p.empty()) return p;
  p.gate = operand(gate);
  p.up = operand(up);
  if (grad) {
    p.grad = operand(*grad);
    flatten_if_contiguous(p, {&p.gate, &p.up, &p.grad});
  } else {
    flatten_if_contiguous(p, {&p.gate, &p.up});
  }
  return p;
}

inline Problem packed_problem(const char* op, Act act, const Tensor& gate_up, const std::optional<Tensor>& grad) {
  check_input(op, gate_up, "gate_up");
  check_packed_width(op, gate_up);
  if (grad) {
    check_given(op, "grad_output", *grad);
    const std::vector<int64_t> out = half_sizes(gate_up);
    check_like(op, *grad, "grad_output", gate_up, "the output", sizes_of(*grad) == out, sizes_str(out));
  }
  Problem p;
  p.act = act;
  p.dtype = gate_up.scalar_type();
  p.n = gate_up.size(-1) / 2;
  p.num_rows = leading_rows(gate_up);
  if (p.empty()) return p;
  p.gate = operand(gate_up);
  p.up = p.gate;
  p.up.col0 = p.n;
  if (grad) p.grad = operand(*grad);
  return p;
}

// ---- the registered functions -------------------------------------------------------------

template <class K>
Tensor forward(const Problem& p, const std::vector<int64_t>& out_sizes, const Tensor& like, const char* op) {
  Outputs o;
  o.a = empty_like_device(like, out_sizes, p.dtype);
  o.out_row_stride = p.n;
  if (!p.empty()) K::forward(p, o, op);
  return o.a;
}

template <class K>
std::tuple<Tensor, Tensor> backward_unpacked(const Problem& p, const Tensor& gate, const char* op) {
  Outputs o;
  o.a = empty_like_device(gate, sizes_of(gate), p.dtype);
  o.b = empty_like_device(gate, sizes_of(gate), p.dtype);
  o.out_row_stride = p.n;
  if (!p.empty()) K::backward(p, o, op);
  return {o.a, o.b};
}

template <class K>
Tensor backward_packed(const Problem& p, const Tensor& gate_up, const char* op) {
  Outputs o;
  o.a = empty_like_device(gate_up, sizes_of(gate_up), p.dtype);
  o.b = o.a;
  o.b_col0 = p.n;
  o.out_row_stride = 2 * p.n;
  if (!p.empty()) K::backward(p, o, op);
  return o.a;
}

template <class K>
Tensor swiglu(Tensor gate, Tensor up) {
  const Problem p = unpacked_problem("swiglu", Act::kSilu, gate, up, std::nullopt);
  return forward<K>(p, sizes_of(gate), gate, "swiglu");
}

template <class K>
std::tuple<Tensor, Tensor> swiglu_backward(Tensor grad_output, Tensor gate, Tensor up) {
  const Problem p = unpacked_problem("swiglu_backward", Act::kSilu, gate, up, grad_output);
  return backward_unpacked<K>(p, gate, "swiglu_backward");
}

template <class K>
Tensor swiglu_packed(Tensor gate_up) {
  const Problem p = packed_problem("swiglu_packed", Act::kSilu, gate_up, std::nullopt);
  return forward<K>(p, half_sizes(gate_up), gate_up, "swiglu_packed");
}

template <class K>
Tensor swiglu_packed_backward(Tensor grad_output, Tensor gate_up) {
  const Problem p = packed_problem("swiglu_packed_backward", Act::kSilu, gate_up, grad_output);
  return backward_packed<K>(p, gate_up, "swiglu_packed_backward");
}

template <class K>
Tensor geglu(Tensor gate, Tensor up, std::string approximate) {
  const Act act = parse_approximate("geglu", approximate);
  const Problem p = unpacked_problem("geglu", act, gate, up, std::nullopt);
  return forward<K>(p, sizes_of(gate), gate, "geglu");
}

template <class K>
std::tuple<Tensor, Tensor> geglu_backward(Tensor grad_output, Tensor gate, Tensor up, std::string approximate) {
  const Act act = parse_approximate("geglu_backward", approximate);
  const Problem p = unpacked_problem("geglu_backward", act, gate, up, grad_output);
  return backward_unpacked<K>(p, gate, "geglu_backward");
}

template <class K>
Tensor geglu_packed(Tensor gate_up, std::string approximate) {
  const Act act = parse_approximate("geglu_packed", approximate);
  const Problem p = packed_problem("geglu_packed", act, gate_up, std::nullopt);
  return forward<K>(p, half_sizes(gate_up), gate_up, "geglu_packed");
}

template <class K>
Tensor geglu_packed_backward(Tensor grad_output, Tensor gate_up, std::string approximate) {
  const Act act = parse_approximate("geglu_packed_backward", approximate);
  const Problem p = packed_problem("geglu_packed_backward", act, gate_up, grad_output);
  return backward_packed<K>(p, gate_up, "geglu_packed_backward");
}

}  // namespace fusedops::gated
