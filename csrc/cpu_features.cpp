// CPU feature detection (cpuid + xgetbv, and the Linux AMX permission request), the active-path
// switch and the per-kernel path counters declared in cpu_features.h.
#include "cpu_features.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#define SPECDEC_X86 1
#endif

namespace specdec {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::PORTABLE: return "portable";
    case Isa::AVX2: return "avx2";
    case Isa::AVX512: return "avx512";
    case Isa::AMX: return "amx";
  }
  return "unknown";
}

Isa isa_from_name(const std::string& name) {
  if (name == "portable") return Isa::PORTABLE;
  if (name == "avx2") return Isa::AVX2;
  if (name == "avx512") return Isa::AVX512;
  if (name == "amx") return Isa::AMX;
  throw std::invalid_argument("SPECDEC_ISA / isa: unknown path '" + name +
                              "' (expected portable, avx2, avx512 or amx)");
}

namespace {

#ifdef SPECDEC_X86
uint64_t read_xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t(edx) << 32) | eax;
}

// Linux keeps AMX tile data disabled per process until it is requested.
bool request_amx_permission() {
#if defined(__linux__)
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
  constexpr long XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return false;
#endif
}
#endif

Isa detect() {
#ifdef SPECDEC_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return Isa::PORTABLE;
  const bool osxsave = c & (1u << 27);
  const bool fma = c & (1u << 12), f16c = c & (1u << 29), avx = c & (1u << 28);
  if (!osxsave || !fma || !f16c || !avx) return Isa::PORTABLE;
  const uint64_t xcr0 = read_xcr0();
  if ((xcr0 & 0x6) != 0x6) return Isa::PORTABLE;  // the OS saves SSE and AVX state
  __cpuid_count(7, 0, a, b, c, d);
  if (!(b & (1u << 5))) return Isa::PORTABLE;    // avx2
  const bool os_avx512 = (xcr0 & 0xE6) == 0xE6;  // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
  if (!os_avx512) return Isa::AVX2;
  const bool f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
  const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
  unsigned a1, b1, c1, d1;
  __cpuid_count(7, 1, a1, b1, c1, d1);
  const bool avx512_bf16 = a1 & (1u << 5);
  if (!(f && dq && bw && vl && avx512_bf16)) return Isa::AVX2;
  const bool os_amx = (xcr0 & (3ull << 17)) == (3ull << 17);  // XTILECFG, XTILEDATA
  if (amx_tile && amx_bf16 && os_amx && request_amx_permission()) return Isa::AMX;
  return Isa::AVX512;
#else
  return Isa::PORTABLE;
#endif
}

std::atomic<int> g_active{-1};
std::mutex g_counters_mutex;
std::vector<PathCounter*>& counters() {
  static std::vector<PathCounter*> v;
  return v;
}

bool detect_avx512_vnni() {
#ifdef SPECDEC_X86
  if (detect() < Isa::AVX512) return false;  // also covers the OS saving ZMM state
  unsigned a, b, c, d;
  __cpuid_count(7, 0, a, b, c, d);
  return c & (1u << 11);  // avx512_vnni
#else
  return false;
#endif
}

}  // namespace

Isa detected_isa() {
  static const Isa isa = detect();
  return isa;
}

bool cpu_has_avx512_vnni() {
  static const bool vnni = detect_avx512_vnni();
  return vnni;
}

bool isa_built(Isa isa) {
  switch (isa) {
    case Isa::PORTABLE: return true;
    case Isa::AVX2:
#ifdef SPECDEC_BUILT_AVX2
      return true;
#else
      return false;
#endif
    case Isa::AVX512:
#ifdef SPECDEC_BUILT_AVX512
      return true;
#else
      return false;
#endif
    case Isa::AMX:
#ifdef SPECDEC_BUILT_AMX
      return true;
#else
      return false;
#endif
  }
  return false;
}

Isa best_supported_isa() {
  int best = static_cast<int>(detected_isa());
  while (best > 0 && !isa_built(static_cast<Isa>(best))) --best;
  return static_cast<Isa>(best);
}

void set_active_isa(Isa isa) {
  if (static_cast<int>(isa) > static_cast<int>(detected_isa())) {
    throw std::invalid_argument(std::string("isa: this CPU/OS cannot run the '") + isa_name(isa) +
                                "' path (detected: " + isa_name(detected_isa()) + ")");
  }
  if (!isa_built(isa)) {
    throw std::invalid_argument(std::string("isa: the '") + isa_name(isa) +
                                "' path was not compiled into this build");
  }
  g_active.store(static_cast<int>(isa));
}

Isa active_isa() {
  int v = g_active.load(std::memory_order_relaxed);
  if (v >= 0) return static_cast<Isa>(v);
  const char* env = std::getenv("SPECDEC_ISA");
  Isa isa = best_supported_isa();
  if (env && *env) {
    isa = isa_from_name(env);
    set_active_isa(isa);  // validates
  }
  g_active.store(static_cast<int>(isa));
  return isa;
}

PathCounter::PathCounter(const char* op_name) : op(op_name) {
  for (auto& n : calls) n.store(0);
  std::lock_guard<std::mutex> lock(g_counters_mutex);
  counters().push_back(this);
}

std::map<std::string, int64_t> kernel_path_counts() {
  std::lock_guard<std::mutex> lock(g_counters_mutex);
  std::map<std::string, int64_t> out;
  for (const PathCounter* c : counters()) {
    for (int i = 0; i < kIsaCount; ++i) {
      const int64_t n = c->calls[i].load();
      if (n) out[std::string(c->op) + ":" + isa_name(static_cast<Isa>(i))] += n;
    }
  }
  return out;
}

void reset_kernel_path_counts() {
  std::lock_guard<std::mutex> lock(g_counters_mutex);
  for (PathCounter* c : counters())
    for (auto& n : c->calls) n.store(0);
}

}  // namespace specdec
