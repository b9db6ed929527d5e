// cross_entropy, cross_entropy_ and their backward scaling on the CPU (the math:
// fusedops/cross_entropy.h).
//
// Targets are validated first (a bad one raises, naming it, before anything is written), and
// the "mean" denominators summed in row order. Rows then run in parallel on torch's thread
// pool: the first sweep over a row (by chunks held in L1) finds its maximum and sums exp(x -
// max) (and the weighted logits, for label smoothing), the second (when a gradient is wanted)
// writes the gradient; a row of the shapes that matter (32000 fp32 values, 128 KiB) stays in L2
// between the sweeps, so the logits come from memory once. The loops are simd loops (exp is the
// branch-free polynomial of cpu_gated.h, so that it vectorises), compiled per instruction set
// (cpu_isa.h). Per-row losses are added in row order afterwards: the result does not depend on
// the thread count.
//
// Nothing is subtracted from lse = max + log(sum) once rounded: lse - x_t is taken as log(sum) -
// (x_t - max) and p_j as exp((x_j - max) - log(sum)), and the smoothing term's sum is kept in
// float64 as sum w_j (x_j - max), relative to the running maximum (moved as it grows), so that
// logits of large magnitude keep their precision, as torch's do (with lse rounded first, rows of
// values near 1e8 lost the loss entirely: float32's spacing there is 8; with sum w_j x_j itself,
// rows near 1e30 lost the smoothing term; relative to the target's logit instead, a masked target,
// -1e30 with weight 0, lost it).
#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "fusedops/cpu_convert.h"
#include "fusedops/cpu_gated.h"
#include "fusedops/cpu_isa.h"
#include "fusedops/cpu_memory.h"
#include "fusedops/cross_entropy.h"
#include "fusedops/dispatch.h"

namespace fusedops::cross_entropy::cpu {
namespace {

using fusedops::cpu::acc_t;
using fusedops::cpu::from_acc;
using fusedops::cpu::to_acc;

FUSEDOPS_CPU_INLINE float exp_acc(float x) { return fusedops::gated::cpu::exp_f32(x); }
FUSEDOPS_CPU_INLINE double exp_acc(double x) { return std::exp(x); }

template <typename T, typename W>
struct Args {
  using A = acc_t<T>;
  const T* x = nullptr;
  RowLayout rows;
  const W* weight = nullptr;  // null: all 1
  T* grad = nullptr;          // null: no gradient
  RowLayout grad_rows;
  int64_t V = 0;
  A softcap = 0, eps = 0, z = 0, W_sum = 0;
  A sw = 1, sn = 1;  // 1 / Dw and 1 / Dn under "mean", else 1
};

// softcap(v) = cap tanh(v / cap). In float32 as cap - 2 cap / (1 + e^(2 v / cap)) with the
// polynomial exp, which the simd loops vectorise (std::tanh, a libm call a value, left the
// softcapped loss at a third of torch.compile's speed); within a few 1e-7 cap of tanh's value,
// e = inf giving cap and e = 0 giving -cap, NaN staying NaN. float64 keeps std::tanh.
FUSEDOPS_CPU_INLINE float softcapped(float v, float cap) {
  const float e = exp_acc(v * (2.0f / cap));
  return cap - 2.0f * cap / (1.0f + e);
}
FUSEDOPS_CPU_INLINE double softcapped(double v, double cap) { return cap * std::tanh(v / cap); }

template <bool kSoftcap, typename A, typename T>
FUSEDOPS_CPU_INLINE A value(T v, A cap) {
  if constexpr (kSoftcap) {
    return softcapped(A(to_acc(v)), cap);
  } else {
    return A(to_acc(v));
  }
}

// Row statistics: the maximum m, sum exp(x - m) and (with smoothing) sum w_j (x_j - m) and
// sum w_j (m: 0 if every value is -inf or NaN). The row is
// read once, by chunks that go through an L1-resident float buffer (converted and soft-capped
// once): the chunk's maximum first, the running sum rescaled when it grows, then the exps.
constexpr int64_t kChunk = 2048;

template <bool kSoftcap, bool kWeighted, bool kSmooth, typename T, typename W>
FUSEDOPS_CPU_MULTIVERSION void row_stats(const Args<T, W>& a, const T* x, acc_t<T>& m_out, acc_t<T>& s_out,
                                         double& wx_out, double& w_out) {
  using A = acc_t<T>;
  const int64_t V = a.V;
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();
  alignas(64) A buf[kChunk];
  A m = kNegInf, s = 0;
  double wx = 0, w = 0;
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int64_t n = std::min(kChunk, V - c0);
    const T* xc = x + c0;
    A cm = kNegInf;
#pragma omp simd reduction(max : cm)
    for (int64_t j = 0; j < n; ++j) {
      const A v = value<kSoftcap>(xc[j], a.softcap);
      buf[j] = v;
      cm = v > cm ? v : cm;  // (a NaN is carried by the sum of exp instead)
    }
    if (cm > m) {
      s *= exp_acc(m - cm);  // (m = -inf: s is 0, or NaN, which stays)
      // (m = -inf: the sum so far is relative to 0, and -inf or NaN, which stays)
      if (kSmooth && m != kNegInf) wx -= w * (double(cm) - double(m));
      m = cm;
    }
    // The exponentials' base: m, or 0 while m is -inf, when the values so far are -inf (each
    // exp(v) 0) or NaN: the maximum skips NaN, the sum must not, or a NaN logit would vanish
    // from its row's loss (torch's is NaN). (exp(-inf - -inf) would be NaN for -inf too.)
    const A base = m == kNegInf ? A(0) : m;
    A cs = 0;
    double cwx = 0, cw = 0;
#pragma omp simd reduction(+ : cs)
    for (int64_t j = 0; j < n; ++j) cs += exp_acc(buf[j] - base);
    if constexpr (kSmooth) {
#pragma omp simd reduction(+ : cwx, cw)
      for (int64_t j = 0; j < n; ++j) {
        const double wj = kWeighted ? double(to_acc(a.weight[c0 + j])) : 1.0;
        cwx += wj * (double(buf[j]) - double(base));
        cw += wj;
      }
    }
    s += cs;
    wx += cwx;
    w += cw;
  }
  m_out = m;
  s_out = s;
  wx_out = wx;
  w_out = w;
}

// g_j = (p_j * cp - cw * w_j) * softcap'(x_j), p_j = exp((x_j - m) - ls) with m the row's
// maximum and ls the log of its sum of exp(x - m); the target's element is corrected by the
// caller.
template <bool kSoftcap, bool kWeighted, bool kSmooth, typename T, typename W>
FUSEDOPS_CPU_MULTIVERSION void row_grad(const Args<T, W>& a, const T* x, T* g, acc_t<T> m, acc_t<T> ls,
                                        acc_t<T> cp, acc_t<T> cw) {
  using A = acc_t<T>;
  const int64_t V = a.V;
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) {
    const A v = value<kSoftcap>(x[j], a.softcap);
    A d = exp_acc((v - m) - ls) * cp;
    if constexpr (kSmooth && kWeighted) {
      d -= cw * A(to_acc(a.weight[j]));
    } else if constexpr (kSmooth) {
      d -= cw;
    }
    if constexpr (kSoftcap) {
      const A u = v / a.softcap;
      d *= A(1) - u * u;
    }
    g[j] = from_acc<T>(d);
  }
}

