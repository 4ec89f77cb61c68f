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

#include "f32_tile.h"
#include "panel_linear.h"

namespace {

using ascendserve_f32::kTileCols;
using ascendserve_f32::kTileRows;
using ascendserve_f32::TileOut;
using ascendserve_f32::tile_fast;
using ascendserve_f32::tile_portable;

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
