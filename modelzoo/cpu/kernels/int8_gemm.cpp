// int8-weight linear layers: y = x @ W^T (+ bias) with W stored as group-wise int8 and the activations quantized on
// the fly to 8 bits (AVX512-VNNI) or 16 bits (AVX512-VNNI, or AVX2 on every CPU).
//
// Weights: q (N, K) int8 with one float32 scale per output row and group of `group` inputs
// (w ~= q * scale), packed by modelzoo/int8_compute.py into blocks of 16 output rows:
//   packed (N/16, K/4, 16, 4) uint8 = q + 128: for each 4 inputs, 16 rows' 4 bytes side by side (one VNNI
//   operand);  scales (N/16, G, 16) float32.
// N and K are padded with zeros (q = 0) to multiples of 16 and of `group`; G = K / group.
//
// Activations are quantized per row and per chunk of `chunk` inputs (the weight group, or for a group over
// 256 inputs the largest multiple of 16 up to 256 dividing it): s = absmax / qmax, xq = round(x / s)
// (nearest even; 0 for an all-zero chunk), qmax = 127 (8 bits) or 32767 (16 bits). Then, for each row m and
// output n,
//   y[m, n] = sum over chunks c, in order, of float(sum_k q * xq) * (ws[n, group of c] * xs[m, c])
// with exact integer sums and one float32 fused multiply-add per chunk. The sums multiply the unsigned
// q + 128 by xq, starting from c = -128 * sum(xq), which takes the +128 back out:
//   8 bits:  vpdpbusd, 4 inputs per 32-bit lane;
//   16 bits: q + 128 zero-extended to 16 bits (even and odd bytes apart), vpdpwssd, 2 inputs per lane, xq
//            stored in the order x0 x2 x1 x3 within each 4 inputs to match. The activations' error is about
//            2^-16 of the chunk's absmax: the result is the weight-only int8 product to float32 rounding.
//            Without VNNI, AVX2's vpmaddwd + vpaddd do the same integer sums on 8 rows at a time (half a
//            packed block): the same bits as vpdpwssd.
//   AMX:     the same integer sums on AMX-INT8 tiles (Amx below): 16 rows x 2 packed blocks per tile product, a
//            packed block's 16 rows of 4 input bytes being an AMX B tile's rows as they lie. 8 bits: tdpbsud (signed
//            activations, unsigned weights). 16 bits: each xq split into a signed high and an unsigned low byte
//            (xq = 256 hi + lo), tdpbsud on the high bytes and tdpbuud on the low ones, then 256 hi_sum + lo_sum.
//            Integer sums are exact in any order, so every path gives the same bits.
// Where more than one path is built, the fastest is timed once per process (`int8_gemm_path`).
// A row's arithmetic is the same whatever the other rows of the call, so the result does not depend on the batch.
#include "amx_tiles.h"
#include "kernels.h"
#include "shared_tasks.h"
#include "storage.h"
#include "timed_choice.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ZOO_INT8_VNNI 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define ZOO_INT8_AMX 1
#endif
#endif

namespace zoo {

bool int8_vnni_available() {
#if defined(ZOO_INT8_VNNI)
  return true;
#else
  return false;
#endif
}

namespace {

constexpr int64_t kBlock = 16;   // output rows per packed block (one 512-bit register of int32 sums)
constexpr int64_t kMaxChunk = 256;  // inputs per int32 sum at most: 256 * 255 * 32767 < 2^31

struct Shape {
  int64_t k_padded, group, chunk;  // inputs (padded), per weight scale, per activation scale
};

// Each kernel below (Vnni<Policy>, Avx2Int16) offers: `type` (a quantized activation), kRowsTile x kBlocksTile
// (activation rows x packed blocks per register tile), the shape of a multiply task over more than one row tile
// (`multiply`: kRunBlocks, kRunTiles, kSpanInputs), quantize_row (one row of k_padded float32 values -> xq, the
// chunk scales and the chunks' corrections) and tile (rows x blocks -> out[r * kBlocksTile * 16 + b * 16 + j]).

#if defined(ZOO_INT8_VNNI)
constexpr int64_t kRowsTile = 4; // activation rows per register tile
constexpr int64_t kBlocksTile = 2;  // packed blocks per register tile: 4 x 2 int32 and 4 x 2 float accumulators

// 8-bit activations: vpdpbusd on 4 inputs per lane, the weights' +128 corrected per chunk.
struct Int8Activations {
  using type = int8_t;
  static constexpr int32_t kMax = 127;
  // 16 quantized inputs i.. of a row of k_padded.
  static void store(const __m512i& q, type* row, int64_t i, int64_t) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + i), _mm512_cvtsepi32_epi8(q));
  }
  // dots[r] += the 4 inputs at k of row r times `weights` (16 rows' 4 bytes), for Rows rows.
  template <int64_t Rows>
  static void multiply(__m512i (&dots)[Rows], const __m512i& weights, const type* xq, int64_t stride, int64_t k) {
    for (int64_t r = 0; r < Rows; ++r) {
      int32_t four;
      std::memcpy(&four, xq + r * stride + k, sizeof four);
      dots[r] = _mm512_dpbusd_epi32(dots[r], weights, _mm512_set1_epi32(four));
    }
  }
};

