// The CUDA kernels of the row normalisations, generic over centring: rms_norm (kCentered =
// false) and layer_norm (kCentered = true, with a bias).
//
// Forward: a group of TPR threads per row (256 / TPR rows per block). Each thread loads its
// VPT 16-byte vectors of the row into registers at once, the group reduces the statistics
// (layer_norm: the mean, then the squared deviations from it, both from registers), and the
// same registers are normalised and stored: one read of x, one write of y. TPR and VPT are
// compile-time constants picked from the row width so that each thread keeps about two vectors
// in flight; with every block resident that is what it takes to reach the copy bandwidth.
// Rows wider than 8 vectors x 256 threads (16384 bf16), and inputs that are not 16-byte
// aligned, take a sweeping kernel of the same math that reads the row again for each statistic
// (mostly from L2).
//
// Backward: a persistent grid of one wave of resident blocks; each row slot walks a fixed set
// of rows with four vectors per thread in flight (x and grad_output), writes grad_input, and
// keeps its parameter-gradient partials in registers. A block adds its slots' partials in a
// fixed order and writes one row of a (blocks, n) buffer per parameter, which a second kernel
// sums over the blocks, again in a fixed order: the parameter gradients are bitwise
// reproducible, with no atomics.
//
// Everything here has internal linkage: each op's translation unit instantiates what it uses.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>

#include <torch/csrc/stable/ops.h>

#include "fusedops/cuda_utils.cuh"
#include "fusedops/norm.h"

namespace fusedops::norm::cuda {
namespace {

using namespace fusedops::cuda;

constexpr int kBlock = 256;            // threads per block of the register-caching kernels
constexpr int kMaxVecsPerThread = 8;   // wider rows are swept
constexpr int kSweepThreads = 1024;    // threads per row of the sweeping kernels
constexpr int kForwardVecs = 2;        // vectors per thread the forward aims at
// and the backward (of x and of grad_output: twice as many loads in flight). layer_norm keeps
// a second register partial (the bias gradient's) and its mean: at four vectors a thread would
// need more than the 128 registers that two resident blocks per SM allow.
constexpr int backward_vecs(bool centered) { return centered ? 2 : 4; }

__device__ __forceinline__ float rsqrt_acc(float v) { return rsqrtf(v); }
__device__ __forceinline__ double rsqrt_acc(double v) { return rsqrt(v); }

// The pointers of one forward.
template <typename T, typename W>
struct ForwardArgs {
  const T* __restrict__ x;
  const W* __restrict__ w;  // null: no weight
  const W* __restrict__ b;  // null: no bias
  T* __restrict__ y;
  acc_t<T>* __restrict__ mean;  // layer_norm only
  acc_t<T>* __restrict__ rstd;
};

// Normalises VEC values of a row and stores them: (x - mu) * rs * w + b.
template <typename T, typename W, int VEC>
__device__ __forceinline__ void normalize_store(T* out, const Vec<T, VEC>& xv, const W* w, const W* b, int64_t col,
                                                acc_t<T> mu, acc_t<T> rs) {
  using A = acc_t<T>;
  A y[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) y[k] = (to_acc(xv.v[k]) - mu) * rs;
  if (w != nullptr) {
    const Vec<W, VEC> wv = load_vec_ldg<W, VEC>(w + col);
#pragma unroll
    for (int k = 0; k < VEC; ++k) y[k] *= A(to_acc(wv.v[k]));
  }
  if (b != nullptr) {
    const Vec<W, VEC> bv = load_vec_ldg<W, VEC>(b + col);
#pragma unroll
    for (int k = 0; k < VEC; ++k) y[k] += A(to_acc(bv.v[k]));
  }
  store_from_acc<T, VEC>(out + col, y);
}

template <typename T, int VEC>
__device__ __forceinline__ acc_t<T> vec_sum(const Vec<T, VEC>& v, acc_t<T> mu, bool squared) {
  acc_t<T> s = 0;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const acc_t<T> d = to_acc(v.v[k]) - mu;
    s += squared ? d * d : d;
  }
  return s;
}

// TPR threads per row, VPT vectors of VEC elements per thread, kBlock / TPR rows per block.
template <bool kCentered, typename T, typename W, int VEC, int TPR, int VPT>
__global__ void __launch_bounds__(kBlock)
    forward_kernel(ForwardArgs<T, W> a, RowLayout rows, int64_t num_rows, int n, acc_t<T> eps) {
  using A = acc_t<T>;
  __shared__ A scratch[2][kBlock / 32];
  const int lane = threadIdx.x % TPR;
  const int64_t row = int64_t(blockIdx.x) * (kBlock / TPR) + threadIdx.x / TPR;
  const bool active = row < num_rows;
  const T* xr = a.x + (active ? rows.offset(row) : 0);
  Vec<T, VEC> xv[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int col = (i * TPR + lane) * VEC;
    if (active && col < n) xv[i] = load_vec<T, VEC>(xr + col);
  }
  A mu = 0;
  if constexpr (kCentered) {
    A s = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i)
      if (active && (i * TPR + lane) * VEC < n) s += vec_sum<T, VEC>(xv[i], A(0), false);
    mu = group_sum<TPR>(s, scratch[1]) / A(n);
  }
  A ss = 0;
#pragma unroll
  for (int i = 0; i < VPT; ++i)
    if (active && (i * TPR + lane) * VEC < n) ss += vec_sum<T, VEC>(xv[i], mu, true);
  const A rs = rsqrt_acc(group_sum<TPR>(ss, scratch[0]) / A(n) + eps);
  if (!active) return;  // only after the block's barriers
  if (lane == 0) {
    a.rstd[row] = rs;
    if constexpr (kCentered) a.mean[row] = mu;
  }
  T* yr = a.y + row * n;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int col = (i * TPR + lane) * VEC;
    if (col < n) normalize_store<T, W, VEC>(yr, xv[i], a.w, a.b, col, mu, rs);
  }
}

