// Gated DeltaNet prefill for CPUs: the causal conv, the delta rule and the gated RMSNorm in one op.
//
// Inputs are laid out as for gdn_decode (csrc/gdn_decode_cpu.cpp): qkvz [T, C + Hv*dv] and ba [T, 2*Hv] (columns
// contiguous), sequences packed by cu_seqlens [B+1], pools indexed by slots [B] (distinct); has_initial [B] False
// means the sequence starts from zero conv and recurrent states, whatever its slot holds. qkvz and ba are both fp32,
// or both bf16 as a bf16 model's projections leave them, each value widened where it is read (a separate copy to fp32
// took 2.7 ms a layer at 2048 rows, and the op then read twice the bytes; Qwen3.5's 8 x 256 bf16 prefill in-process:
// 1625-1658 -> 1553-1609 ms). Per token, as transformers' torch_recurrent_gated_delta_rule (and gdn_decode) computes:
//   q, k = l2norm(x_q), l2norm(x_k) (eps 1e-6), q *= dk^-0.5;  decay = exp(g)
//   delta = beta (v - decay S^T k);  S = decay S + k delta^T;  o = S^T q
// then out = norm(o) * norm_weight * silu(z). Everything is computed in fp32; the recurrent-state pool may be bf16
// (--mamba-ssm-cache-dtype bfloat16): its blocks are widened into the fp32 buffer below and rounded back once per
// segment of kSegment tokens, so a prompt's result depends a little on how it was chunked (never in fp32).
//
// The recurrence is run token by token, not in transformers' chunked form: a value column of S depends
// only on its own column of v, so S is walked in blocks of kCols columns ([dk][32] floats, 16 KiB at
// dk = 128, copied to a contiguous buffer that stays in L1) through all of a sequence's tokens. Each
// token then costs 4 vector operations per state element, against the chunked form's ~5 small GEMMs
// per 64 tokens whose edges, transposes and forward substitution kept it near 80 GFLOP/s. Measured on
// 8 x 256 tokens of Qwen3.5-0.8B's layer shape (16 value heads of 128 x 128), the two ops built side by
// side in one process and alternated: 93 -> 78 and 109 -> 88 ms a layer, the same outputs to 1e-4;
// with the buffers 64-byte aligned (AlignedFloats) 111 -> 83 ms. (Before either op, the plain-torch chunked path
// took ~1.2 s of a 3.2 s 256-token prefill.)
// The conv is done inside each (sequence, head) work item, on that head's q, k and v channels as the tokens are
// gathered, with the rows a few tokens on prefetched: a separate pass over all channels wrote a [T, C] buffer (page
// faults on a fresh one) and read it back, and the strided gathers waited on DRAM. Same microbenchmark, alternated:
// 42-45 -> 31-34 ms (conv in the items, SiLU on AVX-512's exp) -> 25-27 ms (prefetch); in a 0.8B-shaped bf16 model's
// 8 x 256 prefill the 18 layers' ops 0.61-0.64 -> 0.47-0.50 s. The recurrence is about half of what is left.
// Denormals are flushed (flush_denormals.h): strong decays otherwise made it 4x slower.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "flush_denormals.h"
#include "gdn_common.h"

