// Neox-style (rotate-half) rotary embedding of one fp32 or bf16 tensor in one pass (layers/rotary.py on CPU; bf16
// computed in fp32 from the fp32 cos / sin and rounded once).
//
// The torch form is about six ops per tensor (two gathers of the cos / sin rows, a chunk, a negation,
// a cat, two multiplies and an add), each a dispatch and a temporary; at decode sizes (a few rows of
// 9 x 64 on the demo) their overhead is the cost. Same arithmetic: for rotary half r = R / 2 and i < r,
//   out[i]     = x[i] cos[i]     - x[i + r] sin[i]
//   out[i + r] = x[i + r] cos[i + r] + x[i] sin[i + r]
// and channels from R on are copied. x may be a strided view [T, H, D] (q / k split out of a fused
// projection) with a contiguous last dimension; the output is contiguous.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "bf16_convert.h"

namespace {

using ascendserve_bf16::from_float;
using ascendserve_bf16::to_float;

template <typename T>
void rope_rows(const at::Tensor& x, const int64_t* pos, const float* cos_ptr, const float* sin_ptr, int64_t rot,
               at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const T* x_ptr = x.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t half = rot / 2, st = x.stride(0), sh = x.stride(1);
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(1, heads * dim));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_ptr + pos[t] * rot;
      const float* s = sin_ptr + pos[t] * rot;
      for (int64_t h = 0; h < heads; ++h) {
        const T* src = x_ptr + t * st + h * sh;
        T* dst = out_ptr + (t * heads + h) * dim;
        int64_t vectorized = 0;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          // 16 pairs at a time on bf16 rows: the scalar loop's conversions kept it at ~3 cycles an element
          // (the demo's 2048 x 9 x 64 queries: 154 us, two threads)
          using namespace ascendserve_bf16;
          for (int64_t i = 0; i + 16 <= half; i += 16, vectorized = i) {
            const __m512 a = load_bf16x16(src + i), b = load_bf16x16(src + i + half);
            store_bf16x16(dst + i, _mm512_fmsub_ps(a, _mm512_loadu_ps(c + i), _mm512_mul_ps(b, _mm512_loadu_ps(s + i))));
            store_bf16x16(dst + i + half, _mm512_fmadd_ps(b, _mm512_loadu_ps(c + i + half),
                                                          _mm512_mul_ps(a, _mm512_loadu_ps(s + i + half))));
          }
        }
#endif
#pragma omp simd
        for (int64_t i = vectorized; i < half; ++i) {
          const float a = to_float(src[i]), b = to_float(src[i + half]);
          dst[i] = from_float<T>(a * c[i] - b * s[i]);
          dst[i + half] = from_float<T>(b * c[i + half] + a * s[i + half]);
        }
        for (int64_t i = rot; i < dim; ++i) dst[i] = src[i];
      }
    }
  });
}

at::Tensor rope_neox(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_cache,
                     const at::Tensor& sin_cache) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 3 &&
                  (x.size(2) <= 1 || x.stride(2) == 1),
              "rope_neox: x must be an fp32 or bf16 [T, H, D] tensor with a contiguous last dimension");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat &&
                  cos_cache.is_contiguous() && sin_cache.is_contiguous() && cos_cache.dim() == 2 &&
                  cos_cache.sizes() == sin_cache.sizes(),
              "rope_neox: cos_cache and sin_cache must be contiguous fp32 [P, R] tensors of one shape");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), rot = cos_cache.size(1);
  TORCH_CHECK(rot % 2 == 0 && rot <= dim, "rope_neox: rotary dim ", rot, " must be even and at most head_dim ", dim);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 1 &&
                  positions.size(0) == tokens,
              "rope_neox: positions must be a contiguous int64 [T] tensor");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rope_neox: position ", pos[t], " outside the cache's ", max_pos);
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  if (out.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    rope_rows<float>(x, pos, cos_cache.data_ptr<float>(), sin_cache.data_ptr<float>(), rot, out);
  } else {
    rope_rows<at::BFloat16>(x, pos, cos_cache.data_ptr<float>(), sin_cache.data_ptr<float>(), rot, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendserve_cpu, m) {
  m.def("rope_neox(Tensor x, Tensor positions, Tensor cos_cache, Tensor sin_cache) -> Tensor");
  m.impl("rope_neox", c10::DispatchKey::CPU, TORCH_FN(rope_neox));
}
