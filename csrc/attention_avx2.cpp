// AVX2 attention chunk kernel (built with -mavx2 -mfma -mf16c; run when active_isa() >= AVX2 and
// head_dim % 8 == 0, unless a wider kernel takes the call): the AttnChunk contract of
// attention_isa.h on 8 fp32 lanes, per block of 64 keys. bf16 K/V rows are widened to fp32 once
// per block (exact) and shared by every query of the GQA group; all arithmetic is fp32.
// The block's keys are transposed once to [D, 64], and tiles of up to 6 queries run two
// register-blocked products, like a GEMM micro-kernel: S [6, 16 keys] from broadcast q[d] times a
// K^T row, and O [6, 16 dims] += broadcast p[j] times a V row; each K^T or V vector loaded feeds
// up to 6 FMAs. Every chunk takes this path, decode's few queries included: a row then sums
// q . k in the same order whichever call it comes in (verify rows == decode rows bit for bit),
// and it also measured faster than per-query dot products for decode (docs/decisions.md).
// No std:: containers: template code compiled with AVX2 flags must not be shared with the
// portable library.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "attention_isa.h"
#include "isa_util.h"

namespace specdec {
namespace {

constexpr int64_t kKeyBlock = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

thread_local ScratchBuffer t_q, t_k, t_v, t_kt, t_zero;

// D elements of a row as fp32 (D % 8 == 0).
inline void widen_row(const uint16_t* src, int64_t D, float* dst) {
  for (int64_t d = 0; d < D; d += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d));
    _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
}

// exp(x) for x clamped to [-87, 88]: Cody-Waite reduction by ln 2, degree-7 Taylor polynomial on
// |r| <= ln2/2, times 2^n built in the exponent field.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline bool visible(const AttnChunk& c, int64_t t, int64_t p) {
  if (c.window > 0 && key_pos(c, p) <= query_pos(c, t) - c.window) return false;
  if (p < c.prefix) return true;
  const int64_t e = p - c.prefix;
  return c.tree == nullptr ? e <= t : c.tree[t * c.tree_stride + e] != 0;
}

// 8x8 transpose: column i of the 8 rows r[0..7] becomes r[i].
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// kt[d * 64 + j] = krow[j][d] for the block's 64 key rows (rows past its keys point at zeros).
inline void transpose_keys(const float* const* krow, int64_t D, float* kt) {
  for (int64_t j0 = 0; j0 < kKeyBlock; j0 += 8) {
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(krow[j0 + i] + d0);
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_store_ps(kt + (d0 + i) * kKeyBlock + j0, r[i]);
    }
  }
}

// The register tile both products share: o[i][h] += sum_t a[i * a_stride + t] *
// b[t * b_stride + 8h : +8] for i < MT, h < W, t < steps (W * MT accumulators; each b vector
// loaded feeds MT FMAs). always_inline: GCC keeps the accumulators of an inlined tile in
// registers.
template <int MT, int W>
__attribute__((always_inline)) inline void tile_fma(const float* a, int64_t a_stride,
                                                    const float* b, int64_t b_stride, int64_t steps,
                                                    __m256 o[MT][W]) {
  for (int64_t t = 0; t < steps; ++t) {
    __m256 bv[W];
    for (int h = 0; h < W; ++h) bv[h] = _mm256_loadu_ps(b + t * b_stride + 8 * h);
    for (int i = 0; i < MT; ++i) {
      const __m256 ab = _mm256_broadcast_ss(a + i * a_stride + t);
      for (int h = 0; h < W; ++h) o[i][h] = _mm256_fmadd_ps(ab, bv[h], o[i][h]);
    }
  }
}

// s[i * 64 + j] = q_i . k_j for MT queries (rows of q, stride D) and the block's 64 keys, from
// the transposed block kt [D, 64], 16 keys at a time.
template <int MT>
inline void scores_tile(const float* q, const float* kt, int64_t D, float* s) {
  for (int64_t j0 = 0; j0 < kKeyBlock; j0 += 16) {
    __m256 a[MT][2];
    for (int i = 0; i < MT; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
    tile_fma<MT, 2>(q, D, kt + j0, kKeyBlock, D, a);
    for (int i = 0; i < MT; ++i) {
      _mm256_store_ps(s + i * kKeyBlock + j0, a[i][0]);
      _mm256_store_ps(s + i * kKeyBlock + j0 + 8, a[i][1]);
    }
  }
}

// pv_tile over dims [d0, d0 + 8W).
template <int MT, int W>
inline void pv_dims(const float* p, const float* v, int64_t nk, const float* alpha, float* acc,
                    int64_t D, int64_t d0) {
  __m256 o[MT][W];
  for (int i = 0; i < MT; ++i) {
    const __m256 al = _mm256_set1_ps(alpha[i]);
    for (int h = 0; h < W; ++h)
      o[i][h] = _mm256_mul_ps(_mm256_loadu_ps(acc + i * D + d0 + 8 * h), al);
  }
  tile_fma<MT, W>(p, kKeyBlock, v + d0, D, nk, o);
  for (int i = 0; i < MT; ++i)
    for (int h = 0; h < W; ++h) _mm256_storeu_ps(acc + i * D + d0 + 8 * h, o[i][h]);
}

// acc_i[0:D] = alpha_i * acc_i + sum_j p_i[j] * v_j for MT queries (p rows of 64, acc rows of D)
// over the block's nk keys (v: the block's dense V rows [64, D]), 16 (then 8) dims at a time.
template <int MT>
inline void pv_tile(const float* p, const float* v, int64_t nk, const float* alpha, float* acc,
                    int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    if (d0 + 16 <= D) {
      pv_dims<MT, 2>(p, v, nk, alpha, acc, D, d0);
    } else {  // D % 16 == 8
      pv_dims<MT, 1>(p, v, nk, alpha, acc, D, d0);
    }
  }
}

