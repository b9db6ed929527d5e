// rms_norm on CUDA.
//
// Forward: one group of `tpr` threads per row (several rows per block for narrow rows). Each
// thread loads its share of the row as 16-byte vectors into registers once, the group sums the
// squares, and the same registers are scaled and stored: one read of x, one write of y. Rows
// wider than 8 vectors x 256 threads (16384 bf16) are swept twice by 1024 threads (the second
// sweep mostly hits L2). Inputs that are not 16-byte aligned take a scalar path of the same shape.
//
// Backward: a persistent grid of one wave of resident blocks; each row slot walks a fixed set
// of rows, writes grad_input, and
// keeps its weight-gradient partial in registers. A block adds its slots' partials in a fixed
// order and writes one row of a (blocks, n) buffer, which a second kernel sums over the blocks,
// again in a fixed order: the weight gradient is bitwise reproducible, with no atomics.
#include <algorithm>
#include <cmath>
#include <optional>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include "fusedops/cuda_utils.cuh"
#include "fusedops/rms_norm.h"

namespace fusedops::rms_norm {
namespace {

using namespace fusedops::cuda;

constexpr int kCachedThreads = 256;    // block size limit of the caching kernels (registers)
constexpr int kSweepThreads = 1024;    // threads per row of the sweeping kernels
constexpr int kTargetVecsPerThread = 4;
constexpr int kMaxVecsPerThread = 8;   // beyond this the row is swept twice
constexpr int kThreadsPerBlock = 256;  // when several rows share a block
constexpr int kMinRowsPerSlot = 16;   // backward: rows per slot before adding more slots

__device__ __forceinline__ float rsqrt_acc(float v) { return rsqrtf(v); }
__device__ __forceinline__ double rsqrt_acc(double v) { return rsqrt(v); }

template <typename T, typename W, int VEC>
__device__ __forceinline__ void scale_store(T* out, const Vec<T, VEC>& xv, const W* w, int64_t col, acc_t<T> rs) {
  using A = acc_t<T>;
  A y[VEC];
  if (w != nullptr) {
    const Vec<W, VEC> wv = load_vec_ldg<W, VEC>(w + col);
#pragma unroll
    for (int k = 0; k < VEC; ++k) y[k] = to_acc(xv.v[k]) * rs * A(to_acc(wv.v[k]));
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) y[k] = to_acc(xv.v[k]) * rs;
  }
  store_from_acc<T, VEC>(out + col, y);
}

// VPT > 0: each thread caches VPT vectors of its row. VPT == 0: two sweeps over the row.
template <typename T, typename W, int VEC, int VPT>
__global__ void __launch_bounds__(VPT > 0 ? kCachedThreads : kSweepThreads)
    forward_kernel(const T* __restrict__ x, RowLayout rows, const W* __restrict__ w, T* __restrict__ y,
                   acc_t<T>* __restrict__ rstd, int64_t num_rows, int64_t n, acc_t<T> eps) {
  using A = acc_t<T>;
  __shared__ A scratch[32 * 8];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < num_rows;
  const T* xr = x + (active ? rows.offset(row) : 0);
  const int64_t step = int64_t(blockDim.x) * VEC;
  A ss = 0;
  if constexpr (VPT > 0) {
    Vec<T, VEC> xv[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int64_t col = i * step + threadIdx.x * VEC;
      if (active && col < n) {
        xv[i] = load_vec<T, VEC>(xr + col);
#pragma unroll
        for (int k = 0; k < VEC; ++k) ss += to_acc(xv[i].v[k]) * to_acc(xv[i].v[k]);
      }
    }
    const A rs = rsqrt_acc(row_sum(ss, scratch) / A(n) + eps);
    if (!active) return;  // only after the block's last barrier
    if (threadIdx.x == 0) rstd[row] = rs;
    T* yr = y + row * n;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int64_t col = i * step + threadIdx.x * VEC;
      if (col < n) scale_store<T, W, VEC>(yr, xv[i], w, col, rs);
    }
  } else {
    if (active) {
      for (int64_t col = threadIdx.x * VEC; col < n; col += step) {
        const Vec<T, VEC> xv = load_vec<T, VEC>(xr + col);
#pragma unroll
        for (int k = 0; k < VEC; ++k) ss += to_acc(xv.v[k]) * to_acc(xv.v[k]);
      }
    }
    const A rs = rsqrt_acc(row_sum(ss, scratch) / A(n) + eps);
    if (!active) return;
    if (threadIdx.x == 0) rstd[row] = rs;
    T* yr = y + row * n;
    for (int64_t col = threadIdx.x * VEC; col < n; col += step)
      scale_store<T, W, VEC>(yr, load_vec<T, VEC>(xr + col), w, col, rs);
  }
}

