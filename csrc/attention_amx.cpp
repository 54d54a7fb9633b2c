// AMX attention chunk kernel for bf16 (built with the AMX flags; run only when active_isa() ==
// AMX, q is bf16 and head_dim % 32 == 0). Contract: AttnChunk in attention_isa.h.
// Layout: queries sit in vector lanes, 16 per group, so the online softmax is plain lane-wise
// vector code with no per-row horizontal reductions or scalar exp calls:
//   S^T [64 keys, Mp] = K [64 keys, D] . Q^T      (AMX: A = the block's K rows, gathered or read
//                                                   straight from the pool when their slots are
//                                                   consecutive; B = Q^T tiles built per chunk)
//   softmax per lane over the block's keys         (AVX-512; lazy rescaling: the running reference
//                                                   max moves only when a block exceeds it by more
//                                                   than kLazyMargin, so acc is rarely rescaled)
//   P [Mp, 64 keys] = two 16 x 16 word transposes of the bf16 key-pair rows of P^T per group
//   acc [Mp, D] += P . V                           (AMX: B = V rows interleaved into key pairs)
// Tiles: tmm0..3 accumulate, tmm4 holds the A operand, tmm5 the B operand (16 rows x 64 bytes).
#include "amx_tiles.h"
#include "attention_kernel.h"

