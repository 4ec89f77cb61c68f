// RMSNorm of fp32 rows in one pass per row: y = x * rsqrt(mean(x^2) + eps) * (w, or 1 + w with
// unit_offset: Qwen3.5's zero-centred weight). The same arithmetic as layers/norm.py's torch ops (the
// mean summed in another order), without their six passes and temporaries per call, which at decode
// (one row of 1024 per norm, 61 norms a step on the Qwen3.5 shape) cost more than the work.
// x may be a strided view (q / k heads split out of a fused projection): only its last dimension must
// be contiguous; the output is contiguous.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.dim() <= 4 && (x.size(-1) <= 1 || x.stride(-1) == 1),
              "rms_norm: x must be an fp32 tensor of 1 to 4 dimensions, the last one contiguous");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 1 &&
                  weight.size(0) == hidden,
              "rms_norm: weight must be a contiguous fp32 [", hidden, "] tensor, got ", weight.sizes());
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t rows = hidden ? x.numel() / hidden : 0;
  if (rows == 0) return out;
  const float* x_ptr = x.data_ptr<float>();
  // Row r's offset in x: r split over the leading dimensions (innermost first), times their strides.
  const int64_t lead = x.dim() - 1;
  const auto sizes = x.sizes(), strides = x.strides();
  auto row_offset = [&](int64_t r) {
    int64_t offset = 0;
    for (int64_t d = lead - 1; d >= 0; --d) {
      offset += (r % sizes[d]) * strides[d];
      r /= sizes[d];
    }
    return offset;
  };
  const float* w_ptr = weight.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const float offset = unit_offset ? 1.f : 0.f, epsf = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / hidden);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* src = x_ptr + row_offset(r);
      float* dst = out_ptr + r * hidden;
      float squares = 0.f;
      for (int64_t i = 0; i < hidden; ++i) squares += src[i] * src[i];
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(hidden) + epsf);
      for (int64_t i = 0; i < hidden; ++i) dst[i] = src[i] * scale * (w_ptr[i] + offset);
    }
  });
  return out;
}

// (rms_norm(x + residual), x + residual) for contiguous fp32 [T, H] x and residual: a pre-norm layer's
// residual add and the next norm in one pass per row (the sum is written once and normalized from cache).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, bool unit_offset) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && residual.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.sizes() == residual.sizes() && x.is_contiguous() && residual.is_contiguous(),
              "add_rms_norm: x and residual must be contiguous fp32 [T, H] tensors of one shape");
  const int64_t hidden = x.size(1), rows = x.size(0);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 1 &&
                  weight.size(0) == hidden,
              "add_rms_norm: weight must be a contiguous fp32 [", hidden, "] tensor, got ", weight.sizes());
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  const float *x_ptr = x.data_ptr<float>(), *r_ptr = residual.data_ptr<float>(), *w_ptr = weight.data_ptr<float>();
  float *out_ptr = out.data_ptr<float>(), *sum_ptr = sum.data_ptr<float>();
  const float offset = unit_offset ? 1.f : 0.f, epsf = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(hidden, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* s = sum_ptr + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) s[i] = x_ptr[r * hidden + i] + r_ptr[r * hidden + i];
      float squares = 0.f;
      for (int64_t i = 0; i < hidden; ++i) squares += s[i] * s[i];
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(hidden) + epsf);
      float* dst = out_ptr + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) dst[i] = s[i] * scale * (w_ptr[i] + offset);
    }
  });
  return {out, sum};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool unit_offset) -> (Tensor, Tensor)");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
}
