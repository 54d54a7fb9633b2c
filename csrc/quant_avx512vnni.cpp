// AVX-512 VNNI kernels of quant_linear with INT8 activations (quant_isa.h has the definition).
// Built with -mavx512vnni and called only when cpu_has_avx512_vnni(): an AVX-512 CPU without
// VNNI (Skylake-X) never reaches this file. One row of x (decode): each weight row is decoded in
// registers and consumed at once; several rows: weight rows are decoded into a per-thread buffer
// and multiplied into up to 4 rows of x at a time.
// 32-weight formats (32-value activation blocks): every 64 weights become 64 unsigned bytes (the
// stored quant, plus the format's offset for the signed ones), one vpdpbusd per row of x
// multiplies them into the row's 64 int8 quants (16 int32 lanes of 4 products, started at
// -offset * the lane's quant sum, so each lane holds its exact integer dot), and the lanes are
// scaled into fp32 lane accumulators (4 vector ops per x row and 64 weights).
// K formats (256-value activation blocks, as ggml's Q8_K): vpmaddubsw multiplies 64 weight
// bytes into the quants as 32 int16 pairs, vpdpwssd multiplies the pairs by their integer
// sub-block scales into int32 lanes, and only once per 256 weights are the lanes converted and
// scaled (2 vector ops per x row and 64 weights, plus 2-3 per 256).
// A (x row, weight row) pair sees the same operations whatever the number of rows: batch
// invariance.
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
  return _cvtsh_ss(h);
}

// 8 lanes of a, then 8 lanes of b.
inline __m512 halves(float a, float b) {
  return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

// The fp16 pairs at a and b (d and m of two blocks) as fp32 lanes: [a0, a1, b0, b1] in the low
// 128 bits; the per-lane picks below spread them over lanes 0-7 (block a) and 8-15 (block b).
inline __m512 f16_pairs(const uint8_t* a, const uint8_t* b) {
  int32_t va, vb;
  std::memcpy(&va, a, 4);
  std::memcpy(&vb, b, 4);
  return _mm512_castps128_ps512(_mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(va), vb, 1)));
}

// A zero block stands in for the missing partner of the last block of an odd count of 32-weight
// blocks: scale 0, and its weights meet the zero padding of x's quants.
alignas(64) const uint8_t kZeroBlock[64] = {};

// Byte shifts per 128-bit lane for nibbles2 (lanes 1 and 3: 4) and per 256-bit half for the K
// formats' 32-byte nibble arrays (upper half: 4), as 16-bit lanes (vpsrlvw).
inline __m512i odd_lane_shift4() {
  return _mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFF00FF00u, 4);
}
inline __m512i upper_half_shift4() {
  return _mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFFFF0000u, 4);
}

