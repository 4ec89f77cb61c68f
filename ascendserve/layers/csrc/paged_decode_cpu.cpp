// Paged decode attention for CPUs: one query token per request, read straight from the KV blocks.
//
// The plain-torch path gathers every request's blocks into a contiguous workspace and then runs
// SDPA over it, so each K/V byte crosses memory three times (gather read, gather write, SDPA read);
// at 64 streams that gather was 40% of a decode step. Here every request's K and V rows are read
// once, in block-table order.
//
// Layout (ascendserve/layers/attention.py): kv_cache [2, num_blocks, block_size, Hk, D]
// contiguous; token t of request b lives in block tables[b][t / block_size], row t % block_size.
// Query heads h*G .. h*G+G-1 share kv head h (G = Hq / Hk), as in enable_gqa.
//
// Per request b and kv head h: scores[g][t] = scale * q[g] . K[t]  (pass over K), softmax over t per g, then
// out[g] = sum_t p[g][t] V[t]  (pass over V). Accumulation in fp32 for every cache dtype.
//
// Queries and cache share a dtype, or fp32 queries read a bf16 / fp16 cache (--kv-cache-dtype bfloat16:
// half the bytes, each value widened as it is loaded). bf16 queries over a bf16 cache (a model run in bf16) take
// vdpbf16ps for q . k where the CPU has AVX512-BF16 (item_bf16_dot, paged_decode_bf16_dot()); the caller widens
// them to fp32 elsewhere.
//
// fp32 queries over an fp32, bf16 or fp16 cache with head_dim a multiple of 16 take AVX-512 loops where built for it
// (the cache widened as it is loaded; AVX2 + FMA ones, 8 lanes, take a multiple of 8 otherwise): a
// dot product per (query row, token) in registers, exp by a polynomial 16 lanes at a time, and the V pass
// accumulating a query row's 64-float slices in registers over a block's tokens. The portable loops below them ran at
// ~11 GB/s with the cache in L2/L3 (demo shapes, 8 requests x 320 tokens): bound by instructions (a
// scalar exp per score, a reduction and the accumulator's loads and stores per token), not by memory.
// 30 demo layers, 64 requests x 320 tokens from DRAM, both kernels in one process: 103-132 -> 84-87 ms
// (a torch sum over the same bytes: 52 ms).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bf16_convert.h"
#include "softmax_simd.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// One work item's cache blocks (request b, kv heads h0 .. h0 + heads - 1): the K and V rows of a block of tokens from
// head h0's slice of a row on, and the memory to ask for before it is read. Each pass asks, as it starts a block, for
// the block it reads next (the K pass's last block: the first V block; the V pass's last: the next item's first K
// block on this thread): the blocks lie at random in the cache, which the hardware prefetchers do not follow across,
// and the loops over a block's rows leave the loads of the next one to wait otherwise. 30 demo layers, 64 requests
// x 192-384 tokens from DRAM (huge pages), bf16: 43.5 -> 28.2 ms a step, 9.8 -> 15.2 GB/s of cache (asking two or
// four blocks ahead: 32 and 34 ms; into L2 only: 31 ms). Where the item's V fits in L2 with room (kEarlyV), the K pass
// also asks for the V block of the same tokens into L2, so twice the bytes are on their way at once and the V pass
// reads from L2: the same 30 layers 31.7-35.0 -> 30.1-31.8 ms (alternated, eight runs each); Qwen3.5's items (64
// x 512-1024 tokens of 2 x 256 values) hold more V than that and asking early made them 15% slower.
constexpr int64_t kEarlyV = 256 << 10;
//
// AMD CPUs (prefetch_far()) ask for the next two blocks, into L2: on a 2-vCPU AMD EPYC Zen 4, 30 demo layers of 64
// requests x 330 tokens on random blocks from DRAM, in one process alternated with the Intel scheme: bf16 30.6-40.5 ->
// 21.6-26.9 ms (asking for one block into L2: 25.5, into L3: 25.5; no prefetches: 35.8), 486 MB at 18-22 GB/s against
// 29.5 for a sequential torch max over the same bytes; fp32 70.5 -> 48.9 ms; fp32 queries over a bf16 cache 43.6 ->
// 30.8 ms; Qwen3.5's 6 layers at 64 x 330 bf16 22.5 -> 15.7 ms, at 64 x 800 53.6 -> 35.9 ms. Not measured on an AMD
// without AVX-512 (the AVX2 loops take the same scheme). Intel keeps one block into L1 (the measurements above).
bool prefetch_far() {
  static const bool far = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return far;
}

template <typename cache_t>
struct ItemBlocks {
  const cache_t* k;  // the cache's K half and V half, from head h0's slice on
  const cache_t* v;
  const int64_t* table;  // the request's block table
  int64_t len, block_size, token_stride, block_stride;
  int64_t slice_bytes;   // the item's part of a token row: heads * head_dim values
  const cache_t* next;   // the next work item's first K block, from its first head's slice on (nullptr: none)
  bool far;              // prefetch_far()