// 16-bit activations: the 4 weight bytes (q + 128) zero-extended into two pairs of int16, two vpdpwssd per
// 4 inputs, the +128 corrected per chunk.
struct Int16Activations {
  using type = int16_t;
  static constexpr int32_t kMax = 32767;
  static void store(const __m512i& q, type* row, int64_t i, int64_t) {  // x0 x1 x2 x3 -> x0 x2 x1 x3 in each 4
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + i),
                        _mm512_cvtsepi32_epi16(_mm512_shuffle_epi32(q, static_cast<_MM_PERM_ENUM>(0xD8))));
  }
  template <int64_t Rows>
  static void multiply(__m512i (&dots)[Rows], const __m512i& weights, const type* xq, int64_t stride, int64_t k) {
    const __m512i even = _mm512_and_si512(weights, _mm512_set1_epi16(0xFF));  // bytes 0 and 2 of each 4, as int16
    const __m512i odd = _mm512_srli_epi16(weights, 8);                         // bytes 1 and 3
    for (int64_t r = 0; r < Rows; ++r) {
      int32_t pairs[2];
      std::memcpy(pairs, xq + r * stride + k, sizeof pairs);  // (x0, x2), (x1, x3)
      dots[r] = _mm512_dpwssd_epi32(dots[r], even, _mm512_set1_epi32(pairs[0]));
      dots[r] = _mm512_dpwssd_epi32(dots[r], odd, _mm512_set1_epi32(pairs[1]));
    }
  }
};

// One activation row of k values (widened to float32, zero-padded to k_padded) -> xq, the chunk scales
// and the chunks' corrections.
template <typename Policy>
void quantize_row(const float* x, int64_t k_padded, int64_t chunk, typename Policy::type* out, float* scales,
                  int32_t* corrections) {
  const __m512i low = _mm512_set1_epi32(-Policy::kMax), high = _mm512_set1_epi32(Policy::kMax);
  for (int64_t start = 0; start < k_padded; start += chunk) {
    __m512 peak = _mm512_setzero_ps();
    for (int64_t i = start; i < start + chunk; i += kBlock)
      peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    const float absmax = _mm512_reduce_max_ps(peak);
    const __m512 multiplier = _mm512_set1_ps(absmax > 0.f ? Policy::kMax / absmax : 0.f);
    scales[start / chunk] = absmax / Policy::kMax;
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = start; i < start + chunk; i += kBlock) {
      const __m512i q = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i),
                                                                                           multiplier)), low), high);
      sum = _mm512_add_epi32(sum, q);
      Policy::store(q, out, i, k_padded);
    }
    corrections[start / chunk] = -128 * _mm512_reduce_add_epi32(sum);  // takes the weights' +128 back out
  }
}

