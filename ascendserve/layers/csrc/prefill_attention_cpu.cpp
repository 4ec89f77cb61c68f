// Causal prefill attention for CPUs in fp32: the queries of `count` sequences over their own keys. q, k, v and out
// are all fp32, or all bf16 (a model run in bf16: each value widened as it is packed, exact, and the fp32 result
// rounded once as it is stored; before, the layer widened copies of q / k / v and rounded a copy of the output, four
// passes over them: 18 ms of the demo's 0.5 s 8 x 256 bf16 prefill on a 2-core Xeon, torch.profiler).
//
// q [count * Tq, Hq, D] and k / v [count * Tk, Hk, D], Tk >= Tq (a cached prefix of Tk - Tq tokens): query i of
// a sequence sits at position Tk - Tq + i and sees keys 0 .. Tk - Tq + i. Query heads h*G .. h*G+G-1 share kv
// head h (enable_gqa's grouping). Rows may be strided (the qkv projection's split views); a row's heads are
// contiguous. The result goes into out [count * Tq, Hq, D] (rows contiguous, row stride free).
//
// Why: torch's CPU flash attention ran the demo's prefill (8 prompts x 256 tokens, 9 heads over 3 kv heads,
// D = 64) at ~43 GFLOP/s, 10% of a 2048-token prefill step, its products small MKL GEMMs. Here the products
// are the panel GEMM's register tile (f32_tile.h) on operands packed per work item:
//   - first, per (sequence, kv head): K as panels of 16 keys [Tk/16][D][16] and V as panels of 16 of its D
//     columns [D/16][Tk][16];
//   - then work items (sequence, kv head, block of kQueryBlock queries), the threads taking the next free one,
//     the blocks late in a sequence (more keys) first; per query head of the group: its queries, scaled, as 6-row
//     tiles [D][6]; S = Q K^T by the tile (depth D, only the key panels a tile's last row sees); each row's
//     softmax over its causal prefix, written as P tiles [keys][6] (zero past the prefix); out = P V by the
//     tile (depth: the prefix of the tile's last row).
// bf16 with head_dim a multiple of 32 takes bf16 products instead, the same arithmetic on either instruction set: AMX's
// tiles where the CPU has them (run_amx), else vdpbf16ps where it has AVX512-BF16 (run_dot).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "bf16_convert.h"
#include "f32_tile.h"
#include "panel_linear.h"
#include "softmax_simd.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define ASCENDSERVE_PREFILL_DOT 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define ASCENDSERVE_PREFILL_AMX 1
#endif

namespace {

using ascendserve_f32::kTileCols;
using ascendserve_f32::kTileRows;
using ascendserve_f32::TileOut;
using ascendserve_f32::tile_fast;
using ascendserve_bf16::from_float;
using ascendserve_bf16::to_float;

constexpr int64_t kQueryBlock = 48;  // queries per work item (8 tiles of 6)

// s[0 .. n) = exp(s - max(s)); returns the sum.
inline float softmax_numerators(float* s, int64_t n) {
#if defined(__AVX512F__)
  return ascendserve_simd::softmax_numerators_avx512(s, n);
#elif defined(__AVX2__) && defined(__FMA__)
  return ascendserve_simd::softmax_numerators_avx2(s, n);
#else
  const float mx = *std::max_element(s, s + n);
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) sum += (s[t] = std::exp(s[t] - mx));
  return sum;
#endif
}

// T: float or at::BFloat16, the same for q, k, v and out.
template <typename T>
struct Operand {
  const T* data;
  int64_t row_stride;  // elements between consecutive tokens
};

template <typename T>
struct Problem {
  Operand<T> q, k, v;
  T* out;
  int64_t out_stride;
  int64_t tq, tk, heads, kv_heads, head_dim;
  float scale;
};

// Per-thread scratch for one work item's queries (out_tile: a tile's fp32 output rows before a bf16 out rounds them).
struct Scratch {
  std::vector<float> q_tiles, scores, p_tiles, out_tile;
  template <typename T>
  Scratch(const Problem<T>& pr) : out_tile(kTileRows * pr.head_dim) {
    const int64_t key_panels = (pr.tk + kTileCols - 1) / kTileCols, tiles = (kQueryBlock + kTileRows - 1) / kTileRows;
    q_tiles.resize(pr.heads / pr.kv_heads * tiles * pr.head_dim * kTileRows);
    scores.resize(tiles * kTileRows * key_panels * kTileCols);
    p_tiles.resize(tiles * pr.tk * kTileRows);
  }
};

