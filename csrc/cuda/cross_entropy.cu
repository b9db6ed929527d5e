// cross_entropy, cross_entropy_ and their backward scaling on CUDA (the math:
// fusedops/cross_entropy.h).
//
// Memory-bound: the point is to read each logits row once and, when a gradient is wanted, to
// write the gradient once, with no pass in the backward. A forward is three launches:
// 1. targets_kernel, one block: the "mean" denominators (weights of the rows not ignored, their
//    count), the sum of the class weights, and the first bad target, all in a fixed order
//    (deterministic, no atomics) and on the device (no host sync). Targets are 8 bytes a row
//    against the row's V logits: this costs a few microseconds.
// 2. the row kernel. A row stays on chip between its log-sum-exp and its gradient: a block of
//    512 threads (or, for wide rows on sm_90, a thread-block cluster of up to 8 of them, with
//    the row split between the blocks) keeps the row in registers, VPT 16-byte vectors a thread
//    (as stored: 8 bf16 values in 4 registers). Each thread reduces its values to (max, sum of
//    exp relative to that max, and for label smoothing sum of w_j (max - x_j) and sum of w_j);
//    warps, then the block, then the cluster (through distributed shared memory, cuda_norm.cuh's
//    machinery) combine those in a fixed order, so every thread ends with the same row
//    statistics, bit for bit. The gradient is then written from the registers with 16-byte
//    stores. Up to 8 x 512 x 8 vectors: 262144 bf16/fp16 or 131072 fp32 classes per row. Two
//    blocks share an SM (64 registers a thread at most), one loading while the other computes.
//    The kernel is bound by instructions as much as by memory, so a column's work is kept to
//    about five instructions (see share_stats): at 8192 x 128256 bf16 on the H200 (ncu) that cut
//    the kernel from 2.02 to 1.48 ms with a gradient and from 1.34 to 0.93 ms without; the
//    cheaper combine (warp_combine) took a little more. (A persistent variant that streamed
//    rows through shared memory with bulk copies, two rows in flight a block, ran slower: one
//    block of 16 warps an SM could not hide the latencies that two blocks do.)
//    Everything else (wider rows, other architectures for rows wider than a block, float64,
//    rows whose strides or base, or class weights with label smoothing whose base, are not
//    16-byte aligned) takes the sweep kernel: one block per row, an online-softmax pass, then
//    a gradient pass that reads the row again (mostly from L2: a block works on one row at a
//    time).
//    Without a gradient, rows of more than one block's vectors are read as slices instead: a
//    block per slice of a row writes the slice's statistics and a second kernel merges each
//    row's (split_kernel, combine_kernel).
//    Rows whose target is ignore_index are not read; their gradient rows are written as zeros.
// 3. sum_kernel, one block: "mean"/"sum" add the per-row losses in row order.
// The backward (scale_kernel) multiplies the gradient by grad_output, read on the device; in
// place, a row whose scale is exactly 1 is skipped, so loss.backward() reads nothing.
// linear_cross_entropy's low-memory mode has two kernels of its own over slices of the classes
// (slice_stats_kernel, slice_grad_kernel): a block per row walking the slice as the sweep does.
// Offsets are 64-bit; columns within a row are 32-bit (V < 2^31 is checked).
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <cmath>
#include <type_traits>

#include "fusedops/cross_entropy.h"
#include "fusedops/cuda_norm.cuh"  // the cluster machinery (cluster_rank, launch_cluster, ...)
#include "fusedops/cuda_utils.cuh"