  const cache_t* k_block(int64_t t0) const { return k + table[t0 / block_size] * block_stride; }
  const cache_t* v_block(int64_t t0) const { return v + table[t0 / block_size] * block_stride; }
  int64_t rows(int64_t t0) const { return std::min(block_size, len - t0); }
  [[gnu::always_inline]] void k_ahead(int64_t t0) const {
    const cache_t* first = t0 + block_size < len ? k_block(t0 + block_size) : v_block(0);
    if (far) {
      fetch<2>(first);
      if (t0 + 2 * block_size < len) fetch<2>(k_block(t0 + 2 * block_size));
      else if (t0 + block_size < len) fetch<2>(v_block(0));
    } else {
      fetch<3>(first);
    }
    if (len * slice_bytes <= kEarlyV) fetch<2>(v_block(t0));
  }
  [[gnu::always_inline]] void v_ahead(int64_t t0) const {
    if (t0 + block_size < len) {
      if (far) {
        fetch<2>(v_block(t0 + block_size));
        if (t0 + 2 * block_size < len) fetch<2>(v_block(t0 + 2 * block_size));
      } else {
        fetch<3>(v_block(t0 + block_size));
      }
    } else if (next) {
      if (far) fetch<2>(next);
      else fetch<3>(next);
    }
  }
  // The item's slice of each of a block's rows, into L1 (locality 3) or L2 (2); a prefetch never faults, past len
  // included. Inlined: GCC 12 takes a function of nothing but prefetches for one without effects and drops its calls.
  template <int kLocality>
  [[gnu::always_inline]] void fetch(const cache_t* block) const {
    const char* row = reinterpret_cast<const char*>(block);
    for (int64_t r = 0; r < block_size; ++r, row += token_stride * sizeof(cache_t))
      for (int64_t o = 0; o < slice_bytes; o += 64) __builtin_prefetch(row + o, 0, kLocality);
  }
};

#if defined(__AVX512F__)
using ascendserve_simd::softmax_numerators_avx512;

// 16 cache values as fp32: as they are, or bf16 / fp16 widened (exact).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return ascendserve_bf16::widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// acc[0 .. 16 NV) += sum_r p[r] v_r[0 .. 16 NV), v_r = v + r * stride: NV accumulators in registers.
template <int NV, typename cache_t>
inline void weighted_rows(const cache_t* v, int64_t stride, const float* p, int64_t rows, float* acc) {
  __m512 a[NV];
  for (int c = 0; c < NV; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 pr = _mm512_set1_ps(p[r]);
    for (int c = 0; c < NV; ++c) a[c] = _mm512_fmadd_ps(pr, load16(v + r * stride + 16 * c), a[c]);
  }
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
}

// acc_g[0 .. 16 NV) += sum_r p_g[r] v_r[0 .. 16 NV) for the G query rows g of one kv head at once (p_g = p + g *
// p_stride, acc_g = acc + g * acc_stride, v_r = v + r * stride): each cache value is widened once for the G rows,
// where weighted_rows widens it once per row. For half-precision caches (the widening is two instructions a vector).
template <int G, int NV, typename cache_t>
inline void weighted_rows_shared(const cache_t* v, int64_t stride, const float* p, int64_t p_stride, int64_t rows,
                                 float* acc, int64_t acc_stride) {
  __m512 a[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) a[g][c] = _mm512_loadu_ps(acc + g * acc_stride + 16 * c);
  for (int64_t r = 0; r < rows; ++r) {
    __m512 vr[NV];
    for (int c = 0; c < NV; ++c) vr[c] = load16(v + r * stride + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 pr = _mm512_set1_ps(p[g * p_stride + r]);
      for (int c = 0; c < NV; ++c) a[g][c] = _mm512_fmadd_ps(pr, vr[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + g * acc_stride + 16 * c, a[g][c]);
}

template <int G, typename cache_t>
inline void weighted_rows_shared_nv(int64_t nv, const cache_t* v, int64_t stride, const float* p, int64_t p_stride,
                                    int64_t rows, float* acc, int64_t acc_stride) {
  switch (nv) {
    case 1: weighted_rows_shared<G, 1>(v, stride, p, p_stride, rows, acc, acc_stride); break;
    case 2: weighted_rows_shared<G, 2>(v, stride, p, p_stride, rows, acc, acc_stride); break;
    case 3: weighted_rows_shared<G, 3>(v, stride, p, p_stride, rows, acc, acc_stride); break;
    default: weighted_rows_shared<G, 4>(v, stride, p, p_stride, rows, acc, acc_stride); break;
  }
}

// The V pass of one work item over a half-precision cache: acc [heads * group, D] += P V block by block, a kv head's
// query rows up to four at a time and 64 dimensions at a time with the accumulators in registers.
template <typename cache_t>
void v_pass_shared(const ItemBlocks<cache_t>& blocks, int64_t heads, int64_t group, int64_t head_dim,
                   const float* scores, float* acc) {
  const int64_t len = blocks.len, token_stride = blocks.token_stride;
  for (int64_t t0 = 0; t0 < len; t0 += blocks.block_size) {
    blocks.v_ahead(t0);
    const cache_t* vb = blocks.v_block(t0);
    const int64_t rows = blocks.rows(t0);
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const int64_t j = h * group + g0;  // the first query row of this run
        const float* p = scores + j * len + t0;
        for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
          const int64_t nv = std::min<int64_t>(4, (head_dim - d0) / 16);
          const cache_t* v = vb + h * head_dim + d0;
          float* a = acc + j * head_dim + d0;
          switch (std::min<int64_t>(4, group - g0)) {
            case 1: weighted_rows_shared_nv<1>(nv, v, token_stride, p, len, rows, a, head_dim); break;
            case 2: weighted_rows_shared_nv<2>(nv, v, token_stride, p, len, rows, a, head_dim); break;
            case 3: weighted_rows_shared_nv<3>(nv, v, token_stride, p, len, rows, a, head_dim); break;
            default: weighted_rows_shared_nv<4>(nv, v, token_stride, p, len, rows, a, head_dim); break;
          }
        }
      }
    }
  }
}

