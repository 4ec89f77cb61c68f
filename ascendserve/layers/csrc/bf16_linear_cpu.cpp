// y = x @ W.T + b with W stored as bf16 panels: fp32 x and output (bf16_linear), or bf16 x (bf16_linear_bf16x, a
// model run in bf16: AMX's tiles where the CPU has AMX, see tile_amx, else vdpbf16ps where it has AVX512-BF16, see
// tile_dot).
//
// A bf16 checkpoint run in fp32 (what `--dtype auto` does on a CPU without AMX) holds every weight as fp32:
// twice the bytes a decode step must stream, for values that are all exactly bf16. Widening bf16 to fp32 is
// exact (the bf16 bits are the top half of the fp32 word), so keeping the weight as bf16 and widening it in
// registers gives the fp32 product of the same numbers from half the memory traffic. Accumulation is fp32;
// only the summation order differs from F.linear.
//
// Packed layout (ascendserve/layers/compact_linear.py, pack_bf16): W [N, K] (K even, N padded with zero rows
// to a multiple of 32) as panels of 32 output rows, [N/32][K/2][32][2] bf16: for input pair kp, the 32
// rows' (W[n][2kp], W[n][2kp+1]) side by side. One 32-bit lane then holds both of a row's values;
// `lane << 16` is W[n][2kp] as fp32 and `lane & 0xffff0000` is W[n][2kp+1], one instruction each.
// The micro-kernel keeps a tile of x-rows by 32 outputs in registers, broadcasting x and streaming one
// panel front to back, which the hardware prefetcher follows. Up to 6 rows it keeps separate even / odd
// accumulators (4 a row: independent FMA chains where few rows give few chains); 7 to 12 rows share one
// accumulator per row and half (24 at 12 rows), so the 4 widening instructions per input pair, which
// take the FMA ports too, serve 48 FMAs instead of 24 (Qwen3.5-0.8B, 64-row decode step: the linears
// 597-632 -> 538 ms, torch.profiler).

#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "bf16_convert.h"
#include "float_bits.h"
#include "panel_linear.h"
#include "softmax_simd.h"

namespace {

using ascendserve_panel::kPanel;
constexpr int kRowBlock = 12;            // x rows per tile
constexpr int64_t kPrefetchPairs = 32;  // input pairs (128 bytes each) the AVX-512 tile prefetches ahead

inline float bf16_bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Any CPU: the same tile in plain C++ (also the reference the SIMD tiles are tested against).
void tile_portable(int rows, const float* x, int64_t ldx, const uint32_t* panel, int64_t kpairs, float* out,
                   int64_t ldo, int64_t cols, const float* bias) {
  float acc[kRowBlock][kPanel] = {};
  for (int64_t kp = 0; kp < kpairs; ++kp) {
    const uint32_t* lanes = panel + kp * kPanel;
    for (int m = 0; m < rows; ++m) {
      const float xe = x[m * ldx + 2 * kp], xo = x[m * ldx + 2 * kp + 1];
      for (int64_t j = 0; j < kPanel; ++j)
        acc[m][j] += xe * bf16_bits_to_float(lanes[j] << 16) + xo * bf16_bits_to_float(lanes[j] & 0xffff0000u);
    }
  }
  ascendserve_panel::store_rows(acc, rows, out, ldo, cols, bias);
}

#if defined(ASCENDSERVE_TILES_AVX512)
// Input pair kp of a panel as fp32: even / odd inputs of outputs 0-15 (e0, o0) and 16-31 (e1, o1); and a
// request for the pairs kPrefetchPairs (4 KiB) ahead (the panel is contiguous, so past its end is the next
// panel; a prefetch never faults). Single-stream decode: 11-16 -> 17-19 GB/s on the Qwen3.5 shapes with
// the prefetch (benchmarks/probe_bf16_linear.py).
struct WidenedPair {
  __m512 e0, o0, e1, o1;
};

inline WidenedPair widen_pair(const uint32_t* panel, int64_t kp) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  _mm_prefetch(reinterpret_cast<const char*>(panel + (kp + kPrefetchPairs) * kPanel), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(panel + (kp + kPrefetchPairs) * kPanel + 16), _MM_HINT_T0);
  const __m512i w0 = _mm512_loadu_si512(panel + kp * kPanel);
  const __m512i w1 = _mm512_loadu_si512(panel + kp * kPanel + 16);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)), _mm512_castsi512_ps(_mm512_and_si512(w0, high)),
          _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)), _mm512_castsi512_ps(_mm512_and_si512(w1, high))};
}

template <int ROWS>
void tile_avx512(const float* x, int64_t ldx, const uint32_t* panel, int64_t kpairs, float* out, int64_t ldo,
                 int64_t cols, const float* bias) {
  __m512 even[ROWS][2], odd[ROWS][2];
  for (int m = 0; m < ROWS; ++m)
    for (int h = 0; h < 2; ++h) even[m][h] = odd[m][h] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kpairs; ++kp) {
    const WidenedPair w = widen_pair(panel, kp);
    for (int m = 0; m < ROWS; ++m) {
      const __m512 xe = _mm512_set1_ps(x[m * ldx + 2 * kp]);
      const __m512 xo = _mm512_set1_ps(x[m * ldx + 2 * kp + 1]);
      even[m][0] = _mm512_fmadd_ps(xe, w.e0, even[m][0]);
      odd[m][0] = _mm512_fmadd_ps(xo, w.o0, odd[m][0]);
      even[m][1] = _mm512_fmadd_ps(xe, w.e1, even[m][1]);
      odd[m][1] = _mm512_fmadd_ps(xo, w.o1, odd[m][1]);
    }
  }
  for (int m = 0; m < ROWS; ++m)
    for (int h = 0; h < 2; ++h) even[m][h] = _mm512_add_ps(even[m][h], odd[m][h]);
  ascendserve_panel::store_tile<ROWS>(even, out, ldo, cols, bias);
}

