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

}  // namespace fusedops