// One row of grad_input; adds grad_output * xhat into dwp (VEC values) when dwp is given.
template <typename T, typename W, int VEC>
__device__ __forceinline__ void grad_input_store(T* dxr, const Vec<T, VEC>& xv, const Vec<T, VEC>& gv,
                                                 const W* w, int64_t col, acc_t<T> rs, acc_t<T> c,
                                                 acc_t<T>* dwp) {
  using A = acc_t<T>;
  A dxv[VEC];
  Vec<W, VEC> wv;
  if (w != nullptr) wv = load_vec_ldg<W, VEC>(w + col);
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const A xk = to_acc(xv.v[k]), dyk = to_acc(gv.v[k]);
    const A g = w != nullptr ? dyk * A(to_acc(wv.v[k])) : dyk;
    dxv[k] = rs * g - c * xk;
    if (dwp != nullptr) dwp[k] += dyk * xk * rs;
  }
  store_from_acc<T, VEC>(dxr + col, dxv);
}

template <typename T, typename W, int VEC>
__device__ __forceinline__ acc_t<T> dot_g_x(const Vec<T, VEC>& xv, const Vec<T, VEC>& gv, const W* w, int64_t col) {
  using A = acc_t<T>;
  A dot = 0;
  Vec<W, VEC> wv;
  if (w != nullptr) wv = load_vec_ldg<W, VEC>(w + col);
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const A g = w != nullptr ? to_acc(gv.v[k]) * A(to_acc(wv.v[k])) : to_acc(gv.v[k]);
    dot += g * to_acc(xv.v[k]);
  }
  return dot;
}

// partial: null (no weight gradient), else one row of n per block (VPT > 0) or per row slot
// (VPT == 0).
// Two resident blocks per SM (a register cap of 128) keep enough loads in flight; with 8
// vectors per thread that cap would spill, so those keep one.
template <typename T, typename W, int VEC, int VPT>
__global__ void __launch_bounds__(VPT > 0 ? kCachedThreads : kSweepThreads, VPT > 0 && VPT <= 4 ? 2 : 1)
    backward_kernel(const T* __restrict__ dy, RowLayout dy_rows, const T* __restrict__ x, RowLayout x_rows,
                    const W* __restrict__ w, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
                    acc_t<T>* __restrict__ partial, int64_t num_rows, int64_t n) {
  using A = acc_t<T>;
  __shared__ A scratch[32 * 8];
  const int64_t slots = int64_t(gridDim.x) * blockDim.y;
  const int64_t step = int64_t(blockDim.x) * VEC;
  const A inv_n = A(1) / A(n);
  if constexpr (VPT > 0) {
    A dwp[VPT][VEC];
#pragma unroll
    for (int i = 0; i < VPT; ++i)
#pragma unroll
      for (int k = 0; k < VEC; ++k) dwp[i][k] = 0;
    // `base` is uniform across the block, so every thread meets the same barriers.
    for (int64_t base = int64_t(blockIdx.x) * blockDim.y; base < num_rows; base += slots) {
      const int64_t row = base + threadIdx.y;
      const bool active = row < num_rows;
      const T* xr = x + (active ? x_rows.offset(row) : 0);
      const T* gr = dy + (active ? dy_rows.offset(row) : 0);
      Vec<T, VEC> xv[VPT], gv[VPT];
      A dot = 0;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int64_t col = i * step + threadIdx.x * VEC;
        if (active && col < n) {
          xv[i] = load_vec<T, VEC>(xr + col);
          gv[i] = load_vec<T, VEC>(gr + col);
          dot += dot_g_x<T, W, VEC>(xv[i], gv[i], w, col);
        }
      }
      dot = row_sum(dot, scratch);
      if (!active) continue;
      const A rs = rstd[row];
      const A c = rs * rs * rs * dot * inv_n;
      T* dxr = dx + row * n;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int64_t col = i * step + threadIdx.x * VEC;
        if (col < n) grad_input_store<T, W, VEC>(dxr, xv[i], gv[i], w, col, rs, c, dwp[i]);
      }
    }
    if (partial == nullptr) return;
    A* out = partial + int64_t(blockIdx.x) * n;
    if (blockDim.y == 1) {
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int64_t col = i * step + threadIdx.x * VEC;
        if (col < n)
#pragma unroll
          for (int k = 0; k < VEC; ++k) out[col + k] = dwp[i][k];
      }
      return;
    }
    // Several row slots in this block (then blockDim.x * blockDim.y == kThreadsPerBlock): add
    // their partials through shared memory, slot 0 first.
    __shared__ A shared_dw[kThreadsPerBlock * VEC];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      __syncthreads();
