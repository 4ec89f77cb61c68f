// y = x @ W.T + b with W stored as 4-bit values on a grid per block of G inputs, W = d * q + m (fp32
// compute). G is the weight's (K / the scales' second size): 32 for a GGUF, 64 for --quantization int4.
//
// A Q4_0 / Q4_1 GGUF (the demo model) is dequantized at load to fp32 weights that are exactly such
// a grid: every block of 32 inputs of a row holds m + d * q with q in 0..15 (Q4_1: m = the block's
// minimum; Q4_0: m = -8 d). Keeping q (half a byte) and the block's d and m instead of the fp32
// values is the same weight in an eighth of the bytes. `--quantization int4` rounds an fp32 model's
// weights onto such a grid (layers/quantization.py). The product is computed as
//     y[n] = sum over blocks g of ( d[n,g] * sum_{k in g} x[k] q[n,k]  +  m[n,g] * sum_{k in g} x[k] )
// in fp32: the weights' own products, regrouped (a different rounding order, as any GEMM's). q4_linear_bf16x
// computes the same from bf16 x (a model run in bf16), see below.
//
// Packed layout (ascendserve/layers/compact_linear.py, pack_q4): rows in panels of 32 (N padded with zero
// rows), [N/32][K/2][32] bytes: for input pair kp, byte j = q[n][2kp] | q[n][2kp+1] << 4 for the
// panel's row j; scales and mins [N/32][K/G][32] fp32. The micro-kernel is the bf16 one's (up to 6
// x-rows by 32 outputs in registers, x broadcast, one panel streamed front to back), with a block
// accumulator folded into the output at the end of each block of G inputs.

#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bf16_convert.h"
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
// The end of block g of G inputs: acc[m] += d * (row m's block sums, the kSplit sets added) + mins * xsum[m][g].
template <int ROWS, int kSplit>
inline void fold_block(__m512 (&acc)[ROWS][2], const __m512 (&block)[ROWS][2 * kSplit], const float* xsum,
                       int64_t groups, int64_t g, const Q4Panel& w) {
  const __m512 d0 = _mm512_loadu_ps(w.scales + g * kPanel), d1 = _mm512_loadu_ps(w.scales + g * kPanel + 16);
  const __m512 m0 = _mm512_loadu_ps(w.mins + g * kPanel), m1 = _mm512_loadu_ps(w.mins + g * kPanel + 16);
  for (int m = 0; m < ROWS; ++m) {
    __m512 s0 = block[m][0], s1 = block[m][1];
    if constexpr (kSplit == 2) {
      s0 = _mm512_add_ps(s0, block[m][2]);
      s1 = _mm512_add_ps(s1, block[m][3]);
    }
    const __m512 s = _mm512_set1_ps(xsum[m * groups + g]);
    acc[m][0] = _mm512_fmadd_ps(d0, s0, _mm512_fmadd_ps(m0, s, acc[m][0]));
    acc[m][1] = _mm512_fmadd_ps(d1, s1, _mm512_fmadd_ps(m1, s, acc[m][1]));
  }
}

template <int ROWS>
void tile_avx512(const float* x, const float* xsum, int64_t ldx, int64_t groups, const Q4Panel& w, float* out,
                 int64_t ldo, int64_t cols, const float* bias) {
  __m512 acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  // q as fp32 by a lookup: vpermps reads only an index's low 4 bits, so a byte's low nibble needs no
  // mask, and neither nibble a conversion (per 32 weight bytes at one row, 12 instructions instead of
  // 14 with the widening loads and the FMAs: the tile is instruction-bound there, not bandwidth-bound).
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // One or two rows sum even and odd inputs apart (independent FMA chains: one row otherwise waits on two chained
  // FMAs per input pair; Zen 5, 2 threads, from DRAM at one row: 8192 x 1024 0.22 -> 0.14 ms, 7168 x 1024 0.16 ->
  // 0.12 ms); more rows have chains enough.
  constexpr int kSplit = ROWS <= 2 ? 2 : 1;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 block[ROWS][2 * kSplit];
    for (int m = 0; m < ROWS; ++m)
      for (int h = 0; h < 2 * kSplit; ++h) block[m][h] = _mm512_setzero_ps();
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
        block[m][2 * kSplit - 2] = _mm512_fmadd_ps(xo, qo0, block[m][2 * kSplit - 2]);
        block[m][2 * kSplit - 1] = _mm512_fmadd_ps(xo, qo1, block[m][2 * kSplit - 1]);
      }
    }
    fold_block<ROWS, kSplit>(acc, block, xsum, groups, g, w);
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
  ascendserve_panel::check_outputs(n, panels, kPanel, op);
  return group;
}

