// y = x @ W.T + b for fp32 x and W on CPUs, W packed once at load into panels of 16 output columns.
//
// The GEMM's shape is the textbook one (Goto / BLIS): a register tile of 6 x-rows by 16 outputs (12
// AVX2 accumulators, two weight vectors and one broadcast x value: 15 of the 16 registers) walks the
// depth k; x is copied per call into blocks of 6 rows interleaved by input ([k][6], rows past M zero),
// so the tile reads both operands front to back. Loops, outside in: the thread's panels in groups of
// kPanelsPerGroup (their outputs, for every row, stay in L2 / L3 between the depth blocks); the depth in
// blocks of at most ~kMaxDepth inputs (a panel's block, kc x 16 fp32, stays in L1 / L2 while the row
// blocks pass over it); the rows in blocks of kRowBlock (x's block stays in L2 while the group's panels
// pass); the group's panels; the rows' 6-row tiles. The threads split the panels, so each streams its
// share of the weight from DRAM once per call whatever the batch.
//
// Why not MKL / oneDNN: on the 2-vCPU AMD EPYC (Zen 3, AVX2) the demo model's fp32 linears at decode
// batch sizes took 1.3-2.2x longer through oneDNN's GEMM than through this one (a pass over its 121
// layers: 64 rows 165 vs 123 ms, 16 rows 91 vs 55, 1 row 45 vs 30), and MKL's was slower still; at
// prefill sizes (2048 rows) the three are level, near 65% of the cores' FMA peak.
// layers/linear.py probes which GEMM to use once per process.

#include <torch/library.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "panel_linear.h"

namespace {

constexpr int kTileRows = 6;                // x rows per register tile
constexpr int64_t kTileCols = 16;           // outputs per panel (and per register tile)
constexpr int64_t kRowBlock = 72;           // x rows per block (12 tiles: 72 x kc fp32 in L2)
constexpr int64_t kPanelsPerGroup = 16;     // panels whose outputs stay in cache across the depth blocks
constexpr int64_t kMaxDepth = 640;          // inputs per depth block at most (blocks of equal size)
constexpr int64_t kSerialPackElems = 1 << 16;  // x copies below this many values are made by one thread

// Inputs per depth block: k itself up to kMaxDepth, else k split into equal blocks no larger.
inline int64_t depth_block(int64_t k) {
  const int64_t blocks = (k + kMaxDepth - 1) / kMaxDepth;
  return (k + blocks - 1) / blocks;
}

// W [N, K] fp32 -> [ceil(N/16), K, 16]: panel p holds outputs 16p .. 16p + 15, input by input; the last
// panel's missing outputs are zero.
at::Tensor f32_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "f32_pack: weight must be fp32 [N, K]");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kTileCols - 1) / kTileCols;
  at::Tensor packed = at::zeros({panels, k, kTileCols}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kTileCols, n - p * kTileCols);
      for (int64_t j = 0; j < cols; ++j) {
        const float* row = src + (p * kTileCols + j) * k;
        float* out = dst + p * k * kTileCols + j;
        for (int64_t i = 0; i < k; ++i) out[i * kTileCols] = row[i];
      }
    }
  });
  return packed;
}

// The tile's outputs go to out (ldo apart) for its rows and cols: the first depth block stores acc + bias
// (bias may be nullptr), the later ones add acc to what is there.
struct TileOut {
  float* out;
  int64_t ldo;
  int rows;
  int64_t cols;
  const float* bias;
  bool first;

  void store_row(int m, const float* acc) const {
    float* row = out + m * ldo;
    for (int64_t j = 0; j < cols; ++j) row[j] = first ? acc[j] + (bias ? bias[j] : 0.f) : row[j] + acc[j];
  }
};

// Any CPU: the tile in plain C++ (also the reference the AVX2 tile is tested against).
void tile_portable(int64_t kc, const float* a, const float* b, const TileOut& to) {
  float acc[kTileRows][kTileCols] = {};
  for (int64_t i = 0; i < kc; ++i)
    for (int m = 0; m < kTileRows; ++m)
      for (int64_t j = 0; j < kTileCols; ++j) acc[m][j] += a[i * kTileRows + m] * b[i * kTileCols + j];
  for (int m = 0; m < to.rows; ++m) to.store_row(m, acc[m]);
}

#if defined(ASCENDSERVE_TILES_AVX512) || defined(ASCENDSERVE_TILES_AVX2)
inline void store_avx2(const TileOut& to, int m, __m256 lo, __m256 hi) {
  float* row = to.out + m * to.ldo;
  if (to.cols == kTileCols) {
    if (to.first) {
      if (to.bias) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(to.bias));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(to.bias + 8));
      }
    } else {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(row));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(row + 8));
    }
    _mm256_storeu_ps(row, lo);
    _mm256_storeu_ps(row + 8, hi);
    return;
  }
  alignas(32) float acc[kTileCols];
  _mm256_store_ps(acc, lo);
  _mm256_store_ps(acc + 8, hi);
  to.store_row(m, acc);
}