namespace {

using namespace ascendserve_gdn;

constexpr int64_t kCols = 32;  // state columns per pass over a sequence's tokens
// Tokens gathered at a time: bounds each thread's scratch (~0.5 MiB at dk = dv = 128) whatever the
// prefill chunk's length; the state block goes in and out once per segment, 2 x 16 KiB per 256 tokens.
constexpr int64_t kSegment = 256;

// fp32 scratch starting on a 64-byte boundary: the state block's AVX-512 loads and stores each
// straddled two cache lines from a plain vector's 16-byte alignment, which made the recurrence 1.8x slower.
struct AlignedFloats {
  std::vector<float> storage;
  float* ptr;
  explicit AlignedFloats(int64_t n) : storage(n + 16) {
    const auto misalign = reinterpret_cast<uintptr_t>(storage.data()) % 64;
    ptr = storage.data() + (misalign ? (64 - misalign) / sizeof(float) : 0);
  }
  float* data() { return ptr; }
  const float* data() const { return ptr; }
  float& operator[](int64_t i) { return ptr[i]; }
  float operator[](int64_t i) const { return ptr[i]; }
};

// One (sequence, value head)'s rows, gathered once for all column blocks into contiguous buffers: q
// (normed and scaled), k (normed), v, beta and the decay exp(g); and its outputs o before the norm.
struct TokenInputs {
  AlignedFloats q, k, v, o, beta, decay;
  TokenInputs(int64_t max_len, int64_t dk, int64_t dv)
      : q(max_len * dk), k(max_len * dk), v(max_len * dv), o(max_len * dv), beta(max_len), decay(max_len) {}
};

#if defined(__AVX512F__)
// Columns [0, 32) of a contiguous state block s [dk][32] through tokens 0..len-1: v rows at v + t * ldv,
// outputs (S^T q) to o + t * ldo. Four partial sums per vector hide the FMA latency.
void recur_block32(int64_t dk, int64_t len, const TokenInputs& in, const float* v, int64_t ldv, float* s, float* o,
                   int64_t ldo) {
  for (int64_t t = 0; t < len; ++t) {
    const float* k = in.k.data() + t * dk;
    const float* q = in.q.data() + t * dk;
    __m512 kv[4][2];
    for (int p = 0; p < 4; ++p) kv[p][0] = kv[p][1] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 4 <= dk; i += 4)
      for (int p = 0; p < 4; ++p) {
        const __m512 ki = _mm512_set1_ps(k[i + p]);
        kv[p][0] = _mm512_fmadd_ps(_mm512_loadu_ps(s + (i + p) * kCols), ki, kv[p][0]);
        kv[p][1] = _mm512_fmadd_ps(_mm512_loadu_ps(s + (i + p) * kCols + 16), ki, kv[p][1]);
      }
    for (; i < dk; ++i) {
      const __m512 ki = _mm512_set1_ps(k[i]);
      kv[0][0] = _mm512_fmadd_ps(_mm512_loadu_ps(s + i * kCols), ki, kv[0][0]);
      kv[0][1] = _mm512_fmadd_ps(_mm512_loadu_ps(s + i * kCols + 16), ki, kv[0][1]);
    }
    const __m512 decay = _mm512_set1_ps(in.decay[t]), beta = _mm512_set1_ps(in.beta[t]);
    __m512 delta[2];
    for (int h = 0; h < 2; ++h) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(kv[0][h], kv[1][h]), _mm512_add_ps(kv[2][h], kv[3][h]));
      delta[h] = _mm512_mul_ps(beta, _mm512_fnmadd_ps(decay, sum, _mm512_loadu_ps(v + t * ldv + 16 * h)));
    }
    __m512 acc[4][2];
    for (int p = 0; p < 4; ++p) acc[p][0] = acc[p][1] = _mm512_setzero_ps();
    auto update = [&](int64_t row, int p) {
      const __m512 ki = _mm512_set1_ps(k[row]), qi = _mm512_set1_ps(q[row]);
      for (int h = 0; h < 2; ++h) {
        float* cell = s + row * kCols + 16 * h;
        const __m512 updated = _mm512_fmadd_ps(_mm512_loadu_ps(cell), decay, _mm512_mul_ps(ki, delta[h]));
        _mm512_storeu_ps(cell, updated);
        acc[p][h] = _mm512_fmadd_ps(updated, qi, acc[p][h]);
      }
    };
    i = 0;
    for (; i + 4 <= dk; i += 4)
      for (int p = 0; p < 4; ++p) update(i + p, p);
    for (; i < dk; ++i) update(i, 0);
    for (int h = 0; h < 2; ++h)
      _mm512_storeu_ps(o + t * ldo + 16 * h,
                       _mm512_add_ps(_mm512_add_ps(acc[0][h], acc[1][h]), _mm512_add_ps(acc[2][h], acc[3][h])));
  }
}
#endif

// The same for a block of nc <= kCols columns (s [dk][nc] contiguous), in plain loops.
void recur_block(int64_t dk, int64_t nc, int64_t len, const TokenInputs& in, const float* v, int64_t ldv, float* s,
                 float* o, int64_t ldo) {
#if defined(__AVX512F__)
  if (nc == kCols) return recur_block32(dk, len, in, v, ldv, s, o, ldo);
#endif
  float kv[kCols], delta[kCols], acc[kCols];
  for (int64_t t = 0; t < len; ++t) {
    const float* k = in.k.data() + t * dk;
    const float* q = in.q.data() + t * dk;
    std::fill(kv, kv + nc, 0.f);
    for (int64_t i = 0; i < dk; ++i) {
#pragma omp simd
      for (int64_t j = 0; j < nc; ++j) kv[j] += s[i * nc + j] * k[i];
    }
    const float decay = in.decay[t], beta = in.beta[t];
    for (int64_t j = 0; j < nc; ++j) delta[j] = beta * (v[t * ldv + j] - decay * kv[j]);
    std::fill(acc, acc + nc, 0.f);
    for (int64_t i = 0; i < dk; ++i) {
#pragma omp simd
      for (int64_t j = 0; j < nc; ++j) {
        const float updated = s[i * nc + j] * decay + k[i] * delta[j];
        s[i * nc + j] = updated;
        acc[j] += updated * q[i];
      }
    }
    std::copy(acc, acc + nc, o + t * ldo);
  }
}