// rows (<= kRowsTile) activation rows x blocks (<= kBlocksTile) packed blocks over chunks [c0, c1): the running
// sums out[r * stride + b * 16 + j], float32, loaded (from zero if `first`) and stored back.
template <typename Policy, int64_t Rows, int64_t Blocks>
void tile(const typename Policy::type* xq, const float* xs, const int32_t* xc, const Shape& shape,
          const uint8_t* packed, const float* scales, int64_t c0, int64_t c1, float* out, int64_t stride, bool first) {
  const int64_t chunks = shape.k_padded / shape.chunk, block_bytes = shape.k_padded * kBlock;
  const int64_t block_groups = shape.k_padded / shape.group * kBlock;
  __m512 sums[Rows][Blocks];
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t b = 0; b < Blocks; ++b)
      sums[r][b] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * stride + b * kBlock);
  for (int64_t c = c0; c < c1; ++c) {
    __m512i dots[Blocks][Rows];
    for (int64_t r = 0; r < Rows; ++r) {
      const __m512i start = _mm512_set1_epi32(xc[r * chunks + c]);
      for (int64_t b = 0; b < Blocks; ++b) dots[b][r] = start;
    }
    for (int64_t k = c * shape.chunk; k < (c + 1) * shape.chunk; k += 4)
      for (int64_t b = 0; b < Blocks; ++b)
        Policy::template multiply<Rows>(dots[b], _mm512_loadu_si512(packed + b * block_bytes + k * kBlock), xq,
                                        shape.k_padded, k);
    const int64_t g = c * shape.chunk / shape.group;
    for (int64_t b = 0; b < Blocks; ++b) {
      const __m512 weight_scales = _mm512_loadu_ps(scales + b * block_groups + g * kBlock);
      for (int64_t r = 0; r < Rows; ++r) {
        const __m512 scale = _mm512_mul_ps(weight_scales, _mm512_set1_ps(xs[r * chunks + c]));
        sums[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[b][r]), scale, sums[r][b]);
      }
    }
  }
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t b = 0; b < Blocks; ++b) _mm512_storeu_ps(out + r * stride + b * kBlock, sums[r][b]);
}

template <typename Policy, int64_t Blocks, typename... Args>
void tile_rows(int64_t rows, Args... args) {
  switch (rows) {
    case 4: return tile<Policy, 4, Blocks>(args...);
    case 3: return tile<Policy, 3, Blocks>(args...);
    case 2: return tile<Policy, 2, Blocks>(args...);
    default: return tile<Policy, 1, Blocks>(args...);
  }
}

template <typename Policy>
struct Vnni {
  using type = typename Policy::type;
  static constexpr int64_t kRowsTile = zoo::kRowsTile, kBlocksTile = zoo::kBlocksTile;
  static constexpr int64_t kRunBlocks = kBlocksTile, kRunTiles = 1, kSpanInputs = 0;  // measured: longer runs slower
  static void start_thread(const Shape&) {}
  static void end_thread() {}
  static void quantize_row(const float* x, int64_t k_padded, int64_t chunk, type* out, float* scales,
                           int32_t* corrections) {
    zoo::quantize_row<Policy>(x, k_padded, chunk, out, scales, corrections);
  }
  static void tile(int64_t rows, int64_t blocks, const type* xq, const float* xs, const int32_t* xc,
                   const Shape& shape, const uint8_t* packed, const float* scales, int64_t c0, int64_t c1, float* out,
                   int64_t stride, bool first) {
    if (blocks == kBlocksTile)
      tile_rows<Policy, kBlocksTile>(rows, xq, xs, xc, shape, packed, scales, c0, c1, out, stride, first);
    else
      tile_rows<Policy, 1>(rows, xq, xs, xc, shape, packed, scales, c0, c1, out, stride, first);
  }
};
#endif

#if defined(ZOO_INT8_AMX)
// AMX-INT8 tiles: one tile product is 16 activation rows x 2 packed blocks, over windows of the chunk's inputs
// (gcd(chunk, 64): a chunk's integer sums are its own). Tiles: C 0-1 (the blocks' sums of the activations' only or
// high bytes), C 2-3 (of the low bytes, 16 bits), A 4 (only or high bytes), A 5 (low bytes), B 6-7 (the blocks).
// Activation rows are padded with zero rows to a whole tile (the driver allocates them so); the sums of those rows
// are never read.
// The input bytes per tile product: the largest power of two up to 64 dividing the chunk (a multiple of 16).
int64_t amx_window(const Shape& shape) { return std::gcd(shape.chunk, int64_t{64}); }

// 16-bit activations as AMX multiplies them: a row's k_padded int16 slots hold its inputs' high bytes (int8), then
// their low bytes (uint8): xq = 256 high + low.
struct Int16Planes {
  using type = int16_t;
  static constexpr int32_t kMax = Int16Activations::kMax;
  static void store(const __m512i& q, type* row, int64_t i, int64_t k_padded) {
    auto* bytes = reinterpret_cast<uint8_t*>(row);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(bytes + i), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 8)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(bytes + k_padded + i), _mm512_cvtepi32_epi8(q));  // the low bytes
  }
};

