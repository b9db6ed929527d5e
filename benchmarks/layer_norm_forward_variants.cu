// Why layer_norm's CUDA forward keeps its layout: variants of the cached forward (bf16, weight
// and bias) timed beside the library's own forward_kernel for layer_norm and rms_norm at the
// benchmark's shapes. A standalone CUDA program built on csrc/include (torch's headers for the
// types only; it does not link torch):
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -DUSE_CUDA -DTORCH_TARGET_VERSION=0x020a000000000000 -Icsrc/include \
//     -I$(python -c "import torch.utils.cpp_extension as c; print(c.include_paths()[0])") \
//     -o /tmp/layer_norm_forward_variants benchmarks/layer_norm_forward_variants.cu
//   /tmp/layer_norm_forward_variants
//
// "simple": a block per row group, as forward_kernel, with a min-blocks bound (minb) and the
// statistics as two reductions (stats0: the mean, then the squared deviations) or one
// (stats1: each thread's exact moments merged pairwise with equal counts, which needs no
// division). "pipe": a persistent grid (occ blocks an SM, x2: twice that) whose blocks load
// the next row group before reducing the current one, parameters loaded once. TB/s counts one
// read of x and one write of y; maxdiff is against the library kernel's output. With
// -DMAIN_ONLY only the library's kernels are timed (quick to build: how an edit of
// forward_kernel was measured against the one before it, one binary each). The H200 figures of
// 2026-11-30 are in docs/ops/layer_norm.md (Measured performance).
#include "fusedops/cuda_norm.cuh"
#include "standalone.cuh"
#include <cstdio>
#include <vector>
#include <algorithm>

using namespace fusedops::norm::cuda;
using fusedops::cuda::Held;
using fusedops::RowLayout;
using T = __nv_bfloat16;
using CL = Config<true, Variant::kPlain, T, T>;
using CR = Config<false, Variant::kPlain, T, T>;
constexpr int VEC = 8;

// STATS 0: two reductions (mean, then deviations). 1: one reduction of equal-count moments
// (pairwise: mean = (a + b) / 2, m2 = m2a + m2b + d^2 k / 2), every lane holding VPT*VEC values.
template <int G, int VPT>
__device__ __forceinline__ void moments_equal(float& mean, float& m2, float* scratch) {
  float k = float(VPT * VEC);
#pragma unroll
  for (int offset = 1; offset < (G < 32 ? G : 32); offset <<= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, mean, offset);
    const float o2 = __shfl_xor_sync(0xffffffffu, m2, offset);
    const float d = om - mean;
    mean = __fmul_rn(__fadd_rn(mean, om), 0.5f);
    m2 = __fadd_rn(__fadd_rn(m2, o2), __fmul_rn(__fmul_rn(d, d), 0.5f * k));
    k *= 2.f;
  }
  if constexpr (G > 32) {
    constexpr int W = G / 32;
    float* mine = scratch + (threadIdx.x / G) * W * 2;
    if ((threadIdx.x & 31) == 0) { mine[(threadIdx.x % G) / 32] = mean; mine[W + (threadIdx.x % G) / 32] = m2; }
    __syncthreads();
    float mm[W], mv[W];
#pragma unroll
    for (int w = 0; w < W; ++w) { mm[w] = mine[w]; mv[w] = mine[W + w]; }
#pragma unroll
    for (int step = 1; step < W; step <<= 1) {
#pragma unroll
      for (int w = 0; w + step < W; w += 2 * step) {
        const float d = mm[w + step] - mm[w];
        mm[w] = __fmul_rn(__fadd_rn(mm[w], mm[w + step]), 0.5f);
        mv[w] = __fadd_rn(__fadd_rn(mv[w], mv[w + step]), __fmul_rn(__fmul_rn(d, d), 0.5f * k));
      }
      k *= 2.f;
    }
    mean = mm[0];
    m2 = mv[0];
  }
}

