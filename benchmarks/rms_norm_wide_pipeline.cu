// Can the forward of very wide rows (issue 3: 3.6 TB/s at 256x262144 bf16, where the library's
// staged cluster kernel reaches 3.32 on the H200) do without clusters, by a grid-wide software
// pipeline? A standalone CUDA program (no torch), rms_norm only.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/rms_norm_wide_pipeline benchmarks/rms_norm_wide_pipeline.cu
//   /tmp/rms_norm_wide_pipeline
//
// The staged kernel gives each row to one cluster of 8 blocks: 49 rows are in flight at once on
// 132 SMs, the last of 5.2 rounds runs a fifth full, and each row's first bytes wait for its
// 64 KB chunks to land (docs/ops/rms_norm.md: 0.283 us a row plus 12.4 us a launch). Here the
// rows are cut into tiles of one warp's VPT 16-byte vectors a lane (VPT x 256 values), dealt to
// every warp of a resident grid in turn (tile t to warp t mod W), so that every warp has the same
// work whatever the row count. A warp loads tile k, sums its squares and publishes the sum (one
// float a tile, then an increment of the row's counter); the row's last tile to arrive adds the
// row's tile sums once, in a fixed order, and publishes rstd behind the row's ready flag. Then
// the warp finishes tile k - LAG, still in its registers: it waits for that row's flag and
// writes y. No thread waits for a block or a cluster; the row's statistics cross the GPU
// through L2. Rows complete in order, so a warp waits only for tiles that other warps loaded
// LAG tiles ago; every warp loads tile k before it waits on tile k - LAG, and all warps are
// resident, so none waits forever.
//
// Result (H100, 2026-12-07; no H200 could be had): slower than the staged cluster kernel at
// every width, 2.15 TB/s at best at 256x262144 where the staged kernel runs 2.65 and a copy
// 2.93. Not kept; the figures are in docs/ops/rms_norm.md.
//
// Timed as TB/s on the forward's bytes model (read x, write y), beside cudaMemcpy of x's bytes,
// at 256x262144, 512x131072 and 2048x32768; y and rstd checked against a one-block-a-row kernel.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "standalone.cuh"

namespace {

constexpr float EPS = 1e-6f;
constexpr int kThreads = 256, kWarps = kThreads / 32;

template <int VPT>
__device__ __forceinline__ float sum_squares(const uint4 (&v)[VPT]) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) s = add_squares8(v[i], s);
  return s;
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// One step of a warp: load tile `t_load` (32 lanes x VPT vectors) into `in` and publish its
// sum; then finish tile `t_done` from `out` (either may be past the end: skipped), its weight
// vectors loaded before the wait for its row.
template <int N, int VPT, bool HINTS>
__device__ __forceinline__ void step(const uint4* __restrict__ x, const uint4* __restrict__ w, uint4* __restrict__ y,
                                     float* __restrict__ rstd, float* partial, unsigned* done, unsigned* ready, int64_t tiles,
                                     int64_t t_load, int64_t t_done, uint4 (&in)[VPT], uint4 (&out)[VPT]) {
  constexpr int kTile = 32 * VPT * 8, kTilesPerRow = N / kTile;
  const int lane = threadIdx.x % 32;
  if (t_load < tiles) {
    const uint4* src = x + t_load * (kTile / 8) + lane;
#pragma unroll
    for (int i = 0; i < VPT; ++i) in[i] = HINTS ? __ldcs(src + 32 * i) : src[32 * i];
    const float s = warp_sum(sum_squares(in));
    const int64_t row = t_load / kTilesPerRow;
    unsigned arrived = 0;
    if (lane == 0) {
      __stcg(partial + t_load, s);
      __threadfence();
      arrived = atomicAdd(done + row, 1u);
    }
    // The row's last tile to arrive adds the row's tile sums, once, in a fixed order (each lane
    // a fixed run, then a fixed butterfly), and publishes rstd behind the row's ready flag.
    if (__shfl_sync(0xffffffffu, arrived, 0) == unsigned(kTilesPerRow - 1)) {
      __threadfence();
      float total = 0.f;
      constexpr int kPerLane = (kTilesPerRow + 31) / 32;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int i = lane * kPerLane + j;
        if (i < kTilesPerRow) total += __ldcg(partial + row * kTilesPerRow + i);
      }
      const float r = rsqrtf(warp_sum(total) / N + EPS);
      if (lane == 0) {
        __stcg(rstd + row, r);
        __threadfence();
        atomicExch(ready + row, 1u);
      }
    }
  }
  if (t_done >= 0 && t_done < tiles) {
    const int64_t row = t_done / kTilesPerRow;
    const int col_vec = int(t_done % kTilesPerRow) * (kTile / 8) + lane;
    uint4 wv[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) wv[i] = w[col_vec + 32 * i];
    float r = 0.f;
    if (lane == 0) {
      while (load_acquire(ready + row) == 0) __nanosleep(32);
      r = __ldcg(rstd + row);
    }
    r = __shfl_sync(0xffffffffu, r, 0);
    uint4* dst = y + t_done * (kTile / 8) + lane;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      float f[8], g[8];
      unpack8(out[i], f);
      unpack8(wv[i], g);
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = f[e] * r * g[e];
      if (HINTS) __stcs(dst + 32 * i, pack8(f));
      else dst[32 * i] = pack8(f);
    }
  }
}

