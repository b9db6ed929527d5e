// rms_norm on the CPU: rows in parallel on torch's thread pool, each row in two vectorised
// sweeps (sum of squares, then scale) that the second time read the row from cache. The row
// loops are compiled for several instruction sets and picked at load time (cpu_isa.h).
// Math in float32 (float64 for float64 input).
#include <algorithm>
#include <cmath>
#include <optional>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include "fusedops/cpu_convert.h"
#include "fusedops/cpu_isa.h"
#include "fusedops/rms_norm.h"

namespace fusedops::rms_norm {
namespace {

using cpu::acc_t;
using cpu::from_acc;
using cpu::to_acc;

// Rows per parallel task: enough elements that a task outweighs the pool's overhead.
int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

template <typename T>
acc_t<T> sum_of_squares(const T* x, int64_t n) {
  acc_t<T> ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; ++j) {
    const acc_t<T> v = to_acc(x[j]);
    ss += v * v;
  }
  return ss;
}

// y and rstd of rows [begin, end).
template <typename T, typename W>
FUSEDOPS_CPU_MULTIVERSION void forward_rows(const Problem& p, const T* x, const W* w, T* y, acc_t<T>* rstd,
                                            double eps, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  const int64_t n = p.n;
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + p.rows.offset(r);
    T* yr = y + r * n;
    const A rs = A(1) / std::sqrt(sum_of_squares(xr, n) / A(n) + A(eps));
    rstd[r] = rs;
    if (w != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) yr[j] = from_acc<T>(to_acc(xr[j]) * rs * A(to_acc(w[j])));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) yr[j] = from_acc<T>(to_acc(xr[j]) * rs);
    }
  }
}

template <typename T, typename W>
void forward_kernel(const Problem& p, const T* x, const W* w, T* y, acc_t<T>* rstd, double eps) {
  torch::stable::parallel_for(0, p.num_rows, grain_rows(p.n), [&](int64_t begin, int64_t end) {
    forward_rows<T, W>(p, x, w, y, rstd, eps, begin, end);
  });
}

// grad_input of rows [begin, end); adds each row's grad_output * xhat into dw_acc when given.
template <typename T, typename W>
FUSEDOPS_CPU_MULTIVERSION void backward_rows(const Problem& p, const RowLayout& dy_rows, const T* dy, const T* x, const W* w,
                   const acc_t<T>* rstd, T* dx, acc_t<T>* dw_acc, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  const int64_t n = p.n;
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + p.rows.offset(r);
    const T* dyr = dy + dy_rows.offset(r);
    T* dxr = dx + r * n;
    const A rs = rstd[r];
    // dx = rs * (g - xhat * mean(g * xhat)), g = dy * w, xhat = x * rs
    A dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < n; ++j) {
      const A g = w ? to_acc(dyr[j]) * A(to_acc(w[j])) : to_acc(dyr[j]);
      dot += g * to_acc(xr[j]);
    }
    const A c = rs * rs * rs * dot / A(n);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const A g = w ? to_acc(dyr[j]) * A(to_acc(w[j])) : to_acc(dyr[j]);
      dxr[j] = from_acc<T>(rs * g - c * to_acc(xr[j]));
    }
    if (dw_acc != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) dw_acc[j] += to_acc(dyr[j]) * to_acc(xr[j]) * rs;
    }
  }
}

// dw[j] = sum over c of partial[c, j], c in order, for j in [begin, end).
template <typename A, typename W>
FUSEDOPS_CPU_MULTIVERSION void sum_partials(const A* partial, int64_t chunks, int64_t n, W* dw, int64_t begin,
                                            int64_t end) {
  for (int64_t j = begin; j < end; ++j) {
    A s = 0;
    for (int64_t c = 0; c < chunks; ++c) s += partial[c * n + j];
    dw[j] = from_acc<W>(s);
  }
}

