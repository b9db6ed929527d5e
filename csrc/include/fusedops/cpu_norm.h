// The CPU kernels of the row normalisations, generic over their features: centring (rms_norm:
// kCentered = false; layer_norm: true, with a bias), a residual added first (add_rms_norm: the
// residual type R, NoResidual otherwise), rounding the normalised row before the weight
// (cast_before_weight), and in the backward the saved tensor being the output
// (saved_is_output), a gradient reaching residual_out and a residual wider than the output.
// Every feature is a compile-time parameter of one forward and one backward row loop, so each
// op's inner loops hold only what it uses; the weight's offset is folded into the weight before
// the rows run (AffineParams). Rows run in parallel on torch's thread pool; each row is swept a
// few times (statistics, then the output), every sweep after the first reading the row from
// cache (add_rms_norm adds in the first sweep, writing residual_out, and reads that back). The row loops are compiled for several instruction sets and picked at
// load time (cpu_isa.h). Math in float32 (float64 for float64 input).
//
// Each op's translation unit instantiates these for itself: everything here has internal
// linkage, so the multiversioned symbols of two ops never meet at link time.
#pragma once

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include <torch/csrc/stable/ops.h>

#include "fusedops/cpu_convert.h"
#include "fusedops/cpu_isa.h"
#include "fusedops/cpu_memory.h"
#include "fusedops/norm.h"

namespace fusedops::norm::cpu {
namespace {

using fusedops::cpu::acc_t;
using fusedops::cpu::from_acc;
using fusedops::cpu::to_acc;

template <typename T>
constexpr bool kNarrow = std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>;

// The residual type of the norms without one.
struct NoResidual {};

// Calls f(std::bool_constant<b>{}).
template <typename F>
decltype(auto) dispatch_bool(bool b, F&& f) {
  if (b) return f(std::true_type{});
  return f(std::false_type{});
}

// The weight, the residual and add_rms_norm's saved residual_out are in the input's dtype T, or
// float32 under a 16-bit T (norm.h checks): calls f(TypeTag<float>) or f(TypeTag<T>), never
// instantiating float32 with a float64 T (nor at all without kMayWiden).
template <typename T, bool kMayWiden = true, typename F>
decltype(auto) dispatch_wider(ScalarType t, F&& f) {
  if constexpr (kNarrow<T> && kMayWiden)
    if (t == ScalarType::Float) return f(TypeTag<float>{});
  return f(TypeTag<T>{});
}

// Rows per parallel task: enough elements that a task outweighs the pool's overhead.
int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

// Row sums go in blocks of kSumBlock values: each block's vectorised sum in the accumulation
// type stays short, and the blocks add up in float64. One float32 sum over a whole row has an
// error that grows with the row (relative 1e-6 at 262144 values, 3e-5 at 4M, ten to a hundred
// times torch's); blocked, it is that of a 4096-value row at any width. Each loop writes the
// blocking out: a helper taking the block's sum as a lambda would have to force the lambda
// inline too, or its simd loop would leave the FUSEDOPS_CPU_MULTIVERSION clones (AVX2, AVX-512).
constexpr int64_t kSumBlock = 4096;

// The row's mean, as x[0] + mean(x - x[0]): a row whose |mean| is far above its spread would
// lose the mean in a plain float32 sum (of 4096 values 1e5 + N(0, 1), off by whole units), while
// x - x[0] is of the spread's order and nearly exact. (n == 0: 0 / 0, NaN.)
template <typename T>
FUSEDOPS_CPU_INLINE acc_t<T> row_mean(const T* x, int64_t n) {
  using A = acc_t<T>;
  const A x0 = n > 0 ? to_acc(x[0]) : A(0);
  double total = 0;
  for (int64_t j0 = 0; j0 < n; j0 += kSumBlock) {
    const int64_t j1 = std::min(n, j0 + kSumBlock);
    A s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t j = j0; j < j1; ++j) s += to_acc(x[j]) - x0;
    total += s;
  }
  return x0 + A(total / double(n));
}

// Sum of (x - mu)^2; two sweeps (mean first) rather than sum and sum of squares together, which
// loses every digit when |mean| >> std.
template <typename T>
FUSEDOPS_CPU_INLINE acc_t<T> row_sum_sq(const T* x, int64_t n, acc_t<T> mu) {
  using A = acc_t<T>;
  double total = 0;
  for (int64_t j0 = 0; j0 < n; j0 += kSumBlock) {
    const int64_t j1 = std::min(n, j0 + kSumBlock);
    A s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t j = j0; j < j1; ++j) {
      const A v = to_acc(x[j]) - mu;
      s += v * v;
    }
    total += s;
  }
  return A(total);
}