// Rows too wide to cache, or unaligned: blockDim.x threads per row, blockDim.y rows per block;
// the row is read once per statistic and once more to normalise.
template <bool kCentered, typename T, typename W, int VEC>
__global__ void __launch_bounds__(kSweepThreads)
    forward_sweep_kernel(ForwardArgs<T, W> a, RowLayout rows, int64_t num_rows, int64_t n, acc_t<T> eps) {
  using A = acc_t<T>;
  __shared__ A scratch[32 * 8];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < num_rows;
  const T* xr = a.x + (active ? rows.offset(row) : 0);
  const int64_t step = int64_t(blockDim.x) * VEC;
  A mu = 0;
  if constexpr (kCentered) {
    A s = 0;
    if (active)
      for (int64_t col = threadIdx.x * VEC; col < n; col += step) s += vec_sum<T, VEC>(load_vec<T, VEC>(xr + col), A(0), false);
    mu = row_sum(s, scratch) / A(n);
  }
  A ss = 0;
  if (active)
    for (int64_t col = threadIdx.x * VEC; col < n; col += step) ss += vec_sum<T, VEC>(load_vec<T, VEC>(xr + col), mu, true);
  const A rs = rsqrt_acc(row_sum(ss, scratch) / A(n) + eps);
  if (!active) return;
  if (threadIdx.x == 0) {
    a.rstd[row] = rs;
    if constexpr (kCentered) a.mean[row] = mu;
  }
  T* yr = a.y + row * n;
  for (int64_t col = threadIdx.x * VEC; col < n; col += step)
    normalize_store<T, W, VEC>(yr, load_vec<T, VEC>(xr + col), a.w, a.b, col, mu, rs);
}

// The pointers of one backward. Partials: null when that gradient is not wanted, else one row
// of n per block (per row slot for the sweeping kernel).
template <typename T, typename W>
struct BackwardArgs {
  const T* __restrict__ dy;
  const T* __restrict__ x;
  const W* __restrict__ w;
  const acc_t<T>* __restrict__ mean;  // layer_norm only
  const acc_t<T>* __restrict__ rstd;
  T* __restrict__ dx;
  acc_t<T>* __restrict__ dw_partial;
  acc_t<T>* __restrict__ db_partial;
};

