// AVX-512 peak multiply-add probe (see peak_isa.h).
#include <immintrin.h>

#include "peak_isa.h"

namespace specdec {

float peak_probe_avx512(bool bf16, int64_t iters) {
  __m512 acc[kPeakAccumulators];
  for (int i = 0; i < kPeakAccumulators; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-4f);
  const __m512i ab = _mm512_set1_epi32(0x3f803f80);  // bf16 pairs (1.0, 1.0)
  const __m512i bb = _mm512_set1_epi32(0x38d138d1);  // bf16 pairs (~1e-4, ~1e-4)
  if (bf16) {
    for (int64_t t = 0; t < iters; ++t) {
      for (int i = 0; i < kPeakAccumulators; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)ab, (__m512bh)bb);
    }
  } else {
    for (int64_t t = 0; t < iters; ++t) {
      for (int i = 0; i < kPeakAccumulators; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
    }
  }
  __m512 s = acc[0];
  for (int i = 1; i < kPeakAccumulators; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

}  // namespace specdec
