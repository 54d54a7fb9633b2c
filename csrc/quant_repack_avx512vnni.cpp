// AVX-512 VNNI kernel of quant_linear with INT8 activations over the R16 layouts
// (quant_repack.h): lane r of every vector is weight row 16g + r of the group. Per x row and
// 4 weights of the 16 rows, one vpdpbusd against a broadcast of the row's 4 activation quants;
// per sub-block (32 weights Q4_K, 16 Q6_K) its sum times the lane's integer scale (vpmulld)
// into the block's integer sum; per 256 weights one convert and one FMA (d * d_x) per lane, plus
// one for the Q4_K mins (an integer sum of mn * 32-quant sums, vpdpwssd). Up to 4 rows of x share
// each unpacked weight vector (the unpacking is ~1.5 ops per 64 bytes for Q4_K, 3 for Q6_K).
// The 32-weight formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): per x row, block and 16 rows the exact
// integer dot of the block (8 vpdpbusd: 4 weights x 16 rows each, started at -offset * the
// block's quant sum), then one convert and one FMA by d * d_x per lane, plus one FMA for the
// Q4_1 / Q5_1 min (m * d_x * quant sum): ~2.5x fewer vector ops per weight and x row than the
// file layout's kernel, which converts and scales every 4-weight lane. That different float order
// makes a row's result differ from the file kernel's in the last bits (both within the INT8
// definition's rounding bound); repacking is all or nothing per tensor, so one model never mixes
// them. Every lane sees the operations of one (x row, weight row) pair in one order whatever the
// number of rows of x or the tile a row falls in: batch invariance.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_isa.h"
#include "quant_k_rows.h"
#include "quant_repack.h"

namespace specdec {
namespace {

// The 4 bytes at p (4 activation quants, or 2 int16 block sums) in every int32 lane.
inline __m512i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline __m512 f16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The int16 pairs of 16 lanes (32 bytes of pairs) widened: even member in the low int16 of each
// int32 lane, odd member in the high one.
inline __m512i pairs_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512i pairs_i8(const uint8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512i even_member(__m512i pairs) {
  return _mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16);
}
inline __m512i odd_member(__m512i pairs) { return _mm512_srai_epi32(pairs, 16); }

// The chunk kAhead blocks ahead, every cache line, into L1 (T0) or L2 (T1); a group's chunks,
// and the next group's, are contiguous.
template <int64_t kChunk, int kAhead, _mm_hint kHint>
inline void prefetch_chunk(const uint8_t* chunk) {
  for (int64_t off = 0; off < kChunk; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(chunk + kAhead * kChunk + off), kHint);
}

// The chunk two blocks ahead into L1, for the tiles of several rows of x (slower per byte, so
// latency-bound on the hardware prefetchers alone on a single thread). At one row of x both K
// layouts are one sequential stream per group, which the hardware prefetchers keep at decode
// speed from huge pages; a prefetch per cache line would only take load slots and L1 miss
// buffers from them, so that tile takes none (benchmarks/RESULTS.md).
template <int64_t kChunk>
inline void prefetch_ahead(const uint8_t* chunk) {
  prefetch_chunk<kChunk, 2, _MM_HINT_T0>(chunk);
}

// acc[i] += lane-wise block result, the float tail shared by both formats: acc + I * (d * d_x).
inline __m512 scale_add(__m512i isum, __m512 d, float dx, __m512 acc) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc);
}

// Q4_K: MB rows of x against one group, all K.
template <int MB>
void q4_group(const uint8_t* group, int64_t blocks, const XRow* x, __m512* acc) {
  const __m512i nib = _mm512_set1_epi8(15);
  for (int64_t c = 0; c < blocks; ++c) {
    const uint8_t* p = group + c * (16 * 148);
    if constexpr (MB > 1) prefetch_ahead<16 * 148>(p);
    __m512i isum[MB], imin[MB];
    for (int i = 0; i < MB; ++i) isum[i] = imin[i] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      __m512i lo[MB], hi[MB];
      for (int i = 0; i < MB; ++i) lo[i] = hi[i] = _mm512_setzero_si512();
      const uint8_t* qs = p + 320 + j * 512;
      for (int t = 0; t < 8; ++t) {
        const __m512i v = _mm512_loadu_si512(qs + 64 * t);
        const __m512i ul = _mm512_and_si512(v, nib),
                      uh = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        for (int i = 0; i < MB; ++i) {
          const int8_t* q = x[i].q + 256 * c + 64 * j + 4 * t;
          lo[i] = _mm512_dpbusd_epi32(lo[i], ul, bcast4(q));
          hi[i] = _mm512_dpbusd_epi32(hi[i], uh, bcast4(q + 32));
        }
      }
      const __m512i sc = pairs_u8(p + 64 + 32 * j);
      const __m512i sc_lo = even_member(sc), sc_hi = odd_member(sc);
      for (int i = 0; i < MB; ++i)
        isum[i] = _mm512_add_epi32(isum[i], _mm512_add_epi32(_mm512_mullo_epi32(lo[i], sc_lo),
                                                             _mm512_mullo_epi32(hi[i], sc_hi)));
    }
    // Mins: sum_s mn[s] * (sum of the 32 quants of sub-block s), pairs of sub-blocks per vpdpwssd.
    for (int e = 0; e < 4; ++e) {
      const __m512i mn = pairs_u8(p + 192 + 32 * e);
      for (int i = 0; i < MB; ++i)
        imin[i] = _mm512_dpwssd_epi32(imin[i], mn, bcast4(x[i].bsum32 + 8 * c + 2 * e));
    }
    const __m512 d = f16x16(p), dmin = f16x16(p + 32);
    for (int i = 0; i < MB; ++i) {
      const float dx = x[i].d[c];
      acc[i] = scale_add(isum[i], d, dx, acc[i]);
      // - dmin * mn * sum q: acc - Imin * (dmin * d_x), fused.
      acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin[i]),
                                _mm512_mul_ps(dmin, _mm512_set1_ps(dx)), acc[i]);
    }
  }
}