// The row sums the backward needs from VEC values: sum(g * (x - mu)) and, with K = 2 (centred),
// sum(g); g = dy * w.
template <typename T, typename W, int VEC, int K>
__device__ __forceinline__ void add_row_sums(acc_t<T> (&sums)[K], const Vec<T, VEC>& xv, const Vec<T, VEC>& gv,
                                             const W* w, int64_t col, acc_t<T> mu) {
  using A = acc_t<T>;
  Vec<W, VEC> wv;
  if (w != nullptr) wv = load_vec_ldg<W, VEC>(w + col);
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const A g = w != nullptr ? to_acc(gv.v[k]) * A(to_acc(wv.v[k])) : to_acc(gv.v[k]);
    sums[0] += g * (to_acc(xv.v[k]) - mu);
    if constexpr (K > 1) sums[1] += g;
  }
}

// VEC values of grad_input: rs * (g - c0 - c1 * (x - mu)); adds dy * xhat into dwp and, with
// kBias, dy into dbp. The partials are always accumulated (a few FMAs) rather than behind a
// runtime pointer test, which would push the register arrays they live in to local memory.
template <bool kBias, typename T, typename W, int VEC>
__device__ __forceinline__ void grad_input_store(T* dxr, const Vec<T, VEC>& xv, const Vec<T, VEC>& gv, const W* w,
                                                 int64_t col, acc_t<T> mu, acc_t<T> rs, acc_t<T> c0, acc_t<T> c1,
                                                 acc_t<T> (&dwp)[VEC], acc_t<T> (&dbp)[VEC]) {
  using A = acc_t<T>;
  A dxv[VEC];
  Vec<W, VEC> wv;
  if (w != nullptr) wv = load_vec_ldg<W, VEC>(w + col);
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const A xc = to_acc(xv.v[k]) - mu, dyk = to_acc(gv.v[k]);
    const A g = w != nullptr ? dyk * A(to_acc(wv.v[k])) : dyk;
    dxv[k] = rs * (g - c0 - c1 * xc);
    dwp[k] += dyk * (xc * rs);
    if constexpr (kBias) dbp[k] += dyk;
  }
  store_from_acc<T, VEC>(dxr + col, dxv);
}

// Writes this block's partial row of one parameter gradient: the slots' register partials
// added through shared memory, slot 0 first.
template <typename A, int VEC, int TPR, int VPT>
__device__ __forceinline__ void store_block_partial(A* out, const A (&part)[VPT][VEC], A* shared, int n) {
  constexpr int kSlots = kBlock / TPR;
  const int lane = threadIdx.x % TPR;
  if constexpr (kSlots == 1) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (col < n) store_acc<A, VEC>(out + col, part[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      __syncthreads();
#pragma unroll
      for (int k = 0; k < VEC; ++k) shared[threadIdx.x * VEC + k] = part[i][k];
      __syncthreads();
      for (int j = threadIdx.x; j < TPR * VEC; j += kBlock) {
        const int col = i * TPR * VEC + j;
        if (col >= n) continue;
        A s = 0;
#pragma unroll
        for (int q = 0; q < kSlots; ++q) s += shared[q * TPR * VEC + j];
        out[col] = s;
      }
    }
  }
}