// The weight's block size G, after checking the pack and that x is a contiguous fp32 [M, K] matching it.
int64_t check_inputs(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& mins,
                     int64_t n, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous fp32 [M, K] tensor");
  const int64_t group = check_pack(q, scales, mins, n, op);
  TORCH_CHECK(x.size(1) == 2 * q.size(1), op, ": x has ", x.size(1), " columns, the weight ", 2 * q.size(1));
  return group;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& mins,
                  int64_t n, const c10::optional<at::Tensor>& bias, bool portable) {
  const int64_t group = check_inputs(x, q, scales, mins, n, "q4_linear");
  const int64_t m_rows = x.size(0), k = x.size(1), panels = q.size(0), groups = scales.size(1);
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

// ---- int8 activations (opt-in, not bit-exact): the same 4-bit weights times x rounded to int8 ----
//
// For large batches (prefill) the fp32 product above is arithmetic-bound. Here each row of x is rounded
// per block of 32 inputs to qx = round(x / dx), dx = max |x| / 127 (llama.cpp's Q8_1 for a Q4_1 model),
// and each block's sum over q * qx is an exact integer:
//     y[n] = sum over blocks b of ( d[n,g(b)] * dx[b] * sum_{k in b} q[n,k] qx[k]  +  m[n,g(b)] * sum_{k in b} x[k] )
// (the mins' factor uses the exact fp32 sum of x). AVX2's vpmaddubsw multiplies 32 byte pairs per
// instruction where an fp32 FMA does 8. Per panel, the threads first rewrite its nibbles as bytes laid
// out [K/4][32 outputs][4 inputs] in an L2-resident buffer (once per call, for all the rows), so that
// one vpmaddubsw + vpaddw per 8 outputs takes 4 inputs of a row (broadcast as one 32-bit word).
// Block sums stay 16-bit: each vpmaddubsw lane is at most 2 * 15 * 127 = 3810, a block of 32 inputs adds
// 8 of them (30480 < 32767). On the AMD EPYC (Zen 3) we measure, vpmaddubsw issues about once a cycle
// (2.0 G/s a core, a loop of independent maddubs + add: 64 G multiply-adds/s) and fp32 FMAs twice (16 lanes
// of multiply-adds a cycle against 32): this kernel runs the demo's prefill shapes at 170-210 GFLOP/s on 2
// threads, near that peak, where oneDNN's fp32 GEMM reaches 90-115. Where the build has AVX512-VNNI (Intel
// since Cascade Lake, AMD since Zen 4), vpdpbusd multiplies 64 byte pairs and adds them in fours onto 16 int32
// lanes in one instruction: the tile below takes all 32 outputs of a panel per register pair and 6 rows.

constexpr int64_t kActBlock = 32;  // inputs per dx
constexpr int kA8Rows = 4;         // x rows per register tile

// x [M, K] -> qx [M, K] int8, dx and sx [M, K/32]; rows split over the threads. sx: the exact sum of x, or with
// rounded_sums dx times the (exact, integer) sum of qx: what the 8-bit weights' +128 offset adds to a block (below).
void quantize_rows(const float* x, int64_t m_rows, int64_t k, int8_t* qx, float* dx, float* sx,
                   bool rounded_sums = false) {
  const int64_t blocks = k / kActBlock;
  at::parallel_for(0, m_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * blocks; i < end * blocks; ++i) {
      const float* src = x + i * kActBlock;
      float amax = 0.f, sum = 0.f;
      for (int64_t j = 0; j < kActBlock; ++j) {
        amax = std::max(amax, std::fabs(src[j]));
        sum += src[j];
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t qsum = 0;
      for (int64_t j = 0; j < kActBlock; ++j) {
        qx[i * kActBlock + j] = static_cast<int8_t>(std::nearbyint(src[j] * inv));
        qsum += qx[i * kActBlock + j];
      }
      dx[i] = amax / 127.f;
      sx[i] = rounded_sums ? dx[i] * static_cast<float>(qsum) : sum;
    }
  });
}

