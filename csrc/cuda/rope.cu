// rope, rope_ and rope_backward on CUDA (the math: fusedops/rope.h).
//
// Memory-bound: q and k are read once and the outputs written once, in one launch for both.
// A thread does one task: one "unit" of one row (a head of a position). A rotary unit is VEC
// elements and their partners (rotate-half: the VEC elements j.. and j + R/2..; interleaved:
// VEC adjacent elements holding VEC/2 pairs), VEC = 16 bytes of T; a pass-through unit copies
// up to two chunks of the features past R when the output is a new tensor. The task's cos/sin
// chunks are loaded again for every head: they are few (the tables are at most 1/10 of q and
// k) and stay in L1/L2. Tasks follow each tensor's memory order of rows (q's rows, then k's),
// so neighbouring threads read neighbouring bytes whatever the layout (bhsd, bshd, thd).
//
// This replaced a mapping where a thread owned a unit of one position and walked every head,
// loading cos/sin once. In a standalone comparison of the two (H200, LLaMA-3-8B shape, bf16,
// forward) this one ran bhsd at 3.91 TB/s against 3.82 and bshd at 3.98 against 3.74, and
// partial rotary at 4.07, which the old mapping ran as two sweeps (2.66 in the benchmark).
// Tensors whose strides or base addresses do not allow
// 16-byte accesses (or whose R/2 is not a multiple of VEC) take the same kernel with scalar
// accesses. All offsets are 64-bit.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <cmath>

#include "fusedops/cuda_utils.cuh"
#include "fusedops/rope.h"