// 7 to 12 rows: one accumulator per row and half, the even and odd products added in turn.
template <int ROWS>
void tile_avx512_merged(const float* x, int64_t ldx, const uint32_t* panel, int64_t kpairs, float* out,
                        int64_t ldo, int64_t cols, const float* bias) {
  __m512 acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kpairs; ++kp) {
    const WidenedPair w = widen_pair(panel, kp);
    for (int m = 0; m < ROWS; ++m) {
      const __m512 xe = _mm512_set1_ps(x[m * ldx + 2 * kp]);
      const __m512 xo = _mm512_set1_ps(x[m * ldx + 2 * kp + 1]);
      acc[m][0] = _mm512_fmadd_ps(xo, w.o0, _mm512_fmadd_ps(xe, w.e0, acc[m][0]));
      acc[m][1] = _mm512_fmadd_ps(xo, w.o1, _mm512_fmadd_ps(xe, w.e1, acc[m][1]));
    }
  }
  ascendserve_panel::store_tile<ROWS>(acc, out, ldo, cols, bias);
}

void tile_fast(int rows, const float* x, int64_t ldx, const uint32_t* panel, int64_t kpairs, float* out, int64_t ldo,
               int64_t cols, const float* bias) {
  ascendserve_panel::with_tile_rows<kRowBlock>(rows, [&](auto r) {
    constexpr int kRows = decltype(r)::value;
    if constexpr (kRows <= 6) {
      tile_avx512<kRows>(x, ldx, panel, kpairs, out, ldo, cols, bias);
    } else {
      tile_avx512_merged<kRows>(x, ldx, panel, kpairs, out, ldo, cols, bias);
    }
  });
}
#elif defined(ASCENDSERVE_TILES_AVX2)
// ROWS rows of x, one half (16 outputs) of the panel at a time: per input pair, the half's 16 lanes
// widened to even / odd fp32 (4 registers), one accumulator per row and 8 outputs.
template <int ROWS>
void tile_avx2(const float* x, int64_t ldx, const uint32_t* panel, int64_t kpairs, float (*acc)[kPanel]) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int h = 0; h < 2; ++h) {
    __m256 sum[ROWS][2];
    for (int m = 0; m < ROWS; ++m) sum[m][0] = sum[m][1] = _mm256_setzero_ps();
    for (int64_t kp = 0; kp < kpairs; ++kp) {
      const uint32_t* lanes = panel + kp * kPanel + 16 * h;
      _mm_prefetch(reinterpret_cast<const char*>(lanes + kPrefetchPairs * kPanel), _MM_HINT_T0);
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes + 8));
      const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
      const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
      const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(w0, high));
      const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(w1, high));
      for (int m = 0; m < ROWS; ++m) {
        const __m256 xe = _mm256_broadcast_ss(x + m * ldx + 2 * kp);
        const __m256 xo = _mm256_broadcast_ss(x + m * ldx + 2 * kp + 1);
        sum[m][0] = _mm256_fmadd_ps(xo, o0, _mm256_fmadd_ps(xe, e0, sum[m][0]));
        sum[m][1] = _mm256_fmadd_ps(xo, o1, _mm256_fmadd_ps(xe, e1, sum[m][1]));
      }
    }
    for (int m = 0; m < ROWS; ++m) {
      _mm256_storeu_ps(acc[m] + 16 * h, sum[m][0]);
      _mm256_storeu_ps(acc[m] + 16 * h + 8, sum[m][1]);
    }
  }
}

// One row (single-stream decode): the whole panel in one pass, 4 accumulators of 8 outputs. The
// half-panel tile above walks each panel twice, and at one row a panel (K/2 x 128 bytes) is gone from
// L1 by the second walk.
void tile_avx2_one_row(const float* x, const uint32_t* panel, int64_t kpairs, float* acc) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 sum[4];
  for (int v = 0; v < 4; ++v) sum[v] = _mm256_setzero_ps();
  for (int64_t kp = 0; kp < kpairs; ++kp) {
    const uint32_t* lanes = panel + kp * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(lanes + kPrefetchPairs * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(lanes + kPrefetchPairs * kPanel + 16), _MM_HINT_T0);
    const __m256 xe = _mm256_broadcast_ss(x + 2 * kp), xo = _mm256_broadcast_ss(x + 2 * kp + 1);
    for (int v = 0; v < 4; ++v) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes + 8 * v));
      sum[v] = _mm256_fmadd_ps(xe, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), sum[v]);
      sum[v] = _mm256_fmadd_ps(xo, _mm256_castsi256_ps(_mm256_and_si256(w, high)), sum[v]);
    }
  }
  for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc + 8 * v, sum[v]);
}

void tile_fast(int rows, const float* x, int64_t ldx, const uint32_t* panel, int64_t kpairs, float* out, int64_t ldo,
               int64_t cols, const float* bias) {
  float acc[kRowBlock][kPanel];
  if (rows == 1) {
    tile_avx2_one_row(x, panel, kpairs, acc[0]);
    return ascendserve_panel::store_rows(acc, 1, out, ldo, cols, bias);
  }
  ascendserve_panel::in_row_blocks<ascendserve_panel::kAvx2Rows>(rows, [&](int m0, auto r) {
    tile_avx2<decltype(r)::value>(x + m0 * ldx, ldx, panel, kpairs, acc + m0);
  });
  ascendserve_panel::store_rows(acc, rows, out, ldo, cols, bias);
}
#else
void tile_fast(int rows, const float* x, int64_t ldx, const uint32_t* panel, int64_t kpairs, float* out, int64_t ldo,
               int64_t cols, const float* bias) {
  tile_portable(rows, x, ldx, panel, kpairs, out, ldo, cols, bias);
}
#endif