// One query's online-softmax step over the block: s [64] holds its raw scores on entry and its
// weights p on return (0 for keys it does not see) and *alpha the factor for its old acc. Returns
// false when the query sees no key of the block: its state is unchanged (alpha 1, p all 0).
inline bool softmax_step(const AttnChunk& c, int64_t m, int64_t kb0, int64_t nk, bool all_visible,
                         float* s, float* alpha_out) {
  const int64_t t = c.row0 + m / c.heads;
  float block_max = kNegInf;
  if (all_visible && c.logit_cap <= 0) {  // the common case, vectorized
    const __m256 scale = _mm256_set1_ps(c.scale);
    __m256 mx = _mm256_set1_ps(kNegInf);
    for (int64_t j = 0; j < kKeyBlock; j += 8) {
      __m256 x = _mm256_mul_ps(_mm256_load_ps(s + j), scale);
      if (j + 8 > nk) {  // keys past the block's end
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, x);
        for (int64_t i = 0; i < 8; ++i) {
          if (j + i >= nk) lanes[i] = kNegInf;
        }
        x = _mm256_load_ps(lanes);
      }
      _mm256_store_ps(s + j, x);
      mx = _mm256_max_ps(mx, x);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    block_max = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  } else {
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      float x = s[j] * c.scale;
      if (c.logit_cap > 0) x = c.logit_cap * std::tanh(x / c.logit_cap);
      if (j >= nk ||
          (!all_visible && !(c.row_tail != nullptr ? tail_visible(c, m / c.heads, kb0 + j)
                                                   : visible(c, t, kb0 + j)))) {
        x = kNegInf;
      }
      s[j] = x;
      block_max = x > block_max ? x : block_max;
    }
  }
  if (block_max == kNegInf) {
    std::memset(s, 0, kKeyBlock * sizeof(float));
    *alpha_out = 1.0f;
    return false;
  }
  const float m_new = c.max[m] > block_max ? c.max[m] : block_max;
  // 0 when the row had no key yet; 1 (no exp) when the block did not raise its max.
  const float alpha = c.max[m] == m_new ? 1.0f : std::exp(c.max[m] - m_new);
  const __m256 mn = _mm256_set1_ps(m_new), ninf = _mm256_set1_ps(kNegInf);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < kKeyBlock; j += 8) {
    const __m256 x = _mm256_load_ps(s + j);
    // exp clamps its input, so an invisible key (-inf) is zeroed explicitly.
    const __m256 p =
        _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), exp256(_mm256_sub_ps(x, mn)));
    sum = _mm256_add_ps(sum, p);
    _mm256_store_ps(s + j, p);
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  const float total = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  c.sum[m] = c.sum[m] * alpha + total;
  c.max[m] = m_new;
  *alpha_out = alpha;
  return true;
}

// Queries [m0, m0 + MT) against the block: scores, softmax steps, P.V.
template <int MT>
inline void query_tile(const AttnChunk& c, const float* q, const float* kt, const float* v,
                       int64_t m0, int64_t kb0, int64_t nk, bool all_visible, float* s) {
  const int64_t D = c.head_dim;
  scores_tile<MT>(q + m0 * D, kt, D, s);
  float alpha[MT];
  for (int i = 0; i < MT; ++i)
    softmax_step(c, m0 + i, kb0, nk, all_visible, s + i * kKeyBlock, alpha + i);
  pv_tile<MT>(s, v, nk, alpha, c.acc + m0 * D, D);
}

constexpr int kTileQueries = 6;  // queries per register tile

}  // namespace