// h = x + r rounded to R, written to `h` (which may be `r` itself: each element is read before
// it is written); returns the sum of the rounded h^2.
template <typename T, typename R>
FUSEDOPS_CPU_INLINE acc_t<R> add_row(const T* x, const R* r, R* h, int64_t n) {
  using A = acc_t<R>;
  double total = 0;
  for (int64_t j0 = 0; j0 < n; j0 += kSumBlock) {
    const int64_t j1 = std::min(n, j0 + kSumBlock);
    A s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t j = j0; j < j1; ++j) {
      h[j] = from_acc<R>(A(to_acc(x[j])) + to_acc(r[j]));
      const A v = to_acc(h[j]);
      s += v * v;
    }
    total += s;
  }
  return A(total);
}

// The weight and bias as the row loops read them, W*. Without an offset they are the tensors
// themselves (W = P, their dtype). With one, (offset + weight) and the bias are computed once in
// the accumulation type A (W = A), so that no row loop sees the offset. With `inverse`, also
// inv_w = 1 / (offset + weight) and shift = bias * inv_w (1 and 0 without them), by which
// saved_is_output's backward recovers xhat = y * inv_w - shift without a branch or a division.
template <typename W, typename P, typename A>
struct AffineParams {
  const W* w = nullptr;  // null: no weight
  const W* b = nullptr;  // null: no bias
  const A* inv_w = nullptr;  // only with `inverse`, then never null
  const A* shift = nullptr;  // likewise
  std::vector<A> storage;

  AffineParams(const Problem& p, bool inverse) {
    const int64_t n = p.n;
    const P* pw = p.weight ? p.weight->const_data_ptr<P>() : nullptr;
    const P* pb = p.bias ? p.bias->const_data_ptr<P>() : nullptr;
    const bool folded = p.offset != 0;
    storage.resize(n * ((folded && pw ? 1 : 0) + (folded && pb ? 1 : 0) + (inverse ? 2 : 0)));
    A* next = storage.data();
    const A off = A(p.offset);
    if (folded) {
      if constexpr (std::is_same_v<W, A>) {
        if (pw) {
          for (int64_t j = 0; j < n; ++j) next[j] = off + A(to_acc(pw[j]));
          w = next;
          next += n;
        }
        if (pb) {
          for (int64_t j = 0; j < n; ++j) next[j] = A(to_acc(pb[j]));
          b = next;
          next += n;
        }
      } else {
        fail("fusedops: internal error: an offset weight read as its own dtype");
      }
    } else {
      if constexpr (std::is_same_v<W, P>) {
        w = pw;
        b = pb;
      } else {
        fail("fusedops: internal error: a weight without offset read as float");
      }
    }
    if (inverse) {
      A* inv = next;
      A* sh = next + n;
      for (int64_t j = 0; j < n; ++j) {
        inv[j] = pw ? A(1) / (off + A(to_acc(pw[j]))) : A(1);
        sh[j] = pb ? A(to_acc(pb[j])) * inv[j] : A(0);
      }
      inv_w = inv;
      shift = sh;
    }
  }
  AffineParams(const AffineParams&) = delete;
  AffineParams& operator=(const AffineParams&) = delete;
};

// Calls f(TypeTag<W>{}, TypeTag<P>{}): P the parameters' dtype, W how the row loops read them.
template <typename T, typename F>
decltype(auto) dispatch_params(const Problem& p, F&& f) {
  using A = acc_t<T>;
  return dispatch_wider<T>(p.param_dtype(), [&](auto ptag) {
    if (p.offset != 0) return f(TypeTag<A>{}, ptag);
    return f(ptag, ptag);
  });
}