template <typename T>
FUSEDOPS_CPU_MULTIVERSION void zero_row(T* g, int64_t V) {
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) g[j] = from_acc<T>(acc_t<T>(0));
}

// Raises for the first target outside [0, V) that is not ignore_index, naming it.
template <typename I>
void check_targets(const Problem& p, const I* t, const Tensor& target, const char* op) {
  for (int64_t i = 0; i < p.R; ++i) {
    const int64_t v = int64_t(t[i]);
    if (v == p.ignore_index || (v >= 0 && v < p.V)) continue;
    std::string where;
    int64_t rest = i;
    std::vector<int64_t> index(target.dim());
    for (int64_t d = target.dim(); d-- > 0;) {
      index[d] = rest % target.size(d);
      rest /= target.size(d);
    }
    for (int64_t d = 0; d < target.dim(); ++d) where += (d ? ", " : "") + std::to_string(index[d]);
    fail(op, ": target[", where, "] = ", v, " is outside [0, ", p.V, ") and is not ignore_index (", p.ignore_index,
         ")");
  }
}

template <typename T, typename W, typename I>
void run_typed(const Problem& p, Outputs& o, const char* op) {
  using A = acc_t<T>;
  const I* target = p.target.const_data_ptr<I>();
  Args<T, W> a;
  a.x = p.logits.const_data_ptr<T>();
  a.rows = p.rows;
  a.V = p.V;
  if (p.weight) a.weight = p.weight->const_data_ptr<W>();
  if (o.grad) {
    a.grad = o.grad->mutable_data_ptr<T>();
    a.grad_rows = o.grad_rows;
    if (o.grad->get() != p.logits.get()) fusedops::cpu::advise_huge_pages(*o.grad);
  }
  a.softcap = A(p.softcap);
  a.eps = A(p.label_smoothing);
  a.z = A(p.z_loss);
  // (in float64: the smoothing term multiplies it by the log of the row's sum of exponentials,
  // then takes the sum of w_j (x_j - max) away)
  double W_sum_d = double(p.V);
  if (a.weight != nullptr) {
    W_sum_d = 0;
    for (int64_t j = 0; j < p.V; ++j) W_sum_d += double(to_acc(a.weight[j]));
  }
  const A W_sum = A(W_sum_d);
  a.W_sum = W_sum;
  if (p.reduction == Reduction::kMean) {
    // (in float64: a float32 count stops at 2^24, and a float32 sum of a million weights is
    // off in its fourth digit)
    double dw = 0, dn = 0;
    for (int64_t i = 0; i < p.R; ++i) {
      const int64_t t = int64_t(target[i]);
      if (t == p.ignore_index) continue;
      dw += a.weight != nullptr ? double(to_acc(a.weight[t])) : 1.0;
      dn += 1;
    }
    // Kept targets whose weights add up to 0: the loss is 0 / 0 as torch's, NaN even where
    // smoothing's term alone would be finite / 0.
    a.sw = dw != 0 ? A(1.0 / dw) : std::numeric_limits<A>::quiet_NaN();
    a.sn = A(1.0 / dn);
  }
  A* lse_out = o.lse.mutable_data_ptr<A>();
  std::vector<A> row_loss(p.reduction == Reduction::kNone ? 0 : p.R);
  A* loss_rows = p.reduction == Reduction::kNone ? o.loss.mutable_data_ptr<A>() : row_loss.data();
  const bool softcap = p.softcap > 0, weighted = a.weight != nullptr, smooth = p.label_smoothing > 0;
  const int64_t grain = std::max<int64_t>(1, 16384 / p.V);
  torch::stable::parallel_for(0, p.R, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = int64_t(target[i]);
      T* g = a.grad != nullptr ? a.grad + a.grad_rows.offset(i) : nullptr;
      if (t == p.ignore_index) {
        lse_out[i] = 0;
        loss_rows[i] = 0;
        if (g != nullptr) zero_row(g, p.V);
        continue;
      }
      const T* x = a.x + a.rows.offset(i);
      A m, s;
      double wx, w;
      if (!smooth) {
        softcap ? row_stats<true, false, false>(a, x, m, s, wx, w) : row_stats<false, false, false>(a, x, m, s, wx, w);
      } else if (softcap) {
        weighted ? row_stats<true, true, true>(a, x, m, s, wx, w) : row_stats<true, false, true>(a, x, m, s, wx, w);
      } else {
        weighted ? row_stats<false, true, true>(a, x, m, s, wx, w) : row_stats<false, false, true>(a, x, m, s, wx, w);
      }
      const A ls = std::log(s);
      const A lse = m + ls;
      const A xt = value<false>(x[t], a.softcap);
      const A xt_c = softcap ? softcapped(xt, a.softcap) : xt;
      const A wt = weighted ? A(to_acc(a.weight[t])) : A(1);
      const A inv_v = A(1) / A(p.V);
      // lse - x_t and W lse - sum w_j x_j, each taken without rounding lse first (see the
      // header); the smoothing term only when smoothing (with -inf logits it is 0 * inf).
      A ce = (A(1) - a.eps) * wt * (ls - (xt_c - m));
      // (W lse - sum w_j x_j, taken as W ls - sum w_j (x_j - m); where every value is -inf or
      // NaN the sum is of the values themselves, and m stays in the first term)
      const double m_outside = m == -std::numeric_limits<A>::infinity() ? double(m) : 0.0;
      if (a.eps > A(0)) ce += a.eps * inv_v * A(W_sum_d * (m_outside + double(ls)) - wx);
      const A zl = a.z * lse * lse;
      lse_out[i] = lse;
      loss_rows[i] = p.reduction == Reduction::kMean ? ce * a.sw + zl * a.sn : ce + zl;
      if (g == nullptr) continue;
      // (the weights' sum only when smoothing: torch reads no other class's weight without it,
      // and an inf one, 1 / count for a class no row has, would make every gradient 0 * inf)
      const A smoothed = a.eps > A(0) ? a.eps * W_sum * inv_v : A(0);
      const A cp = ((A(1) - a.eps) * wt + smoothed) * a.sw + A(2) * a.z * lse * a.sn;
      const A ct = (A(1) - a.eps) * wt * a.sw;
      const A cw = a.eps * inv_v * a.sw;
      if (!smooth) {
        softcap ? row_grad<true, false, false>(a, x, g, m, ls, cp, cw)
                : row_grad<false, false, false>(a, x, g, m, ls, cp, cw);
      } else if (softcap) {
        weighted ? row_grad<true, true, true>(a, x, g, m, ls, cp, cw)
                 : row_grad<true, false, true>(a, x, g, m, ls, cp, cw);
      } else {
        weighted ? row_grad<false, true, true>(a, x, g, m, ls, cp, cw)
                 : row_grad<false, false, true>(a, x, g, m, ls, cp, cw);
      }
      // The target's element, once more with its own term (g may be x itself: use xt_c).
      A d = exp_acc((xt_c - m) - ls) * cp - ct - cw * wt;
      if (softcap) {
        const A u = xt_c / a.softcap;
        d *= A(1) - u * u;
      }
      g[t] = from_acc<T>(d);
    }
  });
  if (p.reduction != Reduction::kNone) {
    double total = 0;  // (float64: see the mean's denominators above)
    for (int64_t i = 0; i < p.R; ++i) total += double(row_loss[i]);
    // All rows ignored under "mean": 0 / 0, as torch.
    if (p.reduction == Reduction::kMean && !(a.sn < std::numeric_limits<A>::infinity()))
      total = std::numeric_limits<double>::quiet_NaN();
    *o.loss.mutable_data_ptr<A>() = A(total);
  }
  *o.bad_target.mutable_data_ptr<int64_t>() = -1;
}