// The 32 nibbles of each of two 16-byte arrays as [lo(a) hi(a) lo(b) hi(b)] bytes: weight j of a
// block is nibble j / 16 of byte j % 16. Two broadcast loads, one shift, one mask.
inline __m512i nibbles2(const uint8_t* a, const uint8_t* b) {
  __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
  v = _mm512_mask_broadcast_i32x4(v, 0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  return _mm512_and_si512(_mm512_srlv_epi16(v, odd_lane_shift4()), _mm512_set1_epi8(15));
}

// Each format's walker calls f(k, u, scale, min) for the weights [k, k + 64): u their unsigned
// bytes, scale / min the fp32 weight scale / min of each int32 lane (4 weights).
// 32-weight-block formats: blocks in pairs.
template <QuantFmt kFmt>
struct SmallBlocks {
  static constexpr int64_t kBytes = kFmt == QuantFmt::Q4_0   ? 18
                                    : kFmt == QuantFmt::Q4_1 ? 20
                                    : kFmt == QuantFmt::Q5_0 ? 22
                                    : kFmt == QuantFmt::Q5_1 ? 24
                                                             : 34;
  static constexpr bool kHasMin = kFmt == QuantFmt::Q4_1 || kFmt == QuantFmt::Q5_1;
  template <class F>
  static void row(const uint8_t* p, int64_t K, F&& f) {
    const __m512i pick_d = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i pick_m = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
    for (int64_t k = 0; k < K; k += 64, p += 2 * kBytes) {
      const uint8_t* a = p;
      const uint8_t* b = k + 32 < K ? p + kBytes : kZeroBlock;
      // d (and m) of both blocks in one conversion (Q8_0 / Q4_0 / Q5_0 read the next field's
      // bytes as the unused half: every block is at least 18 bytes long).
      const __m512 fields = f16_pairs(a, b);
      const __m512 scale = _mm512_permutexvar_ps(pick_d, fields);
      __m512 mn = _mm512_setzero_ps();
      __m512i u;
      if (kFmt == QuantFmt::Q8_0) {
        const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2));
        const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
        u = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1),
                             _mm512_set1_epi8(static_cast<char>(0x80)));  // q + 128
      } else if (kFmt == QuantFmt::Q5_0 || kFmt == QuantFmt::Q5_1) {
        const int qh_at = kFmt == QuantFmt::Q5_0 ? 2 : 4;
        u = nibbles2(a + qh_at + 4, b + qh_at + 4);
        uint32_t ha, hb;
        std::memcpy(&ha, a + qh_at, 4);
        std::memcpy(&hb, b + qh_at, 4);
        const __mmask64 fifth = static_cast<__mmask64>(ha) | static_cast<__mmask64>(hb) << 32;
        u = _mm512_mask_add_epi8(u, fifth, u, _mm512_set1_epi8(16));
        if (kFmt == QuantFmt::Q5_1) mn = _mm512_permutexvar_ps(pick_m, fields);
      } else if (kFmt == QuantFmt::Q4_1) {
        u = nibbles2(a + 4, b + 4);
        mn = _mm512_permutexvar_ps(pick_m, fields);
      } else {
        u = nibbles2(a + 2, b + 2);
      }
      f(k, u, scale, mn);
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
      const __m512i start =
          kOffset ? _mm512_loadu_si512(neg + i * lanes + k / 4) : _mm512_setzero_si512();
      const __m512i dot = _mm512_dpbusd_epi32(start, u, qx);
      const __m512 s = _mm512_mul_ps(scale, _mm512_loadu_ps(d + i * lanes + k / 4));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[i]);
      if (Rows::kHasMin)
        acc_min[i] = _mm512_fmadd_ps(_mm512_loadu_ps(d_sum + i * lanes + k / 4), mn, acc_min[i]);
    }
  });
  for (int i = 0; i < MB; ++i) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], acc_min[i]));
}

// A weight row's 64-weight steps as the walker produces them, kept for several rows of x.
struct Step {
  __m512i u;
  __m512 scale, mn;
};

// out[j * 4 + i] = weight row w[j] . x[m0 + i] for MB rows of x and NB weight rows, from decoded
// steps: each load of x feeds all NB weight rows, each step of a weight row all MB rows of x.
// The operations on one (x row, weight row) pair are exactly those of dot_rows (same values,
// accumulators, order and reduction): batch invariance.
template <int MB, int NB, bool kHasMin, bool kOffset>
inline void dot_rows_n(const Step* const* w, const QuantizedX& X, int64_t m0, float* out) {
  const int64_t lanes = X.Kp / 4;
  __m512 acc[NB][MB], mins[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < MB; ++i) acc[j][i] = mins[j][i] = _mm512_setzero_ps();
  const int8_t* q = X.q + m0 * X.Kp;
  const float* d = X.d + m0 * lanes;
  const float* d_sum = X.d_sum + m0 * lanes;
  const int32_t* neg = X.neg_offset_sum + m0 * lanes;
  const auto step = [&](int64_t k, int64_t c) {
    for (int i = 0; i < MB; ++i) {
      const __m512i qx = _mm512_loadu_si512(q + i * X.Kp + k);
      const __m512i start =
          kOffset ? _mm512_loadu_si512(neg + i * lanes + k / 4) : _mm512_setzero_si512();
      const __m512 dx = _mm512_loadu_ps(d + i * lanes + k / 4);
      for (int j = 0; j < NB; ++j)
        acc[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, w[j][c].u, qx)),
                                    _mm512_mul_ps(w[j][c].scale, dx), acc[j][i]);
      if (kHasMin) {
        const __m512 ds = _mm512_loadu_ps(d_sum + i * lanes + k / 4);
        for (int j = 0; j < NB; ++j) mins[j][i] = _mm512_fmadd_ps(ds, w[j][c].mn, mins[j][i]);
      }
    }
  };
  for (int64_t k = 0, c = 0; k < X.K; k += 64, ++c) step(k, c);
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < MB; ++i)
      out[j * 4 + i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][i], mins[j][i]));
}

