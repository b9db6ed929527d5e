// The CUDA kernels of the row normalisations, generic over centring (rms_norm, kCentered =
// false; layer_norm, true, with a bias) and over a Variant of the uncentred norms: rms_norm's
// options (offset + weight, cast_before_weight, and the backward from the saved output) and
// add_rms_norm, whose forward first adds a residual (dtype R: T, or float32 under 16-bit T) and
// whose backward adds the gradient reaching residual_out and may write a wider grad_residual.
// norm.h states what every op computes. The offset and the cast flag are runtime values
// uniform over a launch; a variant compiles only the code it needs, so rms_norm and layer_norm
// with their defaults run the same kernels as before the options existed.
//
// Forward: a group of TPR threads per row (256 / TPR rows per block). Each thread loads its
// VPT 16-byte vectors of the row into registers at once, the group reduces the statistics
// (layer_norm: the mean, then the squared deviations from it, both from registers), and the
// same registers are normalised and stored: one read of x, one write of y. TPR and VPT are
// compile-time constants picked from the row width so that each thread keeps about two vectors
// in flight; with every block resident that is what it takes to reach the copy bandwidth.
// add_rms_norm's vectors are VEC = 16 / sizeof(T) elements, so a float32 residual is two 16-byte
// pieces; the thread rounds x + residual to R, writes it to residual_out and keeps the rounded
// values (packed, for 16-bit R) as its cached row: one read of x and of the residual, one write
// of y and of residual_out. In place, residual_out is the residual: each thread reads its
// elements before it writes them.
// Forward rows wider than 8 vectors x 256 threads (16384 bf16) are spread over a thread-block
// cluster (sm_90) of up to 8 blocks of 512 threads, which add their partial sums through
// distributed shared memory. rms_norm and layer_norm stage the row in shared memory: a
// persistent grid of clusters, each block owning a chunk of up to 64 KB of every row, which the
// copy engine loads while the SM's other blocks reduce and write theirs (up to 8 x 64 KB a row:
// 262144 bf16 values). add_rms_norm's rows (two inputs) are cached in the registers of the
// cluster's threads, up to the same width. Wider rows still, the backward of rows
// wider than a block caches, and inputs that are not 16-byte aligned take a sweeping kernel
// of the same math that reads the row again for each statistic (from L2 while the rows
// in flight fit there); add_rms_norm's sweep writes residual_out on the first pass and reads
// it back after (each thread only the elements it wrote).
//
// Backward: a persistent grid of one wave of resident blocks; each row slot walks a fixed set
// of rows with four vectors per thread of each input in flight (x and grad_output, and
// add_rms_norm's grad_residual_out), writes grad_input, and keeps its parameter-gradient
// partials in registers (rms_norm) or, where those registers would cut the loads in flight
// (layer_norm's two partials, add_rms_norm's third input), in the block's shared memory. A
// block adds its slots' partials in a fixed order and writes one row of a (blocks, n) buffer
// per parameter, which a second kernel sums over the blocks, again in a fixed order: the
// parameter gradients are bitwise reproducible, with no atomics. The backward from the saved
// output y takes the row sum sum(g * xhat) as sum(dy * y) (the weight cancels) and recovers
// xhat = y / (offset + w) with a reciprocal where it writes grad_input. add_rms_norm's backward
// writes grad_residual from the registers of grad_input.
//
// Everything here has internal linkage: each op's translation unit instantiates what it uses.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <type_traits>
#include <utility>

#include <torch/csrc/stable/ops.h>

#include "fusedops/cuda_utils.cuh"
#include "fusedops/norm.h"

namespace fusedops::norm::cuda {
namespace {

using namespace fusedops::cuda;

constexpr int kBlock = 256;            // threads per block of the register-caching kernels
constexpr int kMaxVecsPerThread = 8;   // wider rows are swept
constexpr int kSweepThreads = 1024;    // threads per row of the sweeping kernels
constexpr int kForwardVecs = 2;        // vectors per thread the forward aims at (see forward_target)

// What one kernel instance of an uncentred norm computes beyond rms_norm with its defaults
// (kPlain; layer_norm is always kPlain): kOptions reads offset and cast_before_weight at run
// time; kFromOutput is rms_norm's saved_is_output backward (with the offset); kAdd is
// add_rms_norm (with the options), whose forward adds a residual of type R and whose backward
// adds grad_residual_out and, for R wider than T, writes grad_residual too. Each variant
// compiles only its own code, so the kernels rms_norm and layer_norm always ran stay as they
// were.
enum class Variant { kPlain, kOptions, kFromOutput, kAdd };

// One kernel configuration. T: the input's (grad_output's) type, W: the parameters' (T, or
// float32 under 16-bit T), R: add_rms_norm's residual's (T, or float32 under 16-bit T).
template <bool kCentered, Variant kVariant, typename TT, typename WW, typename RR = TT>
struct Config {
  static_assert(!kCentered || kVariant == Variant::kPlain, "layer_norm has no options");
  static_assert(kVariant == Variant::kAdd || std::is_same_v<TT, RR>, "only add_rms_norm has a residual type");
  static constexpr bool centered = kCentered;
  static constexpr bool options = kVariant != Variant::kPlain;  // offset (and cast_before_weight) at run time
  static constexpr bool from_output = kVariant == Variant::kFromOutput;
  static constexpr bool add = kVariant == Variant::kAdd;
  static constexpr bool wide_residual = !std::is_same_v<TT, RR>;
  using T = TT;
  using W = WW;
  using R = RR;
  using A = acc_t<TT>;
};

// Vectors per thread the backward aims at, of each row it reads (x and grad_output: twice the
// forward's loads in flight), or two where add_rms_norm keeps its residual rows in float32
// (8 float32 values a vector of x and of grad_residual_out), whose registers four would spill.
template <typename C>
constexpr int kBackwardVecs = C::wide_residual ? 2 : 4;

__device__ __forceinline__ float rsqrt_acc(float v) { return rsqrtf(v); }
__device__ __forceinline__ double rsqrt_acc(double v) { return rsqrt(v); }

// 1 / v without the IEEE division's slow-path call (which costs the backward registers): the
// hardware approximation, within 1 ulp for float; for double, refined by two Newton steps from
// its ~20 good bits.
__device__ __forceinline__ float rcp_acc(float v) { return rcp_approx(v); }
__device__ __forceinline__ double rcp_acc(double v) {
  double r;
  asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(r) : "d"(v));
#pragma unroll
  for (int i = 0; i < 2; ++i) r = fma(r, fma(-v, r, 1.0), r);
  return r;
}

// The factor a weight value scales by: offset + w with the options, else w.
template <typename C>
__device__ __forceinline__ typename C::A weight_scale(typename C::A w, typename C::A offset) {
  if constexpr (C::options) return offset + w;
  else return w;
}

// The pointers and runtime options of one forward.
template <typename C>
struct ForwardArgs {
  using T = typename C::T;
  using W = typename C::W;
  using R = typename C::R;
  using A = typename C::A;
  const T* __restrict__ x;
  const W* __restrict__ w;  // null: no weight
  const W* __restrict__ b;  // null: no bias (layer_norm only)
  T* __restrict__ y;
  A* __restrict__ mean;  // layer_norm only
  A* __restrict__ rstd;
  const R* r;  // add_rms_norm: the residual and residual_out (the same memory in place)
  R* h;
  A offset;                 // the options: the weight scales as offset + w
  bool cast_before_weight;  // the options: xhat is rounded to T before the weight
};

// The rows of add_rms_norm's residual and residual_out (nothing for the other norms).
template <bool kAdd>
struct ResidualRows {};
template <>
struct ResidualRows<true> {
  RowLayout r, h;
};

// add_rms_norm's row values: x + r rounded to R.
template <typename C, int VEC, typename XV, typename RV>
__device__ __forceinline__ Held<typename C::R, VEC> add_rounded(const XV& xv, const RV& rv) {
  typename C::A s[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) s[k] = acc_at(xv, k) + acc_at(rv, k);
  return round_held<typename C::R, VEC>(s);
}

// The weight and bias values at `col` (those absent: unused), held packed until used so that a
// kernel may load them early, beside its row, and not wait on them after its reductions.
template <typename C, int VEC>
struct Params {
  Held<typename C::W, VEC> w, b;

  __device__ __forceinline__ static Params load(const ForwardArgs<C>& a, int64_t col) {
    Params p;
    if (a.w != nullptr) p.w = load_held<typename C::W, VEC>(a.w + col);
    if constexpr (C::centered)
      if (a.b != nullptr) p.b = load_held<typename C::W, VEC>(a.b + col);
    return p;
  }
};

// Normalises VEC values of a row (the cached x, or add_rms_norm's h) and stores them:
// (x - mu) * rs * w + b for layer_norm; x * rs (rounded to T with cast_before_weight) *
// (offset + w) for the uncentred norms.
template <typename C, int VEC, typename V>
__device__ __forceinline__ void normalize_store(const ForwardArgs<C>& a, typename C::T* out, const V& xv, int64_t col,
                                                typename C::A mu, typename C::A rs, const Params<C, VEC>& p) {
  using T = typename C::T;
  using A = typename C::A;
  A y[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) y[k] = (acc_at(xv, k) - mu) * rs;
  if constexpr (C::options && sizeof(T) < sizeof(A)) {  // rounding to a T as wide as A changes nothing
    if (a.cast_before_weight) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) y[k] = to_acc(from_acc<T>(y[k]));
    }
  }
  if (a.w != nullptr) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) y[k] *= weight_scale<C>(A(acc_at(p.w, k)), a.offset);
  }
  if constexpr (C::centered) {
    if (a.b != nullptr) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) y[k] += A(acc_at(p.b, k));
    }
  }
  store_from_acc<T, VEC>(out + col, y);
}

template <typename C, int VEC, typename V>
__device__ __forceinline__ void normalize_store(const ForwardArgs<C>& a, typename C::T* out, const V& xv, int64_t col,
                                                typename C::A mu, typename C::A rs) {
  normalize_store<C, VEC>(a, out, xv, col, mu, rs, Params<C, VEC>::load(a, col));
}

template <typename A, int VEC, typename V>
__device__ __forceinline__ A vec_sum(const V& v, A mu, bool squared) {
  A s = 0;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const A d = acc_at(v, k) - mu;
    const A term = squared ? d * d : d;
    s = k == 0 ? term : s + term;  // (not 0 + term: the compiler keeps that add, for the sign of zero)
  }
  return s;
}

// Where layer_norm's row sums start: the row's first value for float32 (and float64) rows, whose
// mean is then x0 + mean(x - x0); 0 for 16-bit rows. A float32 row whose |mean| is far above its
// spread would otherwise lose the mean in the raw sum's roundings (1e5 + N(0, 1), 40960 values:
// off by up to three half-units of 1e5's last place, and every output with it; H100,
// 2026-12-05). A 16-bit row's own rounding (2^-9 of |x|) is far coarser than that, and its
// forward is bound by instruction issue (an extra subtraction a value is not free there).
template <typename T, typename A>
__device__ __forceinline__ A sum_origin(const T* xr, bool active) {
  if constexpr (sizeof(T) >= sizeof(float)) return active ? A(xr[0]) : A(0);
  else return A(0);
}

