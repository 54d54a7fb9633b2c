// AVX-512 kernels of quant_linear / quant_dequantize (see quant_isa.h). Weight-streaming: each
// quantized weight row is read once per call; every 32-weight sub-block is dequantized in
// registers (nibbles -> int32 lanes by zero-extension, and / shift, scales applied per sub-block,
// exactly as the file defines the weight) into two 16-lane fp32 vectors, which are multiplied into
// up to 8 rows of x at once. With more than 8 rows of x the row is dequantized once into an L1
// buffer and re-read per group of 8 rows: the same fp32 values enter the same FMA sequence, so a
// row of the output is bitwise the same whatever M is (batch invariance).
#include <immintrin.h>

#include <cstring>

#include "isa_util.h"
#include "quant_isa.h"

namespace specdec {
namespace {

inline float load_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 16 bytes -> 16 int32 lanes (zero-extended).
inline __m512i bytes16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m512 to_f32(__m512i v) { return _mm512_cvtepi32_ps(v); }

// Each format's row walker calls f(k, lo, hi) for the weights [k, k + 16) and [k + 16, k + 32)
// of a row of K weights, in increasing k.
// 4-bit formats look their weights up: the 16 (or 32) values a block's scale(s) allow are
// computed once per (sub-)block, exactly as the file defines them, and vpermps picks each
// weight by its nibble (the index uses the low 4 bits of each int32 lane, so the low nibble needs
// no mask). One permute per 16 weights instead of mask, convert and multiply-add.
inline __m512 iota16() {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

struct Q4_0Rows {
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    const __m512 centred = _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f));  // q - 8
    for (int64_t k = 0; k < K; k += 32, p += 18) {
      const __m512 table = _mm512_mul_ps(centred, _mm512_set1_ps(load_f16(p)));  // d * (q - 8)
      const __m512i v = bytes16(p + 2);
      f(k, _mm512_permutexvar_ps(v, table), _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table));
    }
  }
};

struct Q4_1Rows {
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    const __m512 iota = iota16();
    for (int64_t k = 0; k < K; k += 32, p += 20) {
      // d * q is exact, so the fused multiply-add rounds d * q + m once, as the file's fp32 does.
      const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(load_f16(p)), _mm512_set1_ps(load_f16(p + 2)));
      const __m512i v = bytes16(p + 4);
      f(k, _mm512_permutexvar_ps(v, table), _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table));
    }
  }
};

struct Q5_0Rows {
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    const __m512i nib = _mm512_set1_epi32(15), sixteen = _mm512_set1_epi32(16);
    const __m512 low = _mm512_sub_ps(iota16(), _mm512_set1_ps(16.0f));  // q - 16, q < 16
    const __m512 high = iota16();                                        // q - 16, q >= 16
    for (int64_t k = 0; k < K; k += 32, p += 22) {
      const __m512 d = _mm512_set1_ps(load_f16(p));
      const __m512 t0 = _mm512_mul_ps(low, d), t1 = _mm512_mul_ps(high, d);
      uint32_t qh;
      std::memcpy(&qh, p + 2, 4);
      const __m512i v = bytes16(p + 6);
      __m512i ql = _mm512_and_si512(v, nib), qhi = _mm512_srli_epi32(v, 4);
      // Bit j of qh is the fifth bit of weight j: a lane mask straight from the integer.
      ql = _mm512_mask_or_epi32(ql, static_cast<__mmask16>(qh), ql, sixteen);
      qhi = _mm512_mask_or_epi32(qhi, static_cast<__mmask16>(qh >> 16), qhi, sixteen);
      f(k, _mm512_permutex2var_ps(t0, ql, t1), _mm512_permutex2var_ps(t0, qhi, t1));
    }
  }
};

struct Q8_0Rows {
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    for (int64_t k = 0; k < K; k += 32, p += 34) {
      const __m512 d = _mm512_set1_ps(load_f16(p));
      const __m512i a = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2)));
      const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18)));
      f(k, _mm512_mul_ps(to_f32(a), d), _mm512_mul_ps(to_f32(b), d));
    }
  }
};

