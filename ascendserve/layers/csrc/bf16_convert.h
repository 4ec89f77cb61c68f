// fp32 <-> bf16 for the elementwise ops that take either (rms_norm_cpu.cpp, silu_and_mul_cpu.cpp, rope_cpu.cpp), as
// plain integer operations the compiler vectorizes: c10::BFloat16's conversions kept the loops scalar (SiLU-and-mul
// over a 2048 x 1536 bf16 prefill: 6.5 ms, against about 1 ms in fp32); and widen16, 16 values at a time for the
// AVX-512 kernels.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ascendserve_bf16 {

// The element as fp32: exact for bf16 (its bits are the top half of the fp32 word).
inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// fp32 to T: as it is for float; for bf16 rounded to nearest, ties to even (c10::BFloat16's rounding), NaN kept NaN.
template <typename T>
inline T from_float(float f);

template <>
inline float from_float<float>(float f) {
  return f;
}

template <>
inline at::BFloat16 from_float<at::BFloat16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return at::BFloat16(static_cast<uint16_t>(nan ? 0x7fc0u : rounded), at::BFloat16::from_bits());
}

#if defined(__AVX512F__)
// 16 bf16 values (their bits) as fp32, exact: each moved to the top half of its 32-bit lane.
inline __m512 widen16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 16 bf16 values widened to fp32 (exact), and 16 fp32 values rounded to bf16 to nearest even, NaN to 0x7fc0 (what
// from_float does; vcvtneps2bf16 where the CPU has AVX512-BF16, which keeps a NaN's sign and payload).
inline __m512 load_bf16x16(const at::BFloat16* p) {
  return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store_bf16x16(at::BFloat16* p, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
#endif
}
#endif

}  // namespace ascendserve_bf16
