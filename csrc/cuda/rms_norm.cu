// rms_norm on CUDA.
//
// Forward: a group of TPR threads per row (256 / TPR rows per block). Each thread loads its
// VPT 16-byte vectors of the row into registers at once, the group sums the squares, and the
// same registers are scaled and stored: one read of x, one write of y. TPR and VPT are compile-
// time constants picked from the row width so that each thread keeps about two vectors in
// flight; with every block resident that is what it takes to reach the copy bandwidth.
// Rows wider than 8 vectors x 256 threads (16384 bf16), and inputs that are not 16-byte
// aligned, take a sweeping kernel of the same math that reads the row twice (the second time
// mostly from L2).
//
// Backward: a persistent grid of one wave of resident blocks; each row slot walks a fixed set
// of rows with four vectors per thread in flight (x and grad_output), writes grad_input, and
// keeps its weight-gradient partial in registers. A block adds its slots' partials in a fixed
// order and writes one row of a (blocks, n) buffer, which a second kernel sums over the blocks,
// again in a fixed order: the weight gradient is bitwise reproducible, with no atomics.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include "fusedops/cuda_utils.cuh"
#include "fusedops/rms_norm.h"

namespace fusedops::rms_norm {
namespace {

using namespace fusedops::cuda;

constexpr int kBlock = 256;            // threads per block of the register-caching kernels
constexpr int kMaxVecsPerThread = 8;   // wider rows are swept
constexpr int kSweepThreads = 1024;    // threads per row of the sweeping kernels
constexpr int kForwardVecs = 2;        // vectors per thread the forward aims at
constexpr int kBackwardVecs = 4;       // and the backward (two tensors: eight loads in flight)

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

// TPR threads per row, VPT vectors of VEC elements per thread, kBlock / TPR rows per block.
template <typename T, typename W, int VEC, int TPR, int VPT>
__global__ void __launch_bounds__(kBlock)
    forward_kernel(const T* __restrict__ x, RowLayout rows, const W* __restrict__ w, T* __restrict__ y,
                   acc_t<T>* __restrict__ rstd, int64_t num_rows, int n, acc_t<T> eps) {
  using A = acc_t<T>;
  __shared__ A scratch[kBlock / 32];
  const int lane = threadIdx.x % TPR;
  const int64_t row = int64_t(blockIdx.x) * (kBlock / TPR) + threadIdx.x / TPR;
  const bool active = row < num_rows;
  const T* xr = x + (active ? rows.offset(row) : 0);
  Vec<T, VEC> xv[VPT];
  A ss = 0;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int col = (i * TPR + lane) * VEC;
    if (active && col < n) {
      xv[i] = load_vec<T, VEC>(xr + col);
#pragma unroll
      for (int k = 0; k < VEC; ++k) ss += to_acc(xv[i].v[k]) * to_acc(xv[i].v[k]);
    }
  }
  const A rs = rsqrt_acc(group_sum<TPR>(ss, scratch) / A(n) + eps);
  if (!active) return;  // only after the block's barrier
  if (lane == 0) rstd[row] = rs;
  T* yr = y + row * n;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int col = (i * TPR + lane) * VEC;
    if (col < n) scale_store<T, W, VEC>(yr, xv[i], w, col, rs);
  }
}

