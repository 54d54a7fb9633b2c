// AVX-512 kernel of skinny_linear (see linear_isa.h). Weight-streaming: each weight row is read
// from memory once per call and multiplied into all M rows of x (kept in L1), so a call moves
// N*K weights at close to the memory bandwidth. fp32 uses FMA on 16 lanes; bf16 uses vdpbf16ps,
// which multiplies 32 bf16 pairs exactly and accumulates in fp32.
#include <immintrin.h>

#include <cstring>

#include "linear_isa.h"

namespace specdec {
namespace {

inline uint16_t round_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void store(const LinearBlock& b, int64_t m, int64_t n, float v) {
  if (b.bias) {
    v += b.dtype == LinearDtype::FLOAT32 ? static_cast<const float*>(b.bias)[n]
                                         : bf16_to_float(static_cast<const uint16_t*>(b.bias)[n]);
  }
  if (b.dtype == LinearDtype::FLOAT32) {
    static_cast<float*>(b.y)[m * b.y_stride + n] = v;
  } else {
    static_cast<uint16_t*>(b.y)[m * b.y_stride + n] = round_to_bf16(v);
  }
}

// One weight row n times MB rows of x, with U independent accumulators per x row (U * MB >= 4
// keeps enough FMAs in flight). Rows are visited in memory order, so the weight matrix is read
// as one sequential stream, which the hardware prefetcher follows best.
template <int MB, int U>
void row_f32(const LinearBlock& b, int64_t n, int64_t m0) {
  constexpr int64_t kStep = 16 * U;
  const float* wr = static_cast<const float*>(b.w) + n * b.w_stride;
  const float* xr[MB];
  for (int j = 0; j < MB; ++j) xr[j] = static_cast<const float*>(b.x) + (m0 + j) * b.x_stride;
  __m512 acc[MB][U];
  for (int j = 0; j < MB; ++j)
    for (int u = 0; u < U; ++u) acc[j][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kStep <= b.K; k += kStep) {
    for (int u = 0; u < U; ++u) {
      const __m512 wv = _mm512_loadu_ps(wr + k + 16 * u);
      for (int j = 0; j < MB; ++j)
        acc[j][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xr[j] + k + 16 * u), acc[j][u]);
    }
  }
  for (; k < b.K; k += 16) {
    const int64_t left = b.K - k;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xffff)
                                      : static_cast<__mmask16>((1u << left) - 1u);
    const __m512 wv = _mm512_maskz_loadu_ps(mask, wr + k);
    for (int j = 0; j < MB; ++j)
      acc[j][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, xr[j] + k), acc[j][0]);
  }
  for (int j = 0; j < MB; ++j) {
    __m512 s = acc[j][0];
    for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[j][u]);
    store(b, m0 + j, n, _mm512_reduce_add_ps(s));
  }
}

// bf16: vdpbf16ps multiplies 32 bf16 pairs into 16 fp32 lanes.
template <int MB, int U>
void row_bf16(const LinearBlock& b, int64_t n, int64_t m0) {
  constexpr int64_t kStep = 32 * U;
  const uint16_t* wr = static_cast<const uint16_t*>(b.w) + n * b.w_stride;
  const uint16_t* xr[MB];
  for (int j = 0; j < MB; ++j) xr[j] = static_cast<const uint16_t*>(b.x) + (m0 + j) * b.x_stride;
  __m512 acc[MB][U];
  for (int j = 0; j < MB; ++j)
    for (int u = 0; u < U; ++u) acc[j][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kStep <= b.K; k += kStep) {
    for (int u = 0; u < U; ++u) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k + 32 * u);
      for (int j = 0; j < MB; ++j)
        acc[j][u] = _mm512_dpbf16_ps(acc[j][u], wv,
                                     (__m512bh)_mm512_loadu_si512(xr[j] + k + 32 * u));
    }
  }
  for (; k < b.K; k += 32) {
    const int64_t left = b.K - k;
    const __mmask32 mask = left >= 32 ? static_cast<__mmask32>(0xffffffffu)
                                      : static_cast<__mmask32>((uint64_t{1} << left) - 1u);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr + k);
    for (int j = 0; j < MB; ++j)
      acc[j][0] = _mm512_dpbf16_ps(acc[j][0], wv,
                                   (__m512bh)_mm512_maskz_loadu_epi16(mask, xr[j] + k));
  }
  for (int j = 0; j < MB; ++j) {
    __m512 s = acc[j][0];
    for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[j][u]);
    store(b, m0 + j, n, _mm512_reduce_add_ps(s));
  }
}

template <int MB, int U>
void run_row(const LinearBlock& b, int64_t n, int64_t m0) {
  if (b.dtype == LinearDtype::FLOAT32) row_f32<MB, U>(b, n, m0);
  else row_bf16<MB, U>(b, n, m0);
}

// All M rows of x against weight row n: the first chunk of x rows streams the weight row from
// memory, later chunks find it in L1.
void all_rows(const LinearBlock& b, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= b.M; m += 4) run_row<4, 2>(b, n, m);
  switch (b.M - m) {
    case 3: run_row<3, 2>(b, n, m); break;
    case 2: run_row<2, 2>(b, n, m); break;
    case 1: run_row<1, 4>(b, n, m); break;
    default: break;
  }
}

}  // namespace

void skinny_linear_avx512(const LinearBlock& b) {
  for (int64_t n = b.n_begin; n < b.n_end; ++n) all_rows(b, n);
}

}  // namespace specdec
