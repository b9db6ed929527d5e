// Helpers shared by the CUDA kernels: storage types and conversions, 16-byte vector access,
// row reductions, and the launch plumbing (current stream, device properties, error checks).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/headeronly/util/Exception.h>

#include "fusedops/dispatch.h"

namespace fusedops::cuda {

// torch's storage types mapped to CUDA's, which have device conversions.
template <typename T> struct Device { using type = T; };
template <> struct Device<BFloat16> { using type = __nv_bfloat16; };
template <> struct Device<Half> { using type = __half; };
template <typename T> using device_t = typename Device<T>::type;

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };
template <typename T> using acc_t = typename Acc<T>::type;

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_acc(acc_t<T> v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }

// A quiet NaN of the accumulation type (what an invalid row's or position's results become).
template <typename A>
__device__ __forceinline__ A quiet_nan() {
  if constexpr (sizeof(A) == 8)
    return __longlong_as_double(0x7ff8000000000000ll);
  else
    return __int_as_float(0x7fc00000);
}

// 1 / v by the hardware approximation (within 1 ulp), without the IEEE division's Newton step
// and slow-path call. Subnormal inputs and results flush to 0; 1 / inf = 0.
__device__ __forceinline__ float rcp_approx(float v) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}

// As rcp_approx, but a result below float32's smallest normal number stays a subnormal (the
// non-ftz instruction: v is scaled by 1/4 past 2^126 and the result back, three more
// instructions without a branch). For sigmoids, whose tail times a huge factor is ordinary.
__device__ __forceinline__ float rcp_approx_keep_subnormal(float v) {
  float r;
  asm("rcp.approx.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}

// N elements of T loaded or stored together (16 bytes when N * sizeof(T) == 16).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Vectors wider than 16 bytes (a float32 residual beside 8 bf16 values) are loaded and stored
// as 16-byte pieces, which need only 16-byte alignment.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  if constexpr (sizeof(T) * N > 16) {
    static_assert(sizeof(T) * N % 16 == 0, "wide vectors are whole 16-byte pieces");
    constexpr int kPer = 16 / sizeof(T);
    Vec<T, N> v;
#pragma unroll
    for (int j = 0; j < N; j += kPer) {
      const Vec<T, kPer> piece = *reinterpret_cast<const Vec<T, kPer>*>(p + j);
#pragma unroll
      for (int k = 0; k < kPer; ++k) v.v[j + k] = piece.v[k];
    }
    return v;
  } else {
    return *reinterpret_cast<const Vec<T, N>*>(p);
  }
}

// One 16-byte store. Written as PTX because the compiler, unable to prove the alignment of a
// computed address, otherwise splits it into four 4-byte stores (a 25% bandwidth loss).
__device__ __forceinline__ void store16(void* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  if constexpr (sizeof(T) * N == 16) {
    const uint4 u = *reinterpret_cast<const uint4*>(&v);
    store16(p, u.x, u.y, u.z, u.w);
  } else if constexpr (sizeof(T) * N > 16) {
    static_assert(sizeof(T) * N % 16 == 0, "wide vectors are whole 16-byte pieces");
    constexpr int kPer = 16 / sizeof(T);
#pragma unroll
    for (int j = 0; j < N; j += kPer) {
      Vec<T, kPer> piece;
#pragma unroll
      for (int k = 0; k < kPer; ++k) piece.v[k] = v.v[j + k];
      store_vec<T, kPer>(p + j, piece);
    }
  } else {
    *reinterpret_cast<Vec<T, N>*>(p) = v;
  }
}