// The panel's nibbles as bytes, [K/4][32 outputs][4 inputs] (what the tile multiplies by): plain C++.
void unpack_panel_a8_portable(const uint8_t* q, int64_t k, uint8_t* w8) {
  for (int64_t kp = 0; kp < k / 2; ++kp)
    for (int64_t j = 0; j < kPanel; ++j) {
      uint8_t* dst = w8 + (kp / 2) * 4 * kPanel + j * 4 + (kp % 2) * 2;
      dst[0] = q[kp * kPanel + j] & 15;
      dst[1] = q[kp * kPanel + j] >> 4;
    }
}

// The same with AVX2 shuffles where the build has them.
void unpack_panel_a8(const uint8_t* q, int64_t k, uint8_t* w8) {
#if defined(__AVX2__)
  const __m256i nibble = _mm256_set1_epi8(15);
  for (int64_t s = 0; s < k / 4; ++s) {
    _mm_prefetch(reinterpret_cast<const char*>(q + (2 * s + kPrefetchPairs) * kPanel), _MM_HINT_T0);
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 2 * s * kPanel));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (2 * s + 1) * kPanel));
    const __m256i lo0 = _mm256_and_si256(l0, nibble), hi0 = _mm256_and_si256(_mm256_srli_epi16(l0, 4), nibble);
    const __m256i lo1 = _mm256_and_si256(l1, nibble), hi1 = _mm256_and_si256(_mm256_srli_epi16(l1, 4), nibble);
    // Byte pairs (inputs 4s, 4s+1) and (4s+2, 4s+3) per output, then quads; 128-bit lanes hold outputs
    // 0-15 and 16-31, put back in order by the last permutes.
    const __m256i a_lo = _mm256_unpacklo_epi8(lo0, hi0), a_hi = _mm256_unpackhi_epi8(lo0, hi0);
    const __m256i b_lo = _mm256_unpacklo_epi8(lo1, hi1), b_hi = _mm256_unpackhi_epi8(lo1, hi1);
    const __m256i c0 = _mm256_unpacklo_epi16(a_lo, b_lo), c1 = _mm256_unpackhi_epi16(a_lo, b_lo);
    const __m256i c2 = _mm256_unpacklo_epi16(a_hi, b_hi), c3 = _mm256_unpackhi_epi16(a_hi, b_hi);
    __m256i* dst = reinterpret_cast<__m256i*>(w8 + s * 4 * kPanel);
    _mm256_storeu_si256(dst, _mm256_permute2x128_si256(c0, c1, 0x20));
    _mm256_storeu_si256(dst + 1, _mm256_permute2x128_si256(c2, c3, 0x20));
    _mm256_storeu_si256(dst + 2, _mm256_permute2x128_si256(c0, c1, 0x31));
    _mm256_storeu_si256(dst + 3, _mm256_permute2x128_si256(c2, c3, 0x31));
  }
#else
  unpack_panel_a8_portable(q, k, w8);
#endif
}

// An 8-bit panel [K][32 outputs] (int8) as the tiles' bytes [K/4][32 outputs][4 inputs], each q + 128 (the sign bit
// flipped): vpdpbusd multiplies unsigned bytes by signed ones, so the tile sums (q + 128) qx and the fold takes off
// 128 dx sum(qx) with -128 d in the minimum's place (q8_a8_linear).
void unpack_panel8_a8(const int8_t* q, int64_t k, uint8_t* w8) {
  for (int64_t s = 0; s < k / 4; ++s)
    for (int64_t j = 0; j < kPanel; ++j)
      for (int t = 0; t < 4; ++t)
        w8[(s * kPanel + j) * 4 + t] = static_cast<uint8_t>(q[(4 * s + t) * kPanel + j]) ^ 0x80;
}

struct A8Rows {
  const int8_t* qx;  // [rows][K]
  const float* dx;   // [rows][K/32]
  const float* sx;   // [rows][K/32]
  int64_t k, blocks;
};