// s[r] = q . k_r for r < rows, k_r = k + r * stride, over 16 * chunks floats (NC: chunks known at compile
// time, 0: not).
template <int NC, typename cache_t>
inline void dots(const float* q, const cache_t* k, int64_t stride, int64_t rows, int64_t chunks, float* s) {
  const int64_t nc = NC > 0 ? NC : chunks;
  for (int64_t r = 0; r < rows; ++r) {
    const cache_t* kt = k + r * stride;
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), load16(kt));
    for (int64_t c = 1; c < nc; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), load16(kt + 16 * c), a);
    s[r] = _mm512_reduce_add_ps(a);
  }
}

// One work item (request, kv heads h0 .. h0 + heads - 1) of fp32 attention over an fp32, bf16 or fp16 cache; qf holds
// the scaled queries [heads * group, D], scores has room for [heads * group, len], acc for [heads * group, D].
template <typename cache_t>
void item_avx512(const float* qf, const ItemBlocks<cache_t>& blocks, int64_t heads, int64_t group, int64_t head_dim,
                 float* scores, float* acc, float* out) {
  const int64_t rows_per_item = heads * group, len = blocks.len, token_stride = blocks.token_stride;
  for (int64_t t0 = 0; t0 < len; t0 += blocks.block_size) {
    blocks.k_ahead(t0);
    const cache_t* kb = blocks.k_block(t0);
    const int64_t rows = blocks.rows(t0);
    for (int64_t j = 0; j < rows_per_item; ++j) {  // query row j reads kv head h0 + j / group
      const float* qj = qf + j * head_dim;
      const cache_t* kh = kb + (j / group) * head_dim;
      float* sj = scores + j * len + t0;
      switch (head_dim) {  // the usual sizes with the loop unrolled
        case 64: dots<4>(qj, kh, token_stride, rows, 4, sj); break;
        case 128: dots<8>(qj, kh, token_stride, rows, 8, sj); break;
        case 256: dots<16>(qj, kh, token_stride, rows, 16, sj); break;
        default: dots<0>(qj, kh, token_stride, rows, head_dim / 16, sj); break;
      }
    }
  }
  std::vector<float> inv_sum(rows_per_item);
  for (int64_t j = 0; j < rows_per_item; ++j) inv_sum[j] = 1.f / softmax_numerators_avx512(scores + j * len, len);
  std::fill(acc, acc + rows_per_item * head_dim, 0.f);
  if constexpr (!std::is_same_v<cache_t, float>) {  // each half-precision value widened once for its kv head's rows
    v_pass_shared(blocks, heads, group, head_dim, scores, acc);
  } else {
    for (int64_t t0 = 0; t0 < len; t0 += blocks.block_size) {
      blocks.v_ahead(t0);
      const cache_t* vb = blocks.v_block(t0);
      const int64_t rows = blocks.rows(t0);
      for (int64_t j = 0; j < rows_per_item; ++j) {
        const cache_t* vh = vb + (j / group) * head_dim;
        const float* pj = scores + j * len + t0;
        float* aj = acc + j * head_dim;
        for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
          switch (std::min<int64_t>(4, (head_dim - d0) / 16)) {
            case 1: weighted_rows<1>(vh + d0, token_stride, pj, rows, aj + d0); break;
            case 2: weighted_rows<2>(vh + d0, token_stride, pj, rows, aj + d0); break;
            case 3: weighted_rows<3>(vh + d0, token_stride, pj, rows, aj + d0); break;
            default: weighted_rows<4>(vh + d0, token_stride, pj, rows, aj + d0); break;
          }
        }
      }
    }
  }
  for (int64_t j = 0; j < rows_per_item; ++j) {
    const __m512 f = _mm512_set1_ps(inv_sum[j]);
    for (int64_t d = 0; d < head_dim; d += 16)
      _mm512_storeu_ps(out + j * head_dim + d, _mm512_mul_ps(_mm512_loadu_ps(acc + j * head_dim + d), f));
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define ASCENDSERVE_DECODE_BF16_DOT 1
constexpr int64_t kBf16DotMaxDim = 256;
// Lane i of the result is the sum of a[i]'s 16 lanes: four rounds of adds over shuffled pairs, 15 adds for the 16
// sums (_mm512_reduce_add_ps spends four adds and four shuffles on each). The sums come out in the network's
// order; one permute puts them back.
inline __m512 hsum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: b[i] holds 8 partial sums of a[i], then 8 of a[i + 8]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xee));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters: 4 partial sums each of a[i], a[i + 8], a[i + 4], a[i + 12]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xdd));
  for (int i = 0; i < 2; ++i)  // in each quarter: 2 partial sums of c[i]'s vector, then 2 of c[i + 2]'s
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], 0x44), _mm512_shuffle_ps(c[i], c[i + 2], 0xee));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xdd));
  // lane 4 k + p of e is the sum of a[{0, 2, 1, 3}[p] + {0, 8, 4, 12}[k]]: e = a0 a2 a1 a3 a8 a10 a9 a11 a4 a6 ...
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, e);
}

