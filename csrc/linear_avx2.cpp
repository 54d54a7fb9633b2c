// AVX2 kernel of skinny_linear (see linear_isa.h), for x86-64 CPUs without AVX-512 (AMD Zen 1-3,
// Intel client cores): 8 fp32 lanes, FMA, 16 vector registers. Same weight-streaming plan as
// linear_avx512.cpp. AVX2 has no bf16 arithmetic: a bf16 weight is widened to fp32 in registers
// (a shift for the even element of a pair, a mask for the odd one: both exact), x is widened
// once per call into a per-thread fp32 copy, and the products and sums are fp32 FMAs, so bf16
// weights still move half the bytes of fp32 ones. No std:: containers: template code compiled
// with AVX2 flags must not be shared with the portable library.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "isa_util.h"
#include "linear_isa.h"

namespace specdec {
namespace {

inline float load_scalar(LinearDtype dtype, const void* p, int64_t i) {
  return dtype == LinearDtype::FLOAT32 ? static_cast<const float*>(p)[i]
                                       : bf16_to_float(static_cast<const uint16_t*>(p)[i]);
}

// y[m, n] = v (+ bias[n]) in the output dtype (a bf16 result rounded once, to nearest even).
inline void store(LinearDtype dtype, const void* bias, void* y, int64_t y_stride, int64_t m,
                  int64_t n, float v) {
  if (bias) v += load_scalar(dtype, bias, n);
  if (dtype == LinearDtype::FLOAT32)
    static_cast<float*>(y)[m * y_stride + n] = v;
  else
    static_cast<uint16_t*>(y)[m * y_stride + n] = round_to_bf16(v);
}

thread_local ScratchBuffer t_x;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// x rows [M, width] (row stride `stride`) as dense fp32 [M, width] in a per-thread buffer: fp32
// x is used in place, bf16 x is widened (exactly) once per call.
const float* fp32_rows(LinearDtype dtype, const void* x, int64_t stride, int64_t M, int64_t width,
                       int64_t* out_stride) {
  if (dtype == LinearDtype::FLOAT32) {
    *out_stride = stride;
    return static_cast<const float*>(x);
  }
  float* buf = t_x.get(M * width);
  const uint16_t* src = static_cast<const uint16_t*>(x);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < width; ++k) buf[m * width + k] = bf16_to_float(src[m * stride + k]);
  *out_stride = width;
  return buf;
}

// ---- Row kernel (dense weight rows) ----

// 8 weights of row w at k as fp32.
struct F32Row {
  using T = float;
  static __m256 load(const T* p) { return _mm256_loadu_ps(p); }
};
struct Bf16Row {
  using T = uint16_t;
  static __m256 load(const T* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};

// One weight row n times MB rows of x (fp32), U independent accumulators per x row.
template <class Ops, int MB, int U>
void row(const LinearBlock& b, const float* x, int64_t xs, int64_t n, int64_t m0) {
  using T = typename Ops::T;
  constexpr int64_t L = 8;
  const T* wr = static_cast<const T*>(b.w) + n * b.w_stride;
  const float* xr[MB];
  for (int j = 0; j < MB; ++j) xr[j] = x + (m0 + j) * xs;
  __m256 acc[MB][U];
  for (int j = 0; j < MB; ++j)
    for (int u = 0; u < U; ++u) acc[j][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + L * U <= b.K; k += L * U) {
    for (int u = 0; u < U; ++u) {
      const __m256 wv = Ops::load(wr + k + L * u);
      for (int j = 0; j < MB; ++j)
        acc[j][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr[j] + k + L * u), acc[j][u]);
    }
  }
  for (; k + L <= b.K; k += L) {
    const __m256 wv = Ops::load(wr + k);
    for (int j = 0; j < MB; ++j)
      acc[j][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr[j] + k), acc[j][0]);
  }
  for (int j = 0; j < MB; ++j) {
    __m256 s = acc[j][0];
    for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[j][u]);
    float v = hsum(s);
    for (int64_t kt = k; kt < b.K; ++kt) v += load_scalar(b.dtype, wr, kt) * xr[j][kt];
    store(b.dtype, b.bias, b.y, b.y_stride, m0 + j, n, v);
  }
}

