// Scalar conversions between storage dtypes and the float accumulation type, written so that
// loops over them auto-vectorise (bit operations rather than branches).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fusedops/dispatch.h"

namespace fusedops::cpu {

template <typename T>
struct Acc { using type = float; };
template <>
struct Acc<double> { using type = double; };
template <typename T>
using acc_t = typename Acc<T>::type;

inline float to_acc(float v) { return v; }
inline double to_acc(double v) { return v; }
inline float to_acc(Half v) { return static_cast<float>(v); }
inline float to_acc(BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T from_acc(acc_t<T> v);
template <>
inline float from_acc<float>(float v) { return v; }
template <>
inline double from_acc<double>(double v) { return v; }
template <>
inline Half from_acc<Half>(float v) { return Half(v); }
template <>
inline BFloat16 from_acc<BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  // Round to nearest even; NaN stays a (quiet) NaN.
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  BFloat16 out;
  out.x = static_cast<uint16_t>(v != v ? 0x7fc0u : rounded);
  return out;
}

}  // namespace fusedops::cpu
