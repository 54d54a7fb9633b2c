// The Python module `specdec_inductor._C`: importing it runs every TORCH_LIBRARY registration
// in this library (the op schemas live beside their kernels, one file per op family) and exposes
// the ISA queries and kernel-path counters of cpu_features.h.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "cpu_features.h"
#include "peak_isa.h"

namespace specdec {
void bind_ngram(pybind11::module& m);        // ngram.cpp
void bind_linear_pack(pybind11::module& m);  // linear.cpp
void bind_quant(pybind11::module& m);        // quant.cpp
}  // namespace specdec

TORCH_LIBRARY(specdec, m) {
  // Op families add their schemas with TORCH_LIBRARY_FRAGMENT in their own files.
}

namespace {

// The widest peak probe for the active path: AMX tiles for bf16 on the AMX path, else AVX-512 or
// AVX2 FMAs; PORTABLE when there is none.
specdec::Isa peak_probe_path(bool bf16) {
  using specdec::active_isa;
  using specdec::Isa;
  Isa probe = Isa::PORTABLE;
#ifdef SPECDEC_BUILT_AVX2
  if (active_isa() >= Isa::AVX2) probe = Isa::AVX2;
#endif
#ifdef SPECDEC_BUILT_AVX512
  if (active_isa() >= Isa::AVX512) probe = Isa::AVX512;
#endif
#ifdef SPECDEC_BUILT_AMX
  if (active_isa() == Isa::AMX && bf16) probe = Isa::AMX;
#endif
  return probe;
}

// Runs `probe` once on each of torch's threads at once (a peak probe: every core busy) and
// returns the thread count; the probes' results are summed into a volatile so that no probe
// loop can be optimised away.
template <typename Probe>
int64_t on_every_thread(const Probe& probe) {
  const int64_t threads = at::get_num_threads();
  std::vector<double> sink(threads);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) sink[t] = probe();
  });
  volatile double keep = 0.0;
  for (double v : sink) keep = keep + v;
  (void)keep;
  return threads;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  using namespace specdec;
  m.def("detected_isa", [] { return std::string(isa_name(detected_isa())); },
        "Best path the CPU and OS support: portable, avx2, avx512 or amx.");
  m.def("built_isas", [] {
    std::vector<std::string> out;
    for (Isa isa : {Isa::PORTABLE, Isa::AVX2, Isa::AVX512, Isa::AMX}) {
      if (isa_built(isa)) out.emplace_back(isa_name(isa));
    }
    return out;
  }, "Paths compiled into this build.");
  m.def("active_isa", [] { return std::string(isa_name(active_isa())); },
        "Path the kernels use now (SPECDEC_ISA or the best supported one).");
  m.def("set_active_isa", [](const std::string& name) { set_active_isa(isa_from_name(name)); },
        "Force a path; raises ValueError if this machine or build cannot run it.");
  m.def("kernel_path_counts", &kernel_path_counts, "Calls per '<op>:<path>' since the last reset.");
  m.def("reset_kernel_path_counts", &reset_kernel_path_counts);
  m.def("peak_multiply_adds", [](bool bf16, int64_t iters) -> double {
    // Multiply-adds done by `iters` probe steps on each of torch's threads (benchmarks time the
    // call for their compute roofline); 0 when this build or CPU has no SIMD probe. AMX (bf16
    // only, when the active path is AMX): 4 tile products of 16 x 16 x 32 per step; AVX-512:
    // 16 fp32 FMAs or 32 bf16 products per instruction; AVX2: 8 fp32 FMAs, bf16 included (its
    // kernels widen bf16 to fp32).
    const Isa probe = peak_probe_path(bf16);
    if (probe == Isa::PORTABLE) return 0.0;
    const int64_t per_step = probe == Isa::AMX ? kPeakAmxTiles * kAmxTileMadds
                             : probe == Isa::AVX512 ? kPeakAccumulators * (bf16 ? 32 : 16)
                                                    : kPeakAccumulators * 8;
    return on_every_thread([&]() -> double {
      float out = 0.f;
#ifdef SPECDEC_BUILT_AMX
      if (probe == Isa::AMX) out = peak_probe_amx(iters);
#endif
#ifdef SPECDEC_BUILT_AVX512
      if (probe == Isa::AVX512) out = peak_probe_avx512(bf16, iters);
#endif
#ifdef SPECDEC_BUILT_AVX2
      if (probe == Isa::AVX2) out = peak_probe_avx2(iters);
#endif
      return out;
    }) * iters * per_step;
  }, "Run the widest peak multiply-add probe (AMX for bf16 on the AMX path, else AVX-512 or "
     "AVX2) on every thread; returns its multiply-adds (0 without one). Time the call for the "
     "machine's peak rate.");
  m.def("peak_int8_multiply_adds", [](int64_t iters) -> double {
    // The INT8 kernels' bound (quant_linear with INT8 activations): u8 x s8 multiply-adds done
    // by `iters` steps of 12 independent vpdpbusd (64 each) on each of torch's threads; 0 when
    // this build, CPU or active path has no AVX-512 VNNI.
    bool vnni = false;
#ifdef SPECDEC_BUILT_AVX512VNNI
    vnni = active_isa() >= Isa::AVX512 && cpu_has_avx512_vnni();
#endif
    if (!vnni) return 0.0;
    return on_every_thread([&]() -> double {
#ifdef SPECDEC_BUILT_AVX512VNNI
      return peak_probe_avx512vnni(iters);
#else
      return 0.0;
#endif
    }) * iters * kPeakAccumulators * 64;
  }, "Run the AVX-512 VNNI probe (vpdpbusd, the INT8 GEMV's multiply-add) on every thread; "
     "returns its multiply-adds (0 without VNNI on the active path). Time the call for the "
     "machine's INT8 peak rate.");
  m.def("peak_probe_isa", [](bool bf16) -> std::string {
    const Isa probe = peak_probe_path(bf16);
    return probe == Isa::PORTABLE ? std::string() : std::string(isa_name(probe));
  }, "The path peak_multiply_adds(bf16) runs now ('' when none).");
  bind_ngram(m);
  bind_linear_pack(m);
  bind_quant(m);
}
