// AVX2 kernel of quant_linear with INT8 activations for the K formats (Q4_K, Q5_K, Q6_K;
// quant_isa.h has the definition): the AVX-512 VNNI kernel's scheme on 256-bit vectors without
// VNNI. Per 32 weights and row of x, vpmaddubsw multiplies the weight bytes into the quants as
// 16 int16 pairs and vpmaddwd multiplies the pairs by the sub-block's integer scale into int32
// lanes; per 256 weights the lanes are converted and scaled once. One row of x: each weight
// block is decoded in registers; several rows: a weight row is decoded once into a per-thread
// buffer and multiplied into up to 4 rows of x. A (x row, weight row) pair sees the same
// operations whatever the number of rows: batch invariance. (The 32-weight formats have no AVX2
// INT8 kernel: the portable loops run them.)
#include <immintrin.h>

#include <cstring>

#include "quant_isa.h"

namespace specdec {
namespace {

inline float load_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// A weight block decoded for the integer dot: 8 sub-blocks of 32 unsigned bytes (u), each
// sub-block's int16 scale of every vpmaddubsw pair (sc), the block's d, -dmin * mn per
// sub-block (Q4_K / Q5_K: mins) or -32 * sc of the 16 groups as int16 (Q6_K: corr).
struct KBlock2 {
  __m256i u[8], sc[8];
  __m256 mins;
  __m256i corr;
  float d;
};

template <bool kFifthBit>
struct KDecode45 {
  static constexpr bool kMins = true;
  static constexpr int64_t kBytes = kFifthBit ? 176 : 144;
  static inline void block(const uint8_t* p, KBlock2& w) {
    const float dmin = load_f16(p + 2);
    alignas(32) float mins[8];
    for (int s = 0; s < 8; ++s) {
      int sc, mn;
      k_scale_min(p + 4, s, &sc, &mn);
      w.sc[s] = _mm256_set1_epi16(static_cast<short>(sc));
      mins[s] = -(dmin * static_cast<float>(mn));  // exact: an fp16 times a 6-bit integer
    }
    w.mins = _mm256_load_ps(mins);
    w.d = load_f16(p);
    const uint8_t* qs = p + (kFifthBit ? 48 : 16);
    const __m256i nib = _mm256_set1_epi8(15);
    const __m256i qh = kFifthBit ? load32(p + 16) : _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      // Sub-blocks 2j and 2j + 1: the low and high nibbles of the same 32 bytes.
      const __m256i v = load32(qs + 32 * j);
      w.u[2 * j] = _mm256_and_si256(v, nib);
      w.u[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    }
    if (kFifthBit) {
      for (int s = 0; s < 8; ++s) {
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << s));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
        w.u[s] = _mm256_or_si256(w.u[s], _mm256_and_si256(set, _mm256_set1_epi8(16)));
      }
    }
  }
};

struct KDecode6 {
  static constexpr bool kMins = false;
  static constexpr int64_t kBytes = 210;
  static inline void block(const uint8_t* p, KBlock2& w) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
    const __m256i nib = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
    for (int g = 0; g < 8; ++g) {
      const int h = g / 4, t = g % 4;
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(load32(p + 64 * h + 32 * (t % 2)), 4 * (t / 2)), nib);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(load32(p + 128 + 32 * h), 2 * t), three);
      w.u[g] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
      // int16 lanes 0-7 (weights 0-15) take scale 2g, lanes 8-15 scale 2g + 1.
      w.sc[g] = _mm256_setr_m128i(_mm_set1_epi16(scales[2 * g]), _mm_set1_epi16(scales[2 * g + 1]));
    }
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
    w.corr = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(s16, 5));  // -32 * sc
    w.mins = _mm256_setzero_ps();
    w.d = load_f16(p + 208);
  }
};

