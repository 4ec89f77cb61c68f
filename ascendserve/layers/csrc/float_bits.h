// Tests on fp32 values that must survive -ffast-math (which lets the compiler assume no NaN): read on the bits.
#pragma once

#include <cstdint>
#include <cstring>

namespace ascendserve_bits {

inline bool is_nan(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

}  // namespace ascendserve_bits