// rms_norm's 16-bit rows with 16-bit parameters: two vectors a thread at six blocks an SM.
// What decides its speed is the warps in flight more than the vectors a thread: its forward at
// two vectors took 48 registers left alone (five blocks), as at four, and four vectors were
// faster only for that reason. Bounded to six blocks (40 registers, no spills), two vectors
// beat four at five blocks. H200, bf16 forward, do_bench medians (benchmarks/norm_forward_ab.py),
// 2026-12-01: alternating runs of one scratch build with a switch, 3.97-3.99 -> 4.08-4.10 TB/s
// at 32768x4096 and 3.74-3.78 -> 3.87-3.91 at 65536x1024; then the old wheel against this one,
// three rounds, 3.95-3.96 -> 4.06-4.07 and 3.73-3.75 -> 3.85-3.88. 4096x8192 runs four vectors
// at 256 threads a row either way. Four vectors at six blocks (40 registers, an 8-byte stack)
// lost at 32768x4096 (3.93-3.95); two at eight blocks (32 registers) spilled 40-56 bytes and
// ran at 2.5-3.3. A float32 weight takes 58 registers at two vectors (six blocks would spill
// 64-96 bytes): it keeps four. add_rms_norm (two inputs) gained nothing from the same step
// (65536x1024 3.93-3.95 -> 3.91-3.92 at six or five blocks): it keeps four too.
template <typename C>
constexpr bool kRmsTwoVectors =
    !C::centered && !C::add && sizeof(typename C::T) == 2 && sizeof(typename C::W) == 2;

// Vectors a thread the forward aims at: four for other 16-bit rows, else kForwardVecs. A good share
// of a forward's instructions are spent once a row per thread (the block reductions, the
// statistics, the row's addresses); with four vectors a thread half as many threads pay them
// for a row, and rows of up to 1024 values reduce within one warp, without a barrier. Measured
// on the H200 (bf16 forward, 2026-11-30, alternating builds and runs): layer_norm, bound by
// instruction issue, 3.83-3.85 -> 3.93-3.95 TB/s at 32768x4096 (128 threads a row instead of
// 256) and 3.65 -> 3.70-3.73 at 65536x1024 (32 instead of 64), do_bench medians
// (benchmarks/norm_forward_ab.py); add_rms_norm within 1% (the harness, fusedops alone, two
// rounds each). Float32 rows are not measured this way and keep two.
template <typename C>
constexpr int forward_target() {
  return kRmsTwoVectors<C> ? 2 : sizeof(typename C::T) == 2 ? 4 : kForwardVecs;
}

// TPR threads per row, VPT vectors of VEC elements per thread, kBlock / TPR rows per block.
// Blocks an SM forward_kernel asks for, for layer_norm's 16-bit rows with parameters of the
// input's type: six (40 registers a thread) up to two vectors a thread, which left alone take
// 47 registers and five blocks; at four vectors, whose parameters load late (kLateParams), five
// for bf16 (48 registers, no spills) and four for fp16 (whose conversions spill at 48). For
// rms_norm's (kRmsTwoVectors) six up to two vectors. Elsewhere what the registers give.
template <typename C, int VPT>
constexpr int kForwardMinBlocks =
    C::centered && sizeof(typename C::T) == 2 && sizeof(typename C::W) == 2
        ? (VPT <= 2 ? 6 : VPT == 4 ? (std::is_same_v<typename C::T, __half> ? 4 : 5) : 1)
    : kRmsTwoVectors<C> && VPT <= 2 ? 6
                                    : 1;

template <typename C, int VEC, int TPR, int VPT>
__global__ void __launch_bounds__(kBlock, kForwardMinBlocks<C, VPT>)
    forward_kernel(ForwardArgs<C> a, RowLayout rows, ResidualRows<C::add> res_rows, int64_t num_rows, int n,
                   typename C::A eps, typename C::A inv_n) {
  using T = typename C::T;
  using R = typename C::R;
  using A = typename C::A;
  __shared__ A scratch[2][kBlock / 32];
  const int lane = threadIdx.x % TPR;
  const int64_t row = int64_t(blockIdx.x) * (kBlock / TPR) + threadIdx.x / TPR;
  const bool active = row < num_rows;
  const T* xr = a.x + (active ? rows.offset(row) : 0);
  // The cached row: x, or add_rms_norm's x + r rounded to R (once written to residual_out).
  // Held packed (cuda_utils.cuh: load_held), so that every load is issued before the first wait.
  Held<std::conditional_t<C::add, R, T>, VEC> xv[VPT];
  if constexpr (C::add) {
    const R* rr = a.r + (active ? res_rows.r.offset(row) : 0);
    R* hr = a.h + (active ? res_rows.h.offset(row) : 0);
    Held<T, VEC> xin[VPT];
    Held<R, VEC> rin[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (active && col < n) {
        xin[i] = load_held<T, VEC>(xr + col);
        rin[i] = load_held<R, VEC>(rr + col);
      }
    }
    // Every load is issued before the first store: in place, hr is rr.
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (active && col < n) {
        xv[i] = add_rounded<C, VEC>(xin[i], rin[i]);
        store_held<R, VEC>(hr + col, xv[i]);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (active && col < n) xv[i] = load_held<T, VEC>(xr + col);
    }
  }
  // The parameters are loaded now, so that their latency hides behind the reductions; except
  // at four or more vectors a thread, where holding them through the reductions took 72-74
  // registers (three blocks an SM) and each vector's load just before it is normalised leaves
  // 48 (five) for layer_norm and rms_norm: layer_norm 3.09-3.15 -> 3.37-3.45 TB/s and rms_norm
  // 3.33-3.36 -> 3.43-3.44 at 4096x8192 bf16 (H200, do_bench medians, alternating builds).
  constexpr bool kLateParams = VPT >= 4;
  Params<C, VEC> params[kLateParams ? 1 : VPT];
  if constexpr (!kLateParams) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (active && col < n) params[i] = Params<C, VEC>::load(a, col);
    }
  }
  // Vector i's parameters (at column col), when it is normalised.
  const auto params_of = [&](int i, int col) {
    if constexpr (kLateParams) return Params<C, VEC>::load(a, col);
    else return params[i];
  };
  const auto in_row = [&](int i) { return active && (i * TPR + lane) * VEC < n; };
  if constexpr (C::centered) {
    // layer_norm's forward is bound by instruction issue, not by memory (ncu on the H200), so
    // it spends few: 1 / n is taken once, while the loads are in flight, in place of a
    // division per statistic; 16-bit rows normalise as x * rs + (-mu * rs), one FMA, whose
    // rounding of mu * rs (|mu| / sigma units of 2^-24) stays far below the output's 2^-9; and
    // the weight and bias apply in one FMA. 14% fewer instructions than (x - mu) * rs * w + b
    // in two passes of divisions (3.49 -> 3.69 TB/s at 32768x4096 bf16,
    // benchmarks/layer_norm_forward_variants.cu). Converting x to float once instead needs 56
    // registers a thread, four blocks an SM, and was slower (3.31).
    const A x0 = sum_origin<T, A>(xr, active);
    A s = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i)
      if (in_row(i)) s += vec_sum<A, VEC>(xv[i], x0, false);
    const A mu = x0 + group_sum<TPR>(s, scratch[1]) * inv_n;
    A ss = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i)
      if (in_row(i)) ss += vec_sum<A, VEC>(xv[i], mu, true);
    const A rs = rsqrt_acc(fma(group_sum<TPR>(ss, scratch[0]), inv_n, eps));
    if (!active) return;  // only after the block's barriers
    if (lane == 0) {
      a.rstd[row] = rs;
      a.mean[row] = mu;
    }
    const A shift = -mu * rs;
    T* yr = a.y + row * n;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (col >= n) continue;
      const Params<C, VEC> pv = params_of(i, col);
      A y[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const A x = acc_at(xv[i], k);
        y[k] = sizeof(T) < sizeof(A) ? fma(x, rs, shift) : (x - mu) * rs;
        const A b = a.b != nullptr ? A(acc_at(pv.b, k)) : A(0);
        y[k] = a.w != nullptr ? fma(y[k], A(acc_at(pv.w, k)), b) : y[k] + b;
      }
      store_from_acc<T, VEC>(yr + col, y);
    }
  } else {
    A ss = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i)
      if (in_row(i)) ss += vec_sum<A, VEC>(xv[i], A(0), true);
    const A rs = rsqrt_acc(group_sum<TPR>(ss, scratch[0]) / A(n) + eps);
    if (!active) return;  // only after the block's barriers
    if (lane == 0) a.rstd[row] = rs;
    T* yr = a.y + row * n;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (col < n) normalize_store<C, VEC>(a, yr, xv[i], col, A(0), rs, params_of(i, col));
    }
  }
}

// Rows too wide to cache, or unaligned: blockDim.x threads per row, blockDim.y rows per block;
// the row is read once per statistic and once more to normalise. add_rms_norm computes its row
// values on the first pass, writes them to residual_out, and reads them back from there (each
// thread only the elements it wrote itself).
template <typename C, int VEC>
__global__ void __launch_bounds__(kSweepThreads)
    forward_sweep_kernel(ForwardArgs<C> a, RowLayout rows, ResidualRows<C::add> res_rows, int64_t num_rows,
                         int64_t n, typename C::A eps) {
  using T = typename C::T;
  using R = typename C::R;
  using A = typename C::A;
  __shared__ A scratch[32 * 8];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < num_rows;
  const T* xr = a.x + (active ? rows.offset(row) : 0);
  const R* rr = nullptr;
  R* hr = nullptr;
  if constexpr (C::add) {
    rr = a.r + (active ? res_rows.r.offset(row) : 0);
    hr = a.h + (active ? res_rows.h.offset(row) : 0);
  }
  // The row values after the first pass.
  const auto values = [&](int64_t col) {
    if constexpr (C::add) return load_vec<R, VEC>(hr + col);
    else return load_vec<T, VEC>(xr + col);
  };
  const int64_t step = int64_t(blockDim.x) * VEC;
  A mu = 0;
  if constexpr (C::centered) {
    const A x0 = sum_origin<T, A>(xr, active);
    A s = 0;
    if (active)
      for (int64_t col = threadIdx.x * VEC; col < n; col += step) s += vec_sum<A, VEC>(values(col), x0, false);
    mu = x0 + row_sum(s, scratch) / A(n);
  }
  A ss = 0;
  if (active) {
    for (int64_t col = threadIdx.x * VEC; col < n; col += step) {
      if constexpr (C::add) {
        const Held<R, VEC> hv = add_rounded<C, VEC>(load_vec<T, VEC>(xr + col), load_vec<R, VEC>(rr + col));
        store_held<R, VEC>(hr + col, hv);
        ss += vec_sum<A, VEC>(hv, mu, true);
      } else {
        ss += vec_sum<A, VEC>(values(col), mu, true);
      }
    }
  }
  const A rs = rsqrt_acc(row_sum(ss, scratch) / A(n) + eps);
  if (!active) return;
  if (threadIdx.x == 0) {
    a.rstd[row] = rs;
    if constexpr (C::centered) a.mean[row] = mu;
  }
  T* yr = a.y + row * n;
  for (int64_t col = threadIdx.x * VEC; col < n; col += step) normalize_store<C, VEC>(a, yr, values(col), col, mu, rs);
}

// add_rms_norm's rows too wide for one block's registers but within a cluster's: a thread-block
// cluster of blocks (sm_90) per row, each keeping its share of the row in registers (vectors dealt to the
// blocks in turn, so the shares differ by at most one vector per thread). Each block sums its
// share and sends the sums to every block of the cluster through distributed shared memory
// (cluster_sum), and every block adds all the blocks' sums in rank order: the same totals, bit
// for bit, in every block. One read of each input and one write of each output however wide
// the row, where the sweeping kernels read wide rows again for each statistic and a row of 256K
// bf16 values does not stay in L2 between the reads.
constexpr int kClusterThreads = 512;
constexpr int kMaxCluster = 8;           // the portable cluster size: the forward's limit
constexpr int kMaxBackwardCluster = 16;  // the backward keeps twice the data: 16 blocks (non-portable, sm_90)
constexpr int kClusterBackwardVecs = 4;

