// y = x @ W.T + b with W stored as 8-bit values on a grid per block of G inputs, W = d * q (fp32 compute).
//
// A Q8_0 GGUF tensor (the demo model's token embedding, which is also its tied lm_head) is dequantized at
// load to fp32 values that are, per block of 32 inputs of a row, d * q with q in -127..127. Keeping q (a
// byte) and the block's d instead of the fp32 values is the same weight in a quarter of the bytes: the
// demo's lm_head (49152 x 576) reads 32 MB a decode step instead of 113. The product is computed as
//     y[n] = sum over blocks g of d[n,g] * sum_{k in g} x[k] q[n,k]
// in fp32: the weights' own products, regrouped (a different rounding order, as any GEMM's).
//
// Packed layout (ascendserve/layers/compact_linear.py, pack_q8): rows in panels of 32 (N padded with zero rows),
// [N/32][K][32] int8: for input k, byte j = q[n][k] for the panel's row j; scales [N/32][K/G][32] fp32.
// The tile is the 4-bit kernel's (q4_linear_cpu.cpp) with a byte per weight and no minimum. q8_linear_bf16x
// computes the same from bf16 x (a model run in bf16 with --quantization int8), see below.

#include <torch/library.h>

#include <cstdint>

#include "panel_linear.h"

namespace {

using ascendserve_panel::kMaxRows;
using ascendserve_panel::kPanel;
constexpr int64_t kPrefetchInputs = 64;  // inputs (32 bytes each) prefetched ahead

struct Q8Panel {
  const int8_t* q;      // [K][32]
  const float* scales;  // [K/G][32]
  int64_t group;        // G, inputs per d
};

// Any CPU: the same tile in plain C++ (also the reference the SIMD tiles are tested against).
void tile_portable(int rows, const float* x, int64_t ldx, int64_t groups, const Q8Panel& w, float* out,
                   int64_t ldo, int64_t cols, const float* bias) {
  float acc[kMaxRows][kPanel] = {};
  for (int64_t g = 0; g < groups; ++g) {
    float block[kMaxRows][kPanel] = {};
    for (int64_t k = g * w.group; k < (g + 1) * w.group; ++k) {
      const int8_t* bytes = w.q + k * kPanel;
      for (int m = 0; m < rows; ++m)
        for (int64_t j = 0; j < kPanel; ++j) block[m][j] += x[m * ldx + k] * static_cast<float>(bytes[j]);
    }
    const float* d = w.scales + g * kPanel;
    for (int m = 0; m < rows; ++m)
      for (int64_t j = 0; j < kPanel; ++j) acc[m][j] += d[j] * block[m][j];
  }
  ascendserve_panel::store_rows(acc, rows, out, ldo, cols, bias);
}

#if defined(ASCENDSERVE_TILES_AVX512)
template <int ROWS>
void tile_avx512(const float* x, int64_t ldx, int64_t groups, const Q8Panel& w, float* out, int64_t ldo,
                 int64_t cols, const float* bias) {
  __m512 acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 block[ROWS][2];
    for (int m = 0; m < ROWS; ++m) block[m][0] = block[m][1] = _mm512_setzero_ps();
    for (int64_t k = g * w.group; k < (g + 1) * w.group; ++k) {
      const int8_t* bytes = w.q + k * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchInputs * kPanel), _MM_HINT_T0);
      const __m128i* lanes = reinterpret_cast<const __m128i*>(bytes);  // 2 x 16 outputs' bytes
      const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(lanes)));
      const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(lanes + 1)));
      for (int m = 0; m < ROWS; ++m) {
        const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
        block[m][0] = _mm512_fmadd_ps(xv, q0, block[m][0]);
        block[m][1] = _mm512_fmadd_ps(xv, q1, block[m][1]);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(w.scales + g * kPanel), d1 = _mm512_loadu_ps(w.scales + g * kPanel + 16);
    for (int m = 0; m < ROWS; ++m) {
      acc[m][0] = _mm512_fmadd_ps(d0, block[m][0], acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(d1, block[m][1], acc[m][1]);
    }
  }
  ascendserve_panel::store_tile<ROWS>(acc, out, ldo, cols, bias);
}