// Rows too wide to cache, or unaligned: blockDim.x threads per row, blockDim.y rows per block;
// the row is read twice.
template <typename T, typename W, int VEC>
__global__ void __launch_bounds__(kSweepThreads)
    forward_sweep_kernel(const T* __restrict__ x, RowLayout rows, const W* __restrict__ w, T* __restrict__ y,
                         acc_t<T>* __restrict__ rstd, int64_t num_rows, int64_t n, acc_t<T> eps) {
  using A = acc_t<T>;
  __shared__ A scratch[32 * 8];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < num_rows;
  const T* xr = x + (active ? rows.offset(row) : 0);
  const int64_t step = int64_t(blockDim.x) * VEC;
  A ss = 0;
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

// partial: null (no weight gradient), else one row of n per block.
// Two resident blocks per SM (a register cap of 128) keep enough loads in flight; with 8
// vectors per thread that cap would spill, so those keep one.
template <typename T, typename W, int VEC, int TPR, int VPT>
__global__ void __launch_bounds__(kBlock, VPT <= 4 ? 2 : 1)
    backward_kernel(const T* __restrict__ dy, RowLayout dy_rows, const T* __restrict__ x, RowLayout x_rows,
                    const W* __restrict__ w, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
                    acc_t<T>* __restrict__ partial, int64_t num_rows, int n) {
  using A = acc_t<T>;
  constexpr int kSlots = kBlock / TPR;  // rows in flight per block
  __shared__ A scratch[2][kBlock / 32];
  const int lane = threadIdx.x % TPR, slot = threadIdx.x / TPR;
  const A inv_n = A(1) / A(n);
  A dwp[VPT][VEC];
#pragma unroll
  for (int i = 0; i < VPT; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) dwp[i][k] = 0;
  int parity = 0;
  // `base` is uniform across the block, so every thread meets the same barriers.
  for (int64_t base = int64_t(blockIdx.x) * kSlots; base < num_rows; base += int64_t(gridDim.x) * kSlots) {
    const int64_t row = base + slot;
    const bool active = row < num_rows;
    const T* xr = x + (active ? x_rows.offset(row) : 0);
    const T* gr = dy + (active ? dy_rows.offset(row) : 0);
    Vec<T, VEC> xv[VPT], gv[VPT];
    A dot = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (active && col < n) {
        xv[i] = load_vec<T, VEC>(xr + col);
        gv[i] = load_vec<T, VEC>(gr + col);
      }
    }
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (active && col < n) dot += dot_g_x<T, W, VEC>(xv[i], gv[i], w, col);
    }
    dot = group_sum<TPR>(dot, scratch[parity]);
    parity ^= 1;
    if (!active) continue;
    const A rs = rstd[row];
    const A c = rs * rs * rs * dot * inv_n;
    T* dxr = dx + row * n;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (col < n) grad_input_store<T, W, VEC>(dxr, xv[i], gv[i], w, col, rs, c, dwp[i]);
    }
  }
  if (partial == nullptr) return;
  A* out = partial + int64_t(blockIdx.x) * n;
  if constexpr (kSlots == 1) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (col < n) store_acc<A, VEC>(out + col, dwp[i]);
    }
  } else {
    // Add the slots' partials through shared memory, slot 0 first.
    __shared__ A shared_dw[kBlock * VEC];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      __syncthreads();
#pragma unroll
      for (int k = 0; k < VEC; ++k) shared_dw[threadIdx.x * VEC + k] = dwp[i][k];
      __syncthreads();
      for (int j = threadIdx.x; j < TPR * VEC; j += kBlock) {
        const int col = i * TPR * VEC + j;
        if (col >= n) continue;
        A s = 0;
#pragma unroll
        for (int q = 0; q < kSlots; ++q) s += shared_dw[q * TPR * VEC + j];
        out[col] = s;
      }
    }
  }
}

