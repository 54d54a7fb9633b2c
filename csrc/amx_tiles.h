// AMX tile configuration shared by the AMX translation units (`*_amx.cpp`, built with the AMX
// flags): palette 1 with the first `count` tiles at their full 16 rows x 64 bytes. Anonymous
// namespace: each unit gets its own copy.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace specdec {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Loads the configuration; pair with _tile_release() when the unit's tile work is done.
inline void configure_full_tiles(int count) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < count; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace
}  // namespace specdec
