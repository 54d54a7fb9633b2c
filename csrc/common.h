// Shared argument checks and index-dtype dispatch for the specdec CPU kernels.
// Every check names the offending argument, so a bad call fails with a message a user can act on.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "cpu_features.h"

namespace specdec {

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "argument '", name, "' must be a CPU tensor, got ",
                    t.device());
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == dim, "argument '", name, "' must have ", dim,
                    " dimension(s), got shape ", t.sizes());
}

inline void check_size(const at::Tensor& t, int64_t d, int64_t size, const char* name) {
  TORCH_CHECK_VALUE(t.size(d) == size, "argument '", name, "' must have size ", size,
                    " in dimension ", d, ", got shape ", t.sizes());
}

// Index tensors are int32 or int64; kernels are templated on the type, so no conversion copy.
inline void check_index(const at::Tensor& t, int64_t dim, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "argument '", name,
                   "' must be int32 or int64, got ", t.scalar_type());
  check_dim(t, dim, name);
}

inline void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "argument '", name, "' must be ", dtype, ", got ",
                   t.scalar_type());
}

inline void check_nonneg(int64_t v, const char* name) {
  TORCH_CHECK_VALUE(v >= 0, "argument '", name, "' must be >= 0, got ", v);
}

// Read-only view of an int32/int64 tensor of any strides; elements come back as int64.
// The dtype branch is perfectly predicted, so one code path serves both index dtypes with no
// conversion copy and no template explosion when several index arguments differ in dtype.
struct IndexView {
  const void* p;
  int64_t s0 = 0, s1 = 0;
  bool wide;
  explicit IndexView(const at::Tensor& t)
      : p(t.const_data_ptr()), wide(t.scalar_type() == at::kLong) {
    if (t.dim() >= 1) s0 = t.stride(0);
    if (t.dim() >= 2) s1 = t.stride(1);
  }
  int64_t at(int64_t off) const {
    return wide ? static_cast<const int64_t*>(p)[off] : static_cast<const int32_t*>(p)[off];
  }
  int64_t operator()(int64_t i) const { return at(i * s0); }
  int64_t operator()(int64_t i, int64_t j) const { return at(i * s0 + j * s1); }
};

// Grain for at::parallel_for: a chunk gets at least kParallelWork elementary steps (a few
// hundred us), so small calls stay on the calling thread. Waking the pool costs microseconds, and
// on a loaded machine an OpenMP barrier can wait a whole scheduler time slice (~10 ms) for a
// descheduled worker, so index ops of a verify step must not fan out.
constexpr int64_t kParallelWork = int64_t{1} << 20;
inline int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, work_per_item));
}

}  // namespace specdec