// Any CPU: the tile in plain C++ (the reference for the AVX2 one; integer block sums, fp32 above them).
void tile_a8_portable(int rows, const A8Rows& x, const uint8_t* w8, const float* d, const float* mn, int64_t group,
                      float (*acc)[kPanel]) {
  for (int m = 0; m < rows; ++m)
    for (int64_t j = 0; j < kPanel; ++j) acc[m][j] = 0.f;
  for (int64_t b = 0; b < x.blocks; ++b) {
    const int64_t g = b * kActBlock / group;
    for (int m = 0; m < rows; ++m) {
      const int8_t* a = x.qx + m * x.k + b * kActBlock;
      for (int64_t j = 0; j < kPanel; ++j) {
        int32_t isum = 0;
        for (int64_t s = 0; s < kActBlock / 4; ++s)
          for (int t = 0; t < 4; ++t) isum += w8[((b * kActBlock / 4 + s) * kPanel + j) * 4 + t] * a[4 * s + t];
        acc[m][j] += static_cast<float>(isum) * (d[g * kPanel + j] * x.dx[m * x.blocks + b]);
        acc[m][j] += mn[g * kPanel + j] * x.sx[m * x.blocks + b];
      }
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
template <int ROWS>
void tile_a8_avx2(const A8Rows& x, const uint8_t* w8, const float* d, const float* mn, int64_t group,
                  float (*acc)[kPanel]) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t per_group = group / kActBlock;  // blocks of x per (d, m) of the weight
  for (int h = 0; h < 2; ++h) {
    __m256 total[ROWS][2];
    for (int m = 0; m < ROWS; ++m) total[m][0] = total[m][1] = _mm256_setzero_ps();
    int64_t g = 0, in_group = 0;  // b / per_group without a division in the loop
    for (int64_t b = 0; b < x.blocks; ++b) {
      __m256i block[ROWS][2];
      for (int m = 0; m < ROWS; ++m) block[m][0] = block[m][1] = _mm256_setzero_si256();
      const uint8_t* w = w8 + b * (kActBlock / 4) * 4 * kPanel + 64 * h;
      for (int s = 0; s < kActBlock / 4; ++s) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + s * 4 * kPanel));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + s * 4 * kPanel + 32));
        for (int m = 0; m < ROWS; ++m) {
          const __m256i a = _mm256_castps_si256(
              _mm256_broadcast_ss(reinterpret_cast<const float*>(x.qx + m * x.k + b * kActBlock + 4 * s)));
          block[m][0] = _mm256_add_epi16(block[m][0], _mm256_maddubs_epi16(w0, a));
          block[m][1] = _mm256_add_epi16(block[m][1], _mm256_maddubs_epi16(w1, a));
        }
      }
      const float* dg = d + g * kPanel + 16 * h;
      const float* mg = mn + g * kPanel + 16 * h;
      for (int m = 0; m < ROWS; ++m) {
        const __m256 dxm = _mm256_broadcast_ss(x.dx + m * x.blocks + b);
        const __m256 sxm = _mm256_broadcast_ss(x.sx + m * x.blocks + b);
        for (int v = 0; v < 2; ++v) {
          const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(block[m][v], ones));
          total[m][v] = _mm256_fmadd_ps(isum, _mm256_mul_ps(_mm256_loadu_ps(dg + 8 * v), dxm), total[m][v]);
          total[m][v] = _mm256_fmadd_ps(_mm256_loadu_ps(mg + 8 * v), sxm, total[m][v]);
        }
      }
      if (++in_group == per_group) in_group = 0, ++g;
    }
    for (int m = 0; m < ROWS; ++m)
      for (int v = 0; v < 2; ++v) _mm256_storeu_ps(acc[m] + 16 * h + 8 * v, total[m][v]);
  }
}
#endif

#if defined(ASCENDSERVE_TILES_AVX512) && defined(__AVX512VNNI__)
#define ASCENDSERVE_A8_VNNI 1
constexpr int kVnniRows = 6;  // x rows per tile: 12 int32 block sums and 12 fp32 totals in registers