#if defined(ASCENDSERVE_TILES_AVX512) && defined(__AVX512BF16__)
#define ASCENDSERVE_BF16_DOT 1
// bf16 activations (a model run in bf16) on a CPU with AVX512-BF16: vdpbf16ps multiplies a row's input pair,
// broadcast as one 32-bit lane, by 16 outputs' weight pairs and adds both products to 16 fp32 sums (exact
// products, fp32 sums, denormal inputs read as zero: the arithmetic of oneDNN's bf16 GEMM). Two instructions per
// row and input pair cover the panel's 32 outputs, with no widening: twice the fp32 tile's products per cycle.
// Out: float (the sums as they are) or at::BFloat16 (rounded once).
template <int ROWS, typename Out>
void tile_dot(const uint32_t* x, int64_t ldx, const uint32_t* panel, int64_t kpairs, Out* out, int64_t ldo,
              int64_t cols, const float* bias) {
  __m512 acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kpairs; ++kp) {
    const uint32_t* lanes = panel + kp * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(lanes + kPrefetchPairs * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(lanes + kPrefetchPairs * kPanel + 16), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(lanes);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(lanes + 16);
    for (int m = 0; m < ROWS; ++m) {
      const __m512bh xp = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + kp]));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xp, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xp, w1);
    }
  }
  if constexpr (std::is_same_v<Out, float>) {
    ascendserve_panel::store_tile<ROWS>(acc, out, ldo, cols, bias);
  } else {
    ascendserve_panel::store_tile_bf16<ROWS>(acc, out, ldo, cols, bias);
  }
}

// fp32 sums as the bf16 values a rounding store would leave (to nearest even), widened back.
inline __m512 bf16_rounded(__m512 v) { return ascendserve_bf16::widen16((__m256i)_mm512_cvtneps_pbh(v)); }

// out[0 .. 32) = silu(g) * u for one row of gate and up sums, each first rounded to bf16 as the unfused layer's output
// is, then silu_mul512 (silu_and_mul's arithmetic) rounded once: the unfused pair's bits.
inline void store_silu_mul_row(const float* gate, const float* up, at::BFloat16* out, bool stream) {
  __m512 o[2];
  for (int h = 0; h < 2; ++h)
    o[h] = ascendserve_simd::silu_mul512(bf16_rounded(_mm512_load_ps(gate + 16 * h)),
                                         bf16_rounded(_mm512_load_ps(up + 16 * h)));
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(o[1], o[0]);
  if (stream) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(out), both);
  } else {
    _mm512_storeu_si512(out, both);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ASCENDSERVE_BF16_AMX 1
// AMX (Sapphire Rapids on): tdpbf16ps multiplies a 16-row x 32-input tile of bf16 x by a 32-input x 16-output tile of
// weight pairs into 16 x 16 fp32 sums, the arithmetic of vdpbf16ps (exact products, fp32 sums), 8192 products in one
// instruction. The panels need no repacking: AMX's B tile is 16 rows of input pairs, each 16 outputs' (W[n][2kp],
// W[n][2kp+1]), which is half a panel row (64 of its 128 bytes), so a B tile is 16 panel rows read with a 128-byte
// stride. A 32-row block keeps four fp32 tiles of sums (rows 0-15 / 16-31 by outputs 0-15 / 16-31) over the two A
// tiles and the two B tiles of each step of 32 inputs: all eight tile registers.
constexpr int kAmxRows = 32;   // x rows per block (two A tiles)
constexpr int64_t kAmxPrefetchPairs = 64;  // how far ahead in the panel tile_amx prefetches (8 KiB)
constexpr int64_t kAmxK = 32;  // inputs per tile step (64 bytes of bf16 per tile row)

bool amx_permitted() { return ascendserve_amx::permitted(); }

// The tile shapes for blocks of `rows` rows (1-32): tiles 0-1 the sums of rows 0-15 by outputs 0-15 / 16-31 and
// 2-3 those of rows 16-31, 4-5 x's rows 0-15 / 16-31, 6-7 the panel's outputs 0-15 / 16-31. Loading a
// configuration zeroes every tile, so a thread reconfigures only where a block's height changes (a last block).
inline void amx_configure(int rows) {
  ascendserve_amx::Config config;
  const int top = std::min(rows, 16), bottom = std::max(rows - 16, 0);
  const int tile_rows[8] = {top, top, bottom, bottom, top, bottom, 16, 16};
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = static_cast<uint8_t>(tile_rows[t]);
    config.colsb[t] = tile_rows[t] ? 64 : 0;
  }
  ascendserve_amx::load(config);
}

thread_local int amx_configured_rows = 0;  // the block height this thread's tiles are configured for (0: none)