// Two resident blocks per SM (a register cap of 128) keep enough loads in flight; with more
// vectors per thread than the backward aims at, that cap would spill, so those keep one.
template <bool kCentered, typename T, typename W, int VEC, int TPR, int VPT>
__global__ void __launch_bounds__(kBlock, VPT <= backward_vecs(kCentered) ? 2 : 1)
    backward_kernel(BackwardArgs<T, W> a, RowLayout dy_rows, RowLayout x_rows, int64_t num_rows, int n) {
  using A = acc_t<T>;
  constexpr int kSlots = kBlock / TPR;  // rows in flight per block
  constexpr int kSums = kCentered ? 2 : 1;
  __shared__ A scratch[2][kSums * kBlock / 32];
  const int lane = threadIdx.x % TPR, slot = threadIdx.x / TPR;
  const A inv_n = A(1) / A(n);
  const bool want_dw = a.dw_partial != nullptr, want_db = kCentered && a.db_partial != nullptr;
  A dwp[VPT][VEC], dbp[kCentered ? VPT : 1][VEC];
#pragma unroll
  for (int i = 0; i < VPT; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) dwp[i][k] = 0;
#pragma unroll
  for (int i = 0; i < (kCentered ? VPT : 1); ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) dbp[i][k] = 0;
  int parity = 0;
  // `base` is uniform across the block, so every thread meets the same barriers.
  for (int64_t base = int64_t(blockIdx.x) * kSlots; base < num_rows; base += int64_t(gridDim.x) * kSlots) {
    const int64_t row = base + slot;
    const bool active = row < num_rows;
    const T* xr = a.x + (active ? x_rows.offset(row) : 0);
    const T* gr = a.dy + (active ? dy_rows.offset(row) : 0);
    Vec<T, VEC> xv[VPT], gv[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (active && col < n) {
        xv[i] = load_vec<T, VEC>(xr + col);
        gv[i] = load_vec<T, VEC>(gr + col);
      }
    }
    const A mu = kCentered && active ? a.mean[row] : A(0);
    A sums[kSums] = {};
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (active && col < n) add_row_sums<T, W, VEC>(sums, xv[i], gv[i], a.w, col, mu);
    }
    group_sum<TPR>(sums, scratch[parity]);
    parity ^= 1;
    if (!active) continue;
    const A rs = a.rstd[row];
    const A c1 = sums[0] * inv_n * rs * rs;
    const A c0 = kCentered ? sums[kSums - 1] * inv_n : A(0);
    T* dxr = a.dx + row * n;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (col < n)
        grad_input_store<kCentered, T, W, VEC>(dxr, xv[i], gv[i], a.w, col, mu, rs, c0, c1, dwp[i],
                                               dbp[kCentered ? i : 0]);
    }
  }
  if (!want_dw && !want_db) return;
  __shared__ A shared[kBlock / TPR > 1 ? kBlock * VEC : 1];
  if (want_dw) store_block_partial<A, VEC, TPR, VPT>(a.dw_partial + int64_t(blockIdx.x) * n, dwp, shared, n);
  if constexpr (kCentered)
    if (want_db) store_block_partial<A, VEC, TPR, VPT>(a.db_partial + int64_t(blockIdx.x) * n, dbp, shared, n);
}

