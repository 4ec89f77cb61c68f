// Gated DeltaNet prefill for CPUs: the causal conv, the chunked delta rule and the gated RMSNorm in one op.
//
// The plain-torch chunked path (ascendserve/layers/gated_deltanet.py) batches small matmuls over every
// chunk and head with many [T, H, d] temporaries between them; in a 256-token Qwen3.5-0.8B prefill its
// ops took ~1.2 of 3.2 s (bmm alone 0.53 s, ~25 GFLOP/s). Here each (sequence, value head) is one work
// item that walks its chunks with the state in place in the pool, and every temporary is a chunk-sized
// buffer that stays in L2: 18 ms a layer there, 0.32 s for the 18 layers. Denormals are flushed
// (flush_denormals.h): strong decays otherwise made it 4x slower.
//
// Inputs are laid out as for gdn_decode (csrc/gdn_decode_cpu.cpp): qkvz [T, C + Hv*dv] and ba [T, 2*Hv]
// (columns contiguous), sequences packed by cu_seqlens [B+1], pools indexed by slots [B] (distinct);
// has_initial [B] False means the sequence starts from zero conv and recurrent states, whatever its
// slot holds. Per chunk of L <= 64 tokens (transformers' torch_chunk_gated_delta_rule, l2norm in kernel),
// with c = cumsum(g) inside the chunk and D[i][j] = exp(c_i - c_j) for j <= i:
//   T = (I + strict_lower(diag(beta) K K^T * D))^-1           (forward substitution)
//   U = T diag(beta) V,  W = T diag(beta exp(c)) K
//   V' = U - W S;  O = diag(exp(c)) Q S + lower(Q K^T * D) V'
//   S = exp(c_L) S + (diag(exp(c_L - c)) K)^T V'
// then out = norm(O) * norm_weight * silu(z). Everything fp32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>

#include "flush_denormals.h"
#include "gdn_common.h"

namespace {

using namespace ascendserve_gdn;

constexpr int64_t kChunk = 64;

// One 4 x 64 tile of gemm_acc: 16 vector sums live in registers for the whole i loop.
#if defined(__AVX512F__)
inline void gemm_tile(int64_t K, float alpha, const float* a, int64_t am, int64_t ai, const float* b, int64_t ldb,
                      float* c, int64_t ldc) {
  __m512 acc[4][4];
  for (int r = 0; r < 4; ++r)
    for (int h = 0; h < 4; ++h) acc[r][h] = _mm512_setzero_ps();
  for (int64_t i = 0; i < K; ++i) {
    const float* brow = b + i * ldb;
    const __m512 b0 = _mm512_loadu_ps(brow), b1 = _mm512_loadu_ps(brow + 16);
    const __m512 b2 = _mm512_loadu_ps(brow + 32), b3 = _mm512_loadu_ps(brow + 48);
    for (int r = 0; r < 4; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * am + i * ai]);
      acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(x, b2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(x, b3, acc[r][3]);
    }
  }
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int r = 0; r < 4; ++r)
    for (int h = 0; h < 4; ++h) {
      float* out = c + r * ldc + 16 * h;
      _mm512_storeu_ps(out, _mm512_fmadd_ps(scale, acc[r][h], _mm512_loadu_ps(out)));
    }
}
#else
inline void gemm_tile(int64_t K, float alpha, const float* a, int64_t am, int64_t ai, const float* b, int64_t ldb,
                      float* c, int64_t ldc) {
  constexpr int64_t kCols = 64;
  float acc0[kCols] = {}, acc1[kCols] = {}, acc2[kCols] = {}, acc3[kCols] = {};
  for (int64_t i = 0; i < K; ++i) {
    const float* brow = b + i * ldb;
    const float x0 = a[i * ai], x1 = a[am + i * ai], x2 = a[2 * am + i * ai], x3 = a[3 * am + i * ai];
#pragma omp simd
    for (int64_t j = 0; j < kCols; ++j) {
      acc0[j] += x0 * brow[j];
      acc1[j] += x1 * brow[j];
      acc2[j] += x2 * brow[j];
      acc3[j] += x3 * brow[j];
    }
  }
#pragma omp simd
  for (int64_t j = 0; j < kCols; ++j) {
    c[j] += alpha * acc0[j];
    c[ldc + j] += alpha * acc1[j];
    c[2 * ldc + j] += alpha * acc2[j];
    c[3 * ldc + j] += alpha * acc3[j];
  }
}
#endif

