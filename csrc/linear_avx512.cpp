// AVX-512 kernel of skinny_linear (see linear_isa.h). Weight-streaming: each weight row is read
// from memory once per call and multiplied into all M rows of x (kept in L1), so a call moves
// N*K weights at close to the memory bandwidth. fp32 uses FMA on 16 lanes; bf16 uses vdpbf16ps,
// which multiplies 32 bf16 pairs exactly and accumulates in fp32.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "isa_util.h"
#include "linear_isa.h"

namespace specdec {
namespace {

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
      for (int j = 0; j < MB; ++j)
        acc[j][u] = Ops::madd(acc[j][u], wv, Ops::load(xr[j] + k + L * u));
    }
  }
  for (; k < b.K; k += L) {
    const int64_t left = b.K - k;
    const typename Ops::Vec wv = left >= L ? Ops::load(wr + k) : Ops::load_tail(wr + k, left);
    for (int j = 0; j < MB; ++j) {
      const typename Ops::Vec xv =
          left >= L ? Ops::load(xr[j] + k) : Ops::load_tail(xr[j] + k, left);
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
  if (b.dtype == LinearDtype::FLOAT32)
    row<F32Ops, MB, U>(b, n, m0);
  else
    row<Bf16Ops, MB, U>(b, n, m0);
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

// ---- Packed weights (PackedLinearBlock in linear_isa.h) ----

// Broadcast of x at packed step kk: fp32 one element; bf16 the pair (2kk, 2kk+1) as 32 bits.
struct F32Packed {
  static constexpr int64_t kChunk = 32;  // k steps per partial sum
  static __m512 bcast(const void* x, int64_t kk) {
    return _mm512_set1_ps(static_cast<const float*>(x)[kk]);
  }
  static __m512 load(const void* w) { return _mm512_loadu_ps(w); }
  static __m512 madd(__m512 acc, __m512 w, __m512 xb) { return _mm512_fmadd_ps(w, xb, acc); }
  static constexpr int64_t kStepBytes = kPackLanes * 4;
};

struct Bf16Packed {
  static constexpr int64_t kChunk = 16;  // pair steps (32 k) per partial sum
  static __m512 bcast(const void* x, int64_t kk) {
    int32_t pair;
    std::memcpy(&pair, static_cast<const uint16_t*>(x) + 2 * kk, 4);
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
  }
  static __m512 load(const void* w) { return _mm512_castsi512_ps(_mm512_loadu_si512(w)); }
  static __m512 madd(__m512 acc, __m512 w, __m512 xb) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(w),
                            (__m512bh)_mm512_castps_si512(xb));
  }
  static constexpr int64_t kStepBytes = kPackLanes * 4;  // 16 outputs x 2 bf16
};

// Round 16 fp32 lanes to bf16 (nearest even; NaN stays a quiet NaN), as round_to_bf16 does.
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

inline __m512 load_bias(const PackedLinearBlock& b, int64_t n, __mmask16 mask) {
  if (b.dtype == LinearDtype::FLOAT32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(b.bias) + n);
  }
  const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(b.bias) + n);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Software prefetch of the packed tiles: each k step requests, for every block of the tile, the
// line kPackPrefetchSteps steps (one 64-byte line per step) ahead, into L2 (hint T1). At MB >= 4
// rows a tile does MB multiply-adds per weight line and the hardware prefetcher alone leaves the
// FMA loop waiting on memory; tiles of 1-3 rows prefetch too.
// History: 4 steps ahead into L1 (T0) first made one SmolLM2 step's weights 3-22% faster at
// M = 8 on Zen 4; 16 steps T0 then measured 1.07-1.19x over 4 steps on the AMX Xeon (one-step
// harness, 2 threads, M = 4/8/16) and 1.11-1.24x at bf16 M = 1-2 there.
// 64 steps (4 KiB of each block) ahead into L2 is better again on Zen 4 (2 cores, avx512_bf16,
// same process, the variants in turns, 12 rounds over bench_linear's grouped SmolLM2 step
// weights): against 16 steps T0, fp32 M = 1 1.03-1.13x, M = 2 1.11-1.18x, M = 4 1.18-1.29x,
// M = 8 1.23-1.27x; bf16 M = 1 1.13-1.16x, M = 4 1.15-1.23x, M = 8 1.02-1.07x. A compiled
// decode step went 24.4 -> 23.0 ms and a verify of 8 tokens 28.1 -> 26.4 ms (256-token context),
// and EAGLE-3 generation over 8 held-out prompts 1.23-1.33x -> 1.35-1.49x median over AR.
// T2 at 64 steps measured about as T1; T1 at 32 steps less (fp32 M = 8 1.12x). The AMX Xeon has
// not been measured with T1 / 64 steps (no device lent since).
constexpr int64_t kPackPrefetchSteps = 64;

