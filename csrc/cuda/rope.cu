// rope, rope_ and rope_backward on CUDA (the math: fusedops/rope.h).
//
// Memory-bound: q and k are read once and the outputs written once, in one launch for both.
// A thread owns one "unit" of the rotary features of a position: VEC elements and their
// partners (rotate-half: the VEC elements j.. and j + R/2..; interleaved: VEC adjacent elements
// holding VEC/2 pairs), VEC = 16 bytes of T. It loads that unit's cosines and sines once, held
// as stored (packed 16-bit words for 16-bit tables), and applies them to every head of q and
// then k at that position, kUnroll heads' loads in flight at a time: cos/sin are read once per
// launch, and each head costs two 16-byte loads and two 16-byte stores per thread. Features
// past R are copied by the same threads when the output is a new tensor.
//
// A block is (units, positions, head lanes): the positions per block shrink and the head
// lanes grow until the grid has two blocks per SM, so decode shapes (a few positions, many
// heads) still spread over the GPU; the grid's second dimension then splits the heads into
// groups until it is several waves deep. Tensors whose strides or base addresses do not allow
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
constexpr int kUnroll = 2;  // heads in flight per thread

template <typename T, typename C>
struct Args {
  const T* q;
  const T* k;
  T* qo;
  T* ko;
  Strides qs, ks, qos, kos;
  const C* cos;
  const C* sin;
  int64_t cos_b, cos_s, sin_b, sin_s;
  const void* pos;  // position_ids (int32 when pos32, else int64), or null
  bool pos32;
  int64_t pos_b, pos_s, P;
  int64_t n_pos, S;
  int Hq, Hk;
  int heads_per_block;  // a block's heads; gridDim.y blocks cover q's and k's
  int64_t D, R;
  bool backward;
  bool copy_rest;  // write the features past R (not in place)
};

// N elements of T (q, k or a table) as they are stored, held packed (cuda_utils.cuh: load_held)
// and converted where they are used: the heads in flight cost 16 bytes of registers each, and
// a thread issues all its loads before it waits on one. One vector load, or N scalar loads.
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

// Hides held values from the optimiser for one use: without it the tables' conversions to
// float are hoisted out of the loop over heads, and the converted copies (4 x VEC floats) cost
// the registers that keep more threads resident.
template <typename T, int N>
__device__ __forceinline__ Held<T, N> opaque(Held<T, N> h) {
  if constexpr (std::is_same_v<Held<T, N>, Packed<T, N>>) {
#pragma unroll
    for (int k = 0; k < N / 2; ++k) asm volatile("" : "+r"(h.w[k]));
  }
  return h;
}

// Element offset of row (b, head, s) of q or k (heads past Hq are k's), and of its output.
template <typename T, typename C>
__device__ __forceinline__ void row_pointers(const Args<T, C>& a, int64_t b, int64_t s, int head, const T*& x, T*& y) {
  if (head < a.Hq) {
    x = a.q + b * a.qs.b + int64_t(head) * a.qs.h + s * a.qs.s;
    y = a.qo + b * a.qos.b + int64_t(head) * a.qos.h + s * a.qos.s;
  } else {
    const int64_t hk = head - a.Hq;
    x = a.k + b * a.ks.b + hk * a.ks.h + s * a.ks.s;
    y = a.ko + b * a.kos.b + hk * a.kos.h + s * a.kos.s;
  }
}