template <typename Policy>
struct Amx {
  static constexpr bool kSplit = std::is_same_v<Policy, Int16Planes>;  // 16 bits: high and low bytes
  using type = typename Policy::type;
  static constexpr int64_t kRowsTile = 16, kBlocksTile = 2, kRunBlocks = 2, kRunTiles = 1, kSpanInputs = 0;

  static void start_thread(const Shape& shape) {
    const auto window = static_cast<uint16_t>(amx_window(shape));
    const auto b_rows = static_cast<uint8_t>(window / 4);  // B: a row per 4 inputs, 16 outputs x 4 bytes
    load_tile_config({16, 16, 16, 16, 16, 16, b_rows, b_rows}, {64, 64, 64, 64, window, window, 64, 64});  // C, A, B
  }
  static void end_thread() { _tile_release(); }

  static void quantize_row(const float* x, int64_t k_padded, int64_t chunk, type* out, float* scales,
                           int32_t* corrections) {
    zoo::quantize_row<Policy>(x, k_padded, chunk, out, scales, corrections);
  }

  template <int64_t Blocks>
  static void tile_of(int64_t rows, const type* xq, const float* xs, const int32_t* xc, const Shape& shape,
                      const uint8_t* packed, const float* scales, int64_t c0, int64_t c1, float* out, int64_t stride,
                      bool first) {
    const int64_t chunks = shape.k_padded / shape.chunk, block_bytes = shape.k_padded * kBlock;
    const int64_t block_groups = shape.k_padded / shape.group * kBlock, window = amx_window(shape);
    const auto* bytes = reinterpret_cast<const uint8_t*>(xq);
    const int64_t row_bytes = shape.k_padded * static_cast<int64_t>(sizeof(type));
    alignas(64) int32_t dots[4][16 * kBlock];  // the C tiles, as numbered
    if (first) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < Blocks; ++b) _mm512_storeu_ps(out + r * stride + b * kBlock, _mm512_setzero_ps());
    }
    for (int64_t c = c0; c < c1; ++c) {
      _tile_zero(0);
      if constexpr (Blocks == 2) _tile_zero(1);
      if constexpr (kSplit) {
        _tile_zero(2);
        if constexpr (Blocks == 2) _tile_zero(3);
      }
      for (int64_t k = c * shape.chunk; k < (c + 1) * shape.chunk; k += window) {
        _tile_loadd(4, bytes + k, row_bytes);
        if constexpr (kSplit) _tile_loadd(5, bytes + shape.k_padded + k, row_bytes);
        _tile_loadd(6, packed + k * kBlock, 64);
        if constexpr (Blocks == 2) _tile_loadd(7, packed + block_bytes + k * kBlock, 64);
        _tile_dpbsud(0, 4, 6);
        if constexpr (Blocks == 2) _tile_dpbsud(1, 4, 7);
        if constexpr (kSplit) {
          _tile_dpbuud(2, 5, 6);
          if constexpr (Blocks == 2) _tile_dpbuud(3, 5, 7);
        }
      }
      _tile_stored(0, dots[0], 64);
      if constexpr (Blocks == 2) _tile_stored(1, dots[1], 64);
      if constexpr (kSplit) {
        _tile_stored(2, dots[2], 64);
        if constexpr (Blocks == 2) _tile_stored(3, dots[3], 64);
      }
      const int64_t g = c * shape.chunk / shape.group;
      for (int64_t b = 0; b < Blocks; ++b) {
        const __m512 weight_scales = _mm512_loadu_ps(scales + b * block_groups + g * kBlock);
        for (int64_t r = 0; r < rows; ++r) {
          __m512i sum = _mm512_load_si512(dots[b] + r * 16);
          if constexpr (kSplit)  // 256 hi + lo: integers, exact in any order
            sum = _mm512_add_epi32(_mm512_slli_epi32(sum, 8), _mm512_load_si512(dots[2 + b] + r * 16));
          sum = _mm512_add_epi32(sum, _mm512_set1_epi32(xc[r * chunks + c]));
          const __m512 scale = _mm512_mul_ps(weight_scales, _mm512_set1_ps(xs[r * chunks + c]));
          float* sums = out + r * stride + b * kBlock;
          _mm512_storeu_ps(sums, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, _mm512_loadu_ps(sums)));
        }
      }
    }
  }

  static void tile(int64_t rows, int64_t blocks, const type* xq, const float* xs, const int32_t* xc,
                   const Shape& shape, const uint8_t* packed, const float* scales, int64_t c0, int64_t c1, float* out,
                   int64_t stride, bool first) {
    if (blocks == kBlocksTile)
      tile_of<kBlocksTile>(rows, xq, xs, xc, shape, packed, scales, c0, c1, out, stride, first);
    else
      tile_of<1>(rows, xq, xs, xc, shape, packed, scales, c0, c1, out, stride, first);
  }
};
#endif

