// rope, rope_ and rope_backward on the CPU (the math: fusedops/rope.h).
//
// Rows (one head of one position, D elements) run in parallel on torch's thread pool, q's rows
// then k's, each in the order of its memory (so a task streams through contiguous rows rather
// than hopping between heads S * D elements apart); each row reads its cos/sin row directly
// (small and cached). The inner loop handles a pair of partners per iteration, two multiplies
// and an add per element with no branch (forward and backward are separate instantiations),
// and vectorises; it is compiled per instruction set (cpu_isa.h). Positions are validated
// before any row runs.
#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <cstring>

#include "fusedops/cpu_convert.h"
#include "fusedops/cpu_isa.h"
#include "fusedops/dispatch.h"
#include "fusedops/rope.h"

namespace fusedops::rope::cpu {
namespace {

using fusedops::cpu::acc_t;
using fusedops::cpu::from_acc;
using fusedops::cpu::to_acc;

template <typename T, typename C>
struct Args {
  using A = acc_t<T>;
  const T* q = nullptr;
  const T* k = nullptr;
  T* qo = nullptr;
  T* ko = nullptr;
  Strides qs, ks, qos, kos;
  const C* cos = nullptr;
  const C* sin = nullptr;
  int64_t cos_b = 0, cos_s = 0, sin_b = 0, sin_s = 0;
  const int32_t* pos32 = nullptr;  // position_ids, one of the two or neither
  const int64_t* pos64 = nullptr;
  int64_t pos_b = 0, pos_s = 0;
  int64_t B = 0, S = 0, Hq = 0, Hk = 0, D = 0, R = 0;
  int64_t tile = 1;  // positions per tile in (b, h, s) order
  bool copy_rest = true;  // write the features past R (not in place: they are already there)
};

// One row; y may be x itself (each iteration reads its two elements before writing them).
// c and n are the row's cosines and sines. Forward: y_a = x_a c_a - x_b n_a, y_b = x_b c_b +
// x_a n_b for each pair (a, b) (a < R/2 and b = a + R/2, or a = 2i and b = 2i + 1); the
// backward, the transpose: y_a = x_a c_a + x_b n_b, y_b = x_b c_b - x_a n_a.
template <bool kInterleaved, bool kBackward, typename T, typename C>
FUSEDOPS_CPU_INLINE void rotate_row(const T* x, T* y, const C* c, const C* n, int64_t R, int64_t D, bool copy_rest) {
  using A = acc_t<T>;
  const int64_t h = R / 2;
  constexpr int64_t kStep = kInterleaved ? 2 : 1;  // a = i * kStep, b = a + off
  const int64_t off = kInterleaved ? 1 : h;
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) {
    const int64_t a = i * kStep, b = a + off;
    const A xa = to_acc(x[a]), xb = to_acc(x[b]);
    const A ca = A(to_acc(c[a])), cb = A(to_acc(c[b])), na = A(to_acc(n[a])), nb = A(to_acc(n[b]));
    if constexpr (kBackward) {
      y[a] = from_acc<T>(xa * ca + xb * nb);
      y[b] = from_acc<T>(xb * cb - xa * na);
    } else {
      y[a] = from_acc<T>(xa * ca - xb * na);
      y[b] = from_acc<T>(xb * cb + xa * nb);
    }
  }
  if (copy_rest && D > R) std::memcpy(y + R, x + R, sizeof(T) * (D - R));
}

// Rows [begin, end) of q's rows followed by k's, each tensor's rows in the order of its memory:
// (b, h, s) by tiles of positions when a head's positions are closer together than a
// position's heads (bhsd), else (b, s, h) (bshd, thd), so that the rows a task touches follow
// one another in memory.
template <bool kInterleaved, bool kBackward, typename T, typename C>
FUSEDOPS_CPU_MULTIVERSION void run_rows(const Args<T, C>& a, int64_t begin, int64_t end) {
  const int64_t q_rows = a.B * a.S * a.Hq;
  for (int64_t r = begin; r < end; ++r) {
    const bool is_q = r < q_rows;
    const int64_t i = is_q ? r : r - q_rows;
    const int64_t H = is_q ? a.Hq : a.Hk;
    const Strides& xs = is_q ? a.qs : a.ks;
    const Strides& ys = is_q ? a.qos : a.kos;
    int64_t b, head, s;
    if (xs.s < xs.h) {
      // (b, tile of positions, h, s): each head's rows of a tile follow one another in memory,
      // and the tile's cos/sin rows stay in L1 across the heads (walking all of S per head
      // would stream the whole table through the cache once per head).
      b = i / (a.S * H);
      const int64_t rem = i % (a.S * H);
      const int64_t t0 = rem / (H * a.tile) * a.tile;
      const int64_t len = std::min(a.tile, a.S - t0);
      const int64_t in_tile = rem - t0 * H;
      head = in_tile / len;
      s = t0 + in_tile % len;
    } else {  // (b, s, h)
      head = i % H;
      s = (i / H) % a.S;
      b = i / (H * a.S);
    }
    const T* x = (is_q ? a.q : a.k) + b * xs.b + head * xs.h + s * xs.s;
    T* y = (is_q ? a.qo : a.ko) + b * ys.b + head * ys.h + s * ys.s;
    const C *c, *n;
    if (a.pos32 != nullptr || a.pos64 != nullptr) {
      const int64_t at = b * a.pos_b + s * a.pos_s;
      const int64_t row = a.pos32 != nullptr ? int64_t(a.pos32[at]) : a.pos64[at];
      c = a.cos + row * a.cos_s;
      n = a.sin + row * a.sin_s;
    } else {
      c = a.cos + b * a.cos_b + s * a.cos_s;
      n = a.sin + b * a.sin_b + s * a.sin_s;
    }
    rotate_row<kInterleaved, kBackward>(x, y, c, n, a.R, a.D, a.copy_rest);
  }
}

// Refuses a position outside [0, P) before anything is written, naming where it is.
template <typename I>
void check_positions(const Problem& p, const I* pos, const char* op) {
  const int64_t B = p.pos_b == 0 ? 1 : p.B;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < p.S; ++s) {
      const int64_t v = pos[b * p.pos_b + s * p.pos_s];
      FUSEDOPS_CHECK(v >= 0 && v < p.P, op, ": position_ids[", b, ", ", s, "] = ", v,
                     " is outside the cos/sin tables' ", p.P, " rows");
    }
}

