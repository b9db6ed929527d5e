// Which thread layout and memory hints bring the bf16 forward of rows of 1024 values nearest a
// same-size copy? A standalone CUDA program (no torch) for issue 3's forward goal at 65536x1024
// (3.9 TB/s: rms_norm reaches 3.86-3.88 there on the H200, layer_norm 3.74; docs/ops/rms_norm.md).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/norm_rows_1024_layouts benchmarks/norm_rows_1024_layouts.cu
//   /tmp/norm_rows_1024_layouts
//
// Every kernel is a grid of blocks, TPR threads a row, VPT 16-byte vectors a thread (vector i of
// a row at thread + TPR i), math in float32 as the library's. Variants:
//   - TPR 64 x 2 vectors, the row's sum across two warps through shared memory and a block
//     barrier: the library's rms_norm layout (cuda_norm.cuh, kRmsTwoVectors);
//   - TPR 32 x 4 vectors, a warp a row: no barrier, twice the bytes a thread in flight;
//   - block sizes and __launch_bounds__ minimum blocks, and blocks an SM held to six by unused
//     dynamic shared memory (the library's kernel takes 40 registers, six blocks an SM, where
//     this one's 32 allow eight);
//   - memory hints: x loaded with ld.global.cs (streaming, evict first) or L1::no_allocate, y
//     stored with st.global.cs;
//   - layer_norm at 32 x 4 (the library's) and 64 x 2, with two reductions (the mean, then the
//     squared deviations from it: the library's) or one, of each thread's (mean, m2) merged
//     pairwise (Chan et al.), plain or with the streaming hints.
// Results (H100, 2026-12-07; no H200 could be had): the library's rms_norm layout already runs at
// the copy there (0.998-1.000 of cudaMemcpy), 1.003-1.005 with the streaming hints. layer_norm at
// 64 x 2 (40 registers, six blocks an SM) reaches 0.983-0.985, and 0.998-1.001 with the streaming
// hints, where 32 x 4 (48 registers and a 20-byte spill here) stays at 0.95 (0.97 streaming).
// One reduction or two makes no difference. In a scratch build of the library the same hints
// lost 2-3% on the H100 instead, and were not kept. The figures are in docs/ops/rms_norm.md.
//
// Timed as TB/s on the forward's bytes model (read x, write y), beside cudaMemcpy of x's bytes,
// in two interleaved rounds; every variant's y and statistics are checked against the first
// kernel's of its op.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "standalone.cuh"

namespace {

constexpr int N = 1024;
constexpr float EPS = 1e-6f;
enum Hint { kPlain, kStreaming, kNoL1 };

template <int H>
__device__ __forceinline__ uint4 load_x(const uint4* p) {
  if constexpr (H == kStreaming) return __ldcs(p);
  if constexpr (H == kNoL1) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
  }
  return *p;
}

template <int H>
__device__ __forceinline__ void store_y(uint4* p, uint4 v) {
  if constexpr (H == kStreaming) __stcs(p, v);
  else *p = v;
}

// Sum over the TPR threads of a row; TPR > 32 through `part` (one float a warp) and a barrier.
template <int TPR>
__device__ __forceinline__ float row_sum(float s, float* part) {
#pragma unroll
  for (int o = (TPR < 32 ? TPR : 32) / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if constexpr (TPR > 32) {
    constexpr int kWarps = TPR / 32;
    const int warp = threadIdx.x / 32, first = warp - warp % kWarps;
    if (threadIdx.x % 32 == 0) part[warp] = s;
    __syncthreads();
    s = 0.f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) s += part[first + i];
  }
  return s;
}

template <int TPR, int VPT, int BLOCK, int MINB, int H>
__global__ void __launch_bounds__(BLOCK, MINB)
    rms_kernel(const uint4* x, const uint4* w, uint4* y, float* rstd, int rows) {
  static_assert(TPR * VPT * 8 == N, "a row is TPR x VPT vectors of 8");
  __shared__ float part[BLOCK / 32];
  const int t = threadIdx.x % TPR;
  const int64_t row = int64_t(blockIdx.x) * (BLOCK / TPR) + threadIdx.x / TPR;
  const bool live = row < rows;
  uint4 v[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) v[i] = live ? load_x<H>(x + row * (N / 8) + t + i * TPR) : uint4{};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) s = add_squares8(v[i], s);
  const float r = rsqrtf(row_sum<TPR>(s, part) / N + EPS);
  if (!live) return;
  if (t == 0) rstd[row] = r;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    float f[8], g[8];
    unpack8(v[i], f);
    unpack8(w[t + i * TPR], g);
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = f[e] * r * g[e];
    store_y<H>(y + row * (N / 8) + t + i * TPR, pack8(f));
  }
}