namespace fusedops::cross_entropy::cuda {
namespace {

using namespace fusedops::cuda;
using fusedops::norm::cuda::cluster_blocks;
using fusedops::norm::cuda::cluster_exchange;
using fusedops::norm::cuda::cluster_inbox_init;
using fusedops::norm::cuda::cluster_rank;
using fusedops::norm::cuda::cluster_wait;
using fusedops::norm::cuda::ClusterInbox;

constexpr int kThreads = fusedops::norm::cuda::kClusterThreads;  // 512: the cluster launcher's block
static_assert(kThreads == 512, "the row kernels assume 16 warps");
constexpr int kWarps = kThreads / 32;
constexpr int kMaxCluster = 8;
constexpr int kTargetThreads = 1024;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename A>
struct Args {
  const void* x;  // logits rows (T)
  RowLayout rows;
  const void* target;  // int64, or int32 when target32
  bool target32;
  const void* weight;  // null, or V values of T, or float32 when weight32
  bool weight32;
  void* grad;  // null: no gradient
  RowLayout grad_rows;
  A* lse;
  A* rowloss;      // per-row contributions ("none": the loss itself)
  const A* stats;  // Dw, Dn, sum of weights
  int64_t ignore_index;
  int V;
  bool mean, softcap, weighted, smoothing;
  // (reciprocals from the host: no division in the kernels; cap_k = 2 log2(e) / cap)
  A eps, z, cap, inv_cap, cap_k, inv_v;
};

// Sets a's softcap and the constants its kernels take (softcap <= 0: none).
template <typename A>
void set_softcap(Args<A>& a, double softcap) {
  const double cap = softcap > 0 ? softcap : 1.0;
  a.softcap = softcap > 0;
  a.cap = A(cap);
  a.inv_cap = A(1.0 / cap);
  a.cap_k = A(2.0 / std::log(2.0) / cap);
}

// The options a register kernel is compiled for: none; label smoothing without class weights
// (the common training setting, which stays on the fast path at one more add a value);
// softcap, with or without that smoothing (Gemma 2's logits); class-weighted smoothing, with or
// without softcap (the class weights loaded beside the logits).
enum class Opts { kNone, kSmooth, kCap, kWeightedSmooth };

template <typename A>
Opts options_of(const Args<A>& a) {
  if (a.smoothing && a.weighted) return Opts::kWeightedSmooth;
  if (a.softcap) return Opts::kCap;
  return a.smoothing ? Opts::kSmooth : Opts::kNone;
}

// f(std::integral_constant<Opts, O>) for the O that a's options need: the kernel to launch.
template <typename A, typename F>
decltype(auto) with_options(const Args<A>& a, F&& f) {
  switch (options_of(a)) {
    case Opts::kNone:
      return f(std::integral_constant<Opts, Opts::kNone>{});
    case Opts::kSmooth:
      return f(std::integral_constant<Opts, Opts::kSmooth>{});
    case Opts::kCap:
      return f(std::integral_constant<Opts, Opts::kCap>{});
    default:
      return f(std::integral_constant<Opts, Opts::kWeightedSmooth>{});
  }
}

// 2^x in one MUFU instruction (denormal results flush to 0, which no sum of exponentials here
// notices): exp2f's range fix-ups cost more instructions than the rest of a column's work.
__device__ __forceinline__ float ex2_approx(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

template <typename A>
__device__ __forceinline__ A a_exp(A v) {
  if constexpr (sizeof(A) == 8)
    return exp(v);
  else
    return ex2_approx(v * kLog2e);
}

// A sum the compiler may not fuse with the product before it into an FMA: a butterfly's two
// lanes must compute the same bits (warp_combine relies on it).
template <typename A>
__device__ __forceinline__ A add_rn(A x, A y) {
  if constexpr (sizeof(A) == 8)
    return __dadd_rn(x, y);
  else
    return __fadd_rn(x, y);
}

template <typename A>
__device__ __forceinline__ A a_log(A v) {
  if constexpr (sizeof(A) == 8)
    return log(v);
  else
    return logf(v);
}

template <typename A>
__device__ __forceinline__ A neg_inf() {
  if constexpr (sizeof(A) == 8)
    return __longlong_as_double(static_cast<long long>(0xfff0000000000000ull));
  else
    return __int_as_float(static_cast<int>(0xff800000u));
}

// softcap(v) = cap tanh(v / cap). In float32 as cap - 2 cap / (1 + e^(2 v / cap)): one MUFU
// exponential and one MUFU reciprocal, where tanhf's range split and polynomial took ~20
// instructions and a branch a value (three times a value with a gradient: softcap was the
// slow path). The approximate exponential's error leaves the result within about 3e-7 cap of
// the true one (4 ulp of float32 at cap; the logits' own rounding in bf16 is ~1e4 times that);
// e = inf gives cap, e = 0 gives -cap, NaN stays NaN.
template <typename A>
__device__ __forceinline__ A capped(A v, const Args<A>& a) {
  if (!a.softcap) return v;
  if constexpr (sizeof(A) == 8) {
    return a.cap * tanh(v * a.inv_cap);
  } else {
    const float e = ex2_approx(v * a.cap_k);
    return fmaf(-2.f * a.cap, fusedops::norm::cuda::rcp_acc(1.f + e), a.cap);
  }
}

template <typename T, typename A>
__device__ __forceinline__ A weight_at(const Args<A>& a, int64_t j) {
  if (a.weight32) return A(static_cast<const float*>(a.weight)[j]);
  return A(to_acc(static_cast<const T*>(a.weight)[j]));
}

__device__ __forceinline__ int64_t target_at(const void* t, bool t32, int64_t i) {
  return t32 ? int64_t(static_cast<const int32_t*>(t)[i]) : static_cast<const int64_t*>(t)[i];
}

// A share's statistics (a thread's values, then a warp's, a block's, a cluster's, the row's):
// the maximum m, the sum of exp(x_j - m), and, for label smoothing, wx = sum of w_j (m - x_j)
// and w = sum of w_j. The smoothing sum is kept relative to m as the exponentials are: a plain
// sum of w_j x_j loses float32's precision for logits far from 0 (at 1e7 its spacing is 512, the
// loss wants W lse - sum w_j x_j to 1e-6), while these terms are never negative, so their sum
// keeps its relative precision whatever the logits.
template <typename A>
struct Stats {
  A m, s, wx, w;
};

// m - x, and +inf for x = -inf even where m is -inf too (a share of -inf logits): such a logit's
// smoothing term is w_j * inf, as torch's.
template <typename A>
__device__ __forceinline__ A below(A m, A x) {
  return x == neg_inf<A>() ? -neg_inf<A>() : m - x;
}

// The base the exponentials of a share with maximum m are taken from: m, or 0 while m is -inf,
// when the share holds only -inf (each exp(v - 0) is 0; exp(-inf - -inf) would be NaN) or NaN
// as well. The maximum skips NaN; the sum must not, or a NaN logit would vanish from its row's
// loss (torch's is NaN).
template <typename A>
__device__ __forceinline__ A exp_base(A m) {
  return m == neg_inf<A>() ? A(0) : m;
}

// The share's statistics relative to a maximum mm >= st.m: the exponentials scaled by
// exp(st.m - mm), every value (mm - st.m) further below. (No weight, nothing to move: an empty
// share's m is -inf.)
template <bool kSmooth, typename A>
__device__ __forceinline__ void rebase(Stats<A>& st, A mm) {
  if (st.m == mm) return;
  st.s *= a_exp(st.m - mm);  // (st.m = -inf: s is 0, or NaN, which stays)
  if (kSmooth && st.w != A(0)) st.wx += st.w * (mm - st.m);
  st.m = mm;
}

// Adds share o into st.
template <bool kSmooth, typename A>
__device__ __forceinline__ void merge(Stats<A>& st, Stats<A> o) {
  const A mm = o.m > st.m ? o.m : st.m;
  rebase<kSmooth>(st, mm);
  rebase<kSmooth>(o, mm);
  st.s += o.s;
  if (kSmooth) {
    st.wx += o.wx;
    st.w += o.w;
  }
}

// Combines the statistics over the 32 lanes of a warp: the maximum first, then each lane's
// rebased to it and the sums added, all by butterflies, so every lane ends with the same bits
// (each step adds the same two values on both lanes; the rescaling product is not fused into
// the sums). kSmooth: wx and w too (without label smoothing they are 0 and not exchanged).
template <bool kSmooth, typename A>
__device__ __forceinline__ void warp_combine(Stats<A>& st) {
  A mm = st.m;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const A o = __shfl_xor_sync(0xffffffffu, mm, offset);
    mm = o > mm ? o : mm;
  }
  rebase<kSmooth>(st, mm);  // (mm = -inf: every m is -inf and every s 0)
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    st.s = add_rn(st.s, __shfl_xor_sync(0xffffffffu, st.s, offset));
    if (kSmooth) {
      st.wx = add_rn(st.wx, __shfl_xor_sync(0xffffffffu, st.wx, offset));
      st.w = add_rn(st.w, __shfl_xor_sync(0xffffffffu, st.w, offset));
    }
  }
}

// Combines every thread's statistics over the block and, given the inbox of a cluster's block
// (cluster_inbox_init called), over the cluster: afterwards every thread holds the row's,
// identical bit for bit. `sh` holds 4 * kWarps values plus the cluster's 4.
constexpr int kShared = 4 * kWarps + 4;

template <typename A, bool kSmooth>
using StatsInbox = ClusterInbox<A, kSmooth ? 4 : 2>;

template <bool kSmooth, typename A>
__device__ __forceinline__ void row_combine(Stats<A>& st, A* sh, StatsInbox<A, kSmooth>* box) {
  constexpr int K = kSmooth ? 4 : 2;
  warp_combine<kSmooth>(st);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  if (lane == 0) {
    sh[warp] = st.m;
    sh[kWarps + warp] = st.s;
    if (kSmooth) {
      sh[2 * kWarps + warp] = st.wx;
      sh[3 * kWarps + warp] = st.w;
    }
  }
  __syncthreads();
  // Every warp combines the block's warps the same way (lane w holds warp w's; the other lanes
  // the neutral (-inf, 0, 0, 0)), so every thread ends with the same bits.
  const bool has = lane < warps;
  st.m = has ? sh[lane] : neg_inf<A>();
  st.s = has ? sh[kWarps + lane] : A(0);
  if (kSmooth) {
    st.wx = has ? sh[2 * kWarps + lane] : A(0);
    st.w = has ? sh[3 * kWarps + lane] : A(0);
  }
  warp_combine<kSmooth>(st);
  if (box != nullptr) {
    A* row = sh + 4 * kWarps;
    cluster_wait();  // every block's inbox is ready
    if (warp == 0) {
      A mine[K] = {st.m, st.s}, got[K];
      if constexpr (kSmooth) {
        mine[2] = st.wx;
        mine[3] = st.w;
      }
      cluster_exchange(mine, got, *box, 0);  // lane r gets block r's (the other lanes zeros)
      st.m = unsigned(lane) < cluster_blocks() ? got[0] : neg_inf<A>();
      st.s = got[1];
      if constexpr (kSmooth) {
        st.wx = got[2];
        st.w = got[3];
      }
      warp_combine<kSmooth>(st);
      if (lane == 0) {
        row[0] = st.m;
        row[1] = st.s;
        row[2] = st.wx;
        row[3] = st.w;
      }
    }
    __syncthreads();
    st = {row[0], row[1], row[2], row[3]};
  }
}

// The target's (capped) logit: one more, cached, load; a bad target reads element 0. Read
// before the row's barrier: in place, the gradient overwrites the row after it.
template <typename A, typename T>
__device__ __forceinline__ A target_logit(const Args<A>& a, const T* x, int64_t t) {
  return capped(A(to_acc(x[t >= 0 && t < a.V ? t : 0])), a);
}

// The gradient's coefficients: g_j = (exp(x_j - base) * scale - [j == t] ct - cw w_j) times
// softcap'(x_j). A row's base is its maximum and scale is cp / (its sum of exp(x - max)), so
// that no difference is taken from lse once rounded (float32's spacing at 1e4 is 1e-3);
// linear_cross_entropy's slices pass lse and cp.
template <typename T, typename A>
struct RowCoefs {
  A base, scale, ct, cw;
};

// What scales every row's loss and gradient: 1 / the mean's denominators (of the loss and of
// z_loss) and the sum of the class weights. Loaded from memory, so a kernel loads them before
// its row's barrier, where the wait costs nothing.
template <typename A>
struct Scales {
  A sw, sn, W;
};

template <typename A>
__device__ __forceinline__ Scales<A> load_scales(const Args<A>& a) {
  // (the hardware reciprocal: an IEEE division's slow-path call costs registers and spills;
  // kept targets whose weights add up to 0 give 0 / 0 as torch's, NaN even with smoothing)
  const A dw = a.stats[0];
  return {a.mean ? (dw != A(0) ? fusedops::norm::cuda::rcp_acc(dw) : quiet_nan<A>()) : A(1),
          a.mean ? fusedops::norm::cuda::rcp_acc(a.stats[1]) : A(1), a.weighted ? a.stats[2] : A(a.V)};
}

template <typename T, typename A>
__device__ __forceinline__ RowCoefs<T, A> finish_row(const Args<A>& a, const Scales<A>& sc, int64_t row, int64_t t,
                                                     const Stats<A>& st, A xt, bool write) {
  const bool valid = t >= 0 && t < a.V;
  // lse - x_t = ls - (x_t - max) and W lse - sum w_j x_j = W ls + st.wx, with ls = lse - max:
  // differences from the maximum, which keep their precision for logits of any magnitude.
  const A ls = a_log(st.s), lse = st.m + ls;
  const A wt = valid ? (a.weighted ? weight_at<T>(a, t) : A(1)) : quiet_nan<A>();
  const A sw = sc.sw, sn = sc.sn, W = sc.W;
  const A inv_v = a.inv_v;
  if (write) {
    A ce = (A(1) - a.eps) * wt * (ls - (xt - st.m));
    if (a.smoothing) ce += a.eps * inv_v * (W * ls + st.wx);
    const A zl = a.z * lse * lse;
    a.lse[row] = lse;
    a.rowloss[row] = a.mean ? ce * sw + zl * sn : ce + zl;
  }
  // (W only when smoothing: an inf weight for a class no row targets must not reach the gradient)
  const A cp = ((A(1) - a.eps) * wt + (a.smoothing ? a.eps * W * inv_v : A(0))) * sw + A(2) * a.z * lse * sn;
  RowCoefs<T, A> c;
  c.base = st.m;
  c.scale = cp * fusedops::norm::cuda::rcp_acc(st.s);
  c.ct = (A(1) - a.eps) * wt * sw;
  c.cw = a.eps * inv_v * sw;
  return c;
}

// d loss / d logit of element j holding (capped) value v.
template <typename T, typename A>
__device__ __forceinline__ A grad_at(const Args<A>& a, const RowCoefs<T, A>& c, A v, int64_t j, int64_t t) {
  A d = a_exp(v - c.base) * c.scale;
  if (a.smoothing) d -= c.cw * (a.weighted ? weight_at<T>(a, j) : A(1));
  if (j == t) d -= c.ct;
  if (a.softcap) {
    const A u = v * a.inv_cap;
    d *= A(1) - u * u;
  }
  return d;
}

// ---- a thread's share of a row: statistics and gradient ------------------------------------
//
// Without the options (softcap, label smoothing) a column costs a handful of instructions: the
// maximum of 16-bit values is taken two at a time, exp(v - m) is one FMA and one MUFU, and the
// target's column is the only special one. (Written plainly, with exp2f and a capped() per use,
// a column took 24 instructions and the kernel was instruction-bound at 1.6 TB/s reading.)

template <typename T>
struct Pair;  // two 16-bit values in one register
template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static constexpr uint32_t kNegInf = 0xff80ff80u;
};
template <>
struct Pair<__half> {
  using type = __half2;
  static constexpr uint32_t kNegInf = 0xfc00fc00u;
};