namespace fusedops::rope::cuda {
namespace {

using namespace fusedops::cuda;

constexpr int kThreads = 256;
// Resident blocks an SM: a task's loads are all its work, so latency is hidden by threads in
// flight. Six (at most 40 registers a thread) for bf16 with bf16 tables: in a comparison of
// variants (H200, LLaMA-3-8B shape, forward) 3.90 TB/s bhsd and 3.93 bshd, against 3.64 and
// 3.62 for an unbounded build that used 64 registers; eight (32 registers) spill; two or four
// tasks a thread were slower (3.41, 3.47). Fewer where the conversions need more registers
// (no spills anywhere).
template <typename T, typename C>
constexpr int min_blocks() {
  if constexpr (sizeof(C) > sizeof(T)) return 4;  // 16-bit q and k, float32 tables
  if constexpr (std::is_same_v<T, __half>) return 5;
  return 6;
}

// n / d for 0 <= n < 2^31 by a multiply-high, an add and a shift (d's magic number is made on
// the host): a task decodes its row with three of these instead of 64-bit divisions, which
// cost more instructions than moving the task's bytes.
struct FastDiv {
  uint32_t d = 1, magic = 1, shift = 0;
};

inline FastDiv fast_div(int64_t d) {
  FastDiv f;
  f.d = uint32_t(d);
  while ((uint64_t(1) << f.shift) < f.d) ++f.shift;
  f.magic = uint32_t((uint64_t(1) << 32) * ((uint64_t(1) << f.shift) - f.d) / f.d + 1);
  return f;
}

__device__ __forceinline__ uint32_t div(const FastDiv& f, uint32_t n) { return (__umulhi(n, f.magic) + n) >> f.shift; }

// How a tensor's rows are visited: its three row dimensions (b, h, s) ordered by stride,
// largest first, so that consecutive rows are nearest in memory. For each, the size and what a
// step of it adds to the input and output offsets, to the cos and sin rows, to the position_ids
// offset and to the flat (batch, seq) position index.
struct RowWalk {
  FastDiv size[3];
  int64_t x[3], y[3], cos[3], sin[3], pos[3], flat[3];
};

template <typename T, typename C>
struct Args {
  const T* q;
  const T* k;
  T* qo;
  T* ko;
  RowWalk walk[2];        // q's, k's
  uint32_t q_tasks, tasks;  // q's tasks come first
  FastDiv units;          // per row: rotary units, then pass-through units
  int rot_units;
  int rest_half;          // pass-through unit c copies chunks c and c + rest_half (if < rest_chunks)
  int rest_chunks;
  const C* cos;
  const C* sin;
  const void* pos;  // position_ids (int32 when pos32, else int64), or null
  bool pos32;
  int64_t P;                     // rows of the (P, R) tables
  int64_t table_cos, table_sin;  // their row strides
  int64_t R;
  bool backward;
  // The forward's bad_position (-1 as unsigned: the largest value): with position_ids, preset
  // to -1 and lowered to each bad position's index; without, the first task writes -1.
  unsigned long long* bad;
};

template <bool kVector, int N, typename T>
__device__ __forceinline__ Held<T, N> load_raw(const T* p) {
  if constexpr (kVector) {
    return load_held<T, N>(p);
  } else {
    return load_held_partial<T, N>(p, N);
  }
}

template <bool kVector, int N, typename T>
__device__ __forceinline__ void store_acc_vals(T* p, const acc_t<T> (&vals)[N]) {
  if constexpr (kVector) {
    store_from_acc<T, N>(p, vals);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) p[e] = from_acc<T>(vals[e]);
  }
}

// The rotation of the features (x0, x1) of a pair with cosines (c0, c1) and sines (n0, n1):
// forward y0 = x0 c0 - x1 n0, y1 = x1 c1 + x0 n1; the backward (the transpose) swaps which sine
// goes with which sign: y0 = x0 c0 + x1 n1, y1 = x1 c1 - x0 n0. Rotate-half pairs element e of
// chunk a with element e of chunk b; interleaved pairs neighbours within each chunk.
template <bool kBackward, bool kInterleaved, typename A, typename HX, typename HC, int VEC>
__device__ __forceinline__ void rotate(const HX& xa, const HX& xb, const HC& ca, const HC& cb, const HC& na,
                                       const HC& nb, A (&ya)[VEC], A (&yb)[VEC]) {
  if constexpr (kInterleaved) {
    auto pairs = [](const HX& x, const HC& c, const HC& n, A(&y)[VEC]) {
#pragma unroll
      for (int e = 0; e < VEC; e += 2) {
        const A x0 = acc_at(x, e), x1 = acc_at(x, e + 1);
        const A c0 = acc_at(c, e), c1 = acc_at(c, e + 1), n0 = acc_at(n, e), n1 = acc_at(n, e + 1);
        y[e] = kBackward ? x0 * c0 + x1 * n1 : x0 * c0 - x1 * n0;
        y[e + 1] = kBackward ? x1 * c1 - x0 * n0 : x1 * c1 + x0 * n1;
      }
    };
    pairs(xa, ca, na, ya);
    pairs(xb, cb, nb, yb);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const A x0 = acc_at(xa, e), x1 = acc_at(xb, e);
      const A c0 = acc_at(ca, e), c1 = acc_at(cb, e), n0 = acc_at(na, e), n1 = acc_at(nb, e);
      ya[e] = kBackward ? x0 * c0 + x1 * n1 : x0 * c0 - x1 * n0;
      yb[e] = kBackward ? x1 * c1 - x0 * n0 : x1 * c1 + x0 * n1;
    }
  }
}

