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

// Element type, lane count, loads and multiply-add of each dtype: fp32 uses FMA on 16 lanes;
// bf16 uses vdpbf16ps, which multiplies 32 bf16 pairs exactly into 16 fp32 lanes.
struct F32Ops {
  using T = float;
  using Vec = __m512;
  static constexpr int64_t kLanes = 16;
  static Vec load(const T* p) { return _mm512_loadu_ps(p); }
  static Vec load_tail(const T* p, int64_t left) {  // zeros past `left` elements
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1u), p);
  }
  static __m512 madd(__m512 acc, Vec w, Vec x) { return _mm512_fmadd_ps(w, x, acc); }
};

struct Bf16Ops {
  using T = uint16_t;
  using Vec = __m512i;
  static constexpr int64_t kLanes = 32;
  static Vec load(const T* p) { return _mm512_loadu_si512(p); }
  static Vec load_tail(const T* p, int64_t left) {
    return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint64_t{1} << left) - 1u), p);
  }
  static __m512 madd(__m512 acc, Vec w, Vec x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
  }
};

// One weight row n times MB rows of x, with U independent accumulators per x row (U * MB >= 4
// keeps enough multiply-adds in flight). Rows are visited in memory order, so the weight matrix
// is read as one sequential stream, which the hardware prefetcher follows best.
template <class Ops, int MB, int U>
void row(const LinearBlock& b, int64_t n, int64_t m0) {
  using T = typename Ops::T;
  constexpr int64_t L = Ops::kLanes;
  const T* wr = static_cast<const T*>(b.w) + n * b.w_stride;
  const T* xr[MB];
  for (int j = 0; j < MB; ++j) xr[j] = static_cast<const T*>(b.x) + (m0 + j) * b.x_stride;
  __m512 acc[MB][U];
  for (int j = 0; j < MB; ++j)
    for (int u = 0; u < U; ++u) acc[j][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + L * U <= b.K; k += L * U) {
    for (int u = 0; u < U; ++u) {
      const typename Ops::Vec wv = Ops::load(wr + k + L * u);
      for (int j = 0; j < MB; ++j) acc[j][u] = Ops::madd(acc[j][u], wv, Ops::load(xr[j] + k + L * u));
    }
  }
  for (; k < b.K; k += L) {
    const int64_t left = b.K - k;
    const typename Ops::Vec wv = left >= L ? Ops::load(wr + k) : Ops::load_tail(wr + k, left);
    for (int j = 0; j < MB; ++j) {
      const typename Ops::Vec xv = left >= L ? Ops::load(xr[j] + k) : Ops::load_tail(xr[j] + k, left);
      acc[j][0] = Ops::madd(acc[j][0], wv, xv);
    }
  }
  for (int j = 0; j < MB; ++j) {
    __m512 s = acc[j][0];
    for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[j][u]);
    store(b, m0 + j, n, _mm512_reduce_add_ps(s));
  }
}

template <int MB, int U>
void run_row(const LinearBlock& b, int64_t n, int64_t m0) {
  if (b.dtype == LinearDtype::FLOAT32) row<F32Ops, MB, U>(b, n, m0);
  else row<Bf16Ops, MB, U>(b, n, m0);
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
