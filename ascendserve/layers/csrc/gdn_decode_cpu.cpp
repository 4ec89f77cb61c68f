// One Gated DeltaNet decode step for CPUs: conv, gating, the delta rule and the gated RMSNorm in one op.
//
// The plain-torch step (ascendserve/layers/gated_deltanet.py) is some 30 small ops per layer and reads
// each sequence's recurrent state from memory three times (S^T [k q], the decay, the rank-1 update);
// at one stream on Qwen3.5-0.8B the step's non-GEMM ops went from ~28 to ~14 ms with this op (profiled).
// Here every state byte is read once and written once: a value head's state [dk, dv] (64 KiB at
// 128 x 128) is read for S^T k, then updated and read for S^T q while it is still in L2.
//
// Inputs are the layer's two projection outputs as they come, row stride free, columns contiguous:
//   qkvz [B, 2*Hk*dk + Hv*dv + Hv*dv]: q | k | v (the conv channels, C of them) | z (the output gate)
//   ba   [B, 2*Hv]: b (-> beta = sigmoid(b)) | a (-> g = -exp(A_log) * softplus(a + dt_bias))
// and the pools, indexed in place by slots[b] (distinct):
//   conv_states [S, C, K-1] (the last K-1 conv inputs, oldest first), ssm_states [S, Hv, dk, dv] (fp32 or bf16).
// Per sequence b and value head h (key head h / (Hv / Hk)), with x = silu(conv(window)):
//   q, k = l2norm(x_q), l2norm(x_k) (eps 1e-6), q *= dk^-0.5;  decay = exp(g)
//   delta = beta (v - decay S^T k);  S = decay S + k delta^T;  o = S^T q
//   out[b, h] = o * rsqrt(mean(o^2) + eps) * norm_weight * silu(z)
// Everything is computed in fp32 (a bf16 model widens its projections for this op), the same math as transformers'
// torch_recurrent_gated_delta_rule followed by Qwen3_5RMSNormGated. A bf16 recurrent state (--mamba-ssm-cache-dtype
// bfloat16) is widened as it is read and rounded once a step as it is written: half the bytes a step moves.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "flush_denormals.h"
#include "gdn_common.h"

namespace {

using namespace ascendserve_gdn;

// x[b, c] = silu(sum_j window[j] w[c][j]) over window = [conv_states[slot][c][0 .. K-2], qkvz[b][c]]; the
// state then drops its oldest column and takes qkvz[b][c]. Work items are (row, run of kConvRun channels):
// the sums (16 channels at a time for width 4 on AVX-512, else a scalar loop), then silu over the run in
// a vectorized loop. The scalar form with silu inside was ~1/3 of the op at 64 rows: 18 Qwen3.5 layers
// at 64 rows, in one process, 172-182 ms -> 147-151 (silu split out) -> 113-119 (16-channel sums).
constexpr int64_t kConvRun = 1024;

#if defined(__AVX512F__)
// The width-4 step (Qwen3.5's) for 16 channels at once: their states [16][3] and weights [16][4] are
// split into one vector per tap by lane permutes, summed, and the shifted states [s1, s2, in] put back.
// x gets the sums (silu comes after).
inline void conv4_step16(const float* in, const float* w, float* st, float* x) {
  alignas(64) static const int32_t kTap[3][16] = {
      {0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 36, 39, 42, 45},
      {1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 37, 40, 43, 46},
      {2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 44, 47}};
  const __m512 s_a = _mm512_loadu_ps(st), s_b = _mm512_loadu_ps(st + 16), s_c = _mm512_loadu_ps(st + 32);
  __m512 tap[3];
  for (int j = 0; j < 3; ++j) {  // element 3i + j of the 48: from s_a / s_b below 32, from s_c above
    const __m512i idx = _mm512_load_si512(kTap[j]);
    const __mmask16 high = _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(32));
    tap[j] = _mm512_mask_permutexvar_ps(_mm512_permutex2var_ps(s_a, idx, s_b), high,
                                        _mm512_sub_epi32(idx, _mm512_set1_epi32(32)), s_c);
  }
  const __m512 v = _mm512_loadu_ps(in);
  const __m512i by4 = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(4));
  __m512 acc = _mm512_mul_ps(v, _mm512_i32gather_ps(_mm512_add_epi32(by4, _mm512_set1_epi32(3)), w, 4));
  for (int j = 0; j < 3; ++j)
    acc = _mm512_fmadd_ps(tap[j], _mm512_i32gather_ps(_mm512_add_epi32(by4, _mm512_set1_epi32(j)), w, 4), acc);
  _mm512_storeu_ps(x, acc);
  // New state of channel i: (tap1, tap2, in); output element k = 3i + t takes lane i of (tap1, tap2, v)[t].
  const __m512 src[3] = {tap[1], tap[2], v};
  alignas(64) static const int32_t kLane[3][16] = {  // (16 o + k) / 3
      {0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5},
      {5, 5, 6, 6, 6, 7, 7, 7, 8, 8, 8, 9, 9, 9, 10, 10},
      {10, 11, 11, 11, 12, 12, 12, 13, 13, 13, 14, 14, 14, 15, 15, 15}};
  alignas(64) static const int32_t kWhich[3][16] = {  // (16 o + k) % 3
      {0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0},
      {1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1},
      {2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2}};
  for (int o = 0; o < 3; ++o) {
    const __m512i li = _mm512_load_si512(kLane[o]), wi = _mm512_load_si512(kWhich[o]);
    __m512 r = _mm512_permutexvar_ps(li, src[0]);
    r = _mm512_mask_permutexvar_ps(r, _mm512_cmpeq_epi32_mask(wi, _mm512_set1_epi32(1)), li, src[1]);
    r = _mm512_mask_permutexvar_ps(r, _mm512_cmpeq_epi32_mask(wi, _mm512_set1_epi32(2)), li, src[2]);
    _mm512_storeu_ps(st + 16 * o, r);
  }
}
#endif