// Per block of 32 inputs and row: 8 broadcasts of 4 int8 inputs, 16 vpdpbusd (exact int32 sums: at most
// 32 * 15 * 127 a lane), then the block folded into fp32 as in the AVX2 tile.
template <int ROWS>
void tile_a8_vnni(const A8Rows& x, const uint8_t* w8, const float* d, const float* mn, int64_t group,
                  float (*acc)[kPanel]) {
  const int64_t per_group = group / kActBlock;
  __m512 total[ROWS][2];
  for (int m = 0; m < ROWS; ++m) total[m][0] = total[m][1] = _mm512_setzero_ps();
  int64_t g = 0, in_group = 0;
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m512i block[ROWS][2];
    for (int m = 0; m < ROWS; ++m) block[m][0] = block[m][1] = _mm512_setzero_si512();
    const uint8_t* w = w8 + b * (kActBlock / 4) * 4 * kPanel;
    const int8_t* a = x.qx + b * kActBlock;
    for (int s = 0; s < kActBlock / 4; ++s) {
      const __m512i w0 = _mm512_loadu_si512(w + s * 4 * kPanel);
      const __m512i w1 = _mm512_loadu_si512(w + s * 4 * kPanel + 64);
      for (int m = 0; m < ROWS; ++m) {
        int32_t quad;
        std::memcpy(&quad, a + m * x.k + 4 * s, sizeof quad);
        const __m512i am = _mm512_set1_epi32(quad);
        block[m][0] = _mm512_dpbusd_epi32(block[m][0], w0, am);
        block[m][1] = _mm512_dpbusd_epi32(block[m][1], w1, am);
      }
    }
    const float* dg = d + g * kPanel;
    const float* mg = mn + g * kPanel;
    for (int m = 0; m < ROWS; ++m) {
      const __m512 dxm = _mm512_set1_ps(x.dx[m * x.blocks + b]);
      const __m512 sxm = _mm512_set1_ps(x.sx[m * x.blocks + b]);
      for (int v = 0; v < 2; ++v) {
        const __m512 isum = _mm512_cvtepi32_ps(block[m][v]);
        total[m][v] = _mm512_fmadd_ps(isum, _mm512_mul_ps(_mm512_loadu_ps(dg + 16 * v), dxm), total[m][v]);
        total[m][v] = _mm512_fmadd_ps(_mm512_loadu_ps(mg + 16 * v), sxm, total[m][v]);
      }
    }
    if (++in_group == per_group) in_group = 0, ++g;
  }
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < 2; ++v) _mm512_storeu_ps(acc[m] + 16 * v, total[m][v]);
}
#endif