// The sweeping backward (wide or unaligned rows): blockDim.x threads per row, blockDim.y row
// slots per block, each slot with its own row of each partial buffer.
template <bool kCentered, typename T, typename W, int VEC>
__global__ void __launch_bounds__(kSweepThreads)
    backward_sweep_kernel(BackwardArgs<T, W> a, RowLayout dy_rows, RowLayout x_rows, int64_t num_rows, int64_t n) {
  using A = acc_t<T>;
  __shared__ A scratch[32 * 8];
  const int64_t slots = int64_t(gridDim.x) * blockDim.y;
  const int64_t step = int64_t(blockDim.x) * VEC;
  const A inv_n = A(1) / A(n);
  const int64_t slot = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  A* dw_row = a.dw_partial != nullptr ? a.dw_partial + slot * n : nullptr;
  A* db_row = a.db_partial != nullptr ? a.db_partial + slot * n : nullptr;
  A* partial_rows[2] = {dw_row, db_row};
  for (A* prow : partial_rows)
    if (prow != nullptr)
      for (int64_t col = threadIdx.x * VEC; col < n; col += step)
#pragma unroll
        for (int k = 0; k < VEC; ++k) prow[col + k] = 0;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.y; base < num_rows; base += slots) {
    const int64_t row = base + threadIdx.y;
    const bool active = row < num_rows;
    const T* xr = a.x + (active ? x_rows.offset(row) : 0);
    const T* gr = a.dy + (active ? dy_rows.offset(row) : 0);
    const A mu = kCentered && active ? a.mean[row] : A(0);
    A sums[kCentered ? 2 : 1] = {};
    if (active)
      for (int64_t col = threadIdx.x * VEC; col < n; col += step)
        add_row_sums<T, W, VEC>(sums, load_vec<T, VEC>(xr + col), load_vec<T, VEC>(gr + col), a.w, col, mu);
    sums[0] = row_sum(sums[0], scratch);
    if constexpr (kCentered) sums[1] = row_sum(sums[1], scratch);
    if (!active) continue;
    const A rs = a.rstd[row];
    const A c1 = sums[0] * inv_n * rs * rs;
    A c0 = 0;
    if constexpr (kCentered) c0 = sums[1] * inv_n;
    T* dxr = a.dx + row * n;
    for (int64_t col = threadIdx.x * VEC; col < n; col += step) {
      A dwp[VEC] = {}, dbp[VEC] = {};
      grad_input_store<kCentered, T, W, VEC>(dxr, load_vec<T, VEC>(xr + col), load_vec<T, VEC>(gr + col), a.w, col,
                                             mu, rs, c0, c1, dwp, dbp);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        if (dw_row != nullptr) dw_row[col + k] += dwp[k];
        if (db_row != nullptr) db_row[col + k] += dbp[k];
      }
    }
  }
}

// out[j] = sum over p of partial[p, j], in the order p = 0, 1, ... (per column thread group,
// then the groups in order): reproducible.
template <typename A, typename W>
__global__ void __launch_bounds__(256) sum_partials_kernel(const A* __restrict__ partial, int64_t num_partials,
                                                           int64_t n, W* __restrict__ out) {
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
  out[col] = from_acc<W>(total);
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
Shape make_shape(const Problem& p, const RowLayout& other_rows, const void* other, int target) {
  constexpr int kVec = 16 / sizeof(T);
  bool aligned = p.n % kVec == 0 && aligned16(p.input.const_data_ptr()) && aligned16(other);
  for (const std::optional<Tensor>* param : {&p.weight, &p.bias})
    aligned = aligned && (!*param || aligned16((*param)->const_data_ptr()));
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

template <typename... Tags>
struct ShapeList {};

// Every shape cached_shape returns for a target of 2 and of 4 vectors per thread.
template <int kTarget>
using CachedShapes = std::conditional_t<
    kTarget == 2,
    ShapeList<CachedTag<8, 1>, CachedTag<8, 2>, CachedTag<16, 2>, CachedTag<32, 2>, CachedTag<64, 2>,
              CachedTag<128, 2>, CachedTag<256, 2>, CachedTag<256, 4>, CachedTag<256, 8>>,
    ShapeList<CachedTag<8, 1>, CachedTag<8, 2>, CachedTag<8, 4>, CachedTag<16, 4>, CachedTag<32, 4>,
              CachedTag<64, 4>, CachedTag<128, 4>, CachedTag<256, 4>, CachedTag<256, 8>>>;

// Calls f(integral_constant VEC, CachedTag<TPR, VPT>) for a caching shape of the list.
template <typename T, typename F, typename... Tags>
void dispatch_cached(const Shape& s, const char* op, F&& f, ShapeList<Tags...>) {
  constexpr int kVec = 16 / sizeof(T);
  const bool found = ((s.tpr == Tags::tpr && s.vpt == Tags::vpt ? (f(std::integral_constant<int, kVec>{}, Tags{}), true)
                                                               : false) ||
                      ...);
  STD_TORCH_CHECK(found, "fusedops: no ", op, " kernel for ", s.tpr, " threads x ", s.vpt, " vectors");
}

// Calls f(TypeTag<device T>{}, TypeTag<device W>{}) for input's dtype and the parameters'.
template <typename F>
void dispatch_types(const Problem& p, const char* op, F&& f) {
  dispatch_float(p.input.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) {
      if (p.param_dtype() == ScalarType::Float) return f(TypeTag<device_t<T>>{}, TypeTag<float>{});
    }
    return f(TypeTag<device_t<T>>{}, TypeTag<device_t<T>>{});
  });
}