// scores of up to 16 cache rows k_r = k + r * stride (r < rows) against one bf16 query q of 32 NC values: q . k_r with
// vdpbf16ps (exact products, fp32 sums), times scale. Rows past `rows` read the last one again (no branches, so the
// 16 sums stay in registers) and are not stored.
template <int NC>
inline void dots16_bf16(const c10::BFloat16* q, const c10::BFloat16* k, int64_t stride, int64_t rows, float scale,
                        float* s) {
  __m512i qr[NC];
  for (int c = 0; c < NC; ++c) qr[c] = _mm512_loadu_si512(q + 32 * c);
  __m512 a[16];
  for (int r = 0; r < 16; ++r) {
    const c10::BFloat16* kr = k + std::min<int64_t>(r, rows - 1) * stride;
    a[r] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qr[0], (__m512bh)_mm512_loadu_si512(kr));
    for (int c = 1; c < NC; ++c)
      a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)qr[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
  }
  const __mmask16 m = rows >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << rows) - 1);
  _mm512_mask_storeu_ps(s, m, _mm512_mul_ps(hsum16(a), _mm512_set1_ps(scale)));
}

// One work item of bf16 queries over a bf16 cache (a model run in bf16; head_dim a multiple of 32 up to
// kBf16DotMaxDim, a query row in at most 8 registers): the K pass with vdpbf16ps on the values as they are (q . k's
// products are exact, as fp32 queries widened from bf16 would give; 16 keys' sums reduced together), the softmax and
// the V pass in fp32 (v_pass_shared), the output rounded to bf16 once. q [heads * group, D] unscaled.
// 2-core Xeon (AMX host), 30 demo layers, 64 requests x 160-320 tokens on random blocks from DRAM (huge pages): 46-50
// ms with the queries widened to fp32 (the loops above) -> 40 ms; Qwen3.5's 6 layers (head_dim 256), 64 x 512-1024
// tokens: 72.5 -> 65 ms. From L2, the demo's 64 x 64 tokens: 159 -> 125 us.
void item_bf16_dot(const c10::BFloat16* q, const ItemBlocks<c10::BFloat16>& blocks, int64_t heads, int64_t group,
                   int64_t head_dim, float scale, float* scores, float* acc, c10::BFloat16* out) {
  const int64_t rows_per_item = heads * group, chunks = head_dim / 32, len = blocks.len;
  const int64_t token_stride = blocks.token_stride;
  for (int64_t t0 = 0; t0 < len; t0 += blocks.block_size) {
    blocks.k_ahead(t0);
    const c10::BFloat16* kb = blocks.k_block(t0);
    const int64_t rows = blocks.rows(t0);
    for (int64_t j = 0; j < rows_per_item; ++j) {  // query row j reads kv head h0 + j / group
      const c10::BFloat16* kh = kb + (j / group) * head_dim;
      const c10::BFloat16* qv = q + j * head_dim;
      for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t n = std::min<int64_t>(16, rows - r0);
        float* sj = scores + j * len + t0 + r0;
        const c10::BFloat16* kr = kh + r0 * token_stride;
        switch (chunks) {
          case 1: dots16_bf16<1>(qv, kr, token_stride, n, scale, sj); break;
          case 2: dots16_bf16<2>(qv, kr, token_stride, n, scale, sj); break;
          case 3: dots16_bf16<3>(qv, kr, token_stride, n, scale, sj); break;
          case 4: dots16_bf16<4>(qv, kr, token_stride, n, scale, sj); break;
          case 5: dots16_bf16<5>(qv, kr, token_stride, n, scale, sj); break;
          case 6: dots16_bf16<6>(qv, kr, token_stride, n, scale, sj); break;
          case 7: dots16_bf16<7>(qv, kr, token_stride, n, scale, sj); break;
          default: dots16_bf16<8>(qv, kr, token_stride, n, scale, sj); break;
        }
      }
    }
  }
  std::vector<float> inv_sum(rows_per_item);
  for (int64_t j = 0; j < rows_per_item; ++j) inv_sum[j] = 1.f / softmax_numerators_avx512(scores + j * len, len);
  std::fill(acc, acc + rows_per_item * head_dim, 0.f);
  v_pass_shared(blocks, heads, group, head_dim, scores, acc);
  for (int64_t j = 0; j < rows_per_item; ++j) {
    const __m512 f = _mm512_set1_ps(inv_sum[j]);
    for (int64_t d = 0; d < head_dim; d += 16) {
      const __m512 o = _mm512_mul_ps(_mm512_loadu_ps(acc + j * head_dim + d), f);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * head_dim + d), (__m256i)_mm512_cvtneps_pbh(o));
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The same loops for AVX2 + FMA (8 lanes; head_dim a multiple of 8); exp and the softmax from softmax_simd.h.
using ascendserve_simd::hsum256;
using ascendserve_simd::softmax_numerators_avx2;

