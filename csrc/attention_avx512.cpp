// AVX-512 attention chunk kernel (built with -mavx512f/bw/vl/dq/bf16; run only when
// active_isa() >= AVX512): fp32 FMAs, bf16 products from avx512_bf16 dot products. Contract:
// AttnChunk in attention_isa.h. Layout: query vectors in rows, keys in vector lanes.
// Per block of 64 keys: the K rows are gathered through the slot table and transposed once into a
// [D, 64] tile shared by every query of the GQA group (16x16 register transposes; bf16 pairs travel
// as 32-bit words, the avx512_bf16 dot-product layout), scores come from broadcast-FMA (fp32) or
// _mm512_dpbf16_ps (bf16: exact products, fp32 sums), then a lazily rescaled online-softmax step
// and P.V (fp32 FMAs; bf16: probabilities rounded to bf16 against V rows interleaved into key
// pairs). The next block's rows are prefetched while this one computes.
#include "attention_kernel.h"

namespace specdec {
namespace {

constexpr int64_t kRowBlock = 4;  // queries per register tile

// The row / column tile ladders below are spelled out per product: a shared walker taking
// generic lambdas measured 3-5% slower in the one-chunk harness (GCC 12 inlined less of it).

// s[r, 0:64] = q_r . kt[:, 0:64] for R queries; q and kt hold 32-bit words (fp32 values or bf16
// pairs), kt is [W, 64].
template <int R, bool kBf16>
void qk_tile(const uint32_t* q, int64_t W, const uint32_t* kt, float* s) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t w = 0; w < W; ++w) {
    const uint32_t* kr = kt + w * kKeyBlock;
    __m512 kv[4];
    for (int c = 0; c < 4; ++c)
      kv[c] = _mm512_loadu_ps(reinterpret_cast<const float*>(kr + 16 * c));
    for (int r = 0; r < R; ++r) {
      const __m512i qb = _mm512_set1_epi32(static_cast<int>(q[r * W + w]));
      for (int c = 0; c < 4; ++c) {
        if constexpr (kBf16) {
          acc[r][c] =
              _mm512_dpbf16_ps(acc[r][c], (__m512bh)qb, (__m512bh)_mm512_castps_si512(kv[c]));
        } else {
          acc[r][c] = _mm512_fmadd_ps(_mm512_castsi512_ps(qb), kv[c], acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kKeyBlock + 16 * c, acc[r][c]);
}

template <bool kBf16>
void qk_rows(const uint32_t* q, int64_t M, int64_t W, const uint32_t* kt, float* s) {
  int64_t m = 0;
  for (; m + kRowBlock <= M; m += kRowBlock) {
    qk_tile<4, kBf16>(q + m * W, W, kt, s + m * kKeyBlock);
  }
  switch (M - m) {
    case 3: qk_tile<3, kBf16>(q + m * W, W, kt, s + m * kKeyBlock); break;
    case 2: qk_tile<2, kBf16>(q + m * W, W, kt, s + m * kKeyBlock); break;
    case 1: qk_tile<1, kBf16>(q + m * W, W, kt, s + m * kKeyBlock); break;
    default: break;
  }
}

// acc[r, dc:dc+16C] = alpha[r] * acc[r, ...] + sum_j p[r, j] * vrow[j][dc:dc+16C].
template <int R, int C>
void pv_tile(const float* p, const float* alpha, const float* const* vrow, int64_t nk, int64_t dc,
             float* acc, int64_t D) {
  __m512 a[R][C];
  for (int r = 0; r < R; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < C; ++c)
      a[r][c] = _mm512_mul_ps(al, _mm512_loadu_ps(acc + r * D + dc + 16 * c));
  }
  for (int64_t j = 0; j < nk; ++j) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(vrow[j] + dc + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 pb = _mm512_set1_ps(p[r * kKeyBlock + j]);
      for (int c = 0; c < C; ++c) a[r][c] = _mm512_fmadd_ps(pb, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * D + dc + 16 * c, a[r][c]);
}

// bf16 variant: p holds bf16 probabilities as key-pair words [R, 32], vp the block's V rows as
// key-pair words [32, D] (word (j/2, d) = (v[j][d], v[j+1][d])), so one _mm512_dpbf16_ps adds
// two keys' contributions to 16 outputs.
template <int R, int C>
void pv_tile_bf16(const uint32_t* p, const float* alpha, const uint32_t* vp, int64_t npairs,
                  int64_t dc, float* acc, int64_t D) {
  __m512 a[R][C];
  for (int r = 0; r < R; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < C; ++c)
      a[r][c] = _mm512_mul_ps(al, _mm512_loadu_ps(acc + r * D + dc + 16 * c));
  }
  for (int64_t j2 = 0; j2 < npairs; ++j2) {
    __m512i v[C];
    for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_si512(vp + j2 * D + dc + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512i pb = _mm512_set1_epi32(static_cast<int>(p[r * (kKeyBlock / 2) + j2]));
      for (int c = 0; c < C; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], (__m512bh)pb, (__m512bh)v[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * D + dc + 16 * c, a[r][c]);
}

template <int R>
void pv_cols_bf16(const uint32_t* p, const float* alpha, const uint32_t* vp, int64_t npairs,
                  float* acc, int64_t D) {
  int64_t dc = 0;
  for (; dc + 64 <= D; dc += 64) pv_tile_bf16<R, 4>(p, alpha, vp, npairs, dc, acc, D);
  switch ((D - dc) / 16) {
    case 3: pv_tile_bf16<R, 3>(p, alpha, vp, npairs, dc, acc, D); break;
    case 2: pv_tile_bf16<R, 2>(p, alpha, vp, npairs, dc, acc, D); break;
    case 1: pv_tile_bf16<R, 1>(p, alpha, vp, npairs, dc, acc, D); break;
    default: break;
  }
}

void pv_rows_bf16(const uint32_t* p, const float* alpha, const uint32_t* vp, int64_t npairs,
                  int64_t M, float* acc, int64_t D) {
  constexpr int64_t W = kKeyBlock / 2;
  int64_t m = 0;
  for (; m + kRowBlock <= M; m += kRowBlock) {
    pv_cols_bf16<4>(p + m * W, alpha + m, vp, npairs, acc + m * D, D);
  }
  switch (M - m) {
    case 3: pv_cols_bf16<3>(p + m * W, alpha + m, vp, npairs, acc + m * D, D); break;
    case 2: pv_cols_bf16<2>(p + m * W, alpha + m, vp, npairs, acc + m * D, D); break;
    case 1: pv_cols_bf16<1>(p + m * W, alpha + m, vp, npairs, acc + m * D, D); break;
    default: break;
  }
}

template <int R>
void pv_cols(const float* p, const float* alpha, const float* const* vrow, int64_t nk, float* acc,
             int64_t D) {
  int64_t dc = 0;
  for (; dc + 64 <= D; dc += 64) pv_tile<R, 4>(p, alpha, vrow, nk, dc, acc, D);
  switch ((D - dc) / 16) {
    case 3: pv_tile<R, 3>(p, alpha, vrow, nk, dc, acc, D); break;
    case 2: pv_tile<R, 2>(p, alpha, vrow, nk, dc, acc, D); break;
    case 1: pv_tile<R, 1>(p, alpha, vrow, nk, dc, acc, D); break;
    default: break;
  }
}

void pv_rows(const float* p, const float* alpha, const float* const* vrow, int64_t nk, int64_t M,
             float* acc, int64_t D) {
  int64_t m = 0;
  for (; m + kRowBlock <= M; m += kRowBlock) {
    pv_cols<4>(p + m * kKeyBlock, alpha + m, vrow, nk, acc + m * D, D);
  }
  switch (M - m) {
    case 3: pv_cols<3>(p + m * kKeyBlock, alpha + m, vrow, nk, acc + m * D, D); break;
    case 2: pv_cols<2>(p + m * kKeyBlock, alpha + m, vrow, nk, acc + m * D, D); break;
    case 1: pv_cols<1>(p + m * kKeyBlock, alpha + m, vrow, nk, acc + m * D, D); break;
    default: break;
  }
}

struct Scratch {
  std::vector<uint32_t> q, kt, zero, pb, vp;
  std::vector<float> s, alpha, thr, sumv;
};
thread_local Scratch tls;

}  // namespace

void attention_chunk_avx512(const AttnChunk& c) {
  const bool bf16 = c.dtype == AttnDtype::BFLOAT16;
  const int64_t D = c.head_dim, M = c.rows * c.heads, W = bf16 ? D / 2 : D;
  const int64_t elem = bf16 ? 2 : 4;
  Scratch& s = tls;
  s.q.resize(M * W);
  s.kt.resize(W * kKeyBlock);
  s.zero.assign(W, 0);
  s.s.resize(M * kKeyBlock);
  s.alpha.resize(M);
  if (bf16) {
    s.pb.resize(M * kKeyBlock / 2);
    s.vp.resize(kKeyBlock / 2 * D);
  }
  float* const acc = c.acc;

  // Queries as 32-bit words, vector m = (row m / heads, head m % heads).
  for (int64_t m = 0; m < M; ++m) {
    const char* src = static_cast<const char*>(c.q) +
                      ((m / c.heads) * c.q_stride_row + (m % c.heads) * c.q_stride_head) * elem;
    std::memcpy(s.q.data() + m * W, src, W * 4);
  }
  // c.max holds each row's reference max (see the softmax below); thr the score that moves it.
  for (int64_t m = 0; m < M; ++m) c.max[m] = -std::numeric_limits<float>::infinity();
  s.thr.assign(M, -std::numeric_limits<float>::infinity());
  s.sumv.assign(M * 16, 0.0f);
  std::memset(acc, 0, M * D * sizeof(float));
  const bool raw_max = c.logit_cap <= 0 && c.scale > 0;
  const __m512 scale = _mm512_set1_ps(c.scale);
  const __m512 kx = _mm512_set1_ps(raw_max ? c.scale * kLog2e : kLog2e);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());

  const char* kbase = static_cast<const char*>(c.k);
  const char* vbase = static_cast<const char*>(c.v);
  const float* vrow[kKeyBlock];
  // Row tails (c.row_tail): keys below `shared_end` are the committed prefix every query sees;
  // past it each row r reads its own keys row_tail[r] up to row_end[r], as its decode step does.
  const bool tails = c.row_tail != nullptr;
  const int64_t shared_end = tails ? std::min(c.key_end, c.tail_from) : c.key_end;
  // One key block [kb0, kb0 + nk) for queries [m0, m1): slot of key p = tail ? tail[p - tail_from]
  // : slots[p * slot_stride]; keys up to pf_end may be prefetched one block ahead.
  auto block = [&](int64_t kb0, int64_t nk, int64_t m0, int64_t m1, const int32_t* tail,
                   int64_t pf_end) {
    const int64_t Mq = m1 - m0;
    auto slot = [&](int64_t p) -> int64_t {
      return tail != nullptr ? tail[p - c.tail_from] : c.slots[p * c.slot_stride];
    };
    // K^T tile [W, 64] from the block's rows (missing rows read as zeros, masked below).
    const uint32_t* krow[kKeyBlock];
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      krow[j] =
          j < nk ? reinterpret_cast<const uint32_t*>(kbase + slot(kb0 + j) * c.k_stride_slot * elem)
                 : s.zero.data();
    }
    // Slots are scattered over the pool, so the hardware prefetcher cannot follow: the next
    // block's K and V rows are requested into L2 (the 32 KB L1 would evict them again before
    // use), 16 rows per transpose step, so the misses stay in flight while this block computes
    // instead of filling the miss queue in one burst.
    const int64_t next = kb0 + kKeyBlock;
    const int64_t next_n = tail != nullptr ? 0 : std::min<int64_t>(kKeyBlock, pf_end - next);
    for (int64_t jt = 0; jt < kKeyBlock; jt += 16) {
      const int64_t pn = std::min<int64_t>(16, next_n - jt);
      if (pn > 0) {
        prefetch_rows(c, kbase, c.k_stride_slot, next + jt, pn, D * elem);
        prefetch_rows(c, vbase, c.v_stride_slot, next + jt, pn, D * elem);
      }
      for (int64_t w0 = 0; w0 < W; w0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(krow[jt + i] + w0));
        transpose16(r);
        for (int i = 0; i < 16; ++i) {
          _mm512_storeu_ps(reinterpret_cast<float*>(s.kt.data() + (w0 + i) * kKeyBlock + jt), r[i]);
        }
      }
    }
    if (bf16) {
      qk_rows<true>(s.q.data() + m0 * W, Mq, W, s.kt.data(), s.s.data() + m0 * kKeyBlock);
    } else {
      qk_rows<false>(s.q.data() + m0 * W, Mq, W, s.kt.data(), s.s.data() + m0 * kKeyBlock);
    }

    // Online softmax with lazy rescaling: probabilities are taken relative to a per-row
    // reference max (c.max), which moves only when a block's max passes it by more than
    // kLazyMargin; so the common block needs no horizontal reduction, no scalar exp and no
    // rescale (alpha = 1). Uncapped scores with a positive scale compare raw products against
    // a raw threshold (the scale is monotone) and fold scale and max into one FMA before a
    // base-2 exp. Row sums stay 16-lane vectors until the end of the chunk.
    // (A row tail's full block takes the masked path with every bit set: the same numbers.)
    const bool all_visible =
        c.window <= 0 && nk == kKeyBlock && kb0 + nk <= (tails ? shared_end : c.prefix);
    int64_t last_t = -1;
    uint64_t bits = ~0ull;
    for (int64_t m = m0; m < m1; ++m) {
      float* sr = s.s.data() + m * kKeyBlock;
      if (!all_visible) {
        const int64_t t = c.row0 + m / c.heads;
        if (t != last_t) {
          bits = tails ? tail_bits(c, m / c.heads, kb0, nk) : visible_bits(c, t, kb0, nk);
          last_t = t;
        }
        if (bits == 0) {
          std::memset(sr, 0, kKeyBlock * sizeof(float));
          if (bf16)
            std::memset(s.pb.data() + m * (kKeyBlock / 2), 0, kKeyBlock / 2 * sizeof(uint32_t));
          s.alpha[m] = 1.0f;
          continue;
        }
      }
      __m512 x[4];
      for (int k = 0; k < 4; ++k) {
        x[k] = _mm512_loadu_ps(sr + 16 * k);
        if (!raw_max) {
          x[k] = _mm512_mul_ps(x[k], scale);
          if (c.logit_cap > 0) x[k] = soft_cap512(x[k], c.logit_cap);
        }
      }
      __m512 mx;
      if (all_visible) {
        mx = _mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]));
      } else {
        mx = neg_inf;
        for (int k = 0; k < 4; ++k)
          mx = _mm512_mask_max_ps(mx, static_cast<__mmask16>(bits >> (16 * k)), mx, x[k]);
      }
      __m512 sum = _mm512_loadu_ps(s.sumv.data() + 16 * m);
      float alpha = 1.0f;
      if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(s.thr[m]), _CMP_GT_OQ)) {
        // The reference moves to the block max: alpha = 0 when the row had no key yet.
        const float m_new = _mm512_reduce_max_ps(mx) * (raw_max ? c.scale : 1.0f);
        alpha = std::exp(c.max[m] - m_new);
        c.max[m] = m_new;
        s.thr[m] = raw_max ? (m_new + kLazyMargin) / c.scale : m_new + kLazyMargin;
        sum = _mm512_mul_ps(sum, _mm512_set1_ps(alpha));
      }
      s.alpha[m] = alpha;
      const __m512 mb = _mm512_set1_ps(c.max[m] * kLog2e);
      __m512 p[4];
      for (int k = 0; k < 4; ++k) {
        const __m512 t = _mm512_fmsub_ps(x[k], kx, mb);
        p[k] = bf16 ? exp2_bf16(t) : exp2_fp32(t);
        if (!all_visible)
          p[k] = _mm512_maskz_mov_ps(static_cast<__mmask16>(bits >> (16 * k)), p[k]);
      }
      if (bf16) {  // P.V runs on bf16 probabilities; the row sum uses the same rounded values
        uint32_t* pr = s.pb.data() + m * (kKeyBlock / 2);
        for (int k = 0; k < 4; k += 2) {
          const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(p[k + 1], p[k]);  // bf16 p[16k .. 16k+31]
          _mm512_storeu_si512(pr + 8 * k, h);
          sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));  // even keys
          sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_and_si512(
                                       h, _mm512_set1_epi32(-65536))));  // odd keys
        }
      } else {
        for (int k = 0; k < 4; ++k) _mm512_storeu_ps(sr + 16 * k, p[k]);
        sum =
            _mm512_add_ps(sum, _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])));
      }
      _mm512_storeu_ps(s.sumv.data() + 16 * m, sum);
    }

    if (!bf16) {  // fp32 V rows straight from the pool
      for (int64_t j = 0; j < nk; ++j) {
        vrow[j] = reinterpret_cast<const float*>(vbase + slot(kb0 + j) * c.v_stride_slot * elem);
      }
      pv_rows(s.s.data() + m0 * kKeyBlock, s.alpha.data() + m0, vrow, nk, Mq, acc + m0 * D, D);
      return;
    }
    // bf16: interleave V rows j, j+1 into key-pair words once for the whole group (an odd last
    // key pairs with zeros; its probability is zero too).
    const __m512i interleave =
        _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const int64_t npairs = (nk + 1) / 2;
    for (int64_t j2 = 0; j2 < npairs; ++j2) {
      const char* r0 = vbase + slot(kb0 + 2 * j2) * c.v_stride_slot * elem;
      const char* r1 = 2 * j2 + 1 < nk ? vbase + slot(kb0 + 2 * j2 + 1) * c.v_stride_slot * elem
                                       : reinterpret_cast<const char*>(s.zero.data());
      uint32_t* dst = s.vp.data() + j2 * D;
      for (int64_t d = 0; d < D; d += 16) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + d * 2));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + d * 2));
        const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        _mm512_storeu_si512(dst + d, _mm512_permutexvar_epi16(interleave, ab));
      }
    }
    // Pairs past the block's keys are zero (their probabilities are zero too; zeros keep 0 * x
    // finite for products that run over the whole block).
    std::memset(s.vp.data() + npairs * D, 0, (kKeyBlock / 2 - npairs) * D * sizeof(uint32_t));
    pv_rows_bf16(s.pb.data() + m0 * (kKeyBlock / 2), s.alpha.data() + m0, s.vp.data(), npairs, Mq,
                 acc + m0 * D, D);
  };

  {  // the first block's rows (later blocks are requested one block ahead, in block)
    const int64_t n0 = std::min<int64_t>(kKeyBlock, shared_end - c.key_begin);
    if (n0 > 0) {
      prefetch_rows(c, kbase, c.k_stride_slot, c.key_begin, n0, D * elem);
      prefetch_rows(c, vbase, c.v_stride_slot, c.key_begin, n0, D * elem);
    }
  }
  const int64_t pf_end = tails ? shared_end : prefetch_limit(c);
  for (int64_t kb0 = c.key_begin; kb0 < shared_end; kb0 += kKeyBlock) {
    block(kb0, std::min<int64_t>(kKeyBlock, shared_end - kb0), 0, M, nullptr, pf_end);
  }
  if (tails) {
    for (int64_t r = 0; r < c.rows; ++r) {
      const int64_t end = std::min(c.key_end, c.row_end[r]);
      for (int64_t kb0 = std::max(c.key_begin, c.tail_from); kb0 < end; kb0 += kKeyBlock) {
        block(kb0, std::min<int64_t>(kKeyBlock, end - kb0), r * c.heads, (r + 1) * c.heads,
              c.row_tail[r], 0);
      }
    }
  }
  for (int64_t m = 0; m < M; ++m)
    c.sum[m] = _mm512_reduce_add_ps(_mm512_loadu_ps(s.sumv.data() + 16 * m));
}

}  // namespace specdec