template <typename T, typename W>
void run_weight(const Problem& p, Outputs& o, const char* op) {
  if (p.target.scalar_type() == ScalarType::Int)
    run_typed<T, W, int32_t>(p, o, op);
  else
    run_typed<T, W, int64_t>(p, o, op);
}

// ---- slices of the classes (linear_cross_entropy's low-memory mode) ----------------------
// Each row's slice goes through row_stats / row_grad with the weights shifted to the slice's
// first class; the running statistics are merged per row (rows are independent: no order to
// keep across threads).

// Calls f with the row functions' options as one constant: bit 2 softcap, 1 weighted, 0 smooth.
template <typename F>
void with_row_kind(bool softcap, bool weighted, bool smooth, F&& f) {
  if (!smooth) {
    softcap ? f(std::integral_constant<int, 0b100>{}) : f(std::integral_constant<int, 0b000>{});
  } else if (softcap) {
    weighted ? f(std::integral_constant<int, 0b111>{}) : f(std::integral_constant<int, 0b101>{});
  } else {
    weighted ? f(std::integral_constant<int, 0b011>{}) : f(std::integral_constant<int, 0b001>{});
  }
}

template <typename T, typename W, typename I>
void slice_typed(const SliceProblem& s, bool grad) {
  using A = acc_t<T>;
  Args<T, W> a;
  a.V = s.S;
  a.softcap = A(s.softcap);
  if (s.weight) a.weight = s.weight->const_data_ptr<W>() + s.class_start;
  const I* target = s.target.const_data_ptr<I>();
  T* logits = static_cast<T*>(s.logits.mutable_data_ptr());
  A* state = s.state.mutable_data_ptr<A>();
  const bool softcap = s.softcap > 0, weighted = a.weight != nullptr, smooth = s.smoothing;
  const int64_t grain = std::max<int64_t>(1, 16384 / s.S);
  torch::stable::parallel_for(0, s.R, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = int64_t(target[i]);
      T* x = logits + s.rows.offset(i);
      A* r = state + 4 * i;
      if (t == s.ignore_index) {
        if (grad) zero_row(x, s.S);
        continue;
      }
      const int64_t tl = t - s.class_start;
      const bool holds_target = tl >= 0 && tl < s.S;
      // The target's value, before a gradient overwrites it.
      const A xt = holds_target ? (softcap ? value<true>(x[tl], a.softcap) : value<false>(x[tl], a.softcap)) : A(0);
      with_row_kind(softcap, weighted, smooth, [&](auto kind) {
        constexpr int k = decltype(kind)::value;
        constexpr bool kCap = (k & 0b100) != 0, kW = (k & 0b010) != 0, kS = (k & 0b001) != 0;
        if (!grad) {
          A m, sum;
          double wx, w;
          row_stats<kCap, kW, kS>(a, x, m, sum, wx, w);
          // (a NaN is carried by the sums, as row_stats does: never dropped for a -inf maximum)
          if (m > r[0]) {
            r[1] = r[1] * exp_acc(r[0] - m) + sum;
            r[0] = m;
          } else {
            r[1] += m == r[0] ? sum : sum * exp_acc(m - r[0]);
          }
          // (the state holds sum w_j x_j itself: the slice's sum moved back from its maximum)
          if constexpr (kS) r[2] += A(m == -std::numeric_limits<A>::infinity() ? wx : wx + w * double(m));
        } else {
          row_grad<kCap, kW, kS>(a, x, x, r[0], A(0), r[1], r[3]);  // (base, scale, ct, cw)
        }
      });
      if (!holds_target) continue;
      if (!grad) {
        r[3] = xt;
        continue;
      }
      // The target's element, once more with its own term (as run_typed does).
      A d = exp_acc(xt - r[0]) * r[1] - r[2];
      if (smooth) d -= r[3] * (weighted ? A(to_acc(a.weight[tl])) : A(1));
      if (softcap) {
        const A u = xt / a.softcap;
        d *= A(1) - u * u;
      }
      x[tl] = from_acc<T>(d);
    }
  });
}

