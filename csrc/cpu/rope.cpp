// rope, rope_ and rope_backward on the CPU (the math: fusedops/rope.h).
//
// Rows (one head of one position, D elements) run in parallel on torch's thread pool, ordered
// position by position with all of q's heads and then k's: each task forms the position's
// cosines and signed sines in float32 once (the sign and, in the backward, the transpose's
// choice of sine folded in) and applies them to every head of that position, so the inner loop
// is two multiplies and an add per element with no branch, and vectorises. The row loops are
// compiled per instruction set (cpu_isa.h). Positions are validated before any row runs.
#include <torch/csrc/stable/library.h>

#include <cstring>
#include <vector>

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
  int64_t S = 0, Hq = 0, Hk = 0, D = 0, R = 0;
  bool backward = false;
  bool copy_rest = true;  // write the features past R (not in place: they are already there)
};

// The position's cosines (cw) and signed sines (sw), so that y[j] = x[j]*cw[j] + x[partner]*sw[j].
template <bool kInterleaved, typename C, typename A>
FUSEDOPS_CPU_INLINE void position_tables(const C* c, const C* s, int64_t R, bool backward, A* cw, A* sw) {
  const int64_t h = R / 2;
  for (int64_t j = 0; j < R; ++j) cw[j] = A(to_acc(c[j]));
  if constexpr (!kInterleaved) {
    for (int64_t j = 0; j < h; ++j) {
      const A lo = A(to_acc(s[j])), hi = A(to_acc(s[j + h]));
      sw[j] = backward ? hi : -lo;
      sw[j + h] = backward ? -lo : hi;
    }
  } else {
    for (int64_t i = 0; i < h; ++i) {
      const A even = A(to_acc(s[2 * i])), odd = A(to_acc(s[2 * i + 1]));
      sw[2 * i] = backward ? odd : -even;
      sw[2 * i + 1] = backward ? -even : odd;
    }
  }
}

// One row; y may be x itself (each iteration reads its two elements before writing them).
template <bool kInterleaved, typename T, typename A>
FUSEDOPS_CPU_INLINE void rotate_row(const T* x, T* y, const A* cw, const A* sw, int64_t R, int64_t D,
                                    bool copy_rest) {
  const int64_t h = R / 2;
  if constexpr (!kInterleaved) {
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) {
      const A a = to_acc(x[j]), b = to_acc(x[j + h]);
      y[j] = from_acc<T>(a * cw[j] + b * sw[j]);
      y[j + h] = from_acc<T>(b * cw[j + h] + a * sw[j + h]);
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) {
      const A a = to_acc(x[2 * i]), b = to_acc(x[2 * i + 1]);
      y[2 * i] = from_acc<T>(a * cw[2 * i] + b * sw[2 * i]);
      y[2 * i + 1] = from_acc<T>(b * cw[2 * i + 1] + a * sw[2 * i + 1]);
    }
  }
  if (copy_rest && D > R) std::memcpy(y + R, x + R, sizeof(T) * (D - R));
}

// Rows [begin, end) of the position-major order: row r is head r % H (q's heads, then k's) of
// position r / H = b * S + s.
template <bool kInterleaved, typename T, typename C>
FUSEDOPS_CPU_MULTIVERSION void run_rows(const Args<T, C>& a, acc_t<T>* cw, acc_t<T>* sw, int64_t begin,
                                        int64_t end) {
  const int64_t H = a.Hq + a.Hk;
  int64_t current = -1;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t pos = r / H, head = r % H;
    const int64_t b = pos / a.S, s = pos % a.S;
    if (pos != current) {
      current = pos;
      const C *c, *sn;
      if (a.pos32 != nullptr || a.pos64 != nullptr) {
        const int64_t at = b * a.pos_b + s * a.pos_s;
        const int64_t row = a.pos32 != nullptr ? int64_t(a.pos32[at]) : a.pos64[at];
        c = a.cos + row * a.cos_s;
        sn = a.sin + row * a.sin_s;
      } else {
        c = a.cos + b * a.cos_b + s * a.cos_s;
        sn = a.sin + b * a.sin_b + s * a.sin_s;
      }
      position_tables<kInterleaved>(c, sn, a.R, a.backward, cw, sw);
    }
    const T* x;
    T* y;
    if (head < a.Hq) {
      x = a.q + b * a.qs.b + head * a.qs.h + s * a.qs.s;
      y = a.qo + b * a.qos.b + head * a.qos.h + s * a.qos.s;
    } else {
      const int64_t hk = head - a.Hq;
      x = a.k + b * a.ks.b + hk * a.ks.h + s * a.ks.s;
      y = a.ko + b * a.kos.b + hk * a.kos.h + s * a.kos.s;
    }
    rotate_row<kInterleaved>(x, y, cw, sw, a.R, a.D, a.copy_rest);
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
  a.S = p.S;
  a.Hq = p.Hq;
  a.Hk = p.Hk;
  a.D = p.D;
  a.R = p.R;
  a.backward = p.backward;
  a.copy_rest = !o.in_place;
  const int64_t rows = p.B * p.S * (p.Hq + p.Hk);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(p.D, 1));
  torch::stable::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t<T>> tables(2 * std::max<int64_t>(p.R, 1));
    if (p.interleaved)
      run_rows<true>(a, tables.data(), tables.data() + p.R, begin, end);
    else
      run_rows<false>(a, tables.data(), tables.data() + p.R, begin, end);
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
