// RMSNorm of fp32 or bf16 rows in one pass per row: y = x * rsqrt(mean(x^2) + eps) * (w, or 1 + w
// with unit_offset: Qwen3.5's zero-centred weight), in fp32 and rounded once to x's dtype (a model
// run in bf16). The same arithmetic as layers/norm.py's torch ops (the
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

#include "bf16_convert.h"

namespace {

using ascendserve_bf16::from_float;
using ascendserve_bf16::to_float;

// weight (fp32, or bf16 in a bf16 model) as a contiguous fp32 [hidden] tensor.
at::Tensor fp32_weight(const at::Tensor& weight, int64_t hidden, const char* op) {
  TORCH_CHECK((weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16) && weight.dim() == 1 &&
                  weight.size(0) == hidden,
              op, ": weight must be an fp32 or bf16 [", hidden, "] tensor, got ", weight.sizes());
  return weight.to(at::kFloat).contiguous();
}

bool fp32_or_bf16(const at::Tensor& x) { return x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16; }

template <typename T>
void rms_norm_rows(const at::Tensor& x, const float* w_ptr, double eps, bool unit_offset, at::Tensor& out) {
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  const T* x_ptr = x.data_ptr<T>();
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
  T* out_ptr = out.data_ptr<T>();
  const float offset = unit_offset ? 1.f : 0.f, epsf = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / hidden);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = x_ptr + row_offset(r);
      T* dst = out_ptr + r * hidden;
      float squares = 0.f;
      for (int64_t i = 0; i < hidden; ++i) squares += to_float(src[i]) * to_float(src[i]);
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(hidden) + epsf);
      for (int64_t i = 0; i < hidden; ++i)
        dst[i] = from_float<T>(to_float(src[i]) * scale * (w_ptr[i] + offset));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  TORCH_CHECK(fp32_or_bf16(x) && x.dim() >= 1 && x.dim() <= 4 && (x.size(-1) <= 1 || x.stride(-1) == 1),
              "rms_norm: x must be an fp32 or bf16 tensor of 1 to 4 dimensions, the last one contiguous");
  const int64_t hidden = x.size(-1);
  const at::Tensor w = fp32_weight(weight, hidden, "rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (hidden == 0 || x.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(x, w.data_ptr<float>(), eps, unit_offset, out);
  } else {
    rms_norm_rows<at::BFloat16>(x, w.data_ptr<float>(), eps, unit_offset, out);
  }
  return out;
}

// The sum x + residual in T (rounded to bf16 in a bf16 model, as the model's own add would), then its norm.
template <typename T>
void add_rms_norm_rows(const T* x_ptr, const T* r_ptr, const float* w_ptr, int64_t rows, int64_t hidden, double eps,
                       bool unit_offset, T* out_ptr, T* sum_ptr) {
  const float offset = unit_offset ? 1.f : 0.f, epsf = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(hidden, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* s = sum_ptr + r * hidden;
      for (int64_t i = 0; i < hidden; ++i)
        s[i] = from_float<T>(to_float(x_ptr[r * hidden + i]) + to_float(r_ptr[r * hidden + i]));
      float squares = 0.f;
      for (int64_t i = 0; i < hidden; ++i) squares += to_float(s[i]) * to_float(s[i]);
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(hidden) + epsf);
      T* dst = out_ptr + r * hidden;
      for (int64_t i = 0; i < hidden; ++i)
        dst[i] = from_float<T>(to_float(s[i]) * scale * (w_ptr[i] + offset));
    }
  });
}

// (rms_norm(x + residual), x + residual) for contiguous fp32 or bf16 [T, H] x and residual: a pre-norm layer's
// residual add and the next norm in one pass per row (the sum is written once and normalized from cache).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, bool unit_offset) {
  TORCH_CHECK(fp32_or_bf16(x) && residual.scalar_type() == x.scalar_type() && x.dim() == 2 &&
                  x.sizes() == residual.sizes() && x.is_contiguous() && residual.is_contiguous(),
              "add_rms_norm: x and residual must be contiguous fp32 or bf16 [T, H] tensors of one shape and dtype");
  const int64_t hidden = x.size(1), rows = x.size(0);
  const at::Tensor w = fp32_weight(weight, hidden, "add_rms_norm");
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_rows<float>(x.data_ptr<float>(), residual.data_ptr<float>(), w.data_ptr<float>(), rows, hidden, eps,
                             unit_offset, out.data_ptr<float>(), sum.data_ptr<float>());
  } else {
    add_rms_norm_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), residual.data_ptr<at::BFloat16>(), w.data_ptr<float>(),
                                    rows, hidden, eps, unit_offset, out.data_ptr<at::BFloat16>(),
                                    sum.data_ptr<at::BFloat16>());
  }
  return {out, sum};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool unit_offset) -> (Tensor, Tensor)");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
}