template <typename P>
__device__ __forceinline__ P pair_bits(uint32_t w) {
  P p;
  memcpy(&p, &w, 4);
  return p;
}

// exp(v - m), given mb = m log2(e) rounded. For 16-bit logits one FMA: the rounding of mb (half
// an ulp of m log2(e), a relative 2^-24 of it) shifts every exponential of the row alike, far
// below the logits' own precision. float32 logits of large magnitude (hundreds) would feel it
// (2e-5 at 300): they subtract first, exactly when v is near m.
template <typename T>
__device__ __forceinline__ float exp_arg(float v, float m, float mb) {
  if constexpr (sizeof(T) == 2)
    return fmaf(v, kLog2e, -mb);
  else
    return (v - m) * kLog2e;
}

template <typename T>
__device__ __forceinline__ float exp_from(float v, float m, float mb) {
  return ex2_approx(exp_arg<T>(v, m, mb));
}

// The largest of the live vectors' values (NaN ignored, as fmaxf does), -inf when none.
template <typename T, int VPT, int VEC, typename Live>
__device__ __forceinline__ float share_max(const Held<T, VEC> (&xv)[VPT], Live live) {
  if constexpr (sizeof(T) == 2) {
    using P = typename Pair<T>::type;
    P mx[VEC / 2];
#pragma unroll
    for (int k = 0; k < VEC / 2; ++k) mx[k] = pair_bits<P>(Pair<T>::kNegInf);
#pragma unroll
    for (int i = 0; i < VPT; ++i)
      if (live(i)) {
#pragma unroll
        for (int k = 0; k < VEC / 2; ++k) mx[k] = __hmax2(mx[k], pair_bits<P>(xv[i].w[k]));
      }
#pragma unroll
    for (int k = 1; k < VEC / 2; ++k) mx[0] = __hmax2(mx[0], mx[k]);
    return fmaxf(__low2float(mx[0]), __high2float(mx[0]));
  } else {
    float mx = neg_inf<float>();
#pragma unroll
    for (int i = 0; i < VPT; ++i)
      if (live(i)) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) mx = fmaxf(mx, xv[i].v[e]);
      }
    return mx;
  }
}

// The class weights of columns col .. col + VEC - 1 (16-byte loads: run_rows takes this path
// only for 16-byte aligned weights; they are L2-resident, V values against every row's V).
template <typename T, int VEC>
__device__ __forceinline__ void weights_at(const Args<float>& a, int64_t col, float (&w)[VEC]) {
  if (a.weight32) {
    const Vec<float, VEC> v = load_vec<float, VEC>(static_cast<const float*>(a.weight) + col);
#pragma unroll
    for (int e = 0; e < VEC; ++e) w[e] = v.v[e];
  } else {
    const Held<T, VEC> v = load_held<T, VEC>(static_cast<const T*>(a.weight) + col);
#pragma unroll
    for (int e = 0; e < VEC; ++e) w[e] = acc_at(v, e);
  }
}

