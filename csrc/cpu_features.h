// Run-time ISA selection for specdec kernels.
// Paths: PORTABLE (plain C++, always built), AVX2 (avx2 + fma + f16c: most x86-64 CPUs of the
// last decade, AMD Zen 1-3 included), AVX512 (avx512f/bw/vl/dq + avx512_bf16 + fma), AMX (AVX512
// plus amx-tile/amx-bf16, with the OS permission to use tile data). Each path implies the ones
// below it; an op without a kernel of the active path runs the best lower one it has. The active
// path is the best one the CPU, the OS and this build support, or the one forced by the environment
// variable SPECDEC_ISA=portable|avx2|avx512|amx (forcing a path the machine cannot run is an
// error). Every kernel records which path ran, so tests can assert it (kernel_path_counts()).
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <string>

namespace specdec {

enum class Isa : int { PORTABLE = 0, AVX2 = 1, AVX512 = 2, AMX = 3 };
constexpr int kIsaCount = 4;

const char* isa_name(Isa isa);
Isa isa_from_name(const std::string& name);  // throws on an unknown name

// What the hardware + OS support (independent of the build).
Isa detected_isa();
// Whether this build compiled the translation units of `isa`.
bool isa_built(Isa isa);
// Best path supported by hardware, OS and build.
Isa best_supported_isa();
// The path kernels use now: SPECDEC_ISA if set, else best_supported_isa().
Isa active_isa();
// Force a path at run time (tests, benchmarks). Throws if unsupported here.
void set_active_isa(Isa isa);
// Whether the CPU and OS run AVX-512 VNNI (vpdpbusd) next to the AVX512 path's features. Not a
// path of its own: a kernel with a VNNI variant (quant_linear's INT8 activations) asks this as
// well as active_isa() >= AVX512 and whether its VNNI unit was built (SPECDEC_BUILT_AVX512VNNI).
bool cpu_has_avx512_vnni();

// Counters of kernel invocations per op and path ("<op>:<path>" in kernel_path_counts()), so
// tests can assert which path really ran. One relaxed atomic add per kernel call.
struct PathCounter {
  explicit PathCounter(const char* op);  // registers itself in a global list
  const char* op;
  std::atomic<int64_t> calls[kIsaCount];
};
#define SPECDEC_RECORD_PATH(op, isa)                                                            \
  do {                                                                                          \
    static ::specdec::PathCounter specdec_path_counter_(op);                                    \
    specdec_path_counter_.calls[static_cast<int>(isa)].fetch_add(1, std::memory_order_relaxed); \
  } while (0)

std::map<std::string, int64_t> kernel_path_counts();
void reset_kernel_path_counts();

}  // namespace specdec