void attention_chunk_avx2(const AttnChunk& c) {
  const bool bf16 = c.dtype == AttnDtype::BFLOAT16;
  const int64_t D = c.head_dim, M = c.rows * c.heads, elem = bf16 ? 2 : 4;
  float* q = t_q.get(M * D);
  float* kbuf = bf16 ? t_k.get(kKeyBlock * D) : nullptr;
  // fp32 V rows are copied into a dense block: P.V re-reads every row once per tile of queries,
  // and 64 rows scattered over the pool would thrash the L1 TLB.
  float* vbuf = t_v.get(kKeyBlock * D);
  float* kt = t_kt.get(kKeyBlock * D);
  float* zero = t_zero.get(D);
  std::memset(zero, 0, D * sizeof(float));
  for (int64_t m = 0; m < M; ++m) {
    const char* src = static_cast<const char*>(c.q) +
                      ((m / c.heads) * c.q_stride_row + (m % c.heads) * c.q_stride_head) * elem;
    if (bf16)
      widen_row(reinterpret_cast<const uint16_t*>(src), D, q + m * D);
    else
      std::memcpy(q + m * D, src, D * sizeof(float));
    c.max[m] = kNegInf;
    c.sum[m] = 0.0f;
  }
  std::memset(c.acc, 0, M * D * sizeof(float));
  const char* kbase = static_cast<const char*>(c.k);
  const char* vbase = static_cast<const char*>(c.v);
  const float* krow[kKeyBlock];
  const float* vrow[kKeyBlock];
  alignas(32) float sc[kTileQueries * kKeyBlock];  // scores, then weights, of a tile of queries
  // Row tails (c.row_tail): keys below shared_end are the prefix every query sees; past it row r
  // reads its own keys row_tail[r] up to row_end[r], as its decode step does.
  const bool tails = c.row_tail != nullptr;
  const int64_t shared_end = tails ? std::min(c.key_end, c.tail_from) : c.key_end;
  // One key block [kb0, kb0 + nk) for queries [m0, m1); slot of key p = tail ? tail[p -
  // tail_from] : slots[p * slot_stride].
  auto block = [&](int64_t kb0, int64_t nk, int64_t m0, int64_t m1, const int32_t* tail) {
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      if (j >= nk) {
        krow[j] = vrow[j] = zero;
        continue;
      }
      const int64_t slot =
          tail != nullptr ? tail[kb0 + j - c.tail_from] : c.slots[(kb0 + j) * c.slot_stride];
      const char* kr = kbase + slot * c.k_stride_slot * elem;
      const char* vr = vbase + slot * c.v_stride_slot * elem;
      if (bf16) {
        widen_row(reinterpret_cast<const uint16_t*>(kr), D, kbuf + j * D);
        widen_row(reinterpret_cast<const uint16_t*>(vr), D, vbuf + j * D);
        krow[j] = kbuf + j * D;
        vrow[j] = vbuf + j * D;
      } else {
        krow[j] = reinterpret_cast<const float*>(kr);
        vrow[j] = reinterpret_cast<const float*>(vr);
        std::memcpy(vbuf + j * D, vrow[j], D * sizeof(float));
      }
    }
    // Every key of a block inside the committed prefix is visible to every row (no window).
    const bool all_visible = c.window <= 0 && kb0 + nk <= (tails ? shared_end : c.prefix);
    // The next block's K/V rows are scattered over the pool, so no hardware prefetcher finds
    // them: ask for them now, into L2, while this block's tiles compute.
    const int64_t next_end =
        tail != nullptr
            ? 0
            : std::min<int64_t>(kb0 + 2 * kKeyBlock, tails ? shared_end : prefetch_limit(c));
    for (int64_t p = kb0 + kKeyBlock; p < next_end; ++p) {
      const int64_t slot = c.slots[p * c.slot_stride];
      const char* kr = kbase + slot * c.k_stride_slot * elem;
      const char* vr = vbase + slot * c.v_stride_slot * elem;
      for (int64_t off = 0; off < D * elem; off += 64) {
        _mm_prefetch(kr + off, _MM_HINT_T1);
        _mm_prefetch(vr + off, _MM_HINT_T1);
      }
    }
    transpose_keys(krow, D, kt);
    int64_t m = m0;
    for (; m + kTileQueries <= m1; m += kTileQueries)
      query_tile<kTileQueries>(c, q, kt, vbuf, m, kb0, nk, all_visible, sc);
    switch (m1 - m) {
      case 5: query_tile<5>(c, q, kt, vbuf, m, kb0, nk, all_visible, sc); break;
      case 4: query_tile<4>(c, q, kt, vbuf, m, kb0, nk, all_visible, sc); break;
      case 3: query_tile<3>(c, q, kt, vbuf, m, kb0, nk, all_visible, sc); break;
      case 2: query_tile<2>(c, q, kt, vbuf, m, kb0, nk, all_visible, sc); break;
      case 1: query_tile<1>(c, q, kt, vbuf, m, kb0, nk, all_visible, sc); break;
      default: break;
    }
  };
  for (int64_t kb0 = c.key_begin; kb0 < shared_end; kb0 += kKeyBlock) {
    block(kb0, std::min<int64_t>(kKeyBlock, shared_end - kb0), 0, M, nullptr);
  }
  if (tails) {
    for (int64_t r = 0; r < c.rows; ++r) {
      const int64_t end = std::min(c.key_end, c.row_end[r]);
      for (int64_t kb0 = std::max(c.key_begin, c.tail_from); kb0 < end; kb0 += kKeyBlock) {
        block(kb0, std::min<int64_t>(kKeyBlock, end - kb0), r * c.heads, (r + 1) * c.heads,
              c.row_tail[r]);
      }
    }
  }
}

}  // namespace specdec