template <int TPR, int VPT, int STATS>
__device__ __forceinline__ void row_stats(const Held<T, VEC> (&xv)[VPT], int n, float& mu, float& rs, float eps,
                                          float (*scratch)[2 * kBlock / 32]) {
  if constexpr (STATS == 0) {
    float s = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i) s += vec_sum<float, VEC>(xv[i], 0.f, false);
    mu = group_sum<TPR>(s, scratch[1]) / float(n);
    float ss = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i) ss += vec_sum<float, VEC>(xv[i], mu, true);
    rs = rsqrt_acc(group_sum<TPR>(ss, scratch[0]) / float(n) + eps);
  } else {
    float s = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i) s += vec_sum<float, VEC>(xv[i], 0.f, false);
    float mean = s * (1.f / float(VPT * VEC)), m2 = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i) m2 += vec_sum<float, VEC>(xv[i], mean, true);
    moments_equal<TPR, VPT>(mean, m2, scratch[0]);
    mu = mean;
    rs = rsqrt_acc(m2 / float(n) + eps);
  }
}

// A thread's VPT vectors of row xr, and of the weight and bias.
template <int TPR, int VPT>
__device__ __forceinline__ void load_row(const T* xr, int lane, Held<T, VEC> (&xv)[VPT]) {
#pragma unroll
  for (int i = 0; i < VPT; ++i) xv[i] = load_held<T, VEC>(xr + (i * TPR + lane) * VEC);
}

template <int TPR, int VPT>
__device__ __forceinline__ void load_params(const ForwardArgs<CL>& a, int lane, Params<CL, VEC> (&params)[VPT]) {
#pragma unroll
  for (int i = 0; i < VPT; ++i) params[i] = Params<CL, VEC>::load(a, (i * TPR + lane) * VEC);
}

// Writes the row's statistics and its normalised values.
template <int TPR, int VPT>
__device__ __forceinline__ void store_row(const ForwardArgs<CL>& a, int64_t row, int n, int lane,
                                          const Held<T, VEC> (&xv)[VPT], const Params<CL, VEC> (&params)[VPT],
                                          float mu, float rs) {
  if (lane == 0) { a.rstd[row] = rs; a.mean[row] = mu; }
  T* yr = a.y + row * n;
#pragma unroll
  for (int i = 0; i < VPT; ++i) normalize_store<CL, VEC>(a, yr, xv[i], (i * TPR + lane) * VEC, mu, rs, params[i]);
}

// Non-persistent (a row group per block) with a chosen min-blocks bound.
template <int TPR, int VPT, int MINB, int STATS>
__global__ void __launch_bounds__(kBlock, MINB) ln_simple(ForwardArgs<CL> a, int64_t num_rows, int n, float eps) {
  __shared__ float scratch[2][2 * kBlock / 32];
  const int lane = threadIdx.x % TPR;
  const int64_t row = int64_t(blockIdx.x) * (kBlock / TPR) + threadIdx.x / TPR;
  Held<T, VEC> xv[VPT];
  load_row<TPR>(a.x + row * n, lane, xv);
  Params<CL, VEC> params[VPT];
  load_params<TPR>(a, lane, params);
  float mu, rs;
  row_stats<TPR, VPT, STATS>(xv, n, mu, rs, eps, scratch);
  store_row<TPR>(a, row, n, lane, xv, params, mu, rs);
}

// Persistent: a block walks row groups g, g + grid, ...; the next group's loads are issued
// before this group's reductions; the parameters are loaded once.
template <int TPR, int VPT, int MINB, int STATS>
__global__ void __launch_bounds__(kBlock, MINB) ln_pipe(ForwardArgs<CL> a, int64_t num_rows, int n, float eps) {
  __shared__ float scratch[2][2 * kBlock / 32];
  constexpr int kRows = kBlock / TPR;
  const int lane = threadIdx.x % TPR, slot = threadIdx.x / TPR;
  const int64_t groups = num_rows / kRows;
  Params<CL, VEC> params[VPT];
  load_params<TPR>(a, lane, params);
  int64_t g = blockIdx.x;
  Held<T, VEC> xv[VPT];
  if (g < groups) load_row<TPR>(a.x + (g * kRows + slot) * n, lane, xv);
  for (; g < groups; g += gridDim.x) {
    const int64_t row = g * kRows + slot;
    Held<T, VEC> xn[VPT];
    const int64_t next = g + gridDim.x;
    if (next < groups) load_row<TPR>(a.x + (next * kRows + slot) * n, lane, xn);
    float mu, rs;
    row_stats<TPR, VPT, STATS>(xv, n, mu, rs, eps, scratch);
    store_row<TPR>(a, row, n, lane, xv, params, mu, rs);
#pragma unroll
    for (int i = 0; i < VPT; ++i) xv[i] = xn[i];
  }
}


