// rope, rope_ and rope_backward on CUDA (the math: fusedops/rope.h).
//
// Memory-bound: q and k are read once and the outputs written once, in one launch for both.
// A thread does one task: one "unit" of G rows, G heads of one position (heads_per_task: 4
// for 16-bit rotate-half, else 1). A rotary unit is VEC elements and their partners
// (rotate-half: the VEC elements j.. and j + R/2..; interleaved: VEC adjacent elements holding
// VEC/2 pairs), VEC = 16 bytes of T; a pass-through unit copies up to two chunks of the
// features past R when the output is a new tensor. The task's cos/sin chunks are loaded once
// for its G heads and again for the next task (the tables are at most 1/10 of q and k and stay
// in L1/L2, but that L2 traffic is what G cuts). Tasks follow each tensor's memory order of
// rows (q's rows, then k's; a row dimension of heads counts head groups), so neighbouring
// threads read neighbouring bytes whatever the layout (bhsd, bshd, thd); with full rotary the
// heads come fastest instead, so that a warp's table chunks are shared (row_walk).
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
#include <type_traits>

#include "fusedops/cuda_utils.cuh"
#include "fusedops/rope.h"

namespace fusedops::rope::cuda {
namespace {

using namespace fusedops::cuda;

// Threads a block, and resident blocks an SM: a task's loads are all its work, so latency is
// hidden by threads in flight. Six 256-thread blocks (at most 40 registers a thread) for one
// head a task of bf16 with bf16 tables: in a comparison of one-head variants (H200, LLaMA-3-8B
// shape, forward) 3.90 TB/s bhsd and 3.93 bshd, against 3.64 and 3.62 for an unbounded build
// that used 64 registers; eight (32 registers) spill; two or four tasks a thread, each loading
// its own cos/sin, were slower (3.41, 3.47). Fewer where the conversions need more registers.
// Four heads a task (heads_per_task) hold four heads' chunks (80 registers, no spills): six
// 128-thread blocks, the same threads an SM as three of 256 but retired and replaced in smaller
// steps, which helps partial rotary, whose pass-through tasks finish early (H200, LLaMA-3-8B
// shape, bf16 forward, three alternating rounds of a scratch build with a switch, 2026-12-01:
// partial 3.72-3.74 -> 3.81-3.83 TB/s, bshd 3.91-3.92 -> 3.93-3.94, bhsd and thd level at
// 3.84-3.85 / 3.77-3.78). Against these, two heads a task (64 registers, four 256-thread or
// eight 128-thread blocks) ran bhsd and bshd level but partial and thd 1-5% slower; with 64
// registers four heads spill (104 bytes), and two at 48 (40 bytes).
template <int G>
__host__ __device__ constexpr int block_threads() {
  return G > 1 ? 128 : 256;
}
template <typename T, typename C, int G>
constexpr int min_blocks() {
  if constexpr (G > 1) return 6;
  if constexpr (sizeof(C) > sizeof(T)) return 4;  // 16-bit q and k, float32 tables
  if constexpr (std::is_same_v<T, __half>) return 5;
  return 6;
}

// Heads a task rotates with one load of its cos/sin chunks: four for 16-byte rotate-half units
// of 16-bit q and k with tables of their type. The tables are read through L2 once per task,
// and with one head a task that traffic kept L2 busy (ncu, bshd forward: L2 91%, DRAM 83%, L1
// hit rate 16%). On the H200 (LLaMA-3-8B shape, bf16, forward, scratch build with a switch)
// four heads took partial rotary from 3.50 to 3.83 TB/s and thd from 3.66 to 3.78, with bhsd
// and bshd unchanged (3.75 / 3.87 against 3.75 / 3.85), two heads in between; interleaved
// units lost (3.45 -> 3.13), so they keep one head, as do the other types (not measured).
template <typename T, typename C, bool kInterleaved, bool kVector>
constexpr int heads_per_task() {
  return kVector && !kInterleaved && sizeof(T) == 2 && std::is_same_v<T, C> ? 4 : 1;
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
  FastDiv size[3];  // the head dimension's size counts groups of G heads
  int64_t x[3], y[3], cos[3], sin[3], pos[3], flat[3];
  int head_dim;               // which of the three is the head dimension
  int64_t head_x, head_y;     // one head's step in the input and output
  uint32_t heads;
};

template <typename T, typename C>
struct Args {
  const T* q;
  const T* k;
  T* qo;
  T* ko;
  RowWalk walk[2];        // q's, k's
  uint32_t q_tasks, tasks;  // q's tasks come first, unless `joint`
  FastDiv units;          // per row: rotary units, then pass-through units
  // Positions visited once for q and k together: a position's q head groups, then its k head
  // groups (`groups` of them, q_groups of q's), the heads fastest in both walks.
  bool joint;
  FastDiv groups;
  uint32_t q_groups;
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

// One task per thread: unit u of G heads of one position (the heads in a row, H of them in the
// last group at most). A rotary unit u covers the chunks ja = u * VEC and jb: ja + R/2 for
// rotate-half; for interleaved the next chunk, ja + VEC (absent past R when R / VEC is odd).
// VEC: elements per access (16 bytes of T when kVector, else 1, or 2 for interleaved pairs).
template <typename T, typename C, int VEC, bool kInterleaved, bool kVector,
          int G = heads_per_task<T, C, kInterleaved, kVector>()>
__global__ void __launch_bounds__(block_threads<G>(), min_blocks<T, C, G>()) rope_kernel(const Args<T, C> a) {
  using A = acc_t<T>;
  const uint32_t task = blockIdx.x * block_threads<G>() + threadIdx.x;
  if (task >= a.tasks) return;
  int which;
  uint32_t row;
  int u;
  if (a.joint) {
    const uint32_t r = div(a.units, task);
    u = int(task - r * a.units.d);
    const uint32_t position = div(a.groups, r);
    const uint32_t group = r - position * a.groups.d;
    which = group < a.q_groups ? 0 : 1;
    // (the head dimension is the walk's fastest: its row index is position * groups + group)
    row = position * a.walk[which].size[2].d + (which == 0 ? group : group - a.q_groups);
  } else {
    which = task < a.q_tasks ? 0 : 1;
    const uint32_t t = which == 0 ? task : task - a.q_tasks;
    row = div(a.units, t);
    u = int(t - row * a.units.d);
  }
  const RowWalk& w = a.walk[which];
  int64_t x_off = 0, y_off = 0, c_off = 0, n_off = 0, p_off = 0, flat = 0;
  uint32_t head0 = 0;
#pragma unroll
  for (int d = 2; d >= 0; --d) {
    const uint32_t next = d == 0 ? 0 : div(w.size[d], row);
    const uint32_t i = row - next * w.size[d].d;
    row = next;
    if (d == w.head_dim) head0 = i * G;
    x_off += int64_t(i) * w.x[d];
    y_off += int64_t(i) * w.y[d];
    c_off += int64_t(i) * w.cos[d];
    n_off += int64_t(i) * w.sin[d];
    if (a.pos != nullptr) {
      p_off += int64_t(i) * w.pos[d];
      flat += int64_t(i) * w.flat[d];
    }
  }
  const int heads = G == 1 ? 1 : int(min(uint32_t(G), w.heads - head0));
  const T* x = (which == 0 ? a.q : a.k) + x_off;
  T* y = (which == 0 ? a.qo : a.ko) + y_off;

  const int64_t ja = int64_t(u) * (kInterleaved ? 2 * VEC : VEC);
  const int64_t jb = kInterleaved ? ja + VEC : ja + a.R / 2;
  const bool rotary = u < a.rot_units;
  const bool has_b = rotary && (!kInterleaved || jb < a.R);
  // Every head's q/k chunks are requested before the position lookup that the table rows wait on.
  Held<T, VEC> xa[G], xb[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (rotary && g < heads) {
      xa[g] = load_raw<kVector, VEC>(x + g * w.head_x + ja);
      if (has_b) xb[g] = load_raw<kVector, VEC>(x + g * w.head_x + jb);
    }
  }

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

  if (!rotary) {  // features past R, unchanged (a new output: no overlap with x)
    constexpr int kRest = kVector ? VEC : 1;
    const int c = u - a.rot_units;
    const int64_t j0 = a.R + int64_t(c) * kRest, j1 = a.R + int64_t(c + a.rest_half) * kRest;
    const bool second = c + a.rest_half < a.rest_chunks;
    Vec<T, kRest> v0[G], v1[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g < heads) {
        v0[g] = *reinterpret_cast<const Vec<T, kRest>*>(x + g * w.head_x + j0);
        if (second) v1[g] = *reinterpret_cast<const Vec<T, kRest>*>(x + g * w.head_x + j1);
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g < heads) {
        *reinterpret_cast<Vec<T, kRest>*>(y + g * w.head_y + j0) = v0[g];
        if (second) *reinterpret_cast<Vec<T, kRest>*>(y + g * w.head_y + j1) = v1[g];
      }
    }
    return;
  }