// K of (sequence, kv head) as panels of 16 keys [tk/16][D][16] (the last panel's missing keys zero), V as
// panels of 16 of its D columns [D/16][tk][16]: k_panels / v_panels hold one such pair per (sequence, kv head).
template <typename T>
void pack_keys_values(const Problem<T>& pr, int64_t seq, int64_t h, float* kp, float* vp) {
  const int64_t d = pr.head_dim, key_panels = (pr.tk + kTileCols - 1) / kTileCols;
  const T* k_seq = pr.k.data + seq * pr.tk * pr.k.row_stride + h * d;
  const T* v_seq = pr.v.data + seq * pr.tk * pr.v.row_stride + h * d;
  for (int64_t p = 0; p < key_panels; ++p)
    for (int64_t j = 0; j < kTileCols; ++j) {
      const int64_t t = p * kTileCols + j;
      float* dst = kp + p * d * kTileCols + j;
      if (t < pr.tk) {
        const T* src = k_seq + t * pr.k.row_stride;
        for (int64_t i = 0; i < d; ++i) dst[i * kTileCols] = to_float(src[i]);
      } else {
        for (int64_t i = 0; i < d; ++i) dst[i * kTileCols] = 0.f;
      }
    }
  for (int64_t t = 0; t < pr.tk; ++t) {
    const T* src = v_seq + t * pr.v.row_stride;
    for (int64_t c = 0; c < d / kTileCols; ++c)
      for (int64_t j = 0; j < kTileCols; ++j) vp[(c * pr.tk + t) * kTileCols + j] = to_float(src[c * kTileCols + j]);
  }
}

// One work item: sequence `seq`, kv head h, queries q0 .. q0 + rows - 1, over the packed kp / vp of (seq, h).
template <typename T>
void attend_block(const Problem<T>& pr, int64_t q0, int64_t rows, int64_t seq, int64_t h, const float* kp,
                  const float* vp, Scratch& sc) {
  const int64_t d = pr.head_dim, offset = pr.tk - pr.tq, group = pr.heads / pr.kv_heads;
  const int64_t keys = offset + q0 + rows;  // what the block's last query sees
  const int64_t lds = (keys + kTileCols - 1) / kTileCols * kTileCols;
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  // A tile's last row sees this many keys.
  auto tile_keys = [&](int64_t t) { return offset + q0 + std::min(rows, (t + 1) * kTileRows); };
  // The group's queries, scaled, as 6-row tiles per head [group][tiles][D][6] (a query row's group heads are
  // contiguous in q: read front to back, the next row prefetched).
  const int64_t tile_size = d * kTileRows, head_tiles = tiles * tile_size;
  for (int64_t r = 0; r < tiles * kTileRows; ++r) {
    float* dst = sc.q_tiles.data() + r / kTileRows * tile_size + r % kTileRows;
    if (r < rows) {
      const T* src = pr.q.data + (seq * pr.tq + q0 + r) * pr.q.row_stride + h * group * d;
      if (r + 1 < rows)
        for (int64_t i = 0; i < group * d; i += 16) __builtin_prefetch(src + pr.q.row_stride + i);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i) dst[g * head_tiles + i * kTileRows] = to_float(src[g * d + i]) * pr.scale;
    } else {
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i) dst[g * head_tiles + i * kTileRows] = 0.f;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const int64_t head = h * group + g;
    const float* qa = sc.q_tiles.data() + g * head_tiles;
    float* s = sc.scores.data();
    for (int64_t t = 0; t < tiles; ++t) {
      const int tile_rows = static_cast<int>(std::min<int64_t>(kTileRows, rows - t * kTileRows));
      const int64_t panels = (tile_keys(t) + kTileCols - 1) / kTileCols;
      for (int64_t p = 0; p < panels; ++p)
        tile_fast(d, qa + t * d * kTileRows, kp + p * d * kTileCols,
                  TileOut{s + t * kTileRows * lds + p * kTileCols, lds, tile_rows, kTileCols, nullptr, true});
    }
    float* pa = sc.p_tiles.data();
    for (int64_t t = 0; t < tiles; ++t)
      for (int m = 0; m < kTileRows; ++m) {
        const int64_t r = t * kTileRows + m;
        float* dst = pa + t * keys * kTileRows + m;
        const int64_t seen = r < rows ? offset + q0 + r + 1 : 0;
        if (seen) {
          float* row = s + r * lds;
          const float inv = 1.f / softmax_numerators(row, seen);
          for (int64_t i = 0; i < seen; ++i) dst[i * kTileRows] = row[i] * inv;
        }
        for (int64_t i = seen; i < tile_keys(t); ++i) dst[i * kTileRows] = 0.f;
      }
    for (int64_t t = 0; t < tiles; ++t) {
      const int tile_rows = static_cast<int>(std::min<int64_t>(kTileRows, rows - t * kTileRows));
      T* out_rows = pr.out + (seq * pr.tq + q0 + t * kTileRows) * pr.out_stride + head * d;
      constexpr bool direct = std::is_same_v<T, float>;  // fp32 out: the tile writes it; bf16: via out_tile
      float* tile_out = direct ? reinterpret_cast<float*>(out_rows) : sc.out_tile.data();
      const int64_t ldo = direct ? pr.out_stride : d;
      for (int64_t c = 0; c < d / kTileCols; ++c)
        tile_fast(tile_keys(t), pa + t * keys * kTileRows, vp + c * pr.tk * kTileCols,
                  TileOut{tile_out + c * kTileCols, ldo, tile_rows, kTileCols, nullptr, true});
      if constexpr (!direct)
        for (int m = 0; m < tile_rows; ++m)
          for (int64_t i = 0; i < d; ++i) out_rows[m * pr.out_stride + i] = from_float<T>(tile_out[m * d + i]);
    }
  }
}

