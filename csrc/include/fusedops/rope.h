// Rotary position embeddings (rope, rope_, rope_backward): argument checks, output allocation
// and the registered functions, written once for the CPU and CUDA kernels (csrc/cpu/rope.cpp,
// csrc/cuda/rope.cu). src/fusedops/ops/rope.py raises the same messages from the fake kernels.
//
// What every backend computes (CPU, CUDA and Triton agree). The op sees one logical layout,
// q (B, Hq, S, D) and k (B, Hk, S, D) with any strides (the public function turns "bshd" and
// packed "thd" inputs into such views); R = cos.size(-1) is the rotary width. For each row x of
// q or k at batch b and sequence index s, with c = cos[b, s] and n = sin[b, s] (the batch index
// 0 when cos has batch 1), or c = cos[position_ids[b, s]] and n = sin[...] for (P, R) tables:
//   y[j] = x[j] * c[j] + x[partner(j)] * sgn(j) * n[j]      for j < R
//   y[j] = x[j]                                             for R <= j < D
// where partner/sgn pair j with j + R/2 (rotate-half: partner(j) = j + R/2 with sgn -1 for
// j < R/2, j - R/2 with sgn +1 above) or, interleaved, 2i with 2i + 1 (sgn -1 on the even
// element). rope_backward applies the transpose: dx[j] = g[j] * c[j] - sgn(j) * g[partner(j)] *
// n[partner(j)]. Kernels fold sgn and the choice of n[j] or n[partner(j)] into one signed sine
// per element once per position, so both directions run the same loop: y = x*c + x[partner]*sn.
// Math in float32 (float64 for float64 tensors); outputs rounded once to q's dtype.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include "fusedops/checks.h"
#include "fusedops/tensors.h"

namespace fusedops::rope {

// Element strides of a logical (B, H, S, D) tensor over its first three dimensions (the last
// one has unit stride).
struct Strides {
  int64_t b = 0, h = 0, s = 0;
};

struct Problem {
  // q and k, or in the backward the incoming gradients; absent (a None gradient) they count as
  // zero heads. Their last dimension has unit stride (a copy otherwise).
  std::optional<Tensor> q, k;
  Tensor cos, sin;  // last dimension of unit stride
  std::optional<Tensor> position_ids;
  int64_t B = 0, S = 0, Hq = 0, Hk = 0, D = 0, R = 0;
  Strides qs, ks;
  // cos/sin row of (b, s): cos + b * cos_b + s * cos_s, or with position_ids (cos_b = 0)
  // cos + position * cos_s.
  int64_t cos_b = 0, cos_s = 0, sin_b = 0, sin_s = 0;
  int64_t pos_b = 0, pos_s = 0;  // position_ids' strides (batch stride 0 when its batch is 1)
  int64_t P = 0;                 // rows of the cos/sin tables (with position_ids)
  bool interleaved = false;
  bool backward = false;
  ScalarType dtype = ScalarType::Float;  // q's and k's
  int32_t device_index = 0;