thread_local AlignedBuffer<Step> t_steps;

inline void store_outputs(const QuantLinearInt8Block& b, int64_t m, int mb, int64_t n,
                          const float* out) {
  for (int i = 0; i < mb; ++i) {
    float v = out[i];
    if (b.bias) v += b.bias[n];
    b.y[(m + i) * b.y_stride + n] = v;
  }
}

// One row of x (decode): each weight row is decoded in registers and consumed at once. Several
// rows (verify, prefill): NB weight rows are decoded into a per-thread buffer, then multiplied
// into 4 rows of x at a time (dot_rows_n). Both give the same bits per output. The pass is bound
// by the 4 vector ops per (x row, weight row, 64 weights) (vpdpbusd, convert, scale multiply,
// FMA), not by memory: NB = 4 only spares loads of x (Q6_K / Q8_0 M = 8: -20%).
template <class Rows, bool kOffset>
void linear_rows(const QuantLinearInt8Block& b) {
  if (b.x.M == 1) {
    for (int64_t n = b.n_begin; n < b.n_end; ++n) {
      float out;
      dot_rows<1, Rows, kOffset>(b.w + n * b.w_stride, b.x, 0, &out);
      store_outputs(b, 0, 1, n, &out);
    }
    return;
  }
  // NB weight rows decoded per pass: 4 where the registers allow (no min accumulators), else 2.
  constexpr int NB = Rows::kHasMin ? 2 : 4;
  const int64_t steps = b.x.Kp / 64;
  Step* buf = t_steps.get(NB * steps);
  auto decode_into = [&b](int64_t n, Step* dst) {
    Rows::row(b.w + n * b.w_stride, b.x.K, [dst](int64_t k, __m512i u, __m512 scale, __m512 mn) {
      dst[k / 64] = Step{u, scale, mn};
    });
  };
  for (int64_t n = b.n_begin; n < b.n_end; n += NB) {
    const int nw = b.n_end - n < NB ? static_cast<int>(b.n_end - n) : NB;
    // Missing rows of the last group run against a copy of the first (their results dropped).
    const Step* rows[NB];
    for (int j = 0; j < NB; ++j) {
      rows[j] = j < nw ? buf + j * steps : buf;
      if (j < nw) decode_into(n + j, buf + j * steps);
    }
    // The next group's weight bytes into L2 while this group's dot products run: a weight
    // stream from memory (the LM head) then overlaps its latency with the compute.
    if (n + 2 * NB <= b.n_end) {
      const char* next = reinterpret_cast<const char*>(b.w + (n + NB) * b.w_stride);
      for (int64_t off = 0; off < NB * b.w_stride; off += 64) _mm_prefetch(next + off, _MM_HINT_T1);
    }
    for (int64_t m = 0; m < b.x.M;) {
      const int64_t left = b.x.M - m;
      const int mb = left >= 4 ? 4 : left >= 2 ? 2 : 1;
      float out[NB * 4];
      switch (mb) {
        case 4: dot_rows_n<4, NB, Rows::kHasMin, kOffset>(rows, b.x, m, out); break;
        case 2: dot_rows_n<2, NB, Rows::kHasMin, kOffset>(rows, b.x, m, out); break;
        default: dot_rows_n<1, NB, Rows::kHasMin, kOffset>(rows, b.x, m, out); break;
      }
      for (int j = 0; j < nw; ++j) store_outputs(b, m, mb, n + j, out + 4 * j);
      m += mb;
    }
  }
}

// ---- K formats (Q4_K, Q5_K, Q6_K) against 256-value activation blocks ----
// A weight block decoded for the integer dot: its 256 weights as 4 steps of 64 unsigned bytes in
// natural order (u), the int16 sub-block scale of each vpmaddubsw pair of a step (sc), the
// block's d, and per format -dmin * mn of the 8 sub-blocks in lanes 0-7 (Q4_K / Q5_K: mins,
// lanes 8-15 zero) or -32 * sc of the 16 groups as int16 (Q6_K: corr, the offset of u - 32).
struct KBlock {
  __m512i u[4], sc[4];
  __m512 mins;
  __m256i corr;
  float d;
};