// The Problem over these tensors (checked by prefill_attention).
template <typename T>
Problem<T> make_problem(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t count,
                        double scale) {
  return Problem<T>{{q.data_ptr<T>(), q.stride(0)}, {k.data_ptr<T>(), k.stride(0)}, {v.data_ptr<T>(), v.stride(0)},
                    out.data_ptr<T>(), out.stride(0), q.size(0) / count, k.size(0) / count, q.size(1), k.size(1),
                    q.size(2), static_cast<float>(scale)};
}

// pack(pair) for every (sequence, kv head) pair, then the work items (pair, block of kQueryBlock queries) from the last
// query block (the most keys) to the first, each thread taking the next one free: per thread, worker(drain) sets up
// what the thread needs and calls drain(attend), which runs attend(q0, rows, pair) for each item the thread takes.
template <typename Pack, typename Worker>
void pack_then_attend(int64_t pairs, int64_t tq, const Pack& pack, const Worker& worker) {
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) pack(i);
  });
  const int64_t blocks = (tq + kQueryBlock - 1) / kQueryBlock, items = pairs * blocks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    worker([&](const auto& attend) {
      for (int64_t item = next++; item < items; item = next++) {
        const int64_t b = blocks - 1 - item / pairs;
        attend(b * kQueryBlock, std::min(kQueryBlock, tq - b * kQueryBlock), item % pairs);
      }
    });
  });
}

#if defined(ASCENDSERVE_PREFILL_DOT)
// e[t] = exp(scale (s[t] - max s)) for t < n, split into hi[t] = bf16(e[t]) and lo[t] = bf16(e[t] - hi[t]) (both
// rounded to nearest even), zero from n to `width` (a multiple of 16); returns the sum of the fp32 e[t]. One pass for
// the exponentials and their split (the softmax's 1 / sum scales the output rows instead of P).
inline float exp_split(const float* s, int64_t n, int64_t width, float scale, uint16_t* hi, uint16_t* lo) {
  const __m512 f = _mm512_set1_ps(scale);
  const __m512 shift = _mm512_set1_ps(n > 0 ? -scale * ascendserve_simd::max512(s, n) : 0.f);
  __m512 vsum = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t < n; t += 16) {
    const __mmask16 m = ascendserve_simd::lanes_below(n, t);
    const __m512 e = _mm512_maskz_mov_ps(m, ascendserve_simd::exp512(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, s + t),
                                                                                     f, shift)));
    vsum = _mm512_add_ps(vsum, e);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + t), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + t),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(e, ascendserve_bf16::widen16(h))));
  }
  for (; t < width; t += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + t), _mm256_setzero_si256());
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + t), _mm256_setzero_si256());
  }
  return _mm512_reduce_add_ps(vsum);
}

// bf16 on vdpbf16ps (AVX512-BF16 without AMX, head_dim a multiple of 32): the AMX path's arithmetic (below) with
// register tiles instead of AMX's. vdpbf16ps multiplies a row's value pair, broadcast as one 32-bit lane, by 16 columns'
// pairs and adds both products to 16 fp32 sums (exact products, fp32 sums). Per work item, query head and tile of up
// to kDotRows queries:
//   S = Q K^T, the tile's query rows as dimension pairs against K packed as panels of 32 keys;
//   E = exp(scale (S - max S)) over each row's causal prefix in fp32, split into E_hi + E_lo in bf16 (exp_split);
//   O = E_hi V + E_lo V against V packed as panels of 32 dimensions, times 1 / sum, rounded to bf16 once.
// The fp32 loops (attend_block) widen every value and multiply on fp32 FMAs: half the products per instruction. 2-vCPU
// AMD EPYC Zen 4, 30 layers of the demo's 8 x 256 prefill (9 / 3 heads of 64), alternated in one process: 133 -> 98-100
// ms (with E rounded to bf16 once instead of split: 76 ms, off by up to 4 bf16 steps); Qwen3.5's 6 layers (8 / 2 heads
// of 256) 80 -> 57 ms.
constexpr int kDotRows = 12;  // query rows per register tile: 24 accumulators

// K of (seq, h) as panels of 32 keys [tk/32][d/2][32] of dimension pairs (key n's (K[n][2i], K[n][2i + 1]) at
// [p][i][n]); V as panels of 32 dimensions [d/32][tk/2][32] of key pairs ((V[2i][32c + n], V[2i + 1][32c + n]) at
// [c][i][n]). Keys rounded up to 32, zero past tk.
int64_t dot_keys(int64_t tk) { return (tk + 31) / 32 * 32; }
int64_t dot_k_size(int64_t tk, int64_t d) { return dot_keys(tk) * d / 2; }  // in 32-bit pairs
int64_t dot_v_size(int64_t tk, int64_t d) { return dot_keys(tk) / 2 * d; }

