// AVX-512 VNNI kernel of quant_linear with INT8 activations (quant_isa.h has the definition).
// Built with -mavx512vnni and called only when cpu_has_avx512_vnni(): an AVX-512 CPU without
// VNNI (Skylake-X) never reaches this file. Each weight row is read once per group of 4 rows of
// x; every 64 weights become 64 unsigned bytes (the stored quant, plus the format's offset for
// the signed ones), one vpdpbusd per row of x multiplies them into the row's 64 int8 quants
// (16 int32 lanes of 4 products, started at -offset * the lane's quant sum, so each lane holds
// its exact integer dot), and the lanes are scaled into fp32 lane accumulators. A (x row, weight
// row) pair sees the same operations whatever the number of rows: batch invariance.
#include <immintrin.h>

#include <cstring>

#include "quant_isa.h"

namespace specdec {
namespace {

inline float load_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 8 lanes of a, then 8 lanes of b.
inline __m512 halves(float a, float b) {
  return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

// A zero block stands in for the missing partner of the last block of an odd count of 32-weight
// blocks: scale 0, and its weights meet the zero padding of x's quants.
alignas(64) const uint8_t kZeroBlock[64] = {};

// The 32 nibbles of each of two 16-byte arrays as [lo(a) hi(a) lo(b) hi(b)] bytes: weight j of a
// block is nibble j / 16 of byte j % 16.
inline __m512i nibbles2(const uint8_t* a, const uint8_t* b) {
  const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i vb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  __m512i v = _mm512_castsi128_si512(va);
  v = _mm512_inserti32x4(v, va, 1);
  v = _mm512_inserti32x4(v, vb, 2);
  v = _mm512_inserti32x4(v, vb, 3);
  v = _mm512_mask_srli_epi16(v, 0xFF00FF00u, v, 4);  // 128-bit lanes 1 and 3: high nibbles
  return _mm512_and_si512(v, _mm512_set1_epi8(15));
}

// Each format's walker calls f(k, u, scale, min) for the weights [k, k + 64): u their unsigned
// bytes, scale / min the fp32 weight scale / min of each int32 lane (4 weights).
// 32-weight-block formats: blocks in pairs.
template <QuantFmt kFmt>
struct SmallBlocks {
  static constexpr int64_t kBytes = kFmt == QuantFmt::Q4_0 ? 18 : kFmt == QuantFmt::Q4_1 ? 20
                                  : kFmt == QuantFmt::Q5_0 ? 22 : 34;
  static constexpr bool kHasMin = kFmt == QuantFmt::Q4_1;
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    for (int64_t k = 0; k < K; k += 64, p += 2 * kBytes) {
      const uint8_t* a = p;
      const uint8_t* b = k + 32 < K ? p + kBytes : kZeroBlock;
      const __m512 scale = halves(load_f16(a), load_f16(b));
      __m512 mn = _mm512_setzero_ps();
      __m512i u;
      if (kFmt == QuantFmt::Q8_0) {
        const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2));
        const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
        u = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1),
                             _mm512_set1_epi8(static_cast<char>(0x80)));  // q + 128
      } else if (kFmt == QuantFmt::Q5_0) {
        u = nibbles2(a + 6, b + 6);
        uint32_t ha, hb;
        std::memcpy(&ha, a + 2, 4);
        std::memcpy(&hb, b + 2, 4);
        const __mmask64 fifth = static_cast<__mmask64>(ha) | static_cast<__mmask64>(hb) << 32;
        u = _mm512_mask_add_epi8(u, fifth, u, _mm512_set1_epi8(16));
      } else if (kFmt == QuantFmt::Q4_1) {
        u = nibbles2(a + 4, b + 4);
        mn = halves(load_f16(a + 2), load_f16(b + 2));
      } else {
        u = nibbles2(a + 2, b + 2);
      }
      f(k, u, scale, mn);
    }
  }
};

// Q4_K / Q5_K: the 64 weights of sub-blocks 2j and 2j + 1 are the low and high nibbles of the
// same 32 bytes; scale d * sc, min -dmin * mn per sub-block.
template <bool kFifthBit>
struct KBlocks45 {
  static constexpr bool kHasMin = true;
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    const __m256i nib = _mm256_set1_epi8(15);
    for (int64_t k = 0; k < K; k += 256, p += kFifthBit ? 176 : 144) {
      const float d = load_f16(p), dmin = load_f16(p + 2);
      const uint8_t* qs = p + (kFifthBit ? 48 : 16);
      __m256i qh = _mm256_setzero_si256();
      if (kFifthBit) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
        __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, nib)),
                                       _mm256_and_si256(_mm256_srli_epi16(v, 4), nib), 1);
        if (kFifthBit) {
          const __mmask32 lo = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * j))));
          const __mmask32 hi = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * j + 1))));
          const __mmask64 fifth = static_cast<__mmask64>(lo) | static_cast<__mmask64>(hi) << 32;
          u = _mm512_mask_add_epi8(u, fifth, u, _mm512_set1_epi8(16));
        }
        int sc0, mn0, sc1, mn1;
        k_scale_min(p + 4, 2 * j, &sc0, &mn0);
        k_scale_min(p + 4, 2 * j + 1, &sc1, &mn1);
        f(k + 64 * j, u, halves(d * static_cast<float>(sc0), d * static_cast<float>(sc1)),
          halves(-(dmin * static_cast<float>(mn0)), -(dmin * static_cast<float>(mn1))));
      }
    }
  }
};