// Rows of qkvz are 8-32 KiB apart and each work item reads a few hundred bytes of each, in token order: a stride the
// hardware prefetcher does not follow, so the rows kAhead tokens on are asked for while this one is worked on.
constexpr int64_t kAhead = 8;

template <typename T>
__attribute__((always_inline)) inline void prefetch_values(const T* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(T)) __builtin_prefetch(p + i, 0, 3);
}

// dst[0 .. n) = src[0 .. n) as fp32 (bf16 widened: exact).
template <typename T>
inline void widen_into(const T* src, int64_t n, float* dst) {
  using ascendserve_bf16::to_float;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// The causal conv's inputs: its weights transposed, taps [K][C], and each sequence's window before its first
// token, context [b][K-1][C] (its conv state, oldest first, or zeros without an initial state). A copy of the old
// states, so that the work items may write the new ones while others still read the old. In: qkvz's element type
// (fp32, or bf16 as a bf16 model's projection leaves it).
template <typename In>
struct ConvInputs {
  std::vector<float> taps, context;
  const In* qkvz;
  int64_t qkvz_stride, hist, channels;
  const int64_t* cu;
  ConvInputs(const In* qkvz_, int64_t qkvz_stride_, const float* weight, int64_t width, const float* states,
             const int64_t* cu_, const int64_t* slots, const bool* has_initial, int64_t batch, int64_t channels_)
      : taps(width * channels_), context(batch * (width - 1) * channels_), qkvz(qkvz_), qkvz_stride(qkvz_stride_),
        hist(width - 1), channels(channels_), cu(cu_) {
    for (int64_t c = 0; c < channels; ++c)
      for (int64_t j = 0; j < width; ++j) taps[j * channels + c] = weight[c * width + j];
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t c = 0; c < channels; ++c)
        for (int64_t j = 0; j < hist; ++j)
          context[(b * hist + j) * channels + c] = has_initial[b] ? states[(slots[b] * channels + c) * hist + j] : 0.f;
  }
  // Sequence b's token p's row of qkvz (p >= 0), and the context row of its state column hist + p (p < 0).
  const In* token(int64_t b, int64_t p) const { return qkvz + (cu[b] + p) * qkvz_stride; }
  const float* context_row(int64_t b, int64_t p) const { return context.data() + (b * hist + hist + p) * channels; }
  // The conv input row of token p as fp32 where qkvz is fp32 (p < 0: its state column hist + p).
  const float* row(int64_t b, int64_t p) const {
    static_assert(std::is_same_v<In, float>, "a bf16 qkvz is widened into a ring of rows (gdn_prefill)");
    return p >= 0 ? token(b, p) : context_row(b, p);
  }
  // dst[c0 .. c0 + n) = channels [c0, c0 + n) of token p's conv input, as fp32.
  void widen(int64_t b, int64_t p, int64_t c0, int64_t n, float* dst) const {
    if (p >= 0) {
      widen_into(token(b, p) + c0, n, dst + c0);
    } else {
      std::copy(context_row(b, p) + c0, context_row(b, p) + c0 + n, dst + c0);
    }
  }
  // Sequence b's new state (its last K-1 inputs, old state columns included when it is shorter) for channels
  // [c0, c0 + n), into its slot's state [C][K-1].
  void keep(int64_t b, int64_t len, int64_t c0, int64_t n, float* state) const {
    using ascendserve_bf16::to_float;
    for (int64_t j = 0; j < hist; ++j) {
      const int64_t p = len - hist + j;
      if (p >= 0) {
        const In* in = token(b, p);
        for (int64_t c = c0; c < c0 + n; ++c) state[c * hist + j] = to_float(in[c]);
      } else {
        const float* in = context_row(b, p);
        for (int64_t c = c0; c < c0 + n; ++c) state[c * hist + j] = in[c];
      }
    }
  }
};

