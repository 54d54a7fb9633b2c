// AVX-512 VNNI peak integer multiply-add probe (see peak_isa.h).
#include <immintrin.h>

#include "peak_isa.h"

namespace specdec {

int32_t peak_probe_avx512vnni(int64_t iters) {
  __m512i acc[kPeakAccumulators];
  for (int i = 0; i < kPeakAccumulators; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(-2);
  for (int64_t t = 0; t < iters; ++t) {
    for (int i = 0; i < kPeakAccumulators; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], u, s);
  }
  __m512i sum = acc[0];
  for (int i = 1; i < kPeakAccumulators; ++i) sum = _mm512_add_epi32(sum, acc[i]);
  return _mm512_reduce_add_epi32(sum);
}

}  // namespace specdec
