// Does a persistent rms_norm forward, holding its weight columns in registers and loading the
// next row while it reduces and writes the current one, come nearer the copy
// bandwidth than a grid of one-row-per-group blocks? A standalone CUDA program (no torch) for
// issue 3's forward goal at 65536x1024 bf16 (3.9 TB/s, 98% of a same-size copy, where
// csrc/include/fusedops/cuda_norm.cuh's kernel reaches 97%: docs/ops/rms_norm.md).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/rms_norm_persistent_rows benchmarks/rms_norm_persistent_rows.cu
//   /tmp/rms_norm_persistent_rows
//
// Timed, as TB/s on the forward's bytes model (read x, write y; the weight and rstd not
// counted, as in benchmarks/ops/rms_norm.py): cudaMemcpy of x's bytes; "grid": 64 threads a row
// (two 16-byte vectors a thread, the row's sum across two warps through shared memory), four
// rows a 256-thread block, one block per four rows, the weight loaded per row (the shape of the
// library's kernel); "persistent": the same row groups looping over rows (a grid of resident
// blocks), optionally holding the weight in registers and loading the next row's vectors before
// the current row is reduced. Every kernel's y and rstd are checked against the grid kernel's.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "standalone.cuh"

namespace {

constexpr int N = 1024;
constexpr float EPS = 1e-6f;

__device__ __forceinline__ uint4 scale8(uint4 v, uint4 w, float r) {
  float f[8], g[8];
  unpack8(v, f);
  unpack8(w, g);
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = __bfloat162float(__float2bfloat16(f[e] * r)) * g[e];
  return pack8(f);
}
// 64 threads a row, two vectors a thread (vector i of the row at thread + 64 i), 4 rows a block.
__global__ void __launch_bounds__(256, 6) grid_kernel(const uint4* x, const uint4* w, uint4* y, float* rstd, int rows) {
  __shared__ float part[8];
  const int t = threadIdx.x % 64, r = threadIdx.x / 64, warp = threadIdx.x / 32;
  const int64_t row = int64_t(blockIdx.x) * 4 + r;
  const bool live = row < rows;
  uint4 v0{}, v1{};
  if (live) {
    v0 = x[row * (N / 8) + t];
    v1 = x[row * (N / 8) + t + 64];
  }
  float s = warp_sum(add_squares8(v0, 0.f) + add_squares8(v1, 0.f));
  if (threadIdx.x % 32 == 0) part[warp] = s;
  __syncthreads();
  s = part[2 * r] + part[2 * r + 1];
  const float inv = rsqrtf(s / N + EPS);
  if (!live) return;
  y[row * (N / 8) + t] = scale8(v0, w[t], inv);
  y[row * (N / 8) + t + 64] = scale8(v1, w[t + 64], inv);
  if (t == 0) rstd[row] = inv;
}

// The grid kernel's layout (64 threads a row, two vectors a thread, four row groups a block) in
// a persistent grid: each group loops over rows, its two warps meeting at a named barrier of
// their own (no block barrier), with double-buffered partial sums. HOLD_W: the thread's weight
// vectors in registers; PREFETCH: the next row's vectors loaded before this row is reduced.
template <bool PREFETCH, bool HOLD_W, int MIN_BLOCKS>
__global__ void __launch_bounds__(256, MIN_BLOCKS) persistent_kernel(const uint4* x, const uint4* w, uint4* y, float* rstd,
                                                                     int rows) {
  __shared__ float part[2][8];
  const int t = threadIdx.x % 64, r = threadIdx.x / 64, warp = threadIdx.x / 32;
  const int groups = gridDim.x * 4;
  uint4 w0{}, w1{};
  if (HOLD_W) { w0 = w[t]; w1 = w[t + 64]; }
  int row = blockIdx.x * 4 + r;
  uint4 v0{}, v1{};
  if (row < rows) { v0 = x[int64_t(row) * (N / 8) + t]; v1 = x[int64_t(row) * (N / 8) + t + 64]; }
  for (int it = 0; row < rows; row += groups, ++it) {
    const int next = row + groups;
    uint4 n0{}, n1{};
    if (PREFETCH && next < rows) { n0 = x[int64_t(next) * (N / 8) + t]; n1 = x[int64_t(next) * (N / 8) + t + 64]; }
    const float s = warp_sum(add_squares8(v0, 0.f) + add_squares8(v1, 0.f));
    if (threadIdx.x % 32 == 0) part[it & 1][warp] = s;
    asm volatile("bar.sync %0, 64;" ::"r"(r + 1) : "memory");
    const float inv = rsqrtf((part[it & 1][2 * r] + part[it & 1][2 * r + 1]) / N + EPS);
    y[int64_t(row) * (N / 8) + t] = scale8(v0, HOLD_W ? w0 : w[t], inv);
    y[int64_t(row) * (N / 8) + t + 64] = scale8(v1, HOLD_W ? w1 : w[t + 64], inv);
    if (t == 0) rstd[row] = inv;
    if (PREFETCH) { v0 = n0; v1 = n1; }
    else if (next < rows) { v0 = x[int64_t(next) * (N / 8) + t]; v1 = x[int64_t(next) * (N / 8) + t + 64]; }
  }
}

__global__ void max_diff_f(const float* a, const float* b, int64_t n, float* out) {
  float m = 0.f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(a[i] - b[i]) / fabsf(b[i]));
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(m));
}

}  // namespace