template <class Ops>
void all_rows(const LinearBlock& b, const float* x, int64_t xs, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= b.M; m += 4) row<Ops, 4, 2>(b, x, xs, n, m);
  switch (b.M - m) {
    case 3: row<Ops, 3, 2>(b, x, xs, n, m); break;
    case 2: row<Ops, 2, 2>(b, x, xs, n, m); break;
    case 1: row<Ops, 1, 4>(b, x, xs, n, m); break;
    default: break;
  }
}

// ---- Packed weights (PackedLinearBlock in linear_isa.h) ----
// A block of 16 outputs is two 8-lane halves. fp32: one k step of a half is one vector. bf16:
// one pair step of a half is 8 words holding (k = 2kk, 2kk + 1) of 8 outputs; the even element
// is the word shifted left by 16, the odd one the word with its low half cleared.

struct F32Packed {
  static constexpr int64_t kChunk = 32;  // k steps per partial sum
  static constexpr int kParts = 1;       // fp32 vectors per half and step
  static constexpr int64_t kStepBytes = kPackLanes * 4;
  static void load(const char* w, __m256 out[2][2]) {
    out[0][0] = _mm256_loadu_ps(reinterpret_cast<const float*>(w));
    out[1][0] = _mm256_loadu_ps(reinterpret_cast<const float*>(w) + 8);
  }
};

struct Bf16Packed {
  static constexpr int64_t kChunk = 16;  // pair steps (32 k) per partial sum
  static constexpr int kParts = 2;
  static constexpr int64_t kStepBytes = kPackLanes * 4;  // 16 outputs x 2 bf16
  static void load(const char* w, __m256 out[2][2]) {
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (int h = 0; h < 2; ++h) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w) + h);
      out[h][0] = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
      out[h][1] = _mm256_castsi256_ps(_mm256_and_si256(words, hi_mask));
    }
  }
};

// Row m of packed block nb: y[m, 16 nb + i] = (lo, hi)[i] (+ bias) for the block's outputs < N.
inline void store_block(const PackedLinearBlock& b, int64_t m, int64_t nb, __m256 lo, __m256 hi) {
  const int64_t n0 = nb * kPackLanes;
  const int64_t lanes = std::min<int64_t>(kPackLanes, b.N - n0);
  if (lanes == kPackLanes && b.dtype == LinearDtype::FLOAT32) {  // the common case, vectorized
    float* yr = static_cast<float*>(b.y) + m * b.y_stride + n0;
    if (b.bias) {
      const float* br = static_cast<const float*>(b.bias) + n0;
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(br));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(br + 8));
    }
    _mm256_storeu_ps(yr, lo);
    _mm256_storeu_ps(yr + 8, hi);
    return;
  }
  alignas(32) float out[kPackLanes];
  _mm256_store_ps(out, lo);
  _mm256_store_ps(out + 8, hi);
  for (int64_t i = 0; i < lanes; ++i) store(b.dtype, b.bias, b.y, b.y_stride, m, n0 + i, out[i]);
}

// Blocks [nb0, nb0 + C) times fp32 x rows [m0, m0 + MB) (x holds Kp * kParts columns): 2 * C * MB
// accumulators; each chunk of k ends by adding them into `total`, which keeps the fp32 error of
// a K-long sum at the level of a blocked sum.
template <class Ops, int C, int MB>
void packed_tile(const PackedLinearBlock& b, const float* x, int64_t xs, int64_t nb0, int64_t m0) {
  constexpr int P = Ops::kParts;
  const float* xr[MB];
  for (int j = 0; j < MB; ++j) xr[j] = x + (m0 + j) * xs;
  const char* wb = static_cast<const char*>(b.wp) + nb0 * b.Kp * Ops::kStepBytes;
  const int64_t block_bytes = b.Kp * Ops::kStepBytes;
  __m256 total[C][2][MB];
  for (int c = 0; c < C; ++c)
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < MB; ++j) total[c][h][j] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < b.Kp; k0 += Ops::kChunk) {
    const int64_t k1 = std::min(b.Kp, k0 + Ops::kChunk);
    __m256 acc[C][2][MB];
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < MB; ++j) acc[c][h][j] = _mm256_setzero_ps();
    // Unrolled 4x: fewer pointer / counter updates between the FMA chains (A/Bs on this shared
    // 2-vCPU machine could not separate it from the noise; it never measured slower).