// The fp32 sums of `rows` (1-32) rows of x [., K] (ldx in input pairs) by one panel, K a multiple of kAmxK, over input
// pairs [kp0, kp1) of kpairs. A block whose sums span several such slices starts from the sums the last slice left in
// `partial` ([32][32]) and leaves its own there; the last slice (kp1 == kpairs) puts them in `sums` and returns true.
// Storing and reloading fp32 tiles is exact: the sums are those of one pass.
bool amx_sums(int rows, const uint32_t* x, int64_t ldx, const uint32_t* panel, int64_t kp0, int64_t kp1,
              int64_t kpairs, float* partial, float (*sums)[kPanel]) {
  if (rows != amx_configured_rows) {
    amx_configure(rows);
    amx_configured_rows = rows;
  }
  const int64_t x_stride = 4 * ldx, panel_stride = 4 * kPanel;  // bytes between rows of a tile
  const int64_t sums_stride = kPanel * sizeof(float);
  const bool two = rows > 16;
  if (kp0 == 0) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, partial, sums_stride);
    _tile_loadd(1, partial + 16, sums_stride);
    if (two) {
      _tile_loadd(2, partial + 16 * kPanel, sums_stride);
      _tile_loadd(3, partial + 16 * kPanel + 16, sums_stride);
    }
  }
  // Small blocks (decode) stream the panel from memory at the tiles' pace: its bytes kAmxPrefetchPairs pairs ahead
  // are asked for meanwhile (one row of a 1.6 GB stack of 8192 x 1024 layers: 19.3 GB/s on the vdpbf16ps tile, 22.5
  // on AMX with this). Larger blocks compute longer per panel byte and reread it from cache: no prefetch there; their
  // x tiles are loaded with the streaming hint (tileloaddt1), so that they pass through L1 without evicting the
  // panel's slice, which the chunk's next blocks read again (2048 x 576 by 3072 outputs: 2.3 -> 1.8 ms, a C loop).
  const char* ahead = rows <= 16 ? reinterpret_cast<const char*>(panel) + 4 * kPanel * kAmxPrefetchPairs : nullptr;
  for (int64_t kp = kp0; kp < kp1; kp += kAmxK / 2) {
    if (ahead)
      for (int line = 0; line < 32; ++line) _mm_prefetch(ahead + kp * 4 * kPanel + 64 * line, _MM_HINT_T0);
    if (two) {
      _tile_stream_loadd(4, x + kp, x_stride);
    } else {
      _tile_loadd(4, x + kp, x_stride);
    }
    _tile_loadd(6, panel + kp * kPanel, panel_stride);
    _tile_loadd(7, panel + kp * kPanel + 16, panel_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_stream_loadd(5, x + 16 * ldx + kp, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  float* dst = kp1 < kpairs ? partial : &sums[0][0];
  _tile_stored(0, dst, sums_stride);
  _tile_stored(1, dst + 16, sums_stride);
  if (two) {
    _tile_stored(2, dst + 16 * kPanel, sums_stride);
    _tile_stored(3, dst + 16 * kPanel + 16, sums_stride);
  }
  return kp1 == kpairs;
}

// out[m][0 .. cols) = sums[m] + bias for a block's rows, rounded to bf16 where Out is. With `stream` (a whole panel's
// 32 outputs, out's rows 64-byte aligned) the rows are written with non-temporal stores, which neither read the lines
// first nor pass them through the caches: see bf16x.
template <typename Out>
void store_sums(const float (*sums)[kPanel], int rows, Out* out, int64_t ldo, int64_t cols, const float* bias,
                bool stream) {
  if (stream && cols == kPanel) {
    const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
    for (int m = 0; m < rows; ++m) {
      const __m512 lo = _mm512_add_ps(_mm512_load_ps(&sums[m][0]), b0);
      const __m512 hi = _mm512_add_ps(_mm512_load_ps(&sums[m][16]), b1);
      if constexpr (std::is_same_v<Out, float>) {
        _mm512_stream_ps(out + m * ldo, lo);
        _mm512_stream_ps(out + m * ldo + 16, hi);
      } else {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(out + m * ldo), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
    return;
  }
  for (int m = 0; m < rows; ++m) {
    const __m512 row[1][2] = {{_mm512_load_ps(&sums[m][0]), _mm512_load_ps(&sums[m][16])}};
    if constexpr (std::is_same_v<Out, float>) {
      ascendserve_panel::store_tile<1>(row, out + m * ldo, ldo, cols, bias);
    } else {
      ascendserve_panel::store_tile_bf16<1>(row, out + m * ldo, ldo, cols, bias);
    }
  }
}

constexpr int64_t kAmxSliceInputs = 640;     // at most this many inputs per panel slice (40 KiB: L1 is 48)
// Up to three blocks of rows take each panel whole: their few passes reread it from L2 for less than the slices'
// partial sums cost (stores, reloads, a tile pipeline drained per slice). Qwen3.5's decode linears (24 gate_up, 18
// in_proj_qkvz, 24 down, 18 out_proj and lm_head, each call a different weight copy, alternated): 48 rows 91-93 -> 80
// ms, 64 rows 92-101 -> 86, 96 rows 128-131 -> 124; level at 128 rows, and from 256 rows on the slices win (245-251 vs
// 261-265).
constexpr int64_t kAmxSlicedFrom = 3 * kAmxRows;  // rows above this take the panels in slices
constexpr int64_t kAmxStreamBytes = 8 << 20;  // outputs from this size on are written with non-temporal stores

// Whether m_rows output rows of row_bytes at out are written with non-temporal stores (from kAmxStreamBytes on, rows
// and out 64-byte aligned). An output of 8 MiB or more goes to memory anyway; written through the caches it would
// also read every line first and push the x chunk and the panel slices out of L2 (2048 rows, 2 threads: 1024 inputs x
// 7168 outputs 15.6 -> 10.3-10.7 ms, 576 x 3072 3.0 -> 2.5-2.6 ms; oneDNN's F.linear 11.2-12.3 and 2.7-2.9 ms).
// Smaller ones stay in cache for the next op: from 1 MiB on, the demo's 8 x 256 prefill (outputs of 2.4-6.3 MB) took
// 0.37-0.40 s in-process, from 8 MiB on 0.34-0.35 s (Qwen3.5's level).
inline bool streamed(int64_t m_rows, int64_t row_bytes, const void* out) {
  return m_rows * row_bytes >= kAmxStreamBytes && row_bytes % 64 == 0 && reinterpret_cast<uintptr_t>(out) % 64 == 0;
}

// tile(p, m0, rows, cols, kp0, kp1, partial) over every unit of kPanelsPerUnit panels (one; two for the fused gate and
// up), 32-row block and slice of input pairs: threads split the units; each walks its units once per chunk of rows
// (about kChunkBytes of bf16 x), and a unit's inputs in slices that stay in L1 while the chunk's blocks pass (one slice
// where the chunk is at most kAmxSlicedFrom rows). `partial` is the block's [kPanelsPerUnit][32][32] fp32 sums between
// slices, in a per-thread buffer. 2048 rows, 2 threads (before it the whole K per block, chunks of 1 MiB of fp32-sized
// x): 1024 inputs x 7168 outputs 17.6 -> 15.6 ms, 576 x 3072 4.6 -> 3.0 ms, the same bits. A fused unit's two slices
// share L1: kAmxSliceInputs / kPanelsPerUnit inputs each.
template <int kPanelsPerUnit = 1, typename Tile>
void for_each_amx_block(int64_t m_rows, int64_t k, int64_t n, int64_t panels, const Tile& tile) {
  const int64_t rows_per_chunk = ascendserve_panel::chunk_rows(m_rows, 2 * k, kAmxRows, ascendserve_panel::kChunkBytes);
  const int64_t kpairs = k / 2, step = kAmxK / 2, steps = kpairs / step;
  const int64_t slice_inputs = kAmxSliceInputs / kPanelsPerUnit;
  const int64_t slices = m_rows > kAmxSlicedFrom ? (k + slice_inputs - 1) / slice_inputs : 1;
  const int64_t slice_pairs = (steps + slices - 1) / slices * step;
  at::parallel_for(0, panels, 1, [&](int64_t p_begin, int64_t p_end) {
    amx_configured_rows = 0;
    std::vector<float> partials(slices > 1 ? rows_per_chunk * kPanel * kPanelsPerUnit : 0);
    for (int64_t c0 = 0; c0 < m_rows; c0 += rows_per_chunk) {
      const int64_t c1 = std::min(m_rows, c0 + rows_per_chunk);
      for (int64_t p = p_begin; p < p_end; ++p) {
        const int64_t cols = std::min<int64_t>(kPanel, n - p * kPanel);
        for (int64_t kp0 = 0; kp0 < kpairs; kp0 += slice_pairs) {
          const int64_t kp1 = std::min(kpairs, kp0 + slice_pairs);
          for (int64_t m0 = c0; m0 < c1; m0 += kAmxRows)
            tile(p, m0, static_cast<int>(std::min<int64_t>(kAmxRows, c1 - m0)), cols, kp0, kp1,
                 partials.empty() ? nullptr : partials.data() + (m0 - c0) * kPanel * kPanelsPerUnit);
        }
      }
    }
    _mm_sfence();  // this thread's non-temporal stores (where a tile streamed) are visible before the output is read
    _tile_release();
  });
}
#endif
#endif

// Whether bf16_linear_bf16x multiplies with vdpbf16ps here (else it widens x and runs bf16_linear).
bool bf16_dot() {
#if defined(ASCENDSERVE_BF16_DOT)
  return true;
#else
  return false;
#endif
}

// Whether bf16_linear_bf16x multiplies with AMX here (every batch size, K a multiple of 32): built for a CPU with
// AMX-BF16 and the tile state granted by Linux. Every batch size, so that a row's sums do not depend on how many rows
// share its step (the vdpbf16ps tile sums in another order): with the panel prefetch of tile_amx one row streams
// faster than on the vdpbf16ps tile (a 1.6 GB stack of 8192 x 1024 layers: 22.5 vs 19.3 GB/s), and from 2 rows on AMX
// is level or faster (2-core Xeon, benchmarks/probe_bf16_linear.py: 8192 x 1024 at 8 rows 1.02 vs 1.09 ms, 40 rows
// 1.48 vs 3.76).
bool bf16_amx() {
#if defined(ASCENDSERVE_BF16_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

// Whether the fused ops on bf16_linear_bf16x's sums (bf16_linear_silu_mul, bf16_linear_argmax) multiply on AMX for K
// inputs (a multiple of 32), else on the vdpbf16ps tile: the tile bf16_linear_bf16x takes there. An error naming `op`
// where neither runs.
bool fused_on_amx(int64_t k, const char* op) {
  const bool on_amx = bf16_amx() && k % 32 == 0;
  TORCH_CHECK(on_amx || bf16_dot(), op, ": needs AMX (K a multiple of 32, K=", k, ") or AVX512-BF16");
  return on_amx;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                  bool portable);

// Checks that packed is pack_bf16's layout ([panels, K/2, 32, 2] bf16; `layout` names it in the message).
void check_pack(const at::Tensor& packed, const char* op, const char* layout) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
              packed.size(2) == kPanel && packed.size(3) == 2, op, ": packed must be ", layout, " bf16");
}

// Checks that x [M, K] has the K columns of the pack's K/2 input pairs.
void check_columns(const at::Tensor& x, const at::Tensor& packed, const char* op) {
  TORCH_CHECK(x.size(1) == 2 * packed.size(1), op, ": x has ", x.size(1), " columns, the weight ", 2 * packed.size(1));
}

// The sizes of x [M, K] and of pack_bf16's panels, after the checks the ops on them share: x a contiguous 2-D tensor
// of `dtype` (fp32 or bf16), the pack's layout, x's K columns, n outputs within the panels.
struct PanelShape {
  int64_t m_rows, k, panels, kpairs;
};
PanelShape checked_shape(const at::Tensor& x, at::ScalarType dtype, const at::Tensor& packed, int64_t n,
                         const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && x.is_contiguous(), op, ": x must be a contiguous ",
              dtype == at::kFloat ? "fp32" : "bf16", " [M, K] tensor");
  check_pack(packed, op, "[N/32, K/2, 32, 2]");
  check_columns(x, packed, op);
  ascendserve_panel::check_outputs(n, packed.size(0), kPanel, op);
  return {x.size(0), x.size(1), packed.size(0), packed.size(1)};
}

// y = x @ W.T + b for bf16 x [M, K] (bias fp32), the fp32 sums rounded to bf16 where bf16_out, else returned as
// they are: bf16_dot()'s tile, else x widened to fp32 (exact) through bf16_linear's tiles.
at::Tensor bf16x(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                 bool bf16_out, bool use_amx) {
  const PanelShape shape = checked_shape(x, at::kBFloat16, packed, n, "bf16_linear_bf16x");
  [[maybe_unused]] const int64_t m_rows = shape.m_rows, k = shape.k, panels = shape.panels, kpairs = shape.kpairs;
#if defined(ASCENDSERVE_BF16_DOT)
  const float* bias_ptr = ascendserve_panel::checked_bias(bias, n, "bf16_linear_bf16x");
  at::Tensor out = at::empty({m_rows, n}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (m_rows == 0) return out;
  const uint32_t* x_ptr = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const uint32_t* w_ptr = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t panel_stride = kpairs * kPanel;
  // rows [m0, m0 + rows) of x by panel p on the vdpbf16ps tile, in blocks of up to kRowBlock rows
  auto dot_rows = [&](auto* out_ptr, int64_t p, int64_t m0, int rows, int64_t cols) {
    ascendserve_panel::in_row_blocks<kRowBlock>(rows, [&](int r0, auto r) {
      tile_dot<decltype(r)::value>(x_ptr + (m0 + r0) * kpairs, kpairs, w_ptr + p * panel_stride, kpairs,
                                   out_ptr + (m0 + r0) * n + p * kPanel, n, cols,
                                   bias_ptr ? bias_ptr + p * kPanel : nullptr);
    });
  };
  auto run = [&](auto* out_ptr) {
#if defined(ASCENDSERVE_BF16_AMX)
    if (use_amx && k % kAmxK == 0 && amx_permitted()) {
      const bool stream = streamed(m_rows, n * static_cast<int64_t>(sizeof(*out_ptr)), out_ptr);
      auto amx_block = [&](int64_t p, int64_t m0, int rows, int64_t cols, int64_t kp0, int64_t kp1, float* partial) {
        alignas(64) float sums[kAmxRows][kPanel];
        if (amx_sums(rows, x_ptr + m0 * kpairs, kpairs, w_ptr + p * panel_stride, kp0, kp1, kpairs, partial, sums))
          store_sums(sums, rows, out_ptr + m0 * n + p * kPanel, n, cols, bias_ptr ? bias_ptr + p * kPanel : nullptr,
                     stream);
      };
      return for_each_amx_block(m_rows, k, n, panels, amx_block);
    }
#endif
    ascendserve_panel::for_each_tile<kRowBlock>(m_rows, k, n, panels, [&](int64_t p, int64_t m0, int rows,
                                                                          int64_t cols) {
      dot_rows(out_ptr, p, m0, rows, cols);
    });
  };
  ascendserve_panel::with_out_ptr(out, bf16_out, run);
  return out;
#else
  at::Tensor out = linear(x.to(at::kFloat), packed, n, bias, false);
  return bf16_out ? out.to(at::kBFloat16) : out;
#endif
}

// silu(x @ G.T) * (x @ U.T) for bf16 x [M, K], out [M, n] bf16, from the gate-and-up layer's panels taken in pairs,
// gate panel q then up panel q ([g0, u0, g1, u1, ...], pack_gate_up in compact_linear.py; n a multiple of 32), on the
// tiles bf16_linear_bf16x takes (AMX where K is a multiple of 32, else the vdpbf16ps tile): both panels' sums for a
// block, each rounded to bf16, then silu_and_mul's arithmetic, so the values are those of bf16_linear_bf16x and
// silu_and_mul one after the other, without the [M, 2n] product going to memory and back.
at::Tensor bf16_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "bf16_linear_silu_mul: x must be a contiguous bf16 [M, K] tensor");
  check_pack(packed, "bf16_linear_silu_mul", "[2n/32, K/2, 32, 2]");
  check_columns(x, packed, "bf16_linear_silu_mul");
  [[maybe_unused]] const int64_t m_rows = x.size(0), k = x.size(1), kpairs = packed.size(1);
  TORCH_CHECK(n > 0 && n % kPanel == 0 && packed.size(0) == 2 * n / kPanel, "bf16_linear_silu_mul: n=", n,
              " must be a multiple of 32 with 2n/32 = ", packed.size(0), " panels");
  [[maybe_unused]] const bool on_amx = fused_on_amx(k, "bf16_linear_silu_mul");
  at::Tensor out = at::empty({m_rows, n}, x.options());
#if defined(ASCENDSERVE_BF16_DOT)
  if (m_rows == 0) return out;
  const uint32_t* x_ptr = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const uint32_t* w_ptr = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  at::BFloat16* out_ptr = out.data_ptr<at::BFloat16>();
  const int64_t panel_stride = kpairs * kPanel;
#if defined(ASCENDSERVE_BF16_AMX)
  if (on_amx) {
    const bool stream = streamed(m_rows, n * 2, out_ptr);
    auto pair = [&](int64_t q, int64_t m0, int rows, int64_t, int64_t kp0, int64_t kp1, float* partial) {
      alignas(64) float gate[kAmxRows][kPanel], up[kAmxRows][kPanel];
      const uint32_t* xb = x_ptr + m0 * kpairs;
      const bool last = amx_sums(rows, xb, kpairs, w_ptr + 2 * q * panel_stride, kp0, kp1, kpairs, partial, gate);
      amx_sums(rows, xb, kpairs, w_ptr + (2 * q + 1) * panel_stride, kp0, kp1, kpairs,
               partial ? partial + kAmxRows * kPanel : nullptr, up);
      if (last)
        for (int m = 0; m < rows; ++m)
          store_silu_mul_row(gate[m], up[m], out_ptr + (m0 + m) * n + q * kPanel, stream);
    };
    for_each_amx_block<2>(m_rows, k, n, n / kPanel, pair);
    return out;
  }
#endif
  // a block of rows by gate panel 2q, then by up panel 2q + 1 (both rereading the block's x from L1), into sums that
  // stay on the stack
  ascendserve_panel::for_each_tile<kRowBlock>(m_rows, k, n, n / kPanel, [&](int64_t q, int64_t m0, int rows,
                                                                            int64_t) {
    ascendserve_panel::with_tile_rows<kRowBlock>(rows, [&](auto r) {
      alignas(64) float gate[kRowBlock][kPanel], up[kRowBlock][kPanel];
      const uint32_t* xb = x_ptr + m0 * kpairs;
      tile_dot<decltype(r)::value>(xb, kpairs, w_ptr + 2 * q * panel_stride, kpairs, &gate[0][0], kPanel, kPanel,
                                   static_cast<const float*>(nullptr));
      tile_dot<decltype(r)::value>(xb, kpairs, w_ptr + (2 * q + 1) * panel_stride, kpairs, &up[0][0], kPanel, kPanel,
                                   static_cast<const float*>(nullptr));
      for (int m = 0; m < rows; ++m) store_silu_mul_row(gate[m], up[m], out_ptr + (m0 + m) * n + q * kPanel, false);
    });
  });
#endif
  return out;
}

// Per row of bf16 x [M, K], the index of the largest of n outputs x @ W.T (no bias), on AMX (K a multiple of 32) or on
// the vdpbf16ps tile: the sums bf16_linear_bf16x returns as fp32 (the same tiles, so the same values), never written
// out. Each thread keeps, per row, the largest sum over its panels and its first index (or the first NaN's), and the
// threads' picks are merged by value, then index: argmax_rows' result on bf16_linear_bf16x's output (the first index
// of the maximum, the first NaN where there is one). Greedy sampling's lm_head: a 64-row Qwen3.5 decode step neither
// writes 64 MB of logits nor reads them back. On the vdpbf16ps tile (2-vCPU Zen 4, 64 rows, against the logits and
// argmax_rows): the demo's 49152 x 576 12.0 -> 9.0 ms, Qwen3.5's 248320 x 1024 84.3 -> 76.2 ms; one row level.
at::Tensor bf16_linear_argmax(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  const PanelShape shape = checked_shape(x, at::kBFloat16, packed, n, "bf16_linear_argmax");
  [[maybe_unused]] const int64_t m_rows = shape.m_rows, k = shape.k, panels = shape.panels, kpairs = shape.kpairs;
  TORCH_CHECK(n > 0, "bf16_linear_argmax: n must be positive");
  [[maybe_unused]] const bool on_amx = fused_on_amx(k, "bf16_linear_argmax");
  at::Tensor out = at::empty({m_rows}, x.options().dtype(at::kLong));
#if defined(ASCENDSERVE_BF16_DOT)
  if (m_rows == 0) return out;
  struct Pick {
    float value = 0.f;
    int64_t index = -1;  // -1: nothing seen yet
    bool nan = false;
  };
  const int64_t threads = at::get_num_threads();
  std::vector<Pick> picks(threads * m_rows);
  const uint32_t* x_ptr = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const uint32_t* w_ptr = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t panel_stride = kpairs * kPanel;
  // rows m0 .. m0 + rows - 1's sums of panel p (cols real outputs) into this thread's picks
  auto pick_from = [&](const float (*sums)[kPanel], int64_t p, int64_t m0, int rows, int64_t cols) {
    Pick* mine = picks.data() + std::min<int64_t>(at::get_thread_num(), threads - 1) * m_rows + m0;
    // A thread's panels come in increasing order, so a later sum equal to the pick never replaces it. Per row, the
    // panel's largest sum (and any NaN) is found on two vectors; only a new maximum looks for its first column.
    const __mmask16 valid[2] = {ascendserve_simd::lanes_below(cols, 0),
                                cols > 16 ? ascendserve_simd::lanes_below(cols, 16) : static_cast<__mmask16>(0)};
    const __m512 lowest = _mm512_set1_ps(std::numeric_limits<float>::lowest());
    for (int m = 0; m < rows; ++m) {
      Pick& pick = mine[m];
      if (pick.nan) continue;
      __mmask16 nan[2];
      __m512 v[2];
      for (int h = 0; h < 2; ++h) {
        v[h] = _mm512_mask_loadu_ps(lowest, valid[h], &sums[m][16 * h]);
        const __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(v[h]), _mm512_set1_epi32(0x7fffffff));
        nan[h] = _mm512_mask_cmpgt_epi32_mask(valid[h], magnitude, _mm512_set1_epi32(0x7f800000));
      }
      if (nan[0] | nan[1]) {  // the row's first NaN: nothing later can replace it
        const int c = nan[0] ? __builtin_ctz(nan[0]) : 16 + __builtin_ctz(nan[1]);
        pick = {sums[m][c], p * kPanel + c, true};
        continue;
      }
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(v[0], v[1]));
      if (pick.index >= 0 && !(top > pick.value)) continue;
      int c = 0;
      while (sums[m][c] != top) ++c;
      pick.value = top;
      pick.index = p * kPanel + c;
    }
  };