template <typename T, typename C>
void run_typed(const Problem& p, const Outputs& o) {
  Args<T, C> a;
  if (p.q) {
    a.q = p.q->const_data_ptr<T>();
    a.qo = o.q_out->mutable_data_ptr<T>();
  }
  if (p.k) {
    a.k = p.k->const_data_ptr<T>();
    a.ko = o.k_out->mutable_data_ptr<T>();
  }
  a.qs = p.qs;
  a.ks = p.ks;
  a.qos = o.qo;
  a.kos = o.ko;
  a.cos = p.cos.const_data_ptr<C>();
  a.sin = p.sin.const_data_ptr<C>();
  a.cos_b = p.cos_b;
  a.cos_s = p.cos_s;
  a.sin_b = p.sin_b;
  a.sin_s = p.sin_s;
  if (p.position_ids) {
    if (p.position_ids->scalar_type() == ScalarType::Int)
      a.pos32 = p.position_ids->const_data_ptr<int32_t>();
    else
      a.pos64 = p.position_ids->const_data_ptr<int64_t>();
    a.pos_b = p.pos_b;
    a.pos_s = p.pos_s;
  }
  a.B = p.B;
  a.S = p.S;
  a.Hq = p.Hq;
  a.Hk = p.Hk;
  a.D = p.D;
  a.R = p.R;
  a.copy_rest = !o.in_place;
  // About 16 KiB of cos/sin rows per tile.
  a.tile = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, 2 * p.R * int64_t(sizeof(C))));
  const int64_t rows = p.B * p.S * (p.Hq + p.Hk);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(p.D, 1));
  torch::stable::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    if (p.interleaved) {
      if (p.backward)
        run_rows<true, true>(a, begin, end);
      else
        run_rows<true, false>(a, begin, end);
    } else {
      if (p.backward)
        run_rows<false, true>(a, begin, end);
      else
        run_rows<false, false>(a, begin, end);
    }
  });
}

struct Kernels {
  static void run(const Problem& p, const Outputs& o, const char* op) {
    if (p.position_ids) {
      if (p.position_ids->scalar_type() == ScalarType::Int)
        check_positions(p, p.position_ids->const_data_ptr<int32_t>(), op);
      else
        check_positions(p, p.position_ids->const_data_ptr<int64_t>(), op);
    }
    if (o.bad_position) *o.bad_position->mutable_data_ptr<int64_t>() = -1;  // (checked above)
    dispatch_float(p.dtype, op, [&](auto tag) {
      using T = typename decltype(tag)::type;
      if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) {
        if (p.cos.scalar_type() == ScalarType::Float) return run_typed<T, float>(p, o);
      }
      run_typed<T, T>(p, o);
    });
  }
};

}  // namespace
}  // namespace fusedops::rope::cpu

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  using K = fusedops::rope::cpu::Kernels;
  m.impl("rope", TORCH_BOX(&fusedops::rope::rope<K>));
  m.impl("rope_", TORCH_BOX(&fusedops::rope::rope_inplace<K>));
  m.impl("rope_backward", TORCH_BOX(&fusedops::rope::rope_backward<K>));
}