// The statistics (Stats) of this thread's live values v_j (capped) of columns col(i) + e.
// (The register kernels serve 16-bit and float32 logits: the accumulator is float.)
template <typename T, int VPT, Opts O, int VEC, typename Live, typename Col>
__device__ __forceinline__ void share_stats(const Args<float>& a, const Held<T, VEC> (&xv)[VPT], Live live, Col col,
                                            Stats<float>& st) {
  constexpr bool kWeights = O == Opts::kWeightedSmooth;
  constexpr bool kCapping = O == Opts::kCap || kWeights;  // (kWeightedSmooth: capped() asks a.softcap)
  const auto value = [&](int i, int e) { return kCapping ? capped(acc_at(xv[i], e), a) : acc_at(xv[i], e); };
  int n = 0;  // the live values
#pragma unroll
  for (int i = 0; i < VPT; ++i)
    if (live(i)) n += VEC;
  float m = share_max<T, VPT, VEC>(xv, live);
  // (softcap is increasing: the largest capped value is the largest value capped; -inf logits
  // are capped to -cap, so only an empty share keeps -inf)
  if (kCapping) m = n > 0 ? capped(m, a) : neg_inf<float>();
  const float base = exp_base(m);
  const float mb = base * kLog2e;  // (see exp_from)
  float s = 0;
  float args = 0;  // label smoothing: the sum of the exponentials' arguments (times the weights)
  float wsum = 0;  // class-weighted smoothing: the sum of the weights
#pragma unroll
  for (int i = 0; i < VPT; ++i)
    if (live(i)) {
      float w[VEC];
      if constexpr (kWeights) weights_at<T, VEC>(a, col(i), w);
      float part = 0, part_args = 0;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float arg = exp_arg<T>(value(i, e), base, mb);
        part += ex2_approx(arg);
        if constexpr (kWeights) {
          part_args = fmaf(w[e], arg, part_args);
          wsum += w[e];
        } else if constexpr (O != Opts::kNone) {
          part_args += arg;
        }
      }
      s += part;
      if constexpr (O != Opts::kNone) args += part_args;
    }
  st.m = m;
  st.s = s;
  st.wx = 0;
  st.w = 0;
  if (O == Opts::kSmooth || kWeights || (O == Opts::kCap && a.smoothing)) {
    // Label smoothing's sum of w_j (m - v_j), from the arguments the exponentials took anyway:
    // one more add (or FMA) a value. arg_j = log2(e) (v_j - m) + r, r = log2(e) m - mb being
    // mb's rounding, which fmaf gives exactly (a product's rounding error is representable).
    // The arguments are never positive, so the sum keeps its relative precision. A share of
    // -inf logits only (no softcap): each one's term is +inf (NaN at a weight of 0), as torch's.
    const float W = kWeights ? wsum : float(n);
    const float r = sizeof(T) == 2 ? fmaf(m, kLog2e, -mb) : 0.f;
    st.wx = (m == neg_inf<float>() ? -args : W * r - args) * kLn2;
    st.w = W;
  }
}

// The gradient of vector i's VEC values (columns col .. col + VEC - 1).
template <typename T, Opts O, int VEC>
__device__ __forceinline__ void vector_grad(const Args<float>& a, const RowCoefs<T, float>& c, const Held<T, VEC>& x,
                                            int col, int64_t t, float (&d)[VEC]) {
  constexpr bool kWeights = O == Opts::kWeightedSmooth;
  constexpr bool kCapping = O == Opts::kCap || kWeights;
  float w[VEC];
  if constexpr (kWeights) weights_at<T, VEC>(a, col, w);
  const float bb = c.base * kLog2e;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float v = kCapping ? capped(acc_at(x, e), a) : acc_at(x, e);
    const float p = exp_from<T>(v, c.base, bb);
    if constexpr (O == Opts::kNone)
      d[e] = p * c.scale;
    else  // (cw = 0 without smoothing)
      d[e] = fmaf(p, c.scale, kWeights ? -c.cw * w[e] : -c.cw);
    if (col + e == t) d[e] -= c.ct;
    if (O == Opts::kCap || (kWeights && a.softcap)) {
      const float u = v * a.inv_cap;  // tanh(x / cap): softcap' = 1 - u^2
      d[e] *= fmaf(-u, u, 1.f);
    }
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void zero_columns(T* g, int64_t col) {
  acc_t<T> z[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) z[e] = 0;
  store_from_acc<T, VEC>(g + col, z);
}

// The arguments as a kernel compiled for options O sees them: the flags O rules out are off,
// so that their code is dead and compiled out.
template <Opts O, typename A>
__device__ __forceinline__ Args<A> options_compiled(const Args<A>& args) {
  Args<A> a = args;
  if constexpr (O == Opts::kNone || O == Opts::kSmooth) a.softcap = false;
  if constexpr (O == Opts::kCap) a.softcap = true;
  if constexpr (O == Opts::kNone) a.smoothing = false;
  if constexpr (O == Opts::kSmooth) {
    a.smoothing = true;
    a.weighted = false;
  }
  if constexpr (O == Opts::kWeightedSmooth) {
    a.smoothing = true;
    a.weighted = true;
  }
  return a;
}

// The register-caching kernel: a block (or a cluster of blocks) per row, VPT vectors a thread.
// Vector i of thread tid of cluster rank r holds columns ((i * blocks + r) * 512 + tid) * VEC.
// O: which options the kernel is compiled for (Opts); the others' code is compiled out (the
// common cases keep fewer registers).
// Two blocks an SM (64 registers a thread) are what hides one block's barrier behind the other's
// loads: asked for explicitly, since left to itself ptxas may take more (78 registers at 8 bf16
// vectors a thread given a bound of one block, which ran 8192x128256 forward+backward at 2.4
// TB/s instead of 3.4 on the H200). Class-weighted smoothing at 8 vectors would spill at 64
// (148 bytes: the weights' vector beside the row's); it keeps one block.
template <typename T, int VPT, bool kGrad, Opts O>
__global__ void __launch_bounds__(kThreads, O == Opts::kWeightedSmooth && VPT == 8 ? 1 : 2)
    row_kernel(const Args<acc_t<T>> args) {
  using A = acc_t<T>;
  constexpr bool kSmooth = O != Opts::kNone;
  const Args<A> a = options_compiled<O>(args);
  constexpr int VEC = 16 / sizeof(T);
  __shared__ A sh[kShared];
  const unsigned rank = cluster_rank(), blocks = cluster_blocks();
  const int64_t row = blockIdx.x / blocks;
  const auto column = [&](int i) { return int64_t(((i * int(blocks) + int(rank)) * kThreads + int(threadIdx.x)) * VEC); };
  const T* x = static_cast<const T*>(a.x) + a.rows.offset(row);
  // Held packed (cuda_utils.cuh, load_held): a Vec of 16-bit values is split per element at
  // its (conditional) load, which made each thread wait for one load before issuing the next.
  // Issued before the target is known: an ignored row is then read for nothing, where waiting
  // for the target first held every row's loads back by a trip to memory.
  Held<T, VEC> xv[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i)
    if (column(i) < a.V) xv[i] = load_held<T, VEC>(x + column(i));
  const int64_t t = target_at(a.target, a.target32, row);
  T* g = kGrad ? static_cast<T*>(a.grad) + a.grad_rows.offset(row) : nullptr;
  if (t == a.ignore_index) {  // the whole cluster takes this branch, before its barrier
    if (rank == 0 && threadIdx.x == 0) {
      a.lse[row] = 0;
      a.rowloss[row] = 0;
    }
    if constexpr (kGrad) {
#pragma unroll
      for (int i = 0; i < VPT; ++i)
        if (column(i) < a.V) zero_columns<T, VEC>(g, column(i));
    }
    return;
  }
  __shared__ StatsInbox<A, kSmooth> box;
  if (blocks > 1) cluster_inbox_init(box);
  const bool writer = rank == 0 && threadIdx.x == 0;
  const A xt = writer ? target_logit(a, x, t) : A(0);  // (before the barrier: in place, x is overwritten after it)
  const auto live = [&](int i) { return column(i) < a.V; };
  Stats<A> st;
  const Scales<A> sc = load_scales(a);
  share_stats<T, VPT, O, VEC>(a, xv, live, column, st);
  row_combine<kSmooth>(st, sh, blocks > 1 ? &box : nullptr);
  const RowCoefs<T, A> c = finish_row<T>(a, sc, row, t, st, xt, writer);
  if constexpr (kGrad) {
#pragma unroll
    for (int i = 0; i < VPT; ++i)
      if (column(i) < a.V) {
        A d[VEC];
        vector_grad<T, O, VEC>(a, c, xv[i], column(i), t, d);
        store_from_acc<T, VEC>(g + column(i), d);
      }
  }
}

// ---- the no-grad forward of rows wider than a block: slices, then a combine ------------------
//
// Without a gradient a row need not stay on chip after its statistics, and the row kernel's
// cluster barrier would only make each block wait for the slowest of its row. split_kernel gives
// each block one slice of kSplitThreads * kSplitVecs vectors of a row and writes the slice's
// statistics (Stats, 4 values); combine_kernel merges a row's slices in slice order, a warp
// per row, and finishes the row. Blocks retire independently, so loads stay in flight: at 8192 x
// 128256 bf16 on the H200 this reads at 4.5 TB/s, the read-only ceiling, where the cluster kernel
// read at 3.0 (benchmarks/cross_entropy_split_rows.cu). The loss may differ from the forward with
// a gradient in its last bits (another order of the same sums).
constexpr int kSplitThreads = 128;
constexpr int kSplitVecs = 8;
constexpr int kCombineThreads = 256;

template <typename T, Opts O>
__global__ void __launch_bounds__(kSplitThreads) split_kernel(const Args<acc_t<T>> args, int splits, acc_t<T>* part) {
  using A = acc_t<T>;
  const Args<A> a = options_compiled<O>(args);
  constexpr int VEC = 16 / sizeof(T);
  __shared__ A sh[kShared];
  const int64_t row = blockIdx.x / splits;
  const int slice = int(blockIdx.x % splits);
  if (target_at(a.target, a.target32, row) == a.ignore_index) return;  // (combine_kernel skips the row)
  const T* x = static_cast<const T*>(a.x) + a.rows.offset(row);
  const auto column = [&](int i) { return int64_t(((slice * kSplitVecs + i) * kSplitThreads + int(threadIdx.x)) * VEC); };
  const auto live = [&](int i) { return column(i) < a.V; };
  Held<T, VEC> xv[kSplitVecs];
#pragma unroll
  for (int i = 0; i < kSplitVecs; ++i)
    if (live(i)) xv[i] = load_held<T, VEC>(x + column(i));
  Stats<A> st;
  share_stats<T, kSplitVecs, O, VEC>(a, xv, live, column, st);
  row_combine<O != Opts::kNone, A>(st, sh, nullptr);
  if (threadIdx.x == 0) {
    A* out = part + 4 * int64_t(blockIdx.x);
    out[0] = st.m;
    out[1] = st.s;
    out[2] = st.wx;
    out[3] = st.w;
  }
}

template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const Args<acc_t<T>> a, int splits, const acc_t<T>* part, int64_t R) {
  using A = acc_t<T>;
  const int64_t row = int64_t(blockIdx.x) * (kCombineThreads / 32) + threadIdx.x / 32;
  if (row >= R) return;  // (whole warps)
  const int lane = threadIdx.x & 31;
  const int64_t t = target_at(a.target, a.target32, row);
  if (t == a.ignore_index) {
    if (lane == 0) {
      a.lse[row] = 0;
      a.rowloss[row] = 0;
    }
    return;
  }
  // Lane l merges slices l, l + 32, ... in order, then the warp merges the lanes.
  Stats<A> st{neg_inf<A>(), 0, 0, 0};
  for (int k = lane; k < splits; k += 32) {
    const A* in = part + 4 * (row * splits + k);
    merge<true>(st, Stats<A>{in[0], in[1], in[2], in[3]});
  }
  warp_combine<true>(st);
  const T* x = static_cast<const T*>(a.x) + a.rows.offset(row);
  const A xt = lane == 0 ? target_logit(a, x, t) : A(0);
  finish_row<T>(a, load_scales(a), row, t, st, xt, lane == 0);
}

