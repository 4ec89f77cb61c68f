// y = x @ W.T + b with W stored as 4-bit values on a grid per block of G inputs, W = d * q + m (fp32
// compute). G is the weight's (K / the scales' second size): 32 for a GGUF, 64 for --quantization int4.
//
// A Q4_0 / Q4_1 GGUF (the demo model) is dequantized at load to fp32 weights that are exactly such
// a grid: every block of 32 inputs of a row holds m + d * q with q in 0..15 (Q4_1: m = the block's
// minimum; Q4_0: m = -8 d). Keeping q (half a byte) and the block's d and m instead of the fp32
// values is the same weight in an eighth of the bytes. `--quantization int4` rounds an fp32 model's
// weights onto such a grid (layers/quantization.py). The product is computed as
//     y[n] = sum over blocks g of ( d[n,g] * sum_{k in g} x[k] q[n,k]  +  m[n,g] * sum_{k in g} x[k] )
// in fp32: the weights' own products, regrouped (a different rounding order, as any GEMM's).
//
// Packed layout (ascendserve/layers/linear.py, pack_q4): rows in panels of 32 (N padded with zero
// rows), [N/32][K/2][32] bytes: for input pair kp, byte j = q[n][2kp] | q[n][2kp+1] << 4 for the
// panel's row j; scales and mins [N/32][K/G][32] fp32. The micro-kernel is the bf16 one's (up to 6
// x-rows by 32 outputs in registers, x broadcast, one panel streamed front to back), with a block
// accumulator folded into the output at the end of each block of G inputs.

#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "panel_linear.h"

namespace {

using ascendserve_panel::kMaxRows;
using ascendserve_panel::kPanel;
constexpr int64_t kPrefetchPairs = 64;  // input pairs (32 bytes each) prefetched ahead

struct Q4Panel {
  const uint8_t* q;      // [K/2][32]
  const float* scales;   // [K/G][32]
  const float* mins;     // [K/G][32]
  int64_t group;         // G, inputs per (d, m) block
};

// Any CPU: the same tile in plain C++ (also the reference the SIMD tiles are tested against).
void tile_portable(int rows, const float* x, const float* xsum, int64_t ldx, int64_t groups, const Q4Panel& w,
                   float* out, int64_t ldo, int64_t cols, const float* bias) {
  float acc[kMaxRows][kPanel] = {};
  for (int64_t g = 0; g < groups; ++g) {
    float block[kMaxRows][kPanel] = {};
    for (int64_t kp = g * w.group / 2; kp < (g + 1) * w.group / 2; ++kp) {
      const uint8_t* bytes = w.q + kp * kPanel;
      for (int m = 0; m < rows; ++m) {
        const float xe = x[m * ldx + 2 * kp], xo = x[m * ldx + 2 * kp + 1];
        for (int64_t j = 0; j < kPanel; ++j)
          block[m][j] += xe * static_cast<float>(bytes[j] & 15) + xo * static_cast<float>(bytes[j] >> 4);
      }
    }
    const float* d = w.scales + g * kPanel;
    const float* mn = w.mins + g * kPanel;
    for (int m = 0; m < rows; ++m)
      for (int64_t j = 0; j < kPanel; ++j) acc[m][j] += d[j] * block[m][j] + mn[j] * xsum[m * groups + g];
  }
  ascendserve_panel::store_rows(acc, rows, out, ldo, cols, bias);
}

#if defined(ASCENDSERVE_TILES_AVX512)
template <int ROWS>
void tile_avx512(const float* x, const float* xsum, int64_t ldx, int64_t groups, const Q4Panel& w, float* out,
                 int64_t ldo, int64_t cols, const float* bias) {
  __m512 acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  // q as fp32 by a lookup: vpermps reads only an index's low 4 bits, so a byte's low nibble needs no
  // mask, and neither nibble a conversion (per 32 weight bytes at one row, 12 instructions instead of
  // 14 with the widening loads and the FMAs: the tile is instruction-bound there, not bandwidth-bound).
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 block[ROWS][2];
    for (int m = 0; m < ROWS; ++m) block[m][0] = block[m][1] = _mm512_setzero_ps();
    for (int64_t kp = g * w.group / 2; kp < (g + 1) * w.group / 2; ++kp) {
      const uint8_t* bytes = w.q + kp * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchPairs * kPanel), _MM_HINT_T0);
      const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
      const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)));
      const __m512 qe0 = _mm512_permutexvar_ps(b0, values);
      const __m512 qo0 = _mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), values);
      const __m512 qe1 = _mm512_permutexvar_ps(b1, values);
      const __m512 qo1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b1, 4), values);
      for (int m = 0; m < ROWS; ++m) {
        const __m512 xe = _mm512_set1_ps(x[m * ldx + 2 * kp]);
        const __m512 xo = _mm512_set1_ps(x[m * ldx + 2 * kp + 1]);
        block[m][0] = _mm512_fmadd_ps(xe, qe0, block[m][0]);
        block[m][1] = _mm512_fmadd_ps(xe, qe1, block[m][1]);
        block[m][0] = _mm512_fmadd_ps(xo, qo0, block[m][0]);
        block[m][1] = _mm512_fmadd_ps(xo, qo1, block[m][1]);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(w.scales + g * kPanel), d1 = _mm512_loadu_ps(w.scales + g * kPanel + 16);
    const __m512 m0 = _mm512_loadu_ps(w.mins + g * kPanel), m1 = _mm512_loadu_ps(w.mins + g * kPanel + 16);
    for (int m = 0; m < ROWS; ++m) {
      const __m512 s = _mm512_set1_ps(xsum[m * groups + g]);
      acc[m][0] = _mm512_fmadd_ps(d0, block[m][0], _mm512_fmadd_ps(m0, s, acc[m][0]));
      acc[m][1] = _mm512_fmadd_ps(d1, block[m][1], _mm512_fmadd_ps(m1, s, acc[m][1]));
    }
  }
  ascendserve_panel::store_tile<ROWS>(acc, out, ldo, cols, bias);
}

