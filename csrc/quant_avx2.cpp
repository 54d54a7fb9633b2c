// AVX2 + FMA + F16C kernels of quant_linear / quant_dequantize (see quant_isa.h): the AVX-512
// kernel's scheme on 8 lanes. Every 32-weight sub-block is dequantized in registers into four
// 8-lane fp32 vectors (exactly the file's values) and multiplied into up to 4 rows of x at once;
// with more than 4 rows of x the row is dequantized once into an L1 buffer and re-read, feeding
// the same values into the same FMA sequence (batch invariance). No std:: containers here (see
// csrc/README.md).
#include <immintrin.h>

#include <cstring>

#include "isa_util.h"
#include "quant_isa.h"
#include "quant_k_rows.h"

namespace specdec {
namespace {

inline float load_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

// 8 bytes -> 8 int32 lanes, zero- or sign-extended.
inline __m256i bytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i sbytes8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 to_f32(__m256i v) { return _mm256_cvtepi32_ps(v); }

// Lanes j of (bits >> j) & 1, shifted to bit 4: the fifth bit of 8 consecutive weights.
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i shifts = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i one = _mm256_set1_epi32(1);
  return _mm256_slli_epi32(
      _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(bits)), shifts), one),
      4);
}

// Each format's row walker calls f(k, w0, w1, w2, w3) for the weights [k + 8i, k + 8i + 8) of a
// row of K weights, in increasing k (steps of 32).
struct Q4_0Rows {
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    const __m256i nib = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    for (int64_t k = 0; k < K; k += 32, p += 18) {
      const __m256 d = _mm256_set1_ps(load_f16(p));
      const __m256i a = bytes8(p + 2), b = bytes8(p + 10);
      auto w = [&](__m256i q) { return _mm256_mul_ps(to_f32(_mm256_sub_epi32(q, eight)), d); };
      f(k, w(_mm256_and_si256(a, nib)), w(_mm256_and_si256(b, nib)), w(_mm256_srli_epi32(a, 4)),
        w(_mm256_srli_epi32(b, 4)));
    }
  }
};

struct Q4_1Rows {
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    const __m256i nib = _mm256_set1_epi32(15);
    for (int64_t k = 0; k < K; k += 32, p += 20) {
      const __m256 d = _mm256_set1_ps(load_f16(p)), m = _mm256_set1_ps(load_f16(p + 2));
      const __m256i a = bytes8(p + 4), b = bytes8(p + 12);
      // d * q is exact: the fused multiply-add rounds d * q + m once, as the file's fp32 does.
      auto w = [&](__m256i q) { return _mm256_fmadd_ps(to_f32(q), d, m); };
      f(k, w(_mm256_and_si256(a, nib)), w(_mm256_and_si256(b, nib)), w(_mm256_srli_epi32(a, 4)),
        w(_mm256_srli_epi32(b, 4)));
    }
  }
};

struct Q5_0Rows {
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    const __m256i nib = _mm256_set1_epi32(15), sixteen = _mm256_set1_epi32(16);
    for (int64_t k = 0; k < K; k += 32, p += 22) {
      const __m256 d = _mm256_set1_ps(load_f16(p));
      uint32_t qh;
      std::memcpy(&qh, p + 2, 4);
      const __m256i a = bytes8(p + 6), b = bytes8(p + 14);
      auto w = [&](__m256i q, int first) {
        q = _mm256_or_si256(q, fifth_bits(qh >> first));
        return _mm256_mul_ps(to_f32(_mm256_sub_epi32(q, sixteen)), d);
      };
      f(k, w(_mm256_and_si256(a, nib), 0), w(_mm256_and_si256(b, nib), 8),
        w(_mm256_srli_epi32(a, 4), 16), w(_mm256_srli_epi32(b, 4), 24));
    }
  }
};