// Clusters exist from sm_90 on. Code compiled for an older architecture (a PTX-only build that
// the driver compiles for a newer GPU, say) has none of this: the host never picks the cluster
// kernel for it (cluster_kernel_usable), and these stubs only keep it compiling.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FUSEDOPS_CLUSTERS 1
#endif

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r = 0;
#ifdef FUSEDOPS_CLUSTERS
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}
__device__ __forceinline__ unsigned cluster_blocks() {
  unsigned r = 1;
#ifdef FUSEDOPS_CLUSTERS
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
#endif
  return r;
}
// Every cluster barrier here is relaxed (it orders no memory access): it only tells a block that
// every block of its cluster has started, so that their inboxes (below) are ready. A release
// arrive, which a pull of other blocks' sums through distributed shared memory would need, is a
// GPU-scope memory barrier on sm_90 (MEMBAR.ALL.GPU): it waits for every global store the block
// still has in flight.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#ifdef FUSEDOPS_CLUSTERS
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#ifdef FUSEDOPS_CLUSTERS
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbarrier_init(uint64_t* bar) {
#ifdef FUSEDOPS_CLUSTERS
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
#endif
}
// The async proxy (the copy engine) sees this thread's earlier shared-memory accesses: the
// barriers' initialisation, and the generic reads of a stage it is about to overwrite.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef FUSEDOPS_CLUSTERS
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
// The barrier's one arrival of a phase, which completes once `bytes` more have landed.
__device__ __forceinline__ void mbarrier_arrive_expect(uint64_t* bar, uint32_t bytes) {
#ifdef FUSEDOPS_CLUSTERS
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
#endif
}
// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory into
// shared memory; the copy completes a phase of `bar` together with the thread's arrival.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  mbarrier_arrive_expect(bar, bytes);
#ifdef FUSEDOPS_CLUSTERS
  if (bytes > 0)
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     shared_address(dst)),
                 "l"(src), "r"(bytes), "r"(shared_address(bar))
                 : "memory");
#endif
}
// Waits for the phase of `bar` with this parity to complete.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
#ifdef FUSEDOPS_CLUSTERS
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

// A block's inbox for the row sums of its cluster's blocks. Each block pushes its K sums into
// every block's inbox (st.async into distributed shared memory), which completes bytes of the
// receiver's mbarrier; a block reads its inbox once its barrier's phase completes. That needs
// no release barrier, and no barrier at all beyond the one that first publishes the inboxes
// (cluster_inbox_init): no block leaves before every push into it has landed, and none reads
// another's shared memory. Exchanges alternate between the two halves, so a block may run
// one exchange ahead of another: it cannot send exchange e + 2 before it has received every
// block's e + 1, which each block sends only after it has read e.
// H200, bf16 forward TB/s, against the pull behind release barriers, alternating runs of one
// scratch build (2026-12-01): add_rms_norm 3.59 -> 3.93 at 2048x32768, 3.57 -> 4.04 at 4096x24576
// and 3.46 -> 3.92 at 1024x65536 (with its weights loaded in one batch, below); the staged
// forward at 2048x32768 / 512x131072 / 256x262144, rms_norm 3.36 / 3.26 / 3.16 -> 3.49 / 3.46 /
// 3.31 and layer_norm 3.16 / 3.02 / 2.90 -> 3.27 / 3.16 / 3.02.
template <typename A, int K>
struct ClusterInbox {
  A sums[2][kMaxBackwardCluster][K];  // [exchange % 2][sender's rank][k]
  uint64_t bar[2];
};

// Readies the inbox and arrives at the cluster barrier that publishes it: every thread calls
// this once, and cluster_wait() before its first exchange.
template <typename A, int K>
__device__ __forceinline__ void cluster_inbox_init(ClusterInbox<A, K>& box) {
  if (threadIdx.x == 0) {
    mbarrier_init(&box.bar[0]);
    mbarrier_init(&box.bar[1]);
#ifdef FUSEDOPS_CLUSTERS
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
  }
  cluster_arrive_relaxed();
}

// `local` (in this block's shared memory) as the block of cluster rank `rank` has it.
__device__ __forceinline__ uint32_t cluster_address(const void* local, unsigned rank) {
  uint32_t remote = shared_address(local);
#ifdef FUSEDOPS_CLUSTERS
  asm volatile("mapa.shared::cluster.u32 %0, %0, %1;" : "+r"(remote) : "r"(rank));
#endif
  return remote;
}

template <typename A>
__device__ __forceinline__ void push_to_cluster(uint32_t remote_slot, A v, uint32_t remote_bar) {
#ifdef FUSEDOPS_CLUSTERS
  if constexpr (sizeof(A) == 8) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b64 [%0], %1, [%2];" ::"r"(remote_slot),
                 "l"(__double_as_longlong(v)), "r"(remote_bar)
                 : "memory");
  } else {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(remote_slot),
                 "r"(__float_as_uint(v)), "r"(remote_bar)
                 : "memory");
  }
#endif
}

// Warp 0 only: sends this block's K values to every block of the cluster and receives theirs;
// lane r gets block r's values in `got` (zeros past the cluster's blocks). `exchange` counts
// this block's exchanges through `box` from 0.
template <int K, typename A>
__device__ __forceinline__ void cluster_exchange(const A (&mine)[K], A (&got)[K], ClusterInbox<A, K>& box,
                                                 int exchange) {
  const int lane = threadIdx.x & 31;
  const unsigned blocks = cluster_blocks(), rank = cluster_rank();
  if (blocks == 1) {  // (a cluster of one: nothing to send)
#pragma unroll
    for (int k = 0; k < K; ++k) got[k] = lane == 0 ? mine[k] : A(0);
    return;
  }
  const int half = exchange & 1;
  if (lane == 0) mbarrier_arrive_expect(&box.bar[half], uint32_t(blocks * K * sizeof(A)));
  if (unsigned(lane) < blocks) {
    const uint32_t bar = cluster_address(&box.bar[half], unsigned(lane));
#pragma unroll
    for (int k = 0; k < K; ++k)
      push_to_cluster(cluster_address(&box.sums[half][rank][k], unsigned(lane)), mine[k], bar);
  }
  mbarrier_wait(&box.bar[half], uint32_t(exchange >> 1) & 1u);
#pragma unroll
  for (int k = 0; k < K; ++k) got[k] = unsigned(lane) < blocks ? box.sums[half][lane][k] : A(0);
}

// Sums K values over the cluster's threads: returns them in v, the same in every thread, bit
// for bit (every block adds the blocks' sums in the same butterfly). `warps` (K x
// kClusterThreads / 32 values) and `totals` (K) are this block's scratch.
template <int K, typename A>
__device__ __forceinline__ void cluster_sum(A (&v)[K], A* warps, ClusterInbox<A, K>& box, int exchange, A* totals) {
  constexpr int kWarps = kClusterThreads / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    v[k] = warp_sum(v[k]);
    if (lane == 0) warps[k * kWarps + warp] = v[k];
  }
  __syncthreads();
  if (warp == 0) {
    A mine[K], got[K];
#pragma unroll
    for (int k = 0; k < K; ++k) mine[k] = warp_sum(lane < kWarps ? warps[k * kWarps + lane] : A(0));
    cluster_exchange(mine, got, box, exchange);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const A t = warp_sum(got[k]);
      if (lane == 0) totals[k] = t;
    }
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = totals[k];
}

// A centred row's mean and sum of squared deviations (m2) over the cluster's threads, in one
// exchange where two cluster_sum calls (the mean, then the deviations from it) would take two.
// Each block sums its own values and, around its own mean, their squared deviations, sends
// (count, sum, m2), and every block merges the blocks' triples the same way (the pairwise
// update of Chan, Golub and LeVeque: m2 = sum_b m2_b + sum_b count_b (mean_b - mean)^2), so every
// block gets the same totals, bit for bit, as stable as the two-pass form. `count`: this
// block's number of values, the same in each of its threads; `thread_sum(mu, squared)`: this
// thread's sum of x - mu, or of its squares; `origin`: where the sums start, the same in every
// block (sum_origin). `warps` holds 2 x kClusterThreads / 32 values, `totals` 2.
template <typename A, typename ThreadSum>
__device__ __forceinline__ void cluster_moments(A count, A origin, const ThreadSum& thread_sum, A* warps,
                                                ClusterInbox<A, 3>& box, int exchange, A* totals, A& mean,
                                                A& m2) {
  constexpr int kWarps = kClusterThreads / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  A s = warp_sum(thread_sum(origin, false));
  if (lane == 0) warps[warp] = s;
  __syncthreads();
  s = warp_sum(lane < kWarps ? warps[lane] : A(0));  // the block's sum from origin, in every thread
  A q = warp_sum(thread_sum(origin + (count > A(0) ? s / count : A(0)), true));
  if (lane == 0) warps[kWarps + warp] = q;
  __syncthreads();
  if (warp == 0) {
    q = warp_sum(lane < kWarps ? warps[kWarps + lane] : A(0));
    const A mine[3] = {count, s, q};
    A got[3];
    cluster_exchange(mine, got, box, exchange);
    const A c = got[0], sb = got[1], qb = got[2];
    const A mu = warp_sum(sb) / warp_sum(c);  // from origin
    const A d = c > A(0) ? sb / c - mu : A(0);  // block lane's mean, as that block computed it, less mu
    const A m = warp_sum(qb + c * d * d);
    if (lane == 0) {
      totals[0] = origin + mu;
      totals[1] = m;
    }
  }
  __syncthreads();
  mean = totals[0];
  m2 = totals[1];
}

// Column of the i-th vector of this thread, in a cluster of `blocks` blocks. Within int: the
// cluster kernels serve rows of at most kMaxBackwardCluster * kClusterThreads * 8 vectors.
template <int VEC>
__device__ __forceinline__ int cluster_column(int i, unsigned blocks, unsigned rank) {
  return int(((i * blocks + rank) * kClusterThreads + threadIdx.x) * VEC);
}

// Blocks an SM add_rms_norm's cluster forward asks for: two (64 registers a thread) at 4 vectors
// a thread, so that one block's loads hide the other's cluster barrier; one at 8, where two
// would spill 128 bytes and more (measured 2.28 TB/s at two against 2.94 at one, 256x262144 bf16).
template <int VPT>
constexpr int kClusterForwardBlocks = VPT <= 4 ? 2 : 1;

template <typename C, int VEC, int VPT>
__global__ void __launch_bounds__(kClusterThreads, kClusterForwardBlocks<VPT>)
    forward_cluster_kernel(ForwardArgs<C> a, RowLayout rows, ResidualRows<C::add> res_rows, int64_t n,
                           typename C::A eps) {
  static_assert(C::add, "rms_norm and layer_norm stage wide rows in shared memory: forward_staged_kernel");
  using T = typename C::T;
  using R = typename C::R;
  using A = typename C::A;
  __shared__ A warps[kClusterThreads / 32];
  __shared__ A totals[1];
  __shared__ ClusterInbox<A, 1> box;
  cluster_inbox_init(box);
  const unsigned rank = cluster_rank(), blocks = cluster_blocks();
  const int64_t row = blockIdx.x / blocks;  // (32-bit division)
  const auto column = [&](int i) { return cluster_column<VEC>(i, blocks, rank); };
  // Held packed, as in forward_kernel: every load issued before the first wait, and 16-bit
  // values two to a register.
  Held<R, VEC> hv[VPT];
  {
    const T* xr = a.x + rows.offset(row);
    const R* rr = a.r + res_rows.r.offset(row);
    R* hr = a.h + res_rows.h.offset(row);
    Held<T, VEC> xin[VPT];
    Held<R, VEC> rin[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (column(i) < n) {
        xin[i] = load_held<T, VEC>(xr + column(i));
        rin[i] = load_held<R, VEC>(rr + column(i));
      }
    }
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (column(i) < n) {
        hv[i] = add_rounded<C, VEC>(xin[i], rin[i]);
        store_held<R, VEC>(hr + column(i), hv[i]);
      }
    }
  }
  A ss[1] = {0};
