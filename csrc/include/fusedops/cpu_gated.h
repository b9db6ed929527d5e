// The CPU kernels of the gated activations (gated.h says what they compute). Work is split
// into spans of at most kSpan contiguous elements of one row (the whole tensor is one row when
// every operand is contiguous), run in parallel on torch's thread pool; each span is one simd
// loop over elements, compiled per instruction set (cpu_isa.h). float32 math uses the
// branch-free exp and erf below, so that the loops vectorise: libm's scalar calls would not.
// float64 (for gradcheck) uses libm.
//
// Everything here has internal linkage: each op's translation unit instantiates what it uses.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <torch/csrc/stable/ops.h>

#include "fusedops/cpu_convert.h"
#include "fusedops/cpu_isa.h"
#include "fusedops/cpu_memory.h"
#include "fusedops/gated.h"

namespace fusedops::gated::cpu {
namespace {

using fusedops::cpu::acc_t;
using fusedops::cpu::from_acc;
using fusedops::cpu::to_acc;

// Elements per parallel task and per span: long enough that a task outweighs the pool's
// overhead, short enough that two threads share a 4096 x 14336 problem evenly.
constexpr int64_t kSpan = 16384;

FUSEDOPS_CPU_INLINE float bits_to_float(int32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
FUSEDOPS_CPU_INLINE int32_t float_to_bits(float f) {
  int32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// a * b + c rounded once. Written out because the library is built with -ffp-contract=off
// (CMakeLists.txt): an explicit fma has the same value in every instruction-set clone, from an
// FMA instruction in the AVX2 and AVX-512 ones and from libm's fmaf in the baseline one (slow,
// but only CPUs older than AVX2 run that clone). The polynomials below take half the
// instructions this way.
FUSEDOPS_CPU_INLINE float fma_f32(float a, float b, float c) { return std::fma(a, b, c); }

// e^x within about 1.2 ulp for x in [-86.9, 88.7], 0 below -87 and +inf above 88.72 (where e^x
// passes float32's largest number), NaN for NaN. Cody-Waite reduction x = k ln2 + r,
// |r| <= ln2/2 (ln2 split in two so that k ln2 is exact), 2 e^r by the degree-7 Taylor
// polynomial of e^r with its coefficients doubled (exactly; truncation below 0.1 ulp), times
// 2^(k-1) built in the exponent bits: so k = 128 (x from 88.38) is still a finite 2^127, and the
// last rounding decides between a finite result and inf, as a libm exp does, where 2^k would be
// inf. k = -126 builds 0, which the clamp below -87 gives. k is rounded with the 1.5 * 2^23
// trick, which gives its integer value in the low mantissa bits without a float-to-int
// conversion. The result feeds sigmoids, Gaussians and softmax terms, where 0 for e^x < 1.7e-38
// is exact to well below an ulp of what they compute.
FUSEDOPS_CPU_INLINE float exp_f32(float x) {
  // Clamps as selects of values, written so that a NaN x passes through. (std::min/max return
  // references: a select between two addresses and a load, which only AVX-512's masked loads
  // vectorise; the AVX2 and baseline clones were left scalar.)
  x = x > 88.8f ? 88.8f : x;
  x = x < -87.0f ? -87.0f : x;
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  const float t = fma_f32(x, 1.44269504088896341f, kMagic);
  const float k = t - kMagic;
  const int32_t ki = float_to_bits(t) - float_to_bits(kMagic);
  float r = fma_f32(-k, 0.693145751953125f, x);  // ln2's high part: k * it is exact for |k| <= 128
  r = fma_f32(-k, 1.42860682030941723212e-6f, r);
  float p = 2.0f / 5040.0f;  // 2 e^r
  p = fma_f32(p, r, 2.0f / 720.0f);
  p = fma_f32(p, r, 2.0f / 120.0f);
  p = fma_f32(p, r, 2.0f / 24.0f);
  p = fma_f32(p, r, 2.0f / 6.0f);
  p = fma_f32(p, r, 1.0f);
  p = fma_f32(p, r, 2.0f);
  p = fma_f32(p, r, 2.0f);
  return p * bits_to_float((ki + 126) << 23);  // 2^(k-1); k = -126 gives 0
}

// erf(x) within about 3 ulp (1.9e-7 absolute). |x| <= 1: x * P(x^2), degree 6 in x^2; above:
// 1 - e^Q(x), Q a degree-8 polynomial in s = (|x| - 2.5) / 1.5 fitted to log(erfc(x)) on [1, 4]
// (beyond 4, erf is 1 in float32). Both are minimax fits made for this file (Lawson-weighted
// least squares, max relative error 1.2e-9 and absolute 1.2e-8 respectively); the error left is
// float32 rounding.
FUSEDOPS_CPU_INLINE float erf_f32(float x) {
  const float a = std::fabs(x);
  const float t = a * a;
  float p = 7.854026349496134e-05f;
  p = fma_f32(p, t, -0.0008010247666473089f);
  p = fma_f32(p, t, 0.0051883345031307196f);
  p = fma_f32(p, t, -0.02685381607081992f);
  p = fma_f32(p, t, 0.112835852708357f);
  p = fma_f32(p, t, -0.37612625839752833f);
  p = fma_f32(p, t, 1.1283791657323468f);
  const float near = a * p;
  const float s = ((a > 4.0f ? 4.0f : a) - 2.5f) * 0.666666666666666667f;
  float q = 4.1001573954738286e-05f;
  q = fma_f32(q, s, -0.0002272721546245568f);
  q = fma_f32(q, s, 0.0008822600282449738f);
  q = fma_f32(q, s, -0.0031906896906554235f);
  q = fma_f32(q, s, 0.010960725153158279f);
  q = fma_f32(q, s, -0.03664739478944673f);
  q = fma_f32(q, s, -2.1237606187897975f);
  q = fma_f32(q, s, -8.029021032770876f);
  q = fma_f32(q, s, -7.806815278983118f);
  const float far = 1.0f - exp_f32(q);
  const float r = a <= 1.0f ? near : far;
  return x < 0.0f ? -r : r;
}

FUSEDOPS_CPU_INLINE float exp_acc(float x) { return exp_f32(x); }
FUSEDOPS_CPU_INLINE double exp_acc(double x) { return std::exp(x); }
FUSEDOPS_CPU_INLINE float erf_acc(float x) { return erf_f32(x); }
FUSEDOPS_CPU_INLINE double erf_acc(double x) { return std::erf(x); }

template <typename A>
FUSEDOPS_CPU_INLINE A sigmoid(A x) {
  return A(1) / (A(1) + exp_acc(-x));
}

// s = sigmoid(x) and c = 1 - s, each with a small relative error: for x >= 0, 1 - s would
// cancel (it is e^-x s); for x < 0, e^-x may be inf while 1 - s is exact enough.
template <typename A>
FUSEDOPS_CPU_INLINE void sigmoid_pair(A x, A& s, A& c) {
  const A e = exp_acc(-x);
  s = A(1) / (A(1) + e);
  c = x >= A(0) ? e * s : A(1) - s;
}

constexpr double kSqrt1_2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1 / sqrt(2 pi)
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kTanhCubic = 0.044715;

// act(g)
template <Act kAct, typename A>
FUSEDOPS_CPU_INLINE A activation(A g) {
  if constexpr (kAct == Act::kSilu) {
    return g * sigmoid(g);
  } else if constexpr (kAct == Act::kGelu) {
    return A(0.5) * g * (A(1) + erf_acc(g * A(kSqrt1_2)));
  } else {
    const A z = A(kSqrt2OverPi) * (g + A(kTanhCubic) * g * g * g);
    return g * sigmoid(A(2) * z);
  }
}

// act(g) and act'(g)
template <Act kAct, typename A>
FUSEDOPS_CPU_INLINE void activation_grad(A g, A& act, A& dact) {
  if constexpr (kAct == Act::kSilu) {
    A s, c;
    sigmoid_pair(g, s, c);
    act = g * s;
    dact = s * (A(1) + g * c);
  } else if constexpr (kAct == Act::kGelu) {
    const A cdf = A(0.5) * (A(1) + erf_acc(g * A(kSqrt1_2)));
    const A pdf = A(kInvSqrt2Pi) * exp_acc(A(-0.5) * g * g);
    act = g * cdf;
    dact = cdf + g * pdf;
  } else {
    const A g2 = g * g;
    A s, c;
    sigmoid_pair(A(2 * kSqrt2OverPi) * (g + A(kTanhCubic) * g2 * g), s, c);
    act = g * s;
    dact = s + g * (A(2) * s * c) * (A(kSqrt2OverPi) * (A(1) + A(3 * kTanhCubic) * g2));
  }
}

template <Act kAct, typename T>
FUSEDOPS_CPU_MULTIVERSION void forward_span(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ y,
                                            int64_t len) {
  using A = acc_t<T>;
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) y[j] = from_acc<T>(activation<kAct>(A(to_acc(g[j]))) * A(to_acc(u[j])));
}

template <Act kAct, typename T>
FUSEDOPS_CPU_MULTIVERSION void backward_span(const T* __restrict__ dy, const T* __restrict__ g,
                                             const T* __restrict__ u, T* __restrict__ dg, T* __restrict__ du,
                                             int64_t len) {
  using A = acc_t<T>;
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) {
    A act, dact;
    activation_grad<kAct>(A(to_acc(g[j])), act, dact);
    const A d = to_acc(dy[j]);
    dg[j] = from_acc<T>(d * A(to_acc(u[j])) * dact);
    du[j] = from_acc<T>(d * act);
  }
}

// Calls f(row, begin, end) for spans covering every row, in parallel.
template <typename F>
void for_spans(const Problem& p, F&& f) {
  const int64_t n = p.n;
  const int64_t per_row = (n + kSpan - 1) / kSpan;
  const int64_t items = p.num_rows * per_row;
  const int64_t grain = per_row > 1 ? 1 : std::max<int64_t>(1, kSpan / std::max<int64_t>(n, 1));
  torch::stable::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / per_row, c = i % per_row;
      f(row, c * kSpan, std::min(n, (c + 1) * kSpan));
    }
  });
}