void tile_fast(int rows, const float* x, int64_t ldx, int64_t groups, const Q8Panel& w, float* out, int64_t ldo,
               int64_t cols, const float* bias) {
  ascendserve_panel::with_tile_rows<kMaxRows>(rows, [&](auto r) {
    tile_avx512<decltype(r)::value>(x, ldx, groups, w, out, ldo, cols, bias);
  });
}
#elif defined(ASCENDSERVE_TILES_AVX2)
// ROWS rows of x, one half (16 outputs) of the panel at a time, as the 4-bit kernel's AVX2 tile.
template <int ROWS>
void tile_avx2(const float* x, int64_t ldx, int64_t groups, const Q8Panel& w, float (*acc)[kPanel]) {
  for (int h = 0; h < 2; ++h) {
    for (int m = 0; m < ROWS; ++m)
      for (int j = 0; j < 16; ++j) acc[m][16 * h + j] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      __m256 block[ROWS][2];
      for (int m = 0; m < ROWS; ++m) block[m][0] = block[m][1] = _mm256_setzero_ps();
      for (int64_t k = g * w.group; k < (g + 1) * w.group; ++k) {
        const int8_t* bytes = w.q + k * kPanel + 16 * h;
        _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchInputs * kPanel), _MM_HINT_T0);
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(raw, raw)));
        for (int m = 0; m < ROWS; ++m) {
          const __m256 xv = _mm256_broadcast_ss(x + m * ldx + k);
          block[m][0] = _mm256_fmadd_ps(xv, q0, block[m][0]);
          block[m][1] = _mm256_fmadd_ps(xv, q1, block[m][1]);
        }
      }
      const float* d = w.scales + g * kPanel + 16 * h;
      for (int m = 0; m < ROWS; ++m)
        for (int v = 0; v < 2; ++v) {
          float* a = acc[m] + 16 * h + 8 * v;
          _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_loadu_ps(d + 8 * v), block[m][v], _mm256_loadu_ps(a)));
        }
    }
  }
}

// One row (single-stream decode): the whole panel in one pass, even and odd inputs in separate
// accumulators (8 independent FMA chains), as the 4-bit kernel's one-row tile.
void tile_avx2_one_row(const float* x, int64_t groups, const Q8Panel& w, float* acc) {
  auto widened = [](const int8_t* bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes))));
  };
  __m256 total[4];
  for (int v = 0; v < 4; ++v) total[v] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 even[4], odd[4];
    for (int v = 0; v < 4; ++v) even[v] = odd[v] = _mm256_setzero_ps();
    const int64_t k0 = g * w.group, k1 = k0 + w.group;
    int64_t k = k0;
    for (; k + 1 < k1; k += 2) {
      const int8_t* bytes = w.q + k * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchInputs * kPanel), _MM_HINT_T0);
      const __m256 xe = _mm256_broadcast_ss(x + k), xo = _mm256_broadcast_ss(x + k + 1);
      for (int v = 0; v < 4; ++v) {
        even[v] = _mm256_fmadd_ps(xe, widened(bytes + 8 * v), even[v]);
        odd[v] = _mm256_fmadd_ps(xo, widened(bytes + kPanel + 8 * v), odd[v]);
      }
    }
    if (k < k1) {  // an odd block size's last input
      const __m256 xe = _mm256_broadcast_ss(x + k);
      for (int v = 0; v < 4; ++v) even[v] = _mm256_fmadd_ps(xe, widened(w.q + k * kPanel + 8 * v), even[v]);
    }
    for (int v = 0; v < 4; ++v)
      total[v] = _mm256_fmadd_ps(_mm256_loadu_ps(w.scales + g * kPanel + 8 * v), _mm256_add_ps(even[v], odd[v]),
                                 total[v]);
  }
  for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc + 8 * v, total[v]);
}