#pragma unroll
  for (int i = 0; i < VPT; ++i)
    if (column(i) < n) ss[0] += vec_sum<A, VEC>(hv[i], A(0), true);
  cluster_wait();  // every block's inbox is ready
  cluster_sum(ss, warps, box, 0, totals);
  // 16-bit weight vectors are loaded in one batch before the first store (which the compiler
  // would not move a load past): one wait on the cache instead of one a vector. 3.59-3.60 ->
  // 3.69-3.70 TB/s at 2048x32768 bf16 on the H200 (alternating runs, 2026-12-01, sums still
  // pulled); loaded before the exchange, they cost more than they hid (3.48). A float32 weight's
  // batch would spill (72 bytes at four vectors a thread): it loads a vector at a time.
  constexpr bool kBatch = sizeof(typename C::W) == 2;
  Params<C, VEC> pv[kBatch ? VPT : 1];
  if constexpr (kBatch) {
#pragma unroll
    for (int i = 0; i < VPT; ++i)
      if (column(i) < n) pv[i] = Params<C, VEC>::load(a, column(i));
  }
  const A rs = rsqrt_acc(ss[0] / A(n) + eps);
  if (rank == 0 && threadIdx.x == 0) a.rstd[row] = rs;
  T* yr = a.y + row * n;
#pragma unroll
  for (int i = 0; i < VPT; ++i)
    if (column(i) < n)
      normalize_store<C, VEC>(a, yr, hv[i], column(i), A(0), rs, kBatch ? pv[i] : Params<C, VEC>::load(a, column(i)));
}

// Forward of rows wider than a block caches, through shared memory (sm_90; rms_norm and
// layer_norm with their options, not add_rms_norm): a persistent grid of clusters (three blocks
// an SM: 40 registers a thread, up to 64 KB of shared memory each, the SM's carveout all shared
// memory), each walking the rows r, r + clusters, ...; block `rank` of a cluster owns the
// contiguous columns [rank * chunk, (rank + 1) * chunk) of every row. The Tensor Memory
// Accelerator copies that chunk (cp.async.bulk) into the block's shared memory, signalling an
// mbarrier; the block reduces it (the statistics re-read x from shared memory), adds the row
// sums across the cluster as cluster_sum / cluster_moments do, writes y, and only then asks for
// its chunk of the next row: the SM's other two blocks keep the memory busy meanwhile. x is read
// once and y written once, with no register holding the row.
// One stage of up to 64 KB a block, rather than two of 32 KB with the next row's chunk in flight
// (the kernel's first form): half the cluster barriers for a row of the same width, and rows of
// 262144 bf16 values staged too. H200, forward TB/s, bf16, in one run (2026-11-30):
// rms_norm 3.14 -> 3.36 at 2048x32768, 2.93 -> 3.26 at 512x131072, and at 256x262144 3.16
// against the register-caching cluster kernel's 2.78; layer_norm 2.97 -> 3.18, 2.78 -> 3.03,
// 2.50 -> 2.91.
// Not the last round's idle slots: 2048 rows of 64 KB fill 5.2 of 6 rounds of the 396 resident
// blocks, but splitting rows over 2x or 4x the blocks (32 / 16 KB chunks, clusters up to 16) so
// that 10-21 rounds fill, was slower everywhere (H200, bf16, 2026-12-03, two rounds each of
// benchmarks/cluster_kernels_ab.py --groups staged-fwd): rms_norm 3.49 -> 3.47 / 3.03 at
// 2048x32768, 3.42 -> 3.31 / 2.59 at 512x131072, 3.33 -> 3.11 / 2.47 at 256x262144; layer_norm
// 3.26 -> 3.13 / 2.30, 3.15 -> 2.87 / 2.04, 3.05 -> 2.61 / 1.92. The time a row spends per
// cluster exchange and chunk, not the rounds, is what the wide forward loses. Nor sharing the
// rows evenly over fewer resident clusters (ceil(rows / rounds): 43 clusters of 6 rows, not 49
// with 11 rows in the last round, at 256x262144): equal at 256x262144, slower elsewhere (H200,
// bf16, 2026-12-06, two alternating runs of one build switched by an environment variable, not
// kept): rms_norm 3.52 -> 3.41-3.44 at 2048x32768, layer_norm 3.29-3.31 -> 3.12-3.13; layer_norm
// at 100x262144 2.60-2.64 -> 2.21-2.22. Every block resident matters more than a full last round.
// Also slower (2026-12-03, docs/ops/rms_norm.md "Two more layouts"): forward_cluster_kernel
// (registers, sums pushed) for rms_norm and layer_norm, and the weight and bias staged in shared
// memory beside a smaller chunk of x.
constexpr int kStagedChunkBytes = 64 * 1024;

template <typename C, int VEC>
__global__ void __launch_bounds__(kClusterThreads, 3)
    forward_staged_kernel(ForwardArgs<C> a, RowLayout rows, int64_t num_rows, int n, int chunk,
                          typename C::A eps) {
  static_assert(!C::add, "add_rms_norm stages two inputs: not here");
  using T = typename C::T;
  using A = typename C::A;
  constexpr int kStride = kClusterThreads * VEC;  // columns of one pass of the block's threads
  extern __shared__ __align__(128) unsigned char staged_shared[];
  __shared__ uint64_t bar;
  __shared__ A warps[2 * kClusterThreads / 32];
  __shared__ A totals[2];
  __shared__ ClusterInbox<A, C::centered ? 3 : 1> box;
  const unsigned rank = cluster_rank(), blocks = cluster_blocks();
  const int64_t clusters = gridDim.x / blocks;
  const int col0 = int(rank) * chunk;
  const int len = max(0, min(chunk, n - col0));  // this block's columns: a multiple of VEC
  T* const xs = reinterpret_cast<T*>(staged_shared);
  const uint32_t bytes = uint32_t(len) * sizeof(T);
  int64_t row = blockIdx.x / blocks;
  if (threadIdx.x == 0) {
    mbarrier_init(&bar);
    fence_proxy_async();
    if (row < num_rows) bulk_load(xs, a.x + rows.offset(row) + col0, bytes, &bar);
  }
  cluster_inbox_init(box);
  cluster_wait();  // every block's inbox is ready (and, after the block barrier, `bar`)
  __syncthreads();
  const A inv_n = A(1) / A(n);
  const auto thread_sum = [&](A m, bool squared) {
    A v = 0;
#pragma unroll 2
    for (int c = threadIdx.x * VEC; c < len; c += kStride) v += vec_sum<A, VEC>(load_held<T, VEC>(xs + c), m, squared);
    return v;
  };
  for (int it = 0; row < num_rows; row += clusters, ++it) {
    mbarrier_wait(&bar, uint32_t(it) & 1u);
    A mu = 0;
    A v[1];
    if constexpr (C::centered) {
      cluster_moments(A(len), sum_origin<T, A>(a.x + rows.offset(row), true), thread_sum, warps, box, it, totals,
                      mu, v[0]);
    } else {
      v[0] = thread_sum(A(0), true);
      cluster_sum(v, warps, box, it, totals);
    }
    const A rs = rsqrt_acc(fma(v[0], inv_n, eps));
    if (rank == 0 && threadIdx.x == 0) {
      a.rstd[row] = rs;
      if constexpr (C::centered) a.mean[row] = mu;
    }
    T* yr = a.y + row * n;
    // One vector at a time: unrolled, this loop needs more than the 40 registers a thread that
    // three blocks an SM leave (and the third block is worth more: 2.80 -> 2.98 TB/s for
    // rms_norm at 512x131072 bf16 on the H200, against two blocks at 64 registers).
#pragma unroll 1
    for (int c = threadIdx.x * VEC; c < len; c += kStride)
      normalize_store<C, VEC>(a, yr, load_held<T, VEC>(xs + c), col0 + c, mu, rs);
    __syncthreads();  // the chunk is read: the next row's may land
    if (threadIdx.x == 0 && row + clusters < num_rows) {
      fence_proxy_async();  // (the threads' reads of the chunk, before the copy engine's writes)
      bulk_load(xs, a.x + rows.offset(row + clusters) + col0, bytes, &bar);
    }
  }
}

// The pointers and runtime options of one backward. Partials: null when that gradient is not
// wanted, else one row of n per block (per row slot for the sweeping kernel).
template <typename C>
struct BackwardArgs {
  using T = typename C::T;
  using W = typename C::W;
  using R = typename C::R;
  using A = typename C::A;
  const T* __restrict__ dy;
  const R* __restrict__ x;  // what the forward saved: x, y (saved_is_output) or residual_out (add_rms_norm)
  const W* __restrict__ w;
  const A* __restrict__ mean;  // layer_norm only
  const A* __restrict__ rstd;
  T* __restrict__ dx;
  A* __restrict__ dw_partial;
  A* __restrict__ db_partial;
  const R* __restrict__ dh;  // add_rms_norm: grad_residual_out, or null
  R* __restrict__ dr;        // add_rms_norm with R wider than T: grad_residual
  A offset;                  // the options: the weight scales as offset + w
};

// The rows of add_rms_norm's grad_residual_out (nothing for the other norms).
template <bool kAdd>
struct GradResidualRows {};
template <>
struct GradResidualRows<true> {
  RowLayout dh;
};

// The row sums the backward needs from VEC values: sum(g * (x - mu)) and, with K = 2 (centred),
// sum(g); g = dy * scale(w). From the output the weight is left out: sum(dy * y), which is
// sum(g * xhat).
template <typename C, int VEC, int K, typename V, typename G, typename WV>
__device__ __forceinline__ void add_row_sums(typename C::A (&sums)[K], const V& xv, const G& gv, const WV& wv,
                                             bool weighted, typename C::A mu, typename C::A offset) {
  using A = typename C::A;
  if constexpr (C::from_output) weighted = false;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const A g = weighted ? acc_at(gv, k) * weight_scale<C>(A(acc_at(wv, k)), offset) : acc_at(gv, k);
    sums[0] += g * (acc_at(xv, k) - mu);
    if constexpr (K > 1) sums[1] += g;
  }
}

// The weight's VEC values at `col` (nothing loaded without a weight), held packed.
template <typename C, int VEC>
__device__ __forceinline__ Held<typename C::W, VEC> load_weight(const typename C::W* w, int64_t col) {
  Held<typename C::W, VEC> h{};
  if (w != nullptr) h = load_held<typename C::W, VEC>(w + col);
  return h;
}

// What grad_input_store needs of its row: grad_input = rs * (g - c0 - c1 * xq) (+ dh), where
// xq = x - mu, or y / scale(w) from the output, and xhat = xq * xs.
template <typename C>
struct RowGrad {
  using T = typename C::T;
  using R = typename C::R;
  using A = typename C::A;
  T* dx;
  R* dr;        // add_rms_norm with a wider R: grad_residual's row
  const R* dh;  // add_rms_norm: grad_residual_out's row, or null
  A mu, rs, c0, c1, xs;
};

// add_rms_norm's grad_residual_out row `row`, or null (no such gradient, or another norm).
template <typename C>
__device__ __forceinline__ const typename C::R* grad_residual_row(const BackwardArgs<C>& a,
                                                                  const GradResidualRows<C::add>& dh_rows, int64_t row) {
  if constexpr (C::add)
    if (a.dh != nullptr) return a.dh + dh_rows.dh.offset(row);
  return nullptr;
}

// The row's coefficients from its reduced sums.
template <typename C, int K>
__device__ __forceinline__ RowGrad<C> row_grad(const BackwardArgs<C>& a, const GradResidualRows<C::add>& dh_rows,
                                               int64_t row, int64_t n, const typename C::A (&sums)[K],
                                               typename C::A mu, typename C::A rs, typename C::A inv_n) {
  using A = typename C::A;
  RowGrad<C> g;
  g.dx = a.dx + row * n;
  g.dr = nullptr;
  g.dh = nullptr;
  if constexpr (C::add) {
    if constexpr (C::wide_residual) g.dr = a.dr + row * n;
    g.dh = grad_residual_row<C>(a, dh_rows, row);
  }
  g.mu = mu;
  g.rs = rs;
  g.xs = C::from_output ? A(1) : g.rs;  // sum(g * xhat) = sum(dy * y), or rs * sum(g * (x - mu))
  g.c1 = sums[0] * inv_n * g.xs * g.xs;
  g.c0 = C::centered ? sums[K - 1] * inv_n : A(0);
  return g;
}