#pragma GCC unroll 4
    for (int64_t kk = k0; kk < k1; ++kk) {
      const char* w = wb + kk * Ops::kStepBytes;
      __m256 wv[C][2][2];
      for (int c = 0; c < C; ++c) Ops::load(w + c * block_bytes, wv[c]);
      for (int p = 0; p < P; ++p) {
        for (int j = 0; j < MB; ++j) {
          const __m256 xb = _mm256_broadcast_ss(xr[j] + kk * P + p);
          for (int c = 0; c < C; ++c)
            for (int h = 0; h < 2; ++h)
              acc[c][h][j] = _mm256_fmadd_ps(wv[c][h][p], xb, acc[c][h][j]);
        }
      }
    }
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < MB; ++j) total[c][h][j] = _mm256_add_ps(total[c][h][j], acc[c][h][j]);
  }
  for (int c = 0; c < C; ++c) {
    for (int j = 0; j < MB; ++j) store_block(b, m0 + j, nb0 + c, total[c][0][j], total[c][1][j]);
  }
}

// Rows [m0, m0 + MB) of one block over pair steps [k0, k1) (w: the block's first step; x rows of
// stride xs): the sums are added into tot (16 floats per row, row m at tot + (m - m0) * 16).
// (always_inline: compiled on its own, GCC kept the accumulators in registers but also stored
// all of them to the stack on every step, which halved the kernel's speed.)
template <class Ops, int MB>
__attribute__((always_inline)) inline void packed_rows_chunk(const char* w, const float* x,
                                                             int64_t xs, int64_t m0, int64_t k0,
                                                             int64_t k1, float* tot) {
  constexpr int P = Ops::kParts;
  const float* xr[MB];
  for (int j = 0; j < MB; ++j) xr[j] = x + (m0 + j) * xs;
  __m256 acc[2][MB];
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < MB; ++j) acc[h][j] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t kk = k0; kk < k1; ++kk) {
    __m256 wv[2][2];
    // The first group asks for the line 2 KiB ahead (one chunk for fp32): measured 10-15% off
    // M = 8 and 16 fp32 in a one-thread harness over a step's weights; the hardware prefetcher
    // alone lets the FMAs wait on the stream. (Prefetching in the M <= 4 tile showed nothing.)
    if (m0 == 0) _mm_prefetch(w + kk * Ops::kStepBytes + 2048, _MM_HINT_T0);
    Ops::load(w + kk * Ops::kStepBytes, wv);
    for (int p = 0; p < P; ++p) {
      for (int j = 0; j < MB; ++j) {
        const __m256 xb = _mm256_broadcast_ss(xr[j] + kk * P + p);
        for (int h = 0; h < 2; ++h) acc[h][j] = _mm256_fmadd_ps(wv[h][p], xb, acc[h][j]);
      }
    }
  }
  for (int j = 0; j < MB; ++j) {
    for (int h = 0; h < 2; ++h) {
      float* t = tot + j * kPackLanes + 8 * h;
      _mm256_store_ps(t, _mm256_add_ps(_mm256_load_ps(t), acc[h][j]));
    }
  }
}

thread_local ScratchBuffer t_tot;