#if defined(ASCENDSERVE_BF16_AMX)
  if (on_amx) {
    for_each_amx_block(m_rows, k, n, panels, [&](int64_t p, int64_t m0, int rows, int64_t cols, int64_t kp0,
                                                 int64_t kp1, float* partial) {
      alignas(64) float sums[kAmxRows][kPanel];
      if (amx_sums(rows, x_ptr + m0 * kpairs, kpairs, w_ptr + p * panel_stride, kp0, kp1, kpairs, partial, sums))
        pick_from(sums, p, m0, rows, cols);
    });
  } else
#endif
  {
    ascendserve_panel::for_each_tile<kRowBlock>(m_rows, k, n, panels, [&](int64_t p, int64_t m0, int rows,
                                                                          int64_t cols) {
      ascendserve_panel::in_row_blocks<kRowBlock>(rows, [&](int r0, auto r) {
        alignas(64) float sums[kRowBlock][kPanel];
        tile_dot<decltype(r)::value>(x_ptr + (m0 + r0) * kpairs, kpairs, w_ptr + p * panel_stride, kpairs, &sums[0][0],
                                     kPanel, cols, static_cast<const float*>(nullptr));
        pick_from(sums, p, m0 + r0, decltype(r)::value, cols);
      });
    });
  }
  int64_t* index = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < m_rows; ++m) {
    Pick best;
    for (int64_t t = 0; t < threads; ++t) {
      const Pick& pick = picks[t * m_rows + m];
      if (pick.index < 0) continue;
      const bool better = best.index < 0 || (pick.nan != best.nan ? pick.nan
                                             : pick.nan ? pick.index < best.index
                                             : pick.value > best.value || (pick.value == best.value &&
                                                                           pick.index < best.index));
      if (better) best = pick;
    }
    index[m] = best.index;
  }