#pragma unroll
      for (int k = 0; k < VEC; ++k) shared_dw[(threadIdx.y * blockDim.x + threadIdx.x) * VEC + k] = dwp[i][k];
      __syncthreads();
      for (int j = threadIdx.y * blockDim.x + threadIdx.x; j < blockDim.x * VEC; j += blockDim.x * blockDim.y) {
        const int64_t col = i * step + j;
        if (col >= n) continue;
        A s = 0;
        for (int yy = 0; yy < blockDim.y; ++yy) s += shared_dw[yy * blockDim.x * VEC + j];
        out[col] = s;
      }
    }
  } else {
    const int64_t slot = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
    A* prow = partial != nullptr ? partial + slot * n : nullptr;
    if (prow != nullptr)
      for (int64_t col = threadIdx.x * VEC; col < n; col += step)
#pragma unroll
        for (int k = 0; k < VEC; ++k) prow[col + k] = 0;
    for (int64_t base = int64_t(blockIdx.x) * blockDim.y; base < num_rows; base += slots) {
      const int64_t row = base + threadIdx.y;
      const bool active = row < num_rows;
      const T* xr = x + (active ? x_rows.offset(row) : 0);
      const T* gr = dy + (active ? dy_rows.offset(row) : 0);
      A dot = 0;
      if (active)
        for (int64_t col = threadIdx.x * VEC; col < n; col += step)
          dot += dot_g_x<T, W, VEC>(load_vec<T, VEC>(xr + col), load_vec<T, VEC>(gr + col), w, col);
      dot = row_sum(dot, scratch);
      if (!active) continue;
      const A rs = rstd[row];
      const A c = rs * rs * rs * dot * inv_n;
      T* dxr = dx + row * n;
      for (int64_t col = threadIdx.x * VEC; col < n; col += step)
        grad_input_store<T, W, VEC>(dxr, load_vec<T, VEC>(xr + col), load_vec<T, VEC>(gr + col), w, col, rs, c,
                                    prow != nullptr ? prow + col : nullptr);
    }
  }
}

// dw[j] = sum over p of partial[p, j], in the order p = 0, 1, ... (per column thread group,
// then the groups in order): reproducible.
template <typename A, typename W>
__global__ void __launch_bounds__(256) sum_partials_kernel(const A* __restrict__ partial, int64_t num_partials,
                                                           int64_t n, W* __restrict__ dw) {
  __shared__ A sums[8][33];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  A s = 0;
  if (col < n)
    for (int64_t p = threadIdx.y; p < num_partials; p += 8) s += partial[p * n + col];
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || col >= n) return;
  A total = 0;
  for (int yy = 0; yy < 8; ++yy) total += sums[yy][threadIdx.x];
  dw[col] = from_acc<W>(total);
}

struct Plan {
  int vec;     // elements per access
  int tpr;     // threads per row
  int rpb;     // rows per block
  int vpt;     // vectors cached per thread; 0 = swept twice
  int64_t blocks;
};

