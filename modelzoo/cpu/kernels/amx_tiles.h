// The AMX tile configuration both AMX kernels load (amx_gemm.cpp, int8_gemm.cpp): palette 1, tiles 0-7 of their own
// rows and bytes per row. Every thread loads one before its first tile instruction and releases the tiles after.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace zoo {

#if defined(__AMX_TILE__)
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile t: rows[t] rows of colsb[t] bytes, for t < 8.
inline void load_tile_config(const uint8_t (&rows)[8], const uint16_t (&colsb)[8]) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = rows[t];
    config.colsb[t] = colsb[t];
  }
  asm volatile("" : : "r"(&config) : "memory");  // GCC may otherwise drop the stores ldtilecfg reads
  _tile_loadconfig(&config);
}
#endif

}  // namespace zoo
