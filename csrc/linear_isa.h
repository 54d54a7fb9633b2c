// Raw-pointer kernels of skinny_linear (y = x W^T + b for few rows of x). Declared here, defined
// in linear.cpp (portable) and linear_<isa>.cpp (built with that ISA's flags only when the
// compiler supports it: SPECDEC_BUILT_<ISA>). No ATen types cross this boundary.
#pragma once
#include <cstdint>

namespace specdec {

enum class LinearDtype : int { FLOAT32 = 0, BFLOAT16 = 1 };

// One block of output features [n_begin, n_end) for all M rows:
//   y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]),  m < M, n_begin <= n < n_end.
// x: [M, K] dense rows (row stride x_stride), of `dtype`; w: [N, K] with row stride w_stride;
// bias: [N] or nullptr; y: [M, N] with row stride y_stride, of `dtype`. Accumulation is fp32;
// a bf16 result is rounded to nearest even once, at the end.
struct LinearBlock {
  LinearDtype dtype;
  int64_t M, K;
  const void* x;
  int64_t x_stride;
  const void* w;
  int64_t w_stride;
  const void* bias;
  void* y;
  int64_t y_stride;
  int64_t n_begin, n_end;
};

// Packed weights (registered weights only; see linear.cpp): W [N, K] stored as
// [ceil(N / 16), Kp, 16 * P] with P = 1 for fp32 and P = 2 for bf16 (pairs of consecutive k,
// Kp = ceil(K / 2)): element (n, k) sits at [n / 16][k / P][(n % 16) * P + k % P], zeros past N
// and K. A column block of 16 outputs then reads one contiguous stream, and each x element is
// broadcast against 16 outputs at once: no horizontal sums, x loaded once per k for M rows.
constexpr int64_t kPackLanes = 16;       // outputs per packed block (one fp32 vector)
constexpr int64_t kPackGroupBlocks = 3;  // blocks a kernel call keeps in registers (48 outputs)

inline int64_t packed_pair(LinearDtype dtype) { return dtype == LinearDtype::BFLOAT16 ? 2 : 1; }

// Column groups [g_begin, g_end) (group g = blocks [3g, 3g + 3)) for all M rows:
//   y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]).
// x: [M, Kp * P] dense rows of `dtype` (zero-padded past K), row stride x_stride; wp: the packed
// W; bias [N] or nullptr; y [M, N] with row stride y_stride. fp32 accumulation in chunks of 32
// k (so the error stays at the level of a blocked sum); a bf16 result is rounded once.
struct PackedLinearBlock {
  LinearDtype dtype;
  int64_t M, Kp, N;
  const void* x;
  int64_t x_stride;
  const void* wp;
  const void* bias;
  void* y;
  int64_t y_stride;
  int64_t g_begin, g_end;
};

void skinny_linear_portable(const LinearBlock& blk);
// AVX-512: fp32 FMA; bf16 through avx512_bf16 dot products (vdpbf16ps).
void skinny_linear_avx512(const LinearBlock& blk);
void packed_linear_avx512(const PackedLinearBlock& blk);
// AVX2 + FMA: fp32 FMA on 8 lanes; bf16 widened to fp32 in registers (exact), fp32 FMA.
void skinny_linear_avx2(const LinearBlock& blk);
void packed_linear_avx2(const PackedLinearBlock& blk);

}  // namespace specdec
