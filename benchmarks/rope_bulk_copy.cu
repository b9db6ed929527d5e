// Can rope reach the copy bandwidth if the copy engine (TMA, cp.async.bulk) moves its bytes
// instead of the threads' loads and stores? A standalone CUDA program (no torch) for issue 4's
// forward goal (4.0 TB/s at LLaMA-3-8B's q and k: B=8, S=4096, Hq=32, Hk=8, D=128, bf16, bhsd,
// full rotate-half rotary, cos/sin (B, S, D)), where csrc/cuda/rope.cu's thread loads reach
// 92-95% of a same-size copy (docs/ops/rope.md).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/rope_bulk_copy benchmarks/rope_bulk_copy.cu
//   /tmp/rope_bulk_copy
//
// Timed, each as TB/s on rope's bytes model (read q and k, write both outputs): cudaMemcpy of the
// same bytes; a 16-byte grid-stride copy kernel; the same copy through shared memory by the copy
// engine ("bulk copy"); rope through shared memory by the copy engine ("bulk rope"); and a plain
// rope kernel with thread loads (one rotary pair of 16-byte chunks a thread, rows in memory
// order), which also serves as the reference the bulk rope's output is checked against.
//
// The bulk kernels: a block owns a tile of P positions of one batch element, and walks its
// 40 heads (q's, then k's): each head's P rows are contiguous in bhsd (P * 256 bytes), loaded
// by one bulk copy into one of NST shared-memory stages, rotated in place by the block's P * 8
// threads (each the same pair of chunks of every head, so its cos/sin chunks stay in registers),
// then stored by one bulk copy. One thread issues the copies; a stage is refilled LAG heads
// after its store was issued, once that store has read it.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "standalone.cuh"

namespace {

constexpr int B = 8, S = 4096, Hq = 32, Hk = 8, D = 128, H = Hq + Hk;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_addr(src)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void stores_read_all_but() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done)
                 : "r"(smem_addr(bar)), "r"(parity)
                 : "memory");
  }
}

// y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin, on chunk j (x1) and its partner j + D/2 (x2).
__device__ __forceinline__ void rotate(uint4& xa, uint4& xb, const uint4 ca, const uint4 cb, const uint4 sa,
                                       const uint4 sb) {
  float a[8], b[8], c0[8], c1[8], s0[8], s1[8], y0[8], y1[8];
  unpack8(xa, a); unpack8(xb, b); unpack8(ca, c0); unpack8(cb, c1); unpack8(sa, s0); unpack8(sb, s1);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    y0[e] = a[e] * c0[e] - b[e] * s0[e];
    y1[e] = b[e] * c1[e] + a[e] * s1[e];
  }
  xa = pack8(y0);
  xb = pack8(y1);
}

struct Args {
  const __nv_bfloat16 *q, *k, *cos, *sin;
  __nv_bfloat16 *qo, *ko;
};

// Head h of tile `item` (b, positions s0..s0+P): its rows' start in q / k (bhsd, contiguous).
template <int P>
__device__ __forceinline__ int64_t head_offset(int64_t item, int h) {
  const int64_t b = item / (S / P), s0 = (item % (S / P)) * P;
  return h < Hq ? ((b * Hq + h) * S + s0) * D : ((b * Hk + (h - Hq)) * S + s0) * D;
}

