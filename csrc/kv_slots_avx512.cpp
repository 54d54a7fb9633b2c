// AVX-512 kernels of the KV-slot ops (built with -mavx512f/bw/vl/dq; run only when
// active_isa() >= AVX512). compact: masked 8-lane gather of cache_loc plus compress-store of the
// accepted lanes, so the stream compaction has no per-element branch.
#include <immintrin.h>

#include "kv_slots_isa.h"

namespace specdec {
namespace {

// Handles 8 lanes of indices already widened to int64. Returns the lane mask of bad indices.
inline __mmask8 compact8(__m512i idx, __mmask8 live, const int64_t* cache_loc, int64_t num_slots,
                         int64_t* out, int64_t* k) {
  const __mmask8 accepted = _mm512_mask_cmpge_epi64_mask(live, idx, _mm512_setzero_si512());
  const __mmask8 bad = _mm512_mask_cmpge_epi64_mask(accepted, idx, _mm512_set1_epi64(num_slots));
  const __mmask8 ok = accepted & ~bad;
  const __m512i slots = _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), ok, idx, cache_loc, 8);
  _mm512_mask_compressstoreu_epi64(out + *k, ok, slots);
  *k += __builtin_popcount(ok);
  return bad;
}

template <typename LoadFn>
int64_t compact_impl(int64_t n, const int64_t* cache_loc, int64_t num_slots, int64_t* out,
                     int64_t* count, LoadFn load) {
  int64_t k = 0;
  for (int64_t f = 0; f < n; f += 8) {
    const int64_t rem = n - f;
    const __mmask8 live = rem >= 8 ? 0xFF : static_cast<__mmask8>((1u << rem) - 1);
    const __mmask8 bad = compact8(load(f, live), live, cache_loc, num_slots, out, &k);
    if (bad) return f + __builtin_ctz(bad);
  }
  for (int64_t f = k; f < n; ++f) out[f] = -1;
  *count = k;
  return -1;
}

}  // namespace

int64_t compact_locs_i32_avx512(const int32_t* accept, int64_t n, const int64_t* cache_loc,
                                int64_t num_slots, int64_t* out, int64_t* count) {
  return compact_impl(n, cache_loc, num_slots, out, count, [&](int64_t f, __mmask8 live) {
    return _mm512_cvtepi32_epi64(_mm256_maskz_loadu_epi32(live, accept + f));
  });
}

int64_t compact_locs_i64_avx512(const int64_t* accept, int64_t n, const int64_t* cache_loc,
                                int64_t num_slots, int64_t* out, int64_t* count) {
  return compact_impl(n, cache_loc, num_slots, out, count, [&](int64_t f, __mmask8 live) {
    return _mm512_maskz_loadu_epi64(live, accept + f);
  });
}

}  // namespace specdec
