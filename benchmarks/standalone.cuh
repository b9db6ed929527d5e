// What the standalone CUDA benchmark programs in this folder share (each is built alone from
// its own .cu file, which includes this one): the error check and the timer.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t err_ = (x);                                                          \
    if (err_ != cudaSuccess) {                                                       \
      printf("CUDA %s at %s:%d\n", cudaGetErrorString(err_), __FILE__, __LINE__);    \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

// Median over `repeats` CUDA-event timings of `calls` back-to-back calls of f, in ms per call,
// after `warmup` calls.
template <typename F>
float median_ms(F f, int warmup, int repeats, int calls) {
  cudaEvent_t s, e;
  CK(cudaEventCreate(&s));
  CK(cudaEventCreate(&e));
  for (int i = 0; i < warmup; ++i) f();
  std::vector<float> ts;
  for (int r = 0; r < repeats; ++r) {
    CK(cudaEventRecord(s));
    for (int i = 0; i < calls; ++i) f();
    CK(cudaEventRecord(e));
    CK(cudaEventSynchronize(e));
    float ms;
    CK(cudaEventElapsedTime(&ms, s, e));
    ts.push_back(ms / calls);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(s));
  CK(cudaEventDestroy(e));
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

// The 8 bfloat16 values of a 16-byte vector as floats (exact), and back (rounded to nearest).
__device__ __forceinline__ void unpack8(uint4 v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    w[i] = *reinterpret_cast<uint32_t*>(&h);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// s plus the squares of a 16-byte vector's 8 bfloat16 values, in element order.
__device__ __forceinline__ float add_squares8(uint4 v, float s) {
  float f[8];
  unpack8(v, f);
#pragma unroll
  for (int e = 0; e < 8; ++e) s = fmaf(f[e], f[e], s);
  return s;
}

// The sum over a warp's 32 lanes (the same butterfly, so the same value, on every lane).
__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// Values in [-2, 2) from a hash of the index: random enough that a misplaced element shows.
__global__ void fill_hashed(__nv_bfloat16* x, int64_t n, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed ^ uint32_t(i >> 32) * 40503u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = __float2bfloat16(float(h & 0xffff) / 16384.0f - 2.0f);
  }
}

// *out = max(*out, max |a - b|) (*out starts at 0: non-negative floats order as ints).
__global__ void max_abs_diff(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n, float* out) {
  float m = 0.f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(__bfloat162float(a[i]) - __bfloat162float(b[i])));
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(m));
}
