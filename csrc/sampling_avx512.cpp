// AVX-512 vocabulary passes of the sampling ops (built with -mavx512f/bw/vl/dq; used when
// active_isa() >= AVX512): 16-lane compare + masked accumulate for the top-k / top-p threshold
// search, and the masked rescale of the kept probabilities.
#include <immintrin.h>

#include "sampling_isa.h"

namespace specdec {

double mass_at_or_above_avx512(const float* p, int64_t n, float t) {
  const __m512 vt = _mm512_set1_ps(t);
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(p + i);
    acc = _mm512_mask_add_ps(acc, _mm512_cmp_ps_mask(v, vt, _CMP_GE_OQ), acc, v);
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
  const __m512 v = _mm512_maskz_loadu_ps(tail, p + i);
  acc = _mm512_mask_add_ps(acc, _mm512_mask_cmp_ps_mask(tail, v, vt, _CMP_GE_OQ), acc, v);
  return static_cast<double>(_mm512_reduce_add_ps(acc));
}

int64_t count_at_or_above_avx512(const float* p, int64_t n, float t) {
  const __m512 vt = _mm512_set1_ps(t);
  int64_t count = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    count += __builtin_popcount(_mm512_cmp_ps_mask(_mm512_loadu_ps(p + i), vt, _CMP_GE_OQ));
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
  count += __builtin_popcount(
      _mm512_mask_cmp_ps_mask(tail, _mm512_maskz_loadu_ps(tail, p + i), vt, _CMP_GE_OQ));
  return count;
}

void keep_and_scale_avx512(const float* p, float* out, int64_t n, float t, float scale) {
  const __m512 vt = _mm512_set1_ps(t), vs = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(p + i);
    _mm512_storeu_ps(out + i, _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(v, vt, _CMP_GE_OQ), v, vs));
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
  const __m512 v = _mm512_maskz_loadu_ps(tail, p + i);
  _mm512_mask_storeu_ps(
      out + i, tail, _mm512_maskz_mul_ps(_mm512_mask_cmp_ps_mask(tail, v, vt, _CMP_GE_OQ), v, vs));
}

}  // namespace specdec