template <int P, int NST, int LAG, bool ROTATE>
__global__ void __launch_bounds__(P * 8) bulk_kernel(Args a, int64_t items) {
  constexpr uint32_t TILE = P * D * 2;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bars[NST];
  const int tid = threadIdx.x;
  const int64_t mine = items > blockIdx.x ? (items - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const int64_t n_units = mine * H;  // this block's (item, head) units, in order
  auto src = [&](int64_t n, bool out) -> __nv_bfloat16* {
    const int64_t item = blockIdx.x + (n / H) * gridDim.x;
    const int h = int(n % H);
    const int64_t off = head_offset<P>(item, h);
    if (out) return (h < Hq ? a.qo : a.ko) + off;
    return const_cast<__nv_bfloat16*>(h < Hq ? a.q : a.k) + off;
  };
  if (tid == 0) {
    for (int i = 0; i < NST; ++i) bar_init(&bars[i]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (tid == 0)
    for (int i = 0; i < NST && i < n_units; ++i) bulk_load(smem + i * TILE, src(i, false), TILE, &bars[i]);
  // This thread's pair of chunks in every head's tile: row r, chunks j and j + D/2.
  const int r = tid / 8, j = (tid % 8) * 8;
  uint4 ca{}, cb{}, sa{}, sb{};
  int64_t item_loaded = -1;
  for (int64_t n = 0; n < n_units; ++n) {
    const int st = int(n % NST);
    unsigned char* buf = smem + st * TILE;
    if (ROTATE) {
      const int64_t item = blockIdx.x + (n / H) * gridDim.x;
      if (item != item_loaded) {
        const int64_t bb = item / (S / P), s = (item % (S / P)) * P + r;
        const __nv_bfloat16* cr = a.cos + (bb * S + s) * D;
        const __nv_bfloat16* sr = a.sin + (bb * S + s) * D;
        ca = *reinterpret_cast<const uint4*>(cr + j); cb = *reinterpret_cast<const uint4*>(cr + j + D / 2);
        sa = *reinterpret_cast<const uint4*>(sr + j); sb = *reinterpret_cast<const uint4*>(sr + j + D / 2);
        item_loaded = item;
      }
    }
    bar_wait(&bars[st], uint32_t((n / NST) & 1));
    if (ROTATE) {
      uint4* xa = reinterpret_cast<uint4*>(buf + (r * D + j) * 2);
      uint4* xb = reinterpret_cast<uint4*>(buf + (r * D + j + D / 2) * 2);
      uint4 va = *xa, vb = *xb;
      rotate(va, vb, ca, cb, sa, sb);
      *xa = va;
      *xb = vb;
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    if (tid == 0) {
      bulk_store(src(n, true), buf, TILE);
      // Refill the stage whose store was issued LAG heads ago, once that store has read it.
      const int64_t old = n - LAG;
      if (old >= 0 && old + NST < n_units) {
        stores_read_all_but<LAG>();
        bulk_load(smem + (old % NST) * TILE, src(old + NST, false), TILE, &bars[old % NST]);
      }
    }
  }
  if (tid == 0) stores_read_all_but<0>();
}

// One rotary pair of 16-byte chunks a thread, rows in memory order (q's, then k's).
__global__ void __launch_bounds__(256) plain_rope(Args a) {
  const int64_t rows_q = int64_t(B) * Hq * S, rows = rows_q + int64_t(B) * Hk * S;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = t / 8;
  if (row >= rows) return;
  const int j = int(t % 8) * 8;
  const bool isq = row < rows_q;
  const int64_t rr = isq ? row : row - rows_q;
  const int64_t s = rr % S, b = rr / S / (isq ? Hq : Hk);
  const __nv_bfloat16* x = (isq ? a.q : a.k) + rr * D;
  __nv_bfloat16* y = (isq ? a.qo : a.ko) + rr * D;
  const __nv_bfloat16* cr = a.cos + (b * S + s) * D;
  const __nv_bfloat16* sr = a.sin + (b * S + s) * D;
  uint4 xa = *reinterpret_cast<const uint4*>(x + j), xb = *reinterpret_cast<const uint4*>(x + j + D / 2);
  rotate(xa, xb, *reinterpret_cast<const uint4*>(cr + j), *reinterpret_cast<const uint4*>(cr + j + D / 2),
         *reinterpret_cast<const uint4*>(sr + j), *reinterpret_cast<const uint4*>(sr + j + D / 2));
  *reinterpret_cast<uint4*>(y + j) = xa;
  *reinterpret_cast<uint4*>(y + j + D / 2) = xb;
}

__global__ void copy_kernel(const uint4* x, uint4* y, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = x[i];
}

}  // namespace

int main() {
  const int64_t nq = int64_t(B) * Hq * S * D, nk = int64_t(B) * Hk * S * D, nt = int64_t(B) * S * D;
  __nv_bfloat16 *q, *k, *qo, *ko, *qr, *kr, *cos, *sin;
  for (auto* p : {&q, &qo, &qr}) CK(cudaMalloc(p, nq * 2));
  for (auto* p : {&k, &ko, &kr}) CK(cudaMalloc(p, nk * 2));
  CK(cudaMalloc(&cos, nt * 2));
  CK(cudaMalloc(&sin, nt * 2));
  fill_hashed<<<1024, 256>>>(q, nq, 1); fill_hashed<<<1024, 256>>>(k, nk, 2);
  fill_hashed<<<1024, 256>>>(cos, nt, 3); fill_hashed<<<1024, 256>>>(sin, nt, 4);
  float* diff;
  CK(cudaMalloc(&diff, 4));
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const double bytes = 2.0 * (nq + nk) * 2;
  auto report = [&](const char* name, auto&& f) {
    const float ms = median_ms(f, 5, 15, 10);
    printf("%-48s %8.4f ms %6.3f TB/s\n", name, ms, bytes / ms / 1e9);
  };
  Args ref{q, k, cos, sin, qr, kr};
  const int64_t rows = int64_t(B) * H * S;
  plain_rope<<<unsigned((rows * 8 + 255) / 256), 256>>>(ref);
  CK(cudaDeviceSynchronize());

  report("cudaMemcpy (q, k)", [&] {
    CK(cudaMemcpyAsync(qo, q, nq * 2, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpyAsync(ko, k, nk * 2, cudaMemcpyDeviceToDevice));
  });
  report("copy kernel, 16 B a thread", [&] {
    copy_kernel<<<sms * 8, 512>>>(reinterpret_cast<const uint4*>(q), reinterpret_cast<uint4*>(qo), nq / 8);
    copy_kernel<<<sms * 8, 512>>>(reinterpret_cast<const uint4*>(k), reinterpret_cast<uint4*>(ko), nk / 8);
  });
  report("plain rope (thread loads)", [&] { plain_rope<<<unsigned((rows * 8 + 255) / 256), 256>>>(Args{q, k, cos, sin, qo, ko}); });

  auto check = [&](const char* name) {
    CK(cudaMemset(diff, 0, 4));
    max_abs_diff<<<1024, 256>>>(qo, qr, nq, diff);
    max_abs_diff<<<1024, 256>>>(ko, kr, nk, diff);
    float h;
    CK(cudaMemcpy(&h, diff, 4, cudaMemcpyDeviceToHost));
    printf("%-48s max |bulk - plain| = %g\n", name, h);
  };
  auto bulk = [&](auto kernel, int P, int NST, bool rotate, int per_sm, const char* what) {
    const int smem = P * D * 2 * NST;
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    int fit = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, P * 8, smem));
    const int64_t items = int64_t(B) * (S / P);
    for (int persistent = 0; persistent < 2; ++persistent) {
      const int64_t grid = persistent ? std::min<int64_t>(items, int64_t(sms) * std::min(fit, per_sm)) : items;
      char name[160];
      snprintf(name, sizeof name, "%s P=%d NST=%d (%d KB) %s %d/SM", what, P, NST, smem / 1024,
               persistent ? "persistent" : "a tile a block", fit);
      CK(cudaMemset(qo, 0, nq * 2));
      CK(cudaMemset(ko, 0, nk * 2));
      kernel<<<unsigned(grid), P * 8, smem>>>(Args{q, k, cos, sin, qo, ko}, items);
      CK(cudaDeviceSynchronize());
      if (rotate) check(name);
      report(name, [&] { kernel<<<unsigned(grid), P * 8, smem>>>(Args{q, k, cos, sin, qo, ko}, items); });
    }
  };
#define BULK(P, NST, LAG, PER_SM)                                          \
  bulk(bulk_kernel<P, NST, LAG, false>, P, NST, false, PER_SM, "bulk copy"); \
  bulk(bulk_kernel<P, NST, LAG, true>, P, NST, true, PER_SM, "bulk rope");
  BULK(16, 8, 2, 8)
  BULK(32, 4, 1, 8)
  BULK(32, 8, 2, 8)
  BULK(32, 12, 3, 8)
  BULK(64, 4, 1, 8)
  BULK(64, 6, 2, 8)
  report("cudaMemcpy (q, k), again", [&] {
    CK(cudaMemcpyAsync(qo, q, nq * 2, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpyAsync(ko, k, nk * 2, cudaMemcpyDeviceToDevice));
  });
  return 0;
}
