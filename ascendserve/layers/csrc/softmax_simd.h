// exp and the softmax numerators for AVX-512 (16 lanes at a time) and for AVX2 + FMA (8 lanes): the paged decode
// attention's (paged_decode_cpu.cpp) and the prefill attention's (prefill_attention_cpu.cpp); and SiLU-and-mul on
// AVX-512's exp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace ascendserve_simd {

// exp(x), 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial, times 2^n
// put into the exponent bits (n >= -126 after the clamp, so no denormal is formed).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float hsum256(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// s[0 .. n) = exp(s - max(s)); returns the sum (the last n % 8 scores in scalar code).
inline float softmax_numerators_avx2(float* s, int64_t n) {
  const int64_t whole = n / 8 * 8;
  float mx = std::numeric_limits<float>::lowest();
  for (int64_t t = whole; t < n; ++t) mx = std::max(mx, s[t]);
  if (whole) {
    __m256 vmax = _mm256_loadu_ps(s);
    for (int64_t t = 8; t < whole; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + t));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    mx = std::max(mx, *std::max_element(lanes, lanes + 8));
  }
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t t = 0; t < whole; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx));
    _mm256_storeu_ps(s + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum256(vsum);
  for (int64_t t = whole; t < n; ++t) sum += (s[t] = std::exp(s[t] - mx));
  return sum;
}

}  // namespace ascendserve_simd
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

namespace ascendserve_simd {

// exp(x), 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (relative
// error ~1e-7, below fp32's epsilon), times 2^n by vscalefps. Inputs are clamped to [-88, 88].
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts (Cephes)
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// silu(g) * u = g u / (1 + exp(-g)), 16 lanes: 1 / (1 + exp(-g)) by vrcp14ps and one Newton step (within an ulp or two
// of the division). SiLU-and-mul's (silu_and_mul_cpu.cpp) and the gate-and-up linear's fused form
// (bf16_linear_cpu.cpp).
inline __m512 silu_mul512(__m512 g, __m512 u) {
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(_mm512_mul_ps(g, u), _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f))));
}

// The lanes of [t, t + 16) below n, for t < n: the mask of a run's last (partial) vector.
inline __mmask16 lanes_below(int64_t n, int64_t t) {
  return n - t >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - t)) - 1);
}

// max(s[0 .. n)), n > 0.
inline float max512(const float* s, int64_t n) {
  const __m512 lowest = _mm512_set1_ps(std::numeric_limits<float>::lowest());  // not -inf: built with -ffast-math
  __m512 vmax = lowest;
  for (int64_t t = 0; t < n; t += 16)
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(lowest, lanes_below(n, t), s + t));
  return _mm512_reduce_max_ps(vmax);
}

// s[0 .. n) = exp(s - max(s)); returns the sum.
inline float softmax_numerators_avx512(float* s, int64_t n) {
  const __m512 mx = _mm512_set1_ps(max512(s, n));
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 m = lanes_below(n, t);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), mx));
    _mm512_mask_storeu_ps(s + t, m, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
  }
  return _mm512_reduce_add_ps(vsum);
}

}  // namespace ascendserve_simd
#endif
