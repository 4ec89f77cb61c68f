// The decode layers of a bf16 Llama-family model (models/llama_cpu_decode.py) in one op: per layer the norm, the
// qkv projection, per-head q / k norms (Qwen3), rotary, the paged decode attention with its KV store, the output
// projection, the norm, the fused gate-and-up + SiLU and the down projection, then the final norm. Each is the
// registered op the modules call, called here through the dispatcher (its own checks, the same kernel, the same
// bits), so a step makes one call from Python instead of ~10 a layer.
//
// weights: per layer, in order, the input norm's weight, qkv's panels, qkv's fp32 bias where has_bias, o_proj's
// panels, the post-attention norm's weight, gate-and-up's panels, down's panels, and where qk_norm q_norm's and
// k_norm's weights; then the final norm's weight. dims: heads, kv_heads, head_dim, qkv outputs, o_proj outputs,
// gate-and-up outputs (after SiLU-and-mul), down outputs, has_bias, qk_norm.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace {

using OptTensor = std::optional<at::Tensor>;

// The signatures the registered ops' schemas give (Tensor? -> optional, float -> double, Tensor(a!) -> Tensor&).
using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&, bool);
using SiluMul = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double, bool);
using AddNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                                   bool);
using Rope = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using Attend = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, double);

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

struct Ops {
  c10::TypedOperatorHandle<Linear> linear = op<Linear>("ascendserve_cpu::bf16_linear_bf16x");
  c10::TypedOperatorHandle<SiluMul> silu_mul = op<SiluMul>("ascendserve_cpu::bf16_linear_silu_mul");
  c10::TypedOperatorHandle<Norm> norm = op<Norm>("ascendserve_cpu::rms_norm");
  c10::TypedOperatorHandle<AddNorm> add_norm = op<AddNorm>("ascendserve_cpu::add_rms_norm");
  c10::TypedOperatorHandle<Rope> rope = op<Rope>("ascendserve_cpu::rope_neox");
  c10::TypedOperatorHandle<Attend> attend = op<Attend>("ascendserve_cpu::paged_decode_write");
};

at::Tensor llama_decode_layers(const at::Tensor& embedded, const at::Tensor& positions, at::TensorList weights,
                               at::TensorList kv_caches, const at::Tensor& slots, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, const at::Tensor& cos_cache,
                               const at::Tensor& sin_cache, at::IntArrayRef dims, double eps, double scale) {
  static const Ops ops;
  TORCH_CHECK(dims.size() == 9, "llama_decode_layers: dims must hold 9 values, got ", dims.size());
  const int64_t heads = dims[0], kv_heads = dims[1], head_dim = dims[2], qkv_n = dims[3], o_n = dims[4];
  const int64_t gate_up_n = dims[5], down_n = dims[6];
  const bool has_bias = dims[7] != 0, qk_norm = dims[8] != 0;
  const int64_t per_layer = 6 + (has_bias ? 1 : 0) + (qk_norm ? 2 : 0);
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * per_layer + 1, "llama_decode_layers: ",
              layers * per_layer + 1, " weights expected for ", layers, " layers, got ", weights.size());
  TORCH_CHECK(embedded.dim() == 2 && qkv_n == (heads + 2 * kv_heads) * head_dim,
              "llama_decode_layers: hidden [T, H] and qkv outputs (heads + 2 kv_heads) x head_dim expected");
  const int64_t rows = embedded.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  at::Tensor hidden = embedded, residual;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * per_layer;
    const at::Tensor &norm_in = w[0], &qkv = w[1];
    const OptTensor bias = has_bias ? OptTensor(w[2]) : std::nullopt;
    w += has_bias ? 3 : 2;
    const at::Tensor &o_proj = w[0], &norm_post = w[1], &gate_up = w[2], &down = w[3];
    if (l == 0) {
      residual = hidden;
      hidden = ops.norm.call(hidden, norm_in, eps, false);
    } else {
      std::tie(hidden, residual) = ops.add_norm.call(hidden, residual, norm_in, eps, false);
    }
    const at::Tensor qkv_out = ops.linear.call(hidden, qkv, qkv_n, bias, true);
    at::Tensor q = qkv_out.narrow(1, 0, q_size).view({rows, heads, head_dim});
    at::Tensor k = qkv_out.narrow(1, q_size, kv_size).view({rows, kv_heads, head_dim});
    const at::Tensor v = qkv_out.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, head_dim});
    if (qk_norm) {
      q = ops.norm.call(q, w[4], eps, false);
      k = ops.norm.call(k, w[5], eps, false);
    }
    q = ops.rope.call(q, positions, cos_cache, sin_cache);
    k = ops.rope.call(k, positions, cos_cache, sin_cache);
    at::Tensor kv_cache = kv_caches[l];
    const at::Tensor out = ops.attend.call(q, k, v, kv_cache, slots, block_tables, context_lens, scale);
    hidden = ops.linear.call(out.view({rows, q_size}), o_proj, o_n, std::nullopt, true);
    std::tie(hidden, residual) = ops.add_norm.call(hidden, residual, norm_post, eps, false);
    hidden = ops.linear.call(ops.silu_mul.call(hidden, gate_up, gate_up_n), down, down_n, std::nullopt, true);
  }
  const at::Tensor& norm_final = weights[weights.size() - 1];
  if (layers == 0) return ops.norm.call(hidden, norm_final, eps, false);
  return std::get<0>(ops.add_norm.call(hidden, residual, norm_final, eps, false));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendserve_cpu, m) {
  m.def("llama_decode_layers(Tensor hidden, Tensor positions, Tensor[] weights, Tensor(a!)[] kv_caches, Tensor slots, "
        "Tensor block_tables, Tensor context_lens, Tensor cos_cache, Tensor sin_cache, int[] dims, float eps, "
        "float scale) -> Tensor");
  m.impl("llama_decode_layers", c10::DispatchKey::CPU, TORCH_FN(llama_decode_layers));
}
