// AMX peak multiply-add probe (see peak_isa.h): independent tdpbf16ps into four accumulator tiles
// from two operand tiles that never change, so no memory traffic after the first loads.
#include <immintrin.h>

#include <cstring>

#include "amx_tiles.h"
#include "peak_isa.h"

namespace specdec {

float peak_probe_amx(int64_t iters) {
  configure_full_tiles(6);
  alignas(64) uint32_t ab[16 * 16];
  for (int i = 0; i < 16 * 16; ++i) ab[i] = 0x38d138d1u;  // bf16 pairs (~1e-4, ~1e-4)
  alignas(64) float out[16 * 16];
  _tile_loadd(4, ab, 64);
  _tile_loadd(5, ab, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t t = 0; t < iters; ++t) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 5);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 5);
  }
  float sum = 0.0f;
  _tile_stored(0, out, 64);
  sum += out[0];
  _tile_stored(1, out, 64);
  sum += out[1];
  _tile_stored(2, out, 64);
  sum += out[2];
  _tile_stored(3, out, 64);
  sum += out[3];
  _tile_release();
  return sum;
}

}  // namespace specdec