at::Tensor gdn_prefill(const at::Tensor& qkvz, const at::Tensor& ba, const at::Tensor& conv_weight,
                       const at::Tensor& conv_states, const at::Tensor& ssm_states, const at::Tensor& cu_seqlens,
                       const at::Tensor& slots, const at::Tensor& has_initial, const at::Tensor& A_log,
                       const at::Tensor& dt_bias, const at::Tensor& norm_weight, int64_t num_k_heads,
                       double norm_eps) {
  const Dims d = checked_dims("gdn_prefill", qkvz, ba, conv_weight, conv_states, ssm_states, slots, A_log, dt_bias,
                              norm_weight, num_k_heads, true);
  const int64_t num_tokens = qkvz.size(0), batch = slots.numel(), width = d.width;
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous() && cu_seqlens.numel() == batch + 1 &&
              has_initial.scalar_type() == at::kBool && has_initial.is_contiguous() && has_initial.numel() == batch,
              "gdn_prefill: cu_seqlens [B+1], slots [B] int64 and has_initial [B] bool expected");
  const int64_t *cu = cu_seqlens.data_ptr<int64_t>(), *slot = slots.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[batch] == num_tokens, "gdn_prefill: cu_seqlens must run from 0 to T");
  for (int64_t b = 0; b < batch; ++b) TORCH_CHECK(cu[b + 1] >= cu[b], "gdn_prefill: cu_seqlens must not decrease");

  float* conv_pool = conv_states.data_ptr<float>();
  at::Tensor out = at::empty({num_tokens, d.value_dim}, qkvz.options().dtype(at::kFloat));
  const float *a_log = A_log.data_ptr<float>(), *dt = dt_bias.data_ptr<float>(), *nw = norm_weight.data_ptr<float>();
  const bool* initial = has_initial.data_ptr<bool>();
  float* o_all = out.data_ptr<float>();
  const int64_t qkvz_stride = qkvz.stride(0), ba_stride = ba.stride(0);
  const float eps = static_cast<float>(norm_eps);
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) max_len = std::max(max_len, cu[b + 1] - cu[b]);
  // pool: float* or at::BFloat16*, the recurrent-state pool's element type; qkvz_ptr and ba_ptr fp32 or bf16
  auto run = [&](auto* pool, const auto* qkvz_ptr, const auto* ba_ptr) {
    using S = std::remove_pointer_t<decltype(pool)>;
    using In = std::remove_cv_t<std::remove_pointer_t<decltype(qkvz_ptr)>>;
    using ascendserve_bf16::from_float;
    using ascendserve_bf16::to_float;
    const ConvInputs<In> conv(qkvz_ptr, qkvz_stride, conv_weight.data_ptr<float>(), width,
                              conv_states.data_ptr<float>(), cu, slot, has_initial.data_ptr<bool>(), batch,
                              d.channels);
    const In *bas = ba_ptr, *zs = qkvz_ptr + d.channels;
    at::parallel_for(0, batch * d.hv, 1, [&](int64_t begin, int64_t end) {
      FlushDenormals flush;
      TokenInputs in(std::min(max_len, kSegment), d.dk, d.dv);
      AlignedFloats block(d.dk * kCols);
      std::vector<const float*> window(width);
      // bf16 inputs: the conv's last `width` rows widened, token p in row (p + hist) % width (the head's q, k and v
      // channels only, at their columns), and a z row
      constexpr bool kWiden = !std::is_same_v<In, float>;
      std::vector<float> ring(kWiden ? width * d.channels : 0), z_row(kWiden ? d.dv : 0);
      const int64_t group = d.hv / d.hk;
      const float scale = 1.f / std::sqrt(static_cast<float>(d.dk));
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / d.hv, h = item % d.hv, kh = h / group, t0 = cu[b], len = cu[b + 1] - t0;
        const int64_t q_at = kh * d.dk, k_at = d.key_dim + kh * d.dk, v_at = 2 * d.key_dim + h * d.dv;
        float* conv_state = conv_pool + slot[b] * d.channels * conv.hist;
        if (h % group == 0) {  // the key head's q and k channels are kept by the first of its value heads
          conv.keep(b, len, q_at, d.dk, conv_state);
          conv.keep(b, len, k_at, d.dk, conv_state);
        }
        conv.keep(b, len, v_at, d.dv, conv_state);
        S* s = pool + (slot[b] * d.hv + h) * d.dk * d.dv;
        if (!initial[b]) std::fill(s, s + d.dk * d.dv, from_float<S>(0.f));
        if (len == 0) continue;
        const float a_scale = std::exp(a_log[h]);
        for (int64_t s0 = 0; s0 < len; s0 += kSegment) {  // the tokens a segment at a time
          const int64_t first = t0 + s0, count = std::min(kSegment, len - s0);
          for (int64_t r = 0; r < count; ++r) {  // the conv of the head's channels, q and k normed
            if (s0 + r + kAhead < len) {
              const In* ahead = conv.token(b, s0 + r + kAhead);
              prefetch_values(ahead + q_at, d.dk);
              prefetch_values(ahead + k_at, d.dk);
              prefetch_values(ahead + v_at, d.dv);
            }
            if constexpr (kWiden) {
              const int64_t p = s0 + r;
              for (int64_t t = p == 0 ? -conv.hist : p; t <= p; ++t) {  // the context rows before the first token
                float* dst = ring.data() + (t + conv.hist) % width * d.channels;
                conv.widen(b, t, q_at, d.dk, dst);
                conv.widen(b, t, k_at, d.dk, dst);
                conv.widen(b, t, v_at, d.dv, dst);
              }
              for (int64_t j = 0; j < width; ++j) window[j] = ring.data() + (p + j) % width * d.channels;
            } else {
              for (int64_t j = 0; j < width; ++j) window[j] = conv.row(b, s0 + r - conv.hist + j);
            }
            float *q = in.q.data() + r * d.dk, *k = in.k.data() + r * d.dk;
            conv_silu(window.data(), width, conv.taps.data(), d.channels, q_at, d.dk, q);
            l2norm_into(q, d.dk, scale, q);
            conv_silu(window.data(), width, conv.taps.data(), d.channels, k_at, d.dk, k);
            l2norm_into(k, d.dk, 1.f, k);
            conv_silu(window.data(), width, conv.taps.data(), d.channels, v_at, d.dv, in.v.data() + r * d.dv);
            const In* bar = bas + (first + r) * ba_stride;
            in.beta[r] = 1.f / (1.f + std::exp(-to_float(bar[h])));
            in.decay[r] = std::exp(-a_scale * softplus(to_float(bar[d.hv + h]) + dt[h]));
          }
          for (int64_t j0 = 0; j0 < d.dv; j0 += kCols) {  // the block in, the segment's tokens, the block back
            const int64_t nc = std::min(kCols, d.dv - j0);
            for (int64_t i = 0; i < d.dk; ++i) {
              const S* src = s + i * d.dv + j0;
              float* dst = block.data() + i * nc;
#pragma omp simd
              for (int64_t j = 0; j < nc; ++j) dst[j] = to_float(src[j]);
            }
            recur_block(d.dk, nc, count, in, in.v.data() + j0, d.dv, block.data(), in.o.data() + j0, d.dv);
            for (int64_t i = 0; i < d.dk; ++i) {  // a bf16 state is rounded here, once a segment
              const float* src = block.data() + i * nc;
              S* dst = s + i * d.dv + j0;
#pragma omp simd
              for (int64_t j = 0; j < nc; ++j) dst[j] = from_float<S>(src[j]);
            }
          }
          for (int64_t r = 0; r < count; ++r) {  // gated RMSNorm of each output row
            const In* z = zs + (first + r) * qkvz_stride + h * d.dv;
            if (r + kAhead < count) prefetch_values(z + kAhead * qkvz_stride, d.dv);
            float* o = o_all + (first + r) * d.value_dim + h * d.dv;
            std::copy(in.o.data() + r * d.dv, in.o.data() + (r + 1) * d.dv, o);
            if constexpr (kWiden) {
              widen_into(z, d.dv, z_row.data());
              gated_rms_norm(o, z_row.data(), nw, d.dv, eps);
            } else {
              gated_rms_norm(o, z, nw, d.dv, eps);
            }
          }
        }
      }
    });
  };
  auto with_inputs = [&](auto* pool) {
    if (qkvz.scalar_type() == at::kBFloat16) {
      run(pool, qkvz.data_ptr<at::BFloat16>(), ba.data_ptr<at::BFloat16>());
    } else {
      run(pool, qkvz.data_ptr<float>(), ba.data_ptr<float>());
    }
  };
  if (ssm_states.scalar_type() == at::kBFloat16)
    with_inputs(ssm_states.data_ptr<at::BFloat16>());
  else
    with_inputs(ssm_states.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendserve_cpu, m) {
  m.def("gdn_prefill(Tensor qkvz, Tensor ba, Tensor conv_weight, Tensor(a!) conv_states, Tensor(b!) ssm_states, "
        "Tensor cu_seqlens, Tensor slots, Tensor has_initial, Tensor A_log, Tensor dt_bias, Tensor norm_weight, "
        "int num_k_heads, float norm_eps) -> Tensor");
  m.impl("gdn_prefill", c10::DispatchKey::CPU, TORCH_FN(gdn_prefill));
}
