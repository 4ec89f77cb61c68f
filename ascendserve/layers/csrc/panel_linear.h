// What the CPU linear kernels with a panel layout share (bf16_linear_cpu.cpp, q4_linear_cpu.cpp): the
// panel and tile sizes, the bias check, and the walk over (panel, block of rows) that the threads split.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace ascendserve_panel {

constexpr int64_t kPanel = 32;              // output rows per panel
constexpr int kMaxRows = 6;                 // x rows per register tile (the default row block)
constexpr int64_t kChunkBytes = 256 << 10;  // x rows per pass over the weight: about this many bytes

// The bias's data (nullptr without one), checked to be a contiguous fp32 [N] tensor.
inline const float* checked_bias(const c10::optional<at::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, op,
              ": bias must be a contiguous fp32 [N] tensor");
  return bias->data_ptr<float>();
}

// tile(p, m0, rows, cols) for every panel p and block of up to kRows rows from row m0 (cols: the
// panel's real output rows, fewer in the last). Threads split the panels; each walks its panels once
// per chunk of rows, a chunk's x slice (about kChunkBytes of k fp32 inputs) staying in the core's L2
// meanwhile (decode batches are one chunk), and a panel staying in L1/L2 while the chunk's blocks pass.
template <int kRows = kMaxRows, typename Tile>
void for_each_tile(int64_t m_rows, int64_t k, int64_t n, int64_t panels, const Tile& tile) {
  const int64_t chunk_rows = std::max<int64_t>(kRows, kChunkBytes / (4 * k) / kRows * kRows);
  at::parallel_for(0, panels, 1, [&](int64_t p_begin, int64_t p_end) {
    for (int64_t c0 = 0; c0 < m_rows; c0 += chunk_rows) {
      const int64_t c1 = std::min(m_rows, c0 + chunk_rows);
      for (int64_t p = p_begin; p < p_end; ++p) {
        const int64_t cols = std::min<int64_t>(kPanel, n - p * kPanel);
        for (int64_t m0 = c0; m0 < c1; m0 += kRows)
          tile(p, m0, static_cast<int>(std::min<int64_t>(kRows, c1 - m0)), cols);
      }
    }
  });
}

}  // namespace ascendserve_panel