// The sweeping backward (wide or unaligned rows): blockDim.x threads per row, blockDim.y row
// slots per block, each slot with its own row of `partial`.
template <typename T, typename W, int VEC>
__global__ void __launch_bounds__(kSweepThreads)
    backward_sweep_kernel(const T* __restrict__ dy, RowLayout dy_rows, const T* __restrict__ x, RowLayout x_rows,
                          const W* __restrict__ w, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
                          acc_t<T>* __restrict__ partial, int64_t num_rows, int64_t n) {
  using A = acc_t<T>;
  __shared__ A scratch[32 * 8];
  const int64_t slots = int64_t(gridDim.x) * blockDim.y;
  const int64_t step = int64_t(blockDim.x) * VEC;
  const A inv_n = A(1) / A(n);
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

// How a row is split among threads. vpt > 0: the caching kernels with tpr threads per row and
// vpt vectors per thread; vpt == 0: the sweeping kernels with tpr threads per row.
struct Shape {
  int vec = 1;  // elements per access
  int tpr = 0;
  int vpt = 0;
};

// The caching shape for rows of `nvec` vectors, aiming at `target` vectors per thread: the
// fewest threads per row (from 8, up to a block) that reach it, then as many vectors as needed.
Shape cached_shape(int vec, int64_t nvec, int target) {
  Shape s;
  s.vec = vec;
  if (nvec > int64_t(kBlock) * kMaxVecsPerThread) {
    s.tpr = kSweepThreads;
    return s;
  }
  s.tpr = 8;
  while (s.tpr < kBlock && int64_t(s.tpr) * target < nvec) s.tpr *= 2;
  const int64_t per_thread = (nvec + s.tpr - 1) / s.tpr;
  s.vpt = per_thread <= 1 ? 1 : per_thread <= 2 ? 2 : per_thread <= 4 ? 4 : 8;
  return s;
}

// 16-byte vectors need the base pointers, every row stride and n to be multiples of 16 bytes;
// otherwise a scalar sweep (threads per row: a power of two from 32 to 256 covering the row,
// 256 / tpr rows per block, or 1024 for rows wider than 256 elements).
template <typename T>
Shape make_shape(const Problem& p, const RowLayout& other_rows, const void* other, const void* w, int target) {
  constexpr int kVec = 16 / sizeof(T);
  bool aligned = p.n % kVec == 0 && aligned16(p.input.const_data_ptr()) && aligned16(other) &&
                 (w == nullptr || aligned16(w));
  for (const RowLayout* rl : {&p.rows, &other_rows})
    for (int d = 0; d < rl->ndim; ++d) aligned = aligned && rl->strides[d] % kVec == 0;
  if (aligned) return cached_shape(kVec, (p.n + kVec - 1) / kVec, target);
  Shape s;
  s.tpr = 32;
  while (s.tpr < kBlock && s.tpr < p.n) s.tpr *= 2;
  if (p.n > kBlock) s.tpr = kSweepThreads;
  return s;
}

int sweep_rows_per_block(const Shape& s) { return std::max(1, kBlock / s.tpr); }

// A kernel (or any value) as a type, so that a generic lambda can use it as a template argument.
template <auto V>
struct Constant {
  static constexpr auto value = V;
};

template <int TPR, int VPT>
struct CachedTag {
  static constexpr int tpr = TPR, vpt = VPT;
};

// Calls f(integral_constant VEC, CachedTag<TPR, VPT>) for a caching shape. The lists hold every
// shape cached_shape returns for the forward's and the backward's targets.
template <typename T, typename F, typename... Tags>
void dispatch_cached(const Shape& s, F&& f, Tags... tags) {
  constexpr int kVec = 16 / sizeof(T);
  const bool found = ((s.tpr == Tags::tpr && s.vpt == Tags::vpt ? (f(std::integral_constant<int, kVec>{}, tags), true)
                                                               : false) ||
                      ...);
  STD_TORCH_CHECK(found, "fusedops: no rms_norm kernel for ", s.tpr, " threads x ", s.vpt, " vectors");
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

unsigned grid_size(int64_t blocks) {
  FUSEDOPS_CHECK(blocks < (int64_t(1) << 31), "rms_norm: too many rows (", blocks, " blocks)");
  return unsigned(blocks);
}

// Blocks of `threads` threads of Kernel that fit on one SM at once, asked once per kernel and
// block size (the answer depends on the kernel's registers and shared memory).
template <auto Kernel>
int resident_blocks(int threads) {
  static std::atomic<int> cached[2] = {0, 0};
  std::atomic<int>& r = cached[threads > kBlock ? 1 : 0];
  int v = r.load(std::memory_order_relaxed);
  if (v == 0) {
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, Kernel, threads, 0);
    v = std::max(v, 1);
    r.store(v, std::memory_order_relaxed);
  }
  return v;
}

std::tuple<Tensor, Tensor> rms_norm_cuda(Tensor input, std::optional<Tensor> weight, double eps) {
  const Problem p = forward_problem(input, weight, eps);
  torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  Tensor out, rstd;
  std::tie(out, rstd) = forward_outputs(input);
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
    T* y = reinterpret_cast<T*>(out.mutable_data_ptr());
    A* rs = reinterpret_cast<A*>(rstd.mutable_data_ptr());
    const Shape s = make_shape<T>(p, p.rows, y, w, kForwardVecs);
    if (s.vpt == 0) {
      const int rpb = sweep_rows_per_block(s);
      const auto launch = [&](auto kernel) {
        kernel<<<grid_size((p.num_rows + rpb - 1) / rpb), dim3(s.tpr, rpb), 0, stream>>>(x, p.rows, w, y, rs,
                                                                                       p.num_rows, p.n, A(eps));
      };
      if (s.vec == 1) launch(forward_sweep_kernel<T, W, 1>);
      else launch(forward_sweep_kernel<T, W, 16 / sizeof(T)>);
      return;
    }
    const auto launch = [&](auto vec, auto tag) {
      using Tag = decltype(tag);
      constexpr int kRows = kBlock / Tag::tpr;
      forward_kernel<T, W, decltype(vec)::value, Tag::tpr, Tag::vpt>
          <<<grid_size((p.num_rows + kRows - 1) / kRows), kBlock, 0, stream>>>(x, p.rows, w, y, rs, p.num_rows,
                                                                              int(p.n), A(eps));
    };
    dispatch_cached<T>(s, launch, CachedTag<8, 1>{}, CachedTag<8, 2>{}, CachedTag<16, 2>{}, CachedTag<32, 2>{},
                       CachedTag<64, 2>{}, CachedTag<128, 2>{}, CachedTag<256, 2>{}, CachedTag<256, 4>{},
                       CachedTag<256, 8>{});
  });
  check_launch("rms_norm");
  return {out, rstd};
}