// Stores N accumulator values (float or double) with 16-byte stores where they fill them.
template <typename A, int N>
__device__ __forceinline__ void store_acc(A* p, const A (&vals)[N]) {
  if constexpr ((sizeof(A) * N) % 16 == 0) {
    constexpr int kPer = 16 / sizeof(A);
#pragma unroll
    for (int j = 0; j < N; j += kPer) {
      Vec<A, kPer> v;
#pragma unroll
      for (int k = 0; k < kPer; ++k) v.v[k] = vals[j + k];
      store_vec<A, kPer>(p + j, v);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = vals[k];
  }
}

// Raw bits of one converted value, for packing 16-bit results into 32-bit words in registers
// (assembling an array of __nv_bfloat16 objects goes through local memory).
__device__ __forceinline__ uint32_t to_bits(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
__device__ __forceinline__ uint32_t to_bits(__half v) { return __half_as_ushort(v); }

// The value of 16 bits of T (in the low half of `bits`).
template <typename T> __device__ __forceinline__ float bits_to_acc(uint32_t bits);
template <> __device__ __forceinline__ float bits_to_acc<__nv_bfloat16>(uint32_t bits) {
  return __uint_as_float(bits << 16);
}
template <> __device__ __forceinline__ float bits_to_acc<__half>(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

// N values of a 16-bit T packed two to a word, the lower element in the low half: how a kernel
// holds 16-bit values it rounded itself.
template <typename T, int N>
struct Packed {
  uint32_t w[N / 2];
};

// N values of T rounded from the accumulator and held in registers: Packed for 16-bit T, else a Vec.
template <typename T, int N>
using Held = std::conditional_t<sizeof(T) == 2 && N % 2 == 0, Packed<T, N>, Vec<T, N>>;

// Element k of a register vector, in the accumulation type.
template <typename T, int N>
__device__ __forceinline__ acc_t<T> acc_at(const Vec<T, N>& v, int k) {
  return to_acc(v.v[k]);
}
template <typename T, int N>
__device__ __forceinline__ float acc_at(const Packed<T, N>& v, int k) {
  return bits_to_acc<T>(k % 2 == 0 ? v.w[k / 2] & 0xffffu : v.w[k / 2] >> 16);
}

// Loads N values of T into the registers they are held in (Packed words for 16-bit T): the
// words stay packed until they are used, so a thread can issue all its loads before it waits on
// the first (a Vec of 16-bit values is split per element at the load, which waits for it).
template <typename T, int N>
__device__ __forceinline__ Held<T, N> load_held(const T* p) {
  if constexpr (std::is_same_v<Held<T, N>, Packed<T, N>>) {
    Packed<T, N> h;
    if constexpr (N == 8) {
      const uint4 u = *reinterpret_cast<const uint4*>(p);
      h.w[0] = u.x, h.w[1] = u.y, h.w[2] = u.z, h.w[3] = u.w;
    } else if constexpr (N == 4) {
      const uint2 u = *reinterpret_cast<const uint2*>(p);
      h.w[0] = u.x, h.w[1] = u.y;
    } else {
#pragma unroll
      for (int k = 0; k < N / 2; ++k) h.w[k] = reinterpret_cast<const uint32_t*>(p)[k];
    }
    return h;
  } else {
    return load_vec<T, N>(p);
  }
}

// The first `count` (< N) of N values, the rest zero: a row's partial last vector.
template <typename T, int N>
__device__ __forceinline__ Held<T, N> load_held_partial(const T* p, int count) {
  Held<T, N> h;
  if constexpr (std::is_same_v<Held<T, N>, Packed<T, N>>) {
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {
      const uint32_t lo = 2 * k < count ? to_bits(p[2 * k]) : 0u;
      const uint32_t hi = 2 * k + 1 < count ? to_bits(p[2 * k + 1]) : 0u;
      h.w[k] = lo | (hi << 16);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) h.v[k] = k < count ? p[k] : T(0.0f);
  }
  return h;
}

// Rounds N accumulator values to T.
template <typename T, int N>
__device__ __forceinline__ Held<T, N> round_held(const acc_t<T> (&vals)[N]) {
  Held<T, N> h;
  if constexpr (std::is_same_v<Held<T, N>, Packed<T, N>>) {
#pragma unroll
    for (int k = 0; k < N / 2; ++k)
      h.w[k] = to_bits(from_acc<T>(vals[2 * k])) | (to_bits(from_acc<T>(vals[2 * k + 1])) << 16);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) h.v[k] = from_acc<T>(vals[k]);
  }
  return h;
}

// Stores held values with vector stores (16-byte PTX stores where they fill them).
template <typename T, int N>
__device__ __forceinline__ void store_held(T* p, const Held<T, N>& h) {
  if constexpr (std::is_same_v<Held<T, N>, Packed<T, N>>) {
    if constexpr (N == 8) {
      store16(p, h.w[0], h.w[1], h.w[2], h.w[3]);
    } else if constexpr (N == 4) {
      *reinterpret_cast<uint2*>(p) = make_uint2(h.w[0], h.w[1]);
    } else {
#pragma unroll
      for (int k = 0; k < N / 2; ++k) reinterpret_cast<uint32_t*>(p)[k] = h.w[k];
    }
  } else {
    store_vec<T, N>(p, h);
  }
}

// Converts VEC accumulator values to T and stores them with one vector store (16-byte pieces
// when wider).
template <typename T, int VEC>
__device__ __forceinline__ void store_from_acc(T* p, const acc_t<T> (&vals)[VEC]) {
  store_held<T, VEC>(p, round_held<T, VEC>(vals));
}

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the blockDim.x threads that share threadIdx.y (one row of a 2-D block). `scratch`
// holds blockDim.y * 32 values. Every thread of the block must call it (it may synchronise).
template <typename A>
__device__ __forceinline__ A row_sum(A v, A* scratch) {
  v = warp_sum(v);
  if (blockDim.x <= 32) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  A* mine = scratch + threadIdx.y * 32;
  __syncthreads();  // scratch may still be read from the previous call
  if (lane == 0) mine[warp] = v;
  __syncthreads();
  v = lane < warps ? mine[lane] : A(0);
  return warp_sum(v);
}

// Sums over groups of G consecutive threads (G a power of two up to 256 that divides the block;
// one group per row), K values at once. Every thread of the block must call it, and gets its
// group's totals, added in a fixed order. Groups wider than a warp go through `scratch`
// (K * blockDim.x / 32 values) and one barrier: callers that reduce again before all threads
// have read must alternate between two scratch buffers.
template <int G, int K, typename A>
__device__ __forceinline__ void group_sum(A (&v)[K], A* scratch) {
#pragma unroll
  for (int offset = (G < 32 ? G : 32) / 2; offset > 0; offset >>= 1)
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], offset);
  if constexpr (G > 32) {
    constexpr int kWarps = G / 32;
    A* mine = scratch + (threadIdx.x / G) * kWarps * K;
    if ((threadIdx.x & 31) == 0)
#pragma unroll
      for (int k = 0; k < K; ++k) mine[k * kWarps + (threadIdx.x % G) / 32] = v[k];
    __syncthreads();
#pragma unroll
    for (int k = 0; k < K; ++k) {
      A total = mine[k * kWarps];
#pragma unroll
      for (int i = 1; i < kWarps; ++i) total += mine[k * kWarps + i];
      v[k] = total;
    }
  }
}

template <int G, typename A>
__device__ __forceinline__ A group_sum(A v, A* scratch) {
  A vals[1] = {v};
  group_sum<G, 1>(vals, scratch);
  return vals[0];
}

inline cudaStream_t current_stream(int32_t device_index) {
  void* stream = nullptr;
  STD_TORCH_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream) == AOTI_TORCH_SUCCESS,
                  "fusedops: could not get the current CUDA stream");
  return static_cast<cudaStream_t>(stream);
}

inline int multiprocessor_count(int32_t device_index) {
  static int counts[64] = {};
  if (device_index < 0 || device_index >= 64) return 132;
  if (counts[device_index] == 0) {
    int v = 0;
    cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device_index);
    counts[device_index] = v > 0 ? v : 1;
  }
  return counts[device_index];
}

inline void check_launch(const char* op) {
  const cudaError_t e = cudaGetLastError();
  STD_TORCH_CHECK(e == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(e));
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace fusedops::cuda