// Q6_K: groups 2i and 2i + 1 (64 weights) share their high bits' bytes; the 6-bit quant
// (0..63, wq = q - 32) is assembled at byte level; one int8 scale per 16 weights = per 4 lanes.
struct KBlocks6 {
  static constexpr bool kHasMin = false;
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    const __m256i nib = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int64_t k = 0; k < K; k += 256, p += 210) {
      const uint8_t* ql = p;
      const uint8_t* qh = p + 128;
      const uint8_t* sc = p + 192;
      const __m512 d = _mm512_set1_ps(load_f16(p + 208));
      for (int i = 0; i < 4; ++i) {
        const int g = 2 * i, h = g / 4, t = g % 4;  // t even: groups g, g + 1 are t, t + 1
        const __m256i hbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
        const int lshift = 4 * (t / 2);
        const __m256i lo0 = _mm256_and_si256(_mm256_srl_epi16(l0, _mm_cvtsi32_si128(lshift)), nib);
        const __m256i lo1 = _mm256_and_si256(_mm256_srl_epi16(l1, _mm_cvtsi32_si128(lshift)), nib);
        const __m256i hi0 = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * t)), three);
        const __m256i hi1 = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * t + 2)), three);
        const __m256i q0 = _mm256_or_si256(lo0, _mm256_slli_epi16(hi0, 4));
        const __m256i q1 = _mm256_or_si256(lo1, _mm256_slli_epi16(hi1, 4));
        const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
        int32_t s4;
        std::memcpy(&s4, sc + 2 * g, 4);  // scales 2g .. 2g + 3
        const __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_cvtsi32_si128(s4)));
        const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_mul_ps(s, d));
        f(k + 64 * i, u, scale, _mm512_setzero_ps());
      }
    }
  }
};

// out[i] = row . x[m0 + i] for MB rows of x. Per row: a main and a min fp32 lane accumulator,
// added and reduced in a fixed order at the end.
template <int MB, class Rows, bool kOffset>
inline void dot_rows(const uint8_t* row, const QuantizedX& X, int64_t m0, float* out) {
  const int64_t lanes = X.Kp / 4;
  __m512 acc[MB], acc_min[MB];
  for (int i = 0; i < MB; ++i) acc[i] = acc_min[i] = _mm512_setzero_ps();
  const int8_t* q = X.q + m0 * X.Kp;
  const float* d = X.d + m0 * lanes;
  const float* d_sum = X.d_sum + m0 * lanes;
  const int32_t* neg = X.neg_offset_sum + m0 * lanes;
  Rows::row(row, X.K, [&](int64_t k, __m512i u, __m512 scale, __m512 mn) {
    for (int i = 0; i < MB; ++i) {
      const __m512i qx = _mm512_loadu_si512(q + i * X.Kp + k);
      const __m512i start = kOffset ? _mm512_loadu_si512(neg + i * lanes + k / 4) : _mm512_setzero_si512();
      const __m512i dot = _mm512_dpbusd_epi32(start, u, qx);
      const __m512 s = _mm512_mul_ps(scale, _mm512_loadu_ps(d + i * lanes + k / 4));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[i]);
      if (Rows::kHasMin) acc_min[i] = _mm512_fmadd_ps(_mm512_loadu_ps(d_sum + i * lanes + k / 4), mn, acc_min[i]);
    }
  });
  for (int i = 0; i < MB; ++i) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], acc_min[i]));
}

template <class Rows, bool kOffset>
void linear_rows(const QuantLinearInt8Block& b) {
  for (int64_t n = b.n_begin; n < b.n_end; ++n) {
    const uint8_t* row = b.w + n * b.w_stride;
    for (int64_t m = 0; m < b.x.M;) {
      const int64_t left = b.x.M - m;
      const int mb = left >= 4 ? 4 : left >= 2 ? 2 : 1;
      float out[4];
      switch (mb) {
        case 4: dot_rows<4, Rows, kOffset>(row, b.x, m, out); break;
        case 2: dot_rows<2, Rows, kOffset>(row, b.x, m, out); break;
        default: dot_rows<1, Rows, kOffset>(row, b.x, m, out); break;
      }
      for (int i = 0; i < mb; ++i) {
        float v = out[i];
        if (b.bias) v += b.bias[n];
        b.y[(m + i) * b.y_stride + n] = v;
      }
      m += mb;
    }
  }
}

}  // namespace

void quant_linear_int8_avx512vnni(const QuantLinearInt8Block& b) {
  switch (b.fmt) {
    case QuantFmt::Q4_0: linear_rows<SmallBlocks<QuantFmt::Q4_0>, true>(b); break;
    case QuantFmt::Q4_1: linear_rows<SmallBlocks<QuantFmt::Q4_1>, false>(b); break;
    case QuantFmt::Q5_0: linear_rows<SmallBlocks<QuantFmt::Q5_0>, true>(b); break;
    case QuantFmt::Q8_0: linear_rows<SmallBlocks<QuantFmt::Q8_0>, true>(b); break;
    case QuantFmt::Q4_K: linear_rows<KBlocks45<false>, false>(b); break;
    case QuantFmt::Q5_K: linear_rows<KBlocks45<true>, false>(b); break;
    case QuantFmt::Q6_K: linear_rows<KBlocks6, true>(b); break;
  }
}

}  // namespace specdec
