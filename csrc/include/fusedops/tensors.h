// Allocation and layout helpers on torch::stable::Tensor used by every kernel's host code.
#pragma once

#include <cstdint>
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

}  // namespace fusedops