// Step j's int16 lanes 0-15 take sub-block 2j's scale, lanes 16-31 sub-block 2j + 1's, from
// the int16 at 2s (the low half of int32 lane s) of the unpacked scales.
inline __m512i k45_scale_index(int j) {
  return _mm512_mask_set1_epi16(_mm512_set1_epi16(static_cast<short>(4 * j)), 0xFFFF0000u,
                                static_cast<short>(4 * j + 2));
}

template <bool kFifthBit>
struct KDecode45 {
  static constexpr bool kMins = true;
  static constexpr int64_t kBytes = kFifthBit ? 176 : 144;
  static inline void block(const uint8_t* p, KBlock& w) {
    // Scale s < 4: byte s & 63; s >= 4: (byte s + 4 & 15) | (byte s - 4 >> 6) << 4.
    // Min s < 4: byte s + 4 & 63; s >= 4: (byte s + 4 >> 4) | (byte s >> 6) << 4.
    // (k_scale_min's formula in vector lanes: scales in int32 lanes 0-7, mins in 8-15.)
    const __m512i a_index = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
    const __m512i c_index = _mm512_setr_epi32(0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7);
    const __m512i a_shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4);
    const __m512i a_mask =
        _mm512_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
    const __m512i c_mask =
        _mm512_setr_epi32(0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48);
    const __m512i mins_index =
        _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i b =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4)));
    const __m512i a = _mm512_permutexvar_epi32(a_index, b),
                  c = _mm512_permutexvar_epi32(c_index, b);
    const __m512i six_bit = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(a, a_shift), a_mask),
                                            _mm512_and_si512(_mm512_srli_epi32(c, 2), c_mask));
    w.d = load_f16(p);
    // -dmin * mn, exact (an fp16 times a 6-bit integer).
    w.mins = _mm512_maskz_permutexvar_ps(
        0x00FF, mins_index,
        _mm512_mul_ps(_mm512_cvtepi32_ps(six_bit), _mm512_set1_ps(-load_f16(p + 2))));
    const uint8_t* qs = p + (kFifthBit ? 48 : 16);
    __m256i qh = _mm256_setzero_si256();
    if (kFifthBit) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    const __m512i nib = _mm512_set1_epi8(15), high_shift = upper_half_shift4();
    for (int j = 0; j < 4; ++j) {
      // Sub-blocks 2j and 2j + 1 are the low and high nibbles of the same 32 bytes: the bytes
      // in both halves, the upper half shifted by 4.
      const __m512i v =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j)));
      __m512i u = _mm512_and_si512(_mm512_srlv_epi16(v, high_shift), nib);
      if (kFifthBit) {
        const __mmask32 lo =
            _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * j))));
        const __mmask32 hi =
            _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * j + 1))));
        const __mmask64 fifth = static_cast<__mmask64>(lo) | static_cast<__mmask64>(hi) << 32;
        u = _mm512_mask_add_epi8(u, fifth, u, _mm512_set1_epi8(16));
      }
      w.u[j] = u;
      w.sc[j] = _mm512_permutexvar_epi16(k45_scale_index(j), six_bit);
    }
  }
};

// Q6_K: groups 2i and 2i + 1 (64 weights) share their high bits' bytes; u = the 6-bit quant
// (0..63, wq = u - 32) assembled at byte level; one int8 scale per 16 weights.
alignas(64) const int16_t kGroupOfPair[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                              2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
struct KDecode6 {
  static constexpr bool kMins = false;
  static constexpr int64_t kBytes = 210;
  static inline void block(const uint8_t* p, KBlock& w) {
    const __m512i nib = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3);
    // High-bit shifts of groups (t, t + 1) in the two halves: 2t and 2t + 2, for t = 0 and 2.
    const __m512i high_shift[2] = {_mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFFFF0000u, 2),
                                   _mm512_mask_set1_epi16(_mm512_set1_epi16(4), 0xFFFF0000u, 6)};
    const uint8_t* ql = p;
    const uint8_t* qh = p + 128;
    const __m256i s16 =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
    w.d = load_f16(p + 208);
    w.mins = _mm512_setzero_ps();
    w.corr = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(s16, 5));  // -32 * sc
    for (int i = 0; i < 4; ++i) {
      const int h = i / 2, t = 2 * (i % 2);  // groups 2i, 2i + 1 are t, t + 1 of half h
      // Low bits: the 64 bytes of ql half h (group t from the first 32, t + 1 from the next),
      // nibble t / 2; high bits: the 32 bytes of qh half h in both halves, bits 2t / 2t + 2.
      const __m512i lbits = _mm512_loadu_si512(ql + 64 * h);
      const __m512i hbits =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h)));
      const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(lbits, 2 * t), nib);
      const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(hbits, high_shift[i % 2]), three);
      w.u[i] = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
      // int16 lane l of step i (weights 2l, 2l + 1) takes scale 4i + l / 8.
      const __m512i index = _mm512_add_epi16(_mm512_set1_epi16(static_cast<short>(4 * i)),
                                             _mm512_load_si512(kGroupOfPair));
      w.sc[i] = _mm512_permutexvar_epi16(index, _mm512_castsi256_si512(s16));
    }
  }
};

