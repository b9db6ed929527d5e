// The CPU kernels of the row normalisations, generic over centring: rms_norm (kCentered =
// false) and layer_norm (kCentered = true, with a bias). Rows run in parallel on torch's thread
// pool; each row is swept a few times (statistics, then the output), every sweep after the
// first reading the row from cache. The row loops are compiled for several instruction sets and
// picked at load time (cpu_isa.h). Math in float32 (float64 for float64 input).
//
// Each op's translation unit instantiates these for itself: everything here has internal
// linkage, so the multiversioned symbols of two ops never meet at link time.
#pragma once

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>

#include <torch/csrc/stable/ops.h>

#include "fusedops/cpu_convert.h"
#include "fusedops/cpu_isa.h"
#include "fusedops/norm.h"

namespace fusedops::norm::cpu {
namespace {

using fusedops::cpu::acc_t;
using fusedops::cpu::from_acc;
using fusedops::cpu::to_acc;

// Rows per parallel task: enough elements that a task outweighs the pool's overhead.
int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

template <typename T>
acc_t<T> row_sum(const T* x, int64_t n) {
  acc_t<T> s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) s += to_acc(x[j]);
  return s;
}

// Sum of (x - mu)^2; two sweeps (mean first) rather than sum and sum of squares together, which
// loses every digit when |mean| >> std.
template <typename T>
acc_t<T> row_sum_sq(const T* x, int64_t n, acc_t<T> mu) {
  acc_t<T> s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) {
    const acc_t<T> v = to_acc(x[j]) - mu;
    s += v * v;
  }
  return s;
}

// The input rows and affine parameters of one problem, typed; the per-row statistics (mean:
// layer_norm only) are written by the forward and read by the backward.
template <typename T, typename W, typename Stat>
struct Args {
  const T* x = nullptr;
  const W* w = nullptr;  // null: no weight
  const W* b = nullptr;  // null: no bias
  Stat* mean = nullptr;
  Stat* rstd = nullptr;
};

// y (and the statistics) of rows [begin, end).
template <bool kCentered, typename T, typename W>
FUSEDOPS_CPU_MULTIVERSION void forward_rows(const Problem& p, const Args<T, W, acc_t<T>>& a, T* y, double eps, int64_t begin,
                                            int64_t end) {
  using A = acc_t<T>;
  const int64_t n = p.n;
  const W* w = a.w;
  const W* b = a.b;
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = a.x + p.rows.offset(r);
    T* yr = y + r * n;
    const A mu = kCentered ? row_sum(xr, n) / A(n) : A(0);
    const A rs = A(1) / std::sqrt(row_sum_sq(xr, n, mu) / A(n) + A(eps));
    if (kCentered) a.mean[r] = mu;
    a.rstd[r] = rs;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      A v = (to_acc(xr[j]) - mu) * rs;
      if (w != nullptr) v *= A(to_acc(w[j]));
      if (b != nullptr) v += A(to_acc(b[j]));
      yr[j] = from_acc<T>(v);
    }
  }
}

// The outputs of a forward: y, mean (layer_norm) and rstd.
template <bool kCentered>
std::tuple<Tensor, std::optional<Tensor>, Tensor> forward(const char* op, const Tensor& input,
                                                          const std::optional<Tensor>& weight,
                                                          const std::optional<Tensor>& bias, double eps) {
  const Problem p = forward_problem(op, input, weight, bias, eps);
  Tensor out = output_like(input), rstd = row_stat(input);
  std::optional<Tensor> mean;
  if (kCentered) mean = row_stat(input);
  if (p.num_rows == 0) return {out, mean, rstd};
  dispatch_float(input.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    if (p.n == 0) {  // an empty row: mean 0, variance 0
      std::fill_n(rstd.mutable_data_ptr<A>(), p.num_rows, A(1) / std::sqrt(A(eps)));
      if (kCentered) std::fill_n(mean->mutable_data_ptr<A>(), p.num_rows, A(0));
      return;
    }
    dispatch_weight<T>(p.param_dtype(), [&](auto wtag) {
      using W = typename decltype(wtag)::type;
      Args<T, W, A> a;
      a.x = p.input.const_data_ptr<T>();
      if (p.weight) a.w = p.weight->const_data_ptr<W>();
      if (p.bias) a.b = p.bias->const_data_ptr<W>();
      if (kCentered) a.mean = mean->mutable_data_ptr<A>();
      a.rstd = rstd.mutable_data_ptr<A>();
      T* y = out.mutable_data_ptr<T>();
      torch::stable::parallel_for(0, p.num_rows, grain_rows(p.n), [&](int64_t begin, int64_t end) {
        forward_rows<kCentered, T, W>(p, a, y, eps, begin, end);
      });
    });
  });
  return {out, mean, rstd};
}