template <typename T, typename W>
Plan make_plan(const Problem& p, const RowLayout& other_rows, const void* x, const void* other, const void* w) {
  constexpr int kVec = 16 / sizeof(T);
  bool aligned = p.n % kVec == 0 && aligned16(x) && aligned16(other) && (w == nullptr || aligned16(w));
  for (const RowLayout* rl : {&p.rows, &other_rows})
    for (int d = 0; d < rl->ndim; ++d) aligned = aligned && rl->strides[d] % kVec == 0;
  Plan plan;
  plan.vec = aligned ? kVec : 1;
  const int64_t nvec = (p.n + plan.vec - 1) / plan.vec;
  plan.tpr = 32;
  while (plan.tpr < kCachedThreads && int64_t(plan.tpr) * kTargetVecsPerThread < nvec) plan.tpr *= 2;
  const int64_t per_thread = (nvec + plan.tpr - 1) / plan.tpr;
  plan.vpt = per_thread <= 1 ? 1 : per_thread <= 2 ? 2 : per_thread <= 4 ? 4 : per_thread <= kMaxVecsPerThread ? 8 : 0;
  if (!aligned) plan.vpt = 0;  // the scalar fallback only sweeps
  if (plan.vpt == 0 && per_thread > kMaxVecsPerThread) plan.tpr = kSweepThreads;
  plan.rpb = std::max(1, kThreadsPerBlock / plan.tpr);
  plan.blocks = (p.num_rows + plan.rpb - 1) / plan.rpb;
  FUSEDOPS_CHECK(plan.blocks < (int64_t(1) << 31), "rms_norm: too many rows (", p.num_rows, ")");
  return plan;
}

// Calls f(std::integral_constant<int, VEC>, std::integral_constant<int, VPT>) for the plan.
template <typename T, typename F>
void dispatch_plan(const Plan& plan, F&& f) {
  constexpr int kVec = 16 / sizeof(T);
  using std::integral_constant;
  if (plan.vec == 1) return f(integral_constant<int, 1>{}, integral_constant<int, 0>{});
  switch (plan.vpt) {
    case 1: return f(integral_constant<int, kVec>{}, integral_constant<int, 1>{});
    case 2: return f(integral_constant<int, kVec>{}, integral_constant<int, 2>{});
    case 4: return f(integral_constant<int, kVec>{}, integral_constant<int, 4>{});
    case 8: return f(integral_constant<int, kVec>{}, integral_constant<int, 8>{});
    default: return f(integral_constant<int, kVec>{}, integral_constant<int, 0>{});
  }
}

// Calls f(TypeTag<device T>{}, TypeTag<device W>{}) for input's dtype and weight's (T when absent).
template <typename F>
void dispatch_types(const Problem& p, const char* op, F&& f) {
  dispatch_float(p.input.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (p.weight && p.weight->scalar_type() != p.input.scalar_type()) {
      if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>)
        return f(TypeTag<device_t<T>>{}, TypeTag<float>{});
    }
    return f(TypeTag<device_t<T>>{}, TypeTag<device_t<T>>{});
  });
}

template <typename W>
const W* weight_ptr(const Problem& p) {
  return p.weight ? reinterpret_cast<const W*>(p.weight->const_data_ptr()) : nullptr;
}

std::tuple<Tensor, Tensor> rms_norm_cuda(Tensor input, std::optional<Tensor> weight, double eps) {
  const Problem p = forward_problem(input, weight, eps);
  torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  const ScalarType xt = input.scalar_type();
  auto [out, rstd] = forward_outputs(input);
  if (p.num_rows == 0) return {out, rstd};
  if (p.n == 0) {
    torch::stable::fill_(rstd, 1.0 / std::sqrt(eps));
    return {out, rstd};
  }
  const cudaStream_t stream = current_stream(input.get_device_index());
  dispatch_types(p, "rms_norm", [&](auto ttag, auto wtag) {
    using T = typename decltype(ttag)::type;
    using W = typename decltype(wtag)::type;
    using A = acc_t<T>;
    const T* x = reinterpret_cast<const T*>(p.input.const_data_ptr());
    const W* w = weight_ptr<W>(p);
    const Plan plan = make_plan<T, W>(p, p.rows, x, out.const_data_ptr(), w);
    dispatch_plan<T>(plan, [&](auto vec, auto vpt) {
      forward_kernel<T, W, decltype(vec)::value, decltype(vpt)::value>
          <<<dim3(unsigned(plan.blocks)), dim3(plan.tpr, plan.rpb), 0, stream>>>(
              x, p.rows, w, reinterpret_cast<T*>(out.mutable_data_ptr()),
              reinterpret_cast<A*>(rstd.mutable_data_ptr()), p.num_rows, p.n, A(eps));
    });
  });
  check_launch("rms_norm");
  return {out, rstd};
}