// What a forward reads and writes, typed. R is the residual's type (NoResidual: none).
template <typename T, typename W, typename R>
struct ForwardArgs {
  using A = acc_t<T>;
  int64_t n = 0;
  const T* x = nullptr;
  RowLayout x_rows;
  const R* res = nullptr;  // add_rms_norm: the residual ...
  RowLayout res_rows;
  R* h = nullptr;          // ... and residual_out (possibly the residual itself)
  RowLayout h_rows;
  const W* w = nullptr;  // null: no weight
  const W* b = nullptr;  // null: no bias
  T* y = nullptr;        // contiguous
  A* mean = nullptr;     // layer_norm only
  A* rstd = nullptr;
  A eps = 0;
};

// y (and the statistics, and for add_rms_norm residual_out) of rows [begin, end):
//   h = round_R(x + r) (with a residual; the row normalised is then h, else x)
//   xhat = (x - mean) * rstd, rounded to T when kCast; y = xhat * w + b (w: offset + weight)
// kW, kB: whether there is a weight, a bias. They are template arguments, not tests in the loop:
// a load under a condition "could trap", and GCC vectorises such a loop only with masked loads
// (AVX-512), so the AVX2 clone of some instantiations (fp16 among them) stayed scalar.
template <bool kCentered, bool kCast, bool kW, bool kB, typename T, typename W, typename R>
FUSEDOPS_CPU_INLINE void forward_rows_with(const ForwardArgs<T, W, R>& a, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  constexpr bool kAdd = !std::is_same_v<R, NoResidual>;
  using X = std::conditional_t<kAdd, R, T>;  // the type of the row that is normalised
  static_assert(std::is_same_v<acc_t<X>, A>);
  const int64_t n = a.n;
  const W* w = a.w;
  const W* b = a.b;
  static_assert(!(kAdd && kCentered), "a residual is add_rms_norm's alone");
  for (int64_t r = begin; r < end; ++r) {
    const X* xr;
    A sum_sq;  // of (x - mean)^2, or of x^2
    A mu = 0;
    if constexpr (kAdd) {
      R* hr = a.h + a.h_rows.offset(r);
      sum_sq = add_row(a.x + a.x_rows.offset(r), a.res + a.res_rows.offset(r), hr, n);
      xr = hr;
    } else {
      xr = a.x + a.x_rows.offset(r);
      if constexpr (kCentered) mu = row_mean(xr, n);
      sum_sq = row_sum_sq(xr, n, mu);
    }
    const A rs = A(1) / std::sqrt(sum_sq / A(n) + a.eps);
    if (kCentered) a.mean[r] = mu;
    a.rstd[r] = rs;
    T* yr = a.y + r * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      A v = (to_acc(xr[j]) - mu) * rs;
      if constexpr (kCast) v = to_acc(from_acc<T>(v));
      if constexpr (kW) v *= A(to_acc(w[j]));
      if constexpr (kB) v += A(to_acc(b[j]));
      yr[j] = from_acc<T>(v);
    }
  }
}

template <bool kCentered, bool kCast, typename T, typename W, typename R>
FUSEDOPS_CPU_MULTIVERSION void forward_rows(const ForwardArgs<T, W, R>& a, int64_t begin, int64_t end) {
  if (a.w != nullptr && a.b != nullptr) forward_rows_with<kCentered, kCast, true, true>(a, begin, end);
  else if (a.w != nullptr) forward_rows_with<kCentered, kCast, true, false>(a, begin, end);
  else if (a.b != nullptr) forward_rows_with<kCentered, kCast, false, true>(a, begin, end);
  else forward_rows_with<kCentered, kCast, false, false>(a, begin, end);
}

// The pointers of a forward that every norm has.
template <typename T, typename W, typename R, typename P>
ForwardArgs<T, W, R> forward_args(const Problem& p, const ForwardOutputs& o, const AffineParams<W, P, acc_t<T>>& params) {
  using A = acc_t<T>;
  ForwardArgs<T, W, R> a;
  a.n = p.n;
  a.x = p.input.const_data_ptr<T>();
  a.x_rows = p.rows;
  a.w = params.w;
  a.b = params.b;
  a.y = o.out.mutable_data_ptr<T>();
  if (o.mean) a.mean = o.mean->mutable_data_ptr<A>();
  a.rstd = o.rstd.mutable_data_ptr<A>();
  a.eps = A(p.eps);
  return a;
}