// 16-bit activations on AVX2: the same quantization and integer sums as Vnni<Int16Activations>, one packed block (two
// halves of 8 rows) per tile.
struct Avx2Int16 {
  using type = int16_t;
  static constexpr int64_t kRowsTile = 4, kBlocksTile = 1, kRunBlocks = 4, kRunTiles = 12, kSpanInputs = 256;
  static constexpr int32_t kMax = 32767;
  static void start_thread(const Shape&) {}
  static void end_thread() {}

  // As quantize_row<Int16Activations>, a value at a time: the same float32 products, rounding (cvtss2si, like
  // vcvtps2dq, under the current rounding mode) and clamping.
  static void quantize_row(const float* x, int64_t k_padded, int64_t chunk, type* out, float* scales,
                           int32_t* corrections) {
    constexpr int64_t kOrder[4] = {0, 2, 1, 3};  // x0 x1 x2 x3 stored as x0 x2 x1 x3
    for (int64_t start = 0; start < k_padded; start += chunk) {
      float absmax = 0.f;
      for (int64_t i = start; i < start + chunk; ++i) absmax = std::max(absmax, std::fabs(x[i]));
      const float multiplier = absmax > 0.f ? kMax / absmax : 0.f;
      scales[start / chunk] = absmax / kMax;
      int32_t sum = 0;
      for (int64_t i = start; i < start + chunk; ++i) {
        const int32_t q = std::min(std::max(_mm_cvtss_si32(_mm_set_ss(x[i] * multiplier)), -kMax), kMax);
        sum += q;
        out[(i & ~int64_t{3}) + kOrder[i & 3]] = static_cast<type>(q);
      }
      corrections[start / chunk] = -128 * sum;  // takes the weights' +128 back out
    }
  }

  template <int64_t Rows>
  static void tile_of(const type* xq, const float* xs, const int32_t* xc, const Shape& shape, const uint8_t* packed,
                      const float* scales, int64_t c0, int64_t c1, float* out, int64_t stride, bool first) {
    const int64_t chunks = shape.k_padded / shape.chunk;
    const __m256i low_bytes = _mm256_set1_epi16(0xFF);
    __m256 sums[Rows][2];
#pragma GCC unroll 4
    for (int64_t r = 0; r < Rows; ++r)
      for (int64_t h = 0; h < 2; ++h)
        sums[r][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + r * stride + 8 * h);
    for (int64_t c = c0; c < c1; ++c) {
      __m256i dots[Rows][2];
#pragma GCC unroll 4
      for (int64_t r = 0; r < Rows; ++r) dots[r][0] = dots[r][1] = _mm256_set1_epi32(xc[r * chunks + c]);
      for (int64_t k = c * shape.chunk; k < (c + 1) * shape.chunk; k += 4) {
        __m256i even[2], odd[2];  // of rows 0-7 and 8-15: bytes 0 and 2, 1 and 3 of each 4, as int16
#pragma GCC unroll 2
        for (int64_t h = 0; h < 2; ++h) {
          const __m256i weights = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + k * kBlock + h * 32));
          even[h] = _mm256_and_si256(weights, low_bytes);
          odd[h] = _mm256_srli_epi16(weights, 8);
        }
#pragma GCC unroll 4
        for (int64_t r = 0; r < Rows; ++r) {
          int32_t pairs[2];
          std::memcpy(pairs, xq + r * shape.k_padded + k, sizeof pairs);  // (x0, x2), (x1, x3)
          const __m256i first = _mm256_set1_epi32(pairs[0]), second = _mm256_set1_epi32(pairs[1]);
#pragma GCC unroll 2
          for (int64_t h = 0; h < 2; ++h) {
            dots[r][h] = _mm256_add_epi32(dots[r][h], _mm256_madd_epi16(even[h], first));
            dots[r][h] = _mm256_add_epi32(dots[r][h], _mm256_madd_epi16(odd[h], second));
          }
        }
      }
      const int64_t g = c * shape.chunk / shape.group;
      const __m256 weight_scales[2] = {_mm256_loadu_ps(scales + g * kBlock), _mm256_loadu_ps(scales + g * kBlock + 8)};
#pragma GCC unroll 4
      for (int64_t r = 0; r < Rows; ++r) {
        const __m256 activation_scale = _mm256_set1_ps(xs[r * chunks + c]);
        for (int64_t h = 0; h < 2; ++h) {
          const __m256 scale = _mm256_mul_ps(weight_scales[h], activation_scale);
          sums[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r][h]), scale, sums[r][h]);
        }
      }
    }