#endif
  return out;
}

at::Tensor bf16_linear_bf16x(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                             const c10::optional<at::Tensor>& bias, bool bf16_out) {
  return bf16x(x, packed, n, bias, bf16_out, true);
}

// The same on the vdpbf16ps tile at every batch size (the reference the AMX blocks are tested against).
at::Tensor bf16_linear_bf16x_dot(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                 const c10::optional<at::Tensor>& bias, bool bf16_out) {
  return bf16x(x, packed, n, bias, bf16_out, false);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                  bool portable) {
  const PanelShape shape = checked_shape(x, at::kFloat, packed, n, "bf16_linear");
  const int64_t m_rows = shape.m_rows, k = shape.k, panels = shape.panels, kpairs = shape.kpairs;
  const float* bias_ptr = ascendserve_panel::checked_bias(bias, n, "bf16_linear");
  at::Tensor out = at::empty({m_rows, n}, x.options());
  if (m_rows == 0) return out;
  const float* x_ptr = x.data_ptr<float>();
  const uint32_t* w_ptr = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  float* out_ptr = out.data_ptr<float>();
  const int64_t panel_stride = kpairs * kPanel;
  ascendserve_panel::for_each_tile<kRowBlock>(m_rows, k, n, panels, [&](int64_t p, int64_t m0, int rows, int64_t cols) {
    (portable ? tile_portable : tile_fast)(rows, x_ptr + m0 * k, k, w_ptr + p * panel_stride, kpairs,
                                           out_ptr + m0 * n + p * kPanel, n, cols,
                                           bias_ptr ? bias_ptr + p * kPanel : nullptr);
  });
  return out;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  return linear(x, packed, n, bias, false);
}

