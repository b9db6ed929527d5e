// Which thread mapping runs rope (bf16, rotate-half, LLaMA-3-8B's q and k: B=8, S=4096, Hq=32,
// Hk=8, D=128) nearest the copy bandwidth: the question behind csrc/cuda/rope.cu's mapping. A
// standalone CUDA program (no torch), bhsd and bshd layouts, full (R=128) and partial (R=64)
// rotary; TB/s on the bytes model of benchmarks/ops/rope.py (read q, k; write both outputs).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/rope_thread_mapping benchmarks/rope_thread_mapping.cu
//   /tmp/rope_thread_mapping
//
// "flat": one (row, 16-byte unit) task per thread (items=1), or 2 / 4 tasks per thread with
// all loads issued first; cs=1 adds streaming cache hints. "posmajor": the mapping rope.cu had
// before, a thread walking every head of one position with UNROLL heads in flight. The H200
// figures of 2026-11-30 are in docs/ops/rope.md (Kernels).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cstdlib>

#include "standalone.cuh"

struct St { int64_t b, h, s; };
struct P {
  const __nv_bfloat16 *q, *k; __nv_bfloat16 *qo, *ko;
  St qs, ks;
  const __nv_bfloat16 *cos, *sin;  // (B, S, R) contiguous
  int B, S, Hq, Hk, D, R;
  int bshd;  // row order of the flat mapping: 1 = (b, s, h)
};

template <int CACHE>
__device__ __forceinline__ uint4 ld(const __nv_bfloat16* p) {
  if constexpr (CACHE == 1) return __ldcs(reinterpret_cast<const uint4*>(p));
  else return *reinterpret_cast<const uint4*>(p);
}
template <int CACHE>
__device__ __forceinline__ void st(__nv_bfloat16* p, uint4 v) {
  if constexpr (CACHE == 1) __stcs(reinterpret_cast<uint4*>(p), v);
  else *reinterpret_cast<uint4*>(p) = v;
}

__device__ __forceinline__ void rot(const uint4 xa, const uint4 xb, const uint4 ca, const uint4 cb, const uint4 na,
                                    const uint4 nb, uint4& ya, uint4& yb) {
  float a[8], b[8], c0[8], c1[8], n0[8], n1[8], y0[8], y1[8];
  unpack8(xa, a); unpack8(xb, b); unpack8(ca, c0); unpack8(cb, c1); unpack8(na, n0); unpack8(nb, n1);
#pragma unroll
  for (int e = 0; e < 8; ++e) { y0[e] = a[e] * c0[e] - b[e] * n0[e]; y1[e] = b[e] * c1[e] + a[e] * n1[e]; }
  ya = pack8(y0); yb = pack8(y1);
}

