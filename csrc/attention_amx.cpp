// AMX attention chunk kernel for bf16 (built with the AMX flags; run only when active_isa() ==
// AMX, q is bf16 and head_dim % 32 == 0): the shared body of attention_kernel.h with both bf16
// products on AMX tiles. UNPROVEN: written without AMX hardware; scripts/device_amx_check.sh runs
// the attention tests on this path on an AMX machine.
// One tile configuration serves both products: tmm0..3 accumulate a 16 x 64 fp32 block (four
// 16 x 16 tiles), tmm4 holds the A operand (16 rows x 32 bf16), tmm5 the B operand (16 pair rows x
// 16 columns in the VNNI pair layout that the block's K^T tile and interleaved V rows already use).
#include "attention_kernel.h"

namespace specdec {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tile numbers are immediates, so the four accumulators are spelled out.
#define SPECDEC_FOR_4_TILES(X) X(0) X(1) X(2) X(3)

struct AmxBf16Ops {
  static constexpr int64_t kRowPad = 16;

  // s [Mp, 64] = q [Mp, W] . kt [W, 64] (words), W % 16 == 0.
  static void qk(const uint32_t* q, int64_t Mp, int64_t W, const uint32_t* kt, float* s) {
    for (int64_t m0 = 0; m0 < Mp; m0 += 16) {
#define SPECDEC_ZERO(t) _tile_zero(t);
      SPECDEC_FOR_4_TILES(SPECDEC_ZERO)
#undef SPECDEC_ZERO
      for (int64_t w0 = 0; w0 < W; w0 += 16) {
        _tile_loadd(4, q + m0 * W + w0, W * 4);
#define SPECDEC_QK(t)                                          \
  _tile_loadd(5, kt + w0 * kKeyBlock + 16 * t, kKeyBlock * 4); \
  _tile_dpbf16ps(t, 4, 5);
        SPECDEC_FOR_4_TILES(SPECDEC_QK)
#undef SPECDEC_QK
      }
#define SPECDEC_STORE_S(t) _tile_stored(t, s + m0 * kKeyBlock + 16 * t, kKeyBlock * 4);
      SPECDEC_FOR_4_TILES(SPECDEC_STORE_S)
#undef SPECDEC_STORE_S
    }
  }

  // acc [Mp, D] = alpha * acc + p [Mp, 32 pair words] . vp [32 pairs, D words], D % 16 == 0.
  static void pv(const uint32_t* p, const float* alpha, const uint32_t* vp, int64_t npairs,
                 int64_t Mp, float* acc, int64_t D) {
    (void)npairs;  // the tiles always cover the block's 32 pairs; the rest are zero
    for (int64_t m = 0; m < Mp; ++m) {
      const __m512 al = _mm512_set1_ps(alpha[m]);
      for (int64_t d = 0; d < D; d += 16) {
        _mm512_storeu_ps(acc + m * D + d, _mm512_mul_ps(al, _mm512_loadu_ps(acc + m * D + d)));
      }
    }
    constexpr int64_t kPairs = kKeyBlock / 2;
    for (int64_t m0 = 0; m0 < Mp; m0 += 16) {
      int64_t dc = 0;
      for (; dc + 64 <= D; dc += 64) {
#define SPECDEC_LOAD_ACC(t) _tile_loadd(t, acc + m0 * D + dc + 16 * t, D * 4);
        SPECDEC_FOR_4_TILES(SPECDEC_LOAD_ACC)
#undef SPECDEC_LOAD_ACC
        for (int64_t k0 = 0; k0 < kPairs; k0 += 16) {
          _tile_loadd(4, p + m0 * kPairs + k0, kPairs * 4);
#define SPECDEC_PV(t)                                     \
  _tile_loadd(5, vp + k0 * D + dc + 16 * t, D * 4);       \
  _tile_dpbf16ps(t, 4, 5);
          SPECDEC_FOR_4_TILES(SPECDEC_PV)
#undef SPECDEC_PV
        }
#define SPECDEC_STORE_ACC(t) _tile_stored(t, acc + m0 * D + dc + 16 * t, D * 4);
        SPECDEC_FOR_4_TILES(SPECDEC_STORE_ACC)
#undef SPECDEC_STORE_ACC
      }
      for (; dc < D; dc += 16) {  // D % 64 == 16, 32 or 48: one accumulator tile at a time
        _tile_loadd(0, acc + m0 * D + dc, D * 4);
        for (int64_t k0 = 0; k0 < kPairs; k0 += 16) {
          _tile_loadd(4, p + m0 * kPairs + k0, kPairs * 4);
          _tile_loadd(5, vp + k0 * D + dc, D * 4);
          _tile_dpbf16ps(0, 4, 5);
        }
        _tile_stored(0, acc + m0 * D + dc, D * 4);
      }
    }
  }
};

#undef SPECDEC_FOR_4_TILES

}  // namespace

void attention_chunk_amx(const AttnChunk& c) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 6; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  attention_chunk_simd<AmxBf16Ops>(c);
  _tile_release();
}

}  // namespace specdec