#pragma GCC unroll 4
    for (int64_t r = 0; r < Rows; ++r)
      for (int64_t h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * stride + 8 * h, sums[r][h]);
  }

  template <typename... Args>
  static void tile(int64_t rows, int64_t, Args... args) {
    switch (rows) {
      case 4: return tile_of<4>(args...);
      case 3: return tile_of<3>(args...);
      case 2: return tile_of<2>(args...);
      default: return tile_of<1>(args...);
    }
  }
};

// The activation chunk: the group, or for a group over kMaxChunk inputs the largest multiple of 16 dividing it.
int64_t chunk_size(int64_t group) {
  int64_t chunk = std::min(group, kMaxChunk);
  while (group % chunk) chunk -= kBlock;
  return chunk;
}

template <typename Kernel, typename scalar_t>
void multiply(const scalar_t* xp, int64_t rows, int64_t k, const Shape& shape, const uint8_t* wp, const float* sp,
              const scalar_t* bp, int64_t blocks, int64_t out_features, scalar_t* yp) {
  constexpr int64_t kRowsTile = Kernel::kRowsTile, kBlocksTile = Kernel::kBlocksTile;
  const int64_t chunks = shape.k_padded / shape.chunk;
  // Zero rows pad the activations to a whole row tile: a kernel may read a tile's rows past the call's.
  std::vector<typename Kernel::type> xq((rows + kRowsTile - 1) / kRowsTile * kRowsTile * shape.k_padded);
  std::vector<float> xs(rows * chunks);
  std::vector<int32_t> xc(rows * chunks);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(shape.k_padded, 0.f);
    for (int64_t r = begin; r < end; ++r) {
      widen(xp + r * k, wide.data(), k);
      Kernel::quantize_row(wide.data(), shape.k_padded, shape.chunk, xq.data() + r * shape.k_padded,
                           xs.data() + r * chunks, xc.data() + r * chunks);
    }
  });
  const int64_t groups = shape.k_padded / shape.group;
  // Tasks: a column tile of blocks times a run of rows, column tiles outer: each thread streams its share of the
  // weights once. A call of one row tile takes the kernel's own tile of blocks over all inputs (decode with few rows:
  // the weights are all its work). A longer one takes the kernel's kRunBlocks blocks and kRunTiles row tiles, a span
  // of about kSpanInputs inputs at a time (0: all): the span's weights stay in the L1 cache for every row tile of the
  // run, and a row tile's span of activations for every block, the running sums kept in `sums` between spans.
  // Either way each output's chunks are summed in ascending order from zero: the same bits.
  constexpr int64_t kRunBlocks = Kernel::kRunBlocks, kRunTiles = Kernel::kRunTiles;
  static_assert(kRunBlocks % kBlocksTile == 0, "a run's blocks are whole kernel tiles");
  const bool one_tile = rows <= kRowsTile;
  const int64_t run_blocks = one_tile ? kBlocksTile : kRunBlocks;
  const int64_t run_rows = one_tile ? kRowsTile : kRunTiles * kRowsTile;
  const int64_t span =
      one_tile || !Kernel::kSpanInputs ? chunks : std::max<int64_t>(1, Kernel::kSpanInputs / shape.chunk);
  const int64_t column_tiles = (blocks + run_blocks - 1) / run_blocks, row_runs = (rows + run_rows - 1) / run_rows;
  constexpr int64_t kStride = kRunBlocks * kBlock;  // of sums
  share_tasks(column_tiles * row_runs, [&](int64_t begin, int64_t end) {
    Kernel::start_thread(shape);
    std::vector<float> buffer(kRunTiles * kRowsTile * kStride);
    float* sums = buffer.data();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task / row_runs * run_blocks, row = task % row_runs * run_rows;
      const int64_t task_rows = std::min(run_rows, rows - row), task_blocks = std::min(run_blocks, blocks - block);
      for (int64_t c0 = 0; c0 < chunks; c0 += span) {
        for (int64_t r = 0; r < task_rows; r += kRowsTile) {
          const int64_t tile_row = row + r;
          for (int64_t b = 0; b < task_blocks; b += kBlocksTile)
            Kernel::tile(std::min(kRowsTile, task_rows - r), std::min(kBlocksTile, task_blocks - b),
                         xq.data() + tile_row * shape.k_padded, xs.data() + tile_row * chunks,
                         xc.data() + tile_row * chunks, shape, wp + (block + b) * shape.k_padded * kBlock,
                         sp + (block + b) * groups * kBlock, c0, std::min(chunks, c0 + span),
                         sums + r * kStride + b * kBlock, kStride, c0 == 0);
        }
      }
      const int64_t first = block * kBlock, last = std::min(out_features, (block + task_blocks) * kBlock);
      for (int64_t r = 0; r < task_rows; ++r) {
        scalar_t* y = yp + (row + r) * out_features;
        const float* values = sums + r * kStride;
        for (int64_t n = first; n < last; ++n)
          y[n] = from_float<scalar_t>(bp ? values[n - first] + to_float(bp[n]) : values[n - first]);
      }
    }
    Kernel::end_thread();
  });
}