// One task per thread. A rotary unit u covers the chunks ja = u * VEC and jb: ja + R/2 for
// rotate-half; for interleaved the next chunk, ja + VEC (absent past R when R / VEC is odd).
// VEC: elements per access (16 bytes of T when kVector, else 1, or 2 for interleaved pairs).
template <typename T, typename C, int VEC, bool kInterleaved, bool kVector>
__global__ void __launch_bounds__(kThreads, min_blocks<T, C>()) rope_kernel(const Args<T, C> a) {
  using A = acc_t<T>;
  const uint32_t task = blockIdx.x * kThreads + threadIdx.x;
  if (task >= a.tasks) return;
  const int which = task < a.q_tasks ? 0 : 1;
  const uint32_t t = which == 0 ? task : task - a.q_tasks;
  uint32_t row = div(a.units, t);
  const int u = int(t - row * a.units.d);
  const RowWalk& w = a.walk[which];
  int64_t x_off = 0, y_off = 0, c_off = 0, n_off = 0, p_off = 0, flat = 0;
#pragma unroll
  for (int d = 2; d >= 0; --d) {
    const uint32_t next = d == 0 ? 0 : div(w.size[d], row);
    const int64_t i = row - next * w.size[d].d;
    row = next;
    x_off += i * w.x[d];
    y_off += i * w.y[d];
    c_off += i * w.cos[d];
    n_off += i * w.sin[d];
    if (a.pos != nullptr) {
      p_off += i * w.pos[d];
      flat += i * w.flat[d];
    }
  }
  const T* x = (which == 0 ? a.q : a.k) + x_off;
  T* y = (which == 0 ? a.qo : a.ko) + y_off;

  bool valid = true;
  if (a.pos != nullptr) {
    int64_t prow = a.pos32 ? int64_t(static_cast<const int32_t*>(a.pos)[p_off]) : static_cast<const int64_t*>(a.pos)[p_off];
    // Never read outside the tables: such a position's rotated features come out NaN, and the
    // forward records the first such position (ops/rope.py raises for it in eager mode).
    valid = prow >= 0 && prow < a.P;
    if (!valid && a.bad != nullptr && u == 0) atomicMin(a.bad, static_cast<unsigned long long>(flat));
    prow = valid ? prow : 0;
    c_off = prow * a.table_cos;  // (the walk's cos/sin steps are zero with position_ids)
    n_off = prow * a.table_sin;
  } else if (a.bad != nullptr && task == 0) {
    *a.bad = ~0ull;
  }

  if (u >= a.rot_units) {  // features past R, unchanged (a new output: no overlap with x)
    constexpr int kRest = kVector ? VEC : 1;
    const int c = u - a.rot_units;
    const int64_t j0 = a.R + int64_t(c) * kRest, j1 = a.R + int64_t(c + a.rest_half) * kRest;
    const bool second = c + a.rest_half < a.rest_chunks;
    const Vec<T, kRest> v0 = *reinterpret_cast<const Vec<T, kRest>*>(x + j0);
    Vec<T, kRest> v1;
    if (second) v1 = *reinterpret_cast<const Vec<T, kRest>*>(x + j1);
    *reinterpret_cast<Vec<T, kRest>*>(y + j0) = v0;
    if (second) *reinterpret_cast<Vec<T, kRest>*>(y + j1) = v1;
    return;
  }

  const C* crow = a.cos + c_off;
  const C* srow = a.sin + n_off;
  const int64_t ja = int64_t(u) * (kInterleaved ? 2 * VEC : VEC);
  const int64_t jb = kInterleaved ? ja + VEC : ja + a.R / 2;
  const bool has_b = !kInterleaved || jb < a.R;
  const Held<T, VEC> xa = load_raw<kVector, VEC>(x + ja);
  Held<C, VEC> ca = load_raw<kVector, VEC>(crow + ja);
  const Held<C, VEC> na = load_raw<kVector, VEC>(srow + ja);
  Held<T, VEC> xb{};
  Held<C, VEC> cb{}, nb{};
  if (has_b) {
    xb = load_raw<kVector, VEC>(x + jb);
    cb = load_raw<kVector, VEC>(crow + jb);
    nb = load_raw<kVector, VEC>(srow + jb);
  }
  if (!valid) {  // an invalid position's rotated features come out NaN
    acc_t<C> nan[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) nan[e] = quiet_nan<acc_t<C>>();
    ca = cb = round_held<C, VEC>(nan);
  }
  A ya[VEC], yb[VEC];
  if (a.backward)
    rotate<true, kInterleaved>(xa, xb, ca, cb, na, nb, ya, yb);
  else
    rotate<false, kInterleaved>(xa, xb, ca, cb, na, nb, ya, yb);
  store_acc_vals<kVector, VEC>(y + ja, ya);
  if (has_b) store_acc_vals<kVector, VEC>(y + jb, yb);
}