void conv_step(const float* qkvz, int64_t qkvz_stride, const float* weight, int64_t width, float* states,
               const int64_t* slots, int64_t batch, int64_t channels, float* x) {
  const int64_t hist = width - 1, runs = (channels + kConvRun - 1) / kConvRun;
  at::parallel_for(0, batch * runs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / runs, c0 = (item % runs) * kConvRun, c1 = std::min(channels, c0 + kConvRun);
      const float* in = qkvz + b * qkvz_stride;
      float* xb = x + b * channels;
      int64_t c = c0;
#if defined(__AVX512F__)
      if (width == 4)
        for (; c + 16 <= c1; c += 16)
          conv4_step16(in + c, weight + c * 4, states + (slots[b] * channels + c) * 3, xb + c);
#endif
      for (; c < c1; ++c) {
        float* st = states + (slots[b] * channels + c) * hist;
        const float* w = weight + c * width;
        float acc = in[c] * w[hist];
        for (int64_t j = 0; j < hist; ++j) acc += st[j] * w[j];
        for (int64_t j = 0; j + 1 < hist; ++j) st[j] = st[j + 1];
        if (hist > 0) st[hist - 1] = in[c];
        xb[c] = acc;
      }
#pragma omp simd
      for (int64_t i = c0; i < c1; ++i) xb[i] = silu(xb[i]);
    }
  });
}

// One value head's delta rule on its state s [dk][dv]: kv = S^T k, delta = beta (v - decay kv),
// S = decay S + k delta^T, o = S'^T q, with every state element read once and written once (o is taken while S' is
// written). A bf16 state is widened row by row into `widened` [dk][dv] on the first pass, so the second reads fp32
// from L2 and rounds once, to nearest even, as it stores; the arithmetic is fp32 either way.
template <typename S>
void delta_rule_head_portable(S* s, int64_t dk, int64_t dv, const float* q, const float* k, const float* v,
                              float beta, float decay, float* widened, float* kv, float* delta, float* o) {
  using ascendserve_bf16::from_float;
  using ascendserve_bf16::to_float;
  float* f = nullptr;
  if constexpr (std::is_same_v<S, float>)
    f = s;
  else
    f = widened;
  std::fill(kv, kv + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = f + i * dv;
    if constexpr (!std::is_same_v<S, float>) {
      const S* src = s + i * dv;
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) row[j] = to_float(src[j]);
    }
    const float ki = k[i];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) kv[j] += row[j] * ki;
  }