template <typename T>
const T* base(const Operand& o, int64_t row) {
  return o.t.const_data_ptr<T>() + o.col0 + o.rows.offset(row);
}

template <Act kAct>
void forward(const Problem& p, const Outputs& o, const char* op) {
  ::fusedops::cpu::advise_huge_pages(o.a);
  dispatch_float(p.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* y = o.a.mutable_data_ptr<T>() + o.a_col0;
    for_spans(p, [&](int64_t row, int64_t b, int64_t e) {
      forward_span<kAct, T>(base<T>(p.gate, row) + b, base<T>(p.up, row) + b, y + row * o.out_row_stride + b, e - b);
    });
  });
}

template <Act kAct>
void backward(const Problem& p, const Outputs& o, const char* op) {
  ::fusedops::cpu::advise_huge_pages(o.a);
  if (o.b.data_ptr() != o.a.data_ptr()) ::fusedops::cpu::advise_huge_pages(o.b);
  dispatch_float(p.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* dg = o.a.mutable_data_ptr<T>() + o.a_col0;
    T* du = o.b.mutable_data_ptr<T>() + o.b_col0;
    for_spans(p, [&](int64_t row, int64_t b, int64_t e) {
      const int64_t out = row * o.out_row_stride + b;
      backward_span<kAct, T>(base<T>(p.grad, row) + b, base<T>(p.gate, row) + b, base<T>(p.up, row) + b, dg + out,
                             du + out, e - b);
    });
  });
}