void pack_kv_dot(const Problem<at::BFloat16>& pr, int64_t seq, int64_t h, uint32_t* kp, uint32_t* vp) {
  const int64_t d = pr.head_dim, pairs = d / 2, keys = dot_keys(pr.tk), key_pairs = keys / 2;
  const at::BFloat16* k_seq = pr.k.data + seq * pr.tk * pr.k.row_stride + h * d;
  const at::BFloat16* v_seq = pr.v.data + seq * pr.tk * pr.v.row_stride + h * d;
  for (int64_t t = 0; t < keys; ++t) {
    uint32_t* dst = kp + t / 32 * pairs * 32 + t % 32;
    if (t < pr.tk) {
      uint32_t kr[256];  // d / 2 pairs (head_dim <= 512), read whole: the row may sit at any 2-byte offset
      std::memcpy(kr, k_seq + t * pr.k.row_stride, d * 2);
      for (int64_t i = 0; i < pairs; ++i) dst[i * 32] = kr[i];
    } else {
      for (int64_t i = 0; i < pairs; ++i) dst[i * 32] = 0;
    }
  }
  // keys 2i and 2i + 1 interleaved dimension by dimension: 32 dimensions of a key pair are one 128-byte row
  for (int64_t i = 0; i < key_pairs; ++i) {
    const int64_t t = 2 * i;
    for (int64_t c = 0; c < d / 32; ++c) {
      const __m512i a = t < pr.tk ? _mm512_loadu_si512(v_seq + t * pr.v.row_stride + 32 * c) : _mm512_setzero_si512();
      const __m512i b = t + 1 < pr.tk ? _mm512_loadu_si512(v_seq + (t + 1) * pr.v.row_stride + 32 * c)
                                      : _mm512_setzero_si512();
      // unpacklo / unpackhi interleave within 128-bit lanes: dimensions 8L + 0..3 and 8L + 4..7 of lane L; the
      // permutes put the 32 pairs in dimension order
      const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
      const __m512i first = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), hi);
      const __m512i second = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), hi);
      uint32_t* dst = vp + (c * key_pairs + i) * 32;
      _mm512_storeu_si512(dst, first);
      _mm512_storeu_si512(dst + 16, second);
    }
  }
}

// acc[m][0 .. 2) += sum over kp < kpairs of x_m[kp] (broadcast pair) . panel[kp][0 .. 32) for ROWS rows x_m = x + m *
// ldx (32-bit pairs), and of x2_m[kp] too where x2 is given (E_lo beside E_hi: one pass over the panel for both).
template <int ROWS, bool kTwo>
inline void dot_rows(const uint32_t* x, const uint32_t* x2, int64_t ldx, const uint32_t* panel, int64_t kpairs,
                     __m512 (&acc)[ROWS][2]) {
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kpairs; ++kp) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + kp * 32);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + kp * 32 + 16);
    for (int m = 0; m < ROWS; ++m) {
      const __m512bh xp = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + kp]));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xp, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xp, w1);
      if constexpr (kTwo) {
        const __m512bh xq = (__m512bh)_mm512_set1_epi32(static_cast<int>(x2[m * ldx + kp]));
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xq, w0);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xq, w1);
      }
    }
  }
}

// Per-thread scratch: a tile's queries [kDotRows][d / 2] pairs, scores [kDotRows][lds] and E's two parts
// [kDotRows][lds] (lds: the keys rounded up to 32).
struct DotScratch {
  int64_t lds;
  std::vector<uint32_t> q;
  std::vector<float> scores;
  std::vector<uint16_t> p_hi, p_lo;
  DotScratch(const Problem<at::BFloat16>& pr)
      : lds(dot_keys(pr.tk)), q(kDotRows * pr.head_dim / 2), scores(kDotRows * lds), p_hi(kDotRows * lds),
        p_lo(kDotRows * lds) {}
};

// One tile of ROWS queries (from row `row` of the sequence's queries) of query head `head` over (seq, h)'s packed K / V.
template <int ROWS>
void attend_tile_dot(const Problem<at::BFloat16>& pr, int64_t seq, int64_t head, int64_t row, const uint32_t* kp,
                     const uint32_t* vp, DotScratch& sc) {
  const int64_t d = pr.head_dim, pairs = d / 2, offset = pr.tk - pr.tq, lds = sc.lds;
  const int64_t last_keys = offset + row + ROWS, key_chunks = (last_keys + 31) / 32;  // what the last row sees
  for (int m = 0; m < ROWS; ++m)  // the rows' values as pairs (a row may sit at any 2-byte offset)
    std::memcpy(sc.q.data() + m * pairs, pr.q.data + (seq * pr.tq + row + m) * pr.q.row_stride + head * d, d * 2);
  const uint32_t* q = sc.q.data();
  const int64_t ldq = pairs;
  __m512 acc[ROWS][2];
  for (int64_t p = 0; p < key_chunks; ++p) {
    dot_rows<ROWS, false>(q, nullptr, ldq, kp + p * pairs * 32, pairs, acc);
    for (int m = 0; m < ROWS; ++m) {
      _mm512_storeu_ps(sc.scores.data() + m * lds + 32 * p, acc[m][0]);
      _mm512_storeu_ps(sc.scores.data() + m * lds + 32 * p + 16, acc[m][1]);
    }
  }
  float inv[ROWS];
  for (int m = 0; m < ROWS; ++m) {
    const int64_t seen = offset + row + m + 1;
    inv[m] = 1.f / exp_split(sc.scores.data() + m * lds, seen, key_chunks * 32, pr.scale, sc.p_hi.data() + m * lds,
                             sc.p_lo.data() + m * lds);
  }
  const uint32_t* hi = reinterpret_cast<const uint32_t*>(sc.p_hi.data());
  const uint32_t* lo = reinterpret_cast<const uint32_t*>(sc.p_lo.data());
  const int64_t key_pairs = lds / 2;  // V's panels hold dot_keys(tk) = lds keys
  for (int64_t c = 0; c < d / 32; ++c) {
    dot_rows<ROWS, true>(hi, lo, lds / 2, vp + c * key_pairs * 32, key_chunks * 16, acc);
    for (int m = 0; m < ROWS; ++m) {
      at::BFloat16* dst = pr.out + (seq * pr.tq + row + m) * pr.out_stride + head * d + 32 * c;
      const __m512 f = _mm512_set1_ps(inv[m]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[m][0], f)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[m][1], f)));
    }
  }
}

