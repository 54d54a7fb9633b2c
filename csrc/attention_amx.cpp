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

constexpr int64_t kPairs = kKeyBlock / 2;

// Word l of a 512-bit vector of two 16-element halves a | b: (a[l], b[l]).
inline __m512i interleave_halves() {
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                          6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

// One chunk's shapes, constants and scratch pointers, shared by the phases below. Plain
// pointers (the compiler cannot keep thread-local vectors' data pointers in registers across
// the stores of the loops).
struct AmxChunk {
  const AttnChunk& c;
  int64_t D, W, M, G, Mp, CW;  // W: D in bf16 pairs; G query groups of 16; CW: 16-word columns
  const char *kbase, *vbase;
  int64_t kstride, vstride, row_bytes;  // bytes
  float cap, scale;
  bool raw_max;        // uncapped scores with a positive scale: the block max over raw products
  const uint32_t* qt;  // Q^T tiles [CW][G] of [16 words, 16 queries]
  uint16_t* kbuf;      // gathered K rows [64, D]
  uint32_t* vp;        // V key pairs [32, D]
  float* st;           // S^T [64 keys, Mp]
  uint32_t* pt;        // one group's P^T pair rows [32, 16 lanes]
  uint32_t* pb;        // P rows [Mp, 32 pairs]
  uint16_t* vis;       // one group's visibility lanes per key
  float *mref, *lsum;  // [Mp]: running reference max and sum
  float* acc;          // [Mp, D]

  AmxChunk(const AttnChunk& chunk, AmxScratch& s);
};

// Q^T tiles: q rows of bf16 pairs, transposed per 16 queries x 16 words.
void build_q_tiles(const AttnChunk& c, AmxScratch& s, int64_t M, int64_t W, int64_t G, int64_t CW) {
  const int64_t Mp = 16 * G;
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
}

AmxChunk::AmxChunk(const AttnChunk& chunk, AmxScratch& s)
    : c(chunk),
      D(chunk.head_dim),
      W(chunk.head_dim / 2),
      M(chunk.rows * chunk.heads),
      G((M + 15) / 16),
      Mp(16 * G),
      CW(W / 16),
      kbase(static_cast<const char*>(chunk.k)),
      vbase(static_cast<const char*>(chunk.v)),
      kstride(chunk.k_stride_slot * 2),
      vstride(chunk.v_stride_slot * 2),
      row_bytes(chunk.head_dim * 2),
      cap(chunk.logit_cap),
      scale(chunk.scale),
      raw_max(chunk.logit_cap <= 0 && chunk.scale > 0) {
  build_q_tiles(c, s, M, W, G, CW);
  s.kbuf.resize(kKeyBlock * D);
  s.vp.resize(kPairs * D);
  s.st.resize(kKeyBlock * Mp);
  s.pb.resize(Mp * kPairs);
  s.pt.resize(kPairs * 16);
  s.vis.resize(kKeyBlock);
  s.mref.assign(Mp, -std::numeric_limits<float>::infinity());
  s.lsum.assign(Mp, 0.0f);
  qt = s.qt.data();
  kbuf = s.kbuf.data();
  vp = s.vp.data();
  st = s.st.data();
  pt = s.pt.data();
  pb = s.pb.data();
  vis = s.vis.data();
  mref = s.mref.data();
  lsum = s.lsum.data();
  acc = c.acc;  // the chunk's own [M, D] output when no rows are padding
  if (Mp != M) {
    s.acc.resize(Mp * D);
    acc = s.acc.data();
  }
  std::memset(acc, 0, Mp * D * sizeof(float));
}

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

// The block's K rows as the A operand: straight from the pool when the block's slots are
// consecutive, else gathered into kbuf (rows past the block's keys are zero). Returns the rows
// and sets their stride in bytes.
const char* key_rows(const AmxChunk& a, const int32_t* sl, int64_t nk, int64_t* kld) {
  const AttnChunk& c = a.c;
  bool consecutive = nk == kKeyBlock && c.slot_stride == 1;
  for (int64_t j = 1; consecutive && j < kKeyBlock; ++j) consecutive = sl[j] == sl[0] + j;
  if (consecutive) {
    *kld = a.kstride;
    return a.kbase + sl[0] * a.kstride;
  }
  for (int64_t j = 0; j < nk; ++j) {
    const char* src = a.kbase + sl[j * c.slot_stride] * a.kstride;
    for (int64_t o = 0; o < a.row_bytes; o += 64) {
      _mm512_storeu_si512(reinterpret_cast<char*>(a.kbuf + j * a.D) + o,
                          _mm512_loadu_si512(src + o));
    }
  }
  if (nk < kKeyBlock) std::memset(a.kbuf + nk * a.D, 0, (kKeyBlock - nk) * a.row_bytes);
  *kld = a.row_bytes;
  return reinterpret_cast<const char*>(a.kbuf);
}

// S^T [64 keys, Mp] fp32 = K . Q^T, tile (key block kt, query group g) at st[16 kt, 16 g].
void block_scores(const AmxChunk& a, const char* kptr, int64_t kld) {
  for (int64_t g = 0; g < a.G; ++g) {
#define SPECDEC_ZERO(t) _tile_zero(t);
    SPECDEC_FOR_4_TILES(SPECDEC_ZERO)
#undef SPECDEC_ZERO
    for (int64_t cc = 0; cc < a.CW; ++cc) {
      _tile_loadd(5, a.qt + (cc * a.G + g) * 256, 64);
#define SPECDEC_QK(t)                                   \
  _tile_loadd(4, kptr + 16 * (t) * kld + 64 * cc, kld); \
  _tile_dpbf16ps(t, 4, 5);
      SPECDEC_FOR_4_TILES(SPECDEC_QK)
#undef SPECDEC_QK
    }
#define SPECDEC_STORE_S(t) _tile_stored(t, a.st + 16 * (t) * a.Mp + 16 * g, a.Mp * 4);
    SPECDEC_FOR_4_TILES(SPECDEC_STORE_S)
#undef SPECDEC_STORE_S
  }
}

// V rows j, j + 1 interleaved into key-pair words [32 pairs, D] (the B operand of P . V); rows
// past the block's keys are zero (their probabilities are zero too; zeros keep 0 * x finite).
void value_pairs(const AmxChunk& a, const int32_t* sl, int64_t nk) {
  const AttnChunk& c = a.c;
  const __m512i interleave = interleave_halves();
  const int64_t npairs = (nk + 1) / 2;
  for (int64_t j2 = 0; j2 < npairs; ++j2) {
    const char* r0 = a.vbase + sl[2 * j2 * c.slot_stride] * a.vstride;
    const bool odd = 2 * j2 + 1 < nk;  // an odd last key pairs with zeros
    const char* r1 = odd ? a.vbase + sl[(2 * j2 + 1) * c.slot_stride] * a.vstride : r0;
    uint32_t* dst = a.vp + j2 * a.D;
    for (int64_t d = 0; d < a.D; d += 16) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + d * 2));
      const __m256i hi = odd ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + d * 2))
                             : _mm256_setzero_si256();
      const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      _mm512_storeu_si512(dst + d, _mm512_permutexvar_epi16(interleave, ab));
    }
  }
  std::memset(a.vp + npairs * a.D, 0, (kPairs - npairs) * a.D * sizeof(uint32_t));
}

