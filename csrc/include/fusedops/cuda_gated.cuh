// The CUDA kernels of the gated activations (gated.h says what they compute). Purely
// memory-bound: the forward reads gate and up and writes y (3 passes), the backward reads
// grad_output, gate and up and writes grad_gate and grad_up (5 passes); the math (one exp, and
// an erf for gelu) is far below the instruction budget per byte.
//
// Layout: each row is cut into vectors of VEC elements, VEC * sizeof(T) = 16 bytes where every
// operand's base, row strides and (packed) half offset allow it, else the widest access they
// all allow (8, 4, 2 bytes: a packed gate_up whose n * sizeof(T) is not a multiple of 16). A
// row's last vector may be partial; it is read and written element by element, on a separate
// path taken only by tiles that hold one. A block of kThreads threads owns a tile of up to
// kThreads * U vectors: part of one row (wide rows, cut into tiles of that many vectors) or
// several whole rows (narrow rows). Each thread issues every load of its vectors (U of them,
// forward_unroll / backward_unroll) before it waits on any: they are held packed
// (cuda_utils.cuh, load_held), since unpacking 16-bit values at the load made each thread wait
// for one load before issuing the next (2.3-2.7 TB/s instead of 4.1-4.3 on the H200). When every
// operand is contiguous the whole tensor is one row of numel elements (gated.h), split into
// tiles as any wide row: a plain grid over the tensor.
// Offsets are 64-bit throughout.
//
// Everything here has internal linkage: each op's translation unit instantiates what it uses.
#pragma once

#include <algorithm>
#include <cstdint>

#include <torch/csrc/stable/accelerator.h>

#include "fusedops/cuda_utils.cuh"
#include "fusedops/gated.h"