// Which tile q4_a8_linear runs in this build.
std::string q4_a8_tile() {
#if defined(ASCENDSERVE_A8_VNNI)
  return "avx512_vnni";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

#if defined(ASCENDSERVE_A8_VNNI)
constexpr int kA8TileRows = kVnniRows;
#else
constexpr int kA8TileRows = kA8Rows;
#endif

// eight_bit: q is an 8-bit panel pack [N/32, K, 32] int8 and mins unused (q8_a8_linear: each panel's -128 d is made
// here), else a 4-bit one.
at::Tensor a8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& mins,
                     int64_t n, const c10::optional<at::Tensor>& bias, bool portable, bool eight_bit = false) {
  const char* op = eight_bit ? "q8_a8_linear" : "q4_a8_linear";
  int64_t group;
  if (eight_bit) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
                ": x must be a contiguous fp32 [M, K] tensor");
    group = ascendserve_panel::check_q8_pack(x, q, scales, n, op);
  } else {
    group = check_inputs(x, q, scales, mins, n, op);
  }
  const int64_t m_rows = x.size(0), k = x.size(1), panels = q.size(0);
  TORCH_CHECK(group % kActBlock == 0, op, ": the weight's block size ", group, " is not a multiple of 32");
  const float* bias_ptr = ascendserve_panel::checked_bias(bias, n, op);
  at::Tensor out = at::empty({m_rows, n}, x.options());
  if (m_rows == 0) return out;
  const int64_t blocks = k / kActBlock;
  std::vector<int8_t> qx(m_rows * k);
  std::vector<float> dx(m_rows * blocks), sx(m_rows * blocks);
  quantize_rows(x.data_ptr<float>(), m_rows, k, qx.data(), dx.data(), sx.data(), eight_bit);
  const uint8_t* q_ptr = static_cast<const uint8_t*>(q.data_ptr());
  const float* d_ptr = scales.data_ptr<float>();
  const float* m_ptr = eight_bit ? nullptr : mins.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p_begin, int64_t p_end) {
    std::vector<uint8_t> w8(k * kPanel);
    std::vector<float> offsets(eight_bit ? (k / group) * kPanel : 0);  // an 8-bit panel's -128 d
    for (int64_t p = p_begin; p < p_end; ++p) {
      const float* d = d_ptr + p * (k / group) * kPanel;
      const float* mn;
      if (eight_bit) {
        unpack_panel8_a8(reinterpret_cast<const int8_t*>(q_ptr) + p * k * kPanel, k, w8.data());
        for (size_t i = 0; i < offsets.size(); ++i) offsets[i] = -128.f * d[i];
        mn = offsets.data();
      } else {
        (portable ? unpack_panel_a8_portable : unpack_panel_a8)(q_ptr + p * (k / 2) * kPanel, k, w8.data());
        mn = m_ptr + p * (k / group) * kPanel;
      }
      const int64_t cols = std::min<int64_t>(kPanel, n - p * kPanel);
      const float* panel_bias = bias_ptr ? bias_ptr + p * kPanel : nullptr;
      const int tile_rows = portable ? kA8Rows : kA8TileRows;
      for (int64_t m0 = 0; m0 < m_rows; m0 += tile_rows) {
        const int rows = static_cast<int>(std::min<int64_t>(tile_rows, m_rows - m0));
        const A8Rows xr{qx.data() + m0 * k, dx.data() + m0 * blocks, sx.data() + m0 * blocks, k, blocks};
        float acc[std::max(kA8Rows, kA8TileRows)][kPanel];
#if defined(ASCENDSERVE_A8_VNNI)
        if (!portable) {
          ascendserve_panel::with_tile_rows<kVnniRows>(rows, [&](auto r) {
            tile_a8_vnni<decltype(r)::value>(xr, w8.data(), d, mn, group, acc);
          });
        } else
#elif defined(__AVX2__) && defined(__FMA__)
        if (!portable && !eight_bit) {  // vpmaddubsw's 16-bit pair sums overflow for bytes up to 255
          ascendserve_panel::with_tile_rows<kA8Rows>(rows, [&](auto r) {
            tile_a8_avx2<decltype(r)::value>(xr, w8.data(), d, mn, group, acc);
          });
        } else
#endif
          tile_a8_portable(rows, xr, w8.data(), d, mn, group, acc);
        ascendserve_panel::store_rows(acc, rows, out_ptr + m0 * n + p * kPanel, n, cols, panel_bias);
      }
    }
  });
  return out;
}

at::Tensor q4_a8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& mins,
                        int64_t n, const c10::optional<at::Tensor>& bias) {
  return a8_linear(x, q, scales, mins, n, bias, false);
}

at::Tensor q4_a8_linear_portable(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                                 const at::Tensor& mins, int64_t n, const c10::optional<at::Tensor>& bias) {
  return a8_linear(x, q, scales, mins, n, bias, true);
}

// The same for an 8-bit panel pack (GridInt8Linear, --activation-quantization int8): y = sum over blocks of
// d dx sum((q + 128) qx) + (-128 d) (dx sum(qx)), the +128 that makes q an unsigned byte taken off exactly (integer
// sums; -128 d in the place of the 4-bit kernel's minimum). On AVX512-VNNI's tile, else the portable one (AVX2's would
// saturate).
at::Tensor q8_a8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n,
                        const c10::optional<at::Tensor>& bias) {
  return a8_linear(x, q, scales, scales, n, bias, false, true);
}

at::Tensor q8_a8_linear_portable(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n,
                                 const c10::optional<at::Tensor>& bias) {
  return a8_linear(x, q, scales, scales, n, bias, true, true);
}

// ---- bf16 activations (a model run in bf16 with --quantization int4) ----
//
// The same sums from bf16 x: per block of G inputs, sum_k x[k] q[n,k] on vdpbf16ps (AVX512-BF16), then
// d * that + m * sum_k x[k] in fp32. q (0..15) is exact in bf16 and vdpbf16ps's products are exact with fp32
// sums, so the arithmetic is the fp32 kernel's on the same (bf16) x, in another summation order. Per input pair a
// panel's 32 bytes become two registers of weight pairs: each byte widened to a 32-bit lane, its high nibble moved
// to bits 16-19 (lane | lane << 12, masked), and both 16-bit halves looked up in a table of bf16(0..15) (vpermw):
// 8 instructions per 64 weights, for any number of rows; each row then adds 2 vdpbf16ps. One or two rows keep
// even and odd pairs in separate sums (independent chains: one row is otherwise bound by vdpbf16ps's latency).
// Without AVX512-BF16, x is widened to fp32 (exact) and the fp32 tiles above multiply.