// Group g's block max per lane over its visible keys. Uncapped scores with a positive scale
// take it over the raw products (the scale is monotone); capped ones are scaled, capped and
// stored back for the exp pass.
__m512 group_block_max(const AmxChunk& a, float* sg, int64_t nk, bool all_visible, uint16_t lanes) {
  const __m512 scale = _mm512_set1_ps(a.scale);
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  if (a.raw_max) {
    for (int64_t j = 0; j < nk; ++j) {
      mx = _mm512_mask_max_ps(mx, all_visible ? lanes : a.vis[j], mx,
                              _mm512_loadu_ps(sg + j * a.Mp));
    }
    return _mm512_mul_ps(mx, scale);
  }
  for (int64_t j = 0; j < nk; ++j) {
    __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sg + j * a.Mp), scale);
    if (a.cap > 0) x = soft_cap512(x, a.cap);
    _mm512_storeu_ps(sg + j * a.Mp, x);
    mx = _mm512_mask_max_ps(mx, all_visible ? lanes : a.vis[j], mx, x);
  }
  return mx;
}

// Lanes of group g whose block max passes the reference by more than kLazyMargin move it (a
// lane with no key yet moves at its first visible one); their acc rows and sums are rescaled
// by alpha = exp(m_old - m_new) (0 for a lane with no key yet: its acc and sum are 0). Returns
// the group's reference max after the block.
__m512 move_reference(const AmxChunk& a, int64_t g, __m512 mx) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 m_old = _mm512_loadu_ps(a.mref + 16 * g);
  const __mmask16 move =
      _mm512_cmp_ps_mask(mx, _mm512_add_ps(m_old, _mm512_set1_ps(kLazyMargin)), _CMP_GT_OQ);
  const __m512 m_new = _mm512_mask_mov_ps(m_old, move, mx);
  if (!move) return m_new;
  const __m512 alpha = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_old, neg_inf, _CMP_NEQ_OQ) & move,
                                           exp512(_mm512_sub_ps(m_old, m_new)));
  alignas(64) float al[16];
  _mm512_store_ps(al, alpha);
  for (int l = 0; l < 16; ++l) {
    if (!((move >> l) & 1)) continue;
    float* row = a.acc + (16 * g + l) * a.D;
    const __m512 f = _mm512_set1_ps(al[l]);
    for (int64_t d = 0; d < a.D; d += 16)
      _mm512_storeu_ps(row + d, _mm512_mul_ps(f, _mm512_loadu_ps(row + d)));
  }
  const __m512 lsum = _mm512_loadu_ps(a.lsum + 16 * g);
  _mm512_storeu_ps(a.lsum + 16 * g, _mm512_mask_mul_ps(lsum, move, lsum, alpha));
  _mm512_storeu_ps(a.mref + 16 * g, m_new);
  return m_new;
}