enum class Path { kAvx2, kVnni, kAmx };
constexpr const char* kPathNames[] = {"avx2", "vnni", "amx"};

// The paths built here and usable by this process, in Path order.
int built_paths() {
#if defined(ZOO_INT8_AMX)
  if (amx_tiles_granted()) return 3;
#endif
  return int8_vnni_available() ? 2 : 1;
}

template <typename scalar_t>
void multiply_on(Path path, int64_t activation_bits, const scalar_t* xp, int64_t rows, int64_t k, const Shape& shape,
                 const uint8_t* wp, const float* sp, const scalar_t* bp, int64_t blocks, int64_t out_features,
                 scalar_t* yp) {
#if defined(ZOO_INT8_AMX)
  if (path == Path::kAmx && activation_bits == 8)
    return multiply<Amx<Int8Activations>>(xp, rows, k, shape, wp, sp, bp, blocks, out_features, yp);
  if (path == Path::kAmx)
    return multiply<Amx<Int16Planes>>(xp, rows, k, shape, wp, sp, bp, blocks, out_features, yp);
#endif
#if defined(ZOO_INT8_VNNI)
  if (activation_bits == 8)
    return multiply<Vnni<Int8Activations>>(xp, rows, k, shape, wp, sp, bp, blocks, out_features, yp);
  if (path != Path::kAvx2)
    return multiply<Vnni<Int16Activations>>(xp, rows, k, shape, wp, sp, bp, blocks, out_features, yp);
#endif
  multiply<Avx2Int16>(xp, rows, k, shape, wp, sp, bp, blocks, out_features, yp);
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                     const c10::optional<torch::Tensor>& bias, int64_t out_features, int64_t activation_bits,
                     Path path);

// Calls of at most kFewRows rows (one VNNI register tile: a decode step of a few rows) and longer ones have a path
// each: AMX's 16-row tiles are mostly idle on the former.
constexpr int64_t kFewRows = kBlock / 4;
TimedChoice few_rows_choice, path_choice;

