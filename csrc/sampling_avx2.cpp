// AVX2 vocabulary passes of the sampling ops (built with -mavx2 -mfma -mf16c; used when the
// active path is AVX2): 8-lane compares, the kept mass summed in double (two 4-lane halves, as
// the portable pass sums in double), and the masked rescale of the kept probabilities.
#include <immintrin.h>

#include "sampling_isa.h"

namespace specdec {

double mass_at_or_above_avx2(const float* p, int64_t n, float t) {
  const __m256 vt = _mm256_set1_ps(t);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(p + i);
    const __m256 kept = _mm256_and_ps(v, _mm256_cmp_ps(v, vt, _CMP_GE_OQ));
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(kept)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(kept, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(lo, hi));
  double s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < n; ++i) s += p[i] >= t ? p[i] : 0.0f;
  return s;
}

int64_t count_at_or_above_avx2(const float* p, int64_t n, float t) {
  const __m256 vt = _mm256_set1_ps(t);
  int64_t count = 0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    count += __builtin_popcount(
        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), vt, _CMP_GE_OQ)));
  }
  for (; i < n; ++i) count += p[i] >= t;
  return count;
}

void keep_and_scale_avx2(const float* p, float* out, int64_t n, float t, float scale) {
  const __m256 vt = _mm256_set1_ps(t), vs = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(p + i);
    _mm256_storeu_ps(out + i,
                     _mm256_and_ps(_mm256_mul_ps(v, vs), _mm256_cmp_ps(v, vt, _CMP_GE_OQ)));
  }
  for (; i < n; ++i) out[i] = p[i] >= t ? p[i] * scale : 0.0f;
}

}  // namespace specdec