  bool empty() const { return B == 0 || S == 0 || Hq + Hk == 0 || D == 0; }
};

// Where the kernels write: new tensors, or q and k themselves in place.
struct Outputs {
  std::optional<Tensor> q_out, k_out;
  Strides qo, ko;
  bool in_place = false;
  // The forward's () int64 record of the first position outside the tables: its flat
  // (batch, seq) index, or -1 (absent in the backward, whose positions the forward saw).
  std::optional<Tensor> bad_position;
};

inline bool same_device(const Tensor& a, const Tensor& b) {
  return a.get_device() == b.get_device() && a.is_cpu() == b.is_cpu();
}

inline std::string dims_str(const Tensor& t) {
  return t.dim() == 0 ? std::string("a 0-dimensional tensor") : "shape " + shape_str(t);
}

inline bool is_narrow(ScalarType t) { return t == ScalarType::BFloat16 || t == ScalarType::Half; }

// The output for input `t`: `t`'s strides when it is dense with a unit-stride last dimension
// (so a bshd or thd input's output has that layout again); else dense in `t`'s order of
// dimensions, as torch's elementwise ops lay out theirs: the leading dimensions outermost first
// by decreasing stride (size-1 and broadcast ones where they are, ties in their logical order),
// the last one innermost. A bshd view sliced from a fused QKV output thus gives a contiguous bshd
// output, which `view(B, S, H * D)` takes. ops/rope.py's fake kernels follow the same rule.
inline bool keeps_strides(const Tensor& t) {
  return non_overlapping_and_dense(t) && (t.size(-1) <= 1 || t.stride(-1) == 1);
}

inline std::vector<int64_t> output_strides(const Tensor& t) {
  const int64_t n = t.dim();
  std::vector<int64_t> strides(n);
  if (keeps_strides(t)) {
    for (int64_t d = 0; d < n; ++d) strides[d] = t.stride(d);
    return strides;
  }
  // The leading dimensions, outermost first. Those with an order in memory (size 2 or more,
  // stride not 0) go by decreasing stride (ties in logical order) into the places such
  // dimensions hold; the others (size 1, or broadcast) keep theirs, as in torch's elementwise
  // results, so that an expanded batch stays outermost.
  std::vector<int64_t> order(n - 1), ranked;
  for (int64_t d = 0; d < n - 1; ++d) {
    order[d] = d;
    if (t.size(d) >= 2 && t.stride(d) != 0) ranked.push_back(d);
  }
  const std::vector<int64_t> places = ranked;
  std::stable_sort(ranked.begin(), ranked.end(), [&](int64_t a, int64_t b) { return t.stride(a) > t.stride(b); });
  for (size_t i = 0; i < ranked.size(); ++i) order[places[i]] = ranked[i];
  strides[n - 1] = 1;
  int64_t step = std::max<int64_t>(t.size(n - 1), 1);  // (c10's contiguous strides: sizes of 0 count as 1)
  for (auto d = order.rbegin(); d != order.rend(); ++d) {
    strides[*d] = step;
    step *= std::max<int64_t>(t.size(*d), 1);
  }
  return strides;
}

inline Tensor new_output(const Tensor& t) {
  std::vector<int64_t> sizes;
  for (int64_t d = 0; d < t.dim(); ++d) sizes.push_back(t.size(d));
  const std::vector<int64_t> strides = output_strides(t);
  int32_t device_type = 0, device_index = 0;
  AtenTensorHandle handle = nullptr;
  STD_TORCH_CHECK(aoti_torch_get_device_type(t.get(), &device_type) == AOTI_TORCH_SUCCESS &&
                      aoti_torch_get_device_index(t.get(), &device_index) == AOTI_TORCH_SUCCESS &&
                      aoti_torch_empty_strided(int64_t(sizes.size()), sizes.data(), strides.data(),
                                               static_cast<int32_t>(t.scalar_type()), device_type, device_index,
                                               &handle) == AOTI_TORCH_SUCCESS,
                  "fusedops: tensor allocation failed");
  return Tensor(handle);
}

// `t` with a unit-stride last dimension: itself, or a contiguous copy.
inline Tensor unit_last(const Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : torch::stable::contiguous(t);
}

inline void check_qk(const char* op, const char* name, const Tensor& t) {
  check_given(op, name, t);
  FUSEDOPS_CHECK(t.dim() == 4, op, ": ", name, " must be a 4-D (batch, heads, seq, head_dim) tensor, got ",
                 dims_str(t));
  FUSEDOPS_CHECK(is_float_dtype(t.scalar_type()), op, ": ", name,
                 " dtype must be float32, bfloat16, float16 or float64, got ", dtype_name(t.scalar_type()));
}

// Checks every argument (`qn`, `kn`: the names of q and k, or of the incoming gradients) and
// describes the problem. With neither q nor k (a backward without gradients) only the tables
// are checked, and the problem is empty.
inline Problem make_problem(const char* op, const char* qn, const char* kn, const std::optional<Tensor>& q,
                            const std::optional<Tensor>& k, const Tensor& cos, const Tensor& sin,
                            const std::optional<Tensor>& position_ids, bool interleaved, bool backward) {
  Problem p;
  p.interleaved = interleaved;
  p.backward = backward;
  check_given(op, "cos", cos);
  check_given(op, "sin", sin);
  if (q) check_qk(op, qn, *q);
  if (k) check_qk(op, kn, *k);
  const Tensor* ref = q ? &*q : k ? &*k : nullptr;
  const char* refn = q ? qn : kn;
  if (q && k) {
    FUSEDOPS_CHECK(k->scalar_type() == q->scalar_type(), op, ": ", kn, " dtype ", dtype_name(k->scalar_type()),
                   " does not match ", qn, " dtype ", dtype_name(q->scalar_type()));
    FUSEDOPS_CHECK(same_device(*k, *q), op, ": ", kn, " is on ", device_str(*k), " but ", qn, " is on ",
                   device_str(*q));
    FUSEDOPS_CHECK(k->size(0) == q->size(0) && k->size(2) == q->size(2) && k->size(3) == q->size(3), op, ": ", kn,
                   " shape ", shape_str(*k), " does not go with ", qn, " shape ", shape_str(*q),
                   ": batch, sequence and head_dim must match");
    FUSEDOPS_CHECK(k->size(1) == 0 || q->size(1) % k->size(1) == 0, op, ": ", qn, " has ", q->size(1),
                   " heads, which is not a multiple of ", kn, "'s ", k->size(1), " heads (grouped-query attention)");
  }
  FUSEDOPS_CHECK(cos.dim() >= 1 && is_float_dtype(cos.scalar_type()), op,
                 ": cos must be a floating-point tensor of at least 1 dimension, got ",
                 cos.dim() == 0 ? std::string("a 0-dimensional tensor") : dtype_name(cos.scalar_type()) + std::string(" ") + dims_str(cos));
  FUSEDOPS_CHECK(sin.dim() == cos.dim() && [&] {
    for (int64_t d = 0; d < cos.dim(); ++d)
      if (sin.size(d) != cos.size(d)) return false;
    return true;
  }(), op, ": sin shape ", shape_str(sin), " does not match cos shape ", shape_str(cos));
  FUSEDOPS_CHECK(sin.scalar_type() == cos.scalar_type(), op, ": sin dtype ", dtype_name(sin.scalar_type()),
                 " does not match cos dtype ", dtype_name(cos.scalar_type()));
  if (ref != nullptr) {
    const ScalarType xt = ref->scalar_type(), ct = cos.scalar_type();
    FUSEDOPS_CHECK(ct == xt || (is_narrow(xt) && ct == ScalarType::Float), op, ": cos dtype ", dtype_name(ct),
                   " does not go with ", refn, " dtype ", dtype_name(xt), ": use ", refn,
                   "'s dtype, or float32 with bfloat16/float16 ", refn);
    FUSEDOPS_CHECK(same_device(cos, *ref), op, ": cos is on ", device_str(cos), " but ", refn, " is on ",
                   device_str(*ref));
    FUSEDOPS_CHECK(same_device(sin, *ref), op, ": sin is on ", device_str(sin), " but ", refn, " is on ",
                   device_str(*ref));
  }
  const int64_t B = ref ? ref->size(0) : 0, S = ref ? ref->size(2) : 0, D = ref ? ref->size(3) : 0;
  if (position_ids) {
    const Tensor& pos = *position_ids;
    FUSEDOPS_CHECK(pos.scalar_type() == ScalarType::Long || pos.scalar_type() == ScalarType::Int, op,
                   ": position_ids dtype must be int32 or int64, got ", dtype_name(pos.scalar_type()));
    if (ref != nullptr) {
      FUSEDOPS_CHECK(pos.dim() == 2 && (pos.size(0) == 1 || pos.size(0) == B) && pos.size(1) == S, op,
                     ": position_ids must have shape (1 or batch, seq) = (1 or ", B, ", ", S, "), got ", dims_str(pos));
      FUSEDOPS_CHECK(same_device(pos, *ref), op, ": position_ids is on ", device_str(pos), " but ", refn, " is on ",
                     device_str(*ref));
    }
    FUSEDOPS_CHECK(cos.dim() == 2, op, ": with position_ids, cos and sin must be (max_positions, rotary_dim) tables, got cos ",
                   dims_str(cos));
  } else if (ref != nullptr) {
    FUSEDOPS_CHECK(cos.dim() == 3 && (cos.size(0) == 1 || cos.size(0) == B) && cos.size(1) == S, op,
                   ": cos must have shape (1 or batch, seq, rotary_dim) = (1 or ", B, ", ", S,
                   ", rotary_dim) without position_ids, got ", dims_str(cos));
  }
  const int64_t R = cos.size(-1);
  if (ref != nullptr)
    FUSEDOPS_CHECK(R % 2 == 0 && R <= D, op, ": the rotary dimension cos.size(-1) = ", R,
                   " must be even and at most head_dim ", refn, ".size(-1) = ", D);
  if (ref == nullptr) return p;

  p.dtype = ref->scalar_type();
  p.device_index = ref->is_cpu() ? 0 : ref->get_device_index();
  p.B = B;
  p.S = S;
  p.D = D;
  p.R = R;
  if (q) {
    p.q = unit_last(*q);
    p.Hq = q->size(1);
    p.qs = {p.q->stride(0), p.q->stride(1), p.q->stride(2)};
  }
  if (k) {
    p.k = unit_last(*k);
    p.Hk = k->size(1);
    p.ks = {p.k->stride(0), p.k->stride(1), p.k->stride(2)};
  }
  p.cos = unit_last(cos);
  p.sin = unit_last(sin);
  if (position_ids) {
    p.position_ids = *position_ids;
    p.pos_b = position_ids->size(0) == 1 ? 0 : position_ids->stride(0);
    p.pos_s = position_ids->stride(1);
    p.P = cos.size(0);
    p.cos_s = p.cos.stride(0);
    p.sin_s = p.sin.stride(0);
  } else {
    p.cos_b = cos.size(0) == 1 ? 0 : p.cos.stride(0);
    p.sin_b = sin.size(0) == 1 ? 0 : p.sin.stride(0);
    p.cos_s = p.cos.stride(1);
    p.sin_s = p.sin.stride(1);
  }
  return p;
}

// New outputs shaped like `q` and `k` (absent ones: empty (0,) tensors in `dtype` on `like`).
inline Outputs new_outputs(const Problem& p, const std::optional<Tensor>& q, const std::optional<Tensor>& k,
                           const Tensor& like) {
  Outputs o;
  const ScalarType dt = q ? q->scalar_type() : k ? k->scalar_type() : like.scalar_type();
  o.q_out = q ? new_output(*q) : empty_like_device(like, {0}, dt);
  o.k_out = k ? new_output(*k) : empty_like_device(like, {0}, dt);
  if (q) o.qo = {o.q_out->stride(0), o.q_out->stride(1), o.q_out->stride(2)};
  if (k) o.ko = {o.k_out->stride(0), o.k_out->stride(1), o.k_out->stride(2)};
  return o;
}

// The forward's bad_position output: -1 now for an empty problem, else K::run writes it (the
// CPU kernel raises for a bad position instead; the CUDA kernels record the first one).
inline Tensor new_bad_position(const Problem& p, const Tensor& like) {
  Tensor bad = empty_like_device(like, {}, ScalarType::Long);
  if (p.empty()) torch::stable::fill_(bad, -1.0);
  return bad;
}

// The registered functions. `K` is the backend: K::run(p, o, op) fills the outputs.
template <class K>
std::tuple<Tensor, Tensor, Tensor> rope(Tensor q, Tensor k, Tensor cos, Tensor sin,
                                        std::optional<Tensor> position_ids, bool interleaved) {
  const Problem p = make_problem("rope", "q", "k", q, k, cos, sin, position_ids, interleaved, false);
  Outputs o = new_outputs(p, q, k, q);
  o.bad_position = new_bad_position(p, q);
  if (!p.empty()) K::run(p, o, "rope");
  return {*o.q_out, *o.k_out, *o.bad_position};
}

template <class K>
std::tuple<Tensor, Tensor> rope_backward(std::optional<Tensor> grad_q_out, std::optional<Tensor> grad_k_out,
                                         Tensor cos, Tensor sin, std::optional<Tensor> position_ids,
                                         bool interleaved) {
  const Problem p = make_problem("rope_backward", "grad_q_out", "grad_k_out", grad_q_out, grad_k_out, cos, sin,
                                 position_ids, interleaved, true);
  const Outputs o = new_outputs(p, grad_q_out, grad_k_out, cos);
  if (!p.empty()) K::run(p, o, "rope_backward");
  return {*o.q_out, *o.k_out};
}

template <class K>
Tensor rope_inplace(Tensor q, Tensor k, Tensor cos, Tensor sin, std::optional<Tensor> position_ids, bool interleaved) {
  Problem p = make_problem("rope_", "q", "k", q, k, cos, sin, position_ids, interleaved, false);
  // Rows sharing memory would be rotated more than once, by several threads at once.
  FUSEDOPS_CHECK(q.numel() == 0 || !may_overlap(q), "rope_: q has rows that share memory (an expanded tensor?), "
                 "so it cannot be written in place; pass a contiguous q");
  FUSEDOPS_CHECK(k.numel() == 0 || !may_overlap(k), "rope_: k has rows that share memory (an expanded tensor?), "
                 "so it cannot be written in place; pass a contiguous k");
  FUSEDOPS_CHECK(overlap(q, k) == Overlap::kNone, "rope_: q and k share memory (the same tensor, or overlapping views), "
                 "so they cannot both be rotated in place; pass tensors that do not overlap");
  // The tables are read while q and k are written: a table inside either would be read half
  // rotated.
  for (const auto& [table, name] : {std::pair<const Tensor*, const char*>{&cos, "cos"}, {&sin, "sin"}})
    for (const auto& [written, wname] : {std::pair<const Tensor*, const char*>{&q, "q"}, {&k, "k"}})
      FUSEDOPS_CHECK(overlap(*table, *written) == Overlap::kNone, "rope_: ", name, " shares memory with ", wname,
                     ", which is rotated in place; pass a ", name, " that does not overlap q or k (a clone)");
  Tensor bad = new_bad_position(p, q);
  if (p.empty()) return bad;
  // In place, into q and k themselves or (strided last dimension) into their copies, which are
  // then copied back.
  Outputs o;
  o.in_place = true;
  o.q_out = *p.q;
  o.k_out = *p.k;
  o.qo = p.qs;
  o.ko = p.ks;
  o.bad_position = bad;
  K::run(p, o, "rope_");
  if (p.q->get() != q.get()) torch::stable::copy_(q, *p.q);
  if (p.k->get() != k.get()) torch::stable::copy_(k, *p.k);
  return bad;
}

}  // namespace fusedops::rope