// A block's walk over a row of a.V values, VEC at a time (16 bytes when the row allows, else 1):
// each thread's statistics, online, for row_combine.
template <typename T, int VEC>
__device__ __forceinline__ void sweep_stats(const Args<acc_t<T>>& a, const T* x, Stats<acc_t<T>>& st) {
  using A = acc_t<T>;
  st = {neg_inf<A>(), 0, 0, 0};
  for (int64_t j = int64_t(threadIdx.x) * VEC; j < a.V; j += int64_t(blockDim.x) * VEC) {
    A v[VEC];
    if constexpr (VEC > 1) {
      const Vec<T, VEC> raw = load_vec<T, VEC>(x + j);
#pragma unroll
      for (int e = 0; e < VEC; ++e) v[e] = capped(A(to_acc(raw.v[e])), a);
    } else {
      v[0] = capped(A(to_acc(x[j])), a);
    }
    A vm = v[0];
#pragma unroll
    for (int e = 1; e < VEC; ++e) vm = vm > v[e] ? vm : v[e];
    if (vm > st.m) rebase<true>(st, vm);
    const A base = exp_base(st.m);
#pragma unroll
    for (int e = 0; e < VEC; ++e) st.s += a_exp(v[e] - base);
    if (a.smoothing) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const A w = a.weighted ? weight_at<T>(a, j + e) : A(1);
        st.wx += w * below(st.m, v[e]);
        st.w += w;
      }
    }
  }
}

// The block's walk writing the gradient of a row (g may be x itself: each value is read by the
// thread that writes it), or zeros when c is null (an ignored row; x is not read).
template <typename T, int VEC>
__device__ __forceinline__ void sweep_grad(const Args<acc_t<T>>& a, const RowCoefs<T, acc_t<T>>* c, const T* x, T* g,
                                           int64_t t) {
  using A = acc_t<T>;
  for (int64_t j = int64_t(threadIdx.x) * VEC; j < a.V; j += int64_t(blockDim.x) * VEC) {
    if (c == nullptr) {
      if constexpr (VEC > 1) {
        zero_columns<T, VEC>(g, j);
      } else {
        g[j] = from_acc<T>(A(0));
      }
    } else if constexpr (VEC > 1) {
      const Vec<T, VEC> raw = load_vec<T, VEC>(x + j);
      A d[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) d[e] = grad_at<T>(a, *c, capped(A(to_acc(raw.v[e])), a), j + e, t);
      store_from_acc<T, VEC>(g + j, d);
    } else {
      g[j] = from_acc<T>(grad_at<T>(a, *c, capped(A(to_acc(x[j])), a), j, t));
    }
  }
}

