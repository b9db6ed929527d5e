// Allocation and layout helpers on torch::stable::Tensor used by every kernel's host code.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

namespace fusedops {

// A new contiguous tensor on `like`'s device. Calls the C shim's allocator directly: the boxed
// dispatcher call behind torch::stable::new_empty costs microseconds, which small inputs feel.
inline torch::stable::Tensor empty_like_device(const torch::stable::Tensor& like, const std::vector<int64_t>& sizes,
                                               torch::headeronly::ScalarType dtype) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= sizes[d] > 1 ? sizes[d] : 1;
  }
  int32_t device_type = 0, device_index = 0;
  AtenTensorHandle handle = nullptr;
  STD_TORCH_CHECK(aoti_torch_get_device_type(like.get(), &device_type) == AOTI_TORCH_SUCCESS &&
                      aoti_torch_get_device_index(like.get(), &device_index) == AOTI_TORCH_SUCCESS &&
                      aoti_torch_empty_strided(int64_t(sizes.size()), sizes.data(), strides.data(),
                                               static_cast<int32_t>(dtype), device_type, device_index,
                                               &handle) == AOTI_TORCH_SUCCESS,
                  "fusedops: tensor allocation failed");
  return torch::stable::Tensor(handle);
}

// `t` itself when already contiguous (no dispatcher call), else a contiguous copy.
inline torch::stable::Tensor as_contiguous(const torch::stable::Tensor& t) {
  return t.is_contiguous() ? t : torch::stable::contiguous(t);
}

// Whether elements of t may share memory (an expanded view): sorted by stride, each dimension of
// size > 1 must step over everything inside it. An in-place write into such a tensor would race.
inline bool may_overlap(const torch::stable::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) dims.push_back({t.stride(d), t.size(d)});
  std::sort(dims.begin(), dims.end());
  int64_t extent = 1;
  for (auto [stride, size] : dims) {
    if (stride < extent) return true;
    extent += stride * (size - 1);
  }
  return false;
}

// c10's is_non_overlapping_and_dense, which torch.empty_like and the fake kernels use too.
inline bool non_overlapping_and_dense(const torch::stable::Tensor& t) {
  const int64_t n = t.dim();
  if (n == 1) return t.size(0) < 2 || t.stride(0) == 1;
  std::vector<int64_t> perm(n);
  for (int64_t d = 0; d < n; ++d) perm[d] = d;
  std::sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) {
    if (t.size(a) < 2) return false;
    if (t.size(b) < 2) return true;
    return t.stride(a) < t.stride(b);
  });
  int64_t required = 1;
  for (int64_t d : perm) {
    const int64_t size = t.size(d);
    if (size < 2) return true;
    if (t.stride(d) != required) return false;
    required *= size;
  }
  return true;
}

// How the memory of two tensors that a kernel reads and writes in place relates.
enum class Overlap {
  kNone,     // none, or not decidable (as torch: a tensor that is not dense)
  kSame,     // the same elements in the same layout (one tensor passed twice)
  kPartial,  // some elements shared otherwise
};

// Decided as torch decides it for in-place ops: a partial overlap only between tensors that are
// non-overlapping and dense, whose spans of bytes then intersect; views that interleave (two
// column halves of one buffer) are not dense, and pass.
inline Overlap overlap(const torch::stable::Tensor& a, const torch::stable::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return Overlap::kNone;
  const auto begin = [](const torch::stable::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()); };
  if (begin(a) == begin(b) && a.scalar_type() == b.scalar_type() && a.dim() == b.dim()) {
    bool same = true;
    for (int64_t d = 0; d < a.dim() && same; ++d) same = a.size(d) == b.size(d) && a.stride(d) == b.stride(d);
    if (same) return Overlap::kSame;
  }
  if (!non_overlapping_and_dense(a) || !non_overlapping_and_dense(b)) return Overlap::kNone;
  // Dense: the elements fill numel() slots from the first one.
  const auto end = [&](const torch::stable::Tensor& t) { return begin(t) + uintptr_t(t.numel() * t.element_size()); };
  return begin(a) < end(b) && begin(b) < end(a) ? Overlap::kPartial : Overlap::kNone;
}

}  // namespace fusedops