namespace specdec {
namespace {

struct AmxScratch {
  std::vector<uint32_t> qw, qt, vp, pb, pt;
  std::vector<uint16_t> kbuf;
  std::vector<float> st, acc, mref, lsum;
  std::vector<uint16_t> vis;
};
thread_local AmxScratch amx_tls;

// Tile numbers are immediates, so the four accumulators are spelled out.
#define SPECDEC_FOR_4_TILES(X) X(0) X(1) X(2) X(3)

// Lane masks of the block's keys for query group g: vis[j] bit l = query 16g + l sees key kb0 + j.
void block_visibility(const AttnChunk& c, int64_t M, int64_t g, int64_t kb0, int64_t nk,
                      uint16_t* vis) {
  std::memset(vis, 0, kKeyBlock * sizeof(uint16_t));
  int64_t last_t = -1;
  uint64_t bits = 0;
  for (int64_t l = 0; l < 16 && 16 * g + l < M; ++l) {
    const int64_t t = c.row0 + (16 * g + l) / c.heads;
    if (t != last_t) {
      bits = visible_bits(c, t, kb0, nk);
      last_t = t;
    }
    for (uint64_t b = bits; b != 0; b &= b - 1)
      vis[__builtin_ctzll(b)] |= static_cast<uint16_t>(1u << l);
  }
}

}  // namespace

void attention_chunk_amx(const AttnChunk& c) {
  const int64_t D = c.head_dim, W = D / 2, M = c.rows * c.heads;
  const int64_t G = (M + 15) / 16, Mp = 16 * G, CW = W / 16;  // CW: 16-word column chunks of q
  constexpr int64_t kPairs = kKeyBlock / 2;
  AmxScratch& s = amx_tls;

  // Q^T tiles [CW][G] of [16 words, 16 queries] (the B operand of S^T = K . Q^T).
  s.qw.assign(Mp * W, 0);
  for (int64_t m = 0; m < M; ++m) {
    const char* src = static_cast<const char*>(c.q) +
                      ((m / c.heads) * c.q_stride_row + (m % c.heads) * c.q_stride_head) * 2;
    std::memcpy(s.qw.data() + m * W, src, W * 4);
  }
  s.qt.resize(CW * G * 256);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t cc = 0; cc < CW; ++cc) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = _mm512_loadu_ps(
            reinterpret_cast<const float*>(s.qw.data() + (16 * g + i) * W + 16 * cc));
      }
      transpose16(r);
      for (int i = 0; i < 16; ++i) {
        _mm512_storeu_ps(reinterpret_cast<float*>(s.qt.data() + ((cc * G + g) * 16 + i) * 16),
                         r[i]);
      }
    }
  }
  s.kbuf.resize(kKeyBlock * D);
  s.vp.resize(kPairs * D);
  s.st.resize(kKeyBlock * Mp);
  s.pb.resize(Mp * kPairs);
  s.pt.resize(kPairs * 16);
  s.vis.resize(kKeyBlock);
  s.mref.assign(Mp, -std::numeric_limits<float>::infinity());
  s.lsum.assign(Mp, 0.0f);
  // Plain pointers for the loops (the compiler cannot keep thread-local vectors' data pointers
  // in registers across the stores below).
  float* const st = s.st.data();
  uint16_t* const visb = s.vis.data();
  uint32_t* const ptb = s.pt.data();
  uint32_t* const pbb = s.pb.data();
  uint32_t* const vpb = s.vp.data();
  float* const mref = s.mref.data();
  float* const lsb = s.lsum.data();
  const float cap = c.logit_cap;
  float* acc = c.acc;  // [Mp, D]: the chunk's own [M, D] output when no rows are padding
  if (Mp != M) {
    s.acc.resize(Mp * D);
    acc = s.acc.data();
  }
  std::memset(acc, 0, Mp * D * sizeof(float));

  configure_full_tiles(6);

  const char* kbase = static_cast<const char*>(c.k);
  const char* vbase = static_cast<const char*>(c.v);
  const int64_t kstride = c.k_stride_slot * 2, vstride = c.v_stride_slot * 2;  // bytes per slot
  const int64_t row_bytes = D * 2;
  const __m512i interleave =
      _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512 scale = _mm512_set1_ps(c.scale);
  const bool raw_max = cap <= 0 && c.scale > 0;
  const __m512 log2e = _mm512_set1_ps(kLog2e);
  const __m512 kx = _mm512_set1_ps(raw_max ? c.scale * kLog2e : kLog2e);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  {
    const int64_t n0 = std::min<int64_t>(kKeyBlock, c.key_end - c.key_begin);
    prefetch_rows(c, kbase, c.k_stride_slot, c.key_begin, n0, row_bytes);
    prefetch_rows(c, vbase, c.v_stride_slot, c.key_begin, n0, row_bytes);
  }
  for (int64_t kb0 = c.key_begin; kb0 < c.key_end; kb0 += kKeyBlock) {
    const int64_t nk = std::min<int64_t>(kKeyBlock, c.key_end - kb0);
    const int32_t* sl = c.slots + kb0 * c.slot_stride;
    const int64_t next = kb0 + kKeyBlock;
    const int64_t next_n = std::min<int64_t>(kKeyBlock, c.key_end - next);
    // The next block's K rows now, its V rows after the scores (slots are scattered: the
    // hardware prefetcher cannot follow them).
    if (next_n > 0) prefetch_rows(c, kbase, c.k_stride_slot, next, next_n, row_bytes);

    // K rows as the A operand: straight from the pool when the block's slots are consecutive,
    // else gathered (rows past the block's keys are zero).
    bool consecutive = nk == kKeyBlock && c.slot_stride == 1;
    for (int64_t j = 1; consecutive && j < kKeyBlock; ++j) consecutive = sl[j] == sl[0] + j;
    const char* kptr;
    int64_t kld;
    if (consecutive) {
      kptr = kbase + sl[0] * kstride;
      kld = kstride;
    } else {
      uint16_t* kb = s.kbuf.data();
      for (int64_t j = 0; j < nk; ++j) {
        const char* src = kbase + sl[j * c.slot_stride] * kstride;
        for (int64_t o = 0; o < row_bytes; o += 64) {
          _mm512_storeu_si512(reinterpret_cast<char*>(kb + j * D) + o, _mm512_loadu_si512(src + o));
        }
      }
      if (nk < kKeyBlock) std::memset(kb + nk * D, 0, (kKeyBlock - nk) * row_bytes);
      kptr = reinterpret_cast<const char*>(kb);
      kld = row_bytes;
    }
    // S^T [64 keys, Mp] fp32, tile (key block kt, query group g) at st[16 kt, 16 g].
    for (int64_t g = 0; g < G; ++g) {
#define SPECDEC_ZERO(t) _tile_zero(t);
      SPECDEC_FOR_4_TILES(SPECDEC_ZERO)
#undef SPECDEC_ZERO
      for (int64_t cc = 0; cc < CW; ++cc) {
        _tile_loadd(5, s.qt.data() + (cc * G + g) * 256, 64);
#define SPECDEC_QK(t)                                   \
  _tile_loadd(4, kptr + 16 * (t) * kld + 64 * cc, kld); \
  _tile_dpbf16ps(t, 4, 5);
        SPECDEC_FOR_4_TILES(SPECDEC_QK)
#undef SPECDEC_QK
      }
#define SPECDEC_STORE_S(t) _tile_stored(t, st + 16 * (t) * Mp + 16 * g, Mp * 4);
      SPECDEC_FOR_4_TILES(SPECDEC_STORE_S)
#undef SPECDEC_STORE_S
    }
    if (next_n > 0) prefetch_rows(c, vbase, c.v_stride_slot, next, next_n, row_bytes);

    // V rows j, j + 1 interleaved into key-pair words [32 pairs, D] (the B operand of P . V);
    // rows past the block's keys are zero (their probabilities are zero too; zeros keep 0 * x
    // finite).
    const int64_t npairs = (nk + 1) / 2;
    for (int64_t j2 = 0; j2 < npairs; ++j2) {
      const char* r0 = vbase + sl[2 * j2 * c.slot_stride] * vstride;
      const bool odd = 2 * j2 + 1 < nk;  // an odd last key pairs with zeros
      const char* r1 = odd ? vbase + sl[(2 * j2 + 1) * c.slot_stride] * vstride : r0;
      uint32_t* dst = vpb + j2 * D;
      for (int64_t d = 0; d < D; d += 16) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + d * 2));
        const __m256i b = odd ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + d * 2))
                              : _mm256_setzero_si256();
        const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        _mm512_storeu_si512(dst + d, _mm512_permutexvar_epi16(interleave, ab));
      }
    }
    std::memset(vpb + npairs * D, 0, (kPairs - npairs) * D * sizeof(uint32_t));

    // Per query group: the online softmax (lane-wise), then its P . V on the tiles, so the tile
    // products of one group overlap the vector work of the next.
    const bool all_visible = kb0 + nk <= c.prefix && c.window <= 0;
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t lanes =
          M - 16 * g >= 16 ? 0xFFFF : static_cast<uint16_t>((1u << (M - 16 * g)) - 1);
      if (!all_visible) block_visibility(c, M, g, kb0, nk, visb);
      float* sg = st + 16 * g;
      // The block max: uncapped scores with a positive scale take it over the raw products
      // (the scale is monotone); capped ones are scaled, capped and stored for the exp pass.
      __m512 mx = neg_inf;
      if (raw_max) {
        for (int64_t j = 0; j < nk; ++j) {
          mx = _mm512_mask_max_ps(mx, all_visible ? lanes : visb[j], mx,
                                  _mm512_loadu_ps(sg + j * Mp));
        }
        mx = _mm512_mul_ps(mx, scale);
      } else {
        for (int64_t j = 0; j < nk; ++j) {
          __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sg + j * Mp), scale);
          if (cap > 0) x = soft_cap512(x, cap);
          _mm512_storeu_ps(sg + j * Mp, x);
          mx = _mm512_mask_max_ps(mx, all_visible ? lanes : visb[j], mx, x);
        }
      }
      const __m512 m_old = _mm512_loadu_ps(mref + 16 * g);
      // Lanes whose block max passes the reference by more than the margin move it (a lane with
      // no key yet moves at its first visible one).
      const __mmask16 move =
          _mm512_cmp_ps_mask(mx, _mm512_add_ps(m_old, _mm512_set1_ps(kLazyMargin)), _CMP_GT_OQ);
      const __m512 m_new = _mm512_mask_mov_ps(m_old, move, mx);
      __m512 lsum = _mm512_loadu_ps(lsb + 16 * g);
      if (move) {
        // alpha = exp(m_old - m_new): 0 for a lane with no key yet (its acc and sum are 0).
        const __m512 alpha =
            _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_old, neg_inf, _CMP_NEQ_OQ) & move,
                                exp512(_mm512_sub_ps(m_old, m_new)));
        alignas(64) float al[16];
        _mm512_store_ps(al, alpha);
        for (int l = 0; l < 16; ++l) {
          if (!((move >> l) & 1)) continue;
          float* row = acc + (16 * g + l) * D;
          const __m512 a = _mm512_set1_ps(al[l]);
          for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(row + d, _mm512_mul_ps(a, _mm512_loadu_ps(row + d)));
        }
        lsum = _mm512_mask_mul_ps(lsum, move, lsum, alpha);
        _mm512_storeu_ps(mref + 16 * g, m_new);
      }
      // Lanes that have seen no key keep -inf; subtract 0 there (their probabilities are masked).
      const __m512 msub =
          _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_new, neg_inf, _CMP_NEQ_OQ), m_new);
      // p = exp(x - m) = 2^(stored * kx - m log2 e), stored = raw products (kx = scale log2 e)
      // or scaled, capped scores (kx = log2 e).
      const __m512 mb = _mm512_mul_ps(msub, log2e);
      for (int64_t j2 = 0; j2 < kPairs; ++j2) {
        const int64_t j = 2 * j2;
        __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
        if (j < nk) {
          p0 =
              _mm512_maskz_mov_ps(all_visible ? lanes : visb[j],
                                  exp2_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(sg + j * Mp), kx, mb)));
        }
        if (j + 1 < nk) {
          p1 = _mm512_maskz_mov_ps(
              all_visible ? lanes : visb[j + 1],
              exp2_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(sg + (j + 1) * Mp), kx, mb)));
        }
        // Word l = (bf16 p0[l], bf16 p1[l]): the key pair of query l.
        const __m512i w =
            _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        _mm512_storeu_si512(ptb + j2 * 16, w);
        // The sum uses the same rounded values as P . V.
        lsum = _mm512_add_ps(lsum, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        lsum = _mm512_add_ps(lsum,
                             _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(-65536))));
      }
      _mm512_storeu_ps(lsb + 16 * g, lsum);
      // P^T pair rows [32, 16 lanes] -> P rows [16 queries, 32 pair words] (the A operand).
      uint32_t* const pg = pbb + 16 * g * kPairs;
      for (int64_t half = 0; half < 2; ++half) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(ptb + (16 * half + i) * 16));
        transpose16(r);
        for (int i = 0; i < 16; ++i)
          _mm512_storeu_ps(reinterpret_cast<float*>(pg + i * kPairs + 16 * half), r[i]);
      }

      // acc [16 g .. 16 g + 16, D] += P [16 queries, 32 pairs] . V pairs [32, D].
      float* const ag = acc + 16 * g * D;
      int64_t dc = 0;
      for (; dc + 64 <= D; dc += 64) {
#define SPECDEC_LOAD_ACC(t) _tile_loadd(t, ag + dc + 16 * (t), D * 4);
        SPECDEC_FOR_4_TILES(SPECDEC_LOAD_ACC)
#undef SPECDEC_LOAD_ACC
        for (int64_t k0 = 0; k0 < kPairs; k0 += 16) {
          _tile_loadd(4, pg + k0, kPairs * 4);
#define SPECDEC_PV(t)                                  \
  _tile_loadd(5, vpb + k0 * D + dc + 16 * (t), D * 4); \
  _tile_dpbf16ps(t, 4, 5);
          SPECDEC_FOR_4_TILES(SPECDEC_PV)
#undef SPECDEC_PV
        }
#define SPECDEC_STORE_ACC(t) _tile_stored(t, ag + dc + 16 * (t), D * 4);
        SPECDEC_FOR_4_TILES(SPECDEC_STORE_ACC)
#undef SPECDEC_STORE_ACC
      }
      for (; dc < D; dc += 16) {  // D % 64 == 32: one accumulator tile at a time
        _tile_loadd(0, ag + dc, D * 4);
        for (int64_t k0 = 0; k0 < kPairs; k0 += 16) {
          _tile_loadd(4, pg + k0, kPairs * 4);
          _tile_loadd(5, vpb + k0 * D + dc, D * 4);
          _tile_dpbf16ps(0, 4, 5);
        }
        _tile_stored(0, ag + dc, D * 4);
      }
    }
  }
  _tile_release();

  for (int64_t m = 0; m < M; ++m) {
    c.max[m] = mref[m];
    c.sum[m] = lsb[m];
  }
  if (acc != c.acc) std::memcpy(c.acc, acc, M * D * sizeof(float));
}

#undef SPECDEC_FOR_4_TILES

}  // namespace specdec