at::Tensor bf16_linear_portable(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                const c10::optional<at::Tensor>& bias) {
  return linear(x, packed, n, bias, true);
}

// The dense fp32 [N, K] weight back from the pack: prefill-sized batches multiply by it with MKL,
// which is faster there than the tile above once the product is compute-bound.
at::Tensor bf16_unpack(const at::Tensor& packed, int64_t n) {
  check_pack(packed, "bf16_unpack", "[N/32, K/2, 32, 2]");
  const int64_t panels = packed.size(0), kpairs = packed.size(1), k = 2 * kpairs;
  ascendserve_panel::check_outputs(n, panels, kPanel, "bf16_unpack");
  at::Tensor out = at::empty({n, k}, packed.options().dtype(at::kFloat));
  const uint32_t* w_ptr = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  uint32_t* out_ptr = reinterpret_cast<uint32_t*>(out.data_ptr<float>());
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const uint32_t* lanes = w_ptr + (row / kPanel) * kpairs * kPanel + row % kPanel;
      uint32_t* dst = out_ptr + row * k;
      for (int64_t kp = 0; kp < kpairs; ++kp) {
        const uint32_t lane = lanes[kp * kPanel];
        dst[2 * kp] = lane << 16;
        dst[2 * kp + 1] = lane & 0xffff0000u;
      }
    }
  });
  return out;
}