// Flat mapping: a "task" is (row, unit); rows in memory order (q's rows, then k's); a unit is
// a rotary pair of 16-byte chunks (j, j + R/2) or a pass-through pair of chunks. ITEMS tasks
// per thread, blockDim.x apart, all loads issued first.
template <int ITEMS, int CACHE>
__global__ void __launch_bounds__(256) flat_kernel(P p, int64_t tasks_q, int64_t tasks) {
  const int rot_units = p.R / 16;                 // (R/2)/8
  const int units = rot_units + (p.D - p.R) / 16;  // pass-through: pairs of chunks
  const int64_t base = int64_t(blockIdx.x) * (256 * ITEMS) + threadIdx.x;
  uint4 xa[ITEMS], xb[ITEMS], ca[ITEMS], cb[ITEMS], na[ITEMS], nb[ITEMS];
  __nv_bfloat16* dst[ITEMS];
  int ja[ITEMS], jb[ITEMS];
  bool rotary[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int64_t t = base + i * 256;
    dst[i] = nullptr;
    if (t >= tasks) continue;
    const bool isq = t < tasks_q;
    const int64_t tt = isq ? t : t - tasks_q;
    const int H = isq ? p.Hq : p.Hk;
    const int64_t row = tt / units;
    const int u = int(tt - row * units);
    int64_t b, h, s;
    if (p.bshd) { h = row % H; const int64_t bs = row / H; s = bs % p.S; b = bs / p.S; }
    else { s = row % p.S; const int64_t bh = row / p.S; h = bh % H; b = bh / H; }
    const St& sx = isq ? p.qs : p.ks;
    const int64_t off = b * sx.b + h * sx.h + s * sx.s;
    const __nv_bfloat16* x = (isq ? p.q : p.k) + off;
    dst[i] = (isq ? p.qo : p.ko) + off;  // outputs share the inputs' strides here
    rotary[i] = u < rot_units;
    if (rotary[i]) { ja[i] = u * 8; jb[i] = ja[i] + p.R / 2; }
    else { const int c = u - rot_units; const int half = (p.D - p.R) / 2; ja[i] = p.R + c * 8; jb[i] = ja[i] + half; }
    xa[i] = ld<CACHE>(x + ja[i]); xb[i] = ld<CACHE>(x + jb[i]);
    if (rotary[i]) {
      const __nv_bfloat16* cr = p.cos + (b * p.S + s) * p.R;
      const __nv_bfloat16* sr = p.sin + (b * p.S + s) * p.R;
      ca[i] = *reinterpret_cast<const uint4*>(cr + ja[i]); cb[i] = *reinterpret_cast<const uint4*>(cr + jb[i]);
      na[i] = *reinterpret_cast<const uint4*>(sr + ja[i]); nb[i] = *reinterpret_cast<const uint4*>(sr + jb[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (dst[i] == nullptr) continue;
    uint4 ya = xa[i], yb = xb[i];
    if (rotary[i]) rot(xa[i], xb[i], ca[i], cb[i], na[i], nb[i], ya, yb);
    st<CACHE>(dst[i] + ja[i], ya); st<CACHE>(dst[i] + jb[i], yb);
  }
}

// Position-major mapping (rope.cu's before 2026-11-30): a thread owns a rotary unit of one position,
// loads its cos/sin once and walks every head, UNROLL heads' loads in flight. Pass-through
// features in a second sweep. block = (units, positions).
template <int UNROLL>
__global__ void __launch_bounds__(256) posmajor_kernel(P p) {
  const int64_t pos = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (pos >= int64_t(p.B) * p.S) return;
  const int64_t b = pos / p.S, s = pos % p.S;
  const int H = p.Hq + p.Hk;
  const int u = threadIdx.x;
  const int ja = u * 8, jb = ja + p.R / 2;
  const __nv_bfloat16* cr = p.cos + pos * p.R;
  const __nv_bfloat16* sr = p.sin + pos * p.R;
  const uint4 ca = *reinterpret_cast<const uint4*>(cr + ja), cb = *reinterpret_cast<const uint4*>(cr + jb);
  const uint4 na = *reinterpret_cast<const uint4*>(sr + ja), nb = *reinterpret_cast<const uint4*>(sr + jb);
  for (int h0 = 0; h0 < H; h0 += UNROLL) {
    uint4 xa[UNROLL], xb[UNROLL];
    __nv_bfloat16* dst[UNROLL];
#pragma unroll
    for (int i = 0; i < UNROLL; ++i) {
      const int h = h0 + i;
      dst[i] = nullptr;
      if (h >= H) continue;
      const bool isq = h < p.Hq;
      const St& sx = isq ? p.qs : p.ks;
      const int64_t off = b * sx.b + int64_t(isq ? h : h - p.Hq) * sx.h + s * sx.s;
      const __nv_bfloat16* x = (isq ? p.q : p.k) + off;
      dst[i] = (isq ? p.qo : p.ko) + off;
      xa[i] = ld<0>(x + ja); xb[i] = ld<0>(x + jb);
    }
#pragma unroll
    for (int i = 0; i < UNROLL; ++i) {
      if (dst[i] == nullptr) continue;
      uint4 ya, yb;
      rot(xa[i], xb[i], ca, cb, na, nb, ya, yb);
      st<0>(dst[i] + ja, ya); st<0>(dst[i] + jb, yb);
    }
  }
}

// The copy baseline: a grid-stride 16-byte copy.
__global__ void copy_kernel(const uint4* a, uint4* b, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) b[i] = a[i];
}

int main() {
  const int B = 8, S = 4096, Hq = 32, Hk = 8, D = 128;
  const int64_t nq = int64_t(B) * S * Hq * D, nk = int64_t(B) * S * Hk * D;
  __nv_bfloat16 *q, *k, *qo, *ko, *cos, *sin;
  CK(cudaMalloc(&q, nq * 2)); CK(cudaMalloc(&k, nk * 2)); CK(cudaMalloc(&qo, nq * 2)); CK(cudaMalloc(&ko, nk * 2));
  CK(cudaMalloc(&cos, int64_t(B) * S * D * 2)); CK(cudaMalloc(&sin, int64_t(B) * S * D * 2));
  CK(cudaMemset(q, 0x3c, nq * 2)); CK(cudaMemset(k, 0x3c, nk * 2));
  CK(cudaMemset(cos, 0x3c, int64_t(B) * S * D * 2)); CK(cudaMemset(sin, 0x3c, int64_t(B) * S * D * 2));
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  const double bytes = 2.0 * (nq + nk) * 2;
  auto timeit = [&](const char* name, auto&& f) {
    for (int i = 0; i < 5; ++i) f();
    CK(cudaDeviceSynchronize());
    const int n = 40;
    CK(cudaEventRecord(e0));
    for (int i = 0; i < n; ++i) f();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); ms /= n;
    CK(cudaGetLastError());
    printf("%-44s %8.4f ms %6.3f TB/s\n", name, ms, bytes / ms / 1e9);
  };
  timeit("copy (cudaMemcpy q,k)", [&] { cudaMemcpyAsync(qo, q, nq * 2, cudaMemcpyDeviceToDevice); cudaMemcpyAsync(ko, k, nk * 2, cudaMemcpyDeviceToDevice); });
  timeit("copy kernel (grid 4x SMs)", [&] {
    copy_kernel<<<sms * 8, 512>>>((const uint4*)q, (uint4*)qo, nq / 8);
    copy_kernel<<<sms * 8, 512>>>((const uint4*)k, (uint4*)ko, nk / 8); });
  for (int layout = 0; layout < 2; ++layout) {
    for (int R : {128, 64}) {
      P p{};
      p.q = q; p.k = k; p.qo = qo; p.ko = ko; p.cos = cos; p.sin = sin;
      p.B = B; p.S = S; p.Hq = Hq; p.Hk = Hk; p.D = D; p.R = R; p.bshd = layout;
      if (layout == 0) { p.qs = {int64_t(Hq) * S * D, int64_t(S) * D, D}; p.ks = {int64_t(Hk) * S * D, int64_t(S) * D, D}; }
      else { p.qs = {int64_t(S) * Hq * D, D, int64_t(Hq) * D}; p.ks = {int64_t(S) * Hk * D, D, int64_t(Hk) * D}; }
      const int units = R / 16 + (D - R) / 16;
      const int64_t tq = int64_t(B) * S * Hq * units, tasks = tq + int64_t(B) * S * Hk * units;
      char name[128];
      const char* lay = layout ? "bshd" : "bhsd";
#define FLAT(I, C) { snprintf(name, sizeof name, "%s R=%d flat items=%d cs=%d", lay, R, I, C); \
        const int64_t blocks = (tasks + 256 * I - 1) / (256 * I); \
        timeit(name, [&] { flat_kernel<I, C><<<unsigned(blocks), 256>>>(p, tq, tasks); }); }
      FLAT(1, 0) FLAT(2, 0) FLAT(4, 0) FLAT(2, 1) FLAT(4, 1)
      if (R == D) {
#define POS(U) { snprintf(name, sizeof name, "%s R=%d posmajor unroll=%d", lay, R, U); \
          dim3 blk(R / 16, 256 / (R / 16)); const int64_t blocks = (int64_t(B) * S + blk.y - 1) / blk.y; \
          timeit(name, [&] { posmajor_kernel<U><<<unsigned(blocks), blk>>>(p); }); }
        POS(2) POS(4)
      }
    }
  }
  return 0;
}
