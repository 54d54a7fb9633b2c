// Checked size arithmetic for the index ops. A product or sum of caller-given sizes (topk *
// steps, bs * N * N, seq_len + drafts, ...) that overflows int64 must fail with an error naming
// the arguments, never wrap to a small or negative value that passes a bounds check and then
// writes out of bounds.
#pragma once
#include <c10/util/Exception.h>

#include <cstdint>

namespace specdec {

// a * b, or a ValueError "<what> = a * b overflows int64".
inline int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t r;
  TORCH_CHECK_VALUE(!__builtin_mul_overflow(a, b, &r), what, " = ", a, " * ", b,
                    " overflows int64");
  return r;
}

inline int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t r;
  TORCH_CHECK_VALUE(!__builtin_add_overflow(a, b, &r), what, " = ", a, " + ", b,
                    " overflows int64");
  return r;
}

// The element count of a tensor the op is about to allocate must fit in memory terms too:
// at::empty reports an overflow as "Storage size calculation overflowed" with no argument
// named, so the op checks first (bytes per element up to 8).
inline void check_alloc(int64_t numel, const char* what) {
  TORCH_CHECK_VALUE(numel >= 0 && numel <= (int64_t{1} << 56), what, " would need ", numel,
                    " elements: the sizes it is made of are too large");
}

}  // namespace specdec