// acc + block b of x row m times the decoded weight block w: the exact integer block sum, then
// acc += I * (d * d_x) and, for Q4_K / Q5_K, acc += (-dmin * mn) * (d_x * sum q) per sub-block.
template <class Dec>
inline __m256 block_dot(const KBlock2& w, const QuantizedXK& X, int64_t m, int64_t b, __m256 acc) {
  const int8_t* q = X.q + m * X.K + 256 * b;
  __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
  for (int s = 0; s < 8; s += 2) {
    i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(_mm256_maddubs_epi16(w.u[s], load32(q + 32 * s)), w.sc[s]));
    i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(_mm256_maddubs_epi16(w.u[s + 1], load32(q + 32 * s + 32)), w.sc[s + 1]));
  }
  __m256i isum = _mm256_add_epi32(i0, i1);
  if (!Dec::kMins) isum = _mm256_add_epi32(isum, _mm256_madd_epi16(load32(X.bsum16 + m * (X.K / 16) + 16 * b), w.corr));
  const float dx = X.d[m * (X.K / 256) + b];
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(w.d * dx), acc);
  if (Dec::kMins) acc = _mm256_fmadd_ps(_mm256_loadu_ps(X.d_bsum32 + m * (X.K / 32) + 8 * b), w.mins, acc);
  return acc;
}

// The 8 lanes summed in a fixed order.
inline float reduce8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

thread_local AlignedBuffer<KBlock2> t_kblocks;

inline void store_output(const QuantLinearInt8Block& b, int64_t m, int64_t n, float v) {
  if (b.bias) v += b.bias[n];
  b.y[m * b.y_stride + n] = v;
}

template <int MB, class Dec>
inline void dot_rows(const KBlock2* w, const QuantLinearInt8Block& b, int64_t m0, int64_t n) {
  const QuantizedXK& X = b.xk;
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < X.K / 256; ++c)
    for (int i = 0; i < MB; ++i) acc[i] = block_dot<Dec>(w[c], X, m0 + i, c, acc[i]);
  for (int i = 0; i < MB; ++i) store_output(b, m0 + i, n, reduce8(acc[i]));
}

template <class Dec>
void k_linear_rows(const QuantLinearInt8Block& b) {
  const QuantizedXK& X = b.xk;
  const int64_t blocks = X.K / 256;
  if (X.M == 1) {
    for (int64_t n = b.n_begin; n < b.n_end; ++n) {
      const uint8_t* p = b.w + n * b.w_stride;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t c = 0; c < blocks; ++c) {
        KBlock2 w;
        Dec::block(p + c * Dec::kBytes, w);
        acc = block_dot<Dec>(w, X, 0, c, acc);
      }
      store_output(b, 0, n, reduce8(acc));
    }
    return;
  }
  KBlock2* buf = t_kblocks.get(blocks);
  for (int64_t n = b.n_begin; n < b.n_end; ++n) {
    const uint8_t* p = b.w + n * b.w_stride;
    for (int64_t c = 0; c < blocks; ++c) Dec::block(p + c * Dec::kBytes, buf[c]);
    for (int64_t m = 0; m < X.M;) {
      const int64_t left = X.M - m;
      if (left >= 4) {
        dot_rows<4, Dec>(buf, b, m, n);
        m += 4;
      } else if (left >= 2) {
        dot_rows<2, Dec>(buf, b, m, n);
        m += 2;
      } else {
        dot_rows<1, Dec>(buf, b, m, n);
        m += 1;
      }
    }
  }
}

}  // namespace

void quant_linear_int8k_avx2(const QuantLinearInt8Block& b) {
  switch (b.fmt) {
    case QuantFmt::Q4_K: k_linear_rows<KDecode45<false>>(b); break;
    case QuantFmt::Q5_K: k_linear_rows<KDecode45<true>>(b); break;
    case QuantFmt::Q6_K: k_linear_rows<KDecode6>(b); break;
    default: break;  // 32-weight formats never reach this kernel (quant.cpp's int8 path)
  }
}

}  // namespace specdec