// Blocks [nb0, nb0 + C) times rows [m0, m0 + MB): C * MB accumulators stay in registers; each
// chunk of k ends by adding them into `total` (L1), which keeps the fp32 error of a K-long sum
// at the level of a blocked sum.
template <class Ops, int C, int MB>
void packed_tile(const PackedLinearBlock& b, int64_t nb0, int64_t m0) {
  const int64_t esize = b.dtype == LinearDtype::FLOAT32 ? 4 : 2;
  const char* xr[MB];
  for (int j = 0; j < MB; ++j)
    xr[j] = static_cast<const char*>(b.x) + (m0 + j) * b.x_stride * esize;
  const char* wb = static_cast<const char*>(b.wp) + nb0 * b.Kp * Ops::kStepBytes;
  const int64_t block_bytes = b.Kp * Ops::kStepBytes;
  __m512 total[C][MB];
  for (int c = 0; c < C; ++c)
    for (int j = 0; j < MB; ++j) total[c][j] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < b.Kp; k0 += Ops::kChunk) {
    const int64_t k1 = std::min(b.Kp, k0 + Ops::kChunk);
    __m512 acc[C][MB];
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < MB; ++j) acc[c][j] = _mm512_setzero_ps();
    for (int64_t kk = k0; kk < k1; ++kk) {
      const char* w = wb + kk * Ops::kStepBytes;
      for (int c = 0; c < C; ++c)  // a hint: past the last block it never faults
        _mm_prefetch(w + c * block_bytes + kPackPrefetchSteps * Ops::kStepBytes, _MM_HINT_T1);
      __m512 wv[C];
      for (int c = 0; c < C; ++c) wv[c] = Ops::load(w + c * block_bytes);
      for (int j = 0; j < MB; ++j) {
        const __m512 xb = Ops::bcast(xr[j], kk);
        for (int c = 0; c < C; ++c) acc[c][j] = Ops::madd(acc[c][j], wv[c], xb);
      }
    }
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < MB; ++j) total[c][j] = _mm512_add_ps(total[c][j], acc[c][j]);
  }
  for (int c = 0; c < C; ++c) {
    const int64_t n = (nb0 + c) * kPackLanes;
    const int64_t left = b.N - n;
    const __mmask16 mask = left >= kPackLanes ? __mmask16(0xffff) : __mmask16((1u << left) - 1u);
    const __m512 bias = b.bias ? load_bias(b, n, mask) : _mm512_setzero_ps();
    for (int j = 0; j < MB; ++j) {
      const __m512 v = _mm512_add_ps(total[c][j], bias);
      if (b.dtype == LinearDtype::FLOAT32) {
        _mm512_mask_storeu_ps(static_cast<float*>(b.y) + (m0 + j) * b.y_stride + n, mask, v);
      } else {
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(b.y) + (m0 + j) * b.y_stride + n, mask,
                                 to_bf16(v));
      }
    }
  }
}

template <class Ops, int C>
void packed_rows(const PackedLinearBlock& b, int64_t nb0) {
  int64_t m = 0;
  for (; m + 8 <= b.M; m += 8) packed_tile<Ops, C, 8>(b, nb0, m);
  switch (b.M - m) {
    case 7: packed_tile<Ops, C, 7>(b, nb0, m); break;
    case 6: packed_tile<Ops, C, 6>(b, nb0, m); break;
    case 5: packed_tile<Ops, C, 5>(b, nb0, m); break;
    case 4: packed_tile<Ops, C, 4>(b, nb0, m); break;
    case 3: packed_tile<Ops, C, 3>(b, nb0, m); break;
    case 2: packed_tile<Ops, C, 2>(b, nb0, m); break;
    case 1: packed_tile<Ops, C, 1>(b, nb0, m); break;
    default: break;
  }
}

template <class Ops>
void packed_groups(const PackedLinearBlock& b) {
  const int64_t blocks = (b.N + kPackLanes - 1) / kPackLanes;
  for (int64_t g = b.g_begin; g < b.g_end; ++g) {
    const int64_t nb0 = g * kPackGroupBlocks;
    switch (std::min(kPackGroupBlocks, blocks - nb0)) {
      case 3: packed_rows<Ops, 3>(b, nb0); break;
      case 2: packed_rows<Ops, 2>(b, nb0); break;
      case 1: packed_rows<Ops, 1>(b, nb0); break;
      default: break;
    }
  }
}

}  // namespace

void packed_linear_avx512(const PackedLinearBlock& b) {
  if (b.dtype == LinearDtype::FLOAT32)
    packed_groups<F32Packed>(b);
  else
    packed_groups<Bf16Packed>(b);
}

void skinny_linear_avx512(const LinearBlock& b) {
  for (int64_t n = b.n_begin; n < b.n_end; ++n) all_rows(b, n);
}

}  // namespace specdec