std::tuple<Tensor, Tensor> rms_norm_backward_cuda(Tensor grad_output, Tensor input, std::optional<Tensor> weight,
                                                  Tensor rstd, bool weight_requires_grad) {
  const BackwardProblem p = backward_problem(grad_output, input, weight, rstd, weight_requires_grad);
  torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  const ScalarType xt = input.scalar_type();
  auto [grad_input, grad_weight] = backward_outputs(p, input);
  if (p.empty()) return {grad_input, grad_weight};
  const bool want_dw = p.want_grad_weight;
  const int32_t device = input.get_device_index();
  const cudaStream_t stream = current_stream(device);
  dispatch_types(p, "rms_norm_backward", [&](auto ttag, auto wtag) {
    using T = typename decltype(ttag)::type;
    using W = typename decltype(wtag)::type;
    using A = acc_t<T>;
    const T* x = reinterpret_cast<const T*>(p.input.const_data_ptr());
    const T* g = reinterpret_cast<const T*>(p.grad_output.const_data_ptr());
    const W* w = weight_ptr<W>(p);
    Tensor partial;
    A* partial_ptr = nullptr;
    int64_t num_partials = 0;
    const Plan plan = make_plan<T, W>(p, p.grad_rows, x, g, w);
    const int64_t sms = multiprocessor_count(device);
    dispatch_plan<T>(plan, [&](auto vec, auto vpt) {
      const auto kernel = backward_kernel<T, W, decltype(vec)::value, decltype(vpt)::value>;
      // One wave of resident blocks, each walking its rows (fewer blocks: fewer partial rows
      // to add up), but no more blocks than give each row slot kMinRowsPerSlot rows.
      static const int resident = [&] {
        int r = 0;
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r, kernel, plan.tpr * plan.rpb, 0);
        return std::max(r, 1);
      }();
      const int64_t slots_wanted = (p.num_rows + kMinRowsPerSlot - 1) / kMinRowsPerSlot;
      const int64_t blocks = std::min({plan.blocks, sms * resident,
                                       std::max(sms, (slots_wanted + plan.rpb - 1) / plan.rpb)});
      num_partials = plan.vpt > 0 ? blocks : blocks * plan.rpb;
      if (want_dw) {
        partial = empty_like_device(input, {num_partials, p.n}, acc_dtype(xt));
        partial_ptr = reinterpret_cast<A*>(partial.mutable_data_ptr());
      }
      kernel<<<dim3(unsigned(blocks)), dim3(plan.tpr, plan.rpb), 0, stream>>>(
          g, p.grad_rows, x, p.rows, w, reinterpret_cast<const A*>(p.rstd.const_data_ptr()),
          reinterpret_cast<T*>(grad_input.mutable_data_ptr()), partial_ptr, p.num_rows, p.n);
    });
    check_launch("rms_norm_backward");
    if (want_dw) {
      sum_partials_kernel<A, W><<<dim3(unsigned((p.n + 31) / 32)), dim3(32, 8), 0, stream>>>(
          partial_ptr, num_partials, p.n, reinterpret_cast<W*>(grad_weight.mutable_data_ptr()));
      check_launch("rms_norm_backward");
    }
  });
  return {grad_input, grad_weight};
}

}  // namespace
}  // namespace fusedops::rms_norm

STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("rms_norm", TORCH_BOX(&fusedops::rms_norm::rms_norm_cuda));
  m.impl("rms_norm_backward", TORCH_BOX(&fusedops::rms_norm::rms_norm_backward_cuda));
}
