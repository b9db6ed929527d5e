// Addressing the rows of a tensor that is reduced over its last dimension.
//
// Kernels take the leading ("row") dimensions with their strides rather than asking for a
// contiguous input: x[:, :n] of a wider buffer, a transposed batch/sequence pair or a sliced
// batch all run without a copy. The leading dimensions are first collapsed (dimensions of size
// 1 dropped, neighbours that are contiguous with each other merged), so the common cases reach
// the kernel as a single row stride.
#pragma once

#include <cstdint>

#include <torch/csrc/stable/tensor.h>

#if defined(__CUDACC__)
#define FUSEDOPS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FUSEDOPS_HOST_DEVICE inline
#endif

namespace fusedops {

struct RowLayout {
  // Beyond this many leading dimensions (after collapsing) the caller makes a contiguous copy.
  static constexpr int kMaxDims = 4;
  int ndim = 0;  // 0: a single row
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};

  // Element offset of row `row` (row-major over the leading dimensions).
  FUSEDOPS_HOST_DEVICE int64_t offset(int64_t row) const {
    if (ndim == 1) return row * strides[0];
    int64_t off = 0;
    // Unrolled with constant indices so that on the GPU the arrays stay in registers.
#if defined(__CUDACC__)
#pragma unroll
#endif
    for (int d = kMaxDims - 1; d >= 0; --d) {
      if (d < ndim) {
        off += (row % sizes[d]) * strides[d];
        row /= sizes[d];
      }
    }
    return off;
  }
};

// Collapses the leading dimensions of `t`. Returns false when more than kMaxDims remain.
inline bool collapse_rows(const torch::stable::Tensor& t, RowLayout& out) {
  out = RowLayout{};
  int n = 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    const int64_t size = t.size(d);
    if (size == 0) {  // no rows: a tensor of any rank (torch allows more than 64 empty dimensions)
      out = RowLayout{};
      out.ndim = 1;
      out.strides[0] = 1;
      return true;
    }
    if (size == 1) continue;
    if (n > 0 && out.strides[n - 1] == t.stride(d) * size) {
      out.sizes[n - 1] *= size;  // the previous dimension steps over whole blocks of this one
      out.strides[n - 1] = t.stride(d);
    } else {
      // (a dimension once kept is never merged away, so one past the limit decides)
      if (n == RowLayout::kMaxDims) {
        out = RowLayout{};
        return false;
      }
      out.sizes[n] = size;
      out.strides[n] = t.stride(d);
      ++n;
    }
  }
  out.ndim = n;
  return true;
}

}  // namespace fusedops
