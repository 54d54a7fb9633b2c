// skinny_linear: y = x W^T (+ b) for a few rows of x (decode and verify steps), where a GEMM
// library spends its time packing and the call should instead stream each weight row once at
// memory bandwidth. Contract: shared/spec/kernels.md has no section for it; it is F.linear
// restricted to fp32/bf16, with W's rows dense.
// ISA paths: AVX-512 (linear_avx512.cpp) when active_isa() >= AVX512; portable otherwise. AMX
// would not help: one weight element feeds only M <= 16 products, so the op is memory-bound.
// Output features are split across threads in blocks of 8 rows.
#include <torch/library.h>

#include "common.h"
#include "linear_isa.h"

namespace specdec {

void skinny_linear_portable(const LinearBlock& b) {
  const bool f32 = b.dtype == LinearDtype::FLOAT32;
  auto load = [f32](const void* p, int64_t i) -> float {
    return f32 ? static_cast<const float*>(p)[i]
               : static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]);
  };
  for (int64_t n = b.n_begin; n < b.n_end; ++n) {
    for (int64_t m = 0; m < b.M; ++m) {
      // Sums in double: a plain fp32 running sum over K = 576 errs more than twice torch's
      // blocked sums on some rows (STYLE.md's 2x rule); the portable path is for correctness.
      double acc = 0.0;
      for (int64_t k = 0; k < b.K; ++k) {
        acc += static_cast<double>(load(b.x, m * b.x_stride + k)) * load(b.w, n * b.w_stride + k);
      }
      if (b.bias) acc += load(b.bias, n);
      const float out = static_cast<float>(acc);
      if (f32) static_cast<float*>(b.y)[m * b.y_stride + n] = out;
      else static_cast<c10::BFloat16*>(b.y)[m * b.y_stride + n] = c10::BFloat16(out);
    }
  }
}

namespace {

constexpr int64_t kRowBlock = 8;

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                   "argument 'x' must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), "argument 'weight' must have x's dtype ",
                   x.scalar_type(), ", got ", weight.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1, "argument 'x' must have at least 1 dimension, got a scalar");
  check_dim(weight, 2, "weight");
  const int64_t K = x.size(-1), N = weight.size(0);
  TORCH_CHECK_VALUE(weight.size(1) == K, "argument 'weight' must have shape [N, ", K,
                    "] (x's last dimension), got ", weight.sizes());
  if (bias.has_value()) {
    check_cpu(*bias, "bias");
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "argument 'bias' must have x's dtype ",
                     x.scalar_type(), ", got ", bias->scalar_type());
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N, "argument 'bias' must have shape [",
                      N, "], got ", bias->sizes());
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  const at::Tensor x2 = x.reshape({M, K}).contiguous();  // [M, K]; x is small
  at::Tensor y = at::empty({M, N}, x.options());  // [M, N]
  if (M == 0 || N == 0) return y.view(out_shape);
  if (K == 0) {
    if (bias.has_value()) y.copy_(bias->unsqueeze(0).expand({M, N}));
    else y.zero_();
    return y.view(out_shape);
  }
  // The fast path needs dense weight rows; any other layout is copied once (and counted, so a
  // caller that hits it every step shows up in kernel_path_counts()).
  at::Tensor w = weight;
  if (weight.stride(1) != 1) {
    w = weight.contiguous();
    SPECDEC_RECORD_PATH("skinny_linear_weight_copy", Isa::PORTABLE);
  }
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  LinearBlock blk{x.scalar_type() == at::kFloat ? LinearDtype::FLOAT32 : LinearDtype::BFLOAT16,
                  M, K, x2.const_data_ptr(), K, w.const_data_ptr(), w.stride(0),
                  b.defined() ? b.const_data_ptr() : nullptr, y.data_ptr(), N, 0, 0};
  Isa isa = Isa::PORTABLE;
#ifdef SPECDEC_BUILT_AVX512
  if (active_isa() >= Isa::AVX512) isa = Isa::AVX512;
#endif
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  // A chunk gets at least ~64K multiply-adds: splitting a small layer costs more in the thread
  // pool's wake-up than it saves.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, kRowBlock * K * M));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    LinearBlock part = blk;
    part.n_begin = begin * kRowBlock;
    part.n_end = std::min(N, end * kRowBlock);
#ifdef SPECDEC_BUILT_AVX512
    if (isa == Isa::AVX512) {
      skinny_linear_avx512(part);
      return;
    }
#endif
    skinny_linear_portable(part);
  });
  SPECDEC_RECORD_PATH("skinny_linear", isa);
  return y.view(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
}

}  // namespace specdec