#pragma omp simd
  for (int64_t j = 0; j < dv; ++j) delta[j] = beta * (v[j] - decay * kv[j]);
  std::fill(o, o + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    const float* row = f + i * dv;
    S* dst = s + i * dv;
    const float ki = k[i], qi = q[i];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      const float updated = row[j] * decay + ki * delta[j];
      dst[j] = from_float<S>(updated);
      o[j] += updated * qi;
    }
  }
}

// Whether a bf16 head of dv columns runs in vector registers (delta_rule_head<at::BFloat16> below), with no fp32 copy.
inline bool bf16_head_in_registers(int64_t dv) {
#if defined(__AVX512F__)
  return dv % 16 == 0;
#else
  (void)dv;
  return false;
#endif
}

template <typename S>
void delta_rule_head(S* s, int64_t dk, int64_t dv, const float* q, const float* k, const float* v, float beta,
                     float decay, float* widened, float* kv, float* delta, float* o) {
  delta_rule_head_portable(s, dk, dv, q, k, v, beta, decay, widened, kv, delta, o);
}

#if defined(__AVX512F__)
using ascendserve_bf16::load_bf16x16;
using ascendserve_bf16::store_bf16x16;

// Columns [j, j + 16 NV) of delta_rule_head on a bf16 state, in vector registers: both passes walk the rows in memory
// order (a Qwen3.5 head's 128 columns are one group: 256 contiguous bytes a row), widening each row as it is loaded,
// the second pass from L1 / L2, with no fp32 copy. Walking 16-column strips (32 bytes of each 256-byte row) ran at
// 22 GB/s of state where the fp32 state streams at 33-37 (2-core Zen 5, 64 streams x 18 Qwen3.5 layers).
template <int NV>
inline void delta_rule_bf16_cols(at::BFloat16* s, int64_t dk, int64_t dv, int64_t j, const float* q, const float* k,
                                 const float* v, __m512 vbeta, __m512 vdecay, float* kv, float* delta, float* o) {
  __m512 acc[NV];
  for (int c = 0; c < NV; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < dk; ++i) {
    const at::BFloat16* row = s + i * dv + j;
    const __m512 ki = _mm512_set1_ps(k[i]);
    for (int c = 0; c < NV; ++c) acc[c] = _mm512_fmadd_ps(load_bf16x16(row + 16 * c), ki, acc[c]);
  }
  __m512 d[NV];
  for (int c = 0; c < NV; ++c) {
    _mm512_storeu_ps(kv + j + 16 * c, acc[c]);
    d[c] = _mm512_mul_ps(vbeta, _mm512_fnmadd_ps(vdecay, acc[c], _mm512_loadu_ps(v + j + 16 * c)));
    _mm512_storeu_ps(delta + j + 16 * c, d[c]);
    acc[c] = _mm512_setzero_ps();  // now o's sums
  }
  for (int64_t i = 0; i < dk; ++i) {
    at::BFloat16* row = s + i * dv + j;
    const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
    for (int c = 0; c < NV; ++c) {
      const __m512 updated = _mm512_fmadd_ps(load_bf16x16(row + 16 * c), vdecay, _mm512_mul_ps(ki, d[c]));
      store_bf16x16(row + 16 * c, updated);
      acc[c] = _mm512_fmadd_ps(updated, qi, acc[c]);
    }
  }
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + j + 16 * c, acc[c]);
}

template <>
void delta_rule_head<at::BFloat16>(at::BFloat16* s, int64_t dk, int64_t dv, const float* q, const float* k,
                                   const float* v, float beta, float decay, float* widened, float* kv, float* delta,
                                   float* o) {
  if (!bf16_head_in_registers(dv)) {  // the portable loops (through the fp32 copy) for other head sizes
    delta_rule_head_portable(s, dk, dv, q, k, v, beta, decay, widened, kv, delta, o);
    return;
  }
  const __m512 vdecay = _mm512_set1_ps(decay), vbeta = _mm512_set1_ps(beta);
  int64_t j = 0;
  for (; j + 128 <= dv; j += 128) delta_rule_bf16_cols<8>(s, dk, dv, j, q, k, v, vbeta, vdecay, kv, delta, o);
  for (; j + 64 <= dv; j += 64) delta_rule_bf16_cols<4>(s, dk, dv, j, q, k, v, vbeta, vdecay, kv, delta, o);
  for (; j < dv; j += 16) delta_rule_bf16_cols<1>(s, dk, dv, j, q, k, v, vbeta, vdecay, kv, delta, o);
}
#endif