// One unit of a cache row (kElems values) as kVecs fp32 vectors. Within a unit the vectors may hold the
// values in another order, slot(i) being where value i lands: a bf16 unit is 16 values in one 256-bit
// load, split into the even-indexed ones (shifted into the top half of each 32-bit lane) and the odd ones
// (masked). Queries and accumulators are laid out the same way, so dot products and weighted sums do not
// see the order, and a bf16 unit costs one load and two integer ops for two vectors.
template <typename cache_t>
struct Unit {
  static constexpr int kElems = 0;  // no AVX2 loads for this cache type: the portable loops read it
};
template <>
struct Unit<float> {
  static constexpr int kElems = 8, kVecs = 1;
  static void load(const float* p, __m256* v) { v[0] = _mm256_loadu_ps(p); }
  static int slot(int i) { return i; }
};
template <>
struct Unit<c10::BFloat16> {
  static constexpr int kElems = 16, kVecs = 2;
  static void load(const c10::BFloat16* p, __m256* v) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));                                  // values 0, 2, .., 14
    v[1] = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(0xffff0000)));  // values 1, 3, .., 15
  }
  static int slot(int i) { return i % 2 * 8 + i / 2; }
};
#if defined(__F16C__)
template <>
struct Unit<c10::Half> {
  static constexpr int kElems = 8, kVecs = 1;
  static void load(const c10::Half* p, __m256* v) {
    v[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static int slot(int i) { return i; }
};
#endif

// q . k over `units` units of k, q in unit order; two accumulators (a unit's two vectors, or two units).
template <typename cache_t>
inline float dot_units(const float* q, const cache_t* k, int64_t units) {
  using U = Unit<cache_t>;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), kv[2];
  int64_t u = 0;
  if constexpr (U::kVecs == 1) {
    for (; u + 1 < units; u += 2) {
      U::load(k + u * U::kElems, kv);
      U::load(k + (u + 1) * U::kElems, kv + 1);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + u * U::kElems), kv[0], a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + (u + 1) * U::kElems), kv[1], a1);
    }
  }
  for (; u < units; ++u) {
    U::load(k + u * U::kElems, kv);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + u * U::kElems), kv[0], a0);
    if constexpr (U::kVecs == 2) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + u * U::kElems + 8), kv[1], a1);
  }
  return hsum256(_mm256_add_ps(a0, a1));
}

