// Raw-pointer kernels of the KV-slot ops that have ISA-specific translation units.
// Declared here, defined in kv_slots_<isa>.cpp (built with that ISA's flags only when the
// compiler supports it: SPECDEC_BUILT_<ISA>). No ATen types cross this boundary.
#pragma once
#include <cstdint>

namespace specdec {

// out[k++] = cache_loc[accept[f]] for every accept[f] >= 0 in order; out[k:n] = -1; *count = k.
// Returns -1 on success, or the first flat position f whose accept[f] >= num_slots.
int64_t compact_locs_i32_avx512(const int32_t* accept, int64_t n, const int64_t* cache_loc,
                                int64_t num_slots, int64_t* out, int64_t* count);
int64_t compact_locs_i64_avx512(const int64_t* accept, int64_t n, const int64_t* cache_loc,
                                int64_t num_slots, int64_t* out, int64_t* count);

}  // namespace specdec
