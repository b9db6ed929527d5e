// Argument checks shared by every kernel. Messages name the op and the argument and use torch's
// Python spellings ("bfloat16", "[4, 8]"), so the fake kernels in Python can raise the very same
// text and one test asserts both.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

namespace fusedops {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

inline const char* dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return "float32";
    case ScalarType::Double: return "float64";
    case ScalarType::Half: return "float16";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Long: return "int64";
    case ScalarType::Int: return "int32";
    case ScalarType::Short: return "int16";
    case ScalarType::Char: return "int8";
    case ScalarType::Byte: return "uint8";
    case ScalarType::Bool: return "bool";
    case ScalarType::ComplexFloat: return "complex64";
    case ScalarType::ComplexDouble: return "complex128";
    case ScalarType::ComplexHalf: return "complex32";
    case ScalarType::UInt16: return "uint16";
    case ScalarType::UInt32: return "uint32";
    case ScalarType::UInt64: return "uint64";
    case ScalarType::Float8_e5m2: return "float8_e5m2";
    case ScalarType::Float8_e4m3fn: return "float8_e4m3fn";
    case ScalarType::Float8_e5m2fnuz: return "float8_e5m2fnuz";
    case ScalarType::Float8_e4m3fnuz: return "float8_e4m3fnuz";
    case ScalarType::Float8_e8m0fnu: return "float8_e8m0fnu";
    case ScalarType::Float4_e2m1fn_x2: return "float4_e2m1fn_x2";
    default: return "an unsupported dtype";  // (quantized and sub-byte dtypes)
  }
}

inline std::string shape_str(const Tensor& t) {
  std::ostringstream s;
  s << "[";
  for (int64_t d = 0; d < t.dim(); ++d) s << (d ? ", " : "") << t.size(d);
  s << "]";
  return s.str();
}

inline std::string device_str(const Tensor& t) {
  if (t.is_cpu()) return "cpu";
  std::ostringstream s;
  s << (t.is_cuda() ? "cuda:" : "device:") << static_cast<int>(t.get_device_index());
  return s.str();
}

// Builds the message only when the check fails.
template <typename... Args>
[[noreturn]] inline void fail(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  throw std::invalid_argument(s.str());
}

// torch.ops hands a kernel None, passed for a required Tensor, as an undefined tensor, which
// cannot even tell its dtype: name the argument before anything asks.
inline void check_given(const char* op, const char* name, const Tensor& t) {
  if (!t.defined()) fail(op, ": ", name, " must be a Tensor, got None");
}

#define FUSEDOPS_CHECK(cond, ...) \
  do {                            \
    if (!(cond)) ::fusedops::fail(__VA_ARGS__); \
  } while (0)

inline bool is_float_dtype(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::BFloat16 || t == ScalarType::Half ||
         t == ScalarType::Double;
}

// The dtype kernels accumulate in: float64 for float64, float32 for everything narrower.
inline ScalarType acc_dtype(ScalarType t) {
  return t == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
}

}  // namespace fusedops