  const C* crow = a.cos + c_off;
  const C* srow = a.sin + n_off;
  Held<C, VEC> ca = load_raw<kVector, VEC>(crow + ja);
  const Held<C, VEC> na = load_raw<kVector, VEC>(srow + ja);
  Held<C, VEC> cb{}, nb{};
  if (has_b) {
    cb = load_raw<kVector, VEC>(crow + jb);
    nb = load_raw<kVector, VEC>(srow + jb);
  }
  if (!valid) {  // an invalid position's rotated features come out NaN
    acc_t<C> nan[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) nan[e] = quiet_nan<acc_t<C>>();
    ca = cb = round_held<C, VEC>(nan);
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (g < heads) {
      A ya[VEC], yb[VEC];
      if (a.backward)
        rotate<true, kInterleaved>(xa[g], xb[g], ca, cb, na, nb, ya, yb);
      else
        rotate<false, kInterleaved>(xa[g], xb[g], ca, cb, na, nb, ya, yb);
      store_acc_vals<kVector, VEC>(y + g * w.head_y + ja, ya);
      if (has_b) store_acc_vals<kVector, VEC>(y + g * w.head_y + jb, yb);
    }
  }
}

inline bool aligned_strides(const Strides& st, int64_t vec) {
  return st.b % vec == 0 && st.h % vec == 0 && st.s % vec == 0;
}

// The walk over a tensor's rows (B, H, S) with input strides `xs` and output strides `ys`.
// `order` receives the logical dimensions, slowest first.
inline RowWalk row_walk(const Problem& p, int64_t H, const Strides& xs, const Strides& ys, int G, int (&order)[3]) {
  // Per logical dimension (b, h, s): size, input, output, cos, sin, position and flat steps.
  // With position_ids the cos/sin rows come from the positions instead (steps zero).
  struct Dim {
    int64_t size, x, y, cos, sin, pos, flat;
  };
  const bool by_position = p.position_ids.has_value();
  Dim dims[3] = {
      {p.B, xs.b, ys.b, by_position ? 0 : p.cos_b, by_position ? 0 : p.sin_b, p.pos_b, p.S},
      {(H + G - 1) / G, xs.h * G, ys.h * G, 0, 0, 0, 0},
      {p.S, xs.s, ys.s, by_position ? 0 : p.cos_s, by_position ? 0 : p.sin_s, p.pos_s, 1},
  };
  // Largest input stride first (ties: the logical order), so the last dimension moves fastest
  // and consecutive rows are nearest in memory. Except that with full rotary (R = D) the heads
  // move fastest whatever their stride: the tasks of a warp then share one position, so their
  // cos/sin chunks are the same addresses, one L2 request for all of them, where rows ordered by
  // stride (bhsd: positions fastest) gave each position's row of a warp its own. This only
  // changes bhsd-like strides (bshd and thd already have heads fastest). H200, LLaMA-3-8B shape,
  // bf16 forward, alternating runs of a scratch build with a switch (2026-12-01): bhsd
  // 3.76-3.77 -> 3.82 TB/s (forward+backward 3.80 -> 3.84), interleaved 3.46-3.47 -> 3.63, bshd and
  // thd unchanged; partial rotary (R = D / 2), whose tables are half as large and whose
  // pass-through units read none, lost (3.70 -> 3.54): it keeps the order by stride.
  order[0] = 0, order[1] = 1, order[2] = 2;
  std::stable_sort(order, order + 3, [&](int l, int r) {
    const int64_t sl = dims[l].size > 1 ? dims[l].x : 0, sr = dims[r].size > 1 ? dims[r].x : 0;
    return sl > sr;
  });
  if (p.R == p.D) std::stable_partition(order, order + 3, [](int d) { return d != 1; });
  RowWalk w{};
  w.head_x = xs.h;
  w.head_y = ys.h;
  w.heads = uint32_t(H);
  for (int d = 0; d < 3; ++d) {
    const Dim& m = dims[order[d]];
    w.size[d] = fast_div(std::max<int64_t>(m.size, 1));
    w.x[d] = m.x;
    w.y[d] = m.y;
    w.cos[d] = m.cos;
    w.sin[d] = m.sin;
    w.pos[d] = m.pos;
    w.flat[d] = m.flat;
    if (order[d] == 1) w.head_dim = d;
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
  // Tables without rows (with position_ids): every position is out of range, and the kernel,
  // which reads row 0 in place of such a position's row (its result is NaN either way), reads a
  // row of zeros instead of memory that is not there.
  std::optional<Tensor> zero_row;
  if (p.position_ids && p.P == 0 && p.R > 0) {
    zero_row = empty_like_device(p.cos, {p.R}, p.cos.scalar_type());
    torch::stable::fill_(*zero_row, 0.0);
    a.cos = a.sin = reinterpret_cast<const DC*>(zero_row->const_data_ptr<C>());
  }
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
  const cudaStream_t stream = current_stream(p.device_index);
  if (o.bad_position) {
    a.bad = reinterpret_cast<unsigned long long*>(o.bad_position->mutable_data_ptr<int64_t>());
    if (p.position_ids)
      FUSEDOPS_CHECK(cudaMemsetAsync(a.bad, 0xff, sizeof(*a.bad), stream) == cudaSuccess, op,
                     ": could not preset bad_position");
  }
  // A task covers G heads of one position (heads_per_task): the walks step over head groups.
  auto launch = [&](auto kernel, auto heads) {
    constexpr int G = decltype(heads)::value, kThreads = block_threads<G>();
    int q_order[3], k_order[3];
    a.walk[0] = row_walk(p, p.Hq, p.qs, o.qo, G, q_order);
    a.walk[1] = row_walk(p, p.Hk, p.ks, o.ko, G, k_order);
    // With full rotary both walks have the heads fastest; when they also visit positions in the
    // same order, one walk over positions serves q and k, so that a position's cos/sin chunks
    // are read from DRAM once for both instead of once in q's sweep and again in k's, long after
    // L2 let them go (the (B, S, R) tables are 1/20 of q and k's bytes at the LLaMA-3-8B shape).
    // H200, bf16 forward, three alternating rounds (2026-12-01): bhsd 3.81-3.82 -> 3.85-3.86
    // TB/s, bshd 3.83-3.85 -> 3.92-3.93, interleaved 3.72-3.73 -> 3.76-3.77; ncu: DRAM reads
    // 369 -> 352 MB (q and k: 336). Not with position_ids: their (P, R) tables are shared by
    // every sequence and stay in L2, and the joint walk only added streams (thd 3.79-3.80 ->
    // 3.76-3.77).
    a.joint = p.q && p.k && !p.position_ids && p.R == p.D && q_order[2] == 1 &&
              std::equal(q_order, q_order + 3, k_order);
    const int64_t q_groups = (p.Hq + G - 1) / G, k_groups = (p.Hk + G - 1) / G;  // head groups a position
    if (a.joint) {
      a.q_groups = uint32_t(q_groups);
      a.groups = fast_div(q_groups + k_groups);
    }
    const int64_t q_tasks = p.B * p.S * q_groups * units, tasks = q_tasks + p.B * p.S * k_groups * units;
    // (32-bit task indices: a task covers at least two elements, so 2^31 tasks are 2^32 elements)
    FUSEDOPS_CHECK(tasks < (int64_t(1) << 31), op, ": too many rows (", p.B * p.S * (p.Hq + p.Hk), ")");
    a.q_tasks = uint32_t(q_tasks);
    a.tasks = uint32_t(tasks);
    kernel<<<unsigned((tasks + kThreads - 1) / kThreads), kThreads, 0, stream>>>(a);
  };
  auto pick = [&](auto vec, auto interleaved, auto vector) {
    constexpr int V = decltype(vec)::value;
    constexpr bool I = decltype(interleaved)::value, W = decltype(vector)::value;
    launch(rope_kernel<DT, DC, V, I, W>, std::integral_constant<int, heads_per_task<DT, DC, I, W>()>{});
  };
  using std::bool_constant;
  using std::integral_constant;
  if (vector) {
    if (p.interleaved)
      pick(integral_constant<int, kVec>{}, bool_constant<true>{}, bool_constant<true>{});
    else
      pick(integral_constant<int, kVec>{}, bool_constant<false>{}, bool_constant<true>{});
  } else {
    if (p.interleaved)
      pick(integral_constant<int, 2>{}, bool_constant<true>{}, bool_constant<false>{});
    else
      pick(integral_constant<int, 1>{}, bool_constant<false>{}, bool_constant<false>{});
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