// Group g's probabilities p = exp(x - m) = 2^(stored * kx - m log2 e) (stored: raw products with
// kx = scale log2 e, or scaled, capped scores with kx = log2 e) as bf16 key-pair words of P^T
// [32, 16 lanes] in pt, and their sum into lsum (from the same rounded values as P . V).
void group_probabilities(const AmxChunk& a, int64_t g, const float* sg, int64_t nk,
                         bool all_visible, uint16_t lanes, __m512 m_new) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 log2e = _mm512_set1_ps(kLog2e);
  const __m512 kx = _mm512_set1_ps(a.raw_max ? a.scale * kLog2e : kLog2e);
  const __m512i interleave = interleave_halves();
  // Lanes that have seen no key keep -inf; subtract 0 there (their probabilities are masked).
  const __m512 msub = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_new, neg_inf, _CMP_NEQ_OQ), m_new);
  const __m512 mb = _mm512_mul_ps(msub, log2e);
  __m512 lsum = _mm512_loadu_ps(a.lsum + 16 * g);
  for (int64_t j2 = 0; j2 < kPairs; ++j2) {
    const int64_t j = 2 * j2;
    __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
    if (j < nk) {
      p0 = _mm512_maskz_mov_ps(all_visible ? lanes : a.vis[j],
                               exp2_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(sg + j * a.Mp), kx, mb)));
    }
    if (j + 1 < nk) {
      p1 = _mm512_maskz_mov_ps(
          all_visible ? lanes : a.vis[j + 1],
          exp2_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(sg + (j + 1) * a.Mp), kx, mb)));
    }
    // Word l = (bf16 p0[l], bf16 p1[l]): the key pair of query l.
    const __m512i w = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    _mm512_storeu_si512(a.pt + j2 * 16, w);
    lsum = _mm512_add_ps(lsum, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    lsum = _mm512_add_ps(lsum, _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(-65536))));
  }
  _mm512_storeu_ps(a.lsum + 16 * g, lsum);
}

// P^T pair rows [32, 16 lanes] -> group g's P rows [16 queries, 32 pair words] (the A operand).
uint32_t* probability_rows(const AmxChunk& a, int64_t g) {
  uint32_t* const pg = a.pb + 16 * g * kPairs;
  for (int64_t half = 0; half < 2; ++half) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(a.pt + (16 * half + i) * 16));
    transpose16(r);
    for (int i = 0; i < 16; ++i)
      _mm512_storeu_ps(reinterpret_cast<float*>(pg + i * kPairs + 16 * half), r[i]);
  }
  return pg;
}