// add_rms_norm's grad_residual_out values at `col` of the row `dh` (null, or another norm:
// nothing loaded, and grad_input_store adds nothing).
template <typename C, int VEC>
__device__ __forceinline__ Held<typename C::R, VEC> load_grad_residual(const typename C::R* dh, int64_t col) {
  Held<typename C::R, VEC> h{};
  if constexpr (C::add)
    if (dh != nullptr) h = load_held<typename C::R, VEC>(dh + col);
  return h;
}

// VEC values of grad_input at `col`, written to grad_input and (a wider R) grad_residual. Adds
// dy * xhat into dwp and, for layer_norm, dy into dbp. dhv: add_rms_norm's grad_residual_out
// values (load_grad_residual), added when the row has them. The partials are always accumulated
// (a few FMAs) rather than behind a runtime pointer test, which would push the register arrays
// they live in to local memory.
template <typename C, int VEC, typename V, typename G, typename H, typename WV>
__device__ __forceinline__ void grad_input_store(const RowGrad<C>& r, const V& xv, const G& gv, const H& dhv,
                                                 const WV& wv, bool weighted, typename C::A offset,
                                                 int64_t col, typename C::A (&dwp)[VEC], typename C::A (&dbp)[VEC]) {
  using T = typename C::T;
  using R = typename C::R;
  using A = typename C::A;
  A dxv[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    A xq = acc_at(xv, k) - r.mu;
    const A dyk = acc_at(gv, k);
    const A g = weighted ? dyk * weight_scale<C>(A(acc_at(wv, k)), offset) : dyk;
    if constexpr (C::from_output)
      if (weighted) xq *= rcp_acc(weight_scale<C>(A(acc_at(wv, k)), offset));
    dxv[k] = r.rs * (g - r.c0 - r.c1 * xq);
    dwp[k] += dyk * (xq * r.xs);
    if constexpr (C::centered) dbp[k] += dyk;
    if constexpr (C::add)
      if (r.dh != nullptr) dxv[k] += acc_at(dhv, k);
  }
  store_from_acc<T, VEC>(r.dx + col, dxv);
  if constexpr (C::wide_residual) store_from_acc<R, VEC>(r.dr + col, dxv);
}

// Where the caching backward keeps its parameter-gradient partials (dy * xhat, and dy for
// layer_norm) across the rows it walks. rms_norm keeps them in registers. layer_norm's second
// partial and add_rms_norm's third input (grad_residual_out, 8 values a vector under 16-bit T)
// would cost the registers that four vectors in flight need under the 128-register cap of two
// resident blocks per SM, so those keep their partials in the block's shared memory instead.
template <typename C>
constexpr bool kPartialsInShared = C::centered || (C::add && sizeof(typename C::T) == 2);

// Partials in registers: VPT vectors of VEC accumulators per thread and partial.
template <typename A, int VEC, int TPR, int VPT, int kParts>
struct RegisterPartials {
  static constexpr int kDynamicBytes = 0;
  // Scratch for adding the slots' partials (static shared memory, when a block has several).
  static constexpr int kScratch = kBlock / TPR > 1 ? kBlock * VEC : 1;
  A v[kParts][VPT][VEC];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int p = 0; p < kParts; ++p)
#pragma unroll
      for (int i = 0; i < VPT; ++i)
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[p][i][k] = 0;
  }
  // f(dw, db) on vector i's accumulators (db: dw's again with one partial).
  template <typename F>
  __device__ __forceinline__ void update(int i, F&& f) {
    f(v[0][i], v[kParts - 1][i]);
  }
  // Writes the block's row of partial `p` (n values): the slots' partials added in slot order.
  __device__ __forceinline__ void store(int p, A* out, int n, A* scratch) {
    constexpr int kSlots = kBlock / TPR;
    const int lane = threadIdx.x % TPR;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if constexpr (kSlots == 1) {
        const int col = (i * TPR + lane) * VEC;
        if (col < n) store_acc<A, VEC>(out + col, v[p][i]);
      } else {
        __syncthreads();
#pragma unroll
        for (int k = 0; k < VEC; ++k) scratch[threadIdx.x * VEC + k] = v[p][i][k];
        __syncthreads();
        for (int j = threadIdx.x; j < TPR * VEC; j += kBlock) {
          const int col = i * TPR * VEC + j;
          if (col >= n) continue;
          A s = 0;
#pragma unroll
          for (int q = 0; q < kSlots; ++q) s += scratch[q * TPR * VEC + j];
          out[col] = s;
        }
      }
    }
  }
};

// Partials in dynamic shared memory: each of the block's kThreads threads owns its VPT vectors of
// each partial there, as 16-byte chunks laid out chunk-major, so that a warp's chunk accesses
// are conflict-free.
template <typename A, int VEC, int TPR, int VPT, int kParts, int kThreads = kBlock>
struct SharedPartials {
  using Chunk = Vec<A, 16 / sizeof(A)>;
  static constexpr int kPer = 16 / sizeof(A), kChunks = VEC / kPer;
  static_assert(VEC % kPer == 0, "a vector of accumulators is whole chunks");
  static constexpr int kDynamicBytes = kParts * VPT * kChunks * kThreads * 16;
  static constexpr int kScratch = 1;
  Chunk* base;

  __device__ __forceinline__ Chunk& chunk(int p, int i, int c, int thread) const {
    return base[((p * VPT + i) * kChunks + c) * kThreads + thread];
  }
  __device__ __forceinline__ void zero() {
    Chunk z;
#pragma unroll
    for (int k = 0; k < kPer; ++k) z.v[k] = 0;
#pragma unroll
    for (int p = 0; p < kParts; ++p)
#pragma unroll
      for (int i = 0; i < VPT; ++i)
#pragma unroll
        for (int c = 0; c < kChunks; ++c) chunk(p, i, c, threadIdx.x) = z;
  }
  template <typename F>
  __device__ __forceinline__ void update(int i, F&& f) {
    A v[kParts][VEC];
#pragma unroll
    for (int p = 0; p < kParts; ++p)
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const Chunk ch = chunk(p, i, c, threadIdx.x);
#pragma unroll
        for (int k = 0; k < kPer; ++k) v[p][c * kPer + k] = ch.v[k];
      }
    f(v[0], v[kParts - 1]);
#pragma unroll
    for (int p = 0; p < kParts; ++p)
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        Chunk ch;
#pragma unroll
        for (int k = 0; k < kPer; ++k) ch.v[k] = v[p][c * kPer + k];
        chunk(p, i, c, threadIdx.x) = ch;
      }
  }
  // As RegisterPartials::store (the slots added in the same order), after a block barrier.
  __device__ __forceinline__ void store(int p, A* out, int n, A*) {
    constexpr int kSlots = kThreads / TPR;
    __syncthreads();
    // Column e of the block's row is element e % VEC of vector e / (TPR * VEC) of lane
    // e / VEC % TPR: the columns in order, for coalesced stores.
    for (int e = threadIdx.x; e < VPT * TPR * VEC && e < n; e += kThreads) {
      const int i = e / (TPR * VEC), lane = e / VEC % TPR, k = e % VEC;
      A s = 0;
#pragma unroll
      for (int q = 0; q < kSlots; ++q) s += chunk(p, i, k / kPer, q * TPR + lane).v[k % kPer];
      out[e] = s;
    }
  }
};

template <typename C, int VEC, int TPR, int VPT>
using BackwardPartials =
    std::conditional_t<kPartialsInShared<C>, SharedPartials<typename C::A, VEC, TPR, VPT, C::centered ? 2 : 1>,
                       RegisterPartials<typename C::A, VEC, TPR, VPT, C::centered ? 2 : 1>>;

// The cluster backward's partials (one block of kClusterThreads an SM, a register cap of 128).
// Beside 16-bit rows' x and grad_output, layer_norm's two partials took all 128 registers and
// spilled 120-324 bytes (ptxas, sm_90) into local memory that every row read and wrote, and
// add_rms_norm's one partial beside a float32 residual row (twice the registers of x) 8-10
// bytes. Those keep them in shared memory instead: 128 KB (layer_norm) or 64 KB of the SM's
// 228 (VEC 8, VPT 4).
template <typename C>
constexpr bool kClusterPartialsInShared = (C::centered || C::wide_residual) && sizeof(typename C::T) == 2;

template <typename C, int VEC, int VPT>
using ClusterBackwardPartials =
    std::conditional_t<kClusterPartialsInShared<C>,
                       SharedPartials<typename C::A, VEC, kClusterThreads, VPT, C::centered ? 2 : 1, kClusterThreads>,
                       RegisterPartials<typename C::A, VEC, kClusterThreads, VPT, C::centered ? 2 : 1>>;

// Two resident blocks per SM (a register cap of 128) keep enough loads in flight; with more
// vectors per thread than the backward aims at, that cap would spill, so those keep one.
template <typename C, int VEC, int TPR, int VPT>
__global__ void __launch_bounds__(kBlock, VPT <= kBackwardVecs<C> ? 2 : 1)
    backward_kernel(BackwardArgs<C> a, RowLayout dy_rows, RowLayout x_rows, GradResidualRows<C::add> dh_rows,
                    int64_t num_rows, int n) {
  using T = typename C::T;
  using R = typename C::R;
  using A = typename C::A;
  using Partials = BackwardPartials<C, VEC, TPR, VPT>;
  constexpr int kSlots = kBlock / TPR;  // rows in flight per block
  constexpr int kSums = C::centered ? 2 : 1;
  __shared__ A scratch[2][kSums * kBlock / 32];
  extern __shared__ uint4 dynamic_shared[];
  const int lane = threadIdx.x % TPR, slot = threadIdx.x / TPR;
  const A inv_n = A(1) / A(n);
  Partials partials;
  if constexpr (kPartialsInShared<C>) partials.base = reinterpret_cast<typename Partials::Chunk*>(dynamic_shared);
  partials.zero();
  int parity = 0;
  // `base` is uniform across the block, so every thread meets the same barriers.
  for (int64_t base = int64_t(blockIdx.x) * kSlots; base < num_rows; base += int64_t(gridDim.x) * kSlots) {
    const int64_t row = base + slot;
    const bool active = row < num_rows;
    const R* xr = a.x + (active ? x_rows.offset(row) : 0);
    const T* gr = a.dy + (active ? dy_rows.offset(row) : 0);
    const R* hr = nullptr;
    if constexpr (C::add)
      if (active) hr = grad_residual_row<C>(a, dh_rows, row);
    // Held packed, so that every load of the row is issued before the first wait.
    Held<R, VEC> xv[VPT], hv[C::add ? VPT : 1];
    Held<T, VEC> gv[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (active && col < n) {
        xv[i] = load_held<R, VEC>(xr + col);
        gv[i] = load_held<T, VEC>(gr + col);
        if constexpr (C::add) hv[i] = load_grad_residual<C, VEC>(hr, col);
      }
    }
    // The weight's vectors in one batch, held through the row: loaded where each is used, each
    // load waited on the cache before the next could issue, twice a row. (Not a float32 weight
    // at eight vectors a thread, where the batch would spill.)
    constexpr bool kBatch = sizeof(typename C::W) == 2 || VPT <= 4;
    Held<typename C::W, VEC> wv[kBatch ? VPT : 1];
    if constexpr (kBatch) {
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int col = (i * TPR + lane) * VEC;
        if (active && col < n) wv[i] = load_weight<C, VEC>(a.w, col);
      }
    }
    const auto weight = [&](int i, int col) {
      if constexpr (kBatch) return wv[i];
      else return load_weight<C, VEC>(a.w, col);
    };
    const A mu = C::centered && active ? a.mean[row] : A(0);
    const A rs = active ? a.rstd[row] : A(0);  // (loaded now: needed only after the reduction)
    A sums[kSums] = {};
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (active && col < n) add_row_sums<C, VEC>(sums, xv[i], gv[i], weight(i, col), a.w != nullptr, mu, a.offset);
    }
    group_sum<TPR>(sums, scratch[parity]);
    parity ^= 1;
    if (!active) continue;
    const RowGrad<C> rg = row_grad<C>(a, dh_rows, row, n, sums, mu, rs, inv_n);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (col < n)
        partials.update(i, [&](A(&dwp)[VEC], A(&dbp)[VEC]) {
          grad_input_store<C, VEC>(rg, xv[i], gv[i], hv[C::add ? i : 0], weight(i, col), a.w != nullptr, a.offset,
                                   col, dwp, dbp);
        });
    }
  }
  const bool want_dw = a.dw_partial != nullptr, want_db = C::centered && a.db_partial != nullptr;
  if (!want_dw && !want_db) return;
  __shared__ A shared[Partials::kScratch];
  if (want_dw) partials.store(0, a.dw_partial + int64_t(blockIdx.x) * n, n, shared);
  if constexpr (C::centered)
    if (want_db) partials.store(1, a.db_partial + int64_t(blockIdx.x) * n, n, shared);
}