namespace fusedops::gated::cuda {
namespace {

using namespace fusedops::cuda;

constexpr int kThreads = 256;
// Vectors a thread owns. The backward: 8 elements of each of its three inputs (two outputs),
// at most four vectors; with the loads held packed, 32 registers for 16-bit data, nearly every
// thread slot of an SM resident with 48 bytes a thread in flight, which reaches the H200's copy
// bandwidth. The forward, for 16-byte vectors of 16-bit data, by activation: one vector (8
// elements of each input, 28 registers, every thread slot resident) for silu and tanh-gelu,
// whose math is a few instructions an element; four (58-69 registers) for erf-gelu, whose erf
// costs enough that a thread needs more independent elements to keep the loads coming.
// Measured on the H200 (bf16 forward TB/s at 16384x14336 / 4096x28672 / 8192x11008, scratch
// build with a switch, alternating runs, 2026-12-01), against two vectors for all three:
// swiglu 4.27 / 4.17 / 4.12 -> 4.32 / 4.21 / 4.19, tanh-geglu 4.27 / 4.16 / 4.12 -> 4.33 /
// 4.21 / 4.15, geglu 3.91 / 3.82 / 3.78 -> 4.20 / 4.07 / 4.01. Other vector widths: 4 vectors.
template <Act kAct>
__host__ __device__ constexpr int forward_unroll(int vec) {
  return vec < 8 ? 4 : kAct == Act::kGelu ? 4 : 1;
}
__host__ __device__ constexpr int backward_unroll(int vec) { return vec >= 8 ? 1 : vec >= 4 ? 2 : 4; }

__device__ __forceinline__ float exp_acc(float x) { return __expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float erf_acc(float x) { return erff(x); }
__device__ __forceinline__ double erf_acc(double x) { return erf(x); }
// 1 / (1 + e^-x); e^-x = inf (x < -88.7) gives 0, as it should.
// The hardware reciprocal (cuda_utils.cuh, about 1 ulp like __expf), keeping a subnormal
// sigmoid (x from -88.7 to -87.3) as torch does: times a huge up (|u| > 1e30) it is an ordinary
// number. 1 / inf = 0.
__device__ __forceinline__ float sigmoid(float x) { return rcp_approx_keep_subnormal(1.0f + __expf(-x)); }
__device__ __forceinline__ double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
__device__ __forceinline__ float rcp_acc(float x) { return rcp_approx_keep_subnormal(x); }
__device__ __forceinline__ double rcp_acc(double x) { return 1.0 / x; }
// s = sigmoid(x) and c = 1 - s, each with a small relative error: for x >= 0, 1 - s would
// cancel (it is e^-x s); for x < 0, e^-x may be inf while 1 - s is exact enough.
template <typename A>
__device__ __forceinline__ void sigmoid_pair(A x, A& s, A& c) {
  const A e = exp_acc(-x);
  s = rcp_acc(A(1) + e);
  c = x >= A(0) ? e * s : A(1) - s;
}

constexpr double kSqrt1_2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1 / sqrt(2 pi)
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kTanhCubic = 0.044715;

template <Act kAct, typename A>
__device__ __forceinline__ A activation(A g) {
  if constexpr (kAct == Act::kSilu) {
    return g * sigmoid(g);
  } else if constexpr (kAct == Act::kGelu) {
    return A(0.5) * g * (A(1) + erf_acc(g * A(kSqrt1_2)));
  } else {
    return g * sigmoid(A(2 * kSqrt2OverPi) * (g + A(kTanhCubic) * g * g * g));
  }
}

template <Act kAct, typename A>
__device__ __forceinline__ void activation_grad(A g, A& act, A& dact) {
  if constexpr (kAct == Act::kSilu) {
    A s, c;
    sigmoid_pair(g, s, c);
    act = g * s;
    dact = s * (A(1) + g * c);
  } else if constexpr (kAct == Act::kGelu) {
    const A cdf = A(0.5) * (A(1) + erf_acc(g * A(kSqrt1_2)));
    act = g * cdf;
    dact = cdf + g * (A(kInvSqrt2Pi) * exp_acc(A(-0.5) * g * g));
  } else {
    const A g2 = g * g;
    A s, c;
    sigmoid_pair(A(2 * kSqrt2OverPi) * (g + A(kTanhCubic) * g2 * g), s, c);
    act = g * s;
    dact = s + g * (A(2) * s * c) * (A(kSqrt2OverPi) * (A(1) + A(3 * kTanhCubic) * g2));
  }
}

// One strided input: element (r, j) at p + rows.offset(r) + j.
template <typename T>
struct In {
  const T* __restrict__ p;
  RowLayout rows;
};

template <typename T>
struct Args {
  In<T> g, u, dy;  // dy: backward only
  T* __restrict__ out0;  // y, or grad_gate
  T* __restrict__ out1;  // grad_up
  int64_t out_row_stride;
  int64_t n;          // elements per row
  int64_t nvec;       // vectors per row (the last one may be partial)
  int64_t num_rows;
  int64_t rows_per_block;  // > 1 only for narrow rows (then tiles_per_row is 1)
  int64_t tiles_per_row;
};

// The vector at column `col` of a row, held packed (cuda_utils.cuh: load_held). kFull: the
// caller knows the vector lies inside the row, so the load is one unconditional vector access
// and a thread issues all its loads before waiting on any; else a row's last vector may be
// partial (its missing elements read as 0).
template <typename T, int VEC, bool kFull>
__device__ __forceinline__ Held<T, VEC> load_at(const T* row, int64_t col, int64_t n) {
  if (kFull || col + VEC <= n) return load_held<T, VEC>(row + col);
  return load_held_partial<T, VEC>(row + col, int(n - col));
}

template <typename T, int VEC, bool kFull>
__device__ __forceinline__ void store_at(T* row, int64_t col, int64_t n, const acc_t<T> (&vals)[VEC]) {
  if (kFull || col + VEC <= n) {
    store_from_acc<T, VEC>(row + col, vals);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k)
      if (col + k < n) row[col + k] = from_acc<T>(vals[k]);
  }
}

// The block's tile: rows [row0, row0 + rows) and vectors [c0, c0 + width) of each. kWide: part
// of one row (rows = 1; wide rows are cut into tiles_per_row tiles of kTileVecs vectors, the
// last one shorter); else whole rows, rows_per_block of them. The block index and tile counts
// fit 32 bits (the host checks the grid): 32-bit division here, since 64-bit division costs
// more issue slots per block than a memory-bound kernel can spare.
struct Tile {
  int64_t row0, rows, c0, width;