struct Bufs { T *x, *y, *w, *b; float *mean, *rstd; };

template <typename F>
float time_it(F f) { return median_ms(f, 5, 15, 10); }

__global__ void fill(T* p, int64_t n, uint32_t seed, float scale, float shift) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = __float2bfloat16(shift + scale * (float(h & 0xffff) / 65536.f - 0.5f));
  }
}

int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  struct S { int64_t rows; int n; };
  for (S sh : {S{32768, 4096}, S{65536, 1024}, S{4096, 8192}, S{16384, 4096}}) {
    const int64_t N = sh.rows * sh.n;
    Bufs B; CK(cudaMalloc(&B.x, N * 2)); CK(cudaMalloc(&B.y, N * 2)); CK(cudaMalloc(&B.w, sh.n * 2)); CK(cudaMalloc(&B.b, sh.n * 2));
    CK(cudaMalloc(&B.mean, sh.rows * 4)); CK(cudaMalloc(&B.rstd, sh.rows * 4));
    fill<<<1024, 256>>>(B.x, N, 1, 4.f, 3.f); fill<<<8, 256>>>(B.w, sh.n, 2, 1.f, 1.f); fill<<<8, 256>>>(B.b, sh.n, 3, 1.f, 0.f);
    T* ref; CK(cudaMalloc(&ref, N * 2));
    ForwardArgs<CL> a{}; a.x = B.x; a.w = B.w; a.b = B.b; a.y = B.y; a.mean = B.mean; a.rstd = B.rstd;
    ForwardArgs<CR> ar{}; ar.x = B.x; ar.w = B.w; ar.y = B.y; ar.rstd = B.rstd;
    RowLayout rows; rows.ndim = 1; rows.sizes[0] = sh.rows; rows.strides[0] = sh.n;
    const double bytes = 2.0 * N * 2;
    float copy = time_it([&] { CK(cudaMemcpyAsync(B.y, B.x, N * 2, cudaMemcpyDeviceToDevice)); });
    printf("shape %lldx%d  copy %.3f TB/s (%.1f us)\n", (long long)sh.rows, sh.n, bytes / copy / 1e9, copy * 1e3);
    std::vector<T> h_ref(N), h_y(N);
    auto report = [&](const char* name, float ms, bool check) {
      double md = 0;
      if (check) {
        CK(cudaMemcpy(h_y.data(), B.y, N * 2, cudaMemcpyDeviceToHost));
        for (int64_t i = 0; i < N; i += 7) md = std::max(md, (double)fabsf(__bfloat162float(h_y[i]) - __bfloat162float(h_ref[i])));
      }
      printf("  %-34s %7.1f us  %.3f TB/s  %5.1f%% copy  maxdiff %.3g\n", name, ms * 1e3, bytes / ms / 1e9, 100.0 * copy / ms, md);
    };
    auto run_main = [&](auto tag) {
      using Tag = decltype(tag);
      constexpr int kRows = kBlock / Tag::tpr;
      const float ms = time_it([&] {
        forward_kernel<CL, VEC, Tag::tpr, Tag::vpt><<<(sh.rows + kRows - 1) / kRows, kBlock>>>(a, rows, {}, sh.rows, sh.n, 1e-5f, 1.0f / sh.n);
      });
      CK(cudaMemcpy(h_ref.data(), B.y, N * 2, cudaMemcpyDeviceToHost));
      char nm[64]; snprintf(nm, 64, "main ln tpr%d vpt%d", Tag::tpr, Tag::vpt);
      report(nm, ms, false);
      const float msr = time_it([&] {
        forward_kernel<CR, VEC, Tag::tpr, Tag::vpt><<<(sh.rows + kRows - 1) / kRows, kBlock>>>(ar, rows, {}, sh.rows, sh.n, 1e-5f, 1.0f / sh.n);
      });
      snprintf(nm, 64, "main rms tpr%d vpt%d", Tag::tpr, Tag::vpt);
      report(nm, msr, false);
    };
    auto variants = [&](auto tpr_c, auto vpt_c) {
#ifndef MAIN_ONLY
      constexpr int TPR = decltype(tpr_c)::value, VPT = decltype(vpt_c)::value;
      constexpr int kRows = kBlock / TPR;
      const int64_t groups = sh.rows / kRows;
      char nm[64];
      auto simple = [&](auto k, int minb, int stats) {
        const float ms = time_it([&] { k<<<groups, kBlock>>>(a, sh.rows, sh.n, 1e-5f); });
        snprintf(nm, 64, "simple t%d v%d minb%d stats%d", TPR, VPT, minb, stats); report(nm, ms, true);
      };
      simple(ln_simple<TPR, VPT, 1, 0>, 1, 0);
      simple(ln_simple<TPR, VPT, 6, 0>, 6, 0);
      simple(ln_simple<TPR, VPT, 1, 1>, 1, 1);
      simple(ln_simple<TPR, VPT, 6, 1>, 6, 1);
      auto pipe = [&](auto k, int minb, int stats) {
        int per; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, k, kBlock, 0));
        for (int mult : {1, 2}) {
          const int64_t grid = std::min<int64_t>(groups, int64_t(per) * sms * mult);
          const float ms = time_it([&] { k<<<grid, kBlock>>>(a, sh.rows, sh.n, 1e-5f); });
          snprintf(nm, 64, "pipe t%d v%d minb%d stats%d occ%d x%d", TPR, VPT, minb, stats, per, mult); report(nm, ms, true);
        }
      };
      pipe(ln_pipe<TPR, VPT, 1, 0>, 1, 0);
      pipe(ln_pipe<TPR, VPT, 4, 0>, 4, 0);
      pipe(ln_pipe<TPR, VPT, 5, 0>, 5, 0);
      pipe(ln_pipe<TPR, VPT, 1, 1>, 1, 1);
      pipe(ln_pipe<TPR, VPT, 4, 1>, 4, 1);
