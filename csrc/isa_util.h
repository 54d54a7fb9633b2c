// Scalar helpers and a scratch buffer for the ISA translation units (`*_avx2.cpp`,
// `*_avx512.cpp`): bf16 <-> fp32 conversions and per-thread buffers. Everything sits in an
// anonymous namespace, so each unit gets its own copy compiled with its own flags and no copy
// can be picked by the linker for another unit or the portable library. No std:: containers
// (their template code is shared with the portable library).
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

namespace specdec {
namespace {

// fp32 -> bf16, rounding to nearest even; a NaN stays a quiet NaN.
inline uint16_t round_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A per-thread buffer of T that only grows, 64-byte aligned (freed at thread exit); throws
// std::bad_alloc when the allocation fails.
template <class T>
struct AlignedBuffer {
  T* data = nullptr;
  int64_t size = 0;
  T* get(int64_t n) {
    if (n > size) {
      std::free(data);
      const int64_t bytes = ((n * static_cast<int64_t>(sizeof(T)) + 63) / 64) * 64;
      data = static_cast<T*>(std::aligned_alloc(64, static_cast<size_t>(bytes)));
      if (data == nullptr) {
        size = 0;
        throw std::bad_alloc();
      }
      size = n;
    }
    return data;
  }
  ~AlignedBuffer() { std::free(data); }
};
struct ScratchBuffer : AlignedBuffer<float> {};

}  // namespace
}  // namespace specdec