// acc + block b of x row x times the decoded weight block w (quant_isa.h's K definition): the
// integer block sum I (vpmaddubsw: u * q pairs, no saturation since u < 64; vpdpwssd: times the
// pair's sub-block scale, into int32), then acc += I * (d * d_x) and, for Q4_K / Q5_K,
// acc += (-dmin * mn) * (d_x * sum q) per sub-block. The one float sequence of a (x row,
// weight row) pair, whatever the number of rows: batch invariance.
template <class Dec>
inline __m512 block_dot(const KBlock& w, const XRow& x, int64_t b, __m512 acc) {
  const int8_t* q = x.q + 256 * b;
  const __m512i zero = _mm512_setzero_si512();
  __m512i i0 =
      _mm512_dpwssd_epi32(zero, _mm512_maddubs_epi16(w.u[0], _mm512_loadu_si512(q)), w.sc[0]);
  __m512i i1 =
      _mm512_dpwssd_epi32(zero, _mm512_maddubs_epi16(w.u[1], _mm512_loadu_si512(q + 64)), w.sc[1]);
  i0 = _mm512_dpwssd_epi32(i0, _mm512_maddubs_epi16(w.u[2], _mm512_loadu_si512(q + 128)), w.sc[2]);
  i1 = _mm512_dpwssd_epi32(i1, _mm512_maddubs_epi16(w.u[3], _mm512_loadu_si512(q + 192)), w.sc[3]);
  __m512i isum = _mm512_add_epi32(i0, i1);
  if (!Dec::kMins) {
    const __m256i bsum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsum16 + 16 * b));
    isum = _mm512_add_epi32(isum, _mm512_zextsi256_si512(_mm256_madd_epi16(bsum, w.corr)));
  }
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(w.d * x.d[b]), acc);
  if (Dec::kMins)
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(0x00FF, x.d_bsum32 + 8 * b), w.mins, acc);
  return acc;
}

thread_local AlignedBuffer<KBlock> t_kblocks;

// The vector policy of quant_k_rows.h: 16 fp32 lanes.
struct KVec512 {
  using Block = KBlock;
  using Acc = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  static float reduce(Acc acc) { return _mm512_reduce_add_ps(acc); }
  template <class Dec>
  static Acc dot(const Block& w, const XRow& x, int64_t b, Acc acc) {
    return block_dot<Dec>(w, x, b, acc);
  }
};

}  // namespace

void quant_quantize_xk_avx512vnni(const float* x, int64_t K, int8_t* q, float* d, float* d_bsum32,
                                  int16_t* bsum16, int16_t* bsum32, int64_t m_begin,
                                  int64_t m_end) {
  const __m512 zero = _mm512_setzero_ps(), lim = _mm512_set1_ps(127.0f);
  for (int64_t m = m_begin; m < m_end; ++m) {
    for (int64_t k = 0; k < K; k += 256) {
      const float* xb = x + m * K + k;
      __m512 amax = zero;
      for (int t = 0; t < 16; ++t)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xb + 16 * t)));
      const float dk = _mm512_reduce_max_ps(amax) / 127.0f;
      d[m * (K / 256) + k / 256] = dk;
      // d == 0 only when every |x| < 127 * 2^-149: dividing by 1 gives quants 0 as well.
      const __m512 div = _mm512_set1_ps(dk == 0.0f ? 1.0f : dk);
      int16_t* sums = bsum16 + m * (K / 16) + k / 16;
      for (int t = 0; t < 16; ++t) {
        const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(xb + 16 * t), div),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i i =
            _mm512_cvttps_epi32(_mm512_min_ps(lim, _mm512_max_ps(_mm512_sub_ps(zero, lim), r)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * K + k + 16 * t),
                         _mm512_cvtsepi32_epi8(i));
        sums[t] = static_cast<int16_t>(_mm512_reduce_add_epi32(i));
      }
      // 32-quant sums (exact integers) times d: one rounding, as the portable quantizer.
      for (int s = 0; s < 8; ++s) {
        const int sum = sums[2 * s] + sums[2 * s + 1];
        bsum32[m * (K / 32) + k / 32 + s] = static_cast<int16_t>(sum);
        d_bsum32[m * (K / 32) + k / 32 + s] = dk * static_cast<float>(sum);
      }
    }
  }
}