// All M > 4 rows of one block: per chunk of k (32 fp32 steps, 2 KiB of weights), every group
// of up to 4 rows in turn (8 accumulators; each weight vector feeds 4 rows from a register),
// so the chunk is read from memory once and re-read from L1 by the further groups. (A whole
// block per group re-read the block from L2: 36-96 KiB does not stay in L1.)
template <class Ops>
void packed_block_rows(const PackedLinearBlock& b, const float* x, int64_t xs, int64_t nb) {
  float* tot = t_tot.get(b.M * kPackLanes);
  std::memset(tot, 0, b.M * kPackLanes * sizeof(float));
  const char* w = static_cast<const char*>(b.wp) + nb * b.Kp * Ops::kStepBytes;
  for (int64_t k0 = 0; k0 < b.Kp; k0 += Ops::kChunk) {
    const int64_t k1 = std::min(b.Kp, k0 + Ops::kChunk);
    int64_t m = 0;
    for (; m + 4 <= b.M; m += 4)
      packed_rows_chunk<Ops, 4>(w, x, xs, m, k0, k1, tot + m * kPackLanes);
    switch (b.M - m) {
      case 3: packed_rows_chunk<Ops, 3>(w, x, xs, m, k0, k1, tot + m * kPackLanes); break;
      case 2: packed_rows_chunk<Ops, 2>(w, x, xs, m, k0, k1, tot + m * kPackLanes); break;
      case 1: packed_rows_chunk<Ops, 1>(w, x, xs, m, k0, k1, tot + m * kPackLanes); break;
      default: break;
    }
  }
  for (int64_t m = 0; m < b.M; ++m) {
    const float* t = tot + m * kPackLanes;
    store_block(b, m, nb, _mm256_load_ps(t), _mm256_load_ps(t + 8));
  }
}

// One row (decode): a whole group's C blocks at once, C * 2 streams in flight. 2-4 rows: one
// block at a time against all of them (8 accumulators at most). More rows: one block at a time,
// chunk by chunk (packed_block_rows).
template <class Ops, int C>
void packed_group(const PackedLinearBlock& b, const float* x, int64_t xs, int64_t nb0) {
  switch (b.M) {
    case 1: packed_tile<Ops, C, 1>(b, x, xs, nb0, 0); return;
    case 2:
      for (int c = 0; c < C; ++c) packed_tile<Ops, 1, 2>(b, x, xs, nb0 + c, 0);
      return;
    case 3:
      for (int c = 0; c < C; ++c) packed_tile<Ops, 1, 3>(b, x, xs, nb0 + c, 0);
      return;
    case 4:
      for (int c = 0; c < C; ++c) packed_tile<Ops, 1, 4>(b, x, xs, nb0 + c, 0);
      return;
    default:
      for (int c = 0; c < C; ++c) packed_block_rows<Ops>(b, x, xs, nb0 + c);
  }
}

template <class Ops>
void packed_groups(const PackedLinearBlock& b) {
  int64_t xs = 0;
  const float* x = fp32_rows(b.dtype, b.x, b.x_stride, b.M, b.Kp * Ops::kParts, &xs);
  const int64_t blocks = (b.N + kPackLanes - 1) / kPackLanes;
  for (int64_t g = b.g_begin; g < b.g_end; ++g) {
    const int64_t nb0 = g * kPackGroupBlocks;
    switch (std::min(kPackGroupBlocks, blocks - nb0)) {
      case 3: packed_group<Ops, 3>(b, x, xs, nb0); break;
      case 2: packed_group<Ops, 2>(b, x, xs, nb0); break;
      case 1: packed_group<Ops, 1>(b, x, xs, nb0); break;
      default: break;
    }
  }
}

}  // namespace

void packed_linear_avx2(const PackedLinearBlock& b) {
  if (b.dtype == LinearDtype::FLOAT32)
    packed_groups<F32Packed>(b);
  else
    packed_groups<Bf16Packed>(b);
}

void skinny_linear_avx2(const LinearBlock& b) {
  int64_t xs = 0;
  const float* x = fp32_rows(b.dtype, b.x, b.x_stride, b.M, b.K, &xs);
  for (int64_t n = b.n_begin; n < b.n_end; ++n) {
    if (b.dtype == LinearDtype::FLOAT32)
      all_rows<F32Row>(b, x, xs, n);
    else
      all_rows<Bf16Row>(b, x, xs, n);
  }
}

}  // namespace specdec