// Bit select, per bit: mask ? a : b.
inline __m512i select_bits(__m512i mask, __m512i a, __m512i b) {
  return _mm512_ternarylogic_epi32(a, b, mask, 0xE4);
}

// The 4 vectors of 6-bit quants of a Q6_K_R16 group (quant_repack.h) from its 3 vectors: slots
// 0-2 are bits 0-5 of vectors 0-2, slot 3's three bit pairs sit in their bits 6-7. The 16-bit
// shifts move bits 6-7 of both bytes of a lane to bits 0-1 / 2-3 / 4-5 of the same byte; what
// they bring in from the neighbouring byte lands in bits the selects and the mask drop.
inline void q6_group_quants(const uint8_t* q, __m512i* u) {
  const __m512i six = _mm512_set1_epi8(63), low2 = _mm512_set1_epi8(3), low4 = _mm512_set1_epi8(15);
  const __m512i a = _mm512_loadu_si512(q), b = _mm512_loadu_si512(q + 64),
                c = _mm512_loadu_si512(q + 128);
  u[0] = _mm512_and_si512(a, six);
  u[1] = _mm512_and_si512(b, six);
  u[2] = _mm512_and_si512(c, six);
  const __m512i ab = select_bits(low2, _mm512_srli_epi16(a, 6), _mm512_srli_epi16(b, 4));
  u[3] = _mm512_and_si512(select_bits(low4, ab, _mm512_srli_epi16(c, 2)), six);
}

// Q6_K, group g (16 weights) of block c for MB rows of x: the group's integer dot times its
// scale into isum (one accumulator per row: a 4-row tile fits in registers).
template <int MB>
inline void q6_group_dot(const uint8_t* ch, const XRow* x, int64_t c, int g, __m512i sc,
                         __m512i* isum) {
  __m512i u[4];
  q6_group_quants(ch + 320 + 192 * g, u);
  for (int i = 0; i < MB; ++i) {
    const int8_t* q = x[i].q + 256 * c + 16 * g;
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], bcast4(q));
    for (int t = 1; t < 4; ++t) s = _mm512_dpbusd_epi32(s, u[t], bcast4(q + 4 * t));
    isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(s, sc));
  }
}

// Q6_K: MB rows of x against one group, all K.
template <int MB>
void q6_group(const uint8_t* group, int64_t blocks, const XRow* x, __m512* acc) {
  for (int64_t c = 0; c < blocks; ++c) {
    const uint8_t* ch = group + c * (16 * 212);
    if constexpr (MB > 1) prefetch_ahead<16 * 212>(ch);
    __m512i isum[MB], corr[MB];
    for (int i = 0; i < MB; ++i) isum[i] = corr[i] = _mm512_setzero_si512();
    for (int e = 0; e < 8; ++e) {  // scale pair e: groups 2e, 2e + 1
      const __m512i sc = pairs_i8(ch + 64 + 32 * e);
      q6_group_dot<MB>(ch, x, c, 2 * e, even_member(sc), isum);
      q6_group_dot<MB>(ch, x, c, 2 * e + 1, odd_member(sc), isum);
      // wq = u - 32: I = sum_g sc[g] * (dot_u - 32 * sum of the group's 16 quants).
      for (int i = 0; i < MB; ++i)
        corr[i] = _mm512_dpwssd_epi32(corr[i], sc, bcast4(x[i].bsum16 + 16 * c + 2 * e));
    }
    const __m512 d = f16x16(ch);
    for (int i = 0; i < MB; ++i)
      acc[i] =
          scale_add(_mm512_sub_epi32(isum[i], _mm512_slli_epi32(corr[i], 5)), d, x[i].d[c], acc[i]);
  }
}