// C[m][n] += alpha * sum_i A(m, i) B[i][n] for m < M, n < N, i < K, with A(m, i) = a[m * am + i * ai]
// and B, C row-major. Tiles of 4 rows x 64 columns keep their sums in registers across the i loop.
void gemm_acc(int64_t M, int64_t N, int64_t K, float alpha, const float* a, int64_t am, int64_t ai,
              const float* b, int64_t ldb, float* c, int64_t ldc) {
  constexpr int64_t kRows = 4, kCols = 64;
  for (int64_t n0 = 0; n0 < N; n0 += kCols) {
    const int64_t nc = std::min(kCols, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int64_t mr = std::min(kRows, M - m0);
      if (nc == kCols && mr == kRows) {
        gemm_tile(K, alpha, a + m0 * am, am, ai, b + n0, ldb, c + m0 * ldc + n0, ldc);
        continue;
      }
      for (int64_t r = 0; r < mr; ++r) {  // edges: one row at a time
        float acc[kCols] = {};
        const float* ar = a + (m0 + r) * am;
        for (int64_t i = 0; i < K; ++i) {
          const float x = ar[i * ai];
          const float* brow = b + i * ldb + n0;
#pragma omp simd
          for (int64_t j = 0; j < nc; ++j) acc[j] += x * brow[j];
        }
        float* cr = c + (m0 + r) * ldc + n0;
        for (int64_t j = 0; j < nc; ++j) cr[j] += alpha * acc[j];
      }
    }
  }
}

// Per sequence b and channel c: x[t][c] = silu(sum_j w[c][j] in[t - K + 1 + j][c]) where inputs before
// the sequence's first token come from its conv state (zeros without an initial state); the state
// then holds the last K-1 inputs (old state columns included when the sequence is shorter than K-1).
// Token-major: each token's row is one pass over all channels, reading rows the previous token read.
void conv_prefill(const float* qkvz, int64_t qkvz_stride, const float* weight, int64_t width, float* states,
                  const int64_t* cu, const int64_t* slots, const bool* has_initial, int64_t batch,
                  int64_t channels, float* x) {
  const int64_t hist = width - 1, num_tokens = cu[batch];
  std::vector<float> taps(width * channels);  // taps[j][c] = weight[c][j]: contiguous across channels
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t j = 0; j < width; ++j) taps[j * channels + c] = weight[c * width + j];
  std::vector<float> context(batch * hist * channels);  // [b][j][c]: slot b's state column j, oldest first
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t c = 0; c < channels; ++c)
      for (int64_t j = 0; j < hist; ++j)
        context[(b * hist + j) * channels + c] = has_initial[b] ? states[(slots[b] * channels + c) * hist + j] : 0.f;
  std::vector<int64_t> seq_of(num_tokens);
  for (int64_t b = 0; b < batch; ++b) std::fill(seq_of.begin() + cu[b], seq_of.begin() + cu[b + 1], b);
  // Row of input p of sequence b (p < 0: its state column hist + p).
  auto input = [&](int64_t b, int64_t p) {
    return p >= 0 ? qkvz + (cu[b] + p) * qkvz_stride : context.data() + (b * hist + hist + p) * channels;
  };
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = seq_of[t], p = t - cu[b];
      float* xo = x + t * channels;
      const float* in = input(b, p - hist);
#pragma omp simd
      for (int64_t c = 0; c < channels; ++c) xo[c] = in[c] * taps[c];
      for (int64_t j = 1; j <= hist; ++j) {
        in = input(b, p - hist + j);
        const float* tap = taps.data() + j * channels;
#pragma omp simd
        for (int64_t c = 0; c < channels; ++c) xo[c] += in[c] * tap[c];
      }
#pragma omp simd
      for (int64_t c = 0; c < channels; ++c) xo[c] = silu(xo[c]);
    }
  });
  for (int64_t b = 0; b < batch; ++b) {  // the new states, from the inputs and the context copies
    float* st = states + slots[b] * channels * hist;
    for (int64_t j = 0; j < hist; ++j) {
      const float* in = input(b, cu[b + 1] - cu[b] - hist + j);
      for (int64_t c = 0; c < channels; ++c) st[c * hist + j] = in[c];
    }
  }
}

// Chunk buffers of one work item; L2-sized for dk = dv = 128.
struct Scratch {
  std::vector<float> q, k, kt, rhs, vnew, lower, attn, cum, beta;
  Scratch(const Dims& d)
      : q(kChunk * d.dk), k(kChunk * d.dk), kt(d.dk * kChunk), rhs(kChunk * (d.dv + d.dk)), vnew(kChunk * d.dv),
        lower(kChunk * kChunk), attn(kChunk * kChunk), cum(kChunk), beta(kChunk) {}
};

