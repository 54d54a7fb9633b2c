// Peak multiply-add probe for benchmarks' compute roofline (benchmarks/bench_attention.py): a
// loop of independent register-only multiply-adds, the most this ISA's units can do, with no
// memory traffic. Raw-pointer-free; defined in peak_amx.cpp / peak_avx512.cpp /
// peak_avx512vnni.cpp / peak_avx2.cpp (each built only with its ISA's flags).
#pragma once
#include <cstdint>

namespace specdec {

// Runs `iters` steps of kPeakAccumulators independent 512-bit multiply-adds on one thread:
// fp32 FMA (16 multiply-adds each) or, with bf16, vdpbf16ps (32 each). Returns a value that
// depends on every result, so the loop cannot be optimised away.
constexpr int kPeakAccumulators = 12;
float peak_probe_avx512(bool bf16, int64_t iters);
// The same with 256-bit fp32 FMAs (8 multiply-adds each).
float peak_probe_avx2(int64_t iters);
// The INT8 kernels' instruction: `iters` steps of kPeakAccumulators independent vpdpbusd (64
// u8 x s8 multiply-adds each). Called only when cpu_has_avx512_vnni().
int32_t peak_probe_avx512vnni(int64_t iters);
// bf16 on AMX tiles: `iters` steps of kPeakAmxTiles independent tdpbf16ps, each 16 x 16 outputs
// over 32 products (kAmxTileMadds multiply-adds). Needs the AMX tile permission (active_isa() ==
// AMX).
constexpr int kPeakAmxTiles = 4;
constexpr int64_t kAmxTileMadds = 16 * 16 * 32;
float peak_probe_amx(int64_t iters);

}  // namespace specdec