// One work item of attention with AVX2 + FMA over any cache type with a Unit: item_avx512's passes,
// token-major (each block's K and V rows read once, front to back, for all of the item's query rows, the
// accumulators in L1). qf [rows, D] are the scaled queries; qp (their unit order, when it differs) and acc
// [rows, D] (in unit order) and scores [rows, len] are workspaces.
// Walking a block once per query row with the accumulators in registers, as the AVX-512 loops do, was twice
// as fast with the cache in L2 but 10% slower than the portable loops from DRAM on an AMD EPYC (the strided
// passes stalled on memory); this order, against the portable loops, interleaved: demo shapes (64 x 320
// tokens, 30 layers, from DRAM) 148 -> 125 ms and 131 -> 122 ms in two runs, Qwen3.5's (head_dim 256) 69 ->
// 57 ms; from L2 0.8 -> 0.6 ms. A bf16 cache (--kv-cache-dtype bfloat16) against an fp32 one, same shapes
// from DRAM: demo 104 -> 78 ms, Qwen3.5 36-39 -> 34-38 ms (bound by instructions more than by bytes).
// Tried and dropped: a kv head's query rows four at a time with register accumulators (bf16 demo 63 ms, but
// fp32 15-30% slower), and each block first copied to an fp32 buffer (slower for both).
template <typename cache_t>
void item_avx2(const float* qf, const ItemBlocks<cache_t>& blocks, int64_t heads, int64_t group, int64_t head_dim,
               float* qp, float* scores, float* acc, float* out) {
  using U = Unit<cache_t>;
  const int64_t rows_per_item = heads * group, units = head_dim / U::kElems;
  const int64_t len = blocks.len, token_stride = blocks.token_stride;
  constexpr bool permuted = U::kVecs > 1;  // a unit's values not in order (bf16)
  const float* q = qf;                      // the queries in unit order
  if constexpr (permuted) {
    for (int64_t e = 0; e < rows_per_item * head_dim; e += U::kElems)  // head_dim is a multiple of kElems
      for (int i = 0; i < U::kElems; ++i) qp[e + U::slot(i)] = qf[e + i];
    q = qp;
  }
  for (int64_t t0 = 0; t0 < len; t0 += blocks.block_size) {
    blocks.k_ahead(t0);
    const cache_t* kb = blocks.k_block(t0);
    const int64_t rows = blocks.rows(t0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0, j = 0; h < heads; ++h)  // query row j reads kv head h = j / group
        for (int64_t g = 0; g < group; ++g, ++j)
          scores[j * len + t0 + r] = dot_units(q + j * head_dim, kb + r * token_stride + h * head_dim, units);
  }
  std::vector<float> inv_sum(rows_per_item);
  for (int64_t j = 0; j < rows_per_item; ++j) inv_sum[j] = 1.f / softmax_numerators_avx2(scores + j * len, len);
  std::fill(acc, acc + rows_per_item * head_dim, 0.f);
  for (int64_t t0 = 0; t0 < len; t0 += blocks.block_size) {
    blocks.v_ahead(t0);
    const cache_t* vb = blocks.v_block(t0);
    const int64_t rows = blocks.rows(t0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0, j = 0; h < heads; ++h) {
        const cache_t* vt = vb + r * token_stride + h * head_dim;
        for (int64_t g = 0; g < group; ++g, ++j) {
          const __m256 p = _mm256_broadcast_ss(scores + j * len + t0 + r);
          float* aj = acc + j * head_dim;
          for (int64_t u = 0; u < units; ++u) {
            __m256 vv[U::kVecs];
            U::load(vt + u * U::kElems, vv);
            for (int v = 0; v < U::kVecs; ++v) {
              float* a = aj + u * U::kElems + 8 * v;
              _mm256_storeu_ps(a, _mm256_fmadd_ps(p, vv[v], _mm256_loadu_ps(a)));
            }
          }
        }
      }
  }
  for (int64_t j = 0; j < rows_per_item; ++j) {
    const float* aj = acc + j * head_dim;
    float* oj = out + j * head_dim;
    if constexpr (permuted) {
      for (int64_t e = 0; e < head_dim; e += U::kElems)
        for (int i = 0; i < U::kElems; ++i) oj[e + i] = aj[e + U::slot(i)] * inv_sum[j];
    } else {
      const __m256 f = _mm256_set1_ps(inv_sum[j]);
      for (int64_t d = 0; d < head_dim; d += 8) _mm256_storeu_ps(oj + d, _mm256_mul_ps(_mm256_loadu_ps(aj + d), f));
    }
  }
}

#endif

// Whether bf16 queries of head_dim over a bf16 cache take the vdpbf16ps loops here (head_dim a multiple of 32, at most
// kBf16DotMaxDim); else the caller widens them to fp32 (the portable loops are what bf16 queries take otherwise).
bool bf16_dot_takes(int64_t head_dim) {
#if defined(ASCENDSERVE_DECODE_BF16_DOT)
  return head_dim % 32 == 0 && head_dim <= kBf16DotMaxDim;
#else
  (void)head_dim;
  return false;
#endif
}

// q and out in scalar_t, the cache in cache_t (the same type, or a half-precision cache under fp32
// queries: --kv-cache-dtype).
template <typename scalar_t, typename cache_t>
void decode_impl(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                 const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const cache_t* k_ptr = kv_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = k_ptr + num_blocks * block_stride;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);
  const bool far = prefetch_far();

  // A work item is one request and a run of its kv heads: all of them (a block's rows are then read
  // front to back, which the prefetchers follow; one head's slice of each row is a strided walk that
  // ran at half the bandwidth). The AVX-512 build (measured on Intel Xeons) takes one head an item
  // when there are fewer requests than threads, to keep every thread busy. Elsewhere the strided walk
  // costs more than the second thread gains: on an AMD EPYC (AVX2), one demo request (9 q / 3 kv
  // heads of 64) of 350 tokens took 344 us by head on two threads and 141 us by row on one; in the
  // engine, a single-stream demo step's attention 278 -> 80 us a layer (torch.profiler).
#if defined(__AVX512F__)
  const int64_t heads_per_item = num_seqs >= at::get_num_threads() ? num_kv_heads : 1;
#else
  const int64_t heads_per_item = num_kv_heads;
#endif
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  at::parallel_for(0, num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows_per_item = heads_per_item * group;  // query heads of one item
    std::vector<float> qf(rows_per_item * head_dim), qp(rows_per_item * head_dim), acc(rows_per_item * head_dim);
    std::vector<float> scores, inv_sum(rows_per_item);
    // request b's blocks for kv heads h0 .. h0 + heads_per_item - 1 (next: the following item's, if it is ours)
    auto item_blocks = [&](int64_t b, int64_t h0, const cache_t* next) {
      return ItemBlocks<cache_t>{k_ptr + h0 * head_dim, v_ptr + h0 * head_dim, tables + b * max_blocks, lens[b],
                                 block_size, token_stride, block_stride,
                                 heads_per_item * head_dim * static_cast<int64_t>(sizeof(cache_t)), next, far};
    };
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / items_per_seq, h0 = (work % items_per_seq) * heads_per_item, len = lens[b];
      const cache_t* next = nullptr;
      if (work + 1 < end && lens[(work + 1) / items_per_seq] > 0)
        next = item_blocks((work + 1) / items_per_seq, ((work + 1) % items_per_seq) * heads_per_item, nullptr)
                   .k_block(0);
      const ItemBlocks<cache_t> blocks = item_blocks(b, h0, next);
      const scalar_t* q_item = q_ptr + (b * num_heads + h0 * group) * head_dim;  // rows_per_item rows
      scores.resize(rows_per_item * len);
#if defined(ASCENDSERVE_DECODE_BF16_DOT)
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
        if (bf16_dot_takes(head_dim)) {
          item_bf16_dot(q_item, blocks, heads_per_item, group, head_dim, fscale, scores.data(), acc.data(),
                        out_ptr + (b * num_heads + h0 * group) * head_dim);
          continue;
        }
      }
