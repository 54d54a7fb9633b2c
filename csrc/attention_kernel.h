// AVX-512 helpers shared by the attention chunk kernels (contract: AttnChunk in attention_isa.h):
// the key block, 16x16 transposes, exp / exp2 / soft-cap, block visibility and row prefetch.
// Included only by ISA translation units -- attention_avx512.cpp and attention_amx.cpp -- which
// compile it with their own flags; everything sits in an anonymous namespace, so the copies never
// merge at link time and no wide-ISA code can leak into the portable library.
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
  const __m512 th =
      _mm512_sub_ps(_mm512_set1_ps(1.0f),
                    _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
  return _mm512_mul_ps(th, _mm512_set1_ps(cap));
}

constexpr float kLog2e = 1.4426950408889634f;

// Lazy rescaling: probabilities may reach exp(kLazyMargin) relative to the reference max; bf16
// keeps its relative precision at any magnitude, and fp32 sums have room to spare.
constexpr float kLazyMargin = 8.0f;

// 2^t for t <= kLazyMargin * log2(e): 2^n * 2^f, n = round(t), |f| <= 1/2; t below -144
// flushes to ~0 through the clamp (scalef underflows cleanly). exp2_fp32: 2^f by its degree-7
// Taylor polynomial (relative error ~5e-9 before fp32 rounding); exp2_bf16: degree 4 (~4e-5,
// far below bf16's 2^-9 rounding of the probabilities).
inline __m512 exp2_fp32(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-144.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5252734e-05f);                  // ln2^7 / 5040
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530e-04f));  // ln2^6 / 720
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-03f));  // ln2^5 / 120
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-03f));  // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-02f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-01f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-01f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 exp2_bf16(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-144.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(0.009618129f);                 // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05550411f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265f));   // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931472f));   // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Visibility of the block's keys [kb0, kb0 + nk) for query row t, bit j = key kb0 + j.
uint64_t visible_bits(const AttnChunk& c, int64_t t, int64_t kb0, int64_t nk) {
  uint64_t bits = nk >= 64 ? ~0ull : ((1ull << nk) - 1);
  const int64_t lo_pos = query_pos(c, t) - c.window + 1;  // first position inside the window
  if (c.window > 0) {
    // Key indices below lo_pos are outside the window: a key's position never exceeds its
    // index (prefix keys: equal; tree keys: prefix + depth(e) <= prefix + e).
    const int64_t lo = lo_pos - kb0;  // first j not excluded by index
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
    if (!row[kb0 + j - c.prefix] || (c.window > 0 && key_pos(c, kb0 + j) < lo_pos)) {
      bits &= ~(1ull << j);
    }
  }
  return bits;
}

// Visibility of keys [kb0, kb0 + nk) for row r of a row-tail chunk (AttnChunk::row_tail): every
// key below its row_end, from its window's first position on; the bits visible_bits gives the
// decode step of the same position.
inline uint64_t tail_bits(const AttnChunk& c, int64_t r, int64_t kb0, int64_t nk) {
  const int64_t n = std::min<int64_t>(nk, c.row_end[r] - kb0);
  if (n <= 0) return 0;
  uint64_t bits = n >= 64 ? ~0ull : ((1ull << n) - 1);
  if (c.window > 0) {
    const int64_t lo = c.row_end[r] - c.window - kb0;  // first j inside the window
    if (lo >= 64) return 0;
    if (lo > 0) bits &= ~((1ull << lo) - 1);
  }
  return bits;
}

// Key rows [p0, p0 + n) of the chunk into L2. always_inline: GCC 12 once found an out-of-line
// version free of side effects (prefetches only) and deleted its calls, every prefetch of the
// kernels (docs/decisions.md).
__attribute__((always_inline)) inline void prefetch_rows(const AttnChunk& c, const char* base,
                                                         int64_t stride, int64_t p0, int64_t n,
                                                         int64_t row_bytes) {
  for (int64_t j = 0; j < n; ++j) {
    const char* row = base + c.slots[(p0 + j) * c.slot_stride] * stride * (row_bytes / c.head_dim);
    for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(row + off, _MM_HINT_T1);
  }
}

}  // namespace
}  // namespace specdec