void run_dot(const Problem<at::BFloat16>& pr, int64_t count) {
  const int64_t pairs = count * pr.kv_heads, k_size = dot_k_size(pr.tk, pr.head_dim);
  const int64_t pair_size = k_size + dot_v_size(pr.tk, pr.head_dim), group = pr.heads / pr.kv_heads;
  std::vector<uint32_t> packed(pairs * pair_size);
  auto pack = [&](int64_t pair) {
    uint32_t* kp = packed.data() + pair * pair_size;
    pack_kv_dot(pr, pair / pr.kv_heads, pair % pr.kv_heads, kp, kp + k_size);
  };
  pack_then_attend(pairs, pr.tq, pack, [&](const auto& drain) {
    DotScratch sc(pr);
    drain([&](int64_t q0, int64_t rows, int64_t pair) {
      const uint32_t* kp = packed.data() + pair * pair_size;
      const int64_t seq = pair / pr.kv_heads, h = pair % pr.kv_heads;
      for (int64_t g = 0; g < group; ++g)
        ascendserve_panel::in_row_blocks<kDotRows>(static_cast<int>(rows), [&](int r0, auto n) {
          attend_tile_dot<decltype(n)::value>(pr, seq, h * group + g, q0 + r0, kp, kp + k_size, sc);
        });
    });
  });
}
#endif

#if defined(ASCENDSERVE_PREFILL_AMX)
// bf16 on AMX (head_dim a multiple of 32): tdpbf16ps multiplies a 16 x 32 bf16 A tile by a 32 x 16 B tile of value
// pairs into 16 x 16 fp32 sums (exact products, fp32 sums). Per work item and 16 queries of a query head:
//   S = Q K^T on the tiles (Q's bf16 values as they are: the products the fp32 arithmetic gives);
//   each row's softmax numerators over its causal prefix in fp32, E = exp(scale (S - max S)), and their sum;
//   O = E V with E split into bf16 high and low parts, E_hi = bf16(E), E_lo = bf16(E - E_hi), two tile products into
//   one fp32 sum: E_hi + E_lo is E to within 2^-16 of it, below the output's own bf16 rounding (SDPA's bf16 path
//   rounds P to bf16 once, 2^-8, which cost the demo's greedy "Paris");
//   the output row times 1 / sum, rounded to bf16 once.
// Tiles (all 16 rows x 64 bytes): 0, 4, 5, 6 the sums of up to four panels (independent chains: one accumulator's
// tdpbf16ps waits for the one before), 1 and 3 the A operands (Q, or E_hi and E_lo), 2 and 7 the B operands. With one
// accumulator the demo's 8 x 256 prefill attention took 3.35 ms a layer. Packing K and V with 32-bit moves and one
// permute per V row pair, the exponentials and their split in one pass (exp_split) and the output scaled and rounded
// 16 values at a time (the scale, split and rounding had been separate scalar passes over each row): the same
// 8 x 256 (9 / 3 heads of 64) 2.78-3.01 -> 1.90-2.05 ms a call, Qwen3.5's (8 / 2 heads of 256) 5.56-6.29 -> 3.69-4.61
// ms (alternated builds, 2-core Xeon, /tmp microbenchmark of the op).
constexpr int64_t kAmxTile = 16;  // a tile's rows and outputs
constexpr int kAmxSums = 4;       // accumulator tiles

// K of (seq, h) as B tiles per panel p of 16 keys and chunk c of 32 dims: row i, key n holds K[16p + n][32c + 2i + e]
// at [(p * chunks + c) * 512 + i * 32 + 2 n + e]; V as B tiles per chunk kc of 32 keys and panel dp of 16 dims: row i,
// dim n holds V[32kc + 2i + e][16dp + n] at [(kc * dpanels + dp) * 512 + i * 32 + 2 n + e]. Zero past tk.
int64_t amx_k_size(int64_t tk, int64_t d) { return (tk + 15) / 16 * (d / 32) * 512; }
int64_t amx_v_size(int64_t tk, int64_t d) { return (tk + 31) / 32 * (d / 16) * 512; }