// Whether the linear kernels' tiles were compiled for AVX-512 or AVX2 (see panel_linear.h).
bool simd_tiles() { return ascendserve_panel::simd_tiles(); }
int64_t tile_lanes() { return ascendserve_panel::tile_lanes(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendserve_cpu, m) {
  m.def("simd_tiles() -> bool", &simd_tiles);
  m.def("tile_lanes() -> int", &tile_lanes);
  m.def("bf16_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("bf16_linear_portable(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("bf16_unpack(Tensor packed, int n) -> Tensor");
  m.def("bf16_dot() -> bool", &bf16_dot);
  m.def("bf16_amx() -> bool", &bf16_amx);
  m.def("bf16_linear_bf16x(Tensor x, Tensor packed, int n, Tensor? bias, bool bf16_out) -> Tensor");
  m.def("bf16_linear_bf16x_dot(Tensor x, Tensor packed, int n, Tensor? bias, bool bf16_out) -> Tensor");
  m.def("bf16_linear_silu_mul(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("bf16_linear_argmax(Tensor x, Tensor packed, int n) -> Tensor");
  m.impl("bf16_linear_bf16x", c10::DispatchKey::CPU, TORCH_FN(bf16_linear_bf16x));
  m.impl("bf16_linear_silu_mul", c10::DispatchKey::CPU, TORCH_FN(bf16_linear_silu_mul));
  m.impl("bf16_linear_argmax", c10::DispatchKey::CPU, TORCH_FN(bf16_linear_argmax));
  m.impl("bf16_linear_bf16x_dot", c10::DispatchKey::CPU, TORCH_FN(bf16_linear_bf16x_dot));
  m.impl("bf16_unpack", c10::DispatchKey::CPU, TORCH_FN(bf16_unpack));
  m.impl("bf16_linear", c10::DispatchKey::CPU, TORCH_FN(bf16_linear));
  m.impl("bf16_linear_portable", c10::DispatchKey::CPU, TORCH_FN(bf16_linear_portable));
}