// Q5_1: d * q + m with the fifth bit; d * q exact, so the fused multiply-add rounds once.
struct Q5_1Rows {
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    const __m256i nib = _mm256_set1_epi32(15);
    for (int64_t k = 0; k < K; k += 32, p += 24) {
      const __m256 d = _mm256_set1_ps(load_f16(p)), m = _mm256_set1_ps(load_f16(p + 2));
      uint32_t qh;
      std::memcpy(&qh, p + 4, 4);
      const __m256i a = bytes8(p + 8), b = bytes8(p + 16);
      auto w = [&](__m256i q, int first) {
        q = _mm256_or_si256(q, fifth_bits(qh >> first));
        return _mm256_fmadd_ps(to_f32(q), d, m);
      };
      f(k, w(_mm256_and_si256(a, nib), 0), w(_mm256_and_si256(b, nib), 8),
        w(_mm256_srli_epi32(a, 4), 16), w(_mm256_srli_epi32(b, 4), 24));
    }
  }
};

struct Q8_0Rows {
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    for (int64_t k = 0; k < K; k += 32, p += 34) {
      const __m256 d = _mm256_set1_ps(load_f16(p));
      auto w = [&](int i) { return _mm256_mul_ps(to_f32(sbytes8(p + 2 + 8 * i)), d); };
      f(k, w(0), w(1), w(2), w(3));
    }
  }
};

// Q4_K and Q5_K: sub-block s is (d * sc[s]) * q - dmin * mn[s]; both products are exact, so one
// fused multiply-add rounds the difference once, as the file's fp32.
template <bool kFifthBit>
struct QK45Rows {
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    const __m256i nib = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
    const int64_t block_bytes = kFifthBit ? 176 : 144;
    for (int64_t k = 0; k < K; k += 256, p += block_bytes) {
      const float d = load_f16(p), dmin = load_f16(p + 2);
      const uint8_t* scales = p + 4;
      const uint8_t* qs = p + (kFifthBit ? 48 : 16);
      for (int j = 0; j < 4; ++j) {
        __m256i v[4];
        for (int i = 0; i < 4; ++i) v[i] = bytes8(qs + 32 * j + 8 * i);
        for (int half = 0; half < 2; ++half) {
          const int s = 2 * j + half;
          int sc, mn;
          k_scale_min(scales, s, &sc, &mn);
          const __m256 ds = _mm256_set1_ps(d * static_cast<float>(sc));
          const __m256 neg_dm = _mm256_set1_ps(-(dmin * static_cast<float>(mn)));
          const __m128i shift = _mm_cvtsi32_si128(s);
          __m256 w[4];
          for (int i = 0; i < 4; ++i) {
            __m256i q = half ? _mm256_srli_epi32(v[i], 4) : _mm256_and_si256(v[i], nib);
            if (kFifthBit) {
              const __m256i h = bytes8(p + 16 + 8 * i);
              q = _mm256_or_si256(
                  q, _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, shift), one), 4));
            }
            w[i] = _mm256_fmadd_ps(to_f32(q), ds, neg_dm);
          }
          f(k + 32 * s, w[0], w[1], w[2], w[3]);
        }
      }
    }
  }
};

// Q6_K: the 6-bit quant minus 32 is assembled at byte level (32 weights per op), then
// sign-extended; (d * sc) * (q - 32) is exact and keeps the file's sign of zero.
struct Q6_KRows {
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    const __m256i nib = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
    const __m256i thirty_two = _mm256_set1_epi8(32);
    for (int64_t k = 0; k < K; k += 256, p += 210) {
      const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
      const float d = load_f16(p + 208);
      for (int g = 0; g < 8; ++g) {
        const int h = g / 4, t = g % 4;
        const __m256i lbits =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32 * (t % 2)));
        const __m256i hbits =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
        const __m256i lo =
            _mm256_and_si256(_mm256_srl_epi16(lbits, _mm_cvtsi32_si128(4 * (t / 2))), nib);
        const __m256i hi =
            _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * t)), three);
        const __m256i q =
            _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), thirty_two);
        const __m128i q_lo = _mm256_castsi256_si128(q), q_hi = _mm256_extracti128_si256(q, 1);
        const __m256 s0 = _mm256_set1_ps(d * static_cast<float>(scales[2 * g]));
        const __m256 s1 = _mm256_set1_ps(d * static_cast<float>(scales[2 * g + 1]));
        f(k + 32 * g, _mm256_mul_ps(to_f32(_mm256_cvtepi8_epi32(q_lo)), s0),
          _mm256_mul_ps(to_f32(_mm256_cvtepi8_epi32(_mm_srli_si128(q_lo, 8))), s0),
          _mm256_mul_ps(to_f32(_mm256_cvtepi8_epi32(q_hi)), s1),
          _mm256_mul_ps(to_f32(_mm256_cvtepi8_epi32(_mm_srli_si128(q_hi, 8))), s1));
      }
    }
  }
};