// Q4_K and Q5_K: sub-block s of a 256-weight block is (d * sc[s]) * q - dmin * mn[s]; both
// products are exact, so one fused multiply-add rounds the difference once, as the file's fp32:
// the sub-block's table of 16 (32) weights, looked up by nibble.
template <bool kFifthBit>
struct QK45Rows {
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    const __m512i nib = _mm512_set1_epi32(15), sixteen = _mm512_set1_epi32(16);
    const __m512 iota = iota16(), iota_high = _mm512_add_ps(iota16(), _mm512_set1_ps(16.0f));
    const int64_t block_bytes = kFifthBit ? 176 : 144;
    for (int64_t k = 0; k < K; k += 256, p += block_bytes) {
      const float d = load_f16(p), dmin = load_f16(p + 2);
      const uint8_t* scales = p + 4;
      const uint8_t* qs = p + (kFifthBit ? 48 : 16);
      __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();
      if (kFifthBit) {
        h0 = bytes16(p + 16);
        h1 = bytes16(p + 32);
      }
      for (int j = 0; j < 4; ++j) {
        const __m512i v0 = bytes16(qs + 32 * j), v1 = bytes16(qs + 32 * j + 16);
        for (int half = 0; half < 2; ++half) {
          const int s = 2 * j + half;
          int sc, mn;
          k_scale_min(scales, s, &sc, &mn);
          const __m512 ds = _mm512_set1_ps(d * static_cast<float>(sc));
          const __m512 neg_dm = _mm512_set1_ps(-(dmin * static_cast<float>(mn)));
          // The sub-block's possible weights (q = 0..15, and 16..31 with the fifth bit).
          const __m512 t0 = _mm512_fmadd_ps(iota, ds, neg_dm);
          __m512i q0 = half ? _mm512_srli_epi32(v0, 4) : v0;
          __m512i q1 = half ? _mm512_srli_epi32(v1, 4) : v1;
          if (kFifthBit) {
            const __m512 t1 = _mm512_fmadd_ps(iota_high, ds, neg_dm);
            const __m512i bit = _mm512_set1_epi32(1 << s);
            q0 = _mm512_and_si512(q0, nib);
            q1 = _mm512_and_si512(q1, nib);
            q0 = _mm512_mask_or_epi32(q0, _mm512_test_epi32_mask(h0, bit), q0, sixteen);
            q1 = _mm512_mask_or_epi32(q1, _mm512_test_epi32_mask(h1, bit), q1, sixteen);
            f(k + 32 * s, _mm512_permutex2var_ps(t0, q0, t1), _mm512_permutex2var_ps(t0, q1, t1));
          } else {
            f(k + 32 * s, _mm512_permutexvar_ps(q0, t0), _mm512_permutexvar_ps(q1, t0));
          }
        }
      }
    }
  }
};

// Q6_K: the 6-bit quant is assembled at byte level (32 weights per 256-bit op), then widened;
// (d * sc) * (q - 32) has at most 23 significant bits: exact.
struct Q6_KRows {
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    const __m256i nib = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
    const __m256i thirty_two = _mm256_set1_epi8(32);
    for (int64_t k = 0; k < K; k += 256, p += 210) {
      const uint8_t* ql = p;
      const uint8_t* qh = p + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
      const float d = load_f16(p + 208);
      for (int h = 0; h < 2; ++h) {
        const __m256i hbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
        for (int t = 0; t < 4; ++t) {
          const int g = 4 * h + t;
          const __m256i lbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32 * (t % 2)));
          const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(lbits, _mm_cvtsi32_si128(4 * (t / 2))), nib);
          const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * t)), three);
          // q - 32 in signed bytes (-32..31), sign-extended: d * sc * (q - 32) as the file computes
          // it (exact, with the file's sign of zero).
          const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), thirty_two);
          const __m512 w0 = _mm512_mul_ps(to_f32(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))),
                                          _mm512_set1_ps(d * static_cast<float>(scales[2 * g])));
          const __m512 w1 = _mm512_mul_ps(to_f32(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))),
                                          _mm512_set1_ps(d * static_cast<float>(scales[2 * g + 1])));
          f(k + 32 * g, w0, w1);
        }
      }
    }
  }
};

// A row already dequantized into an fp32 buffer, walked like a quantized one.
struct BufferRows {
  template <class F>
  static void row(const float* p, int64_t K, F&& f) {
    for (int64_t k = 0; k < K; k += 32) f(k, _mm512_loadu_ps(p + k), _mm512_loadu_ps(p + k + 16));
  }
};

