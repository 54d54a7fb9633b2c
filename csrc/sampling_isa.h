// Raw-pointer vocabulary kernels of the sampling ops with ISA-specific translation units
// (sampling_avx512.cpp, sampling_avx2.cpp); no ATen types cross this boundary. p >= 0 everywhere,
// so comparing the IEEE bit patterns of floats as integers orders them like the values.
#pragma once
#include <cstdint>

namespace specdec {

// Sum of p[i] over p[i] >= t, and the number of such i.
double mass_at_or_above_avx512(const float* p, int64_t n, float t);
int64_t count_at_or_above_avx512(const float* p, int64_t n, float t);
// out[i] = p[i] >= t ? p[i] * scale : 0.
void keep_and_scale_avx512(const float* p, float* out, int64_t n, float t, float scale);

// The same on AVX2 (the mass summed in double lanes).
double mass_at_or_above_avx2(const float* p, int64_t n, float t);
int64_t count_at_or_above_avx2(const float* p, int64_t n, float t);
void keep_and_scale_avx2(const float* p, float* out, int64_t n, float t, float scale);

}  // namespace specdec