template <typename T, typename W>
void backward_kernel(const Problem& p, const RowLayout& dy_rows, const T* dy, const T* x, const W* w,
                     const acc_t<T>* rstd, T* dx, W* dw, acc_t<T>* partial, int64_t chunks) {
  using A = acc_t<T>;
  const int64_t n = p.n, rows = p.num_rows;
  if (dw == nullptr) {
    torch::stable::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      backward_rows<T, W>(p, dy_rows, dy, x, w, rstd, dx, nullptr, begin, end);
    });
    return;
  }
  // Deterministic weight gradient: a fixed split of the rows into `chunks` (independent of the
  // thread count), one partial sum per chunk, then the partials added in chunk order.
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      A* acc = partial + c * n;
      std::fill(acc, acc + n, A(0));
      backward_rows<T, W>(p, dy_rows, dy, x, w, rstd, dx, acc, rows * c / chunks, rows * (c + 1) / chunks);
    }
  });
  torch::stable::parallel_for(0, n, 4096, [&](int64_t jb, int64_t je) {
    sum_partials<A, W>(partial, chunks, n, dw, jb, je);
  });
}

std::tuple<Tensor, Tensor> rms_norm_cpu(Tensor input, std::optional<Tensor> weight, double eps) {
  const Problem p = forward_problem(input, weight, eps);
  const ScalarType xt = input.scalar_type();
  auto [out, rstd] = forward_outputs(input);
  if (p.num_rows == 0) return {out, rstd};
  dispatch_float(xt, "rms_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    if (p.n == 0) {
      std::fill_n(rstd.mutable_data_ptr<A>(), p.num_rows, A(1) / std::sqrt(A(eps)));
      return;
    }
    const T* x = p.input.const_data_ptr<T>();
    if (!p.weight) {
      forward_kernel<T, T>(p, x, nullptr, out.mutable_data_ptr<T>(), rstd.mutable_data_ptr<A>(), eps);
      return;
    }
    dispatch_weight<T>(p.weight->scalar_type(), [&](auto wtag) {
      using W = typename decltype(wtag)::type;
      forward_kernel<T, W>(p, x, p.weight->const_data_ptr<W>(), out.mutable_data_ptr<T>(),
                           rstd.mutable_data_ptr<A>(), eps);
    });
  });
  return {out, rstd};
}

std::tuple<Tensor, Tensor> rms_norm_backward_cpu(Tensor grad_output, Tensor input, std::optional<Tensor> weight,
                                                 Tensor rstd, bool weight_requires_grad) {
  const BackwardProblem p = backward_problem(grad_output, input, weight, rstd, weight_requires_grad);
  const ScalarType xt = input.scalar_type();
  auto [grad_input, grad_weight] = backward_outputs(p, input);
  if (p.empty()) return {grad_input, grad_weight};
  const bool want_dw = p.want_grad_weight;
  // At most 64 chunks and about 16 MiB of partial sums.
  const int64_t chunks = std::clamp<int64_t>(std::min<int64_t>(64, (int64_t(1) << 22) / p.n), 1, p.num_rows);
  dispatch_float(xt, "rms_norm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* x = p.input.const_data_ptr<T>();
    const T* g = p.grad_output.const_data_ptr<T>();
    const A* rs = p.rstd.const_data_ptr<A>();
    T* dx = grad_input.mutable_data_ptr<T>();
    if (!p.weight) {
      backward_kernel<T, T>(p, p.grad_rows, g, x, nullptr, rs, dx, nullptr, nullptr, 0);
      return;
    }
    dispatch_weight<T>(p.weight->scalar_type(), [&](auto wtag) {
      using W = typename decltype(wtag)::type;
      Tensor partial;
      if (want_dw) partial = empty_like_device(input, {chunks, p.n}, acc_dtype(xt));
      backward_kernel<T, W>(p, p.grad_rows, g, x, p.weight->const_data_ptr<W>(), rs, dx,
                            want_dw ? grad_weight.mutable_data_ptr<W>() : nullptr,
                            want_dw ? partial.mutable_data_ptr<A>() : nullptr, chunks);
    });
  });
  return {grad_input, grad_weight};
}

}  // namespace
}  // namespace fusedops::rms_norm

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  m.impl("rms_norm", TORCH_BOX(&fusedops::rms_norm::rms_norm_cpu));
  m.impl("rms_norm_backward", TORCH_BOX(&fusedops::rms_norm::rms_norm_backward_cpu));
}