// The options only the uncentred norms have (layer_norm's schema has none of them): they are
// not instantiated for kCentered, which keeps layer_norm's compile time and code size down.
template <bool kCentered>
void check_uncentred_options(const Problem& p, bool saved_is_output, bool grad_residual_out, bool wider_x,
                             const char* op) {
  if constexpr (kCentered)
    FUSEDOPS_CHECK(!p.cast_before_weight && !saved_is_output && !grad_residual_out && !wider_x, op,
                   ": internal error: an rms_norm option reached the centred kernels");
}

template <bool kCentered, typename T, typename W, typename R>
void run_forward(const Problem& p, const ForwardArgs<T, W, R>& a) {
  // Rounding to T before the weight changes nothing when T is the accumulation type.
  dispatch_bool(kNarrow<T> && !kCentered && p.cast_before_weight, [&](auto cast) {
    constexpr bool kCast = kNarrow<T> && !kCentered && decltype(cast)::value;
    torch::stable::parallel_for(0, p.num_rows, grain_rows(p.n), [&](int64_t begin, int64_t end) {
      forward_rows<kCentered, kCast, T, W, R>(a, begin, end);
    });
  });
}

// rms_norm (kCentered = false) and layer_norm (true): fills o.out, o.rstd and o.mean.
template <bool kCentered>
void forward(const Problem& p, const ForwardOutputs& o, const char* op) {
  if (p.empty()) return;
  check_uncentred_options<kCentered>(p, false, false, false, op);
  dispatch_float(p.input.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_params<T>(p, [&](auto wtag, auto ptag) {
      using W = typename decltype(wtag)::type;
      using P = typename decltype(ptag)::type;
      const AffineParams<W, P, acc_t<T>> params(p, false);
      run_forward<kCentered>(p, forward_args<T, W, NoResidual>(p, o, params));
    });
  });
}

// add_rms_norm and add_rms_norm_: fills o.out, o.rstd and *o.residual_out.
inline void add_forward(const AddProblem& p, const ForwardOutputs& o, const char* op) {
  if (p.empty()) return;
  dispatch_float(p.input.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_params<T>(p, [&](auto wtag, auto ptag) {
      using W = typename decltype(wtag)::type;
      using P = typename decltype(ptag)::type;
      const AffineParams<W, P, acc_t<T>> params(p, false);
      dispatch_wider<T>(p.residual.scalar_type(), [&](auto rtag) {  // R: T, or float32 under 16-bit T
        using R = typename decltype(rtag)::type;
        ForwardArgs<T, W, R> a = forward_args<T, W, R>(p, o, params);
        a.res = p.residual.const_data_ptr<R>();
        a.res_rows = p.residual_rows;
        a.h = o.residual_out->mutable_data_ptr<R>();
        a.h_rows = o.residual_out_rows;
        run_forward<false>(p, a);
      });
    });
  });
}

// What a backward reads and writes, typed. T is grad_output's type (and grad_input's), X the
// saved tensor's: T, or for add_rms_norm the wider residual_out's.
template <typename T, typename X, typename W>
struct BackwardArgs {
  using A = acc_t<T>;
  int64_t n = 0;
  const X* x = nullptr;  // the forward's input (or output, or residual_out)
  RowLayout x_rows;
  const T* dy = nullptr;
  RowLayout dy_rows;
  const X* dh = nullptr;  // the gradient reaching residual_out, or null
  RowLayout dh_rows;
  const W* w = nullptr;      // offset + weight (the bias only enters through `shift`)
  const A* inv_w = nullptr;  // with saved_is_output: 1 / (offset + weight) ...
  const A* shift = nullptr;  // ... and bias / (offset + weight)
  const A* mean = nullptr;
  const A* rstd = nullptr;
  T* dx = nullptr;    // contiguous
  X* dres = nullptr;  // contiguous; only when X is not T
};

// The normalised element xhat = u * k with k = rstd, or k = 1 with kSavedOutput; see below.
template <bool kSavedOutput, typename X, typename A>
FUSEDOPS_CPU_INLINE A unscaled_xhat(const X* xr, const A* inv_w, const A* shift, A mu, int64_t j) {
  if constexpr (kSavedOutput) {  // x is y = xhat * w + b
    return to_acc(xr[j]) * inv_w[j] - shift[j];
  } else {
    return to_acc(xr[j]) - mu;
  }
}