void run_slice(const SliceProblem& s, bool grad, const char* op) {
  dispatch_float(s.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool t32 = s.target.scalar_type() == ScalarType::Int;
    if constexpr (!std::is_same_v<T, float>) {
      if (s.weight && s.weight->scalar_type() == ScalarType::Float)
        return t32 ? slice_typed<T, float, int32_t>(s, grad) : slice_typed<T, float, int64_t>(s, grad);
    }
    t32 ? slice_typed<T, T, int32_t>(s, grad) : slice_typed<T, T, int64_t>(s, grad);
  });
}

struct Kernels {
  static void forward(const Problem& p, Outputs& o, const char* op) {
    if (p.target.scalar_type() == ScalarType::Int)
      check_targets(p, p.target.const_data_ptr<int32_t>(), p.target, op);
    else
      check_targets(p, p.target.const_data_ptr<int64_t>(), p.target, op);
    dispatch_float(p.dtype, op, [&](auto tag) {
      using T = typename decltype(tag)::type;
      // (the weight is in the logits' dtype or float32, for any logits dtype)
      if constexpr (!std::is_same_v<T, float>) {
        if (p.weight && p.weight->scalar_type() == ScalarType::Float) return run_weight<T, float>(p, o, op);
      }
      run_weight<T, T>(p, o, op);
    });
  }

