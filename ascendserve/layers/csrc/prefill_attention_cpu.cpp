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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "bf16_convert.h"
#include "f32_tile.h"
#include "softmax_avx2.h"

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
#if defined(__AVX2__) && defined(__FMA__)
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
  if (dtype == at::kBFloat16)
    run<at::BFloat16>(out, q, k, v, count, scale);
  else
    run<float>(out, q, k, v, count, scale);
}

template <typename T>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t count, double scale) {
  const int64_t heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
  const int64_t tq = q.size(0) / count, tk = k.size(0) / count;
  const Problem<T> pr{{q.data_ptr<T>(), q.stride(0)}, {k.data_ptr<T>(), k.stride(0)},
                      {v.data_ptr<T>(), v.stride(0)}, out.data_ptr<T>(), out.stride(0), tq, tk, heads, kv_heads,
                      d, static_cast<float>(scale)};
  const int64_t pairs = count * kv_heads, key_panels = (tk + kTileCols - 1) / kTileCols;
  const int64_t k_size = key_panels * d * kTileCols, v_size = d * tk;
  at::Tensor packed = at::empty({pairs, k_size + v_size}, q.options().dtype(at::kFloat));
  float* packed_ptr = packed.data_ptr<float>();
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* kp = packed_ptr + i * (k_size + v_size);
      pack_keys_values(pr, i / kv_heads, i % kv_heads, kp, kp + k_size);
    }
  });
  // Items from the last query block (the most keys) to the first, each thread taking the next one free.
  const int64_t blocks = (tq + kQueryBlock - 1) / kQueryBlock, items = pairs * blocks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    Scratch sc(pr);
    for (int64_t item = next++; item < items; item = next++) {
      const int64_t b = blocks - 1 - item / pairs, pair = item % pairs;
      const float* kp = packed_ptr + pair * (k_size + v_size);
      attend_block(pr, b * kQueryBlock, std::min(kQueryBlock, tq - b * kQueryBlock), pair / kv_heads, pair % kv_heads,
                   kp, kp + k_size, sc);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendserve_cpu, m) {
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, int count, float scale) -> ()");
  m.impl("prefill_attention", c10::DispatchKey::CPU, TORCH_FN(prefill_attention));
}
