// How fast cross_entropy's no-grad forward can read its logits: the question behind
// csrc/cuda/cross_entropy.cu's split_kernel. A standalone CUDA program (no torch): the copy
// bandwidth, a read-only ceiling (every byte loaded once, 16 bytes a load, four loads in flight
// a thread), and the log-sum-exp of bf16 rows (8192x128256, 4096x256000) as slices of
// THREADS x VPT 16-byte vectors, one block each, whose (max, sum of exp) a second kernel merges
// per row (a warp a row) into the loss of a target; err is against a float64 host reference
// of four rows. TB/s counts one read of the logits.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/cross_entropy_split_rows benchmarks/cross_entropy_split_rows.cu
//   /tmp/cross_entropy_split_rows
//
// The H200 figures of 2026-11-30 are in docs/ops/cross_entropy.md (Measured performance).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cmath>

#include "standalone.cuh"
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float ex2(float x) { float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
__device__ __forceinline__ uint4 ld(const void* p) { return *reinterpret_cast<const uint4*>(p); }

__global__ void read_sum(const uint4* x, int64_t n16, float* out) {
  uint32_t acc = 0;
  int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (; i + 3 * step < n16; i += 4 * step) {
    uint4 a = x[i], b = x[i + step], c = x[i + 2 * step], d = x[i + 3 * step];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n16; i += step) { uint4 a = x[i]; acc ^= a.x ^ a.y ^ a.z ^ a.w; }
  if (acc == 0x12345678u) out[0] = 1.f;
}

// Max then sum of exp of a block's share; every thread gets the block's (m, s).
template <int THREADS>
__device__ __forceinline__ void block_ms(float& m, float& s, float* sh) {
  float mm = m;
#pragma unroll
  for (int o = 16; o; o >>= 1) mm = fmaxf(mm, __shfl_xor_sync(~0u, mm, o));
  if (m != mm) s *= ex2((m - mm) * kLog2e);
  m = mm;
#pragma unroll
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(~0u, s, o);
  constexpr int W = THREADS / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) { sh[warp] = m; sh[W + warp] = s; }
  __syncthreads();
  if (warp == 0) {
    m = lane < W ? sh[lane] : -INFINITY;
    s = lane < W ? sh[W + lane] : 0.f;
    mm = m;
#pragma unroll
    for (int o = 16; o; o >>= 1) mm = fmaxf(mm, __shfl_xor_sync(~0u, mm, o));
    if (m != mm) s = (m == -INFINITY) ? 0.f : s * ex2((m - mm) * kLog2e);
    m = mm;
#pragma unroll
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(~0u, s, o);
  }
}

// One block per (row, split): chunk of THREADS * VPT vectors of 8 bf16.
template <int THREADS, int VPT, int MINB>
__global__ void __launch_bounds__(THREADS, MINB) split_kernel(const __nv_bfloat16* x, int V, int splits, float2* part) {
  __shared__ float sh[2 * THREADS / 32];
  const int64_t row = blockIdx.x / splits;
  const int sp = blockIdx.x % splits;
  const __nv_bfloat16* xr = x + row * V;
  uint4 v[VPT];
  const int base = sp * THREADS * VPT * 8;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int col = base + (i * THREADS + threadIdx.x) * 8;
    v[i] = col < V ? ld(xr + col) : make_uint4(0xff80ff80u, 0xff80ff80u, 0xff80ff80u, 0xff80ff80u);
  }
  __nv_bfloat162 mx[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) mx[k] = *reinterpret_cast<const __nv_bfloat162*>(&reinterpret_cast<const uint32_t*>(&v[0])[k]);
#pragma unroll
  for (int i = 1; i < VPT; ++i)
#pragma unroll
    for (int k = 0; k < 4; ++k) mx[k] = __hmax2(mx[k], *reinterpret_cast<const __nv_bfloat162*>(&reinterpret_cast<const uint32_t*>(&v[i])[k]));
  mx[0] = __hmax2(__hmax2(mx[0], mx[1]), __hmax2(mx[2], mx[3]));
  float m = fmaxf(__low2float(mx[0]), __high2float(mx[0]));
  float s = 0;
  if (m != -INFINITY) {
    const float mb = m * kLog2e;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const uint32_t* w = reinterpret_cast<const uint32_t*>(&v[i]);
      float p = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        p += ex2(fmaf(__uint_as_float(w[k] << 16), kLog2e, -mb));
        p += ex2(fmaf(__uint_as_float(w[k] & 0xffff0000u), kLog2e, -mb));
      }
      s += p;
    }
  }
  block_ms<THREADS>(m, s, sh);
  if (threadIdx.x == 0) part[blockIdx.x] = make_float2(m, s);
}

__global__ void combine_kernel(const float2* part, int splits, const __nv_bfloat16* x, int V, const int64_t* t,
                               int64_t rows, float* loss) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  float m = -INFINITY, s = 0;
  for (int sp = lane; sp < splits; sp += 32) {
    const float2 p = part[row * splits + sp];
    const float mm = fmaxf(m, p.x);
    if (mm != -INFINITY) s = s * ex2((m - mm) * kLog2e) + p.y * ex2((p.x - mm) * kLog2e);
    m = mm;
  }
  float mm = m;