#endif
      for (int64_t i = 0; i < rows_per_item * head_dim; ++i) qf[i] = static_cast<float>(q_item[i]) * fscale;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (head_dim % 16 == 0) {
          item_avx512(qf.data(), blocks, heads_per_item, group, head_dim, scores.data(), acc.data(),
                      out_ptr + (b * num_heads + h0 * group) * head_dim);
          continue;
        }
      }
#endif
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<scalar_t, float> && Unit<cache_t>::kElems > 0) {
        if (head_dim % Unit<cache_t>::kElems == 0) {
          item_avx2(qf.data(), blocks, heads_per_item, group, head_dim, qp.data(), scores.data(), acc.data(),
                    out_ptr + (b * num_heads + h0 * group) * head_dim);
          continue;
        }
      }
#endif
      // Block by block: the row inside a block is a counter, not a division per token.
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        blocks.k_ahead(t0);
        const cache_t* kb = blocks.k_block(t0);
        const int64_t rows = blocks.rows(t0);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < rows_per_item; ++j) {  // query row j reads kv head h0 + j / group
            const cache_t* kt = kb + r * token_stride + (j / group) * head_dim;
            const float* qj = qf.data() + j * head_dim;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < head_dim; ++d) s += qj[d] * static_cast<float>(kt[d]);
            scores[j * len + t0 + r] = s;
          }
        }
      }
      for (int64_t j = 0; j < rows_per_item; ++j) {
        float* sj = scores.data() + j * len;
        const float m = *std::max_element(sj, sj + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sj[t] = std::exp(sj[t] - m);
          sum += sj[t];
        }
        inv_sum[j] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        blocks.v_ahead(t0);
        const cache_t* vb = blocks.v_block(t0);
        const int64_t rows = blocks.rows(t0);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < rows_per_item; ++j) {
            const cache_t* vt = vb + r * token_stride + (j / group) * head_dim;
            const float p = scores[j * len + t0 + r];
            float* aj = acc.data() + j * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) aj[d] += p * static_cast<float>(vt[d]);
          }
        }
      }
      scalar_t* out_item = out_ptr + (b * num_heads + h0 * group) * head_dim;
      for (int64_t j = 0; j < rows_per_item; ++j)
        for (int64_t d = 0; d < head_dim; ++d)
          out_item[j * head_dim + d] = static_cast<scalar_t>(acc[j * head_dim + d] * inv_sum[j]);
    }
  });
}

// The query / cache dtype pairs decode_impl is built for.
void check_dtypes(at::ScalarType qt, at::ScalarType ct) {
  TORCH_CHECK(qt == ct ? (qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf)
                       : (qt == at::kFloat && (ct == at::kBFloat16 || ct == at::kHalf)),
              "paged_decode: a ", ct, " cache under ", qt, " queries is not supported (float32, bfloat16 or float16 "
              "for both, or a bfloat16 / float16 cache under float32 queries)");
}

bool paged_decode_bf16_dot(int64_t head_dim) { return bf16_dot_takes(head_dim); }

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "paged_decode: q [B, Hq, D], "
              "kv_cache [2, num_blocks, block_size, Hk, D] expected");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous(), "paged_decode: q and kv_cache must be contiguous");
  const at::ScalarType qt = q.scalar_type(), ct = kv_cache.scalar_type();
  check_dtypes(qt, ct);
  TORCH_CHECK(q.size(2) == kv_cache.size(4) && q.size(1) % kv_cache.size(3) == 0,
              "paged_decode: head_dim or head grouping mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
              block_tables.is_contiguous() && context_lens.is_contiguous() && block_tables.size(0) == q.size(0) &&
              context_lens.size(0) == q.size(0), "paged_decode: block_tables [B, max_blocks] and context_lens [B] "
              "int64 contiguous expected");
  at::Tensor out = at::empty_like(q);
  if (qt == at::kFloat && ct == at::kFloat)
    decode_impl<float, float>(q, kv_cache, block_tables, context_lens, scale, out);
  else if (qt == at::kFloat && ct == at::kBFloat16)
    decode_impl<float, c10::BFloat16>(q, kv_cache, block_tables, context_lens, scale, out);
  else if (qt == at::kFloat)
    decode_impl<float, c10::Half>(q, kv_cache, block_tables, context_lens, scale, out);
  else if (qt == at::kBFloat16)
    decode_impl<c10::BFloat16, c10::BFloat16>(q, kv_cache, block_tables, context_lens, scale, out);
  else
    decode_impl<c10::Half, c10::Half>(q, kv_cache, block_tables, context_lens, scale, out);
  return out;
}