std::tuple<Tensor, Tensor> rms_norm_backward_cuda(Tensor grad_output, Tensor input, std::optional<Tensor> weight,
                                                  Tensor rstd, bool weight_requires_grad) {
  const BackwardProblem p = backward_problem(grad_output, input, weight, rstd, weight_requires_grad);
  torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  Tensor grad_input, grad_weight;
  std::tie(grad_input, grad_weight) = backward_outputs(p, input);
  if (p.empty()) return {grad_input, grad_weight};
  const ScalarType xt = input.scalar_type();
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
    const A* rs = reinterpret_cast<const A*>(p.rstd.const_data_ptr());
    T* dx = reinterpret_cast<T*>(grad_input.mutable_data_ptr());
    const Shape s = make_shape<T>(p, p.grad_rows, g, w, kBackwardVecs);
    const int64_t sms = multiprocessor_count(device);
    // One wave of resident blocks, each walking its rows: as few partial rows to add up as
    // the bandwidth allows.
    const auto run = [&](auto kernel_tag, int64_t blocks_needed, dim3 block, int64_t partials_per_block) {
      constexpr auto kernel = decltype(kernel_tag)::value;
      const int64_t blocks = std::min(blocks_needed, sms * resident_blocks<kernel>(int(block.x * block.y)));
      const int64_t num_partials = blocks * partials_per_block;
      Tensor partial;
      A* partial_ptr = nullptr;
      if (want_dw) {
        partial = empty_like_device(input, {num_partials, p.n}, acc_dtype(xt));
        partial_ptr = reinterpret_cast<A*>(partial.mutable_data_ptr());
      }
      kernel<<<grid_size(blocks), block, 0, stream>>>(g, p.grad_rows, x, p.rows, w, rs, dx, partial_ptr,
                                                      p.num_rows, p.n);
      check_launch("rms_norm_backward");
      if (want_dw) {
        sum_partials_kernel<A, W><<<dim3(unsigned((p.n + 31) / 32)), dim3(32, 8), 0, stream>>>(
            partial_ptr, num_partials, p.n, reinterpret_cast<W*>(grad_weight.mutable_data_ptr()));
        check_launch("rms_norm_backward");
      }
    };
    if (s.vpt == 0) {
      const int rpb = sweep_rows_per_block(s);
      const int64_t needed = (p.num_rows + rpb - 1) / rpb;
      if (s.vec == 1) run(Constant<backward_sweep_kernel<T, W, 1>>{}, needed, dim3(s.tpr, rpb), rpb);
      else run(Constant<backward_sweep_kernel<T, W, 16 / sizeof(T)>>{}, needed, dim3(s.tpr, rpb), rpb);
      return;
    }
    const auto launch = [&](auto vec, auto tag) {
      using Tag = decltype(tag);
      constexpr int kRows = kBlock / Tag::tpr;
      run(Constant<backward_kernel<T, W, decltype(vec)::value, Tag::tpr, Tag::vpt>>{},
          (p.num_rows + kRows - 1) / kRows, dim3(kBlock), 1);
    };
    dispatch_cached<T>(s, launch, CachedTag<8, 1>{}, CachedTag<8, 2>{}, CachedTag<8, 4>{}, CachedTag<16, 4>{},
                       CachedTag<32, 4>{}, CachedTag<64, 4>{}, CachedTag<128, 4>{}, CachedTag<256, 4>{},
                       CachedTag<256, 8>{});
  });
  return {grad_input, grad_weight};
}

}  // namespace
}  // namespace fusedops::rms_norm

STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("rms_norm", TORCH_BOX(&fusedops::rms_norm::rms_norm_cuda));
  m.impl("rms_norm_backward", TORCH_BOX(&fusedops::rms_norm::rms_norm_backward_cuda));
}