template <int N, int VPT, int LAG, int MINB, bool HINTS>
__global__ void __launch_bounds__(kThreads, MINB)
    pipeline_kernel(const uint4* x, const uint4* w, uint4* y, float* rstd, float* partial, unsigned* done, int rows) {
  constexpr int kTile = 32 * VPT * 8;
  static_assert(N % kTile == 0, "whole tiles a row");
  const int64_t tiles = int64_t(rows) * (N / kTile);
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  const int64_t first = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  uint4 buf[LAG + 1][VPT];
  // Step k loads tile first + k * warps into buf[k % (LAG + 1)] and finishes the tile of step
  // k - LAG, in buf[(k + 1) % (LAG + 1)]: unrolled by LAG + 1 so that both indices are constants.
  for (int64_t k0 = 0;; k0 += LAG + 1) {
    if (first + (k0 - LAG) * warps >= tiles) break;
#pragma unroll
    for (int j = 0; j <= LAG; ++j) {
      const int64_t k = k0 + j;
      step<N, VPT, HINTS>(x, w, y, rstd, partial, done, done + rows, tiles, first + k * warps, first + (k - LAG) * warps, buf[j],
                     buf[(j + 1) % (LAG + 1)]);
    }
  }
}

// A plain reference: one 1024-thread block a row, a sum then a normalising sweep.
template <int N>
__global__ void __launch_bounds__(1024) reference_kernel(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y,
                                                         float* rstd) {
  __shared__ float part[32];
  const __nv_bfloat16* xr = x + int64_t(blockIdx.x) * N;
  float s = 0.f;
  for (int i = threadIdx.x; i < N; i += 1024) {
    const float v = __bfloat162float(xr[i]);
    s = fmaf(v, v, s);
  }
  s = warp_sum(s);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = s;
  __syncthreads();
  s = warp_sum(part[threadIdx.x % 32]);
  const float r = rsqrtf(s / N + EPS);
  for (int i = threadIdx.x; i < N; i += 1024)
    y[int64_t(blockIdx.x) * N + i] = __float2bfloat16(__bfloat162float(xr[i]) * r * __bfloat162float(w[i]));
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

__global__ void max_rel_diff(const float* a, const float* b, int64_t n, float* out) {
  float m = 0.f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(a[i] - b[i]) / fabsf(b[i]));
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(m));
}