void quant_quantize_x_avx512vnni(const float* x, int64_t K, int offset, int64_t Kp, int8_t* q,
                                 float* d, float* d_sum, int32_t* neg_offset_sum, int64_t m_begin,
                                 int64_t m_end) {
  const __m512 zero = _mm512_setzero_ps(), lim = _mm512_set1_ps(127.0f);
  const __m512i ones = _mm512_set1_epi8(1), neg_offset = _mm512_set1_epi32(-offset);
  const int64_t lanes = Kp / 4;
  for (int64_t m = m_begin; m < m_end; ++m) {
    const float* xm = x + m * K;
    int8_t* qm = q + m * Kp;
    for (int64_t k = 0; k < Kp; k += 64) {
      float dk[2];
      for (int h = 0; h < 2; ++h) {
        const int64_t kb = k + 32 * h;
        __m512 v0 = zero, v1 = zero;
        if (kb < K) {
          v0 = _mm512_loadu_ps(xm + kb);
          v1 = _mm512_loadu_ps(xm + kb + 16);
        }
        const float amax =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        dk[h] = amax / 127.0f;
        // d == 0 only when every |x| < 127 * 2^-149: dividing by 1 gives quants 0 as well.
        const __m512 div = _mm512_set1_ps(dk[h] == 0.0f ? 1.0f : dk[h]);
        const __m512 r0 = _mm512_roundscale_ps(_mm512_div_ps(v0, div),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 r1 = _mm512_roundscale_ps(_mm512_div_ps(v1, div),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i i0 =
            _mm512_cvttps_epi32(_mm512_min_ps(lim, _mm512_max_ps(_mm512_sub_ps(zero, lim), r0)));
        const __m512i i1 =
            _mm512_cvttps_epi32(_mm512_min_ps(lim, _mm512_max_ps(_mm512_sub_ps(zero, lim), r1)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qm + kb), _mm512_cvtsepi32_epi8(i0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qm + kb + 16), _mm512_cvtsepi32_epi8(i1));
      }
      const __m512i sum4 =
          _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(qm + k));
      const __m512 dl = halves(dk[0], dk[1]);
      _mm512_storeu_ps(d + m * lanes + k / 4, dl);
      _mm512_storeu_ps(d_sum + m * lanes + k / 4, _mm512_mul_ps(dl, _mm512_cvtepi32_ps(sum4)));
      _mm512_storeu_si512(neg_offset_sum + m * lanes + k / 4, _mm512_mullo_epi32(sum4, neg_offset));
    }
  }
}

void quant_linear_int8_avx512vnni(const QuantLinearInt8Block& b) {
  switch (b.fmt) {
    case QuantFmt::Q4_0: linear_rows<SmallBlocks<QuantFmt::Q4_0>, true>(b); break;
    case QuantFmt::Q4_1: linear_rows<SmallBlocks<QuantFmt::Q4_1>, false>(b); break;
    case QuantFmt::Q5_0: linear_rows<SmallBlocks<QuantFmt::Q5_0>, true>(b); break;
    case QuantFmt::Q5_1: linear_rows<SmallBlocks<QuantFmt::Q5_1>, false>(b); break;
    case QuantFmt::Q8_0: linear_rows<SmallBlocks<QuantFmt::Q8_0>, true>(b); break;
    case QuantFmt::Q4_K: k_linear_rows<KVec512, KDecode45<false>>(b, t_kblocks); break;
    case QuantFmt::Q5_K: k_linear_rows<KVec512, KDecode45<true>>(b, t_kblocks); break;
    case QuantFmt::Q6_K: k_linear_rows<KVec512, KDecode6>(b, t_kblocks); break;
    default: break;  // repacked layouts: quant_repack_avx512vnni.cpp
  }
}

}  // namespace specdec