// A row already dequantized into an fp32 buffer, walked like a quantized one.
struct BufferRows {
  template <class F>
  static void row(const float* p, int64_t K, F&& f) {
    for (int64_t k = 0; k < K; k += 32) {
      f(k, _mm256_loadu_ps(p + k), _mm256_loadu_ps(p + k + 8), _mm256_loadu_ps(p + k + 16),
        _mm256_loadu_ps(p + k + 24));
    }
  }
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[m] = dot(row, x[m]) for MB rows of x: two accumulators per row of x, summed and reduced in
// a fixed order at the end; the operations on one x row never depend on MB.
template <int MB, class Rows, class Src>
inline void dot_rows(const Src* row, int64_t K, const float* x, int64_t xs, float* out) {
  __m256 a0[MB], a1[MB];
  for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
  Rows::row(row, K, [&](int64_t k, __m256 w0, __m256 w1, __m256 w2, __m256 w3) {
    for (int m = 0; m < MB; ++m) {
      const float* xm = x + m * xs + k;
      a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), a0[m]);
      a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), a1[m]);
      a0[m] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xm + 16), a0[m]);
      a1[m] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xm + 24), a1[m]);
    }
  });
  for (int m = 0; m < MB; ++m) out[m] = hsum(_mm256_add_ps(a0[m], a1[m]));
}

template <class Rows, class Src>
inline void dot_group(int mb, const Src* row, int64_t K, const float* x, int64_t xs, float* out) {
  switch (mb) {
    case 4: dot_rows<4, Rows>(row, K, x, xs, out); break;
    case 2: dot_rows<2, Rows>(row, K, x, xs, out); break;
    default: dot_rows<1, Rows>(row, K, x, xs, out); break;
  }
}

constexpr int64_t kFusedMaxRows = 4;
thread_local ScratchBuffer t_row;

template <class Rows>
void linear_rows(const QuantLinearBlock& b) {
  const bool buffered = b.M > kFusedMaxRows;
  float* buf = buffered ? t_row.get(b.K) : nullptr;
  for (int64_t n = b.n_begin; n < b.n_end; ++n) {
    const uint8_t* row = b.w + n * b.w_stride;
    if (buffered) {
      Rows::row(row, b.K, [buf](int64_t k, __m256 w0, __m256 w1, __m256 w2, __m256 w3) {
        _mm256_storeu_ps(buf + k, w0);
        _mm256_storeu_ps(buf + k + 8, w1);
        _mm256_storeu_ps(buf + k + 16, w2);
        _mm256_storeu_ps(buf + k + 24, w3);
      });
    }
    for (int64_t m = 0; m < b.M;) {
      const int64_t left = b.M - m;
      const int mb = left >= 4 ? 4 : left >= 2 ? 2 : 1;
      float out[4];
      const float* xm = b.x + m * b.x_stride;
      if (buffered)
        dot_group<BufferRows>(mb, buf, b.K, xm, b.x_stride, out);
      else
        dot_group<Rows>(mb, row, b.K, xm, b.x_stride, out);
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
  Rows::row(row, K, [out](int64_t k, __m256 w0, __m256 w1, __m256 w2, __m256 w3) {
    _mm256_storeu_ps(out + k, w0);
    _mm256_storeu_ps(out + k + 8, w1);
    _mm256_storeu_ps(out + k + 16, w2);
    _mm256_storeu_ps(out + k + 24, w3);
  });
}

}  // namespace

void quant_linear_avx2(const QuantLinearBlock& b) {
#define SPECDEC_LINEAR_ROWS(Rows) linear_rows<Rows>(b)
  SPECDEC_QUANT_FLOAT_DISPATCH(b.fmt, SPECDEC_LINEAR_ROWS)
#undef SPECDEC_LINEAR_ROWS
}

void quant_dequantize_row_avx2(QuantFmt fmt, const uint8_t* row, int64_t K, float* out) {
#define SPECDEC_DEQUANTIZE_ROW(Rows) dequantize_row<Rows>(row, K, out)
  SPECDEC_QUANT_FLOAT_DISPATCH(fmt, SPECDEC_DEQUANTIZE_ROW)
#undef SPECDEC_DEQUANTIZE_ROW
}

// ---- INT8 activations, K formats (Q4_K, Q5_K, Q6_K; quant_isa.h has the definition) ----
// The AVX-512 VNNI kernel's scheme on 256-bit vectors without VNNI: per 32 weights and row of
// x, vpmaddubsw multiplies the weight bytes into the quants as 16 int16 pairs and vpmaddwd
// multiplies the pairs by the sub-block's integer scale into int32 lanes; per 256 weights the
// lanes are converted and scaled once. One row of x: each weight block is decoded in
// registers; several rows: a weight row is decoded once into a per-thread buffer and multiplied
// into up to 4 rows of x. A (x row, weight row) pair sees the same operations whatever the
// number of rows: batch invariance. (The 32-weight formats have no AVX2 INT8 kernel: the
// portable loops run them.)
namespace {

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

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
      const __m256i lo =
          _mm256_and_si256(_mm256_srli_epi16(load32(p + 64 * h + 32 * (t % 2)), 4 * (t / 2)), nib);
      const __m256i hi =
          _mm256_and_si256(_mm256_srli_epi16(load32(p + 128 + 32 * h), 2 * t), three);
      w.u[g] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
      // int16 lanes 0-7 (weights 0-15) take scale 2g, lanes 8-15 scale 2g + 1.
      w.sc[g] = _mm256_setr_m128i(_mm_set1_epi16(scales[2 * g]), _mm_set1_epi16(scales[2 * g + 1]));
    }
    const __m256i s16 =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
    w.corr = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(s16, 5));  // -32 * sc
    w.mins = _mm256_setzero_ps();
    w.d = load_f16(p + 208);
  }
};