template <typename W>
const W* param_ptr(const std::optional<Tensor>& t) {
  return t ? reinterpret_cast<const W*>(t->const_data_ptr()) : nullptr;
}

template <typename A>
A* data_or_null(const std::optional<Tensor>& t) {
  return t ? reinterpret_cast<A*>(t->mutable_data_ptr()) : nullptr;
}

unsigned grid_size(const char* op, int64_t blocks) {
  FUSEDOPS_CHECK(blocks < (int64_t(1) << 31), op, ": too many rows (", blocks, " blocks)");
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

// The outputs of a forward: y, mean (layer_norm) and rstd.
template <bool kCentered>
std::tuple<Tensor, std::optional<Tensor>, Tensor> forward(const char* op, const Tensor& input,
                                                          const std::optional<Tensor>& weight,
                                                          const std::optional<Tensor>& bias, double eps) {
  const Problem p = forward_problem(op, input, weight, bias, eps);
  torch::stable::accelerator::DeviceGuard guard(input.get_device_index());
  Tensor out = output_like(input), rstd = row_stat(input);
  std::optional<Tensor> mean;
  if (kCentered) mean = row_stat(input);
  if (p.num_rows == 0) return {out, mean, rstd};
  if (p.n == 0) {  // an empty row: mean 0, variance 0
    torch::stable::fill_(rstd, 1.0 / std::sqrt(eps));
    if (kCentered) torch::stable::zero_(*mean);
    return {out, mean, rstd};
  }
  const cudaStream_t stream = current_stream(input.get_device_index());
  dispatch_types(p, op, [&](auto ttag, auto wtag) {
    using T = typename decltype(ttag)::type;
    using W = typename decltype(wtag)::type;
    using A = acc_t<T>;
    ForwardArgs<T, W> a{reinterpret_cast<const T*>(p.input.const_data_ptr()),
                        param_ptr<W>(p.weight),
                        param_ptr<W>(p.bias),
                        reinterpret_cast<T*>(out.mutable_data_ptr()),
                        data_or_null<A>(mean),
                        reinterpret_cast<A*>(rstd.mutable_data_ptr())};
    const Shape s = make_shape<T>(p, p.rows, a.y, kForwardVecs);
    if (s.vpt == 0) {
      const int rpb = sweep_rows_per_block(s);
      const auto launch = [&](auto kernel) {
        kernel<<<grid_size(op, (p.num_rows + rpb - 1) / rpb), dim3(s.tpr, rpb), 0, stream>>>(a, p.rows, p.num_rows,
                                                                                           p.n, A(eps));
      };
      if (s.vec == 1) launch(forward_sweep_kernel<kCentered, T, W, 1>);
      else launch(forward_sweep_kernel<kCentered, T, W, 16 / sizeof(T)>);
      return;
    }
    const auto launch = [&](auto vec, auto tag) {
      using Tag = decltype(tag);
      constexpr int kRows = kBlock / Tag::tpr;
      forward_kernel<kCentered, T, W, decltype(vec)::value, Tag::tpr, Tag::vpt>
          <<<grid_size(op, (p.num_rows + kRows - 1) / kRows), kBlock, 0, stream>>>(a, p.rows, p.num_rows, int(p.n),
                                                                                  A(eps));
    };
    dispatch_cached<T>(s, op, launch, CachedShapes<kForwardVecs>{});
  });
  check_launch(op);
  return {out, mean, rstd};
}

// grad_input, grad_weight and grad_bias (empty when not wanted).
template <bool kCentered>
std::tuple<Tensor, Tensor, Tensor> backward(const BackwardProblem& p, const char* op) {
  torch::stable::accelerator::DeviceGuard guard(p.input.get_device_index());
  Tensor grad_input = output_like(p.input);
  Tensor grad_weight = param_grad(p, p.weight, p.want_grad_weight);
  Tensor grad_bias = param_grad(p, p.bias, p.want_grad_bias);
  if (p.empty()) return {grad_input, grad_weight, grad_bias};
  const ScalarType xt = p.input.scalar_type();
  const int32_t device = p.input.get_device_index();
  const cudaStream_t stream = current_stream(device);
  dispatch_types(p, op, [&](auto ttag, auto wtag) {
    using T = typename decltype(ttag)::type;
    using W = typename decltype(wtag)::type;
    using A = acc_t<T>;
    BackwardArgs<T, W> a{reinterpret_cast<const T*>(p.grad_output.const_data_ptr()),
                         reinterpret_cast<const T*>(p.input.const_data_ptr()),
                         param_ptr<W>(p.weight),
                         param_ptr<A>(p.mean),
                         reinterpret_cast<const A*>(p.rstd.const_data_ptr()),
                         reinterpret_cast<T*>(grad_input.mutable_data_ptr()),
                         nullptr,
                         nullptr};
    const Shape s = make_shape<T>(p, p.grad_rows, a.dy, backward_vecs(kCentered));
    const int64_t sms = multiprocessor_count(device);
    // One wave of resident blocks, each walking its rows: as few partial rows to add up as
    // the bandwidth allows.
    const auto run = [&](auto kernel_tag, int64_t blocks_needed, dim3 block, int64_t partials_per_block) {
      constexpr auto kernel = decltype(kernel_tag)::value;
      const int64_t blocks = std::min(blocks_needed, sms * resident_blocks<kernel>(int(block.x * block.y)));
      const int64_t num_partials = blocks * partials_per_block;
      const int64_t params = int64_t(p.want_grad_weight) + int64_t(p.want_grad_bias);
      Tensor partial;
      if (params > 0) {
        partial = empty_like_device(p.input, {params, num_partials, p.n}, acc_dtype(xt));
        A* base = reinterpret_cast<A*>(partial.mutable_data_ptr());
        if (p.want_grad_weight) a.dw_partial = base;
        if (p.want_grad_bias) a.db_partial = base + (p.want_grad_weight ? num_partials * p.n : 0);
      }
      kernel<<<grid_size(op, blocks), block, 0, stream>>>(a, p.grad_rows, p.rows, p.num_rows, p.n);
      check_launch(op);
      const dim3 sum_grid(unsigned((p.n + 31) / 32)), sum_block(32, 8);
      if (p.want_grad_weight)
        sum_partials_kernel<A, W><<<sum_grid, sum_block, 0, stream>>>(
            a.dw_partial, num_partials, p.n, reinterpret_cast<W*>(grad_weight.mutable_data_ptr()));
      if (p.want_grad_bias)
        sum_partials_kernel<A, W><<<sum_grid, sum_block, 0, stream>>>(
            a.db_partial, num_partials, p.n, reinterpret_cast<W*>(grad_bias.mutable_data_ptr()));
      check_launch(op);
    };
    if (s.vpt == 0) {
      const int rpb = sweep_rows_per_block(s);
      const int64_t needed = (p.num_rows + rpb - 1) / rpb;
      if (s.vec == 1) run(Constant<backward_sweep_kernel<kCentered, T, W, 1>>{}, needed, dim3(s.tpr, rpb), rpb);
      else run(Constant<backward_sweep_kernel<kCentered, T, W, 16 / sizeof(T)>>{}, needed, dim3(s.tpr, rpb), rpb);
      return;
    }
    const auto launch = [&](auto vec, auto tag) {
      using Tag = decltype(tag);
      constexpr int kRows = kBlock / Tag::tpr;
      run(Constant<backward_kernel<kCentered, T, W, decltype(vec)::value, Tag::tpr, Tag::vpt>>{},
          (p.num_rows + kRows - 1) / kRows, dim3(kBlock), 1);
    };
    dispatch_cached<T>(s, op, launch, CachedShapes<backward_vecs(kCentered)>{});
  });
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace
}  // namespace fusedops::norm::cuda