inline bool aligned_strides(const Strides& st, int64_t vec) {
  return st.b % vec == 0 && st.h % vec == 0 && st.s % vec == 0;
}

// The walk over a tensor's rows (B, H, S) with input strides `xs` and output strides `ys`.
inline RowWalk row_walk(const Problem& p, int64_t H, const Strides& xs, const Strides& ys) {
  // Per logical dimension (b, h, s): size, input, output, cos, sin, position and flat steps.
  // With position_ids the cos/sin rows come from the positions instead (steps zero).
  struct Dim {
    int64_t size, x, y, cos, sin, pos, flat;
  };
  const bool by_position = p.position_ids.has_value();
  Dim dims[3] = {
      {p.B, xs.b, ys.b, by_position ? 0 : p.cos_b, by_position ? 0 : p.sin_b, p.pos_b, p.S},
      {H, xs.h, ys.h, 0, 0, 0, 0},
      {p.S, xs.s, ys.s, by_position ? 0 : p.cos_s, by_position ? 0 : p.sin_s, p.pos_s, 1},
  };
  // Largest input stride first (ties: the logical order), so the last dimension moves fastest.
  int order[3] = {0, 1, 2};
  std::stable_sort(order, order + 3, [&](int l, int r) {
    const int64_t sl = dims[l].size > 1 ? dims[l].x : 0, sr = dims[r].size > 1 ? dims[r].x : 0;
    return sl > sr;
  });
  RowWalk w{};
  for (int d = 0; d < 3; ++d) {
    const Dim& m = dims[order[d]];
    w.size[d] = fast_div(std::max<int64_t>(m.size, 1));
    w.x[d] = m.x;
    w.y[d] = m.y;
    w.cos[d] = m.cos;
    w.sin[d] = m.sin;
    w.pos[d] = m.pos;
    w.flat[d] = m.flat;
  }
  return w;
}

