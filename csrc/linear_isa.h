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

void skinny_linear_portable(const LinearBlock& blk);
// AVX-512: fp32 FMA; bf16 through avx512_bf16 dot products (vdpbf16ps).
void skinny_linear_avx512(const LinearBlock& blk);

}  // namespace specdec
