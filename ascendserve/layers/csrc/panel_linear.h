// What the CPU linear kernels with a panel layout share (bf16_linear_cpu.cpp, q4_linear_cpu.cpp): the
// panel and tile sizes, the bias check, and the walk over (panel, block of rows) that the threads split.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The tiles' instruction sets: AVX-512 (32 outputs as two 16-lane registers), else AVX2 with FMA (16
// registers of 8 lanes: a tile works on half a panel at a time, up to kAvx2Rows rows), else plain C++.
#if defined(__AVX512F__)
#define ASCENDSERVE_TILES_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define ASCENDSERVE_TILES_AVX2 1
#endif

namespace ascendserve_panel {

constexpr int64_t kPanel = 32;              // output rows per panel
constexpr int kMaxRows = 6;                 // x rows per register tile (the default row block)
// x rows per pass over the weight: at most about this many bytes of x, which stays in the core's L2
// (1.25-2 MiB on the Xeons we measure) while the panels stream past. Each pass reads the whole weight
// from DRAM again: with 256 KiB, a 64-row Qwen3.5 decode step made 2 passes over the k=1024 layers
// (60 rows + 4) and 6 over the k=3584 ones, and the step took 764 ms; with 1 MiB (one pass) 663 ms.
constexpr int64_t kChunkBytes = 1 << 20;

// The bias's data (nullptr without one), checked to be a contiguous fp32 [N] tensor.
inline const float* checked_bias(const c10::optional<at::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, op,
              ": bias must be a contiguous fp32 [N] tensor");
  return bias->data_ptr<float>();
}

// Checks that n outputs fill `panels` panels of `width` outputs each, the last one at least partly.
inline void check_outputs(int64_t n, int64_t panels, int64_t width, const char* op) {
  TORCH_CHECK(n > (panels - 1) * width && n <= panels * width, op, ": n=", n, " does not match ", panels, " panels");
}

// Rows per chunk for m_rows rows of row_bytes each: whole blocks of kRows rows holding at most about chunk_bytes
// (at least one block), the chunks of about equal size, so that none is a sliver that streams the weight for a few
// rows.
inline int64_t chunk_rows(int64_t m_rows, int64_t row_bytes, int64_t k_rows, int64_t chunk_bytes) {
  const int64_t max_chunk_rows = std::max<int64_t>(k_rows, chunk_bytes / row_bytes / k_rows * k_rows);
  const int64_t chunks = std::max<int64_t>(1, (m_rows + max_chunk_rows - 1) / max_chunk_rows);
  return ((m_rows + chunks - 1) / chunks + k_rows - 1) / k_rows * k_rows;
}

// tile(p, m0, rows, cols) for every panel p and block of up to kRows rows from row m0 (cols: the
// panel's real output rows, fewer in the last). Threads split the panels; each walks its panels once
// per chunk of rows, a chunk's x slice (at most about kChunkBytes of k fp32 inputs) staying in the
// core's L2 meanwhile (decode batches are one chunk), and a panel staying in L1/L2 while the chunk's
// blocks pass.
template <int kRows = kMaxRows, typename Tile>
void for_each_tile(int64_t m_rows, int64_t k, int64_t n, int64_t panels, const Tile& tile) {
  const int64_t rows_per_chunk = chunk_rows(m_rows, 4 * k, kRows, kChunkBytes);
  at::parallel_for(0, panels, 1, [&](int64_t p_begin, int64_t p_end) {
    for (int64_t c0 = 0; c0 < m_rows; c0 += rows_per_chunk) {
      const int64_t c1 = std::min(m_rows, c0 + rows_per_chunk);
      for (int64_t p = p_begin; p < p_end; ++p) {
        const int64_t cols = std::min<int64_t>(kPanel, n - p * kPanel);
        for (int64_t m0 = c0; m0 < c1; m0 += kRows)
          tile(p, m0, static_cast<int>(std::min<int64_t>(kRows, c1 - m0)), cols);
      }
    }
  });
}