void tile_fast(int rows, const float* x, const float* xsum, int64_t ldx, int64_t groups, const Q4Panel& w,
               float* out, int64_t ldo, int64_t cols, const float* bias) {
  ascendserve_panel::with_tile_rows<kMaxRows>(rows, [&](auto r) {
    tile_avx512<decltype(r)::value>(x, xsum, ldx, groups, w, out, ldo, cols, bias);
  });
}
#elif defined(ASCENDSERVE_TILES_AVX2)
// ROWS rows of x, one half (16 outputs) of the panel at a time: per input pair, the half's 16 bytes
// widened to 32-bit lanes, each nibble converted to fp32 once for all rows. A block's sums stay in
// registers (2 a row); the running totals in acc, folded into once per block of G inputs.
template <int ROWS>
void tile_avx2(const float* x, const float* xsum, int64_t ldx, int64_t groups, const Q4Panel& w,
               float (*acc)[kPanel]) {
  const __m256i nibble = _mm256_set1_epi32(15);
  for (int h = 0; h < 2; ++h) {
    for (int m = 0; m < ROWS; ++m)
      for (int j = 0; j < 16; ++j) acc[m][16 * h + j] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      __m256 block[ROWS][2];
      for (int m = 0; m < ROWS; ++m) block[m][0] = block[m][1] = _mm256_setzero_ps();
      for (int64_t kp = g * w.group / 2; kp < (g + 1) * w.group / 2; ++kp) {
        const uint8_t* bytes = w.q + kp * kPanel + 16 * h;
        _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchPairs * kPanel), _MM_HINT_T0);
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
        const __m256i b0 = _mm256_cvtepu8_epi32(raw), b1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(raw, raw));
        const __m256 qe0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, nibble));
        const __m256 qe1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, nibble));
        for (int m = 0; m < ROWS; ++m) {
          const __m256 xe = _mm256_broadcast_ss(x + m * ldx + 2 * kp);
          block[m][0] = _mm256_fmadd_ps(xe, qe0, block[m][0]);
          block[m][1] = _mm256_fmadd_ps(xe, qe1, block[m][1]);
        }
        const __m256 qo0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
        const __m256 qo1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
        for (int m = 0; m < ROWS; ++m) {
          const __m256 xo = _mm256_broadcast_ss(x + m * ldx + 2 * kp + 1);
          block[m][0] = _mm256_fmadd_ps(xo, qo0, block[m][0]);
          block[m][1] = _mm256_fmadd_ps(xo, qo1, block[m][1]);
        }
      }
      const float* d = w.scales + g * kPanel + 16 * h;
      const float* mn = w.mins + g * kPanel + 16 * h;
      for (int m = 0; m < ROWS; ++m) {
        const __m256 s = _mm256_broadcast_ss(xsum + m * groups + g);
        for (int v = 0; v < 2; ++v) {
          float* a = acc[m] + 16 * h + 8 * v;
          const __m256 total = _mm256_fmadd_ps(_mm256_loadu_ps(mn + 8 * v), s, _mm256_loadu_ps(a));
          _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_loadu_ps(d + 8 * v), block[m][v], total));
        }
      }
    }
  }
}