void tile_fast(int rows, const float* x, int64_t ldx, int64_t groups, const Q8Panel& w, float* out, int64_t ldo,
               int64_t cols, const float* bias) {
  float acc[kMaxRows][kPanel];
  if (rows == 1) {
    tile_avx2_one_row(x, groups, w, acc[0]);
    return ascendserve_panel::store_rows(acc, 1, out, ldo, cols, bias);
  }
  ascendserve_panel::in_row_blocks<ascendserve_panel::kAvx2Rows>(rows, [&](int m0, auto r) {
    tile_avx2<decltype(r)::value>(x + m0 * ldx, ldx, groups, w, acc + m0);
  });
  ascendserve_panel::store_rows(acc, rows, out, ldo, cols, bias);
}
#else
void tile_fast(int rows, const float* x, int64_t ldx, int64_t groups, const Q8Panel& w, float* out, int64_t ldo,
               int64_t cols, const float* bias) {
  tile_portable(rows, x, ldx, groups, w, out, ldo, cols, bias);
}
#endif

at::Tensor linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n,
                  const c10::optional<at::Tensor>& bias, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "q8_linear: x must be a contiguous fp32 [M, K] tensor");
  const int64_t group = ascendserve_panel::check_q8_pack(x, q, scales, n, "q8_linear");
  const int64_t panels = q.size(0), k = q.size(1), groups = k / group;
  const float* bias_ptr = ascendserve_panel::checked_bias(bias, n, "q8_linear");
  const int64_t m_rows = x.size(0);
  at::Tensor out = at::empty({m_rows, n}, x.options());
  if (m_rows == 0) return out;
  const float* x_ptr = x.data_ptr<float>();
  const int8_t* q_ptr = q.data_ptr<int8_t>();
  const float* d_ptr = scales.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  ascendserve_panel::for_each_tile(m_rows, k, n, panels, [&](int64_t p, int64_t m0, int rows, int64_t cols) {
    const Q8Panel w{q_ptr + p * k * kPanel, d_ptr + p * groups * kPanel, group};
    (portable ? tile_portable : tile_fast)(rows, x_ptr + m0 * k, k, groups, w, out_ptr + m0 * n + p * kPanel, n,
                                           cols, bias_ptr ? bias_ptr + p * kPanel : nullptr);
  });
  return out;
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n,
                     const c10::optional<at::Tensor>& bias) {
  return linear(x, q, scales, n, bias, false);
}

at::Tensor q8_linear_portable(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n,
                              const c10::optional<at::Tensor>& bias) {
  return linear(x, q, scales, n, bias, true);
}

// ---- bf16 activations (a model run in bf16 with --quantization int8) ----
//
// The same sums from bf16 x on vdpbf16ps (AVX512-BF16): per block of G inputs sum_k x[k] q[n,k], then d * that
// in fp32. q (-127..127) is exact in bf16 and vdpbf16ps's products are exact with fp32 sums: the fp32 kernel's
// arithmetic on the same (bf16) x, in another summation order. Per input pair a panel's 2 x 32 bytes become two
// registers of weight pairs: each byte widened to fp32 (exact; a small integer's low 16 bits are zero, so its bf16
// is its high half), the odd input's kept in place and the even one's shifted down into the low half: 16
// instructions per 64 weights, for any number of rows; each row then adds 2 vdpbf16ps. As the 4-bit kernel's bf16
// tile, one or two rows keep even and odd pairs in separate sums. Without AVX512-BF16, x is widened to fp32
// (exact) and the fp32 tiles above multiply.

#if defined(ASCENDSERVE_TILES_AVX512) && defined(__AVX512BF16__)
#define ASCENDSERVE_Q8_DOT 1
constexpr int kDotRows = 12;  // x rows per tile: 24 registers of block sums

using ascendserve_panel::PairBf16;

// bytes: input 2kp's 32 bytes (a panel's rows), then input 2kp + 1's.
inline PairBf16 pair_bf16(const int8_t* bytes) {
  _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchInputs * kPanel), _MM_HINT_T0);
  auto widened = [&](int at) {
    return _mm512_castps_si512(_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + at)))));
  };
  return {(__m512bh)_mm512_or_si512(widened(32), _mm512_srli_epi32(widened(0), 16)),
          (__m512bh)_mm512_or_si512(widened(48), _mm512_srli_epi32(widened(16), 16))};
}