// The sum of (x - center)^2 over a thread's VPT vectors, in element order.
template <int VPT>
__device__ __forceinline__ float squared_deviations(const uint4 (&v)[VPT], float center) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    float f[8];
    unpack8(v[i], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) s = fmaf(f[e] - center, f[e] - center, s);
  }
  return s;
}

// layer_norm, TPR threads a row (32: a warp, 64: two warps meeting in shared memory), memory hint
// H. CHAN: one reduction of (mean, m2) pairs; else two (the mean, then the squared deviations).
template <int TPR, int VPT, int BLOCK, int MINB, bool CHAN, int H>
__global__ void __launch_bounds__(BLOCK, MINB)
    ln_kernel(const uint4* x, const uint4* w, const uint4* b, uint4* y, float* mean, float* rstd, int rows) {
  static_assert(TPR * VPT * 8 == N, "a row is TPR x VPT vectors of 8");
  __shared__ float part[2][BLOCK / 32];
  const int t = threadIdx.x % TPR;
  const int64_t row = int64_t(blockIdx.x) * (BLOCK / TPR) + threadIdx.x / TPR;
  const bool live = row < rows;
  uint4 v[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) v[i] = live ? load_x<H>(x + row * (N / 8) + t + i * TPR) : uint4{};
  constexpr float kInvN = 1.f / N;
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    float f[8];
    unpack8(v[i], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) s += f[e];
  }
  float mu, var;
  if constexpr (CHAN) {
    // The thread's own mean and squared deviations from it, then pairwise merges of equal
    // counts: m = (ma + mb) / 2, m2 = m2a + m2b + (mb - ma)^2 * c / 2 for c values a side.
    constexpr float kInvThread = 1.f / (VPT * 8);
    float m = s * kInvThread, m2 = squared_deviations(v, m);
    float c = VPT * 8;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float mo = __shfl_xor_sync(0xffffffffu, m, o), m2o = __shfl_xor_sync(0xffffffffu, m2, o);
      const float d = mo - m;
      m2 += m2o + d * d * (0.5f * c);
      m = 0.5f * (m + mo);
      c *= 2.f;
    }
    if constexpr (TPR == 64) {  // the row's other warp's pair, through shared memory
      const int warp = threadIdx.x / 32;
      if (threadIdx.x % 32 == 0) part[0][warp] = m, part[1][warp] = m2;
      __syncthreads();
      const float mo = part[0][warp ^ 1], m2o = part[1][warp ^ 1], d = mo - m;
      m2 += m2o + d * d * (0.5f * c);
      m = 0.5f * (m + mo);
    }
    mu = m, var = m2 * kInvN;
  } else {
    mu = row_sum<TPR>(s, part[0]) * kInvN;
    var = row_sum<TPR>(squared_deviations(v, mu), part[1]) * kInvN;
  }
  const float r = rsqrtf(var + EPS), shift = -mu * r;
  if (!live) return;
  if (t == 0) rstd[row] = r, mean[row] = mu;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    float f[8], g[8], h[8];
    unpack8(v[i], f);
    unpack8(w[t + i * TPR], g);
    unpack8(b[t + i * TPR], h);
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = fmaf(fmaf(f[e], r, shift), g[e], h[e]);
    store_y<H>(y + row * (N / 8) + t + i * TPR, pack8(f));
  }
}

__global__ void max_rel_diff(const float* a, const float* b, int64_t n, float* out) {
  float m = 0.f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(a[i] - b[i]) / fmaxf(fabsf(b[i]), 1e-3f));
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(m));
}

}  // namespace

int main() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("%s\n", prop.name);
  const int rows = 65536;
  const int64_t n = int64_t(rows) * N;
  __nv_bfloat16 *x, *w, *b, *y, *yr;
  float *st, *str, *diff;  // mean and rstd, [2 * rows]
  CK(cudaMalloc(&x, n * 2)); CK(cudaMalloc(&y, n * 2)); CK(cudaMalloc(&yr, n * 2));
  CK(cudaMalloc(&w, N * 2)); CK(cudaMalloc(&b, N * 2));
  CK(cudaMalloc(&st, 8 * rows)); CK(cudaMalloc(&str, 8 * rows)); CK(cudaMalloc(&diff, 12));
  fill_hashed<<<1024, 256>>>(x, n, 1);
  fill_hashed<<<4, 256>>>(w, N, 2);
  fill_hashed<<<4, 256>>>(b, N, 3);
  const auto X = reinterpret_cast<const uint4*>(x), W = reinterpret_cast<const uint4*>(w),
             B = reinterpret_cast<const uint4*>(b);
  const auto Y = reinterpret_cast<uint4*>(y), YR = reinterpret_cast<uint4*>(yr);
  const double bytes = 2.0 * n * 2;
  auto time = [&](auto&& f) { return bytes / median_ms(f, 5, 21, 20) / 1e9; };
  auto check = [&](const char* name) {
    CK(cudaMemset(diff, 0, 12));
    max_abs_diff<<<1024, 256>>>(y, yr, n, diff);
    max_rel_diff<<<256, 256>>>(st, str, 2 * rows, diff + 1);
    float h[2];
    CK(cudaMemcpy(h, diff, 8, cudaMemcpyDeviceToHost));
    printf("  check %-44s max |y - y_ref| = %g, max rel stat diff = %g\n", name, h[0], h[1]);
  };
  struct Variant {
    const char* name;
    void (*launch)(const uint4*, const uint4*, const uint4*, uint4*, float*, int);
  };
  // A variant's launch: grid of ceil(rows / rows a block) blocks.