void pack_kv_amx(const Problem<at::BFloat16>& pr, int64_t seq, int64_t h, uint16_t* kb, uint16_t* vb) {
  const int64_t d = pr.head_dim, chunks = d / 32, dpanels = d / 16, pairs = d / 2;
  const at::BFloat16* k_seq = pr.k.data + seq * pr.tk * pr.k.row_stride + h * d;
  const at::BFloat16* v_seq = pr.v.data + seq * pr.tk * pr.v.row_stride + h * d;
  // Only the last panel / chunk can hold positions past tk: zero those before the keys go in.
  const int64_t k_tail = pr.tk / 16 * chunks * 512, v_tail = pr.tk / 32 * dpanels * 512;
  std::fill(kb + k_tail, kb + amx_k_size(pr.tk, d), uint16_t{0});
  std::fill(vb + v_tail, vb + amx_v_size(pr.tk, d), uint16_t{0});
  // K: a key's dims as 32-bit pairs; pair x2 = 16c + i goes to row i of chunk c's tile, column 16p + n's pair.
  uint32_t* k32 = reinterpret_cast<uint32_t*>(kb);
  for (int64_t t = 0; t < pr.tk; ++t) {
    uint32_t kr[256];  // d / 2 pairs (head_dim <= 512), read whole: the row may sit at any 2-byte offset
    std::memcpy(kr, k_seq + t * pr.k.row_stride, d * 2);
    uint32_t* dst = k32 + t / 16 * chunks * 256 + t % 16;
    for (int64_t x2 = 0; x2 < pairs; ++x2) dst[x2 / 16 * 256 + x2 % 16 * 16] = kr[x2];
  }
  // V: keys 2i and 2i + 1 of a chunk interleaved dim by dim, 16 dims (one panel) per 64-byte row.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t t = 0; t < pr.tk; t += 2) {
    const at::BFloat16* even = v_seq + t * pr.v.row_stride;
    const at::BFloat16* odd = t + 1 < pr.tk ? even + pr.v.row_stride : nullptr;
    uint16_t* dst = vb + t / 32 * dpanels * 512 + t % 32 / 2 * 32;
    for (int64_t dp = 0; dp < dpanels; ++dp) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + 16 * dp));
      const __m256i b = odd ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + 16 * dp))
                            : _mm256_setzero_si256();
      const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
      _mm512_storeu_si512(dst + dp * 512, _mm512_permutexvar_epi16(interleave, ab));
    }
  }
}

// Per-thread scratch: a work item's 16 queries [16][d], their scores [16][lds] and E's two parts [16][lds] (lds: the
// keys rounded up to P V's 32), four tiles of output sums [16][64].
struct AmxScratch {
  int64_t lds;
  std::vector<uint16_t> q, p_hi, p_lo;
  std::vector<float> scores, out;
  AmxScratch(const Problem<at::BFloat16>& pr)
      : lds((pr.tk + 31) / 32 * 32), q(kAmxTile * pr.head_dim), p_hi(kAmxTile * lds), p_lo(kAmxTile * lds),
        scores(kAmxTile * lds), out(kAmxTile * 16 * kAmxSums) {}
};

// S[., 16 p0 .. 16 (p0 + N)) = Q K^T for the N <= 4 key panels from p0: q [16][d] bf16, kb as pack_kv_amx lays it out,
// s [16][lds] fp32.
template <int N>
inline void qk_panels(const uint16_t* q, int64_t d, const uint16_t* kb, int64_t p0, float* s, int64_t lds) {
  const int64_t chunks = d / 32;
  auto b = [&](int64_t p, int64_t c) { return kb + (p * chunks + c) * 512; };
  _tile_zero(0);
  if constexpr (N > 1) _tile_zero(4);
  if constexpr (N > 2) _tile_zero(5);
  if constexpr (N > 3) _tile_zero(6);
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(1, q + 32 * c, d * 2);
    _tile_loadd(2, b(p0, c), 64);
    _tile_dpbf16ps(0, 1, 2);
    if constexpr (N > 1) {
      _tile_loadd(7, b(p0 + 1, c), 64);
      _tile_dpbf16ps(4, 1, 7);
    }
    if constexpr (N > 2) {
      _tile_loadd(2, b(p0 + 2, c), 64);
      _tile_dpbf16ps(5, 1, 2);
    }
    if constexpr (N > 3) {
      _tile_loadd(7, b(p0 + 3, c), 64);
      _tile_dpbf16ps(6, 1, 7);
    }
  }
  _tile_stored(0, s + 16 * p0, lds * 4);
  if constexpr (N > 1) _tile_stored(4, s + 16 * (p0 + 1), lds * 4);
  if constexpr (N > 2) _tile_stored(5, s + 16 * (p0 + 2), lds * 4);
  if constexpr (N > 3) _tile_stored(6, s + 16 * (p0 + 3), lds * 4);
}

