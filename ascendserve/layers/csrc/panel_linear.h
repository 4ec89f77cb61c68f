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

// An 8-bit panel pack's block size G (pack_q8: q [N/32, K, 32] int8, scales [N/32, K/G, 32] fp32), after checking
// it, that n outputs fill its panels and that x has its K columns: q8_linear_cpu.cpp's kernels and q8_a8_linear.
inline int64_t check_q8_pack(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n,
                             const char* op) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(2) == kPanel, op,
              ": q must be [N/32, K, 32] int8");
  const int64_t panels = q.size(0), k = q.size(1);
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == panels && scales.size(1) > 0 && scales.size(2) == kPanel,
              op, ": scales must be [N/32, K/G, 32] fp32");
  const int64_t groups = scales.size(1), group = k / groups;
  TORCH_CHECK(group * groups == k, op, ": K=", k, " is not ", groups, " equal blocks");
  check_outputs(n, panels, kPanel, op);
  TORCH_CHECK(x.size(1) == k, op, ": x has ", x.size(1), " columns, the weight ", k);
  return group;
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

// store_tile for a bf16 output: the fp32 sums rounded once.
template <int ROWS>
inline void store_tile(const __m512 (&acc)[ROWS][2], at::BFloat16* out, int64_t ldo, int64_t cols, const float* bias) {
  store_tile_bf16<ROWS>(acc, out, ldo, cols, bias);
}

// A panel's weights for one input pair kp as vdpbf16ps operands: outputs 0-15 / 16-31, (w[n][2kp], w[n][2kp+1]) as
// bf16 in each 32-bit lane.
struct PairBf16 {
  __m512bh w0, w1;
};

// Block sums per row and half of the panel: one or two rows keep even and odd pairs apart (independent chains: one
// row is otherwise bound by vdpbf16ps's latency), pair_sum adds them.
template <int ROWS>
constexpr int kPairSplit = ROWS <= 2 ? 2 : 1;

template <int ROWS>
inline __m512 pair_sum(const __m512 (&block)[ROWS][2 * kPairSplit<ROWS>], int m, int half) {
  if constexpr (kPairSplit<ROWS> == 2) return _mm512_add_ps(block[m][half], block[m][2 + half]);
  return block[m][half];
}

// ROWS rows of bf16 x (pairs as 32-bit words, ldx in pairs) against one panel, a block of `pairs` input pairs at a
// time: each block's sums (vdpbf16ps of each x pair with pair_at(kp)) start at zero and go to fold(g, block). The
// bf16-activation tiles of the 4-bit and 8-bit kernels (q4_linear_bf16x, q8_linear_bf16x), which differ in how
// they widen a pair of weights and fold a block.
template <int ROWS, typename PairAt, typename Fold>
inline void dot_pair_blocks(const uint32_t* x, int64_t ldx, int64_t groups, int64_t pairs, const PairAt& pair_at,
                            const Fold& fold) {
  constexpr int kSplit = kPairSplit<ROWS>;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 block[ROWS][2 * kSplit];
    for (int m = 0; m < ROWS; ++m)
      for (int h = 0; h < 2 * kSplit; ++h) block[m][h] = _mm512_setzero_ps();
    int64_t kp = g * pairs;
    const int64_t end = kp + pairs;
    for (; kp + kSplit <= end; kp += kSplit) {
      for (int s = 0; s < kSplit; ++s) {
        const PairBf16 p = pair_at(kp + s);
        for (int m = 0; m < ROWS; ++m) {
          const __m512bh xp = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + kp + s]));
          block[m][2 * s] = _mm512_dpbf16_ps(block[m][2 * s], xp, p.w0);
          block[m][2 * s + 1] = _mm512_dpbf16_ps(block[m][2 * s + 1], xp, p.w1);
        }
      }
    }
    for (; kp < end; ++kp) {  // an odd number of pairs per block
      const PairBf16 p = pair_at(kp);
      for (int m = 0; m < ROWS; ++m) {
        const __m512bh xp = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + kp]));
        block[m][0] = _mm512_dpbf16_ps(block[m][0], xp, p.w0);
        block[m][1] = _mm512_dpbf16_ps(block[m][1], xp, p.w1);
      }
    }
    fold(g, block);
  }
}

#endif

}  // namespace ascendserve_panel