// VEC: elements per access (16 bytes of T when kVector, else 1, or 2 for interleaved pairs).
template <typename T, typename C, int VEC, bool kInterleaved, bool kVector>
__global__ void __launch_bounds__(kThreads) rope_kernel(const Args<T, C> a) {
  using A = acc_t<T>;
  const int64_t pos = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (pos >= a.n_pos) return;
  const int64_t b = pos / a.S, s = pos % a.S;
  const C* crow;
  const C* srow;
  bool valid = true;
  if (a.pos != nullptr) {
    const int64_t at = b * a.pos_b + s * a.pos_s;
    int64_t row = a.pos32 ? int64_t(static_cast<const int32_t*>(a.pos)[at]) : static_cast<const int64_t*>(a.pos)[at];
    // Never read outside the tables: such a position's rotated features come out NaN (eager
    // calls are checked before the launch, see ops/rope.py).
    valid = row >= 0 && row < a.P;
    row = valid ? row : 0;
    crow = a.cos + row * a.cos_s;
    srow = a.sin + row * a.sin_s;
  } else {
    crow = a.cos + b * a.cos_b + s * a.cos_s;
    srow = a.sin + b * a.sin_b + s * a.sin_s;
  }
  // This block's heads (q's, then k's): blockIdx.y picks a group of heads_per_block.
  const int h_begin = int(blockIdx.y) * a.heads_per_block;
  const int H = min(a.Hq + a.Hk, h_begin + a.heads_per_block);
  const int64_t half = a.R / 2;
  const int64_t units = kInterleaved ? a.R / VEC : half / VEC;

  // The rotation of a pair (x0, x1) of features with cosines (c0, c1) and sines (n0, n1):
  // forward y0 = x0 c0 - x1 n0, y1 = x1 c1 + x0 n1; the backward (the transpose) swaps which
  // sine goes with which sign: y0 = x0 c0 + x1 n1, y1 = x1 c1 - x0 n0.
  const A sign = a.backward ? A(1) : A(-1);
  for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
    // ja: this unit's elements; rotate-half partners sit at jb = ja + R/2 (interleaved: the
    // pairs are adjacent, (ja + e, ja + e + 1)).
    const int64_t ja = u * VEC;
    const int64_t jb = kInterleaved ? ja : ja + half;
    Held<C, VEC> ca_ = load_raw<kVector, VEC>(crow + ja);
    const Held<C, VEC> na_ = load_raw<kVector, VEC>(srow + ja);
    [[maybe_unused]] Held<C, VEC> cb_, nb_;
    if constexpr (!kInterleaved) {
      cb_ = load_raw<kVector, VEC>(crow + jb);
      nb_ = load_raw<kVector, VEC>(srow + jb);
    }
    if (!valid) {  // an invalid position's rotated features come out NaN
      acc_t<C> nan[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) nan[e] = quiet_nan<acc_t<C>>();
      ca_ = cb_ = round_held<C, VEC>(nan);
    }
    for (int h0 = h_begin + int(threadIdx.z); h0 < H; h0 += kUnroll * blockDim.z) {
      // Every load of the group is issued before any store: in place, a store may alias a
      // later head's load only through the compiler's eyes, never in fact.
      Held<T, VEC> xa[kUnroll];
      [[maybe_unused]] Held<T, VEC> xb[kUnroll];
      T* dst[kUnroll];
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        const int head = h0 + i * blockDim.z;
        dst[i] = nullptr;
        if (head < H) {
          const T* x;
          row_pointers(a, b, s, head, x, dst[i]);
          xa[i] = load_raw<kVector, VEC>(x + ja);
          if constexpr (!kInterleaved) xb[i] = load_raw<kVector, VEC>(x + jb);
        }
      }
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        if (dst[i] == nullptr) continue;
        const Held<C, VEC> ca = opaque<C, VEC>(ca_), na = opaque<C, VEC>(na_);
        [[maybe_unused]] Held<C, VEC> cb, nb;
        if constexpr (!kInterleaved) cb = opaque<C, VEC>(cb_), nb = opaque<C, VEC>(nb_);
        A ya[VEC];
        if constexpr (kInterleaved) {
#pragma unroll
          for (int e = 0; e < VEC; e += 2) {
            const A x0 = acc_at(xa[i], e), x1 = acc_at(xa[i], e + 1);
            const A n0 = acc_at(na, e), n1 = acc_at(na, e + 1);
            ya[e] = x0 * A(acc_at(ca, e)) + x1 * (a.backward ? n1 : -n0);
            ya[e + 1] = x1 * A(acc_at(ca, e + 1)) + x0 * (a.backward ? -n0 : n1);
          }
          store_acc_vals<kVector, VEC>(dst[i] + ja, ya);
        } else {
          A yb[VEC];
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const A x0 = acc_at(xa[i], e), x1 = acc_at(xb[i], e);
            const A n0 = acc_at(na, e), n1 = acc_at(nb, e);
            ya[e] = x0 * A(acc_at(ca, e)) + sign * x1 * (a.backward ? n1 : n0);
            yb[e] = x1 * A(acc_at(cb, e)) - sign * x0 * (a.backward ? n0 : n1);
          }
          store_acc_vals<kVector, VEC>(dst[i] + ja, ya);
          store_acc_vals<kVector, VEC>(dst[i] + jb, yb);
        }
      }
    }
  }

  if (a.copy_rest) {
    // Features past R, unchanged (a new output, so sources and destinations never overlap).
    constexpr int kRest = kVector ? VEC : 1;
    const int64_t chunks = (a.D - a.R) / kRest;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      const int64_t j = a.R + c * kRest;
      for (int h0 = h_begin + int(threadIdx.z); h0 < H; h0 += kUnroll * blockDim.z) {
        Vec<T, kRest> v[kUnroll];
        T* dst[kUnroll];
#pragma unroll
        for (int i = 0; i < kUnroll; ++i) {
          const int head = h0 + i * blockDim.z;
          dst[i] = nullptr;
          if (head < H) {
            const T* x;
            row_pointers(a, b, s, head, x, dst[i]);
            v[i] = kVector ? load_vec<T, kRest>(x + j) : *reinterpret_cast<const Vec<T, kRest>*>(x + j);
          }
        }
#pragma unroll
        for (int i = 0; i < kUnroll; ++i)
          if (dst[i] != nullptr) {
            if constexpr (kVector)
              store_vec<T, kRest>(dst[i] + j, v[i]);
            else
              *reinterpret_cast<Vec<T, kRest>*>(dst[i] + j) = v[i];
          }
      }
    }
  }
}

