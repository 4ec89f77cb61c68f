// What the two Gated DeltaNet ops share (gdn_decode_cpu.cpp, gdn_prefill_cpu.cpp): the layer's sizes and
// the checks of the arguments both take, and the per-element math of transformers' layer.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

#include "bf16_convert.h"
#include "softmax_simd.h"

namespace ascendserve_gdn {

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's threshold 20

// dst = src * rsqrt(sum(src^2) + 1e-6) * scale (transformers' l2norm, then q's scale)
inline void l2norm_into(const float* src, int64_t n, float scale, float* dst) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += src[i] * src[i];
  const float f = scale / std::sqrt(ss + 1e-6f);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * f;
}

// o = o * rsqrt(mean(o^2) + eps) * weight * silu(z) over one head's n values (Qwen3_5RMSNormGated); on AVX-512 the
// SiLU is silu_mul512's (libmvec's 8-lane expf was ~1/8 of the prefill op at Qwen3.5's shape).
inline void gated_rms_norm(float* o, const float* z, const float* weight, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; ++j) ss += o[j] * o[j];
  const float inv_rms = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#if defined(__AVX512F__)
  using namespace ascendserve_simd;
  const __m512 f = _mm512_set1_ps(inv_rms);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes_below(n, j);
    const __m512 scaled = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, o + j), f),
                                        _mm512_maskz_loadu_ps(m, weight + j));
    _mm512_mask_storeu_ps(o + j, m, silu_mul512(_mm512_maskz_loadu_ps(m, z + j), scaled));
  }
#else
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) o[j] = o[j] * inv_rms * weight[j] * silu(z[j]);
#endif
}

// out[i] = silu(sum_j rows[j][c] * taps[j * ld + c]) at c = c0 + i, i < n: one token's causal conv over a run of
// channels, rows [width] the window's input rows (oldest first) and taps [width][ld] the weights transposed.
inline void conv_silu(const float* const* rows, int64_t width, const float* taps, int64_t ld, int64_t c0, int64_t n,
                      float* out) {
  taps += c0;
#if defined(__AVX512F__)
  using namespace ascendserve_simd;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes_below(n, i);
    __m512 acc = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, rows[0] + c0 + i), _mm512_maskz_loadu_ps(m, taps + i));
    for (int64_t j = 1; j < width; ++j)
      acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, rows[j] + c0 + i), _mm512_maskz_loadu_ps(m, taps + j * ld + i),
                            acc);
    _mm512_mask_storeu_ps(out + i, m, silu_mul512(acc, _mm512_set1_ps(1.f)));
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    float acc = 0.f;
    for (int64_t j = 0; j < width; ++j) acc += rows[j][c0 + i] * taps[j * ld + i];
    out[i] = silu(acc);
  }
#endif
}

struct Dims {
  int64_t hk, hv, dk, dv, key_dim, value_dim, channels, width;  // channels: the conv's, 2*Hk*dk + Hv*dv
};

// The layer's sizes from the pools and the conv weight, after checking every argument both ops take: fp32
// throughout but for the recurrent-state pool (fp32 or bf16), qkvz [rows, C + Hv*dv] and ba [rows, 2*Hv] with
// contiguous columns, contiguous conv weight [C, K] and pools [S, C, K-1] / [S, Hv, dk, dv], slots [B] int64 within
// the pool.
inline Dims checked_dims(const char* op, const at::Tensor& qkvz, const at::Tensor& ba, const at::Tensor& conv_weight,
                         const at::Tensor& conv_states, const at::Tensor& ssm_states, const at::Tensor& slots,
                         const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                         int64_t num_k_heads, bool bf16_projections = false) {
  for (const at::Tensor* t : {&conv_weight, &conv_states, &A_log, &dt_bias, &norm_weight})
    TORCH_CHECK(t->scalar_type() == at::kFloat, op, ": fp32 tensors expected");
  if (bf16_projections) {
    TORCH_CHECK((qkvz.scalar_type() == at::kFloat || qkvz.scalar_type() == at::kBFloat16) &&
                    ba.scalar_type() == qkvz.scalar_type(), op, ": qkvz and ba must be both fp32 or both bf16");
  } else {
    TORCH_CHECK(qkvz.scalar_type() == at::kFloat && ba.scalar_type() == at::kFloat, op, ": fp32 tensors expected");
  }
  TORCH_CHECK(ssm_states.scalar_type() == at::kFloat || ssm_states.scalar_type() == at::kBFloat16, op,
              ": the recurrent-state pool must be fp32 or bf16");
  TORCH_CHECK(ssm_states.is_contiguous() && ssm_states.dim() == 4, op, ": contiguous pools [S, C, K-1] and "
              "[S, Hv, dk, dv] expected");
  TORCH_CHECK(conv_weight.is_contiguous() && conv_weight.dim() == 2, op, ": conv_weight [C, K] contiguous expected");
  Dims d{num_k_heads, ssm_states.size(1), ssm_states.size(2), ssm_states.size(3), 0, 0, 0, conv_weight.size(1)};
  TORCH_CHECK(num_k_heads > 0 && d.hv % num_k_heads == 0, op, ": Hv must be a multiple of Hk");
  d.key_dim = d.hk * d.dk;
  d.value_dim = d.hv * d.dv;
  d.channels = 2 * d.key_dim + d.value_dim;
  const int64_t rows = qkvz.size(0);
  TORCH_CHECK(qkvz.dim() == 2 && qkvz.stride(1) == 1 && qkvz.size(1) == d.channels + d.value_dim, op,
              ": qkvz [rows, 2*Hk*dk + 2*Hv*dv] with contiguous columns expected");
  TORCH_CHECK(ba.dim() == 2 && ba.stride(1) == 1 && ba.size(0) == rows && ba.size(1) == 2 * d.hv, op,
              ": ba [rows, 2*Hv] with contiguous columns expected");
  TORCH_CHECK(conv_weight.size(0) == d.channels, op, ": conv_weight [C, K] contiguous expected");
  TORCH_CHECK(conv_states.is_contiguous() && conv_states.dim() == 3 && conv_states.size(1) == d.channels &&
              conv_states.size(2) == d.width - 1 && conv_states.size(0) == ssm_states.size(0), op,
              ": contiguous pools [S, C, K-1] and [S, Hv, dk, dv] expected");
  TORCH_CHECK(A_log.numel() == d.hv && dt_bias.numel() == d.hv && norm_weight.numel() == d.dv &&
              A_log.is_contiguous() && dt_bias.is_contiguous() && norm_weight.is_contiguous(), op,
              ": A_log, dt_bias [Hv] and norm_weight [dv] expected");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1, op,
              ": slots [B] int64 expected");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < slots.numel(); ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < ssm_states.size(0), op, ": slot ", slot[b], " out of range");
  return d;
}

}  // namespace ascendserve_gdn