// The sweeping kernel: a block per row, the row read once for its statistics (online) and again
// for the gradient.
template <typename T, int VEC, bool kGrad>
__global__ void __launch_bounds__(kThreads) sweep_kernel(const Args<acc_t<T>> a) {
  using A = acc_t<T>;
  __shared__ A sh[kShared];
  const int64_t row = blockIdx.x;
  const int64_t t = target_at(a.target, a.target32, row);
  T* g = kGrad ? static_cast<T*>(a.grad) + a.grad_rows.offset(row) : nullptr;
  if (t == a.ignore_index) {
    if (threadIdx.x == 0) {
      a.lse[row] = 0;
      a.rowloss[row] = 0;
    }
    if constexpr (kGrad) sweep_grad<T, VEC>(a, nullptr, nullptr, g, t);
    return;
  }
  const T* x = static_cast<const T*>(a.x) + a.rows.offset(row);
  Stats<A> st;
  sweep_stats<T, VEC>(a, x, st);
  const A xt = threadIdx.x == 0 ? target_logit(a, x, t) : A(0);  // (before the barrier, as above)
  row_combine<true, A>(st, sh, nullptr);
  const RowCoefs<T, A> c = finish_row<T>(a, load_scales(a), row, t, st, xt, threadIdx.x == 0);
  if constexpr (kGrad) sweep_grad<T, VEC>(a, &c, x, g, t);
}

// ---- slices of the classes (linear_cross_entropy's low-memory mode) ------------------------
//
// A block of kSliceThreads per row walks the row's slice (a few thousand classes: that mode
// keeps a slice of every row's logits within a small byte budget). a.V is the slice's width and
// a.weight starts at its first class; targets are compared as t - class_start. The statistics
// kernel reduces as the sweep does and thread 0 merges the result into the row's running
// values: slices are launched one after another on a stream, so no two blocks share a row.
constexpr int kSliceThreads = 256;

template <typename T, int VEC>
__global__ void __launch_bounds__(kSliceThreads)
    slice_stats_kernel(const Args<acc_t<T>> a, int64_t class_start, acc_t<T>* stats) {
  using A = acc_t<T>;
  __shared__ A sh[kShared];
  const int64_t row = blockIdx.x;
  const int64_t t = target_at(a.target, a.target32, row);
  if (t == a.ignore_index) return;
  const T* x = static_cast<const T*>(a.x) + a.rows.offset(row);
  Stats<A> st;
  sweep_stats<T, VEC>(a, x, st);
  row_combine<true, A>(st, sh, nullptr);
  if (threadIdx.x != 0) return;
  A* r = stats + 4 * row;
  // (the running statistics hold sum_j w_j x_j, not relative to the maximum: sum_j w_j m - st.wx)
  if (a.smoothing) r[2] += (st.w != A(0) ? st.w * st.m : A(0)) - st.wx;
  Stats<A> run{r[0], r[1], 0, 0};
  merge<false>(run, st);  // (a NaN maximum is carried by the sum, as in sweep_stats)
  r[0] = run.m;
  r[1] = run.s;
  const int64_t tl = t - class_start;
  if (tl >= 0 && tl < a.V) r[3] = capped(A(to_acc(x[tl])), a);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kSliceThreads)
    slice_grad_kernel(const Args<acc_t<T>> a, int64_t class_start, const acc_t<T>* coefs) {
  using A = acc_t<T>;
  const int64_t row = blockIdx.x;
  const int64_t t = target_at(a.target, a.target32, row);
  T* g = static_cast<T*>(a.grad) + a.grad_rows.offset(row);
  if (t == a.ignore_index) {
    sweep_grad<T, VEC>(a, nullptr, nullptr, g, t);
    return;
  }
  const A* k = coefs + 4 * row;
  const RowCoefs<T, A> c{k[0], k[1], k[2], k[3]};  // (base, scale, ct, cw)
  sweep_grad<T, VEC>(a, &c, g, g, t - class_start);
}

// One block: the "mean" denominators, the sum of the class weights and the first bad target.
// Each thread walks a fixed set of rows; the block adds the threads' partials in a fixed order.
template <typename T, typename A>
__global__ void __launch_bounds__(kTargetThreads)
    targets_kernel(const void* target, bool t32, const void* weight, bool w32, int64_t R, int64_t V,
                   int64_t ignore_index, A* stats, int64_t* bad) {
  __shared__ A sdw[kTargetThreads / 32], sdn[kTargetThreads / 32], sws[kTargetThreads / 32];
  __shared__ long long sbad[kTargetThreads / 32];
  A dw = 0, dn = 0, ws = 0;
  long long first = R;
  for (int64_t i = threadIdx.x; i < R; i += kTargetThreads) {
    const int64_t t = target_at(target, t32, i);
    if (t == ignore_index) continue;
    const bool valid = t >= 0 && t < V;
    A w = A(1);
    if (weight != nullptr && valid)
      w = w32 ? A(static_cast<const float*>(weight)[t]) : A(to_acc(static_cast<const T*>(weight)[t]));
    if (!valid) {
      w = quiet_nan<A>();
      first = first < i ? first : i;
    }
    dw += w;
    dn += 1;
  }
  if (weight != nullptr)
    for (int64_t j = threadIdx.x; j < V; j += kTargetThreads)
      ws += w32 ? A(static_cast<const float*>(weight)[j]) : A(to_acc(static_cast<const T*>(weight)[j]));
  dw = warp_sum(dw);
  dn = warp_sum(dn);
  ws = warp_sum(ws);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const long long o = __shfl_xor_sync(0xffffffffu, first, offset);
    first = o < first ? o : first;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sdw[warp] = dw;
    sdn[warp] = dn;
    sws[warp] = ws;
    sbad[warp] = first;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    A tdw = 0, tdn = 0, tws = 0;
    long long f = R;
    for (int w = 0; w < kTargetThreads / 32; ++w) {
      tdw += sdw[w];
      tdn += sdn[w];
      tws += sws[w];
      f = sbad[w] < f ? sbad[w] : f;
    }
    stats[0] = tdw;
    stats[1] = tdn;
    stats[2] = tws;
    *bad = f == R ? -1 : f;
  }
}

// One block: the per-row losses added in row order ("mean": all rows ignored gives NaN).
template <typename A>
__global__ void __launch_bounds__(kTargetThreads)
    sum_kernel(const A* rowloss, const A* stats, A* loss, int64_t R, bool mean) {
  __shared__ A partial[kTargetThreads / 32];
  A s = 0;
  for (int64_t i = threadIdx.x; i < R; i += kTargetThreads) s += rowloss[i];
  s = warp_sum(s);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    A total = 0;
    for (int w = 0; w < kTargetThreads / 32; ++w) total += partial[w];
    if (mean && stats[1] == A(0)) total = quiet_nan<A>();
    *loss = total;
  }
}

// grad_output's element i in the accumulation type, whatever its floating dtype.
template <typename A>
__device__ __forceinline__ A scale_at(const void* p, int code, int64_t i) {
  switch (code) {
    case 0: return A(static_cast<const float*>(p)[i]);
    case 1: return A(static_cast<const double*>(p)[i]);
    case 2: return A(__bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]));
    default: return A(__half2float(static_cast<const __half*>(p)[i]));
  }
}

constexpr int kScaleThreads = 256;
constexpr int kScaleVecs = 4;

