// AVX-512 attention chunk kernel (built with -mavx512f/bw/vl/dq/bf16; run only when
// active_isa() >= AVX512): the shared body of attention_kernel.h with bf16 products from
// _mm512_dpbf16_ps (fp32 always uses FMAs).
#include "attention_kernel.h"

namespace specdec {
namespace {

struct Avx512Bf16Ops {
  static constexpr int64_t kRowPad = 1;
  static void qk(const uint32_t* q, int64_t M, int64_t W, const uint32_t* kt, float* s) {
    qk_rows<true>(q, M, W, kt, s);
  }
  static void pv(const uint32_t* p, const float* alpha, const uint32_t* vp, int64_t npairs,
                 int64_t M, float* acc, int64_t D) {
    pv_rows_bf16(p, alpha, vp, npairs, M, acc, D);
  }
};

}  // namespace

void attention_chunk_avx512(const AttnChunk& c) { attention_chunk_simd<Avx512Bf16Ops>(c); }

}  // namespace specdec
