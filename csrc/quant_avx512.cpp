// AVX-512 kernels of quant_linear / quant_dequantize (see quant_isa.h). Weight-streaming: each
// quantized weight row is read once per call and every 32-weight sub-block is turned into two
// 16-lane fp32 vectors of exactly the file's weights (4/5-bit formats by a per-block table lookup,
// Q6_K / Q8_0 by widening and one exact multiply). One row of x (decode): the vectors feed the
// dot product straight from registers. Several rows (verify, prefill): weight rows are dequantized
// in pairs into a per-thread buffer and multiplied into 4 rows of x at a time, so each x load
// feeds two rows. Either way one (x row, weight row) pair sees the same FMA sequence and the same
// final reduction, so a row of the output is bitwise the same whatever M is (batch invariance).
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
      const __m512 table =
          _mm512_fmadd_ps(iota, _mm512_set1_ps(load_f16(p)), _mm512_set1_ps(load_f16(p + 2)));
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
    const __m512 high = iota16();                                       // q - 16, q >= 16
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

// Q5_1: as Q5_0 with the table d * q + m (d * q exact: one rounding, as the file's fp32).
struct Q5_1Rows {
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    const __m512i nib = _mm512_set1_epi32(15), sixteen = _mm512_set1_epi32(16);
    const __m512 low = iota16(), high = _mm512_add_ps(iota16(), _mm512_set1_ps(16.0f));
    for (int64_t k = 0; k < K; k += 32, p += 24) {
      const __m512 d = _mm512_set1_ps(load_f16(p)), m = _mm512_set1_ps(load_f16(p + 2));
      const __m512 t0 = _mm512_fmadd_ps(low, d, m), t1 = _mm512_fmadd_ps(high, d, m);
      uint32_t qh;
      std::memcpy(&qh, p + 4, 4);
      const __m512i v = bytes16(p + 8);
      __m512i ql = _mm512_and_si512(v, nib), qhi = _mm512_srli_epi32(v, 4);
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
      const __m512i a =
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2)));
      const __m512i b =
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18)));
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
          const __m256i lbits =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32 * (t % 2)));
          const __m256i lo =
              _mm256_and_si256(_mm256_srl_epi16(lbits, _mm_cvtsi32_si128(4 * (t / 2))), nib);
          const __m256i hi =
              _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * t)), three);
          // q - 32 in signed bytes (-32..31), sign-extended: d * sc * (q - 32) as the file computes
          // it (exact, with the file's sign of zero).
          const __m256i q =
              _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), thirty_two);
          const __m512 w0 = _mm512_mul_ps(to_f32(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))),
                                          _mm512_set1_ps(d * static_cast<float>(scales[2 * g])));
          const __m512 w1 =
              _mm512_mul_ps(to_f32(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))),
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
    case 4: dot_rows<4, Rows>(row, K, x, xs, out); break;
    case 2: dot_rows<2, Rows>(row, K, x, xs, out); break;
    default: dot_rows<1, Rows>(row, K, x, xs, out); break;
  }
}