// One chunk of `len` tokens of value head h, rows starting at token t0; s is the state [dk][dv] in place;
// writes the un-normed outputs into o (row stride ldo).
void chunk_step(const Dims& d, const float* x, const float* ba, int64_t ba_stride, float a_scale, float dt,
                int64_t h, int64_t t0, int64_t len, float* s, Scratch& w, float* o, int64_t ldo) {
  const int64_t dk = d.dk, dv = d.dv, kh = h / (d.hv / d.hk), width = dv + dk;
  const float scale = 1.f / std::sqrt(static_cast<float>(dk));
  float run = 0.f;
  for (int64_t r = 0; r < len; ++r) {
    const float* xr = x + (t0 + r) * d.channels;
    l2norm_into(xr + kh * dk, dk, scale, w.q.data() + r * dk);
    l2norm_into(xr + d.key_dim + kh * dk, dk, 1.f, w.k.data() + r * dk);
    const float* bar = ba + (t0 + r) * ba_stride;
    w.beta[r] = 1.f / (1.f + std::exp(-bar[h]));
    run += -a_scale * softplus(bar[d.hv + h] + dt);
    w.cum[r] = run;
    for (int64_t i = 0; i < dk; ++i) w.kt[i * kChunk + r] = w.k[r * dk + i];
  }
  // lower[i][j] = beta_i k_i.k_j D_ij (j < i); attn[i][j] = q_i.k_j D_ij (j <= i); zeros elsewhere.
  std::fill(w.lower.begin(), w.lower.end(), 0.f);
  std::fill(w.attn.begin(), w.attn.end(), 0.f);
  gemm_acc(len, len, dk, 1.f, w.k.data(), dk, 1, w.kt.data(), kChunk, w.lower.data(), kChunk);
  gemm_acc(len, len, dk, 1.f, w.q.data(), dk, 1, w.kt.data(), kChunk, w.attn.data(), kChunk);
  for (int64_t i = 0; i < len; ++i) {
    for (int64_t j = 0; j <= i; ++j) {
      const float decay = std::exp(w.cum[i] - w.cum[j]);
      w.lower[i * kChunk + j] = j < i ? w.lower[i * kChunk + j] * decay * w.beta[i] : 0.f;
      w.attn[i * kChunk + j] *= decay;
    }
    for (int64_t j = i + 1; j < len; ++j) w.lower[i * kChunk + j] = w.attn[i * kChunk + j] = 0.f;
  }
  // rhs rows [beta v | beta exp(c) k], then T applied by forward substitution: [U | W]. Column blocks
  // of 64: a row's block is summed in registers over the rows before it.
  for (int64_t r = 0; r < len; ++r) {
    float* row = w.rhs.data() + r * width;
    const float* v = x + (t0 + r) * d.channels + 2 * d.key_dim + h * dv;
    const float fk = w.beta[r] * std::exp(w.cum[r]);
    for (int64_t j = 0; j < dv; ++j) row[j] = w.beta[r] * v[j];
    for (int64_t j = 0; j < dk; ++j) row[dv + j] = fk * w.k[r * dk + j];
  }
  constexpr int64_t kBlock = 64;
  for (int64_t c0 = 0; c0 < width; c0 += kBlock) {
    const int64_t nc = std::min(kBlock, width - c0);
    for (int64_t r = 1; r < len; ++r) {
      float acc[kBlock];
      float* row = w.rhs.data() + r * width + c0;
      std::copy(row, row + nc, acc);
      for (int64_t i = 0; i < r; ++i) {
        const float f = w.lower[r * kChunk + i];
        const float* prev = w.rhs.data() + i * width + c0;
#pragma omp simd
        for (int64_t j = 0; j < nc; ++j) acc[j] -= f * prev[j];
      }
      std::copy(acc, acc + nc, row);
    }
  }
  // V' = U - W S
  for (int64_t r = 0; r < len; ++r) {
    const float* u = w.rhs.data() + r * width;
    std::copy(u, u + dv, w.vnew.data() + r * dv);
  }
  gemm_acc(len, dv, dk, -1.f, w.rhs.data() + dv, width, 1, s, dv, w.vnew.data(), dv);
  // O = diag(exp(c)) Q S + attn V'
  for (int64_t r = 0; r < len; ++r) {
    const float f = std::exp(w.cum[r]);
    for (int64_t i = 0; i < dk; ++i) w.q[r * dk + i] *= f;
    std::fill(o + r * ldo, o + r * ldo + dv, 0.f);
  }
  gemm_acc(len, dv, dk, 1.f, w.q.data(), dk, 1, s, dv, o, ldo);
  gemm_acc(len, dv, len, 1.f, w.attn.data(), kChunk, 1, w.vnew.data(), dv, o, ldo);
  // S = exp(c_L) S + (diag(exp(c_L - c)) K)^T V'; the scaled K goes in place of Q's buffer.
  const float last = w.cum[len - 1], chunk_decay = std::exp(last);
  for (int64_t r = 0; r < len; ++r) {
    const float f = std::exp(last - w.cum[r]);
    for (int64_t i = 0; i < dk; ++i) w.q[r * dk + i] = f * w.k[r * dk + i];
  }
  for (int64_t i = 0; i < dk * dv; ++i) s[i] *= chunk_decay;
  gemm_acc(dk, dv, len, 1.f, w.q.data(), 1, dk, w.vnew.data(), dv, s, dv);
}