// The backward of rows too wide for a block to cache: a persistent grid of clusters, each
// walking a fixed set of rows. Each block keeps its share of the row's x and grad_output in
// registers (columns dealt as in the forward), and the parameter-gradient partials of its
// columns across the rows it walks (ClusterBackwardPartials: registers, or shared memory
// where registers would spill); the row sums go through the cluster (cluster_sum). Each
// cluster writes one row of the (clusters, n) partial buffers, each column by one thread.
template <typename C, int VEC, int VPT>
__global__ void __launch_bounds__(kClusterThreads, 1)
    backward_cluster_kernel(BackwardArgs<C> a, RowLayout dy_rows, RowLayout x_rows, GradResidualRows<C::add> dh_rows,
                            int64_t num_rows, int64_t n) {
  using T = typename C::T;
  using R = typename C::R;
  using A = typename C::A;
  constexpr int kSums = C::centered ? 2 : 1;
  __shared__ A warps[kSums * kClusterThreads / 32];
  __shared__ A totals[kSums];
  __shared__ ClusterInbox<A, kSums> box;
  extern __shared__ uint4 dynamic_shared[];
  cluster_inbox_init(box);
  const unsigned rank = cluster_rank(), blocks = cluster_blocks();
  const unsigned cluster = blockIdx.x / blocks, clusters = gridDim.x / blocks;
  const auto column = [&](int i) { return cluster_column<VEC>(i, blocks, rank); };
  const A inv_n = A(1) / A(n);
  using Partials = ClusterBackwardPartials<C, VEC, VPT>;
  Partials partials;
  if constexpr (Partials::kDynamicBytes > 0) partials.base = reinterpret_cast<typename Partials::Chunk*>(dynamic_shared);
  partials.zero();
  cluster_wait();  // every block's inbox is ready
  int exchange = 0;
  for (int64_t row = cluster; row < num_rows; row += clusters) {  // uniform across the cluster
    const R* xr = a.x + x_rows.offset(row);
    const T* gr = a.dy + dy_rows.offset(row);
    Vec<R, VEC> xv[VPT];
    Vec<T, VEC> gv[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (column(i) < n) {
        xv[i] = load_vec<R, VEC>(xr + column(i));
        gv[i] = load_vec<T, VEC>(gr + column(i));
      }
    }
    const A mu = C::centered ? a.mean[row] : A(0);
    A sums[kSums] = {};
#pragma unroll
    for (int i = 0; i < VPT; ++i)
      if (column(i) < n)
        add_row_sums<C, VEC>(sums, xv[i], gv[i], load_weight<C, VEC>(a.w, column(i)), a.w != nullptr, mu, a.offset);
    cluster_sum(sums, warps, box, exchange++, totals);
    const RowGrad<C> rg = row_grad<C>(a, dh_rows, row, n, sums, mu, a.rstd[row], inv_n);
#pragma unroll
    for (int i = 0; i < VPT; ++i)
      if (column(i) < n)
        partials.update(i, [&](A(&dwp)[VEC], A(&dbp)[VEC]) {
          grad_input_store<C, VEC>(rg, xv[i], gv[i], load_grad_residual<C, VEC>(rg.dh, column(i)),
                                   load_weight<C, VEC>(a.w, column(i)), a.w != nullptr, a.offset, column(i), dwp,
                                   dbp);
        });
  }
  // Each thread writes its own columns' partials (update leaves them as they are).
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (column(i) >= n) continue;
    partials.update(i, [&](A(&dwp)[VEC], A(&dbp)[VEC]) {
      if (a.dw_partial != nullptr) store_acc<A, VEC>(a.dw_partial + int64_t(cluster) * n + column(i), dwp);
      if constexpr (C::centered)
        if (a.db_partial != nullptr) store_acc<A, VEC>(a.db_partial + int64_t(cluster) * n + column(i), dbp);
    });
  }
}

// The sweeping backward (wide or unaligned rows): blockDim.x threads per row, blockDim.y row
// slots per block, each slot with its own row of each partial buffer.
template <typename C, int VEC>
__global__ void __launch_bounds__(kSweepThreads)
    backward_sweep_kernel(BackwardArgs<C> a, RowLayout dy_rows, RowLayout x_rows, GradResidualRows<C::add> dh_rows,
                          int64_t num_rows, int64_t n) {
  using T = typename C::T;
  using R = typename C::R;
  using A = typename C::A;
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
    const R* xr = a.x + (active ? x_rows.offset(row) : 0);
    const T* gr = a.dy + (active ? dy_rows.offset(row) : 0);
    const A mu = C::centered && active ? a.mean[row] : A(0);
    A sums[C::centered ? 2 : 1] = {};
    if (active)
      for (int64_t col = threadIdx.x * VEC; col < n; col += step)
        add_row_sums<C, VEC>(sums, load_vec<R, VEC>(xr + col), load_vec<T, VEC>(gr + col),
                             load_weight<C, VEC>(a.w, col), a.w != nullptr, mu, a.offset);
    sums[0] = row_sum(sums[0], scratch);
    if constexpr (C::centered) sums[1] = row_sum(sums[1], scratch);
    if (!active) continue;
    const RowGrad<C> rg = row_grad<C>(a, dh_rows, row, n, sums, mu, a.rstd[row], inv_n);
    for (int64_t col = threadIdx.x * VEC; col < n; col += step) {
      A dwp[VEC] = {}, dbp[VEC] = {};
      grad_input_store<C, VEC>(rg, load_vec<R, VEC>(xr + col), load_vec<T, VEC>(gr + col),
                               load_grad_residual<C, VEC>(rg.dh, col), load_weight<C, VEC>(a.w, col), a.w != nullptr,
                               a.offset, col, dwp, dbp);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        if (dw_row != nullptr) dw_row[col + k] += dwp[k];
        if (db_row != nullptr) db_row[col + k] += dbp[k];
      }
    }
  }
}

// out[j] = sum over p of partial[p, j], in the order p = 0, 1, ... (per column thread group,
// then the groups in order): reproducible. blockIdx.y picks the parameter: its (num_partials, n)
// partials follow the previous parameter's, and its sums go to out0 or out1 (weight and bias
// in one launch: a launch is several microseconds of host time that a small call feels).
template <typename A, typename W>
__global__ void __launch_bounds__(256) sum_partials_kernel(const A* __restrict__ partials, int64_t num_partials,
                                                           int64_t n, W* out0, W* out1) {
  __shared__ A sums[8][33];
  const A* __restrict__ partial = partials + int64_t(blockIdx.y) * num_partials * n;
  W* __restrict__ out = blockIdx.y == 0 ? out0 : out1;
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
  int cluster = 0;  // > 0: the cluster kernel (forward only), with this many blocks per row
};

// The caching shape for rows of `nvec` vectors, aiming at `target` vectors per thread: the
// fewest threads per row (from 8, up to a block) that reach it, then as many vectors as needed.
Shape cached_shape(int vec, int64_t nvec, int target, int max_cluster, int max_cluster_vpt) {
  Shape s;
  s.vec = vec;
  if (nvec > int64_t(kBlock) * kMaxVecsPerThread) {
    s.tpr = kSweepThreads;
    if (max_cluster > 0) {  // the fewest blocks at 4 vectors a thread, then (forward) 8 vectors
      int blocks = 2;
      while (blocks < max_cluster && int64_t(blocks) * kClusterThreads * 4 < nvec) blocks *= 2;
      int vpt = 4;
      if (int64_t(blocks) * kClusterThreads * vpt < nvec && max_cluster_vpt >= 8) vpt = 8;
      if (int64_t(blocks) * kClusterThreads * vpt >= nvec) {
        s.tpr = kClusterThreads;
        s.vpt = vpt;
        s.cluster = blocks;
      }
    }
    return s;
  }
  s.tpr = 8;
  while (s.tpr < kBlock && int64_t(s.tpr) * target < nvec) s.tpr *= 2;
  const int64_t per_thread = (nvec + s.tpr - 1) / s.tpr;
  s.vpt = per_thread <= 1 ? 1 : per_thread <= 2 ? 2 : per_thread <= 4 ? 4 : 8;
  return s;
}

// A tensor a kernel accesses by vectors: its data and the rows it is laid out by (null: its
// rows are contiguous, n apart), in elements of `elem_size` bytes. Null data: not accessed.
struct Operand {
  const void* data;
  const RowLayout* rows;
  int64_t elem_size;
};