// The kernels as one type for gated.h's registered functions: Kernels<false> has swiglu's
// activation, Kernels<true> geglu's two, so each op's translation unit compiles only its own.
template <bool kGeglu>
struct Kernels {
  template <Act kAct>
  static void run(const Problem& p, const Outputs& o, const char* op, bool bwd) {
    if (bwd) cpu::backward<kAct>(p, o, op);
    else cpu::forward<kAct>(p, o, op);
  }
  static void dispatch(const Problem& p, const Outputs& o, const char* op, bool bwd) {
    if constexpr (!kGeglu) {
      FUSEDOPS_CHECK(p.act == Act::kSilu, op, ": internal error: a gelu reached swiglu's kernels");
      run<Act::kSilu>(p, o, op, bwd);
    } else {
      FUSEDOPS_CHECK(p.act != Act::kSilu, op, ": internal error: silu reached geglu's kernels");
      if (p.act == Act::kGeluTanh) run<Act::kGeluTanh>(p, o, op, bwd);
      else run<Act::kGelu>(p, o, op, bwd);
    }
  }
  static void forward(const Problem& p, const Outputs& o, const char* op) { dispatch(p, o, op, false); }
  static void backward(const Problem& p, const Outputs& o, const char* op) { dispatch(p, o, op, true); }
};

}  // namespace
}  // namespace fusedops::gated::cpu