// One row (single-stream decode): the whole panel in one pass, even and odd inputs in separate
// accumulators (8 independent FMA chains). The tile above walks each panel twice and, at one row,
// chains two FMAs a step on each accumulator: Qwen3.5 shapes at one row from DRAM 5.8-6.9 -> 9.6-12.4 GB/s
// (AMD EPYC, 2 threads; int4 B=1 decode step 66 ms in-process).
void tile_avx2_one_row(const float* x, const float* xsum, int64_t groups, const Q4Panel& w, float* acc) {
  const __m256i nibble = _mm256_set1_epi32(15);
  __m256 total[4];
  for (int v = 0; v < 4; ++v) total[v] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 even[4], odd[4];
    for (int v = 0; v < 4; ++v) even[v] = odd[v] = _mm256_setzero_ps();
    for (int64_t kp = g * w.group / 2; kp < (g + 1) * w.group / 2; ++kp) {
      const uint8_t* bytes = w.q + kp * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchPairs * kPanel), _MM_HINT_T0);
      const __m256 xe = _mm256_broadcast_ss(x + 2 * kp), xo = _mm256_broadcast_ss(x + 2 * kp + 1);
      for (int v = 0; v < 4; ++v) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * v)));
        even[v] = _mm256_fmadd_ps(xe, _mm256_cvtepi32_ps(_mm256_and_si256(b, nibble)), even[v]);
        odd[v] = _mm256_fmadd_ps(xo, _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), odd[v]);
      }
    }
    const __m256 s = _mm256_broadcast_ss(xsum + g);
    for (int v = 0; v < 4; ++v) {
      const __m256 d = _mm256_loadu_ps(w.scales + g * kPanel + 8 * v);
      const __m256 mn = _mm256_loadu_ps(w.mins + g * kPanel + 8 * v);
      total[v] = _mm256_fmadd_ps(d, _mm256_add_ps(even[v], odd[v]), _mm256_fmadd_ps(mn, s, total[v]));
    }
  }
  for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc + 8 * v, total[v]);
}

void tile_fast(int rows, const float* x, const float* xsum, int64_t ldx, int64_t groups, const Q4Panel& w,
               float* out, int64_t ldo, int64_t cols, const float* bias) {
  float acc[kMaxRows][kPanel];
  if (rows == 1) {
    tile_avx2_one_row(x, xsum, groups, w, acc[0]);
    return ascendserve_panel::store_rows(acc, 1, out, ldo, cols, bias);
  }
  ascendserve_panel::in_row_blocks<ascendserve_panel::kAvx2Rows>(rows, [&](int m0, auto r) {
    tile_avx2<decltype(r)::value>(x + m0 * ldx, xsum + m0 * groups, ldx, groups, w, acc + m0);
  });
  ascendserve_panel::store_rows(acc, rows, out, ldo, cols, bias);
}
#else
void tile_fast(int rows, const float* x, const float* xsum, int64_t ldx, int64_t groups, const Q4Panel& w,
               float* out, int64_t ldo, int64_t cols, const float* bias) {
  tile_portable(rows, x, xsum, ldx, groups, w, out, ldo, cols, bias);
}
#endif