// grad_input of rows [begin, end); adds grad_output * xhat into dw_acc and grad_output into
// db_acc when they are given.
//   xhat = (x - mean) * rstd, g = grad_output * w
//   dx = rstd * (g - xhat * mean(g * xhat) - mean(g))     (the last term: layer_norm only)
template <bool kCentered, typename T, typename W>
FUSEDOPS_CPU_MULTIVERSION void backward_rows(const BackwardProblem& p, const Args<T, W, const acc_t<T>>& a,
                                             const T* dy, T* dx,
                                             acc_t<T>* dw_acc, acc_t<T>* db_acc, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  const int64_t n = p.n;
  const W* w = a.w;
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = a.x + p.rows.offset(r);
    const T* dyr = dy + p.grad_rows.offset(r);
    T* dxr = dx + r * n;
    const A rs = a.rstd[r];
    const A mu = kCentered ? a.mean[r] : A(0);
    A sum_gx = 0, sum_g = 0;
#pragma omp simd reduction(+ : sum_gx, sum_g)
    for (int64_t j = 0; j < n; ++j) {
      const A g = w != nullptr ? to_acc(dyr[j]) * A(to_acc(w[j])) : to_acc(dyr[j]);
      sum_gx += g * (to_acc(xr[j]) - mu);
      if (kCentered) sum_g += g;
    }
    const A c1 = rs * sum_gx / A(n) * rs;  // mean(g * xhat) * rstd, applied to (x - mu)
    const A c0 = kCentered ? sum_g / A(n) : A(0);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const A g = w != nullptr ? to_acc(dyr[j]) * A(to_acc(w[j])) : to_acc(dyr[j]);
      dxr[j] = from_acc<T>(rs * (g - c0 - c1 * (to_acc(xr[j]) - mu)));
    }
    if (dw_acc != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) dw_acc[j] += to_acc(dyr[j]) * ((to_acc(xr[j]) - mu) * rs);
    }
    if (db_acc != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) db_acc[j] += to_acc(dyr[j]);
    }
  }
}

// out[j] = sum over c of partial[c, j], c in order, for j in [begin, end).
template <typename A, typename W>
FUSEDOPS_CPU_MULTIVERSION void sum_partials(const A* partial, int64_t chunks, int64_t n, W* out, int64_t begin,
                                            int64_t end) {
  for (int64_t j = begin; j < end; ++j) {
    A s = 0;
    for (int64_t c = 0; c < chunks; ++c) s += partial[c * n + j];
    out[j] = from_acc<W>(s);
  }
}

// grad_input, grad_weight and grad_bias (empty when not wanted).
template <bool kCentered>
std::tuple<Tensor, Tensor, Tensor> backward(const BackwardProblem& p, const char* op) {
  Tensor grad_input = output_like(p.input);
  Tensor grad_weight = param_grad(p, p.weight, p.want_grad_weight);
  Tensor grad_bias = param_grad(p, p.bias, p.want_grad_bias);
  if (p.empty()) return {grad_input, grad_weight, grad_bias};
  const int64_t n = p.n, rows = p.num_rows;
  const bool want_dw = p.want_grad_weight, want_db = p.want_grad_bias;
  // Deterministic parameter gradients: a fixed split of the rows into `chunks` (independent of
  // the thread count), one partial sum per chunk, then the partials added in chunk order. At
  // most 64 chunks and about 16 MiB of partial sums.
  const int64_t chunks = std::clamp<int64_t>(std::min<int64_t>(64, (int64_t(1) << 22) / n), 1, rows);
  dispatch_float(p.input.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    dispatch_weight<T>(p.param_dtype(), [&](auto wtag) {
      using W = typename decltype(wtag)::type;
      Args<T, W, const A> a;
      a.x = p.input.const_data_ptr<T>();
      if (p.weight) a.w = p.weight->const_data_ptr<W>();
      if (kCentered) a.mean = p.mean->const_data_ptr<A>();
      a.rstd = p.rstd.const_data_ptr<A>();
      const T* dy = p.grad_output.const_data_ptr<T>();
      T* dx = grad_input.mutable_data_ptr<T>();
      if (!want_dw && !want_db) {
        torch::stable::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
          backward_rows<kCentered, T, W>(p, a, dy, dx, nullptr, nullptr, begin, end);
        });
        return;
      }
      const int64_t params = int64_t(want_dw) + int64_t(want_db);
      Tensor partial = empty_like_device(p.input, {params, chunks, n}, acc_dtype(p.input.scalar_type()));
      A* dw_part = want_dw ? partial.mutable_data_ptr<A>() : nullptr;
      A* db_part = want_db ? partial.mutable_data_ptr<A>() + (want_dw ? chunks * n : 0) : nullptr;
      torch::stable::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
        for (int64_t c = cb; c < ce; ++c) {
          A* dw_acc = want_dw ? dw_part + c * n : nullptr;
          A* db_acc = want_db ? db_part + c * n : nullptr;
          if (dw_acc) std::fill(dw_acc, dw_acc + n, A(0));
          if (db_acc) std::fill(db_acc, db_acc + n, A(0));
          backward_rows<kCentered, T, W>(p, a, dy, dx, dw_acc, db_acc, rows * c / chunks, rows * (c + 1) / chunks);
        }
      });
      torch::stable::parallel_for(0, n, 4096, [&](int64_t jb, int64_t je) {
        if (want_dw) sum_partials<A, W>(dw_part, chunks, n, grad_weight.mutable_data_ptr<W>(), jb, je);
        if (want_db) sum_partials<A, W>(db_part, chunks, n, grad_bias.mutable_data_ptr<W>(), jb, je);
      });
    });
  });
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace
}  // namespace fusedops::norm::cpu