// out0[m], out1[m] = dot(w0, x[m]), dot(w1, x[m]) for two rows already dequantized into fp32
// buffers: each load of x feeds both rows (half the loads per FMA). The operations on one
// (x row, weight row) pair are exactly those of dot_rows: same accumulators, order and reduction.
template <int MB>
inline void dot_rows2(const float* w0, const float* w1, int64_t K, const float* x, int64_t xs,
                      float* out0, float* out1) {
  __m512 a0[MB], a1[MB], b0[MB], b1[MB];
  for (int m = 0; m < MB; ++m) a0[m] = a1[m] = b0[m] = b1[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __m512 lo0 = _mm512_loadu_ps(w0 + k), hi0 = _mm512_loadu_ps(w0 + k + 16);
    const __m512 lo1 = _mm512_loadu_ps(w1 + k), hi1 = _mm512_loadu_ps(w1 + k + 16);
    for (int m = 0; m < MB; ++m) {
      const __m512 xl = _mm512_loadu_ps(x + m * xs + k), xh = _mm512_loadu_ps(x + m * xs + k + 16);
      a0[m] = _mm512_fmadd_ps(lo0, xl, a0[m]);
      a1[m] = _mm512_fmadd_ps(hi0, xh, a1[m]);
      b0[m] = _mm512_fmadd_ps(lo1, xl, b0[m]);
      b1[m] = _mm512_fmadd_ps(hi1, xh, b1[m]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    out0[m] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
    out1[m] = _mm512_reduce_add_ps(_mm512_add_ps(b0[m], b1[m]));
  }
}

inline void dot_group2(int mb, const float* w0, const float* w1, int64_t K, const float* x,
                       int64_t xs, float* out0, float* out1) {
  switch (mb) {
    case 4: dot_rows2<4>(w0, w1, K, x, xs, out0, out1); break;
    case 2: dot_rows2<2>(w0, w1, K, x, xs, out0, out1); break;
    default: dot_rows2<1>(w0, w1, K, x, xs, out0, out1); break;
  }
}

thread_local ScratchBuffer t_rows;

inline void store_outputs(const QuantLinearBlock& b, int64_t m, int mb, int64_t n,
                          const float* out) {
  for (int i = 0; i < mb; ++i) {
    float v = out[i];
    if (b.bias) v += b.bias[n];
    b.y[(m + i) * b.y_stride + n] = v;
  }
}

// One row of x (decode): each weight row is dequantized in registers and consumed at once.
// Several rows of x (verify, prefill): weight rows are dequantized in pairs into an L1/L2 buffer
// and multiplied into 4 rows of x at a time (dot_rows2). Both give the same bits per output.
template <class Rows>
void linear_rows(const QuantLinearBlock& b) {
  if (b.M == 1) {
    for (int64_t n = b.n_begin; n < b.n_end; ++n) {
      float out;
      dot_rows<1, Rows>(b.w + n * b.w_stride, b.K, b.x, b.x_stride, &out);
      store_outputs(b, 0, 1, n, &out);
    }
    return;
  }
  float* buf = t_rows.get(2 * b.K);
  auto dequantize_into = [&b](int64_t n, float* dst) {
    Rows::row(b.w + n * b.w_stride, b.K, [dst](int64_t k, __m512 lo, __m512 hi) {
      _mm512_storeu_ps(dst + k, lo);
      _mm512_storeu_ps(dst + k + 16, hi);
    });
  };
  for (int64_t n = b.n_begin; n < b.n_end; n += 2) {
    const bool pair = n + 1 < b.n_end;
    dequantize_into(n, buf);
    if (pair) dequantize_into(n + 1, buf + b.K);
    for (int64_t m = 0; m < b.M;) {
      const int64_t left = b.M - m;
      const int mb = left >= 4 ? 4 : left >= 2 ? 2 : 1;
      float out0[4], out1[4];
      const float* xm = b.x + m * b.x_stride;
      if (pair) {
        dot_group2(mb, buf, buf + b.K, b.K, xm, b.x_stride, out0, out1);
        store_outputs(b, m, mb, n + 1, out1);
      } else {
        dot_group<BufferRows>(mb, buf, b.K, xm, b.x_stride, out0);
      }
      store_outputs(b, m, mb, n, out0);
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
#define SPECDEC_LINEAR_ROWS(Rows) linear_rows<Rows>(b)
  SPECDEC_QUANT_FLOAT_DISPATCH(b.fmt, SPECDEC_LINEAR_ROWS)
#undef SPECDEC_LINEAR_ROWS
}

void quant_dequantize_row_avx512(QuantFmt fmt, const uint8_t* row, int64_t K, float* out) {
#define SPECDEC_DEQUANTIZE_ROW(Rows) dequantize_row<Rows>(row, K, out)
  SPECDEC_QUANT_FLOAT_DISPATCH(fmt, SPECDEC_DEQUANTIZE_ROW)
#undef SPECDEC_DEQUANTIZE_ROW
}

}  // namespace specdec