#if defined(ASCENDSERVE_TILES_AVX512) && defined(__AVX512BF16__)
#define ASCENDSERVE_Q4_DOT 1
constexpr int kDotRows = 12;  // x rows per tile: 24 registers of block sums

using ascendserve_panel::PairBf16;

inline PairBf16 pair_bf16(const uint8_t* bytes, const __m512i& table) {
  const __m512i mask = _mm512_set1_epi32(0x000f000f);
  _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchPairs * kPanel), _MM_HINT_T0);
  const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)));
  // (b | b << 12) & 0x000f000f: the low nibble in bits 0-3, the high one in bits 16-19 (ternary 0xA8: (A | B) & C)
  const __m512i n0 = _mm512_ternarylogic_epi32(b0, _mm512_slli_epi32(b0, 12), mask, 0xA8);
  const __m512i n1 = _mm512_ternarylogic_epi32(b1, _mm512_slli_epi32(b1, 12), mask, 0xA8);
  return {(__m512bh)_mm512_permutexvar_epi16(n0, table), (__m512bh)_mm512_permutexvar_epi16(n1, table)};
}

// bf16(0..15) in the low 16 of 32 words (vpermw reads an index's low 5 bits; the nibbles are 0..15).
inline __m512i nibble_table() {
  alignas(64) uint16_t words[32] = {};
  for (int v = 0; v < 16; ++v) {
    const float f = static_cast<float>(v);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    words[v] = static_cast<uint16_t>(bits >> 16);  // exact: small integers have 8 significant bits at most
  }
  return _mm512_load_si512(words);
}

// Out: float (the fp32 sums) or at::BFloat16 (rounded once). x: bf16 pairs as 32-bit words, ldx in pairs; table:
// nibble_table(), built once per call.
template <int ROWS, typename Out>
void tile_dot(const uint32_t* x, int64_t ldx, const float* xsum, int64_t groups, const Q4Panel& w,
              const __m512i& table, Out* out, int64_t ldo, int64_t cols, const float* bias) {
  __m512 acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  ascendserve_panel::dot_pair_blocks<ROWS>(
      x, ldx, groups, w.group / 2, [&](int64_t kp) { return pair_bf16(w.q + kp * kPanel, table); },
      [&](int64_t g, const auto& block) {
        fold_block<ROWS, ascendserve_panel::kPairSplit<ROWS>>(acc, block, xsum, groups, g, w);
      });
  ascendserve_panel::store_tile<ROWS>(acc, out, ldo, cols, bias);
}

// Per row and block of G inputs, the fp32 sum of bf16 x (the mins' factor), rows split over the threads.
std::vector<float> block_sums_bf16(const at::BFloat16* x, int64_t m_rows, int64_t k, int64_t group) {
  const int64_t groups = k / group;
  std::vector<float> xsum(m_rows * groups);
  at::parallel_for(0, m_rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * groups; i < end * groups; ++i) {
      const at::BFloat16* src = x + i * group;
      int64_t j = 0;
      __m512 lanes = _mm512_setzero_ps();  // 16 partial sums, then added up (a torch sum's dispatch costs more)
      for (; j + 16 <= group; j += 16) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j));
        lanes = _mm512_add_ps(lanes, ascendserve_bf16::widen16(raw));
      }
      float sum = _mm512_reduce_add_ps(lanes);
      for (; j < group; ++j) sum += static_cast<float>(src[j]);
      xsum[i] = sum;
    }
  });
  return xsum;
}
#endif

// y = x @ W.T + b for bf16 x [M, K] (bias fp32), the fp32 sums rounded to bf16 where bf16_out. On the vdpbf16ps
// tile where the build has AVX512-BF16 (every batch size: a row's sums do not depend on its batch), else x widened
// to fp32 (exact) through q4_linear's tiles.
at::Tensor q4_linear_bf16x(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& mins,
                           int64_t n, const c10::optional<at::Tensor>& bias, bool bf16_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "q4_linear_bf16x: x must be a contiguous bf16 [M, K] tensor");