  static void scale(const ScaleProblem& s, const Tensor& out, const RowLayout& out_rows, bool in_place, const char* op) {
    dispatch_float(s.dtype, op, [&](auto tag) {
      using T = typename decltype(tag)::type;
      using A = acc_t<T>;
      // grad_output in float64 whatever its dtype (a handful of values).
      const Tensor go = torch::stable::to(s.grad_output, ScalarType::Double);
      const double* scales = go.const_data_ptr<double>();
      const T* g = s.grad.const_data_ptr<T>();
      T* y = out.mutable_data_ptr<T>();
      const int64_t V = s.V;
      const int64_t grain = std::max<int64_t>(1, 32768 / V);
      if (!in_place) fusedops::cpu::advise_huge_pages(out);
      torch::stable::parallel_for(0, s.R, grain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const double k = scales[s.per_row ? i : 0];
          if (in_place && k == 1.0) continue;
          scale_row<T>(g + s.rows.offset(i), y + out_rows.offset(i), A(k), V);
        }
      });
    });
  }

  static void slice_stats(const SliceProblem& s) { run_slice(s, false, "cross_entropy_slice_stats_"); }
  static void slice_grad(const SliceProblem& s) { run_slice(s, true, "cross_entropy_slice_grad_"); }

  template <typename T>
  FUSEDOPS_CPU_MULTIVERSION static void scale_row(const T* g, T* y, acc_t<T> k, int64_t V) {
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) y[j] = from_acc<T>(acc_t<T>(to_acc(g[j])) * k);
  }
};

}  // namespace
}  // namespace fusedops::cross_entropy::cpu

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  using K = fusedops::cross_entropy::cpu::Kernels;
  m.impl("cross_entropy", TORCH_BOX(&fusedops::cross_entropy::cross_entropy<K>));
  m.impl("cross_entropy_", TORCH_BOX(&fusedops::cross_entropy::cross_entropy_inplace<K>));
  m.impl("cross_entropy_backward", TORCH_BOX(&fusedops::cross_entropy::cross_entropy_backward<K>));
  m.impl("cross_entropy_backward_", TORCH_BOX(&fusedops::cross_entropy::cross_entropy_backward_inplace<K>));
  m.impl("cross_entropy_slice_stats_", TORCH_BOX(&fusedops::cross_entropy::cross_entropy_slice_stats<K>));
  m.impl("cross_entropy_slice_grad_", TORCH_BOX(&fusedops::cross_entropy::cross_entropy_slice_grad<K>));
}