// grad_output times the weight at j (kW), or grad_output alone.
template <bool kW, typename T, typename W>
FUSEDOPS_CPU_INLINE acc_t<T> weighted_grad(const T* dyr, const W* w, int64_t j) {
  if constexpr (kW) {
    return to_acc(dyr[j]) * acc_t<T>(to_acc(w[j]));
  } else {
    return to_acc(dyr[j]);
  }
}

// grad_input (and grad_residual) of rows [begin, end); adds grad_output * xhat into dw_acc and
// grad_output into db_acc when they are given.
//   xhat = u * k: u = x - mean, k = rstd; with kSavedOutput u = (y - b) / w, k = 1 (x is y)
//   g = grad_output * w (w: offset + weight)
//   dx = rstd * (g - xhat * mean(g * xhat) - mean(g)) (+ grad_residual_out with kGradRes)
// (the mean(g) term: layer_norm only); written in T, and in X too when that is wider.
// kW: whether there is a weight (a template argument for the reason forward_rows_with gives).
template <bool kCentered, bool kSavedOutput, bool kGradRes, bool kW, typename T, typename X, typename W>
FUSEDOPS_CPU_INLINE void backward_rows_with(const BackwardArgs<T, X, W>& a, acc_t<T>* dw_acc, acc_t<T>* db_acc,
                                            int64_t begin, int64_t end) {
  using A = acc_t<T>;
  static_assert(std::is_same_v<acc_t<X>, A>);
  constexpr bool kWide = !std::is_same_v<X, T>;
  const int64_t n = a.n;
  const W* w = a.w;
  const A* inv_w = a.inv_w;
  const A* shift = a.shift;
  for (int64_t r = begin; r < end; ++r) {
    const X* xr = a.x + a.x_rows.offset(r);
    const T* dyr = a.dy + a.dy_rows.offset(r);
    const X* dhr = kGradRes ? a.dh + a.dh_rows.offset(r) : nullptr;
    T* dxr = a.dx + r * n;
    X* dresr = kWide ? a.dres + r * n : nullptr;
    const A rs = a.rstd[r];
    const A mu = kCentered && !kSavedOutput ? a.mean[r] : A(0);
    double total_gu = 0, total_g = 0;  // (in blocks: see kSumBlock)
    for (int64_t j0 = 0; j0 < n; j0 += kSumBlock) {
      const int64_t j1 = std::min(n, j0 + kSumBlock);
      A block_gu = 0, block_g = 0;
#pragma omp simd reduction(+ : block_gu, block_g)
      for (int64_t j = j0; j < j1; ++j) {
        if constexpr (kSavedOutput) {
          // g * xhat = dy * y: no division, so a column where offset + w is 0 (y = 0 there)
          // adds 0 rather than 0 * inf, and only its own gradients are NaN.
          block_gu += to_acc(dyr[j]) * to_acc(xr[j]);
        } else {
          const A g = weighted_grad<kW>(dyr, w, j);
          block_gu += g * unscaled_xhat<kSavedOutput>(xr, inv_w, shift, mu, j);
          if (kCentered) block_g += g;
        }
      }
      total_gu += block_gu;
      total_g += block_g;
    }
    const A sum_gu = A(total_gu), sum_g = A(total_g);
    const A k = kSavedOutput ? A(1) : rs;
    const A c1 = k * sum_gu / A(n) * k;  // mean(g * xhat) * k, applied to u
    const A c0 = kCentered ? sum_g / A(n) : A(0);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const A g = weighted_grad<kW>(dyr, w, j);
      A d = rs * (g - c0 - c1 * unscaled_xhat<kSavedOutput>(xr, inv_w, shift, mu, j));
      if constexpr (kGradRes) d += to_acc(dhr[j]);
      dxr[j] = from_acc<T>(d);
      if constexpr (kWide) dresr[j] = from_acc<X>(d);
    }
    if (dw_acc != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j)
        dw_acc[j] += to_acc(dyr[j]) * (unscaled_xhat<kSavedOutput>(xr, inv_w, shift, mu, j) * k);
    }
    if (db_acc != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) db_acc[j] += to_acc(dyr[j]);
    }
  }
}