int main() {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (int rows : {65536, 32768, 131072}) {
    const int64_t n = int64_t(rows) * N;
    __nv_bfloat16 *x, *w, *y, *yr;
    float *rstd, *rstdr, *diff;
    CK(cudaMalloc(&x, n * 2)); CK(cudaMalloc(&y, n * 2)); CK(cudaMalloc(&yr, n * 2)); CK(cudaMalloc(&w, N * 2));
    CK(cudaMalloc(&rstd, rows * 4)); CK(cudaMalloc(&rstdr, rows * 4)); CK(cudaMalloc(&diff, 8));
    fill_hashed<<<1024, 256>>>(x, n, 1);
    fill_hashed<<<4, 256>>>(w, N, 2);
    const auto X = reinterpret_cast<const uint4*>(x);
    const auto W = reinterpret_cast<const uint4*>(w);
    const double bytes = 2.0 * n * 2;
    auto report = [&](const char* name, auto&& f) {
      const float ms = median_ms(f, 5, 21, 20);
      printf("%6dx%d %-40s %8.4f ms %6.3f TB/s\n", rows, N, name, ms, bytes / ms / 1e9);
    };
    auto check = [&](const char* name) {
      CK(cudaMemset(diff, 0, 8));
      max_abs_diff<<<1024, 256>>>(y, yr, n, diff);
      max_diff_f<<<256, 256>>>(rstd, rstdr, rows, diff + 1);
      float h[2];
      CK(cudaMemcpy(h, diff, 8, cudaMemcpyDeviceToHost));
      printf("%s: max |y - y_grid| = %g, max rel rstd diff = %g\n", name, h[0], h[1]);
    };
    const unsigned grid_blocks = unsigned((rows + 3) / 4);
    grid_kernel<<<grid_blocks, 256>>>(X, W, reinterpret_cast<uint4*>(yr), rstdr, rows);
    CK(cudaDeviceSynchronize());
    report("cudaMemcpy (x's bytes)", [&] { CK(cudaMemcpyAsync(y, x, n * 2, cudaMemcpyDeviceToDevice)); });
    report("grid (64 threads a row)", [&] { grid_kernel<<<grid_blocks, 256>>>(X, W, reinterpret_cast<uint4*>(y), rstd, rows); });
    auto persistent = [&](auto kernel, const char* what) {
      int fit;
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, 256, 0));
      for (int per_sm : {4, 6, 8}) {
        if (per_sm > fit) continue;
        char name[96];
        snprintf(name, sizeof name, "%s, %d blocks an SM", what, per_sm);
        report(name, [&] { kernel<<<unsigned(sms * per_sm), 256>>>(X, W, reinterpret_cast<uint4*>(y), rstd, rows); });
        check(name);
      }
    };
    persistent(persistent_kernel<false, false, 6>, "persistent");
    persistent(persistent_kernel<false, true, 6>, "persistent, w held");
    persistent(persistent_kernel<true, false, 6>, "persistent + prefetch");
    persistent(persistent_kernel<true, true, 6>, "persistent + prefetch, w held");
    persistent(persistent_kernel<true, true, 4>, "persistent + prefetch, w held, lb4");
    report("grid (64 threads a row), again", [&] { grid_kernel<<<grid_blocks, 256>>>(X, W, reinterpret_cast<uint4*>(y), rstd, rows); });
    for (void* p : {(void*)x, (void*)y, (void*)yr, (void*)w, (void*)rstd, (void*)rstdr, (void*)diff}) CK(cudaFree(p));
  }
  return 0;
}
