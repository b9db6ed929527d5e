// The CPU kernels' scalar conversions (fusedops/cpu_convert.h) give exactly c10's values: every
// fp16 value to float, and floats to fp16 and bf16 (bf16's rounding is the library's own
// bit-level code) over every sign, exponent and high mantissa with the low bits at the rounding
// boundaries, plus every float near an fp16 halfway point (ties, the largest finite values, the
// subnormal range, inf and NaN). Bit-exact, NaN payloads included.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "fusedops/cpu_convert.h"

namespace {

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}
float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

int failures = 0;
void fail(const char* what, uint32_t in, uint32_t got, uint32_t want) {
  if (++failures <= 20) std::printf("%s: input 0x%08x gave 0x%08x, c10 gives 0x%08x\n", what, in, got, want);
}

void check_float(float f) {
  const uint16_t h_got = fusedops::cpu::from_acc<fusedops::Half>(f).x;
  const uint16_t h_want = c10::Half(f).x;
  if (h_got != h_want) fail("float->fp16", bits_of(f), h_got, h_want);
  const uint16_t b_got = fusedops::cpu::from_acc<fusedops::BFloat16>(f).x;
  const uint16_t b_want = c10::BFloat16(f).x;
  if (b_got != b_want) fail("float->bf16", bits_of(f), b_got, b_want);
}

}  // namespace

int main() {
  for (uint32_t h = 0; h < 65536; ++h) {
    fusedops::Half v;
    v.x = static_cast<uint16_t>(h);
    const float got = fusedops::cpu::to_acc(v), want = static_cast<float>(c10::Half(static_cast<uint16_t>(h), c10::Half::from_bits()));
    if (bits_of(got) != bits_of(want)) fail("fp16->float", h, bits_of(got), bits_of(want));  // NaN payloads too
  }
  // Every float whose low 9 mantissa bits are one of a few patterns (0, the fp16 and bf16 halfway
  // points and their neighbours, all ones), for every sign, exponent and high mantissa: 2^23 x 12.
  const uint32_t lows[] = {0x000, 0x001, 0x0ff, 0x100, 0x101, 0x1ff};
  for (uint32_t high = 0; high < (1u << 23); ++high) {
    for (uint32_t low : lows) {
      const uint32_t b = (high << 9) | low;
      check_float(float_of(b));
      check_float(float_of(b | 0x80000000u));
    }
  }
  // The fp16 rounding boundaries: every float within 2 ulp of a half's halfway point.
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    fusedops::Half lo, hi;
    lo.x = static_cast<uint16_t>(h);
    hi.x = static_cast<uint16_t>(h + 1);
    const float mid = 0.5f * (fusedops::cpu::to_acc(lo) + fusedops::cpu::to_acc(hi));
    for (int d = -2; d <= 2; ++d) check_float(float_of(bits_of(mid) + d));
  }
  std::printf("convert_test: %d mismatches\n", failures);
  return failures == 0 ? 0 : 1;
}
