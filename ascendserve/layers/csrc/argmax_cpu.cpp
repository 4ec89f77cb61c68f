// Greedy sampling's argmax over rows of fp32 logits, one pass per row at memory speed.
//
// torch's argmax on CPU walks a row one value at a time with its index: for a 64-row Qwen3.5 decode
// step (64 x 248320 logits, 64 MB) it took 15-16 ms of a ~700 ms step, 4x what a plain pass over the
// same bytes (amax, sum) takes. Here each of 16 lanes keeps its largest value and that value's first
// index, and the lanes are merged at the end. The result is torch's: the first index of the maximum,
// and the first NaN's index where a row holds one (NaN is detected on the bits, which -ffast-math
// cannot fold away).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "float_bits.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using ascendserve_bits::is_nan;

// From index `from` on, one value at a time: the first NaN, else the first maximum (or best_index
// when nothing after it is larger than best).
int64_t argmax_scalar(const float* x, int64_t n, int64_t from, float best, int64_t best_index) {
  for (int64_t i = from; i < n; ++i) {
    if (is_nan(x[i])) return i;
    if (x[i] > best) {
      best = x[i];
      best_index = i;
    }
  }
  return best_index;
}

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (is_nan(x[i])) return i;
  return -1;
}

int64_t row_argmax(const float* x, int64_t n) {
#if defined(__AVX512F__)
  if (n >= 32) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf_bits = _mm512_set1_epi32(0x7f800000);
    const __m512i step = _mm512_set1_epi32(16);
    __m512 best = _mm512_loadu_ps(x);
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i best_index = index;
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(best), abs_mask), inf_bits);
    int64_t i = 16;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      index = _mm512_add_epi32(index, step);
      nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), inf_bits);
      const __mmask16 larger = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, larger, v);
      best_index = _mm512_mask_mov_epi32(best_index, larger, index);
    }
    if (nan) return first_nan(x, n);
    // Lanes hold disjoint indices, each lane's first maximum: the smallest index among the lanes that
    // reach the row's maximum is the row's first one.
    const float max = _mm512_reduce_max_ps(best);
    const __mmask16 at_max = _mm512_cmp_ps_mask(best, _mm512_set1_ps(max), _CMP_EQ_OQ);
    const int64_t first = static_cast<uint32_t>(_mm512_mask_reduce_min_epu32(at_max, best_index));
    return argmax_scalar(x, n, i, max, first);
  }
#endif
  return is_nan(x[0]) ? 0 : argmax_scalar(x, n, 1, x[0], 0);
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "argmax_rows: logits must be a contiguous fp32 [rows, vocab] tensor");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0 || rows == 0, "argmax_rows: the rows are empty");
  TORCH_CHECK(vocab < (int64_t{1} << 31), "argmax_rows: a row is longer than 2^31 - 1");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* out_ptr = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out_ptr[r] = row_argmax(x + r * vocab, vocab);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendserve_cpu, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(argmax_rows));
}