inline bool aligned_strides(const Strides& st, int64_t vec) {
  return st.b % vec == 0 && st.h % vec == 0 && st.s % vec == 0;
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
  a.qs = p.qs;
  a.ks = p.ks;
  a.qos = o.qo;
  a.kos = o.ko;
  a.cos = reinterpret_cast<const DC*>(p.cos.const_data_ptr<C>());
  a.sin = reinterpret_cast<const DC*>(p.sin.const_data_ptr<C>());
  a.cos_b = p.cos_b;
  a.cos_s = p.cos_s;
  a.sin_b = p.sin_b;
  a.sin_s = p.sin_s;
  if (p.position_ids) {
    a.pos = p.position_ids->const_data_ptr();
    a.pos32 = p.position_ids->scalar_type() == ScalarType::Int;
    a.pos_b = p.pos_b;
    a.pos_s = p.pos_s;
    a.P = p.P;
  }
  a.n_pos = p.B * p.S;
  a.S = p.S;
  FUSEDOPS_CHECK(p.Hq + p.Hk < (int64_t(1) << 30), op, ": too many heads (", p.Hq + p.Hk, ")");
  a.Hq = int(p.Hq);
  a.Hk = int(p.Hk);
  a.D = p.D;
  a.R = p.R;
  a.backward = p.backward;
  a.copy_rest = !o.in_place && p.D > p.R;

  // 16-byte accesses need every row and table offset, and every base, 16-byte aligned.
  const int64_t rotary_step = p.interleaved ? kVec : 2 * kVec;
  bool vector = p.D % kVec == 0 && p.R % rotary_step == 0 && aligned16(a.cos) && aligned16(a.sin) &&
                a.cos_b % kVec == 0 && a.cos_s % kVec == 0 && a.sin_b % kVec == 0 && a.sin_s % kVec == 0;
  if (p.q) vector = vector && aligned16(a.q) && aligned16(a.qo) && aligned_strides(a.qs, kVec) && aligned_strides(a.qos, kVec);
  if (p.k) vector = vector && aligned16(a.k) && aligned16(a.ko) && aligned_strides(a.ks, kVec) && aligned_strides(a.kos, kVec);

  const int vec = vector ? kVec : (p.interleaved ? 2 : 1);
  const int64_t units = p.interleaved ? p.R / vec : p.R / 2 / vec;
  const int64_t rest = (p.D - p.R) / (vector ? kVec : 1);
  const int g = int(std::min<int64_t>(kThreads, units > 0 ? units : std::max<int64_t>(rest, 1)));
  // Positions per block, then head lanes for grids too small to fill the GPU.
  const int64_t H = p.Hq + p.Hk;
  const int64_t sms = multiprocessor_count(p.device_index);
  int pb = std::max(1, kThreads / g), hs = 1;
  const int64_t n_pos = a.n_pos;
  while (pb >= 2 && (n_pos + pb - 1) / pb < 2 * sms && 2 * hs <= std::min<int64_t>(H, 64)) {
    pb /= 2;
    hs *= 2;
  }
  pb = int(std::min<int64_t>(pb, n_pos));
  const int64_t blocks = (n_pos + pb - 1) / pb;
  FUSEDOPS_CHECK(blocks < (int64_t(1) << 31), op, ": too many positions (", n_pos, ")");
  // Heads are split among blocks while the grid has fewer than four blocks per SM: a grid of a
  // few long-lived blocks idles much of the GPU in its last wave (partial rotary at LLaMA-3-8B's
  // shape made 512 blocks: 2.5 TB/s forward, 3.1 with the split). Splitting a grid that is
  // already deep only repeats the cos/sin loads (1024 blocks split into 5120 lost 4%). A block
  // keeps at least two rounds of kUnroll heads per lane, over which its cos/sin loads are amortised.
  const int64_t want = 4 * sms;
  const int64_t max_groups = std::max<int64_t>(1, H / (2 * kUnroll * hs));
  const int64_t groups0 = std::clamp<int64_t>((want + blocks - 1) / blocks, 1, max_groups);
  a.heads_per_block = int((H + groups0 - 1) / groups0);
  const int64_t groups = (H + a.heads_per_block - 1) / a.heads_per_block;
  const dim3 block(g, pb, hs);
  const cudaStream_t stream = current_stream(p.device_index);
  auto launch = [&](auto kernel) { kernel<<<dim3(unsigned(blocks), unsigned(groups)), block, 0, stream>>>(a); };
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