// acc + block b of x row m times the decoded weight block w: the exact integer block sum, then
// acc += I * (d * d_x) and, for Q4_K / Q5_K, acc += (-dmin * mn) * (d_x * sum q) per sub-block.
template <class Dec>
inline __m256 block_dot(const KBlock2& w, const XRow& x, int64_t b, __m256 acc) {
  const int8_t* q = x.q + 256 * b;
  __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
  for (int s = 0; s < 8; s += 2) {
    i0 = _mm256_add_epi32(
        i0, _mm256_madd_epi16(_mm256_maddubs_epi16(w.u[s], load32(q + 32 * s)), w.sc[s]));
    i1 = _mm256_add_epi32(
        i1,
        _mm256_madd_epi16(_mm256_maddubs_epi16(w.u[s + 1], load32(q + 32 * s + 32)), w.sc[s + 1]));
  }
  __m256i isum = _mm256_add_epi32(i0, i1);
  if (!Dec::kMins)
    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(load32(x.bsum16 + 16 * b), w.corr));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(w.d * x.d[b]), acc);
  if (Dec::kMins) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x.d_bsum32 + 8 * b), w.mins, acc);
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

// The vector policy of quant_k_rows.h: 8 fp32 lanes.
struct KVec256 {
  using Block = KBlock2;
  using Acc = __m256;
  static Acc zero() { return _mm256_setzero_ps(); }
  static float reduce(Acc acc) { return reduce8(acc); }
  template <class Dec>
  static Acc dot(const Block& w, const XRow& x, int64_t b, Acc acc) {
    return block_dot<Dec>(w, x, b, acc);
  }
};

}  // namespace

void quant_linear_int8k_avx2(const QuantLinearInt8Block& b) {
  switch (b.fmt) {
    case QuantFmt::Q4_K: k_linear_rows<KVec256, KDecode45<false>>(b, t_kblocks); break;
    case QuantFmt::Q5_K: k_linear_rows<KVec256, KDecode45<true>>(b, t_kblocks); break;
    case QuantFmt::Q6_K: k_linear_rows<KVec256, KDecode6>(b, t_kblocks); break;
    default: break;  // 32-weight formats never reach this kernel (quant.cpp's int8 path)
  }
}

}  // namespace specdec