// Out: float (the fp32 sums) or at::BFloat16 (rounded once). x: bf16 pairs as 32-bit words, ldx in pairs.
template <int ROWS, typename Out>
void tile_dot(const uint32_t* x, int64_t ldx, int64_t groups, const Q8Panel& w, Out* out, int64_t ldo, int64_t cols,
              const float* bias) {
  __m512 acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  ascendserve_panel::dot_pair_blocks<ROWS>(
      x, ldx, groups, w.group / 2, [&](int64_t kp) { return pair_bf16(w.q + 2 * kp * kPanel); },
      [&](int64_t g, const auto& block) {
        const __m512 d0 = _mm512_loadu_ps(w.scales + g * kPanel), d1 = _mm512_loadu_ps(w.scales + g * kPanel + 16);
        for (int m = 0; m < ROWS; ++m) {
          acc[m][0] = _mm512_fmadd_ps(d0, ascendserve_panel::pair_sum<ROWS>(block, m, 0), acc[m][0]);
          acc[m][1] = _mm512_fmadd_ps(d1, ascendserve_panel::pair_sum<ROWS>(block, m, 1), acc[m][1]);
        }
      });
  ascendserve_panel::store_tile<ROWS>(acc, out, ldo, cols, bias);
}
#endif

// y = x @ W.T + b for bf16 x [M, K] (bias fp32), the fp32 sums rounded to bf16 where bf16_out. On the vdpbf16ps
// tile where the build has AVX512-BF16 (every batch size), else x widened to fp32 (exact) through q8_linear's tiles.
at::Tensor q8_linear_bf16x(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n,
                           const c10::optional<at::Tensor>& bias, bool bf16_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "q8_linear_bf16x: x must be a contiguous bf16 [M, K] tensor");
#if defined(ASCENDSERVE_Q8_DOT)
  const int64_t group = ascendserve_panel::check_q8_pack(x, q, scales, n, "q8_linear_bf16x");
  TORCH_CHECK(group % 2 == 0, "q8_linear_bf16x: blocks of ", group, " inputs, not whole input pairs");
  const float* bias_ptr = ascendserve_panel::checked_bias(bias, n, "q8_linear_bf16x");
  const int64_t m_rows = x.size(0), k = q.size(1), panels = q.size(0), groups = k / group, kpairs = k / 2;
  at::Tensor out = at::empty({m_rows, n}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (m_rows == 0) return out;
  const uint32_t* x_ptr = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const int8_t* q_ptr = q.data_ptr<int8_t>();
  const float* d_ptr = scales.data_ptr<float>();
  auto run = [&](auto* out_ptr) {
    ascendserve_panel::for_each_tile<kDotRows>(m_rows, k, n, panels, [&](int64_t p, int64_t m0, int rows,
                                                                         int64_t cols) {
      const Q8Panel w{q_ptr + p * k * kPanel, d_ptr + p * groups * kPanel, group};
      ascendserve_panel::with_tile_rows<kDotRows>(rows, [&](auto r) {
        tile_dot<decltype(r)::value>(x_ptr + m0 * kpairs, kpairs, groups, w, out_ptr + m0 * n + p * kPanel, n, cols,
                                     bias_ptr ? bias_ptr + p * kPanel : nullptr);
      });
    });
  };
  ascendserve_panel::with_out_ptr(out, bf16_out, run);
  return out;
#else
  at::Tensor out = linear(x.to(at::kFloat), q, scales, n, bias, false);
  return bf16_out ? out.to(at::kBFloat16) : out;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendserve_cpu, m) {
  m.def("q8_linear(Tensor x, Tensor q, Tensor scales, int n, Tensor? bias) -> Tensor");
  m.def("q8_linear_portable(Tensor x, Tensor q, Tensor scales, int n, Tensor? bias) -> Tensor");
  m.def("q8_linear_bf16x(Tensor x, Tensor q, Tensor scales, int n, Tensor? bias, bool bf16_out) -> Tensor");
  m.impl("q8_linear", c10::DispatchKey::CPU, TORCH_FN(q8_linear));
  m.impl("q8_linear_portable", c10::DispatchKey::CPU, TORCH_FN(q8_linear_portable));
  m.impl("q8_linear_bf16x", c10::DispatchKey::CPU, TORCH_FN(q8_linear_bf16x));
}