// acc [16 g .. 16 g + 16, D] += P [16 queries, 32 pairs] . V pairs [32, D].
void accumulate_pv(const AmxChunk& a, int64_t g, const uint32_t* pg) {
  const int64_t D = a.D;
  float* const ag = a.acc + 16 * g * D;
  int64_t dc = 0;
  for (; dc + 64 <= D; dc += 64) {
#define SPECDEC_LOAD_ACC(t) _tile_loadd(t, ag + dc + 16 * (t), D * 4);
    SPECDEC_FOR_4_TILES(SPECDEC_LOAD_ACC)
#undef SPECDEC_LOAD_ACC
    for (int64_t k0 = 0; k0 < kPairs; k0 += 16) {
      _tile_loadd(4, pg + k0, kPairs * 4);
#define SPECDEC_PV(t)                                   \
  _tile_loadd(5, a.vp + k0 * D + dc + 16 * (t), D * 4); \
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
      _tile_loadd(5, a.vp + k0 * D + dc, D * 4);
      _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, ag + dc, D * 4);
  }
}

// One key block [kb0, kb0 + nk): its scores, then per query group the online softmax
// (lane-wise) and its P . V on the tiles, so the tile products of one group overlap the vector
// work of the next.
void key_block(const AmxChunk& a, int64_t kb0, int64_t nk) {
  const AttnChunk& c = a.c;
  const int32_t* sl = c.slots + kb0 * c.slot_stride;
  const int64_t next = kb0 + kKeyBlock;
  const int64_t next_n = std::min<int64_t>(kKeyBlock, prefetch_limit(c) - next);
  // The next block's K rows now, its V rows after the scores (slots are scattered: the
  // hardware prefetcher cannot follow them).
  if (next_n > 0) prefetch_rows(c, a.kbase, c.k_stride_slot, next, next_n, a.row_bytes);
  int64_t kld;
  const char* kptr = key_rows(a, sl, nk, &kld);
  block_scores(a, kptr, kld);
  if (next_n > 0) prefetch_rows(c, a.vbase, c.v_stride_slot, next, next_n, a.row_bytes);
  value_pairs(a, sl, nk);
  const bool all_visible = kb0 + nk <= c.prefix && c.window <= 0;
  for (int64_t g = 0; g < a.G; ++g) {
    const uint16_t lanes =
        a.M - 16 * g >= 16 ? 0xFFFF : static_cast<uint16_t>((1u << (a.M - 16 * g)) - 1);
    if (!all_visible) block_visibility(c, a.M, g, kb0, nk, a.vis);
    float* sg = a.st + 16 * g;
    const __m512 m_new = move_reference(a, g, group_block_max(a, sg, nk, all_visible, lanes));
    group_probabilities(a, g, sg, nk, all_visible, lanes, m_new);
    accumulate_pv(a, g, probability_rows(a, g));
  }
}

}  // namespace

void attention_chunk_amx(const AttnChunk& c) {
  const AmxChunk a(c, amx_tls);
  configure_full_tiles(6);
  {
    const int64_t n0 = std::min<int64_t>(kKeyBlock, c.key_end - c.key_begin);
    prefetch_rows(c, a.kbase, c.k_stride_slot, c.key_begin, n0, a.row_bytes);
    prefetch_rows(c, a.vbase, c.v_stride_slot, c.key_begin, n0, a.row_bytes);
  }
  for (int64_t kb0 = c.key_begin; kb0 < c.key_end; kb0 += kKeyBlock)
    key_block(a, kb0, std::min<int64_t>(kKeyBlock, c.key_end - kb0));
  _tile_release();

  for (int64_t m = 0; m < a.M; ++m) {
    c.max[m] = a.mref[m];
    c.sum[m] = a.lsum[m];
  }
  if (a.acc != c.acc) std::memcpy(c.acc, a.acc, a.M * a.D * sizeof(float));
}

#undef SPECDEC_FOR_4_TILES

}  // namespace specdec