#if defined(ASCENDSERVE_Q4_DOT)
  const int64_t group = check_pack(q, scales, mins, n, "q4_linear_bf16x");
  TORCH_CHECK(x.size(1) == 2 * q.size(1), "q4_linear_bf16x: x has ", x.size(1), " columns, the weight ",
              2 * q.size(1));
  const float* bias_ptr = ascendserve_panel::checked_bias(bias, n, "q4_linear_bf16x");
  const int64_t m_rows = x.size(0), k = x.size(1), panels = q.size(0), groups = scales.size(1), kpairs = k / 2;
  at::Tensor out = at::empty({m_rows, n}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (m_rows == 0) return out;
  const std::vector<float> xsum = block_sums_bf16(x.data_ptr<at::BFloat16>(), m_rows, k, group);
  const uint32_t* x_ptr = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const uint8_t* q_ptr = q.data_ptr<uint8_t>();
  const float* d_ptr = scales.data_ptr<float>();
  const float* m_ptr = mins.data_ptr<float>();
  const __m512i table = nibble_table();
  auto run = [&](auto* out_ptr) {
    ascendserve_panel::for_each_tile<kDotRows>(m_rows, k, n, panels, [&](int64_t p, int64_t m0, int rows,
                                                                         int64_t cols) {
      const Q4Panel w{q_ptr + p * kpairs * kPanel, d_ptr + p * groups * kPanel, m_ptr + p * groups * kPanel, group};
      ascendserve_panel::with_tile_rows<kDotRows>(rows, [&](auto r) {
        tile_dot<decltype(r)::value>(x_ptr + m0 * kpairs, kpairs, xsum.data() + m0 * groups, groups, w, table,
                                     out_ptr + m0 * n + p * kPanel, n, cols,
                                     bias_ptr ? bias_ptr + p * kPanel : nullptr);
      });
    });
  };
  ascendserve_panel::with_out_ptr(out, bf16_out, run);
  return out;
#else
  at::Tensor out = linear(x.to(at::kFloat), q, scales, mins, n, bias, false);
  return bf16_out ? out.to(at::kBFloat16) : out;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendserve_cpu, m) {
  m.def("q4_linear(Tensor x, Tensor q, Tensor scales, Tensor mins, int n, Tensor? bias) -> Tensor");
  m.def("q4_linear_portable(Tensor x, Tensor q, Tensor scales, Tensor mins, int n, Tensor? bias) -> Tensor");
  m.def("q4_unpack(Tensor q, Tensor scales, Tensor mins, int n) -> Tensor");
  m.def("q4_a8_linear(Tensor x, Tensor q, Tensor scales, Tensor mins, int n, Tensor? bias) -> Tensor");
  m.def("q4_a8_linear_portable(Tensor x, Tensor q, Tensor scales, Tensor mins, int n, Tensor? bias) -> Tensor");
  m.def("q8_a8_linear(Tensor x, Tensor q, Tensor scales, int n, Tensor? bias) -> Tensor");
  m.def("q8_a8_linear_portable(Tensor x, Tensor q, Tensor scales, int n, Tensor? bias) -> Tensor");
  m.def("q4_linear_bf16x(Tensor x, Tensor q, Tensor scales, Tensor mins, int n, Tensor? bias, bool bf16_out) "
        "-> Tensor");
  m.impl("q4_linear", c10::DispatchKey::CPU, TORCH_FN(q4_linear));
  m.impl("q4_linear_bf16x", c10::DispatchKey::CPU, TORCH_FN(q4_linear_bf16x));
  m.impl("q4_unpack", c10::DispatchKey::CPU, TORCH_FN(q4_unpack));
  m.impl("q4_linear_portable", c10::DispatchKey::CPU, TORCH_FN(q4_linear_portable));
  m.impl("q4_a8_linear", c10::DispatchKey::CPU, TORCH_FN(q4_a8_linear));
  m.impl("q4_a8_linear_portable", c10::DispatchKey::CPU, TORCH_FN(q4_a8_linear_portable));
  m.impl("q8_a8_linear", c10::DispatchKey::CPU, TORCH_FN(q8_a8_linear));
  m.impl("q8_a8_linear_portable", c10::DispatchKey::CPU, TORCH_FN(q8_a8_linear_portable));
  m.def("q4_a8_tile() -> str", &q4_a8_tile);
}