// One x row's step: x broadcast, times the 16 weights of this input, into the row's two accumulators (inlined,
// so the accumulators stay in registers).
__attribute__((always_inline)) inline void fma_row(const float* x, __m256 b0, __m256 b1, __m256& lo, __m256& hi) {
  const __m256 xv = _mm256_broadcast_ss(x);
  lo = _mm256_fmadd_ps(xv, b0, lo);
  hi = _mm256_fmadd_ps(xv, b1, hi);
}

// The accumulators are named variables, not an array: an array of __m256 was kept on the stack by gcc
// (a load and a store around every FMA, 3x slower).
void tile_fast(int64_t kc, const float* a, const float* b, const TileOut& to) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#pragma GCC unroll 4
  for (int64_t i = 0; i < kc; ++i) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    fma_row(a, b0, b1, c00, c01);
    fma_row(a + 1, b0, b1, c10, c11);
    fma_row(a + 2, b0, b1, c20, c21);
    fma_row(a + 3, b0, b1, c30, c31);
    fma_row(a + 4, b0, b1, c40, c41);
    fma_row(a + 5, b0, b1, c50, c51);
    a += kTileRows;
    b += kTileCols;
  }
  store_avx2(to, 0, c00, c01);
  if (to.rows > 1) store_avx2(to, 1, c10, c11);
  if (to.rows > 2) store_avx2(to, 2, c20, c21);
  if (to.rows > 3) store_avx2(to, 3, c30, c31);
  if (to.rows > 4) store_avx2(to, 4, c40, c41);
  if (to.rows > 5) store_avx2(to, 5, c50, c51);
}
#else
void tile_fast(int64_t kc, const float* a, const float* b, const TileOut& to) { tile_portable(kc, a, b, to); }
#endif

// x [M, K] -> [ceil(M/6), K, 6]: each block of 6 rows interleaved by input, rows past M zero.
at::Tensor pack_rows(const at::Tensor& x) {
  const int64_t m_rows = x.size(0), k = x.size(1), blocks = (m_rows + kTileRows - 1) / kTileRows;
  at::Tensor packed = at::empty({blocks, k, kTileRows}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  auto pack = [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m_rows - blk * kTileRows));
      float* out = dst + blk * k * kTileRows;
      const float* in = src + blk * kTileRows * k;
      for (int64_t i = 0; i < k; ++i)
        for (int m = 0; m < kTileRows; ++m) out[i * kTileRows + m] = m < rows ? in[m * k + i] : 0.f;
    }
  };
  if (m_rows * k < kSerialPackElems) pack(0, blocks);
  else at::parallel_for(0, blocks, 1, pack);
  return packed;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                  bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "f32_linear: x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
              packed.size(2) == kTileCols, "f32_linear: packed must be fp32 [N/16, K, 16]");
  const int64_t m_rows = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(k == packed.size(1), "f32_linear: x has ", k, " columns, the weight ", packed.size(1));
  ascendserve_panel::check_outputs(n, panels, kTileCols, "f32_linear");
  const float* bias_ptr = ascendserve_panel::checked_bias(bias, n, "f32_linear");
  at::Tensor out = at::empty({m_rows, n}, x.options());
  if (m_rows == 0) return out;
  if (k == 0) return bias_ptr ? bias->expand({m_rows, n}).contiguous() : out.zero_();
  const at::Tensor rows_packed = pack_rows(x);
  const float* a_ptr = rows_packed.data_ptr<float>();
  const float* w_ptr = packed.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t kc_max = depth_block(k);
  auto tile = portable ? tile_portable : tile_fast;
  at::parallel_for(0, panels, 1, [&](int64_t p_begin, int64_t p_end) {
    for (int64_t g0 = p_begin; g0 < p_end; g0 += kPanelsPerGroup) {
      const int64_t g1 = std::min(p_end, g0 + kPanelsPerGroup);
      for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
        const int64_t kc = std::min(kc_max, k - k0);
        for (int64_t m0 = 0; m0 < m_rows; m0 += kRowBlock) {
          const int64_t m1 = std::min(m_rows, m0 + kRowBlock);
          for (int64_t p = g0; p < g1; ++p) {
            const float* b = w_ptr + (p * k + k0) * kTileCols;
            const int64_t cols = std::min(kTileCols, n - p * kTileCols);
            for (int64_t r = m0; r < m1; r += kTileRows) {
              const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m1 - r));
              const TileOut to{out_ptr + r * n + p * kTileCols, n, rows, cols,
                               bias_ptr ? bias_ptr + p * kTileCols : nullptr, k0 == 0};
              tile(kc, a_ptr + (r / kTileRows * k + k0) * kTileRows, b, to);
            }
          }
        }
      }
    }
  });
  return out;
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  return linear(x, packed, n, bias, false);
}

at::Tensor f32_linear_portable(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                               const c10::optional<at::Tensor>& bias) {
  return linear(x, packed, n, bias, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendserve_cpu, m) {
  m.def("f32_pack(Tensor weight) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("f32_linear_portable(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.impl("f32_pack", c10::DispatchKey::CPU, TORCH_FN(f32_pack));
  m.impl("f32_linear", c10::DispatchKey::CPU, TORCH_FN(f32_linear));
  m.impl("f32_linear_portable", c10::DispatchKey::CPU, TORCH_FN(f32_linear_portable));
}