// Rows of src_t values into dst_t cache rows: src row b starts at src + b * src_stride, goes to slot[b].
// A float -> bfloat16 / half conversion rounds to nearest even, as torch's .to() does. Threads split the rows
// from kStoreGrain of them on (a prefill's k / v: torch's index_copy_ took 75 us for the demo's 2048 x 3 x 64 bf16
// rows, one thread, against ~10 for a plain copy of them).
constexpr int64_t kStoreGrain = 256;

template <typename src_t, typename dst_t>
void store_rows(const src_t* src, int64_t src_stride, const int64_t* slot, int64_t rows, int64_t row_elems,
                dst_t* dst) {
  at::parallel_for(0, rows, kStoreGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const src_t* from = src + b * src_stride;
      dst_t* to = dst + slot[b] * row_elems;
      if constexpr (std::is_same_v<src_t, dst_t>) {
        std::memcpy(to, from, row_elems * sizeof(dst_t));
      } else {
        for (int64_t i = 0; i < row_elems; ++i) to[i] = static_cast<dst_t>(static_cast<float>(from[i]));
      }
    }
  });
}

// Store a step's new k / v [T, Hk, D] (rows may be strided, each row's [Hk, D] contiguous: the views the qkv split
// gives) at their cache slots of kv_cache [2, num_blocks, block_size, Hk, D]: what attention.write_kv does with two
// index_copy_ calls elsewhere. k and v are in the cache's dtype, or float32 into a bfloat16 / float16 cache
// (rounded as they are stored). Every slot is checked before anything is stored.
void paged_kv_write(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache, const at::Tensor& slots) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_kv_write: kv_cache [2, num_blocks, block_size, Hk, D] contiguous expected");
  const int64_t rows = k.dim() == 3 ? k.size(0) : -1, row_elems = kv_cache.size(3) * kv_cache.size(4);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == rows && t->size(1) == kv_cache.size(3) &&
                    t->size(2) == kv_cache.size(4) && t->stride(2) == 1 && t->stride(1) == t->size(2) &&
                    t->scalar_type() == k.scalar_type(),
                "paged_kv_write: k and v must be [T, Hk, D] of one dtype, each row contiguous");
  const at::ScalarType st = k.scalar_type(), ct = kv_cache.scalar_type();
  TORCH_CHECK(st == ct || (st == at::kFloat && (ct == at::kBFloat16 || ct == at::kHalf)),
              "paged_kv_write: ", st, " k / v into a ", ct, " cache is not supported (the cache's dtype, or "
              "float32 into a bfloat16 / float16 cache)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == rows,
              "paged_kv_write: slots must be [T] int64");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < num_slots, "paged_kv_write: slot ", slot[b], " outside the cache's ",
                num_slots);
  auto store = [&](auto src_type, auto cache_type) {
    using src_t = decltype(src_type);
    using cache_t = decltype(cache_type);
    cache_t* k_cache = kv_cache.data_ptr<cache_t>();
    store_rows(k.data_ptr<src_t>(), k.stride(0), slot, rows, row_elems, k_cache);
    store_rows(v.data_ptr<src_t>(), v.stride(0), slot, rows, row_elems, k_cache + num_slots * row_elems);
  };
  if (st == ct && ct == at::kFloat) store(float(), float());
  else if (st == ct && ct == at::kBFloat16) store(c10::BFloat16(), c10::BFloat16());
  else if (st == ct && ct == at::kHalf) store(c10::Half(), c10::Half());
  else if (ct == at::kBFloat16) store(float(), c10::BFloat16());
  else if (ct == at::kHalf) store(float(), c10::Half());
  else TORCH_CHECK(false, "paged_kv_write: ", ct, " caches are not supported");
}

// paged_decode after paged_kv_write of the step's new k / v [B, Hk, D]: the two index_copy_ calls of a layer's
// decode folded into the op (at one row, 60 of a demo step's ~400 op calls).
at::Tensor paged_decode_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
                              const at::Tensor& slots, const at::Tensor& block_tables,
                              const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() && q.dim() == 3 &&
                  k.dim() == 3 && k.size(0) == q.size(0),
              "paged_decode_write: q [B, Hq, D], k / v [B, Hk, D], kv_cache [2, num_blocks, block_size, Hk, D] "
              "contiguous expected");
  check_dtypes(q.scalar_type(), kv_cache.scalar_type());  // before anything is stored
  paged_kv_write(k, v, kv_cache, slots);
  return paged_decode(q, kv_cache, block_tables, context_lens, scale);
}

}  // namespace

TORCH_LIBRARY(ascendserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
  m.def("paged_decode_write(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slots, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
  m.def("paged_kv_write(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slots) -> ()");
  m.def("paged_decode_bf16_dot(int head_dim) -> bool", &paged_decode_bf16_dot);
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
  m.impl("paged_decode_write", c10::DispatchKey::CPU, TORCH_FN(paged_decode_write));
  m.impl("paged_kv_write", c10::DispatchKey::CPU, TORCH_FN(paged_kv_write));
}