template <bool kCentered, bool kSavedOutput, bool kGradRes, typename T, typename X, typename W>
FUSEDOPS_CPU_MULTIVERSION void backward_rows(const BackwardArgs<T, X, W>& a, acc_t<T>* dw_acc, acc_t<T>* db_acc,
                                             int64_t begin, int64_t end) {
  if (a.w != nullptr) backward_rows_with<kCentered, kSavedOutput, kGradRes, true>(a, dw_acc, db_acc, begin, end);
  else backward_rows_with<kCentered, kSavedOutput, kGradRes, false>(a, dw_acc, db_acc, begin, end);
}

// out[j] = sum over c of partial[c, j], c in order, for j in [begin, end): a block of columns
// at a time, adding each chunk's row across the block (contiguous, so the adds vectorise; each
// column still adds its chunks in order).
template <typename A, typename W>
FUSEDOPS_CPU_MULTIVERSION void sum_partials(const A* partial, int64_t chunks, int64_t n, W* out, int64_t begin,
                                            int64_t end) {
  constexpr int64_t kColumns = 1024;
  alignas(64) A acc[kColumns];
  for (int64_t j0 = begin; j0 < end; j0 += kColumns) {
    const int64_t m = std::min(kColumns, end - j0);
    std::fill(acc, acc + m, A(0));
    for (int64_t c = 0; c < chunks; ++c) {
      const A* row = partial + c * n + j0;
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) acc[j] += row[j];
    }
#pragma omp simd
    for (int64_t j = 0; j < m; ++j) out[j0 + j] = from_acc<W>(acc[j]);
  }
}

// P: the parameters' dtype (and their gradients'); W: how the row loops read them.
template <bool kCentered, bool kSavedOutput, bool kGradRes, typename T, typename X, typename W, typename P>
void run_backward(const BackwardProblem& p, const BackwardOutputs& o) {
  using A = acc_t<T>;
  const AffineParams<W, P, A> params(p, kSavedOutput);
  BackwardArgs<T, X, W> a;
  a.n = p.n;
  a.x = p.input.const_data_ptr<X>();
  a.x_rows = p.rows;
  a.dy = p.grad_output.const_data_ptr<T>();
  a.dy_rows = p.grad_rows;
  if constexpr (kGradRes) {
    a.dh = p.grad_residual_out->const_data_ptr<X>();
    a.dh_rows = p.grad_residual_rows;
  }
  a.w = params.w;
  a.inv_w = params.inv_w;
  a.shift = params.shift;
  if (kCentered) a.mean = p.mean->const_data_ptr<A>();
  a.rstd = p.rstd.const_data_ptr<A>();
  a.dx = o.grad_input.mutable_data_ptr<T>();
  if constexpr (!std::is_same_v<X, T>) a.dres = o.grad_residual->mutable_data_ptr<X>();

  const int64_t n = p.n, rows = p.num_rows;
  const bool want_dw = p.want_grad_weight, want_db = p.want_grad_bias;
  if (!want_dw && !want_db) {
    torch::stable::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      backward_rows<kCentered, kSavedOutput, kGradRes>(a, nullptr, nullptr, begin, end);
    });
    return;
  }
  // Deterministic parameter gradients: a fixed split of the rows into `chunks` (independent of
  // the thread count), one partial sum per chunk, then the partials added in chunk order. At
  // most 64 chunks and about 16 MiB of partial sums, and no more chunks than tasks worth a
  // thread (grain_rows): each chunk costs n partial sums to clear, write and add up, which for
  // a few rows is more than their row loop.
  const int64_t chunks =
      std::clamp<int64_t>(std::min<int64_t>({64, (int64_t(1) << 22) / n, rows / grain_rows(n)}), 1, rows);
  const int64_t num_params = int64_t(want_dw) + int64_t(want_db);
  Tensor partial = empty_like_device(p.input, {num_params, chunks, n}, acc_dtype(p.grad_output.scalar_type()));
  A* dw_part = want_dw ? partial.mutable_data_ptr<A>() : nullptr;
  A* db_part = want_db ? partial.mutable_data_ptr<A>() + (want_dw ? chunks * n : 0) : nullptr;
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      A* dw_acc = want_dw ? dw_part + c * n : nullptr;
      A* db_acc = want_db ? db_part + c * n : nullptr;
      if (dw_acc) std::fill(dw_acc, dw_acc + n, A(0));
      if (db_acc) std::fill(db_acc, db_acc + n, A(0));
      backward_rows<kCentered, kSavedOutput, kGradRes>(a, dw_acc, db_acc, rows * c / chunks,
                                                       rows * (c + 1) / chunks);
    }
  });
  P* dw = want_dw ? o.grad_weight.mutable_data_ptr<P>() : nullptr;
  P* db = want_db ? o.grad_bias->mutable_data_ptr<P>() : nullptr;
  torch::stable::parallel_for(0, n, 4096, [&](int64_t jb, int64_t je) {
    if (dw) sum_partials<A, P>(dw_part, chunks, n, dw, jb, je);
    if (db) sum_partials<A, P>(db_part, chunks, n, db, jb, je);
  });
}

