// AVX2 peak multiply-add probe (see peak_isa.h): fp32 FMAs on 8 lanes. AVX2 has no bf16
// arithmetic (our AVX2 kernels widen bf16 to fp32), so its bf16 peak is this fp32 one.
#include <immintrin.h>

#include "peak_isa.h"

namespace specdec {

float peak_probe_avx2(int64_t iters) {
  __m256 acc[kPeakAccumulators];
  for (int i = 0; i < kPeakAccumulators; ++i) acc[i] = _mm256_set1_ps(0.001f * i);
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-4f);
  for (int64_t t = 0; t < iters; ++t) {
    for (int i = 0; i < kPeakAccumulators; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  __m256 s = acc[0];
  for (int i = 1; i < kPeakAccumulators; ++i) s = _mm256_add_ps(s, acc[i]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, s);
  float total = 0.0f;
  for (float v : lanes) total += v;
  return total;
}

}  // namespace specdec