// The fastest path on this CPU for a call of `rows` rows: the GEMM timed with each, 16-bit activations, on a call of
// kFewRows rows or of 64 whose weights stay in the L2 cache, in groups of `group` inputs (the first call's: a model
// has one group size; AMX's lead over VNNI grows with the group, its per-group sums leaving its tiles for memory).
Path path_in_use(int64_t group, int64_t rows) {
  const int64_t timed_rows = rows <= kFewRows ? kFewRows : 64;
  return static_cast<Path>((rows <= kFewRows ? few_rows_choice : path_choice).get([group, timed_rows] {
    constexpr int64_t kOut = 256;
    const int64_t in = group * std::max<int64_t>(1, 576 / group);
    const auto x = torch::full({timed_rows, in}, 0.5f);
    const auto packed = torch::full({kOut / kBlock, in / 4, kBlock, 4}, 130, torch::dtype(at::kByte));
    const auto scales = torch::full({kOut / kBlock, in / group, kBlock}, 0.01f);
    return std::function<void(int)>([=](int path) {
      linear(x, packed, scales, c10::nullopt, kOut, 16, static_cast<Path>(path));
    });
  }, built_paths()));
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                     const c10::optional<torch::Tensor>& bias, int64_t out_features, int64_t activation_bits,
                     Path path) {
  TORCH_CHECK(x.device().is_cpu() && is_storage_type(x.scalar_type()) && x.dim() >= 1,
              "x must be a float32, bfloat16 or float16 CPU tensor (..., K)");
  TORCH_CHECK(activation_bits == 8 || activation_bits == 16, "activation_bits must be 8 or 16");
  TORCH_CHECK(activation_bits == 16 || int8_vnni_available(), "8-bit activations need AVX512-VNNI, which this "
              "build's CPU lacks");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.size(2) == kBlock &&
                  packed.size(3) == 4 && packed.is_contiguous(), "packed must be contiguous uint8 (N/16, K/4, 16, 4)");
  const int64_t blocks = packed.size(0), k_padded = packed.size(1) * 4, groups = scales.size(1);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == blocks && scales.size(2) == kBlock && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat && groups > 0 && k_padded % groups == 0,
              "scales must be contiguous float32 (N/16, G, 16), G dividing the padded K");
  const int64_t group = k_padded / groups, k = x.size(-1);
  TORCH_CHECK(group % kBlock == 0, "the group size must be a multiple of 16");
  TORCH_CHECK(k <= k_padded && k_padded - k < group, "x's last dimension does not match the packed weight");
  TORCH_CHECK(out_features > 0 && out_features <= blocks * kBlock && out_features > (blocks - 1) * kBlock,
              "out_features does not match the packed weight");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->scalar_type() == x.scalar_type() &&
                    bias->is_contiguous(), "bias must be contiguous (out_features,) of x's dtype");
  }
  const auto input = x.contiguous();
  const int64_t rows = k ? input.numel() / k : 0;
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  auto out = torch::empty(sizes, x.options());
  // 8 bits: one activation scale per weight group (whole rows per channel: no int32 overflow at 8 x 8 bits).
  const Shape shape{k_padded, group, activation_bits == 8 ? group : chunk_size(group)};
  ZOO_DISPATCH_FLOATS(x.scalar_type(), "int8_linear", [&] {
    const scalar_t* bp = bias ? bias->data_ptr<scalar_t>() : nullptr;
    multiply_on(path, activation_bits, input.data_ptr<scalar_t>(), rows, k, shape, packed.data_ptr<uint8_t>(),
                scales.data_ptr<float>(), bp, blocks, out_features, out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& bias, int64_t out_features, int64_t activation_bits) {
  const int64_t groups = scales.dim() == 3 ? scales.size(1) : 0;
  const int64_t group = packed.dim() == 4 && groups > 0 ? packed.size(1) * 4 / groups : 0;  // checked by linear
  const int64_t rows = x.dim() >= 1 && x.size(-1) ? x.numel() / x.size(-1) : 0;
  return linear(x, packed, scales, bias, out_features, activation_bits,
                path_in_use(group > 0 && group % kBlock == 0 ? group : 32, rows));
}

std::vector<std::string> int8_gemm_paths() { return {kPathNames, kPathNames + built_paths()}; }

std::string int8_gemm_path(const std::string& use, int64_t group, int64_t rows) {
  if (!use.empty()) {
    const auto paths = int8_gemm_paths();
    const auto found = std::find(paths.begin(), paths.end(), use);
    TORCH_CHECK(found != paths.end(), "path is ", c10::Join(", ", paths), " here, not ", use);
    few_rows_choice.set(static_cast<int>(found - paths.begin()));
    path_choice.set(static_cast<int>(found - paths.begin()));
  }
  TORCH_CHECK(group > 0 && group % kBlock == 0, "group must be a positive multiple of 16, not ", group);
  return kPathNames[static_cast<int>(path_in_use(group, rows))];
}

}  // namespace zoo