// out[m] = dot(row, x[m]) for MB rows of x. Two accumulators per row of x (weights k..k+15 and
// k+16..k+31 of each sub-block), summed and reduced in a fixed order at the end: the operations
// on one x row never depend on MB.
template <int MB, class Rows, class Src>
inline void dot_rows(const Src* row, int64_t K, const float* x, int64_t xs, float* out) {
  __m512 a0[MB], a1[MB];
  for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  Rows::row(row, K, [&](int64_t k, __m512 lo, __m512 hi) {
    for (int m = 0; m < MB; ++m) {
      a0[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + m * xs + k), a0[m]);
      a1[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + m * xs + k + 16), a1[m]);
    }
  });
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
}

template <class Rows, class Src>
inline void dot_group(int mb, const Src* row, int64_t K, const float* x, int64_t xs, float* out) {
  switch (mb) {
    case 8: dot_rows<8, Rows>(row, K, x, xs, out); break;
    case 4: dot_rows<4, Rows>(row, K, x, xs, out); break;
    case 2: dot_rows<2, Rows>(row, K, x, xs, out); break;
    default: dot_rows<1, Rows>(row, K, x, xs, out); break;
  }
}

constexpr int64_t kFusedMaxRows = 8;
thread_local ScratchBuffer t_row;

template <class Rows>
void linear_rows(const QuantLinearBlock& b) {
  const bool buffered = b.M > kFusedMaxRows;
  float* buf = buffered ? t_row.get(b.K) : nullptr;
  for (int64_t n = b.n_begin; n < b.n_end; ++n) {
    const uint8_t* row = b.w + n * b.w_stride;
    if (buffered) {
      Rows::row(row, b.K, [buf](int64_t k, __m512 lo, __m512 hi) {
        _mm512_storeu_ps(buf + k, lo);
        _mm512_storeu_ps(buf + k + 16, hi);
      });
    }
    for (int64_t m = 0; m < b.M;) {
      const int64_t left = b.M - m;
      const int mb = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
      float out[8];
      const float* xm = b.x + m * b.x_stride;
      if (buffered) dot_group<BufferRows>(mb, buf, b.K, xm, b.x_stride, out);
      else dot_group<Rows>(mb, row, b.K, xm, b.x_stride, out);
      for (int i = 0; i < mb; ++i) {
        float v = out[i];
        if (b.bias) v += b.bias[n];
        b.y[(m + i) * b.y_stride + n] = v;
      }
      m += mb;
    }
  }
}

template <class Rows>
void dequantize_row(const uint8_t* row, int64_t K, float* out) {
  Rows::row(row, K, [out](int64_t k, __m512 lo, __m512 hi) {
    _mm512_storeu_ps(out + k, lo);
    _mm512_storeu_ps(out + k + 16, hi);
  });
}

}  // namespace

void quant_linear_avx512(const QuantLinearBlock& b) {
  switch (b.fmt) {
    case QuantFmt::Q4_0: linear_rows<Q4_0Rows>(b); break;
    case QuantFmt::Q4_1: linear_rows<Q4_1Rows>(b); break;
    case QuantFmt::Q5_0: linear_rows<Q5_0Rows>(b); break;
    case QuantFmt::Q8_0: linear_rows<Q8_0Rows>(b); break;
    case QuantFmt::Q4_K: linear_rows<QK45Rows<false>>(b); break;
    case QuantFmt::Q5_K: linear_rows<QK45Rows<true>>(b); break;
    case QuantFmt::Q6_K: linear_rows<Q6_KRows>(b); break;
  }
}

void quant_dequantize_row_avx512(QuantFmt fmt, const uint8_t* row, int64_t K, float* out) {
  switch (fmt) {
    case QuantFmt::Q4_0: dequantize_row<Q4_0Rows>(row, K, out); break;
    case QuantFmt::Q4_1: dequantize_row<Q4_1Rows>(row, K, out); break;
    case QuantFmt::Q5_0: dequantize_row<Q5_0Rows>(row, K, out); break;
    case QuantFmt::Q8_0: dequantize_row<Q8_0Rows>(row, K, out); break;
    case QuantFmt::Q4_K: dequantize_row<QK45Rows<false>>(row, K, out); break;
    case QuantFmt::Q5_K: dequantize_row<QK45Rows<true>>(row, K, out); break;
    case QuantFmt::Q6_K: dequantize_row<Q6_KRows>(row, K, out); break;
  }
}

}  // namespace specdec