// The weight's block size G (inputs per d and m), after checking the pack's shapes.
int64_t check_pack(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& mins, int64_t n, const char* op) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kByte && q.is_contiguous() && q.size(2) == kPanel, op,
              ": q must be [N/32, K/2, 32] uint8");
  const int64_t panels = q.size(0), k = 2 * q.size(1);
  TORCH_CHECK(scales.dim() == 3 && scales.size(1) > 0, op, ": scales must be [N/32, K/G, 32] fp32");
  const int64_t groups = scales.size(1), group = k / groups;
  TORCH_CHECK(group * groups == k && group % 2 == 0, op, ": K=", k, " is not ", groups, " blocks of an even size");
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(0) == panels &&
                t->size(1) == groups && t->size(2) == kPanel, op, ": scales and mins must be [N/32, K/G, 32] fp32");
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, op, ": n=", n, " does not match ", panels, " panels");
  return group;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& mins,
                  int64_t n, const c10::optional<at::Tensor>& bias, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "q4_linear: x must be a contiguous fp32 [M, K] tensor");
  const int64_t group = check_pack(q, scales, mins, n, "q4_linear");
  const int64_t m_rows = x.size(0), k = x.size(1), panels = q.size(0), groups = scales.size(1);
  TORCH_CHECK(k == 2 * q.size(1), "q4_linear: x has ", k, " columns, the weight ", 2 * q.size(1));
  const float* bias_ptr = ascendserve_panel::checked_bias(bias, n, "q4_linear");
  at::Tensor out = at::empty({m_rows, n}, x.options());
  if (m_rows == 0) return out;
  // Each row's sum over each block of G inputs (the mins' factor), once per call (a plain loop: at
  // decode a torch sum's dispatch and allocation cost more than the sums, ~115 calls a step).
  const float* x_ptr = x.data_ptr<float>();
  std::vector<float> xsum(m_rows * groups);
  for (int64_t i = 0; i < m_rows * groups; ++i) {
    float sum = 0.f;
    for (int64_t j = 0; j < group; ++j) sum += x_ptr[i * group + j];
    xsum[i] = sum;
  }
  const float* xsum_ptr = xsum.data();
  const uint8_t* q_ptr = q.data_ptr<uint8_t>();
  const float* d_ptr = scales.data_ptr<float>();
  const float* m_ptr = mins.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  ascendserve_panel::for_each_tile(m_rows, k, n, panels, [&](int64_t p, int64_t m0, int rows, int64_t cols) {
    const Q4Panel w{q_ptr + p * (k / 2) * kPanel, d_ptr + p * groups * kPanel, m_ptr + p * groups * kPanel, group};
    (portable ? tile_portable : tile_fast)(rows, x_ptr + m0 * k, xsum_ptr + m0 * groups, k, groups, w,
                                           out_ptr + m0 * n + p * kPanel, n, cols,
                                           bias_ptr ? bias_ptr + p * kPanel : nullptr);
  });
  return out;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& mins,
                     int64_t n, const c10::optional<at::Tensor>& bias) {
  return linear(x, q, scales, mins, n, bias, false);
}

at::Tensor q4_linear_portable(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                              const at::Tensor& mins, int64_t n, const c10::optional<at::Tensor>& bias) {
  return linear(x, q, scales, mins, n, bias, true);
}

// The dense fp32 [N, K] weight, d * q + m per block (for batches where MKL's GEMM on it is faster).
// Threads split the rows; each row is written front to back, its panel's bytes read with a stride
// (the panel, K/2 x 32 bytes, stays in L2 while its 32 rows are written).
at::Tensor q4_unpack(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& mins, int64_t n) {
  const int64_t group = check_pack(q, scales, mins, n, "q4_unpack");
  const int64_t k = 2 * q.size(1), groups = scales.size(1);
  at::Tensor out = at::empty({n, k}, scales.options());
  const uint8_t* q_ptr = q.data_ptr<uint8_t>();
  const float* d_ptr = scales.data_ptr<float>();
  const float* m_ptr = mins.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, n, kPanel, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t p = row / kPanel, j = row % kPanel;
      const uint8_t* bytes = q_ptr + p * (k / 2) * kPanel + j;
      float* dst = out_ptr + row * k;
      for (int64_t g = 0; g < groups; ++g) {
        const float d = d_ptr[(p * groups + g) * kPanel + j], mn = m_ptr[(p * groups + g) * kPanel + j];
        for (int64_t kp = g * group / 2; kp < (g + 1) * group / 2; ++kp) {
          const uint8_t b = bytes[kp * kPanel];
          dst[2 * kp] = d * static_cast<float>(b & 15) + mn;
          dst[2 * kp + 1] = d * static_cast<float>(b >> 4) + mn;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendserve_cpu, m) {
  m.def("q4_linear(Tensor x, Tensor q, Tensor scales, Tensor mins, int n, Tensor? bias) -> Tensor");
  m.def("q4_linear_portable(Tensor x, Tensor q, Tensor scales, Tensor mins, int n, Tensor? bias) -> Tensor");
  m.def("q4_unpack(Tensor q, Tensor scales, Tensor mins, int n) -> Tensor");
  m.impl("q4_linear", c10::DispatchKey::CPU, TORCH_FN(q4_linear));
  m.impl("q4_unpack", c10::DispatchKey::CPU, TORCH_FN(q4_unpack));
  m.impl("q4_linear_portable", c10::DispatchKey::CPU, TORCH_FN(q4_linear_portable));
}