at::Tensor gdn_prefill(const at::Tensor& qkvz, const at::Tensor& ba, const at::Tensor& conv_weight,
                       const at::Tensor& conv_states, const at::Tensor& ssm_states, const at::Tensor& cu_seqlens,
                       const at::Tensor& slots, const at::Tensor& has_initial, const at::Tensor& A_log,
                       const at::Tensor& dt_bias, const at::Tensor& norm_weight, int64_t num_k_heads,
                       double norm_eps) {
  const Dims d = checked_dims("gdn_prefill", qkvz, ba, conv_weight, conv_states, ssm_states, slots, A_log, dt_bias,
                              norm_weight, num_k_heads);
  const int64_t num_tokens = qkvz.size(0), batch = slots.numel(), width = d.width;
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous() && cu_seqlens.numel() == batch + 1 &&
              has_initial.scalar_type() == at::kBool && has_initial.is_contiguous() && has_initial.numel() == batch,
              "gdn_prefill: cu_seqlens [B+1], slots [B] int64 and has_initial [B] bool expected");
  const int64_t *cu = cu_seqlens.data_ptr<int64_t>(), *slot = slots.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[batch] == num_tokens, "gdn_prefill: cu_seqlens must run from 0 to T");
  for (int64_t b = 0; b < batch; ++b) TORCH_CHECK(cu[b + 1] >= cu[b], "gdn_prefill: cu_seqlens must not decrease");

  at::Tensor x = at::empty({num_tokens, d.channels}, qkvz.options());
  conv_prefill(qkvz.data_ptr<float>(), qkvz.stride(0), conv_weight.data_ptr<float>(), width,
               conv_states.data_ptr<float>(), cu, slot, has_initial.data_ptr<bool>(), batch, d.channels,
               x.data_ptr<float>());

  at::Tensor out = at::empty({num_tokens, d.value_dim}, qkvz.options());
  const float *xs = x.data_ptr<float>(), *bas = ba.data_ptr<float>(), *zs = qkvz.data_ptr<float>() + d.channels;
  const float *a_log = A_log.data_ptr<float>(), *dt = dt_bias.data_ptr<float>(), *nw = norm_weight.data_ptr<float>();
  const bool* initial = has_initial.data_ptr<bool>();
  float* pool = ssm_states.data_ptr<float>();
  float* o_all = out.data_ptr<float>();
  const int64_t qkvz_stride = qkvz.stride(0), ba_stride = ba.stride(0);
  const float eps = static_cast<float>(norm_eps);
  at::parallel_for(0, batch * d.hv, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals flush;
    Scratch w(d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / d.hv, h = item % d.hv;
      float* s = pool + (slot[b] * d.hv + h) * d.dk * d.dv;
      if (!initial[b]) std::fill(s, s + d.dk * d.dv, 0.f);
      for (int64_t t0 = cu[b]; t0 < cu[b + 1]; t0 += kChunk) {
        const int64_t len = std::min(kChunk, cu[b + 1] - t0);
        float* o = o_all + t0 * d.value_dim + h * d.dv;
        chunk_step(d, xs, bas, ba_stride, std::exp(a_log[h]), dt[h], h, t0, len, s, w, o, d.value_dim);
        for (int64_t r = 0; r < len; ++r)  // gated RMSNorm of each output row
          gated_rms_norm(o + r * d.value_dim, zs + (t0 + r) * qkvz_stride + h * d.dv, nw, d.dv, eps);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendserve_cpu, m) {
  m.def("gdn_prefill(Tensor qkvz, Tensor ba, Tensor conv_weight, Tensor(a!) conv_states, Tensor(b!) ssm_states, "
        "Tensor cu_seqlens, Tensor slots, Tensor has_initial, Tensor A_log, Tensor dt_bias, Tensor norm_weight, "
        "int num_k_heads, float norm_eps) -> Tensor");
  m.impl("gdn_prefill", c10::DispatchKey::CPU, TORCH_FN(gdn_prefill));
}
