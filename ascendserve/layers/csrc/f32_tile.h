// The fp32 register tile of the panel GEMM (f32_linear_cpu.cpp), shared with the prefill attention
// (prefill_attention_cpu.cpp): out[6 rows][16 outputs] (+)= a . b over a depth of kc, a packed as [kc][6]
// (6 rows interleaved by input), b as [kc][16] (16 outputs interleaved by input).
#pragma once

#include <algorithm>
#include <cstdint>

#include "panel_linear.h"  // the instruction-set macros and <immintrin.h>

namespace ascendserve_f32 {

constexpr int kTileRows = 6;       // x rows per register tile
constexpr int64_t kTileCols = 16;  // outputs per panel (and per register tile)

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
inline void tile_portable(int64_t kc, const float* a, const float* b, const TileOut& to) {
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

// The tile's output rows are prefetched before the depth loop, so they are in L1 when it ends: at prefill sizes a row
// block's outputs are out of cache by then, and the six stores (with the read before them after the first depth block)
// waited on memory; the demo's four layer shapes at 2048 rows: 150 -> 159 GFLOP/s (the AVX2 tile). The accumulators
// are named variables, not an array: an array of __m256 was kept on the stack by gcc (a load and a store around every
// FMA, 3x slower).
#if defined(ASCENDSERVE_TILES_AVX512)
// One input's step for a tile's six rows: a[0 .. 6) broadcast, times the input's 16 weights b, into r0 .. r5.
__attribute__((always_inline)) inline void fma6(const float* a, __m512 b, __m512& r0, __m512& r1, __m512& r2,
                                                __m512& r3, __m512& r4, __m512& r5) {
  r0 = _mm512_fmadd_ps(_mm512_set1_ps(a[0]), b, r0);
  r1 = _mm512_fmadd_ps(_mm512_set1_ps(a[1]), b, r1);
  r2 = _mm512_fmadd_ps(_mm512_set1_ps(a[2]), b, r2);
  r3 = _mm512_fmadd_ps(_mm512_set1_ps(a[3]), b, r3);
  r4 = _mm512_fmadd_ps(_mm512_set1_ps(a[4]), b, r4);
  r5 = _mm512_fmadd_ps(_mm512_set1_ps(a[5]), b, r5);
}

// AVX-512: a tile row's 16 outputs are one register, and two sets of six accumulators take the even and the odd
// inputs (twelve independent FMA chains, as the AVX2 tile's twelve halves), added at the end. On a 2-core Zen 5,
// whose 512-bit FMAs run at full width, against the AVX2 tile: the panel GEMM 185-194 -> 271-289 GFLOP/s at 2048
// rows (3072 x 576, 2048 x 1024), 177-186 -> 253-284 at 64; the prefill attention op (8 x 256 tokens) 5.85 -> 4.61 ms
// on the demo's heads (9 over 3, D 64), 14.5 -> 11.6 ms on Qwen3.5's (8 over 2, D 256).
inline void tile_fast(int64_t kc, const float* a, const float* b, const TileOut& to) {
  for (int m = 0; m < to.rows; ++m) _mm_prefetch(reinterpret_cast<const char*>(to.out + m * to.ldo), _MM_HINT_T0);
  __m512 e0 = _mm512_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, e4 = e0, e5 = e0;
  __m512 o0 = e0, o1 = e0, o2 = e0, o3 = e0, o4 = e0, o5 = e0;
  int64_t i = 0;
#pragma GCC unroll 2
  for (; i + 2 <= kc; i += 2) {
    fma6(a, _mm512_loadu_ps(b), e0, e1, e2, e3, e4, e5);
    fma6(a + kTileRows, _mm512_loadu_ps(b + kTileCols), o0, o1, o2, o3, o4, o5);
    a += 2 * kTileRows;
    b += 2 * kTileCols;
  }
  if (i < kc) fma6(a, _mm512_loadu_ps(b), e0, e1, e2, e3, e4, e5);
  const __m512 rows[kTileRows] = {_mm512_add_ps(e0, o0), _mm512_add_ps(e1, o1), _mm512_add_ps(e2, o2),
                                  _mm512_add_ps(e3, o3), _mm512_add_ps(e4, o4), _mm512_add_ps(e5, o5)};
  for (int m = 0; m < to.rows; ++m) {
    __m512 acc = rows[m];
    float* row = to.out + m * to.ldo;
    if (to.cols == kTileCols) {
      if (to.first) {
        if (to.bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(to.bias));
      } else {
        acc = _mm512_add_ps(acc, _mm512_loadu_ps(row));
      }
      _mm512_storeu_ps(row, acc);
    } else {
      alignas(64) float spill[kTileCols];
      _mm512_store_ps(spill, acc);
      to.store_row(m, spill);
    }
  }
}
#else  // AVX2: 6 rows x (2 x 8) outputs
inline void tile_fast(int64_t kc, const float* a, const float* b, const TileOut& to) {
  for (int m = 0; m < to.rows; ++m) {  // 16 outputs: one or two cache lines
    _mm_prefetch(reinterpret_cast<const char*>(to.out + m * to.ldo), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(to.out + m * to.ldo + kTileCols - 1), _MM_HINT_T0);
  }
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
#endif
#else
inline void tile_fast(int64_t kc, const float* a, const float* b, const TileOut& to) { tile_portable(kc, a, b, to); }
#endif

}  // namespace ascendserve_f32