// fn(std::integral_constant<int, R>{}) with R = min(rows, kMax), rows >= 1: a tile's row count as a
// compile-time constant (one instantiation of the tile per height).
template <int kMax, typename Fn>
inline void with_tile_rows(int rows, const Fn& fn) {
  if constexpr (kMax > 1) {
    if (rows < kMax) return with_tile_rows<kMax - 1>(rows, fn);
  }
  fn(std::integral_constant<int, kMax>{});
}

// fn(m0, std::integral_constant<int, R>{}) for the tile's rows in blocks of R <= kMax rows from row m0.
template <int kMax, typename Fn>
inline void in_row_blocks(int rows, const Fn& fn) {
  for (int m0 = 0; m0 < rows; m0 += kMax) with_tile_rows<kMax>(std::min(kMax, rows - m0), [&](auto r) { fn(m0, r); });
}

// run(p) with p out's data as at::BFloat16 where bf16_out (the sums rounded as stored), else as float.
template <typename Run>
inline void with_out_ptr(const at::Tensor& out, bool bf16_out, const Run& run) {
  if (bf16_out) {
    run(out.data_ptr<at::BFloat16>());
  } else {
    run(out.data_ptr<float>());
  }
}

// out[m][0 .. cols) = acc[m] + bias for a tile's rows kept in memory (bias may be nullptr).
inline void store_rows(const float (*acc)[kPanel], int rows, float* out, int64_t ldo, int64_t cols, const float* bias) {
  for (int m = 0; m < rows; ++m)
    for (int64_t j = 0; j < cols; ++j) out[m * ldo + j] = acc[m][j] + (bias ? bias[j] : 0.f);
}

// fp32 lanes per register of the tiles: 16 (AVX-512), 8 (AVX2), 0 (portable loops only). Where the
// kernels stop paying off against a dense GEMM depends on it (layers/quantization.py).
inline int64_t tile_lanes() {
#if defined(ASCENDSERVE_TILES_AVX512)
  return 16;
#elif defined(ASCENDSERVE_TILES_AVX2)
  return 8;
#else
  return 0;
#endif
}

// Whether the tiles were compiled for a SIMD instruction set (else only the portable loops, which are
// slower than MKL's fp32 GEMM: the layers then keep their fp32 weights).
inline bool simd_tiles() { return tile_lanes() > 0; }

#if defined(ASCENDSERVE_TILES_AVX2)
constexpr int kAvx2Rows = 4;  // x rows per AVX2 register tile
#endif

#if defined(ASCENDSERVE_TILES_AVX512)
// out[m][0 .. cols) = acc[m] + bias for a tile's ROWS rows of 32 outputs, two 16-lane halves each (the
// last panel's columns masked off; bias may be nullptr).
template <int ROWS>
inline void store_tile(const __m512 (&acc)[ROWS][2], float* out, int64_t ldo, int64_t cols, const float* bias) {
  const __mmask16 mask0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 mask1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(mask0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(mask1, bias + 16) : _mm512_setzero_ps();
  for (int m = 0; m < ROWS; ++m) {
    _mm512_mask_storeu_ps(out + m * ldo, mask0, _mm512_add_ps(acc[m][0], b0));
    _mm512_mask_storeu_ps(out + m * ldo + 16, mask1, _mm512_add_ps(acc[m][1], b1));
  }
}
#endif

#if defined(ASCENDSERVE_TILES_AVX512) && defined(__AVX512BF16__)
// out[m][0 .. cols) = acc[m] + bias rounded to bf16 (vcvtneps2bf16: to nearest even), the last panel's columns
// masked off; bias may be nullptr.
template <int ROWS>
inline void store_tile_bf16(const __m512 (&acc)[ROWS][2], at::BFloat16* out, int64_t ldo, int64_t cols,
                            const float* bias) {
  const __mmask16 mask0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 mask1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(mask0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(mask1, bias + 16) : _mm512_setzero_ps();
  for (int m = 0; m < ROWS; ++m) {
    const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][0], b0));
    const __m256i hi = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][1], b1));
    _mm256_mask_storeu_epi16(out + m * ldo, mask0, lo);
    _mm256_mask_storeu_epi16(out + m * ldo + 16, mask1, hi);
  }
}

#endif

}  // namespace ascendserve_panel