template <typename T, typename C>
void run_typed(const Problem& p, const Outputs& o, const char* op) {
  using DT = device_t<T>;
  using DC = device_t<C>;
  constexpr int kVec = 16 / sizeof(T);
  Args<DT, DC> a{};
  if (p.q) {
    a.q = reinterpret_cast<const DT*>(p.q->const_data_ptr<T>());
    a.qo = reinterpret_cast<DT*>(o.q_out->mutable_data_ptr<T>());
  }
  if (p.k) {
    a.k = reinterpret_cast<const DT*>(p.k->const_data_ptr<T>());
    a.ko = reinterpret_cast<DT*>(o.k_out->mutable_data_ptr<T>());
  }
  a.cos = reinterpret_cast<const DC*>(p.cos.const_data_ptr<C>());
  a.sin = reinterpret_cast<const DC*>(p.sin.const_data_ptr<C>());
  if (p.position_ids) {
    a.pos = p.position_ids->const_data_ptr();
    a.pos32 = p.position_ids->scalar_type() == ScalarType::Int;
    a.P = p.P;
    a.table_cos = p.cos_s;
    a.table_sin = p.sin_s;
  }
  a.R = p.R;
  a.backward = p.backward;

  // 16-byte accesses need every row and table offset, and every base, 16-byte aligned.
  const int64_t rotary_step = p.interleaved ? kVec : 2 * kVec;
  bool vector = p.D % kVec == 0 && p.R % rotary_step == 0 && aligned16(a.cos) && aligned16(a.sin) &&
                p.cos_b % kVec == 0 && p.cos_s % kVec == 0 && p.sin_b % kVec == 0 && p.sin_s % kVec == 0;
  if (p.q) vector = vector && aligned16(a.q) && aligned16(a.qo) && aligned_strides(p.qs, kVec) && aligned_strides(o.qo, kVec);
  if (p.k) vector = vector && aligned16(a.k) && aligned16(a.ko) && aligned_strides(p.ks, kVec) && aligned_strides(o.ko, kVec);

  const int vec = vector ? kVec : (p.interleaved ? 2 : 1);
  // (interleaved: two neighbouring chunks a unit, the last one alone when R / vec is odd)
  const int64_t rot_units = p.interleaved ? (p.R / vec + 1) / 2 : p.R / 2 / vec;
  const int64_t rest_chunks = o.in_place ? 0 : (p.D - p.R) / (vector ? kVec : 1);
  const int64_t rest_units = (rest_chunks + 1) / 2;
  FUSEDOPS_CHECK(rot_units + rest_units < (int64_t(1) << 30), op, ": head_dim too large (", p.D, ")");
  a.rot_units = int(rot_units);
  const int64_t units = rot_units + rest_units;
  a.rest_chunks = int(rest_chunks);
  a.rest_half = int(rest_units);
  if (units == 0) {  // nothing to rotate or copy (R = 0 in place)
    if (o.bad_position) torch::stable::fill_(*o.bad_position, -1.0);
    return;
  }
  a.units = fast_div(units);
  a.walk[0] = row_walk(p, p.Hq, p.qs, o.qo);
  a.walk[1] = row_walk(p, p.Hk, p.ks, o.ko);
  const int64_t q_tasks = p.B * p.S * p.Hq * units, tasks = q_tasks + p.B * p.S * p.Hk * units;
  // (32-bit task indices: a task covers at least two elements, so 2^31 tasks are 2^32 elements)
  FUSEDOPS_CHECK(tasks < (int64_t(1) << 31), op, ": too many rows (", p.B * p.S * (p.Hq + p.Hk), ")");
  a.q_tasks = uint32_t(q_tasks);
  a.tasks = uint32_t(tasks);
  const int64_t blocks = (tasks + kThreads - 1) / kThreads;

  const cudaStream_t stream = current_stream(p.device_index);
  if (o.bad_position) {
    a.bad = reinterpret_cast<unsigned long long*>(o.bad_position->mutable_data_ptr<int64_t>());
    if (p.position_ids)
      FUSEDOPS_CHECK(cudaMemsetAsync(a.bad, 0xff, sizeof(*a.bad), stream) == cudaSuccess, op,
                     ": could not preset bad_position");
  }
  auto launch = [&](auto kernel) { kernel<<<unsigned(blocks), kThreads, 0, stream>>>(a); };
  if (vector) {
    if (p.interleaved)
      launch(rope_kernel<DT, DC, kVec, true, true>);
    else
      launch(rope_kernel<DT, DC, kVec, false, true>);
  } else {
    if (p.interleaved)
      launch(rope_kernel<DT, DC, 2, true, false>);
    else
      launch(rope_kernel<DT, DC, 1, false, false>);
  }
  check_launch(op);
}

struct Kernels {
  static void run(const Problem& p, const Outputs& o, const char* op) {
    torch::stable::accelerator::DeviceGuard guard(p.device_index);
    dispatch_float(p.dtype, op, [&](auto tag) {
      using T = typename decltype(tag)::type;
      if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) {
        if (p.cos.scalar_type() == ScalarType::Float) return run_typed<T, float>(p, o, op);
      }
      run_typed<T, T>(p, o, op);
    });
  }
};

}  // namespace
}  // namespace fusedops::rope::cuda

STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  using K = fusedops::rope::cuda::Kernels;
  m.impl("rope", TORCH_BOX(&fusedops::rope::rope<K>));
  m.impl("rope_", TORCH_BOX(&fusedops::rope::rope_inplace<K>));
  m.impl("rope_backward", TORCH_BOX(&fusedops::rope::rope_backward<K>));
}