#pragma unroll
  for (int o = 16; o; o >>= 1) mm = fmaxf(mm, __shfl_xor_sync(~0u, mm, o));
  if (m != mm) s = (m == -INFINITY) ? 0.f : s * ex2((m - mm) * kLog2e);
#pragma unroll
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(~0u, s, o);
  if (lane == 0) loss[row] = mm + logf(s) - __bfloat162float(x[row * V + t[row]]);
}

__global__ void fill(__nv_bfloat16* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    uint32_t g = h * 747796405u; g ^= g >> 16;
    // sum of two uniforms: a rough bell of width ~3
    p[i] = __float2bfloat16(3.f * (float(h & 0xffff) / 65536.f + float(g & 0xffff) / 65536.f - 1.f));
  }
}

template <typename F>
float time_it(F f) { return median_ms(f, 3, 9, 5); }

int main() {
  struct S { int64_t rows; int V; };
  for (S sh : {S{8192, 128256}, S{4096, 256000}}) {
    const int64_t N = sh.rows * sh.V;
    __nv_bfloat16 *x, *y; CK(cudaMalloc(&x, N * 2)); CK(cudaMalloc(&y, N * 2));
    fill<<<4096, 256>>>(x, N, 7);
    int64_t* t; CK(cudaMalloc(&t, sh.rows * 8));
    std::vector<int64_t> ht(sh.rows); for (int64_t i = 0; i < sh.rows; ++i) ht[i] = (i * 7919) % sh.V;
    CK(cudaMemcpy(t, ht.data(), sh.rows * 8, cudaMemcpyHostToDevice));
    float2* part; CK(cudaMalloc(&part, sh.rows * 1024 * sizeof(float2)));
    float *loss, *ref; CK(cudaMalloc(&loss, sh.rows * 4)); CK(cudaMalloc(&ref, sh.rows * 4));
    const double rb = double(N) * 2;
    const float copy = time_it([&] { CK(cudaMemcpyAsync(y, x, N * 2, cudaMemcpyDeviceToDevice)); });
    printf("shape %lldx%d  copy %.3f TB/s (read+write), %.1f us\n", (long long)sh.rows, sh.V, 2 * rb / copy / 1e9, copy * 1e3);
    for (int blocks : {132 * 4, 132 * 8, 132 * 16}) {
      const float ms = time_it([&] { read_sum<<<blocks, 512>>>(reinterpret_cast<const uint4*>(x), N / 8, loss); });
      printf("  read-only %5d blocks            %7.1f us  %.3f TB/s\n", blocks, ms * 1e3, rb / ms / 1e9);
    }
    // host fp64 reference of a few rows
    std::vector<__nv_bfloat16> hx(sh.V);
    std::vector<double> want;
    const int64_t check_rows[] = {0, 1, sh.rows / 2, sh.rows - 1};
    for (int64_t r : check_rows) {
      CK(cudaMemcpy(hx.data(), x + r * sh.V, sh.V * 2, cudaMemcpyDeviceToHost));
      double mx = -1e300; for (auto v : hx) mx = std::max(mx, (double)__bfloat162float(v));
      double s = 0; for (auto v : hx) s += std::exp((double)__bfloat162float(v) - mx);
      want.push_back(mx + std::log(s) - (double)__bfloat162float(hx[ht[r]]));
    }
    auto run = [&](auto kernel, int threads, int vpt, int minb) {
      const int chunk = threads * vpt * 8;
      const int splits = (sh.V + chunk - 1) / chunk;
      const float ms = time_it([&] {
        kernel<<<sh.rows * splits, threads>>>(x, sh.V, splits, part);
        combine_kernel<<<(sh.rows + 7) / 8, 256>>>(part, splits, x, sh.V, t, sh.rows, loss);
      });
      std::vector<float> hl(sh.rows); CK(cudaMemcpy(hl.data(), loss, sh.rows * 4, cudaMemcpyDeviceToHost));
      double err = 0; int k = 0; for (int64_t r : check_rows) err = std::max(err, std::fabs(hl[r] - want[k++]));
      int occ; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, threads, 0));
      printf("  split t%d v%d minb%d splits%d occ%d  %7.1f us  %.3f TB/s  err %.2g\n", threads, vpt, minb, splits, occ, ms * 1e3, rb / ms / 1e9, err);
    };
    run(split_kernel<512, 4, 1>, 512, 4, 1);
    run(split_kernel<512, 8, 1>, 512, 8, 1);
    run(split_kernel<256, 4, 1>, 256, 4, 1);
    run(split_kernel<256, 8, 1>, 256, 8, 1);
    run(split_kernel<256, 16, 1>, 256, 16, 1);
    run(split_kernel<128, 8, 1>, 128, 8, 1);
    run(split_kernel<128, 16, 1>, 128, 16, 1);
    run(split_kernel<256, 4, 4>, 256, 4, 4);
    CK(cudaFree(x)); CK(cudaFree(y)); CK(cudaFree(t)); CK(cudaFree(part)); CK(cudaFree(loss)); CK(cudaFree(ref));
  }
}