// ---- The 32-weight formats (32-value activation blocks, QuantizedX) ----
// The fields of a pair chunk (quant_repack.h), at compile time.
template <QuantFmt kBase>
struct SmallR16 {
  static constexpr bool kMin = kBase == QuantFmt::Q4_1 || kBase == QuantFmt::Q5_1;
  static constexpr bool kFifth = kBase == QuantFmt::Q5_0 || kBase == QuantFmt::Q5_1;
  static constexpr bool kQ8 = kBase == QuantFmt::Q8_0;
  // quant_isa.h's int8_weight_offset: wq = u - offset.
  static constexpr int kOffset = kBase == QuantFmt::Q4_0   ? 8
                                 : kBase == QuantFmt::Q5_0 ? 16
                                 : kQ8                     ? 128
                                                           : 0;
  static constexpr int64_t kQhAt = kMin ? 128 : 64, kQsAt = kQhAt + (kFifth ? 128 : 0);
  static constexpr int64_t kChunk = kQsAt + (kQ8 ? 1024 : 512);
};

// One row of x as the 32-weight kernel reads it: quants, and per block d, the quant sum and
// d * quant sum.
struct SmallXRow {
  const int8_t* q;
  const float* d;  // the d of each 4-quant lane: block b's at 8b
  const int32_t* bsum;
  const float* d_sum;
  SmallXRow() = default;
  SmallXRow(const QuantizedX& x, int64_t m)
      : q(x.q + m * x.Kp),
        d(x.d + m * (x.Kp / 4)),
        bsum(x.bsum32 + m * (x.Kp / 32)),
        d_sum(x.d_sum32 + m * (x.Kp / 32)) {}
};

inline __mmask64 fifth_bits(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return static_cast<__mmask64>(v);
}

// Block b (= 2c + blk) of MB rows of x against one chunk's block blk: the exact integer dots
// of the 16 lanes (started at -offset * the block's quant sum, so that they hold sum wq * q).
template <QuantFmt kBase, int MB>
inline void small_block_dots(const uint8_t* ch, int blk, const SmallXRow* x, int64_t b,
                             __m512i* dot) {
  using L = SmallR16<kBase>;
  __m512i other[MB];  // a second chain: the nibbles' high halves, Q8_0's odd vectors
  for (int i = 0; i < MB; ++i) {
    dot[i] = _mm512_set1_epi32(-L::kOffset * x[i].bsum[b]);
    other[i] = _mm512_setzero_si512();
  }
  if constexpr (L::kQ8) {
    for (int t = 0; t < 8; t += 2) {  // stored as u = q + 128
      const uint8_t* qs = ch + L::kQsAt + 512 * blk + 64 * t;
      const __m512i u0 = _mm512_loadu_si512(qs), u1 = _mm512_loadu_si512(qs + 64);
      for (int i = 0; i < MB; ++i) {
        const int8_t* q = x[i].q + 32 * b + 4 * t;
        dot[i] = _mm512_dpbusd_epi32(dot[i], u0, bcast4(q));
        other[i] = _mm512_dpbusd_epi32(other[i], u1, bcast4(q + 4));
      }
    }
  } else {
    const __m512i nib = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
    for (int t = 0; t < 4; ++t) {
      const __m512i v = _mm512_loadu_si512(ch + L::kQsAt + 256 * blk + 64 * t);
      __m512i ul = _mm512_and_si512(v, nib), uh = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      if constexpr (L::kFifth) {
        const uint8_t* qh = ch + L::kQhAt + 8 * ((blk * 4 + t) * 2);
        ul = _mm512_mask_add_epi8(ul, fifth_bits(qh), ul, sixteen);
        uh = _mm512_mask_add_epi8(uh, fifth_bits(qh + 8), uh, sixteen);
      }
      for (int i = 0; i < MB; ++i) {
        const int8_t* q = x[i].q + 32 * b + 4 * t;
        dot[i] = _mm512_dpbusd_epi32(dot[i], ul, bcast4(q));
        other[i] = _mm512_dpbusd_epi32(other[i], uh, bcast4(q + 16));
      }
    }
  }
  for (int i = 0; i < MB; ++i) dot[i] = _mm512_add_epi32(dot[i], other[i]);
}