// rms_norm_backward and add_rms_norm_backward (kCentered = false), layer_norm_backward (true):
// fills o.grad_input, o.grad_residual (when present) and the wanted parameter gradients.
template <bool kCentered>
void backward(const BackwardProblem& p, const BackwardOutputs& o, const char* op) {
  if (p.empty()) return;
  check_uncentred_options<kCentered>(p, p.saved_is_output, p.grad_residual_out.has_value(),
                                     p.input.scalar_type() != p.grad_output.scalar_type(), op);
  dispatch_float(p.grad_output.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_params<T>(p, [&](auto wtag, auto ptag) {
      using W = typename decltype(wtag)::type;
      using P = typename decltype(ptag)::type;
      // X: T, or float32 under 16-bit T (add_rms_norm's residual_out)
      dispatch_wider<T, !kCentered>(p.input.scalar_type(), [&](auto xtag) {
        using X = typename decltype(xtag)::type;
        if constexpr (!kCentered) {
          if (p.saved_is_output) {
            // Only rms_norm's backward saves the output, never with a wider X or grad_residual_out.
            if constexpr (std::is_same_v<X, T>)
              if (!p.grad_residual_out) return run_backward<kCentered, true, false, T, X, W, P>(p, o);
            fail(op, ": internal error: saved_is_output with a residual");
          }
          if (p.grad_residual_out) return run_backward<kCentered, false, true, T, X, W, P>(p, o);
        }
        run_backward<kCentered, false, false, T, X, W, P>(p, o);
      });
    });
  });
}

// The backward of add_rms_norm: rms_norm's row loop with the residual's extras (the CUDA
// kernels have separate add kernels; here one loop serves both).
inline void add_backward(const BackwardProblem& p, const BackwardOutputs& o, const char* op) {
  backward<false>(p, o, op);
}

// The kernels as one type, for the registered functions shared by both backends (norm_ops.h).
// Member templates, so that a translation unit compiles only the kernels its functions call.
// Each asks for huge pages under the activation-sized outputs it is about to write
// (cpu_memory.h: faulting a fresh output in 4 KiB pages costs as much as the row loop).
struct Kernels {
  template <bool kCentered>
  static void forward(const Problem& p, const ForwardOutputs& o, const char* op) {
    ::fusedops::cpu::advise_huge_pages(o.out);
    cpu::forward<kCentered>(p, o, op);
  }
  template <bool kCentered>
  static void backward(const BackwardProblem& p, const BackwardOutputs& o, const char* op) {
    advise_grads(o);
    cpu::backward<kCentered>(p, o, op);
  }
  template <typename = void>
  static void add_forward(const AddProblem& p, const ForwardOutputs& o, const char* op) {
    ::fusedops::cpu::advise_huge_pages(o.out);
    if (o.residual_out && o.residual_out->const_data_ptr() != p.residual.const_data_ptr())  // not in place
      ::fusedops::cpu::advise_huge_pages(*o.residual_out);
    cpu::add_forward(p, o, op);
  }
  template <typename = void>
  static void add_backward(const BackwardProblem& p, const BackwardOutputs& o, const char* op) {
    advise_grads(o);
    cpu::add_backward(p, o, op);
  }

 private:
  static void advise_grads(const BackwardOutputs& o) {
    ::fusedops::cpu::advise_huge_pages(o.grad_input);
    if (o.grad_residual) ::fusedops::cpu::advise_huge_pages(*o.grad_residual);
  }
};

}  // namespace
}  // namespace fusedops::norm::cpu
