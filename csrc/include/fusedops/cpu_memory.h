// Memory helpers of the CPU kernels.
#pragma once

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <torch/csrc/stable/tensor.h>

namespace fusedops::cpu {

// Asks the kernel for transparent huge pages under a new output before the kernels first touch
// it. A large CPU tensor is a fresh mmap on every call (the allocator hands it back to the
// system when it is freed), and on a machine whose THP setting is "madvise" (a common default)
// faulting it in 4 KiB pages costs more than the computation: measured on the development VM,
// writing a new 235 MB tensor took 205 ms with 4 KiB pages and 92 ms with this advice (67 ms
// for the same writes into memory already mapped). Only the 2 MiB-aligned interior of the
// buffer is advised, which the kernels overwrite entirely; the advice ends with the mapping.
// Without THP, or elsewhere, nothing happens (the call's result is ignored: it is advice).
inline void advise_huge_pages(const torch::stable::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  const int64_t bytes = t.numel() * int64_t(t.element_size());
  if (bytes < int64_t(8 * kHuge)) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (begin + uintptr_t(bytes)) & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
}

}  // namespace fusedops::cpu
