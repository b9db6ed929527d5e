// Dtype dispatch: turns a runtime ScalarType into a compile-time storage type.
#pragma once

#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include "fusedops/checks.h"

namespace fusedops {

using BFloat16 = torch::headeronly::BFloat16;
using Half = torch::headeronly::Half;

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) for the floating dtypes kernels support.
template <typename F>
decltype(auto) dispatch_float(ScalarType t, const char* op, F&& f) {
  switch (t) {
    case ScalarType::Float: return f(TypeTag<float>{});
    case ScalarType::BFloat16: return f(TypeTag<BFloat16>{});
    case ScalarType::Half: return f(TypeTag<Half>{});
    case ScalarType::Double: return f(TypeTag<double>{});
    default: fail(op, ": unsupported dtype ", dtype_name(t));
  }
}

// The weight of a norm is either in the input's dtype or, for 16-bit inputs, float32.
template <typename T, typename F>
decltype(auto) dispatch_weight(ScalarType w, F&& f) {
  if (w == ScalarType::Float) return f(TypeTag<float>{});
  return f(TypeTag<T>{});
}

}  // namespace fusedops