// Vectors of `vec` elements (16 bytes of the op's narrow dtype) need n to be a multiple of vec
// and every operand's base pointer and row strides (and the parameters) to be 16-byte aligned;
// otherwise a scalar sweep (threads per row: a power of two from 32 to 256 covering the row,
// 256 / tpr rows per block, or 1024 for rows wider than 256 elements).
// max_cluster > 0: rows too wide to cache in a block may take the cluster kernels, with up to
// that many blocks and max_cluster_vpt vectors a thread.
Shape make_shape(const Problem& p, int vec, std::initializer_list<Operand> operands, int target,
                 int max_cluster = 0, int max_cluster_vpt = 4) {
  bool aligned = p.n % vec == 0;
  for (const std::optional<Tensor>* param : {&p.weight, &p.bias})
    aligned = aligned && (!*param || aligned16((*param)->const_data_ptr()));
  for (const Operand& o : operands) {
    if (o.data == nullptr) continue;
    aligned = aligned && aligned16(o.data);
    if (o.rows != nullptr)
      for (int d = 0; d < o.rows->ndim; ++d) aligned = aligned && (o.rows->strides[d] * o.elem_size) % 16 == 0;
  }
  if (aligned) return cached_shape(vec, (p.n + vec - 1) / vec, target, max_cluster, max_cluster_vpt);
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

template <typename T>
constexpr bool is_narrow_device = std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;

// Calls f(TypeTag<T>{}, TypeTag<W>{}) with the device storage types of dtype `t` (the op's
// narrow dtype: input, or grad_output) and of p's parameters (T, or float with 16-bit T).
template <typename F>
void dispatch_types(ScalarType t, const Problem& p, const char* op, F&& f) {
  dispatch_float(t, op, [&](auto tag) {
    using T = device_t<typename decltype(tag)::type>;
    if constexpr (is_narrow_device<T>) {
      if ((p.weight || p.bias) && p.param_dtype() == ScalarType::Float) return f(TypeTag<T>{}, TypeTag<float>{});
    }
    return f(TypeTag<T>{}, TypeTag<T>{});
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

// Blocks of `threads` threads of Kernel (with `dynamic_shared` bytes of dynamic shared memory,
// fixed per kernel) that fit on one SM at once, asked once per kernel and block size (the answer
// depends on the kernel's registers and shared memory).
template <auto Kernel>
int resident_blocks(int threads, int dynamic_shared = 0) {
  static std::atomic<int> cached[2] = {0, 0};
  std::atomic<int>& r = cached[threads > kBlock ? 1 : 0];
  int v = r.load(std::memory_order_relaxed);
  if (v == 0) {
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, Kernel, threads, size_t(dynamic_shared));
    v = std::max(v, 1);
    r.store(v, std::memory_order_relaxed);
  }
  return v;
}

// Lets Kernel use `bytes` of dynamic shared memory on `device`: beyond the default 48 KB a
// kernel must opt in, once per device (the attribute belongs to the device's context). `bytes`
// is the most any launch of Kernel asks: later calls change nothing.
template <auto Kernel>
void allow_dynamic_shared(int32_t device, int bytes, const char* op, bool all_shared = false) {
  constexpr int kDefaultLimit = 48 * 1024;
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> allowed[kMaxDevices] = {};
  if (bytes <= kDefaultLimit) return;
  if (device >= 0 && device < kMaxDevices && allowed[device].load(std::memory_order_relaxed)) return;
  const cudaError_t e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  STD_TORCH_CHECK(e == cudaSuccess, op, ": cannot give a CUDA kernel ", bytes,
                  " bytes of shared memory: ", cudaGetErrorString(e));
  // `all_shared`: the SM's whole carveout as shared memory (L1 keeps the rest), which the blocks
  // Kernel's launch bounds ask for need. A preference, so a refusal is harmless.
  if (all_shared && cudaFuncSetAttribute(Kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         cudaSharedmemCarveoutMaxShared) != cudaSuccess)
    (void)cudaGetLastError();
  if (device >= 0 && device < kMaxDevices) allowed[device].store(true, std::memory_order_relaxed);
}

// Whether a block of Kernel can have `dynamic_shared` bytes of dynamic shared memory on `device`
// beside its static shared memory. Not every GPU that runs clusters has sm_90's 227 KB a block
// (sm_120 has 99 KB). Asked once per kernel: a process drives GPUs of one architecture here.
template <auto Kernel>
bool dynamic_shared_fits(int32_t device, int dynamic_shared) {
  static const bool fits = [&] {
    int most = 0;
    cudaFuncAttributes attributes;
    if (cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
        cudaFuncGetAttributes(&attributes, Kernel) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return int64_t(attributes.sharedSizeBytes) + dynamic_shared <= most;
  }();
  return fits;
}

// Whether Kernel (a cluster kernel) runs its real code on the current GPU: the code the GPU
// runs was compiled for sm_90 or newer (ptxVersion: the virtual architecture it came from).
// Asked once per kernel; a process drives GPUs of one architecture here.
template <auto Kernel>
bool cluster_kernel_usable() {
  static const bool usable = [] {
    cudaFuncAttributes attributes;
    if (cudaFuncGetAttributes(&attributes, Kernel) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return attributes.ptxVersion >= 90 && attributes.binaryVersion >= 90;
  }();
  return usable;
}

// The launch configuration of `grid` blocks of kClusterThreads in clusters of `cluster` blocks.
// The configuration points at `attribute`, the caller's, which holds the cluster size.
inline cudaLaunchConfig_t cluster_config(unsigned grid, int cluster, int dynamic_shared, cudaStream_t stream,
                                         cudaLaunchAttribute& attribute) {
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = unsigned(cluster);
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(kClusterThreads);
  config.dynamicSmemBytes = size_t(dynamic_shared);
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return config;
}

// Launches `kernel` on `grid` blocks in clusters of `cluster` blocks (more than 8: sm_90's
// non-portable sizes, which the kernel must have been allowed, see allow_large_clusters).
template <typename... KernelArgs, typename... Args>
void launch_cluster(void (*kernel)(KernelArgs...), unsigned grid, int cluster, int dynamic_shared, cudaStream_t stream,
                    const char* op, Args&&... args) {
  cudaLaunchAttribute cluster_dim;
  const cudaLaunchConfig_t config = cluster_config(grid, cluster, dynamic_shared, stream, cluster_dim);
  const cudaError_t e = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (e != cudaSuccess) (void)cudaGetLastError();  // raised here, not by the next CUDA call's check
  STD_TORCH_CHECK(e == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(e));
}

// Lets Kernel run in clusters of more than 8 blocks (sm_90's non-portable sizes) on the current
// GPU. The attribute belongs to the device's context, so it is set once per device (a process
// that ran a wide norm backward on cuda:0 and then on cuda:1 launched there without it); false
// where it is refused.
template <auto Kernel>
bool allow_large_clusters() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> state[kMaxDevices] = {};  // 0: not asked yet, 1: allowed, -1: refused
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) (void)cudaGetLastError();
  const bool kept = device >= 0 && device < kMaxDevices;
  int v = kept ? state[device].load(std::memory_order_relaxed) : 0;
  if (v == 0) {
    v = cudaFuncSetAttribute(Kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess ? 1 : -1;
    if (v < 0) (void)cudaGetLastError();
    if (kept) state[device].store(v, std::memory_order_relaxed);
  }
  return v > 0;
}

// Clusters of `cluster` blocks of Kernel, with `dynamic_shared` bytes each (fixed per kernel),
// that can be resident at once (0: none fit, or clusters unsupported), asked once per kernel and
// size (a process drives GPUs of one architecture here); sizes above 8 are allowed first, on
// each device.
template <auto Kernel>
int resident_clusters(int cluster, int dynamic_shared = 0) {
  if (cluster > kMaxCluster && !allow_large_clusters<Kernel>()) return 0;
  static std::atomic<int> cached[kMaxBackwardCluster + 1] = {};
  std::atomic<int>& r = cached[cluster];
  int v = r.load(std::memory_order_relaxed);
  if (v == 0) {
    cudaLaunchAttribute cluster_dim;
    const cudaLaunchConfig_t config = cluster_config(unsigned(cluster), cluster, dynamic_shared, nullptr, cluster_dim);
    if (cudaOccupancyMaxActiveClusters(&v, Kernel, &config) != cudaSuccess || v <= 0) {
      (void)cudaGetLastError();
      v = -1;
    }
    r.store(v, std::memory_order_relaxed);
  }
  return std::max(v, 0);
}

// The staged forward's cluster and chunk for rows of n values of T: the fewest blocks (up to
// kMaxCluster) whose chunks fit kStagedChunkBytes; none (blocks == 0) where that takes more.
struct Staging {
  int blocks = 0;
  int chunk = 0;  // columns per block, a multiple of the vector
};

template <typename T>
Staging staging_for(int64_t n) {
  constexpr int64_t kVec = 16 / sizeof(T);
  const int64_t blocks = std::max<int64_t>(1, (n * int64_t(sizeof(T)) + kStagedChunkBytes - 1) / kStagedChunkBytes);
  const int64_t chunk = ((n + blocks - 1) / blocks + kVec - 1) / kVec * kVec;
  Staging st;
  if (blocks > kMaxCluster || chunk * int64_t(sizeof(T)) > kStagedChunkBytes) return st;
  st.blocks = int(blocks);
  st.chunk = int(chunk);
  return st;
}

// Clusters of `cluster` blocks of Kernel, with `dynamic_shared` bytes each, resident at once
// (at least 1); the last answer is kept, as a process asks about few shapes.
template <auto Kernel>
int resident_clusters_with_shared(int cluster, int dynamic_shared) {
  thread_local int last_cluster = 0, last_shared = -1, last = 1;
  if (cluster != last_cluster || dynamic_shared != last_shared) {
    cudaLaunchAttribute cluster_dim;
    const cudaLaunchConfig_t config = cluster_config(unsigned(cluster), cluster, dynamic_shared, nullptr, cluster_dim);
    int v = 0;
    if (cudaOccupancyMaxActiveClusters(&v, Kernel, &config) != cudaSuccess) (void)cudaGetLastError();
    last_cluster = cluster, last_shared = dynamic_shared, last = std::max(v, 1);
  }
  return last;
}

// One forward of the kernels configured by C, with add_rms_norm's residual (and its rows) when C::add.
template <typename C>
void launch_forward(const Problem& p, const ForwardOutputs& o, const Tensor* residual, const RowLayout* residual_rows,
                    const char* op) {
  using T = typename C::T;
  using W = typename C::W;
  using R = typename C::R;
  using A = typename C::A;
  constexpr int kVec = 16 / sizeof(T);
  ForwardArgs<C> a{reinterpret_cast<const T*>(p.input.const_data_ptr()),
                   param_ptr<W>(p.weight),
                   param_ptr<W>(p.bias),
                   reinterpret_cast<T*>(o.out.mutable_data_ptr()),
                   data_or_null<A>(o.mean),
                   reinterpret_cast<A*>(o.rstd.mutable_data_ptr()),
                   nullptr,
                   nullptr,
                   A(p.offset),
                   p.cast_before_weight};
  ResidualRows<C::add> res_rows;
  if constexpr (C::add) {
    a.r = reinterpret_cast<const R*>(residual->const_data_ptr());
    a.h = reinterpret_cast<R*>(o.residual_out->mutable_data_ptr());
    res_rows.r = *residual_rows;
    res_rows.h = o.residual_out_rows;
  }
  // Rows past what a block caches go to clusters on sm_90: staged in shared memory (rms_norm,
  // layer_norm), or cached in registers (add_rms_norm, whose two inputs would halve the chunk).
  bool clusters = false;
  if constexpr (C::add) clusters = cluster_kernel_usable<forward_cluster_kernel<C, kVec, 4>>();
  else clusters = cluster_kernel_usable<forward_staged_kernel<C, kVec>>();
  Shape s = make_shape(p, kVec,
                       {{a.x, &p.rows, sizeof(T)},
                        {a.y, nullptr, sizeof(T)},
                        {a.r, residual_rows, sizeof(R)},
                        {a.h, &o.residual_out_rows, sizeof(R)}},
                       forward_target<C>(), clusters ? kMaxCluster : 0, 8);
  const cudaStream_t stream = current_stream(p.input.get_device_index());
  if constexpr (!C::add) {
    // The staged chunks cover every width the register clusters would (8 blocks of 512 threads x
    // 8 vectors, 8 x 64 KB), so s.cluster > 0 finds a staging; the sweep below is only a guard.
    const Staging st = staging_for<T>(p.n);
    if (s.cluster > 0 && st.blocks > 0) {
      constexpr auto kStaged = forward_staged_kernel<C, kVec>;
      const int shared = st.chunk * int(sizeof(T));
      // The kernel's limit is set once, to what any row asks (allow_dynamic_shared's contract).
      allow_dynamic_shared<kStaged>(p.input.get_device_index(), kStagedChunkBytes, op, true);
      const int64_t resident = std::min<int64_t>(p.num_rows, resident_clusters_with_shared<kStaged>(st.blocks, shared));
      launch_cluster(kStaged, grid_size(op, resident * st.blocks), st.blocks, shared, stream, op, a, p.rows,
                     p.num_rows, int(p.n), st.chunk, A(p.eps));
      check_launch(op);
      return;
    }
    if (s.cluster > 0) s = Shape{s.vec, kSweepThreads, 0, 0};
  }
  if (s.cluster > 0) {
    if constexpr (C::add) {
      const auto launch = [&](auto kernel) {
        launch_cluster(kernel, grid_size(op, p.num_rows * s.cluster), s.cluster, 0, stream, op, a, p.rows, res_rows,
                       p.n, A(p.eps));
      };
      if (s.vpt == 4) launch(forward_cluster_kernel<C, kVec, 4>);
      else launch(forward_cluster_kernel<C, kVec, 8>);
    }
  } else if (s.vpt == 0) {
    const int rpb = sweep_rows_per_block(s);
    const auto launch = [&](auto kernel) {
      kernel<<<grid_size(op, (p.num_rows + rpb - 1) / rpb), dim3(s.tpr, rpb), 0, stream>>>(a, p.rows, res_rows,
                                                                                         p.num_rows, p.n, A(p.eps));
    };
    if (s.vec == 1) launch(forward_sweep_kernel<C, 1>);
    else launch(forward_sweep_kernel<C, kVec>);
  } else {
    const auto launch = [&](auto vec, auto tag) {
      using Tag = decltype(tag);
      constexpr int kRows = kBlock / Tag::tpr;
      forward_kernel<C, decltype(vec)::value, Tag::tpr, Tag::vpt>
          <<<grid_size(op, (p.num_rows + kRows - 1) / kRows), kBlock, 0, stream>>>(a, p.rows, res_rows, p.num_rows,
                                                                                  int(p.n), A(p.eps), A(1) / A(p.n));
    };
    dispatch_cached<T>(s, op, launch, CachedShapes<forward_target<C>()>{});
  }
  check_launch(op);
}

// One backward of the kernels configured by C.
template <typename C>
void launch_backward(const BackwardProblem& p, const BackwardOutputs& o, const char* op) {
  using T = typename C::T;
  using W = typename C::W;
  using R = typename C::R;
  using A = typename C::A;
  constexpr int kVec = 16 / sizeof(T);
  BackwardArgs<C> a{reinterpret_cast<const T*>(p.grad_output.const_data_ptr()),
                    reinterpret_cast<const R*>(p.input.const_data_ptr()),
                    param_ptr<W>(p.weight),
                    param_ptr<A>(p.mean),
                    reinterpret_cast<const A*>(p.rstd.const_data_ptr()),
                    reinterpret_cast<T*>(o.grad_input.mutable_data_ptr()),
                    nullptr,
                    nullptr,
                    nullptr,
                    nullptr,
                    A(p.offset)};
  GradResidualRows<C::add> dh_rows;
  if constexpr (C::add) {
    a.dh = param_ptr<R>(p.grad_residual_out);
    a.dr = data_or_null<R>(o.grad_residual);
    dh_rows.dh = p.grad_residual_rows;
  }
  Shape s = make_shape(p, kVec,
                       {{a.dy, &p.grad_rows, sizeof(T)},
                        {a.x, &p.rows, sizeof(R)},
                        {a.dh, &p.grad_residual_rows, sizeof(R)},
                        {a.dx, nullptr, sizeof(T)},
                        {a.dr, nullptr, sizeof(R)}},
                       kBackwardVecs<C>,
                       cluster_kernel_usable<backward_cluster_kernel<C, kVec, kClusterBackwardVecs>>()
                           ? kMaxBackwardCluster
                           : 0,
                       kClusterBackwardVecs);
  const int32_t device = p.input.get_device_index();
  const cudaStream_t stream = current_stream(device);
  const int64_t sms = multiprocessor_count(device);
  // Allocates the (num_partials, n) partial buffers, runs `launch` (which fills them), and adds
  // them up into the parameter gradients.
  const auto run_partials = [&](int64_t num_partials, auto&& launch) {
    const int64_t params = int64_t(p.want_grad_weight) + int64_t(p.want_grad_bias);
    if (params == 0) {
      launch();
      check_launch(op);
      return;
    }
    // The wanted parameters in order (weight, then bias), each with its partial rows and its gradient.
    Tensor partial = empty_like_device(p.input, {params, num_partials, p.n}, acc_dtype(p.grad_output.scalar_type()));
    A* base = reinterpret_cast<A*>(partial.mutable_data_ptr());
    W* outs[2] = {nullptr, nullptr};
    int k = 0;
    if (p.want_grad_weight) {
      a.dw_partial = base + k * num_partials * p.n;
      outs[k++] = reinterpret_cast<W*>(o.grad_weight.mutable_data_ptr());
    }
    if (p.want_grad_bias) {
      a.db_partial = base + k * num_partials * p.n;
      outs[k++] = reinterpret_cast<W*>(o.grad_bias->mutable_data_ptr());
    }
    launch();
    check_launch(op);
    const dim3 sum_grid(unsigned((p.n + 31) / 32), unsigned(params)), sum_block(32, 8);
    sum_partials_kernel<A, W><<<sum_grid, sum_block, 0, stream>>>(base, num_partials, p.n, outs[0], outs[1]);
    check_launch(op);
  };
  // One wave of resident blocks, each walking its rows: as few partial rows to add up as
  // the bandwidth allows.
  const auto run = [&](auto kernel_tag, int64_t blocks_needed, dim3 block, int64_t partials_per_block,
                       int dynamic_shared = 0) {
    constexpr auto kernel = decltype(kernel_tag)::value;
    allow_dynamic_shared<kernel>(device, dynamic_shared, op);
    const int64_t blocks =
        std::min(blocks_needed, sms * resident_blocks<kernel>(int(block.x * block.y), dynamic_shared));
    run_partials(blocks * partials_per_block, [&] {
      kernel<<<grid_size(op, blocks), block, size_t(dynamic_shared), stream>>>(a, p.grad_rows, p.rows, dh_rows,
                                                                            p.num_rows, p.n);
    });
  };
  if (s.cluster > 0) {
    constexpr auto kernel = backward_cluster_kernel<C, kVec, kClusterBackwardVecs>;
    constexpr int kShared = ClusterBackwardPartials<C, kVec, kClusterBackwardVecs>::kDynamicBytes;
    int64_t resident = 0;  // (where a block cannot have kShared bytes, none: the rows are swept)
    if (dynamic_shared_fits<kernel>(device, kShared)) {
      allow_dynamic_shared<kernel>(device, kShared, op);
      resident = resident_clusters<kernel>(s.cluster, kShared);
    }
    if (resident > 0) {
      const int64_t clusters = std::min(p.num_rows, resident);
      run_partials(clusters, [&] {
        launch_cluster(kernel, grid_size(op, clusters * s.cluster), s.cluster, kShared, stream, op, a, p.grad_rows,
                       p.rows, dh_rows, p.num_rows, p.n);
      });
      return;
    }
    s.tpr = kSweepThreads;  // no cluster of that size fits on this GPU: sweep
    s.vpt = 0;
    s.cluster = 0;
  }
  const auto sweep = [&] {
    const int rpb = sweep_rows_per_block(s);
    const int64_t needed = (p.num_rows + rpb - 1) / rpb;
    if (s.vec == 1) run(Constant<backward_sweep_kernel<C, 1>>{}, needed, dim3(s.tpr, rpb), rpb);
    else run(Constant<backward_sweep_kernel<C, kVec>>{}, needed, dim3(s.tpr, rpb), rpb);
  };
  if (s.vpt == 0) {
    sweep();
    return;
  }
  const auto launch = [&](auto vec, auto tag) {
    using Tag = decltype(tag);
    constexpr int kRows = kBlock / Tag::tpr;
    constexpr int kVecT = decltype(vec)::value;
    constexpr auto kernel = backward_kernel<C, kVecT, Tag::tpr, Tag::vpt>;
    constexpr int kShared = BackwardPartials<C, kVecT, Tag::tpr, Tag::vpt>::kDynamicBytes;
    if (!dynamic_shared_fits<kernel>(device, kShared)) {
      // (layer_norm's 16-bit rows of 8K-16K keep 128 KB of partial sums a block, more than the
      // 99 KB a block of sm_86, sm_89 and sm_120 can have: those rows are swept there)
      s.tpr = kSweepThreads;
      s.vpt = 0;
      sweep();
      return;
    }
    run(Constant<kernel>{}, (p.num_rows + kRows - 1) / kRows, dim3(kBlock), 1, kShared);
  };
  dispatch_cached<T>(s, op, launch, CachedShapes<kBackwardVecs<C>>{});
}

// rms_norm (kCentered false) or layer_norm (true): writes o.out, o.rstd and (layer_norm) o.mean.
template <bool kCentered>
void forward(const Problem& p, const ForwardOutputs& o, const char* op) {
  if (p.empty()) return;
  torch::stable::accelerator::DeviceGuard guard(p.input.get_device_index());
  dispatch_types(p.input.scalar_type(), p, op, [&](auto ttag, auto wtag) {
    using T = typename decltype(ttag)::type;
    using W = typename decltype(wtag)::type;
    if constexpr (!kCentered) {
      // Rounding before the weight changes nothing without a weight or for a 32/64-bit T.
      if (p.offset != 0 || (p.cast_before_weight && p.weight && is_narrow_device<T>))
        return launch_forward<Config<false, Variant::kOptions, T, W>>(p, o, nullptr, nullptr, op);
    }
    launch_forward<Config<kCentered, Variant::kPlain, T, W>>(p, o, nullptr, nullptr, op);
  });
}

// add_rms_norm and add_rms_norm_: writes o.out, o.residual_out and o.rstd. (A template only so
// that the translation units that do not call it compile none of its kernels.)
template <typename = void>
void add_forward(const AddProblem& p, const ForwardOutputs& o, const char* op) {
  if (p.empty()) return;  // (norm.h refused an in-place residual whose rows share memory)
  torch::stable::accelerator::DeviceGuard guard(p.input.get_device_index());
  const bool wide = p.residual.scalar_type() != p.input.scalar_type();
  dispatch_types(p.input.scalar_type(), p, op, [&](auto ttag, auto wtag) {
    using T = typename decltype(ttag)::type;
    using W = typename decltype(wtag)::type;
    if constexpr (is_narrow_device<T>) {
      if (wide)
        return launch_forward<Config<false, Variant::kAdd, T, W, float>>(p, o, &p.residual, &p.residual_rows, op);
    }
    launch_forward<Config<false, Variant::kAdd, T, W>>(p, o, &p.residual, &p.residual_rows, op);
  });
}

// The backward of rms_norm (kCentered false) or layer_norm (true): writes o.grad_input and the
// wanted parameter gradients.
template <bool kCentered>
void backward(const BackwardProblem& p, const BackwardOutputs& o, const char* op) {
  if (p.empty()) return;
  torch::stable::accelerator::DeviceGuard guard(p.input.get_device_index());
  dispatch_types(p.grad_output.scalar_type(), p, op, [&](auto ttag, auto wtag) {
    using T = typename decltype(ttag)::type;
    using W = typename decltype(wtag)::type;
    if constexpr (!kCentered) {
      if (p.saved_is_output) return launch_backward<Config<false, Variant::kFromOutput, T, W>>(p, o, op);
      if (p.offset != 0) return launch_backward<Config<false, Variant::kOptions, T, W>>(p, o, op);
    }
    launch_backward<Config<kCentered, Variant::kPlain, T, W>>(p, o, op);
  });
}

// The backward of add_rms_norm: writes o.grad_input, o.grad_residual where present and the
// weight gradient. Always the add kernels (a gradient usually reaches residual_out), so that
// add_rms_norm's translation unit compiles none of rms_norm's. (A template for the same reason
// as add_forward.)
template <typename = void>
void add_backward(const BackwardProblem& p, const BackwardOutputs& o, const char* op) {
  if (p.empty()) return;
  torch::stable::accelerator::DeviceGuard guard(p.input.get_device_index());
  const bool wide = p.input.scalar_type() != p.grad_output.scalar_type();  // a float32 residual_out
  dispatch_types(p.grad_output.scalar_type(), p, op, [&](auto ttag, auto wtag) {
    using T = typename decltype(ttag)::type;
    using W = typename decltype(wtag)::type;
    if constexpr (is_narrow_device<T>) {
      if (wide) return launch_backward<Config<false, Variant::kAdd, T, W, float>>(p, o, op);
    }
    launch_backward<Config<false, Variant::kAdd, T, W>>(p, o, op);
  });
}

// The kernels as one type, for the registered functions shared by both backends (norm_ops.h).
// Member templates, so that a translation unit compiles only the kernels its functions call.
struct Kernels {
  template <bool kCentered>
  static void forward(const Problem& p, const ForwardOutputs& o, const char* op) {
    cuda::forward<kCentered>(p, o, op);
  }
  template <bool kCentered>
  static void backward(const BackwardProblem& p, const BackwardOutputs& o, const char* op) {
    cuda::backward<kCentered>(p, o, op);
  }
  template <typename = void>
  static void add_forward(const AddProblem& p, const ForwardOutputs& o, const char* op) {
    cuda::add_forward(p, o, op);
  }
  template <typename = void>
  static void add_backward(const BackwardProblem& p, const BackwardOutputs& o, const char* op) {
    cuda::add_backward(p, o, op);
  }
};

}  // namespace
}  // namespace fusedops::norm::cuda