#define RMS(TPR, VPT, BLOCK, MINB, H)                                                                        \
  Variant{"rms " #TPR "x" #VPT " block " #BLOCK " lb " #MINB " " #H,                                      \
          [](const uint4* x, const uint4* w, const uint4*, uint4* y, float* s, int r) {                       \
            rms_kernel<TPR, VPT, BLOCK, MINB, H><<<(r + BLOCK / TPR - 1) / (BLOCK / TPR), BLOCK>>>(x, w, y, s, r); \
          }}
#define LN(TPR, VPT, BLOCK, MINB, CHAN, H)                                                                  \
  Variant{"ln " #TPR "x" #VPT " block " #BLOCK " lb " #MINB " one merge: " #CHAN " " #H,                      \
          [](const uint4* x, const uint4* w, const uint4* b, uint4* y, float* s, int r) {                     \
            ln_kernel<TPR, VPT, BLOCK, MINB, CHAN, H><<<(r + BLOCK / TPR - 1) / (BLOCK / TPR), BLOCK>>>(     \
                x, w, b, y, s, s + r, r);                                                                      \
          }}
  // The library's layout held to six blocks an SM: 36 KB of dynamic shared memory a block.
  const auto six_an_sm = [](const uint4* x, const uint4* w, const uint4*, uint4* y, float* s, int r) {
    constexpr auto kernel = rms_kernel<64, 2, 256, 6, kPlain>;
    static bool once = [] {
      CK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
      return true;
    }();
    (void)once;
    kernel<<<(r + 3) / 4, 256, 36 * 1024>>>(x, w, y, s, r);
  };
  const Variant rms[] = {
      RMS(64, 2, 256, 6, kPlain),     Variant{"rms 64x2 block 256, six blocks an SM (shared)", six_an_sm},     RMS(64, 2, 256, 6, kStreaming), RMS(64, 2, 256, 6, kNoL1),
      RMS(32, 4, 256, 6, kPlain),     RMS(32, 4, 256, 5, kPlain),     RMS(32, 4, 128, 12, kPlain),
      RMS(32, 4, 256, 6, kStreaming), RMS(64, 2, 128, 12, kPlain),    RMS(16, 8, 256, 4, kPlain),
  };
  const Variant ln[] = {
      LN(32, 4, 256, 5, false, kPlain),     LN(32, 4, 256, 5, true, kPlain),  LN(32, 4, 256, 6, false, kPlain),
      LN(32, 4, 256, 6, true, kPlain),      LN(32, 4, 128, 10, true, kPlain), LN(32, 4, 256, 5, false, kStreaming),
      LN(64, 2, 256, 6, false, kPlain),     LN(64, 2, 256, 6, true, kPlain),  LN(64, 2, 256, 6, false, kStreaming),
      LN(64, 2, 256, 6, true, kStreaming),
  };
  const auto run_group = [&](const Variant* vs, int count) {
    CK(cudaMemset(str, 0, 8 * rows));
    vs[0].launch(X, W, B, YR, str, rows);  // the reference: the group's first variant
    CK(cudaDeviceSynchronize());
    for (int i = 0; i < count; ++i) {
      CK(cudaMemset(y, 0, n * 2));
      CK(cudaMemset(st, 0, 8 * rows));
      vs[i].launch(X, W, B, Y, st, rows);
      CK(cudaDeviceSynchronize());
      check(vs[i].name);
    }
    for (int round = 0; round < 2; ++round) {
      const double copy = time([&] { CK(cudaMemcpyAsync(y, x, n * 2, cudaMemcpyDeviceToDevice)); });
      printf("round %d: cudaMemcpy %.3f TB/s\n", round, copy);
      for (int i = 0; i < count; ++i) {
        const double tb = time([&] { vs[i].launch(X, W, B, Y, st, rows); });
        printf("  %-48s %.3f TB/s (%.3f of the copy)\n", vs[i].name, tb, tb / copy);
      }
    }
  };
  run_group(rms, int(sizeof rms / sizeof rms[0]));
  run_group(ln, int(sizeof ln / sizeof ln[0]));
  for (void* p : {(void*)x, (void*)y, (void*)yr, (void*)w, (void*)b, (void*)st, (void*)str, (void*)diff}) CK(cudaFree(p));
  return 0;
}
