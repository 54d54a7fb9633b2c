// Shared body of the SIMD attention chunk kernels (contract: AttnChunk in attention_isa.h).
// Included only by ISA translation units -- attention_avx512.cpp and attention_amx.cpp -- which
// compile it with their own flags; everything sits in an anonymous namespace, so the copies never
// merge at link time and no wide-ISA code can leak into the portable library.
// Per block of 64 keys: the K rows are gathered through the slot table and transposed once into a
// [D, 64] tile shared by every query of the GQA group (16x16 register transposes; bf16 pairs travel
// as 32-bit words, the avx512_bf16 / AMX dot-product layout), scores come from broadcast-FMA (fp32)
// or the Bf16Ops products (bf16: exact products, fp32 sums), then an online-softmax step and P.V
// (fp32 FMAs; bf16: probabilities rounded to bf16 against V rows interleaved into key pairs).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_isa.h"

namespace specdec {
namespace {

constexpr int64_t kKeyBlock = 64;  // keys per online-softmax step: 4 zmm of scores per query
constexpr int64_t kRowBlock = 4;   // queries per register tile

// In-register transpose of 16 rows of 16 32-bit words.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
  }
}

// exp(x) for finite x (clamped to [-87, 88]): Cody-Waite reduction by ln 2, degree-7 Taylor
// polynomial on |r| <= ln2/2 (relative error ~1e-8 before fp32 rounding), scalef by 2^n.
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// cap * tanh(x / cap), tanh(y) = 1 - 2 / (exp(2y) + 1) (saturates to +-1 through the clamp).
inline __m512 soft_cap512(__m512 x, float cap) {
  const __m512 e = exp512(_mm512_mul_ps(x, _mm512_set1_ps(2.0f / cap)));
  const __m512 th = _mm512_sub_ps(
      _mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
  return _mm512_mul_ps(th, _mm512_set1_ps(cap));
}

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
    for (int c = 0; c < 4; ++c) kv[c] = _mm512_loadu_ps(reinterpret_cast<const float*>(kr + 16 * c));
    for (int r = 0; r < R; ++r) {
      const __m512i qb = _mm512_set1_epi32(static_cast<int>(q[r * W + w]));
      for (int c = 0; c < 4; ++c) {
        if constexpr (kBf16) {
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)qb, (__m512bh)_mm512_castps_si512(kv[c]));
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
  for (; m + kRowBlock <= M; m += kRowBlock) qk_tile<4, kBf16>(q + m * W, W, kt, s + m * kKeyBlock);
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
    for (int c = 0; c < C; ++c) a[r][c] = _mm512_mul_ps(al, _mm512_loadu_ps(acc + r * D + dc + 16 * c));
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
    for (int c = 0; c < C; ++c) a[r][c] = _mm512_mul_ps(al, _mm512_loadu_ps(acc + r * D + dc + 16 * c));
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
  for (; m + kRowBlock <= M; m += kRowBlock) pv_cols_bf16<4>(p + m * W, alpha + m, vp, npairs, acc + m * D, D);
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

// Visibility of the block's keys [kb0, kb0 + nk) for query row t, bit j = key kb0 + j.
uint64_t visible_bits(const AttnChunk& c, int64_t t, int64_t kb0, int64_t nk) {
  uint64_t bits = nk >= 64 ? ~0ull : ((1ull << nk) - 1);
  if (c.window > 0) {
    const int64_t lo = c.prefix + t - c.window + 1 - kb0;  // first visible j
    if (lo >= 64) return 0;
    if (lo > 0) bits &= ~((1ull << lo) - 1);
  }
  const int64_t first_new = c.prefix - kb0;  // j of new token 0
  if (first_new >= nk) return bits;
  if (c.tree == nullptr) {
    const int64_t hi = c.prefix + t - kb0;  // last visible j (causal)
    if (hi < 0) return 0;
    if (hi < 63) bits &= (1ull << (hi + 1)) - 1;
    return bits;
  }
  const uint8_t* row = c.tree + t * c.tree_stride;
  for (int64_t j = first_new < 0 ? 0 : first_new; j < nk; ++j) {
    if (!row[kb0 + j - c.prefix]) bits &= ~(1ull << j);
  }
  return bits;
}

void prefetch_rows(const AttnChunk& c, const char* base, int64_t stride, int64_t p0, int64_t n,
                   int64_t row_bytes) {
  for (int64_t j = 0; j < n; ++j) {
    const char* row = base + c.slots[(p0 + j) * c.slot_stride] * stride * (row_bytes / c.head_dim);
    for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(row + off, _MM_HINT_T1);
  }
}

struct Scratch {
  std::vector<uint32_t> q, kt, zero, pb, vp;
  std::vector<float> s, alpha, acc;
};
thread_local Scratch tls;

// The chunk kernel. Bf16Ops supplies the bf16 matrix products -- qk(q, Mp, W, kt, s): s [Mp, 64] =
// q [Mp, W words] . kt [W, 64]; pv(p, alpha, vp, npairs, Mp, acc, D): acc [Mp, D] = alpha * acc +
// p [Mp, 32 pair words] . vp [32 pairs, D] (pairs >= npairs are zero) -- and kRowPad, the
// multiple the query rows are padded to (padding rows are zero).
template <class Bf16Ops>
void attention_chunk_simd(const AttnChunk& c) {
  const bool bf16 = c.dtype == AttnDtype::BFLOAT16;
  const int64_t D = c.head_dim, M = c.rows * c.heads, W = bf16 ? D / 2 : D;
  const int64_t elem = bf16 ? 2 : 4;
  const int64_t Mp = bf16 ? (M + Bf16Ops::kRowPad - 1) / Bf16Ops::kRowPad * Bf16Ops::kRowPad : M;
  Scratch& s = tls;
  s.q.assign(Mp * W, 0);
  s.kt.resize(W * kKeyBlock);
  s.zero.assign(W, 0);
  s.s.resize(Mp * kKeyBlock);
  s.alpha.assign(Mp, 0.0f);
  if (bf16) {
    s.pb.assign(Mp * kKeyBlock / 2, 0);
    s.vp.resize(kKeyBlock / 2 * D);
  }
  // Padded rows accumulate into scratch; the chunk's own [M, D] output gets the first M rows.
  float* acc = c.acc;
  if (Mp != M) {
    s.acc.resize(Mp * D);
    acc = s.acc.data();
  }

  // Queries as 32-bit words, vector m = (row m / heads, head m % heads).
  for (int64_t m = 0; m < M; ++m) {
    const char* src = static_cast<const char*>(c.q) +
                      ((m / c.heads) * c.q_stride_row + (m % c.heads) * c.q_stride_head) * elem;
    std::memcpy(s.q.data() + m * W, src, W * 4);
  }
  for (int64_t m = 0; m < M; ++m) {
    c.max[m] = -std::numeric_limits<float>::infinity();
    c.sum[m] = 0.0f;
  }
  std::memset(acc, 0, Mp * D * sizeof(float));

  const char* kbase = static_cast<const char*>(c.k);
  const char* vbase = static_cast<const char*>(c.v);
  const float* vrow[kKeyBlock];
  {  // the first block's rows (later blocks are requested one block ahead, below)
    const int64_t n0 = std::min<int64_t>(kKeyBlock, c.key_end - c.key_begin);
    prefetch_rows(c, kbase, c.k_stride_slot, c.key_begin, n0, D * elem);
    prefetch_rows(c, vbase, c.v_stride_slot, c.key_begin, n0, D * elem);
  }
  for (int64_t kb0 = c.key_begin; kb0 < c.key_end; kb0 += kKeyBlock) {
    const int64_t nk = std::min<int64_t>(kKeyBlock, c.key_end - kb0);
    // K^T tile [W, 64] from the block's rows (missing rows read as zeros, masked below).
    const uint32_t* krow[kKeyBlock];
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      krow[j] = j < nk ? reinterpret_cast<const uint32_t*>(
                             kbase + c.slots[(kb0 + j) * c.slot_stride] * c.k_stride_slot * elem)
                       : s.zero.data();
    }
    // Slots are scattered over the pool, so the hardware prefetcher cannot follow: the next
    // block's K and V rows are requested into L2 (the 32 KB L1 would evict them again before
    // use), 16 rows per transpose step, so the misses stay in flight while this block computes
    // instead of filling the miss queue in one burst.
    const int64_t next = kb0 + kKeyBlock;
    const int64_t next_n = std::min<int64_t>(kKeyBlock, c.key_end - next);
    for (int64_t jt = 0; jt < kKeyBlock; jt += 16) {
      const int64_t pn = std::min<int64_t>(16, next_n - jt);
      if (pn > 0) {
        prefetch_rows(c, kbase, c.k_stride_slot, next + jt, pn, D * elem);
        prefetch_rows(c, vbase, c.v_stride_slot, next + jt, pn, D * elem);
      }
      for (int64_t w0 = 0; w0 < W; w0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(krow[jt + i] + w0));
        transpose16(r);
        for (int i = 0; i < 16; ++i) {
          _mm512_storeu_ps(reinterpret_cast<float*>(s.kt.data() + (w0 + i) * kKeyBlock + jt), r[i]);
        }
      }
    }
    if (bf16) {
      Bf16Ops::qk(s.q.data(), Mp, W, s.kt.data(), s.s.data());
    } else {
      qk_rows<false>(s.q.data(), M, W, s.kt.data(), s.s.data());
    }

    // Online softmax: scores -> probabilities relative to the running row max.
    const __m512 scale = _mm512_set1_ps(c.scale);
    for (int64_t m = 0; m < M; ++m) {
      float* sr = s.s.data() + m * kKeyBlock;
      const uint64_t bits = visible_bits(c, c.row0 + m / c.heads, kb0, nk);
      __m512 x[4];
      __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int k = 0; k < 4; ++k) {
        const __mmask16 vis = static_cast<__mmask16>(bits >> (16 * k));
        x[k] = _mm512_mul_ps(_mm512_loadu_ps(sr + 16 * k), scale);
        if (c.logit_cap > 0) x[k] = soft_cap512(x[k], c.logit_cap);
        mx = _mm512_mask_max_ps(mx, vis, mx, x[k]);
      }
      const float block_max = _mm512_reduce_max_ps(mx);
      const float m_new = std::max(c.max[m], block_max);
      if (bits == 0 || m_new == -std::numeric_limits<float>::infinity()) {
        std::memset(sr, 0, kKeyBlock * sizeof(float));
        if (bf16) std::memset(s.pb.data() + m * (kKeyBlock / 2), 0, kKeyBlock / 2 * sizeof(uint32_t));
        s.alpha[m] = 1.0f;
        continue;
      }
      const float alpha = std::exp(c.max[m] - m_new);  // 0 when the row had no key yet
      const __m512 mn = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      __m512 p[4];
      for (int k = 0; k < 4; ++k) {
        const __mmask16 vis = static_cast<__mmask16>(bits >> (16 * k));
        p[k] = _mm512_maskz_mov_ps(vis, exp512(_mm512_sub_ps(x[k], mn)));
      }
      if (bf16) {  // P.V runs on bf16 probabilities; the row sum uses the same rounded values
        uint32_t* pr = s.pb.data() + m * (kKeyBlock / 2);
        for (int k = 0; k < 4; k += 2) {
          const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(p[k + 1], p[k]);  // bf16 p[16k .. 16k+31]
          _mm512_storeu_si512(pr + 8 * k, h);
          sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));  // even keys
          sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_and_si512(h, _mm512_set1_epi32(-65536))));  // odd keys
        }
      } else {
        for (int k = 0; k < 4; ++k) {
          sum = _mm512_add_ps(sum, p[k]);
          _mm512_storeu_ps(sr + 16 * k, p[k]);
        }
      }
      c.sum[m] = c.sum[m] * alpha + _mm512_reduce_add_ps(sum);
      c.max[m] = m_new;
      s.alpha[m] = alpha;
    }

    if (!bf16) {  // fp32 V rows straight from the pool
      for (int64_t j = 0; j < nk; ++j) {
        vrow[j] = reinterpret_cast<const float*>(
            vbase + c.slots[(kb0 + j) * c.slot_stride] * c.v_stride_slot * elem);
      }
      pv_rows(s.s.data(), s.alpha.data(), vrow, nk, M, acc, D);
      continue;
    }
    // bf16: interleave V rows j, j+1 into key-pair words once for the whole group (an odd last
    // key pairs with zeros; its probability is zero too).
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                                24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                                1, 16, 0);
    const int64_t npairs = (nk + 1) / 2;
    for (int64_t j2 = 0; j2 < npairs; ++j2) {
      const char* r0 = vbase + c.slots[(kb0 + 2 * j2) * c.slot_stride] * c.v_stride_slot * elem;
      const char* r1 = 2 * j2 + 1 < nk
          ? vbase + c.slots[(kb0 + 2 * j2 + 1) * c.slot_stride] * c.v_stride_slot * elem
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
    Bf16Ops::pv(s.pb.data(), s.alpha.data(), s.vp.data(), npairs, Mp, acc, D);
  }
  if (acc != c.acc) std::memcpy(c.acc, acc, M * D * sizeof(float));
}

}  // namespace
}  // namespace specdec