// out = grad * grad_output over tiles of kScaleThreads * kScaleVecs * VEC columns of one row, a
// persistent grid walking the tiles; in place, rows whose scale is exactly 1 are skipped.
template <typename T, int VEC>
__global__ void __launch_bounds__(kScaleThreads)
    scale_kernel(const T* g, RowLayout g_rows, T* out, RowLayout o_rows, const void* go, int go_code, bool per_row,
                 bool in_place, int64_t V, int64_t tiles_per_row, int64_t tiles) {
  using A = acc_t<T>;
  constexpr int64_t kTile = int64_t(kScaleThreads) * kScaleVecs * VEC;
  if (!per_row && in_place && scale_at<A>(go, go_code, 0) == A(1)) return;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t row = tile / tiles_per_row;
    const A k = scale_at<A>(go, go_code, per_row ? row : 0);
    if (in_place && k == A(1)) continue;
    const int64_t c0 = (tile - row * tiles_per_row) * kTile;
    const T* gr = g + g_rows.offset(row);
    T* orow = out + o_rows.offset(row);
    Held<T, VEC> v[kScaleVecs];
#pragma unroll
    for (int i = 0; i < kScaleVecs; ++i) {
      const int64_t j = c0 + (int64_t(i) * kScaleThreads + threadIdx.x) * VEC;
      if (j < V) {
        if constexpr (VEC > 1)
          v[i] = load_held<T, VEC>(gr + j);
        else
          v[i].v[0] = gr[j];
      }
    }
#pragma unroll
    for (int i = 0; i < kScaleVecs; ++i) {
      const int64_t j = c0 + (int64_t(i) * kScaleThreads + threadIdx.x) * VEC;
      if (j < V) {
        A d[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) d[e] = A(acc_at(v[i], e)) * k;
        if constexpr (VEC > 1)
          store_from_acc<T, VEC>(orow + j, d);
        else
          orow[j] = from_acc<T>(d[0]);
      }
    }
  }
}

inline bool rows_aligned(const RowLayout& r, int64_t vec) {
  for (int d = 0; d < r.ndim; ++d)
    if (r.sizes[d] > 1 && r.strides[d] % vec != 0) return false;
  return true;
}

template <auto Kernel>
bool cluster_fits(int cluster) {
  return fusedops::norm::cuda::cluster_kernel_usable<Kernel>() &&
         fusedops::norm::cuda::resident_clusters<Kernel>(cluster) > 0;
}

// Launches the register kernel with VPT vectors a thread in clusters of `cluster` blocks.
template <typename T, int VPT, bool kGrad, Opts O>
bool launch_rows(const Args<acc_t<T>>& a, int64_t R, int cluster, cudaStream_t stream, const char* op) {
  constexpr auto kernel = row_kernel<T, VPT, kGrad, O>;
  if (cluster == 1) {
    kernel<<<unsigned(R), kThreads, 0, stream>>>(a);
    check_launch(op);
    return true;
  }
  if (!cluster_fits<kernel>(cluster)) return false;
  fusedops::norm::cuda::launch_cluster(kernel, unsigned(R * cluster), cluster, 0, stream, op, a);
  return true;
}

template <typename T, bool kGrad, Opts O>
bool try_rows(const Args<acc_t<T>>& a, int64_t R, int64_t vectors, cudaStream_t stream, const char* op) {
  // One block when the row fits its registers (the fewest vectors a thread that do), else the
  // smallest cluster at 8 vectors a thread, else at 4: a block's share of the row between two
  // cluster barriers is what amortises them (at 128256 bf16 classes, 8 blocks of 4 vectors a
  // thread reached 0.82 TB/s forward on the H200, against 1.72 for 256000 classes at 8 vectors).
  if (vectors <= kThreads) return launch_rows<T, 1, kGrad, O>(a, R, 1, stream, op);
  if (vectors <= 2 * kThreads) return launch_rows<T, 2, kGrad, O>(a, R, 1, stream, op);
  if (vectors <= 4 * kThreads) return launch_rows<T, 4, kGrad, O>(a, R, 1, stream, op);
  if (vectors <= 8 * kThreads) return launch_rows<T, 8, kGrad, O>(a, R, 1, stream, op);
  const int64_t c8 = (vectors + 8 * kThreads - 1) / (8 * kThreads);
  if (c8 <= kMaxCluster) return launch_rows<T, 8, kGrad, O>(a, R, int(c8), stream, op);
  return false;
}

// The no-grad forward of rows of more than one block's vectors (one a thread), as slices; false
// when the grid would be too large (the caller then takes the row kernel).
template <typename T>
bool try_slices(const Args<acc_t<T>>& a, const Problem& p, cudaStream_t stream, const char* op) {
  using A = acc_t<T>;
  constexpr int64_t kVec = 16 / sizeof(T);
  constexpr int64_t kSlice = int64_t(kSplitThreads) * kSplitVecs;
  const int64_t vectors = p.V / kVec;
  const int64_t splits = (vectors + kSlice - 1) / kSlice;
  if (vectors <= kThreads || p.R * splits >= (int64_t(1) << 31)) return false;
  const Tensor part = empty_like_device(p.logits, {p.R * splits * 4}, acc_dtype(p.dtype));
  A* parts = part.mutable_data_ptr<A>();
  const unsigned blocks = unsigned(p.R * splits);
  with_options(a, [&](auto o) {
    split_kernel<T, decltype(o)::value><<<blocks, kSplitThreads, 0, stream>>>(a, int(splits), parts);
  });
  check_launch(op);
  constexpr int64_t kRowsPerBlock = kCombineThreads / 32;
  combine_kernel<T><<<unsigned((p.R + kRowsPerBlock - 1) / kRowsPerBlock), kCombineThreads, 0, stream>>>(
      a, int(splits), parts, p.R);
  check_launch(op);
  return true;
}

template <typename T, bool kGrad>
void run_rows(const Args<acc_t<T>>& a, const Problem& p, cudaStream_t stream, const char* op) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vector = p.V % kVec == 0 && aligned16(a.x) && rows_aligned(p.rows, kVec) &&
                      (!kGrad || (aligned16(a.grad) && rows_aligned(a.grad_rows, kVec)));
  // (class-weighted smoothing loads the weights beside the logits, as 16-byte vectors too)
  const bool registers = vector && (options_of(a) != Opts::kWeightedSmooth || aligned16(a.weight));
  if constexpr (sizeof(T) < 8) {
    if (!kGrad && registers && try_slices<T>(a, p, stream, op)) return;
    if (registers && with_options(a, [&](auto o) {
          return try_rows<T, kGrad, decltype(o)::value>(a, p.R, p.V / kVec, stream, op);
        }))
      return;
  }
  if (vector) {
    sweep_kernel<T, kVec, kGrad><<<unsigned(p.R), kThreads, 0, stream>>>(a);
  } else {
    sweep_kernel<T, 1, kGrad><<<unsigned(p.R), kThreads, 0, stream>>>(a);
  }
  check_launch(op);
}