  template <bool kWide, int64_t kTileVecs, typename T>
  __device__ __forceinline__ static Tile of(const Args<T>& a) {
    Tile t;
    const int64_t b = blockIdx.x;
    if constexpr (kWide) {
      const unsigned tiles = unsigned(a.tiles_per_row);
      const unsigned row = blockIdx.x / tiles;
      t.row0 = row;
      t.rows = 1;
      t.c0 = int64_t(blockIdx.x - row * tiles) * kTileVecs;
      t.width = min(kTileVecs, a.nvec - t.c0);
    } else {
      t.row0 = b * a.rows_per_block;
      t.rows = min(a.rows_per_block, a.num_rows - t.row0);
      t.c0 = 0;
      t.width = a.nvec;
    }
    return t;
  }
};

// Where slot i (0 <= i < U) of this thread falls: the element offsets of its vector in each
// operand and in the outputs, or false when the tile has no such vector. A wide tile's slots
// share one row, whose offsets are formed once.
template <bool kWide, int U, int VEC, typename T>
struct Slots {
  int64_t g[U], u[U], dy[U], out[U], col[U];
  bool live[U];

  __device__ __forceinline__ Slots(const Args<T>& a, const Tile& t, bool backward) {
    if constexpr (kWide) {
      const int64_t g0 = a.g.rows.offset(t.row0), u0 = a.u.rows.offset(t.row0);
      const int64_t d0 = backward ? a.dy.rows.offset(t.row0) : 0, o0 = t.row0 * a.out_row_stride;
#pragma unroll
      for (int i = 0; i < U; ++i) {
        const int64_t l = threadIdx.x + int64_t(i) * kThreads;
        live[i] = l < t.width;
        col[i] = (t.c0 + l) * VEC;
        g[i] = g0;
        u[i] = u0;
        dy[i] = d0;
        out[i] = o0;
      }
    } else {
#pragma unroll
      for (int i = 0; i < U; ++i) {
        const unsigned l = threadIdx.x + unsigned(i) * kThreads, width = unsigned(t.width);  // < a tile: 32 bits
        live[i] = l < t.rows * t.width;
        const unsigned r = live[i] ? l / width : 0;
        const int64_t row = t.row0 + r;
        col[i] = int64_t(live[i] ? l - r * width : 0) * VEC;
        g[i] = a.g.rows.offset(row);
        u[i] = a.u.rows.offset(row);
        dy[i] = backward ? a.dy.rows.offset(row) : 0;
        out[i] = row * a.out_row_stride;
      }
    }
  }
};

// Whether every vector of the tile lies inside its row (none partial): then the tile takes the
// path whose loads are unconditional. Uniform over the block.
template <bool kWide, int VEC, typename T>
__device__ __forceinline__ bool tile_is_full(const Args<T>& a, const Tile& t) {
  return kWide ? (t.c0 + t.width) * VEC <= a.n : a.n % VEC == 0;
}

template <Act kAct, typename T, int VEC, bool kWide, bool kFull>
__device__ __forceinline__ void forward_tile(const Args<T>& a, const Slots<kWide, forward_unroll<kAct>(VEC), VEC, T>& s) {
  using A = acc_t<T>;
  constexpr int U = forward_unroll<kAct>(VEC);
  Held<T, VEC> gv[U], uv[U];
#pragma unroll
  for (int i = 0; i < U; ++i) {
    if (s.live[i]) {
      gv[i] = load_at<T, VEC, kFull>(a.g.p + s.g[i], s.col[i], a.n);
      uv[i] = load_at<T, VEC, kFull>(a.u.p + s.u[i], s.col[i], a.n);
    }
  }
#pragma unroll
  for (int i = 0; i < U; ++i) {
    if (!s.live[i]) continue;
    A y[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) y[k] = activation<kAct>(A(acc_at(gv[i], k))) * A(acc_at(uv[i], k));
    store_at<T, VEC, kFull>(a.out0 + s.out[i], s.col[i], a.n, y);
  }
}

template <Act kAct, typename T, int VEC, bool kWide>
__global__ void __launch_bounds__(kThreads) forward_kernel(Args<T> a) {
  constexpr int U = forward_unroll<kAct>(VEC);
  const Tile t = Tile::of<kWide, int64_t(kThreads) * U>(a);
  const Slots<kWide, U, VEC, T> s(a, t, false);
  if (tile_is_full<kWide, VEC>(a, t)) forward_tile<kAct, T, VEC, kWide, true>(a, s);
  else forward_tile<kAct, T, VEC, kWide, false>(a, s);
}

template <Act kAct, typename T, int VEC, bool kWide, bool kFull>
__device__ __forceinline__ void backward_tile(const Args<T>& a, const Slots<kWide, backward_unroll(VEC), VEC, T>& s) {
  using A = acc_t<T>;
  constexpr int U = backward_unroll(VEC);
  Held<T, VEC> dv[U], gv[U], uv[U];
#pragma unroll
  for (int i = 0; i < U; ++i) {
    if (s.live[i]) {
      dv[i] = load_at<T, VEC, kFull>(a.dy.p + s.dy[i], s.col[i], a.n);
      gv[i] = load_at<T, VEC, kFull>(a.g.p + s.g[i], s.col[i], a.n);
      uv[i] = load_at<T, VEC, kFull>(a.u.p + s.u[i], s.col[i], a.n);
    }
  }
#pragma unroll
  for (int i = 0; i < U; ++i) {
    if (!s.live[i]) continue;
    A dg[VEC], du[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      A act, dact;
      activation_grad<kAct>(A(acc_at(gv[i], k)), act, dact);
      const A d = acc_at(dv[i], k);
      dg[k] = d * A(acc_at(uv[i], k)) * dact;
      du[k] = d * act;
    }
    store_at<T, VEC, kFull>(a.out0 + s.out[i], s.col[i], a.n, dg);
    store_at<T, VEC, kFull>(a.out1 + s.out[i], s.col[i], a.n, du);
  }
}

template <Act kAct, typename T, int VEC, bool kWide>
__global__ void __launch_bounds__(kThreads) backward_kernel(Args<T> a) {
  constexpr int U = backward_unroll(VEC);
  const Tile t = Tile::of<kWide, int64_t(kThreads) * U>(a);
  const Slots<kWide, U, VEC, T> s(a, t, true);
  if (tile_is_full<kWide, VEC>(a, t)) backward_tile<kAct, T, VEC, kWide, true>(a, s);
  else backward_tile<kAct, T, VEC, kWide, false>(a, s);
}

// ---- host side ---------------------------------------------------------------------------------

// The widest access (bytes, at most 16) that every address the kernels form is aligned to.
inline int access_bytes(const Problem& p, const Outputs& o, bool backward, int elem) {
  uint64_t acc = 16;
  const auto add_addr = [&](const void* ptr) { acc |= reinterpret_cast<uintptr_t>(ptr); };
  const auto add_stride = [&](int64_t stride_elems) { acc |= uint64_t(stride_elems) * elem; };
  const auto add_operand = [&](const Operand& op) {
    add_addr(static_cast<const char*>(op.t.data_ptr()) + op.col0 * elem);
    for (int d = 0; d < op.rows.ndim; ++d) add_stride(op.rows.strides[d]);
  };
  add_operand(p.gate);
  add_operand(p.up);
  if (backward) add_operand(p.grad);
  add_addr(static_cast<const char*>(o.a.data_ptr()) + o.a_col0 * elem);
  if (backward) add_addr(static_cast<const char*>(o.b.data_ptr()) + o.b_col0 * elem);
  if (p.num_rows > 1) add_stride(o.out_row_stride);
  // The lowest set bit is the alignment every address and stride shares (16 at most).
  const uint64_t align = acc & (~acc + 1);
  return int(std::max<uint64_t>(align, uint64_t(elem)));
}

template <typename T>
In<T> in_of(const Operand& o) {
  return In<T>{reinterpret_cast<const T*>(o.t.data_ptr()) + o.col0, o.rows};
}

template <Act kAct, bool kBackward>
void launch(const Problem& p, const Outputs& o, const char* op) {
  torch::stable::accelerator::DeviceGuard guard(p.gate.t.get_device_index());
  const cudaStream_t stream = current_stream(p.gate.t.get_device_index());
  dispatch_float(p.dtype, op, [&](auto tag) {
    using T = device_t<typename decltype(tag)::type>;
    const int elem = int(sizeof(T));
    const int bytes = access_bytes(p, o, kBackward, elem);
    Args<T> a;
    a.g = in_of<T>(p.gate);
    a.u = in_of<T>(p.up);
    if (kBackward) a.dy = in_of<T>(p.grad);
    a.out0 = reinterpret_cast<T*>(o.a.data_ptr()) + o.a_col0;
    a.out1 = kBackward ? reinterpret_cast<T*>(o.b.data_ptr()) + o.b_col0 : nullptr;
    a.out_row_stride = o.out_row_stride;
    a.n = p.n;
    a.num_rows = p.num_rows;
    const auto run = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      constexpr int64_t kTileVecs = int64_t(kThreads) * (kBackward ? backward_unroll(VEC) : forward_unroll<kAct>(VEC));
      a.nvec = (p.n + VEC - 1) / VEC;
      // (a tile of one whole row takes the wide kernel too: rows_per_block 1, one tile)
      if (a.nvec * 2 >= kTileVecs) {
        a.rows_per_block = 1;
        a.tiles_per_row = (a.nvec + kTileVecs - 1) / kTileVecs;
      } else {
        a.rows_per_block = std::max<int64_t>(1, kTileVecs / a.nvec);
        a.tiles_per_row = 1;
      }
      const int64_t blocks = a.tiles_per_row == 1 ? (p.num_rows + a.rows_per_block - 1) / a.rows_per_block
                                                   : p.num_rows * a.tiles_per_row;
      FUSEDOPS_CHECK(blocks < (int64_t(1) << 31), op, ": tensor too large (", blocks, " blocks)");
      const auto go = [&](auto wide_tag) {
        constexpr bool kWide = decltype(wide_tag)::value;
        if constexpr (kBackward)
          backward_kernel<kAct, T, VEC, kWide><<<unsigned(blocks), kThreads, 0, stream>>>(a);
        else
          forward_kernel<kAct, T, VEC, kWide><<<unsigned(blocks), kThreads, 0, stream>>>(a);
      };
      if (a.rows_per_block == 1) go(std::true_type{});
      else go(std::false_type{});
    };
    // VEC elements of 16, 8, 4 or 2 bytes (never wider than 16, never narrower than one element).
    const int vec = bytes / elem;
    if constexpr (sizeof(T) == 8) {
      if (vec >= 2) run(std::integral_constant<int, 2>{});
      else run(std::integral_constant<int, 1>{});
    } else if constexpr (sizeof(T) == 4) {
      if (vec >= 4) run(std::integral_constant<int, 4>{});
      else if (vec == 2) run(std::integral_constant<int, 2>{});
      else run(std::integral_constant<int, 1>{});
    } else {
      if (vec >= 8) run(std::integral_constant<int, 8>{});
      else if (vec == 4) run(std::integral_constant<int, 4>{});
      else if (vec == 2) run(std::integral_constant<int, 2>{});
      else run(std::integral_constant<int, 1>{});
    }
  });
  check_launch(op);
}

// The kernels as one type for gated.h's registered functions: Kernels<false> has swiglu's
// activation, Kernels<true> geglu's two, so each op's translation unit compiles only its own.
template <bool kGeglu>
struct Kernels {
  template <bool kBackward>
  static void dispatch(const Problem& p, const Outputs& o, const char* op) {
    if constexpr (!kGeglu) {
      FUSEDOPS_CHECK(p.act == Act::kSilu, op, ": internal error: a gelu reached swiglu's kernels");
      launch<Act::kSilu, kBackward>(p, o, op);
    } else {
      FUSEDOPS_CHECK(p.act != Act::kSilu, op, ": internal error: silu reached geglu's kernels");
      if (p.act == Act::kGeluTanh) launch<Act::kGeluTanh, kBackward>(p, o, op);
      else launch<Act::kGelu, kBackward>(p, o, op);
    }
  }
  static void forward(const Problem& p, const Outputs& o, const char* op) { dispatch<false>(p, o, op); }
  static void backward(const Problem& p, const Outputs& o, const char* op) { dispatch<true>(p, o, op); }
};

}  // namespace
}  // namespace fusedops::gated::cuda
