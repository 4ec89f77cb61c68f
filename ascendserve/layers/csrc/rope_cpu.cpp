// Neox-style (rotate-half) rotary embedding of one fp32 tensor in one pass (layers/rotary.py on CPU).
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

namespace {

at::Tensor rope_neox(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_cache,
                     const at::Tensor& sin_cache) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && (x.size(2) <= 1 || x.stride(2) == 1),
              "rope_neox: x must be an fp32 [T, H, D] tensor with a contiguous last dimension");
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
  const float *x_ptr = x.data_ptr<float>(), *cos_ptr = cos_cache.data_ptr<float>(),
              *sin_ptr = sin_cache.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t half = rot / 2, st = x.stride(0), sh = x.stride(1);
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(1, heads * dim));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_ptr + pos[t] * rot;
      const float* s = sin_ptr + pos[t] * rot;
      for (int64_t h = 0; h < heads; ++h) {
        const float* src = x_ptr + t * st + h * sh;
        float* dst = out_ptr + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          dst[i] = src[i] * c[i] - src[i + half] * s[i];
          dst[i + half] = src[i + half] * c[i + half] + src[i] * s[i + half];
        }
        for (int64_t i = rot; i < dim; ++i) dst[i] = src[i];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendserve_cpu, m) {
  m.def("rope_neox(Tensor x, Tensor positions, Tensor cos_cache, Tensor sin_cache) -> Tensor");
  m.impl("rope_neox", c10::DispatchKey::CPU, TORCH_FN(rope_neox));
}
