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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename scalar_t>
void decode_impl(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                 const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = kv_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = k_ptr + num_blocks * block_stride;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  // A work item is one request and a run of its kv heads: all of them when there are enough requests
  // to keep every thread busy (a block's rows are then read front to back, which the prefetchers
  // follow; one head's slice of each row is a strided walk that ran at half the bandwidth), else one.
  const int64_t heads_per_item = num_seqs >= at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  at::parallel_for(0, num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows_per_item = heads_per_item * group;  // query heads of one item
    std::vector<float> qf(rows_per_item * head_dim), acc(rows_per_item * head_dim), scores, inv_sum(rows_per_item);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / items_per_seq, h0 = (work % items_per_seq) * heads_per_item, len = lens[b];
      const int64_t* table = tables + b * max_blocks;
      const scalar_t* q_item = q_ptr + (b * num_heads + h0 * group) * head_dim;  // rows_per_item rows
      scores.resize(rows_per_item * len);
      for (int64_t i = 0; i < rows_per_item * head_dim; ++i) qf[i] = static_cast<float>(q_item[i]) * fscale;
      // Block by block: the row inside a block is a counter, not a division per token.
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const scalar_t* kb = k_ptr + table[t0 / block_size] * block_stride + h0 * head_dim;
        const int64_t rows = std::min(block_size, len - t0);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < rows_per_item; ++j) {  // query row j reads kv head h0 + j / group
            const scalar_t* kt = kb + r * token_stride + (j / group) * head_dim;
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
        const scalar_t* vb = v_ptr + table[t0 / block_size] * block_stride + h0 * head_dim;
        const int64_t rows = std::min(block_size, len - t0);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < rows_per_item; ++j) {
            const scalar_t* vt = vb + r * token_stride + (j / group) * head_dim;
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

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "paged_decode: q [B, Hq, D], "
              "kv_cache [2, num_blocks, block_size, Hk, D] expected");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous(), "paged_decode: q and kv_cache must be contiguous");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "paged_decode: q and kv_cache dtypes differ");
  TORCH_CHECK(q.size(2) == kv_cache.size(4) && q.size(1) % kv_cache.size(3) == 0,
              "paged_decode: head_dim or head grouping mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
              block_tables.is_contiguous() && context_lens.is_contiguous() && block_tables.size(0) == q.size(0) &&
              context_lens.size(0) == q.size(0), "paged_decode: block_tables [B, max_blocks] and context_lens [B] "
              "int64 contiguous expected");
  at::Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_impl<scalar_t>(q, kv_cache, block_tables, context_lens, scale, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(ascendserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