at::Tensor gdn_decode(const at::Tensor& qkvz, const at::Tensor& ba, const at::Tensor& conv_weight,
                      const at::Tensor& conv_states, const at::Tensor& ssm_states, const at::Tensor& slots,
                      const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                      int64_t num_k_heads, double norm_eps) {
  const Dims d = checked_dims("gdn_decode", qkvz, ba, conv_weight, conv_states, ssm_states, slots, A_log, dt_bias,
                              norm_weight, num_k_heads);
  TORCH_CHECK(slots.numel() == qkvz.size(0), "gdn_decode: one slot per row expected");
  const int64_t batch = qkvz.size(0), num_v_heads = d.hv, dk = d.dk, dv = d.dv, width = d.width;
  const int64_t key_dim = d.key_dim, value_dim = d.value_dim, channels = d.channels;
  const int64_t* slot = slots.data_ptr<int64_t>();

  at::Tensor x = at::empty({batch, channels}, qkvz.options());
  conv_step(qkvz.data_ptr<float>(), qkvz.stride(0), conv_weight.data_ptr<float>(), width,
            conv_states.data_ptr<float>(), slot, batch, channels, x.data_ptr<float>());

  at::Tensor out = at::empty({batch, value_dim}, qkvz.options());
  const float* xs = x.data_ptr<float>();
  const float* zs = qkvz.data_ptr<float>() + channels;
  const float* bas = ba.data_ptr<float>();
  const float *a_log = A_log.data_ptr<float>(), *dt = dt_bias.data_ptr<float>(), *nw = norm_weight.data_ptr<float>();
  float* o_all = out.data_ptr<float>();
  const int64_t qkvz_stride = qkvz.stride(0), ba_stride = ba.stride(0), group = num_v_heads / num_k_heads;
  const float scale = 1.f / std::sqrt(static_cast<float>(dk)), eps = static_cast<float>(norm_eps);
  auto run = [&](auto* pool) {  // float* or at::BFloat16*: the recurrent-state pool's element type
    using S = std::remove_pointer_t<decltype(pool)>;
    at::parallel_for(0, batch * num_v_heads, 1, [&](int64_t begin, int64_t end) {
      FlushDenormals flush;
      std::vector<float> q(dk), k(dk), kv(dv), delta(dv);
      // a bf16 head's state in fp32, for the portable loops only
      std::vector<float> widened(std::is_same_v<S, float> || bf16_head_in_registers(dv) ? 0 : dk * dv);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / num_v_heads, h = item % num_v_heads, kh = h / group;
        const float* xb = xs + b * channels;
        l2norm_into(xb + kh * dk, dk, scale, q.data());
        l2norm_into(xb + key_dim + kh * dk, dk, 1.f, k.data());
        const float* v = xb + 2 * key_dim + h * dv;
        const float beta = 1.f / (1.f + std::exp(-bas[b * ba_stride + h]));
        const float decay = std::exp(-std::exp(a_log[h]) * softplus(bas[b * ba_stride + num_v_heads + h] + dt[h]));
        float* o = o_all + b * value_dim + h * dv;
        delta_rule_head(pool + (slot[b] * num_v_heads + h) * dk * dv, dk, dv, q.data(), k.data(), v, beta, decay,
                        widened.data(), kv.data(), delta.data(), o);
        gated_rms_norm(o, zs + b * qkvz_stride + h * dv, nw, dv, eps);
      }
    });
  };
  if (ssm_states.scalar_type() == at::kBFloat16)
    run(ssm_states.data_ptr<at::BFloat16>());
  else
    run(ssm_states.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendserve_cpu, m) {
  m.def("gdn_decode(Tensor qkvz, Tensor ba, Tensor conv_weight, Tensor(a!) conv_states, Tensor(b!) ssm_states, "
        "Tensor slots, Tensor A_log, Tensor dt_bias, Tensor norm_weight, int num_k_heads, float norm_eps) -> Tensor");
  m.impl("gdn_decode", c10::DispatchKey::CPU, TORCH_FN(gdn_decode));
}