#endif
    };
    if (sh.n == 4096) {
      run_main(CachedTag<256, 2>{});
      variants(std::integral_constant<int, 256>{}, std::integral_constant<int, 2>{});
      variants(std::integral_constant<int, 128>{}, std::integral_constant<int, 4>{});
      variants(std::integral_constant<int, 64>{}, std::integral_constant<int, 8>{});
    } else if (sh.n == 1024) {
      run_main(CachedTag<64, 2>{});
      variants(std::integral_constant<int, 64>{}, std::integral_constant<int, 2>{});
      variants(std::integral_constant<int, 32>{}, std::integral_constant<int, 4>{});
    } else {
      run_main(CachedTag<256, 4>{});
      variants(std::integral_constant<int, 256>{}, std::integral_constant<int, 4>{});
      variants(std::integral_constant<int, 128>{}, std::integral_constant<int, 8>{});
    }
    CK(cudaFree(B.x)); CK(cudaFree(B.y)); CK(cudaFree(B.w)); CK(cudaFree(B.b)); CK(cudaFree(B.mean)); CK(cudaFree(B.rstd)); CK(cudaFree(ref));
  }
  return 0;
}

// Never called: the header's host-side code references them, and this program does not link torch.
extern "C" uint64_t aoti_torch_abi_version() { return 0; }
extern "C" AOTITorchError torch_get_const_data_ptr(AtenTensorHandle, const void**) { return 1; }