// A 32-weight format: MB rows of x against one group, all K. Per lane and block, in order:
// acc += I * (d * d_x); Q4_1 / Q5_1 then acc += m * (d_x * quant sum).
template <QuantFmt kBase, int MB>
void small_group(const uint8_t* group, int64_t pairs, const SmallXRow* x, __m512* out) {
  using L = SmallR16<kBase>;
  __m512 acc[MB];  // local, so that they stay in registers across the loop
  for (int i = 0; i < MB; ++i) acc[i] = out[i];
  for (int64_t c = 0; c < pairs; ++c) {
    const uint8_t* ch = group + c * L::kChunk;
    prefetch_ahead<L::kChunk>(ch);
    for (int blk = 0; blk < 2; ++blk) {
      const int64_t b = 2 * c + blk;
      __m512i dot[MB];
      small_block_dots<kBase, MB>(ch, blk, x, b, dot);
      const __m512 d = f16x16(ch + 32 * blk);
      for (int i = 0; i < MB; ++i) acc[i] = scale_add(dot[i], d, x[i].d[8 * b], acc[i]);
      if constexpr (L::kMin) {
        const __m512 m = f16x16(ch + 64 + 32 * blk);
        for (int i = 0; i < MB; ++i)
          acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[i].d_sum[b]), acc[i]);
      }
    }
  }
  for (int i = 0; i < MB; ++i) out[i] = acc[i];
}

// The K formats' group loop for MB rows of x from m0.
template <int MB>
void k_tile(const QuantLinearInt8Block& b, const uint8_t* group, int64_t m0, __m512* acc) {
  XRow x[MB];
  for (int i = 0; i < MB; ++i) x[i] = XRow(b.xk, m0 + i);
  if (b.fmt == QuantFmt::Q4_K_R16)
    q4_group<MB>(group, b.xk.K / 256, x, acc);
  else
    q6_group<MB>(group, b.xk.K / 256, x, acc);
}

template <int MB>
void small_tile(const QuantLinearInt8Block& b, const uint8_t* group, int64_t m0, __m512* acc) {
  SmallXRow x[MB];
  for (int i = 0; i < MB; ++i) x[i] = SmallXRow(b.x, m0 + i);
  const int64_t pairs = b.x.K / 64;
  switch (b.fmt) {
    case QuantFmt::Q4_0_R16: small_group<QuantFmt::Q4_0, MB>(group, pairs, x, acc); break;
    case QuantFmt::Q4_1_R16: small_group<QuantFmt::Q4_1, MB>(group, pairs, x, acc); break;
    case QuantFmt::Q5_0_R16: small_group<QuantFmt::Q5_0, MB>(group, pairs, x, acc); break;
    case QuantFmt::Q5_1_R16: small_group<QuantFmt::Q5_1, MB>(group, pairs, x, acc); break;
    default: small_group<QuantFmt::Q8_0, MB>(group, pairs, x, acc); break;
  }
}

// MB rows of x from m0 against the group of output features [n, n + 16); kK: a K format.
template <int MB, bool kK>
void tile(const QuantLinearInt8Block& b, const uint8_t* group, int64_t n, int64_t m0) {
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  if constexpr (kK)
    k_tile<MB>(b, group, m0, acc);
  else
    small_tile<MB>(b, group, m0, acc);
  for (int i = 0; i < MB; ++i) {
    __m512 v = acc[i];
    if (b.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(b.bias + n));
    _mm512_storeu_ps(b.y + (m0 + i) * b.y_stride + n, v);
  }
}

// The rows of x one pass over a group takes: up to 4 for the K formats; up to 8 for the
// 32-weight formats, whose tile keeps 3 vectors per row (two integer dot chains and the float
// sum), so 8 rows still fit the 32 registers with the unpacked weights. A verify of 5-8 rows
// then reads each weight once instead of twice (a second pass over the weights costs about as
// much as the first at these sizes).
template <int MB, bool kK>
void tiles_of(const QuantLinearInt8Block& b, const uint8_t* group, int64_t n, int64_t M) {
  int64_t m = 0;
  for (; M - m >= MB; m += MB) tile<MB, kK>(b, group, n, m);
  const int64_t rest = M - m;  // fewer than MB rows, in one tile
  if (rest == 1) tile<1, kK>(b, group, n, m);
  if (rest == 2) tile<2, kK>(b, group, n, m);
  if (rest == 3) tile<3, kK>(b, group, n, m);
  if constexpr (MB == 8) {
    if (rest == 4) tile<4, kK>(b, group, n, m);
    if (rest == 5) tile<5, kK>(b, group, n, m);
    if (rest == 6) tile<6, kK>(b, group, n, m);
    if (rest == 7) tile<7, kK>(b, group, n, m);
  }
}

}  // namespace

void quant_linear_int8_r16_avx512vnni(const QuantLinearInt8Block& b) {
  const bool k = is_k_format(file_format(b.fmt));
  const int64_t M = k ? b.xk.M : b.x.M;
  for (int64_t n = b.n_begin; n < b.n_end; n += 16) {
    const uint8_t* group = b.w + (n / 16) * b.w_stride;
    if (k)
      tiles_of<4, true>(b, group, n, M);
    else
      tiles_of<8, false>(b, group, n, M);
  }
}

}  // namespace specdec