// o [16][64] fp32 = (E_hi + E_lo) V for the N <= 4 dim panels from dp0 over key_chunks chunks of 32 keys: hi / lo
// [16][lds] bf16, vb as pack_kv_amx lays it out.
template <int N>
inline void pv_panels(const uint16_t* hi, const uint16_t* lo, int64_t lds, const uint16_t* vb, int64_t dpanels,
                      int64_t dp0, int64_t key_chunks, float* o) {
  auto b = [&](int64_t kc, int64_t dp) { return vb + (kc * dpanels + dp) * 512; };
  _tile_zero(0);
  if constexpr (N > 1) _tile_zero(4);
  if constexpr (N > 2) _tile_zero(5);
  if constexpr (N > 3) _tile_zero(6);
  for (int64_t kc = 0; kc < key_chunks; ++kc) {
    _tile_loadd(1, hi + 32 * kc, lds * 2);
    _tile_loadd(3, lo + 32 * kc, lds * 2);
    _tile_loadd(2, b(kc, dp0), 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_dpbf16ps(0, 3, 2);
    if constexpr (N > 1) {
      _tile_loadd(7, b(kc, dp0 + 1), 64);
      _tile_dpbf16ps(4, 1, 7);
      _tile_dpbf16ps(4, 3, 7);
    }
    if constexpr (N > 2) {
      _tile_loadd(2, b(kc, dp0 + 2), 64);
      _tile_dpbf16ps(5, 1, 2);
      _tile_dpbf16ps(5, 3, 2);
    }
    if constexpr (N > 3) {
      _tile_loadd(7, b(kc, dp0 + 3), 64);
      _tile_dpbf16ps(6, 1, 7);
      _tile_dpbf16ps(6, 3, 7);
    }
  }
  _tile_stored(0, o, 256);
  if constexpr (N > 1) _tile_stored(4, o + 16, 256);
  if constexpr (N > 2) _tile_stored(5, o + 32, 256);
  if constexpr (N > 3) _tile_stored(6, o + 48, 256);
}

// One work item on AMX: sequence seq, kv head h, queries q0 .. q0 + rows - 1, 16 at a time per query head.
void attend_block_amx(const Problem<at::BFloat16>& pr, int64_t q0, int64_t rows, int64_t seq, int64_t h,
                      const uint16_t* kb, const uint16_t* vb, AmxScratch& sc) {
  const int64_t d = pr.head_dim, offset = pr.tk - pr.tq, group = pr.heads / pr.kv_heads;
  const int64_t dpanels = d / 16, lds = sc.lds;
  for (int64_t r0 = 0; r0 < rows; r0 += kAmxTile) {
    const int64_t n = std::min(kAmxTile, rows - r0), last_keys = offset + q0 + r0 + n;  // the last row sees
    const int64_t panels = (last_keys + 15) / 16, key_chunks = (last_keys + 31) / 32;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t head = h * group + g;
      for (int64_t m = 0; m < kAmxTile; ++m) {  // the 16 queries' rows, zero past the block
        uint16_t* dst = sc.q.data() + m * d;
        if (m < n) {
          std::memcpy(dst, pr.q.data + (seq * pr.tq + q0 + r0 + m) * pr.q.row_stride + head * d, d * 2);
        } else {
          std::fill(dst, dst + d, uint16_t{0});
        }
      }
      for (int64_t p0 = 0; p0 < panels; p0 += kAmxSums) {
        float* s = sc.scores.data();
        switch (std::min<int64_t>(kAmxSums, panels - p0)) {
          case 1: qk_panels<1>(sc.q.data(), d, kb, p0, s, lds); break;
          case 2: qk_panels<2>(sc.q.data(), d, kb, p0, s, lds); break;
          case 3: qk_panels<3>(sc.q.data(), d, kb, p0, s, lds); break;
          default: qk_panels<4>(sc.q.data(), d, kb, p0, s, lds); break;
        }
      }
      float inv[kAmxTile];  // 1 / each row's softmax sum, applied to its output
      for (int64_t m = 0; m < kAmxTile; ++m) {
        const int64_t seen = m < n ? offset + q0 + r0 + m + 1 : 0;
        const float sum = exp_split(sc.scores.data() + m * lds, seen, key_chunks * 32, pr.scale,
                                    sc.p_hi.data() + m * lds, sc.p_lo.data() + m * lds);
        inv[m] = seen ? 1.f / sum : 0.f;
      }
      for (int64_t dp0 = 0; dp0 < dpanels; dp0 += kAmxSums) {
        const int64_t np = std::min<int64_t>(kAmxSums, dpanels - dp0);
        const uint16_t *hi = sc.p_hi.data(), *lo = sc.p_lo.data();
        float* o = sc.out.data();
        switch (np) {
          case 1: pv_panels<1>(hi, lo, lds, vb, dpanels, dp0, key_chunks, o); break;
          case 2: pv_panels<2>(hi, lo, lds, vb, dpanels, dp0, key_chunks, o); break;
          case 3: pv_panels<3>(hi, lo, lds, vb, dpanels, dp0, key_chunks, o); break;
          default: pv_panels<4>(hi, lo, lds, vb, dpanels, dp0, key_chunks, o); break;
        }
        for (int64_t m = 0; m < n; ++m) {
          at::BFloat16* dst = pr.out + (seq * pr.tq + q0 + r0 + m) * pr.out_stride + head * d + 16 * dp0;
          const __m512 f = _mm512_set1_ps(inv[m]);
          for (int64_t j = 0; j < np; ++j)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + m * 64 + 16 * j), f)));
        }
      }
    }
  }
}

