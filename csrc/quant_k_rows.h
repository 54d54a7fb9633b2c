// The row loop of the K-format INT8 kernels (quant_avx2.cpp, quant_avx512vnni.cpp), written once
// over a unit's vector policy V:
//   V::Block              a decoded 256-weight block (Dec::block(p, Block&) fills it; Dec::kBytes
//                         bytes a block in the file)
//   V::Acc, V::zero()     the fp32 accumulator of one (x row, weight row) pair
//   V::dot<Dec>(w, x, b, acc)   acc + block b of x row x times w (the whole float sequence)
//   V::reduce(acc)        the accumulator's lanes summed in a fixed order
// One row of x (decode): each weight block is decoded in registers and consumed at once. Several
// rows (verify, prefill): a weight row is decoded once into a per-thread buffer (L1/L2), then
// multiplied into up to 4 rows of x at a time, the buffered block loads shared by those rows.
// A (x row, weight row) pair sees the same V::dot sequence and reduction either way: batch
// invariance. Included by ISA units only (anonymous namespace: each keeps its own copy).
#pragma once
#include <xmmintrin.h>

#include <cstdint>

#include "isa_util.h"
#include "quant_isa.h"

namespace specdec {
namespace {

// Row m of a QuantizedXK.
struct XRow {
  const int8_t* q;        // [K]
  const float* d;         // [K / 256]
  const float* d_bsum32;  // [K / 32]
  const int16_t* bsum16;  // [K / 16]
  const int16_t* bsum32;  // [K / 32]
  XRow() = default;
  XRow(const QuantizedXK& X, int64_t m)
      : q(X.q + m * X.K),
        d(X.d + m * (X.K / 256)),
        d_bsum32(X.d_bsum32 + m * (X.K / 32)),
        bsum16(X.bsum16 + m * (X.K / 16)),
        bsum32(X.bsum32 + m * (X.K / 32)) {}
};

inline void store_k_output(const QuantLinearInt8Block& b, int64_t m, int64_t n, float v) {
  if (b.bias) v += b.bias[n];
  b.y[m * b.y_stride + n] = v;
}

template <class V, class Dec, int MB>
inline void k_dot_rows(const typename V::Block* w, const QuantLinearInt8Block& b, int64_t m0,
                       int64_t n) {
  static_assert(MB >= 1 && MB <= 4, "1 to 4 rows of x");
  const QuantizedXK& X = b.xk;
  const XRow rows[4] = {XRow(X, m0), XRow(X, m0 + (MB > 1)), XRow(X, m0 + 2 * (MB > 2)),
                        XRow(X, m0 + 3 * (MB > 3))};
  typename V::Acc acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = V::zero();
  for (int64_t c = 0; c < X.K / 256; ++c)
    for (int i = 0; i < MB; ++i) acc[i] = V::template dot<Dec>(w[c], rows[i], c, acc[i]);
  for (int i = 0; i < MB; ++i) store_k_output(b, m0 + i, n, V::reduce(acc[i]));
}

template <class V, class Dec>
void k_linear_rows(const QuantLinearInt8Block& b, AlignedBuffer<typename V::Block>& buffer) {
  const QuantizedXK& X = b.xk;
  const int64_t blocks = X.K / 256;
  if (X.M == 1) {
    const XRow x(X, 0);
    for (int64_t n = b.n_begin; n < b.n_end; ++n) {
      const uint8_t* p = b.w + n * b.w_stride;
      typename V::Acc acc = V::zero();
      for (int64_t c = 0; c < blocks; ++c) {
        typename V::Block w;
        Dec::block(p + c * Dec::kBytes, w);
        acc = V::template dot<Dec>(w, x, c, acc);
      }
      store_k_output(b, 0, n, V::reduce(acc));
    }
    return;
  }
  typename V::Block* buf = buffer.get(blocks);
  for (int64_t n = b.n_begin; n < b.n_end; ++n) {
    const uint8_t* p = b.w + n * b.w_stride;
    for (int64_t c = 0; c < blocks; ++c) Dec::block(p + c * Dec::kBytes, buf[c]);
    // The next row's bytes into L2 while this row's dot products run.
    if (n + 1 < b.n_end) {
      const char* next = reinterpret_cast<const char*>(p + b.w_stride);
      for (int64_t off = 0; off < blocks * Dec::kBytes; off += 64)
        _mm_prefetch(next + off, _MM_HINT_T1);
    }
    for (int64_t m = 0; m < X.M;) {
      const int64_t left = X.M - m;
      if (left >= 4) {
        k_dot_rows<V, Dec, 4>(buf, b, m, n);
        m += 4;
      } else if (left >= 2) {
        k_dot_rows<V, Dec, 2>(buf, b, m, n);
        m += 2;
      } else {
        k_dot_rows<V, Dec, 1>(buf, b, m, n);
        m += 1;
      }
    }
  }
}

}  // namespace
}  // namespace specdec