template <typename T>
void run_typed(const Problem& p, Outputs& o, const char* op) {
  using DT = device_t<T>;
  using A = acc_t<T>;
  const ScalarType acc = acc_dtype(p.dtype);
  const cudaStream_t stream = current_stream(p.device_index);
  const Tensor stats = empty_like_device(p.logits, {3}, acc);
  const bool t32 = p.target.scalar_type() == ScalarType::Int;
  const bool w32 = p.weight && p.weight->scalar_type() == ScalarType::Float && p.dtype != ScalarType::Float;
  const void* weight = p.weight ? p.weight->const_data_ptr() : nullptr;
  A* stats_ptr = stats.mutable_data_ptr<A>();
  targets_kernel<DT, A><<<1, kTargetThreads, 0, stream>>>(p.target.const_data_ptr(), t32, weight, w32, p.R, p.V,
                                                          p.ignore_index, stats_ptr,
                                                          o.bad_target.mutable_data_ptr<int64_t>());
  check_launch(op);
  const bool none = p.reduction == Reduction::kNone;
  const Tensor rowloss = none ? o.loss : empty_like_device(p.logits, {p.R}, acc);
  if (p.R > 0) {
    FUSEDOPS_CHECK(p.R < (int64_t(1) << 31) / kMaxCluster, op, ": too many rows (", p.R, ")");
    Args<A> a{};
    a.x = p.logits.const_data_ptr();
    a.rows = p.rows;
    a.target = p.target.const_data_ptr();
    a.target32 = t32;
    a.weight = weight;
    a.weight32 = w32;
    a.grad = o.grad ? o.grad->mutable_data_ptr() : nullptr;
    a.grad_rows = o.grad_rows;
    a.lse = o.lse.mutable_data_ptr<A>();
    a.rowloss = rowloss.mutable_data_ptr<A>();
    a.stats = stats_ptr;
    a.ignore_index = p.ignore_index;
    a.V = int(p.V);
    a.mean = p.reduction == Reduction::kMean;
    set_softcap(a, p.softcap);
    a.weighted = p.weight.has_value();
    a.smoothing = p.label_smoothing > 0;
    a.eps = A(p.label_smoothing);
    a.z = A(p.z_loss);
    a.inv_v = A(1.0 / double(p.V));
    if (o.grad)
      run_rows<DT, true>(a, p, stream, op);
    else
      run_rows<DT, false>(a, p, stream, op);
  }
  if (!none) {
    sum_kernel<A><<<1, kTargetThreads, 0, stream>>>(rowloss.const_data_ptr<A>(), stats_ptr, o.loss.mutable_data_ptr<A>(),
                                                    p.R, p.reduction == Reduction::kMean);
    check_launch(op);
  }
}

int scale_code(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return 0;
    case ScalarType::Double: return 1;
    case ScalarType::BFloat16: return 2;
    default: return 3;
  }
}

template <typename T>
void scale_typed(const ScaleProblem& s, const Tensor& out, const RowLayout& out_rows, bool in_place, const char* op) {
  using DT = device_t<T>;
  constexpr int kVec = 16 / sizeof(T);
  const cudaStream_t stream = current_stream(s.device_index);
  const DT* g = static_cast<const DT*>(s.grad.const_data_ptr());
  DT* o = static_cast<DT*>(out.mutable_data_ptr());
  const bool vector =
      s.V % kVec == 0 && aligned16(g) && aligned16(o) && rows_aligned(s.rows, kVec) && rows_aligned(out_rows, kVec);
  const int vec = vector ? kVec : 1;
  const int64_t tile = int64_t(kScaleThreads) * kScaleVecs * vec;
  const int64_t tiles_per_row = (s.V + tile - 1) / tile;
  const int64_t tiles = tiles_per_row * s.R;
  const int64_t grid = std::min<int64_t>(tiles, int64_t(multiprocessor_count(s.device_index)) * 8);
  const void* go = s.grad_output.const_data_ptr();
  const int code = scale_code(s.grad_output.scalar_type());
  if (vector)
    scale_kernel<DT, kVec><<<unsigned(grid), kScaleThreads, 0, stream>>>(g, s.rows, o, out_rows, go, code, s.per_row,
                                                                          in_place, s.V, tiles_per_row, tiles);
  else
    scale_kernel<DT, 1><<<unsigned(grid), kScaleThreads, 0, stream>>>(g, s.rows, o, out_rows, go, code, s.per_row,
                                                                      in_place, s.V, tiles_per_row, tiles);
  check_launch(op);
}

template <typename T>
void slice_typed(const SliceProblem& s, bool grad, const char* op) {
  using DT = device_t<T>;
  using A = acc_t<T>;
  constexpr int kVec = 16 / sizeof(T);
  FUSEDOPS_CHECK(s.R < (int64_t(1) << 31), op, ": too many rows (", s.R, ")");
  FUSEDOPS_CHECK(s.S < (int64_t(1) << 31), op, ": slice too wide (", s.S, " classes)");
  const cudaStream_t stream = current_stream(s.device_index);
  const bool w32 = s.weight && s.weight->scalar_type() == ScalarType::Float && s.dtype != ScalarType::Float;
  Args<A> a{};
  a.x = s.logits.const_data_ptr();
  a.rows = s.rows;
  a.target = s.target.const_data_ptr();
  a.target32 = s.target.scalar_type() == ScalarType::Int;
  if (s.weight)  // (from the slice's first class on)
    a.weight = static_cast<const char*>(s.weight->const_data_ptr()) + s.class_start * (w32 ? 4 : int64_t(sizeof(T)));
  a.weight32 = w32;
  a.weighted = s.weight.has_value();
  a.grad = grad ? s.logits.mutable_data_ptr() : nullptr;
  a.grad_rows = s.rows;
  a.ignore_index = s.ignore_index;
  a.V = int(s.S);
  set_softcap(a, s.softcap);
  a.smoothing = s.smoothing;
  const bool vector = s.S % kVec == 0 && aligned16(a.x) && rows_aligned(s.rows, kVec);
  const unsigned blocks = unsigned(s.R);
  if (grad) {
    const A* coefs = s.state.const_data_ptr<A>();
    if (vector)
      slice_grad_kernel<DT, kVec><<<blocks, kSliceThreads, 0, stream>>>(a, s.class_start, coefs);
    else
      slice_grad_kernel<DT, 1><<<blocks, kSliceThreads, 0, stream>>>(a, s.class_start, coefs);
  } else {
    A* stats = s.state.mutable_data_ptr<A>();
    if (vector)
      slice_stats_kernel<DT, kVec><<<blocks, kSliceThreads, 0, stream>>>(a, s.class_start, stats);
    else
      slice_stats_kernel<DT, 1><<<blocks, kSliceThreads, 0, stream>>>(a, s.class_start, stats);
  }
  check_launch(op);
}

void run_slice(const SliceProblem& s, bool grad, const char* op) {
  torch::stable::accelerator::DeviceGuard guard(s.device_index);
  dispatch_float(s.dtype, op, [&](auto tag) { slice_typed<typename decltype(tag)::type>(s, grad, op); });
}

struct Kernels {
  static void forward(const Problem& p, Outputs& o, const char* op) {
    torch::stable::accelerator::DeviceGuard guard(p.device_index);
    dispatch_float(p.dtype, op, [&](auto tag) { run_typed<typename decltype(tag)::type>(p, o, op); });
  }

  static void scale(const ScaleProblem& s, const Tensor& out, const RowLayout& out_rows, bool in_place,
                    const char* op) {
    torch::stable::accelerator::DeviceGuard guard(s.device_index);
    dispatch_float(s.dtype, op, [&](auto tag) { scale_typed<typename decltype(tag)::type>(s, out, out_rows, in_place, op); });
  }

  static void slice_stats(const SliceProblem& s) { run_slice(s, false, "cross_entropy_slice_stats_"); }
  static void slice_grad(const SliceProblem& s) { run_slice(s, true, "cross_entropy_slice_grad_"); }
};

}  // namespace
}  // namespace fusedops::cross_entropy::cuda

STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  using K = fusedops::cross_entropy::cuda::Kernels;
  m.impl("cross_entropy", TORCH_BOX(&fusedops::cross_entropy::cross_entropy<K>));
  m.impl("cross_entropy_", TORCH_BOX(&fusedops::cross_entropy::cross_entropy_inplace<K>));
  m.impl("cross_entropy_backward", TORCH_BOX(&fusedops::cross_entropy::cross_entropy_backward<K>));
  m.impl("cross_entropy_backward_", TORCH_BOX(&fusedops::cross_entropy::cross_entropy_backward_inplace<K>));
  m.impl("cross_entropy_slice_stats_", TORCH_BOX(&fusedops::cross_entropy::cross_entropy_slice_stats<K>));
  m.impl("cross_entropy_slice_grad_", TORCH_BOX(&fusedops::cross_entropy::cross_entropy_slice_grad<K>));
}