void run_amx(const Problem<at::BFloat16>& pr, int64_t count) {
  const int64_t pairs = count * pr.kv_heads, k_size = amx_k_size(pr.tk, pr.head_dim);
  const int64_t pair_size = k_size + amx_v_size(pr.tk, pr.head_dim);
  std::vector<uint16_t> packed(pairs * pair_size);
  auto pack = [&](int64_t pair) {
    uint16_t* kb = packed.data() + pair * pair_size;
    pack_kv_amx(pr, pair / pr.kv_heads, pair % pr.kv_heads, kb, kb + k_size);
  };
  pack_then_attend(pairs, pr.tq, pack, [&](const auto& drain) {
    ascendserve_amx::Config config;
    for (int t = 0; t < 8; ++t) {
      config.rows[t] = kAmxTile;
      config.colsb[t] = 64;
    }
    ascendserve_amx::load(config);
    AmxScratch sc(pr);
    drain([&](int64_t q0, int64_t rows, int64_t pair) {
      const uint16_t* kb = packed.data() + pair * pair_size;
      attend_block_amx(pr, q0, rows, pair / pr.kv_heads, pair % pr.kv_heads, kb, kb + k_size, sc);
    });
    _tile_release();
  });
}
#endif

// Whether bf16 prefills with head_dim a multiple of 32 run on AMX here (built for a CPU with AMX-BF16, the tile state
// granted by Linux).
bool prefill_attention_amx() {
#if defined(ASCENDSERVE_PREFILL_AMX)
  return ascendserve_amx::permitted();
#else
  return false;
#endif
}

// Whether bf16 prefills with head_dim a multiple of 32 (up to 512) run on vdpbf16ps here: built for a CPU with
// AVX512-BF16, and not on AMX (prefill_attention_amx()).
bool prefill_attention_dot() {
#if defined(ASCENDSERVE_PREFILL_DOT)
  return !prefill_attention_amx();
#else
  return false;
#endif
}

void check_rows(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == dtype && t.stride(2) == 1 && t.stride(1) == t.size(2),
              "prefill_attention: ", name, " must be fp32 or bf16 (q's dtype for all four) [tokens, heads, head_dim] "
              "with each row's heads contiguous");
}

template <typename T>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t count, double scale);

void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t count,
                       double scale) {
  const at::ScalarType dtype = q.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
  check_rows(q, "q", dtype);
  check_rows(k, "k", dtype);
  check_rows(v, "v", dtype);
  check_rows(out, "out", dtype);
  TORCH_CHECK(out.sizes() == q.sizes(), "prefill_attention: out must have q's shape");
  TORCH_CHECK(k.sizes() == v.sizes(), "prefill_attention: k and v must have one shape");
  const int64_t heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
  TORCH_CHECK(k.size(2) == d && d % kTileCols == 0, "prefill_attention: head_dim must match and be a multiple of ",
              kTileCols);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "prefill_attention: ", heads, " query heads over ", kv_heads,
              " kv heads");
  TORCH_CHECK(count > 0 && q.size(0) % count == 0 && k.size(0) % count == 0,
              "prefill_attention: q and k rows must split into ", count, " sequences");
  const int64_t tq = q.size(0) / count, tk = k.size(0) / count;
  TORCH_CHECK(tk >= tq, "prefill_attention: fewer keys (", tk, ") than queries (", tq, ") per sequence");
  if (tq == 0) return;
#if defined(ASCENDSERVE_PREFILL_AMX)
  if (dtype == at::kBFloat16 && d % 32 == 0 && d <= 512 && prefill_attention_amx())
    return run_amx(make_problem<at::BFloat16>(out, q, k, v, count, scale), count);
#endif
#if defined(ASCENDSERVE_PREFILL_DOT)
  if (dtype == at::kBFloat16 && d % 32 == 0 && d <= 512)
    return run_dot(make_problem<at::BFloat16>(out, q, k, v, count, scale), count);
#endif
  if (dtype == at::kBFloat16)
    run<at::BFloat16>(out, q, k, v, count, scale);
  else
    run<float>(out, q, k, v, count, scale);
}

template <typename T>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t count, double scale) {
  const Problem<T> pr = make_problem<T>(out, q, k, v, count, scale);
  const int64_t pairs = count * pr.kv_heads, d = pr.head_dim, key_panels = (pr.tk + kTileCols - 1) / kTileCols;
  const int64_t k_size = key_panels * d * kTileCols, pair_size = k_size + d * pr.tk;
  at::Tensor packed = at::empty({pairs, pair_size}, q.options().dtype(at::kFloat));
  float* packed_ptr = packed.data_ptr<float>();
  auto pack = [&](int64_t pair) {
    float* kp = packed_ptr + pair * pair_size;
    pack_keys_values(pr, pair / pr.kv_heads, pair % pr.kv_heads, kp, kp + k_size);
  };
  pack_then_attend(pairs, pr.tq, pack, [&](const auto& drain) {
    Scratch sc(pr);
    drain([&](int64_t q0, int64_t rows, int64_t pair) {
      const float* kp = packed_ptr + pair * pair_size;
      attend_block(pr, q0, rows, pair / pr.kv_heads, pair % pr.kv_heads, kp, kp + k_size, sc);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendserve_cpu, m) {
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, int count, float scale) -> ()");
  m.impl("prefill_attention", c10::DispatchKey::CPU, TORCH_FN(prefill_attention));
  m.def("prefill_attention_amx() -> bool", &prefill_attention_amx);
  m.def("prefill_attention_dot() -> bool", &prefill_attention_dot);
}