template <int N>
void run(int rows, int sms) {
  const int64_t n = int64_t(rows) * N;
  const int64_t tiles = n / (32 * 2 * 8);  // (the smallest tile below: the most tile sums)
  __nv_bfloat16 *x, *w, *y, *yr;
  float *rstd, *rstdr, *partial, *diff;
  unsigned* done;
  CK(cudaMalloc(&x, n * 2)); CK(cudaMalloc(&y, n * 2)); CK(cudaMalloc(&yr, n * 2)); CK(cudaMalloc(&w, N * 2));
  CK(cudaMalloc(&rstd, rows * 4)); CK(cudaMalloc(&rstdr, rows * 4)); CK(cudaMalloc(&diff, 8));
  CK(cudaMalloc(&partial, tiles * 4)); CK(cudaMalloc(&done, rows * 8));  // arrivals, then ready flags
  fill_hashed<<<1024, 256>>>(x, n, 1);
  fill_hashed<<<64, 256>>>(w, N, 2);
  reference_kernel<N><<<rows, 1024>>>(x, w, yr, rstdr);
  CK(cudaDeviceSynchronize());
  const double bytes = 2.0 * n * 2;
  const auto X = reinterpret_cast<const uint4*>(x), W = reinterpret_cast<const uint4*>(w);
  const auto Y = reinterpret_cast<uint4*>(y);
  auto report = [&](const char* name, auto&& f) {
    const float ms = median_ms(f, 5, 21, 20);
    printf("%6dx%-6d %-52s %8.4f ms %6.3f TB/s\n", rows, N, name, ms, bytes / ms / 1e9);
  };
  auto variant = [&](auto kernel, const char* name) {
    int fit = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, kThreads, 0));
    const unsigned grid = unsigned(sms * fit);
    auto launch = [&] {
      CK(cudaMemsetAsync(done, 0, rows * 8));
      kernel<<<grid, kThreads>>>(X, W, Y, rstd, partial, done, rows);
    };
    CK(cudaMemset(y, 0, n * 2));
    launch();
    CK(cudaDeviceSynchronize());
    CK(cudaMemset(diff, 0, 8));
    max_abs_diff<<<1024, 256>>>(y, yr, n, diff);
    max_rel_diff<<<64, 256>>>(rstd, rstdr, rows, diff + 1);
    float h[2];
    CK(cudaMemcpy(h, diff, 8, cudaMemcpyDeviceToHost));
    char full[128];
    snprintf(full, sizeof full, "%s (%d blocks an SM)", name, fit);
    report(full, launch);
    printf("%14s max |y - y_ref| = %g, max rel rstd diff = %g\n", "", h[0], h[1]);
  };
  report("cudaMemcpy (x's bytes)", [&] { CK(cudaMemcpyAsync(y, x, n * 2, cudaMemcpyDeviceToDevice)); });
  report("reference (a 1024-thread block a row)", [&] { reference_kernel<N><<<rows, 1024>>>(x, w, y, rstd); });
  variant(pipeline_kernel<N, 4, 1, 3, false>, "pipeline, 4 vectors, lag 1");
  variant(pipeline_kernel<N, 4, 2, 2, false>, "pipeline, 4 vectors, lag 2");
  variant(pipeline_kernel<N, 2, 2, 4, false>, "pipeline, 2 vectors, lag 2");
  variant(pipeline_kernel<N, 2, 3, 3, false>, "pipeline, 2 vectors, lag 3");
  variant(pipeline_kernel<N, 8, 1, 2, false>, "pipeline, 8 vectors, lag 1");
  variant(pipeline_kernel<N, 4, 1, 3, true>, "pipeline, 4 vectors, lag 1, streaming hints");
  variant(pipeline_kernel<N, 2, 2, 4, true>, "pipeline, 2 vectors, lag 2, streaming hints");
  report("cudaMemcpy (x's bytes), again", [&] { CK(cudaMemcpyAsync(y, x, n * 2, cudaMemcpyDeviceToDevice)); });
  for (void* p : {(void*)x, (void*)y, (void*)yr, (void*)w, (void*)rstd, (void*)rstdr, (void*)diff, (void*)partial,
                  (void*)done})
    CK(cudaFree(p));
}

}  // namespace

int main() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("%s\n", prop.name);
  for (int round = 0; round < 2; ++round) {
    run<262144>(256, prop.multiProcessorCount);
    run<131072>(512, prop.multiProcessorCount);
    run<32768>(2048, prop.multiProcessorCount);
  }
  return 0;
}
