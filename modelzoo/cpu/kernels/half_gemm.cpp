// 16-bit-weight linear layers in float32 arithmetic: y = x @ W^T (+ bias), W bfloat16 or float16, x and y float32.
// (float32 weights pack and multiply the same way, read as they are: the float32 GEMM candidate `packed` of
// modelzoo/cpu/gemm.py, batch-invariant by construction.)
//
// The GEMM of the precision policy on a CPU without native multiplies for the job's 16-bit dtype
// (modelzoo/precision.py): the weights stay in their own 2 bytes, are widened to float32 as they are read (into
// registers, or into a small float32 panel that up to 48 rows share: `multiply`), and multiply the float32 inputs as
// they are (no rounding of the inputs): the arithmetic of a float32 GEMM over the 16-bit values, at half the bytes of
// weights read per decode step.
//
// Weights: W (N, K), packed by pack_half_weight (below) into blocks of 16 output rows:
//   packed (N/16, K, 16) bfloat16 or float16: for each input, 16 rows' values side by side.
// N is padded with zero rows to a multiple of 16. Each output is one float32 lane summing x[k] * w[k] with one fused
// multiply-add per input, in ascending k, from zero: whatever the other rows of the call, and whichever code path
// runs, an output's bits are the same (batch-invariant, and the AVX2 and AVX-512 paths agree bit for bit).
//
// Two code paths: AVX2 + FMA (+ F16C for float16; every AVX2 CPU has it) with tiles of 6 rows x 16 outputs, and,
// where the build has AVX-512, tiles of 6 rows x 64 outputs. The faster on this CPU is timed once per process
// (`half_gemm_path`); tests set each.
#include "greedy_picks.h"
#include "kernels.h"
#include "shared_tasks.h"
#include "storage.h"
#include "timed_choice.h"
#include "weight_rows.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>

namespace zoo {
namespace {

constexpr int64_t kBlock = 16;    // output rows per packed block
constexpr int64_t kRowsTile = 6;  // activation rows per register tile
constexpr int64_t kRowsAhead = 128;  // inputs ahead of its reads that a weight read in rows is prefetched

enum class Path { kAvx2, kAvx512 };

constexpr bool avx512_built() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// Calls f with std::integral_constant n, for n in 1 .. N (a tile's row or block count as a compile-time constant).
template <int64_t N, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (N > 1) {
    if (n >= N) return f(std::integral_constant<int64_t, N>{});
    return with_count<N - 1>(n, std::forward<F>(f));
  } else {
    f(std::integral_constant<int64_t, 1>{});
  }
}

// AVX2 tile: Rows rows x one block of 16 outputs (two 8-wide halves), inputs [0, kc) of x (the first row; rows k
// apart). weights(i, h): half h of input i's 16 weights as float32. sums: Rows x 16 floats at `stride`, the running
// sums, loaded unless `first` and stored back.
template <int64_t Rows, typename Weights>
inline void tile_avx2(const float* x, int64_t k, int64_t kc, const Weights& weights, float* sums, int64_t stride,
                      bool first) {
  __m256 acc[Rows][2];
#pragma GCC unroll 8
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t h = 0; h < 2; ++h)
      acc[r][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + r * stride + 8 * h);
  for (int64_t i = 0; i < kc; ++i) {
    const __m256 low = weights(i, 0), high = weights(i, 1);
#pragma GCC unroll 8
    for (int64_t r = 0; r < Rows; ++r) {
      const __m256 input = _mm256_broadcast_ss(x + r * k + i);
      acc[r][0] = _mm256_fmadd_ps(input, low, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(input, high, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t h = 0; h < 2; ++h) _mm256_storeu_ps(sums + r * stride + 8 * h, acc[r][h]);
}

#if defined(__AVX512F__)
template <typename T>
inline __m512 widen16(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm512_loadu_ps(p);
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  return _mm512_cvtph_ps(bits);
}

// AVX-512 tile: Rows rows x Blocks blocks of 16 outputs; weights(i, b): block b's 16 weights of input i as float32;
// otherwise as tile_avx2.
template <int64_t Rows, int64_t Blocks, typename Weights>
inline void tile_avx512(const float* x, int64_t k, int64_t kc, const Weights& weights, float* sums, int64_t stride,
                        bool first) {
  __m512 acc[Rows][Blocks];
#pragma GCC unroll 8
  for (int64_t r = 0; r < Rows; ++r)
#pragma GCC unroll 4
    for (int64_t b = 0; b < Blocks; ++b)
      acc[r][b] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + r * stride + b * kBlock);
  for (int64_t i = 0; i < kc; ++i) {
    __m512 w[Blocks];
#pragma GCC unroll 4
    for (int64_t b = 0; b < Blocks; ++b) w[b] = weights(i, b);
#pragma GCC unroll 8
    for (int64_t r = 0; r < Rows; ++r) {
      const __m512 input = _mm512_set1_ps(x[r * k + i]);
#pragma GCC unroll 4
      for (int64_t b = 0; b < Blocks; ++b) acc[r][b] = _mm512_fmadd_ps(input, w[b], acc[r][b]);
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < Rows; ++r)
#pragma GCC unroll 4
    for (int64_t b = 0; b < Blocks; ++b) _mm512_storeu_ps(sums + r * stride + b * kBlock, acc[r][b]);
}
#endif

// A tile of `rows` (<= 6) x `blocks` (<= 4; one at a time on the AVX2 path) over inputs [0, kc): with
// `packed` the blocks' packed weights (block_values apart), widened in registers as they are multiplied; else
// `panel` (kc, blocks * 16), widened before.
template <typename T>
void tile(Path path, int64_t rows, int64_t blocks, const float* x, int64_t k, int64_t kc, const T* packed,
          int64_t block_values, const float* panel, float* sums, int64_t stride, bool first) {
#if defined(__AVX512F__)
  if (path == Path::kAvx512) {
    return with_count<kRowsTile>(rows, [&](auto r) {
      with_count<4>(blocks, [&](auto b) {
        constexpr int64_t kBlocks = decltype(b)::value;
        if (packed) {
          tile_avx512<decltype(r)::value, kBlocks>(x, k, kc, [=](int64_t i, int64_t block) {
            return widen16<T>(packed + block * block_values + i * kBlock);
          }, sums, stride, first);
        } else {
          tile_avx512<decltype(r)::value, kBlocks>(x, k, kc, [=](int64_t i, int64_t block) {
            return _mm512_loadu_ps(panel + (i * kBlocks + block) * kBlock);
          }, sums, stride, first);
        }
      });
    });
  }
#endif
  with_count<kRowsTile>(rows, [&](auto r) {
    for (int64_t b = 0; b < blocks; ++b) {  // the tile's rows of x stay in the L1 cache from block to block
      if (packed) {
        tile_avx2<decltype(r)::value>(x, k, kc, [=](int64_t i, int64_t h) {
          return load8(packed + b * block_values + i * kBlock + 8 * h);  // widened to float32
        }, sums + b * kBlock, stride, first);
      } else {
        tile_avx2<decltype(r)::value>(x, k, kc, [=](int64_t i, int64_t h) {
          return _mm256_loadu_ps(panel + (i * blocks + b) * kBlock + 8 * h);
        }, sums + b * kBlock, stride, first);
      }
    }
  });
}

// inputs [k0, k0 + kc) of `blocks` packed blocks (the first at w, block_values apart) widened into panel (kc, blocks
// * 16) float32.
template <typename T>
void widen_panel(const T* w, int64_t blocks, int64_t block_values, int64_t k0, int64_t kc, float* panel) {
  for (int64_t i = 0; i < kc; ++i)
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t half = 0; half < 2; ++half)
        _mm256_storeu_ps(panel + (i * blocks + b) * kBlock + half * 8,
                         load8(w + b * block_values + (k0 + i) * kBlock + half * 8));
}

// The weights as `multiply` reads them (a "source"): packed blocks (N/16, K, 16) of pack_half_weight. `tile_in_registers`: a tile of
// rows (<= 6) x count blocks from `block` over all k inputs, its weights widened in registers as they are multiplied
// (false where a source cannot: the caller widens them into a panel); `widen`: inputs [k0, k0 + kc) of count blocks
// widened into a panel (kc, count * 16); `panel_in_place`: packed float32 blocks, read as the panel itself.
template <typename T>
struct PackedBlocks {
  const T* w;
  int64_t block_values;  // K * 16

  const T* panel_in_place(int64_t block, int64_t k0) const {
    return std::is_same_v<T, float> ? w + block * block_values + k0 * kBlock : nullptr;
  }
  bool tile_in_registers(Path path, int64_t rows, int64_t block, int64_t count, const float* x, int64_t k,
                         float* sums, int64_t stride) const {
    tile<T>(path, rows, count, x, k, k, w + block * block_values, block_values, nullptr, sums, stride, true);
    return true;
  }
  void widen(int64_t block, int64_t count, int64_t k0, int64_t kc, float* panel) const {
    widen_panel<T>(w + block * block_values, count, block_values, k0, kc, panel);
  }
};

// The two 16-bit values of each 32-bit word of `pairs` widened to float32: the first (lower address) into `low`.
template <typename T, typename V>
inline void widen_pairs(V pairs, V& low, V& high);

#if defined(__AVX512F__)
template <>
inline void widen_pairs<c10::BFloat16, __m512i>(__m512i pairs, __m512i& low, __m512i& high) {
  low = _mm512_slli_epi32(pairs, 16);
  high = _mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}
template <>
inline void widen_pairs<c10::Half, __m512i>(__m512i pairs, __m512i& low, __m512i& high) {
  low = _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(pairs)));
  high = _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pairs, 16))));
}
#endif

template <>
inline void widen_pairs<c10::BFloat16, __m256i>(__m256i pairs, __m256i& low, __m256i& high) {
  low = _mm256_slli_epi32(pairs, 16);
  high = _mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
}
// The low 16 bits of 8 words below 2^16 (exact through unsigned saturation), side by side.
inline __m128i low_halves(__m256i words) {
  return _mm_packus_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
}
template <>
inline void widen_pairs<c10::Half, __m256i>(__m256i pairs, __m256i& low, __m256i& high) {
  low = _mm256_castps_si256(_mm256_cvtph_ps(low_halves(_mm256_and_si256(pairs, _mm256_set1_epi32(0xFFFF)))));
  high = _mm256_castps_si256(_mm256_cvtph_ps(low_halves(_mm256_srli_epi32(pairs, 16))));
}

// Inputs [k0, k0 + kc) of 16 rows (row r at rows[r]) widened into the panel's 16 columns (panel + i * step is input k0
// + i's): the rows' 32-bit words (pairs of inputs) transposed in registers, 16 words of 16 rows at a time
// (8 x 8 on the AVX2 path), then each pair widened; inputs past the last whole word group one at a time.
template <typename T>
void widen_rows(const T* const rows[kBlock], int64_t k0, int64_t kc, float* panel, int64_t step, Path path) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (path == Path::kAvx512) {
    for (; i + 2 * kBlock <= kc; i += 2 * kBlock) {
      __m512i v[kBlock];
#pragma GCC unroll 16
      for (int64_t r = 0; r < kBlock; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(rows[r] + k0 + i + kRowsAhead), _MM_HINT_T0);
        v[r] = _mm512_loadu_si512(rows[r] + k0 + i);
      }
      transpose16_words(v);
#pragma GCC unroll 16
      for (int64_t j = 0; j < kBlock; ++j) {
        __m512i low, high;
        widen_pairs<T>(v[j], low, high);
        _mm512_storeu_si512(panel + (i + 2 * j) * step, low);
        _mm512_storeu_si512(panel + (i + 2 * j + 1) * step, high);
      }
    }
  }
#endif
  if (path == Path::kAvx2) {
    for (; i + kBlock <= kc; i += kBlock) {
      for (int64_t half = 0; half < 2; ++half) {
        __m256i v[8];
#pragma GCC unroll 8
        for (int64_t r = 0; r < 8; ++r) {
          _mm_prefetch(reinterpret_cast<const char*>(rows[8 * half + r] + k0 + i + kRowsAhead), _MM_HINT_T0);
          v[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[8 * half + r] + k0 + i));
        }
        transpose8_words(v);
#pragma GCC unroll 8
        for (int64_t j = 0; j < 8; ++j) {
          __m256i low, high;
          widen_pairs<T>(v[j], low, high);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + (i + 2 * j) * step + 8 * half), low);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + (i + 2 * j + 1) * step + 8 * half), high);
        }
      }
    }
  }
  for (; i < kc; ++i)
    for (int64_t r = 0; r < kBlock; ++r) panel[i * step + r] = static_cast<float>(rows[r][k0 + i]);
}

// The 16 x 16 block of 16-bit values at in (16 rows `stride` apart, 16 inputs each) -> out (16 inputs, 16 rows): the
// rows' words (pairs of inputs) transposed 8 rows at a time, then each word split into its two inputs' lines.
template <typename E>
inline void transpose_halves(const E* in, int64_t stride, E* out) {
  __m256i low[8], high[8];  // rows 0-7, rows 8-15
#pragma GCC unroll 8
  for (int64_t r = 0; r < 8; ++r) {
    low[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + r * stride));
    high[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + (8 + r) * stride));
  }
  transpose8_words(low);
  transpose8_words(high);
  const __m256i first = _mm256_set1_epi32(0xFFFF);
#pragma GCC unroll 8
  for (int64_t j = 0; j < 8; ++j) {  // word j: inputs 2j (its low half) and 2j + 1 of the 16 rows
    // packus interleaves 4 rows of each half per 128-bit lane; 0xD8 puts the quarters back in row order
    const __m256i even = _mm256_packus_epi32(_mm256_and_si256(low[j], first), _mm256_and_si256(high[j], first));
    const __m256i odd = _mm256_packus_epi32(_mm256_srli_epi32(low[j], 16), _mm256_srli_epi32(high[j], 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * j * kBlock), _mm256_permute4x64_epi64(even, 0xD8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (2 * j + 1) * kBlock), _mm256_permute4x64_epi64(odd, 0xD8));
  }
}

// The 16 x 8 block of float32 values at in (16 rows `stride` apart, 8 inputs each) -> out (8 inputs, 16 rows).
inline void transpose_floats(const float* in, int64_t stride, float* out) {
  for (int64_t half = 0; half < 2; ++half) {
    __m256i v[8];
#pragma GCC unroll 8
    for (int64_t r = 0; r < 8; ++r)
      v[r] = _mm256_castps_si256(_mm256_loadu_ps(in + (8 * half + r) * stride));
    transpose8_words(v);
#pragma GCC unroll 8
    for (int64_t j = 0; j < 8; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * kBlock + 8 * half), v[j]);
  }
}

// One block: `rows` (<= 16) rows of k values, `stride` apart from in, -> out (k, 16), zero rows padding it: the 16
// rows read side by side, each output line written whole (pack_half_weight's layout). A whole block is transposed in
// registers, 16 inputs (float32: 8) at a time.
template <typename E>
void pack_block(const E* in, int64_t stride, int64_t rows, int64_t k, E* out) {
  if (rows < kBlock) {
    std::memset(out, 0, k * kBlock * sizeof(E));
    for (int64_t i = 0; i < k; ++i)
      for (int64_t r = 0; r < rows; ++r) out[i * kBlock + r] = in[r * stride + i];
    return;
  }
  constexpr int64_t kInputs = sizeof(E) == 2 ? 16 : 8;  // inputs per transpose
  int64_t i = 0;
  for (; i + kInputs <= k; i += kInputs) {
    if constexpr (sizeof(E) == 2) {
      transpose_halves(in + i, stride, out + i * kBlock);
    } else {
      transpose_floats(in + i, stride, out + i * kBlock);
    }
  }
  for (; i < k; ++i)
    for (int64_t r = 0; r < kBlock; ++r) out[i * kBlock + r] = in[r * stride + i];
}

// A weight read where it lies: rows of one or more row-major parts, in blocks of 16 rows, a source of `multiply` (see
// PackedBlocks): a tile of up to 6 rows transposes and widens the rows' words in registers (AVX-512), longer runs (and
// the AVX2 path) widen them into a panel. 16 rows are read side by side, each prefetched kRowsAhead inputs ahead.
template <typename T>
struct RowBlocks {
  const RowBlock<T>* blocks;
  const T* zeros;  // a row of K zeros, for the rows past a weight's last
  Path path;

  const T* panel_in_place(int64_t, int64_t) const { return nullptr; }
  void row_pointers(int64_t b, const T* rows[kBlock]) const { blocks[b].pointers(zeros, rows); }
  void widen(int64_t block, int64_t count, int64_t k0, int64_t kc, float* panel) const {
    for (int64_t b = 0; b < count; ++b) {
      const T* rows[kBlock];
      row_pointers(block + b, rows);
      widen_rows<T>(rows, k0, kc, panel + b * kBlock, count * kBlock, path);
    }
  }
  // count blocks from `block`, all k inputs, packed into out (count, k, 16)
  void pack(int64_t block, int64_t count, int64_t k, T* out) const {
    for (int64_t b = 0; b < count; ++b) {
      const RowBlock<T>& source = blocks[block + b];
      pack_block(source.first, source.stride, source.rows, k, out + b * k * kBlock);
    }
  }
#if defined(__AVX512F__)
  // Rows rows x the 16 outputs of rows[0 .. 16) over all k inputs, into sums (Rows x 16, `stride` apart).
  template <int64_t Rows>
  static void tile16(const T* const rows[kBlock], const float* x, int64_t k, float* sums, int64_t stride) {
    __m512 acc[Rows];
#pragma GCC unroll 8
    for (int64_t r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 2 * kBlock <= k; i += 2 * kBlock) {
      __m512i v[kBlock];
#pragma GCC unroll 16
      for (int64_t r = 0; r < kBlock; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(rows[r] + i + kRowsAhead), _MM_HINT_T0);
        v[r] = _mm512_loadu_si512(rows[r] + i);
      }
      transpose16_words(v);
#pragma GCC unroll 16
      for (int64_t j = 0; j < kBlock; ++j) {
        __m512i low, high;
        widen_pairs<T>(v[j], low, high);
#pragma GCC unroll 8
        for (int64_t r = 0; r < Rows; ++r) {
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * k + i + 2 * j]), _mm512_castsi512_ps(low), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * k + i + 2 * j + 1]), _mm512_castsi512_ps(high), acc[r]);
        }
      }
    }
    for (; i < k; ++i) {
      alignas(64) float column[kBlock];
      for (int64_t r = 0; r < kBlock; ++r) column[r] = static_cast<float>(rows[r][i]);
      const __m512 w = _mm512_load_ps(column);
      for (int64_t r = 0; r < Rows; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * k + i]), w, acc[r]);
    }
#pragma GCC unroll 8
    for (int64_t r = 0; r < Rows; ++r) _mm512_storeu_ps(sums + r * stride, acc[r]);
  }
#endif
  bool tile_in_registers(Path, int64_t rows, int64_t block, int64_t count, const float* x, int64_t k, float* sums,
                         int64_t stride) const {
#if defined(__AVX512F__)
    if (path != Path::kAvx512) return false;
    for (int64_t b = 0; b < count; ++b) {
      const T* pointers[kBlock];
      row_pointers(block + b, pointers);
      with_count<kRowsTile>(rows, [&](auto r) { tile16<decltype(r)::value>(pointers, x, k, sums + b * kBlock, stride); });
    }
    return true;
#else
    return false;
#endif
  }
};

// y (rows, out_features) = x (rows, k) @ W^T (+ bias) over the weights `source` (PackedBlocks or RowBlocks). Tasks: a
// column tile (4 blocks; 1 on the AVX2 path for a call of one row tile over packed weights, whose weights are all its
// work) times a run of up to kRowsRun rows, column tiles outer: each thread streams its share of the weights once,
// and a row tile's inputs, read once from memory, serve the 64 outputs of its column tile. A task of one row tile
// widens each weight in registers as it multiplies it where its source can (decode with few rows); any other widens
// kPanelInputs inputs of its column tile at a time into a float32 panel that all its row tiles share (packed float32
// weights are read in place, as many inputs at a time), keeping its running sums in `sums` between panels. Weights
// read in rows by a call of several runs (a prefill) are packed a column tile at a time into a scratch that the tile's
// runs share (a task a column tile), rather than transposed again by each run. Either way each output's fused
// multiply-adds run in ascending k from zero: the same bits, from either source.
constexpr int64_t kRowsRun = 8 * kRowsTile;
constexpr int64_t kPanelInputs = 128;

// With `tokens` (greedy), y is not written: each row's pick among its outputs (greedy_picks.h) goes to tokens (rows,).
template <typename T, typename Source>
void multiply(const float* x, int64_t rows, int64_t k, const Source& source, int64_t blocks, const float* bias,
              int64_t out_features, float* y, Path path, int64_t* tokens = nullptr) {
  constexpr bool packed = std::is_same_v<Source, PackedBlocks<T>>;
  const int64_t blocks_tile = path == Path::kAvx512 || rows > kRowsTile || !packed ? 4 : 1;
  const int64_t column_tiles = (blocks + blocks_tile - 1) / blocks_tile;
  std::unique_ptr<GreedyPicks> picks(tokens ? new GreedyPicks(rows, column_tiles) : nullptr);
  const int64_t row_runs = (rows + kRowsRun - 1) / kRowsRun;
  const int64_t block_values = k * kBlock;
  const int64_t stride = blocks_tile * kBlock;  // of sums
  // Output rows [run, run + kRowsRun) x blocks [block, block + count), their weights `from`'s blocks from `at` on.
  const auto run_tile = [&](const auto& from, int64_t at, int64_t block, int64_t count, int64_t run, float* sums,
                            float* panel) {
    const int64_t run_rows = std::min(kRowsRun, rows - run);
    const float* xr = x + run * k;
    if (run_rows > kRowsTile || !from.tile_in_registers(path, run_rows, at, count, xr, k, sums, stride)) {
      for (int64_t k0 = 0; k0 < k; k0 += kPanelInputs) {
        const int64_t kc = std::min(kPanelInputs, k - k0);
        const T* in_place = from.panel_in_place(at, k0);
        if (!in_place) from.widen(at, count, k0, kc, panel);
        for (int64_t row = 0; row < run_rows; row += kRowsTile)
          tile<T>(path, std::min(kRowsTile, run_rows - row), count, xr + row * k + k0, k, kc, in_place,
                  block_values, panel, sums + row * stride, stride, k0 == 0);
      }
    }
    const int64_t first = block * kBlock, last = std::min(out_features, (block + count) * kBlock);
    for (int64_t r = 0; r < run_rows; ++r) {
      const float* values = sums + r * stride;
      if (picks) {
        picks->keep(run + r, block / blocks_tile, values, bias ? bias + first : nullptr, first, last - first);
        continue;
      }
      float* out = y + (run + r) * out_features;
      if (bias) {
        for (int64_t n = first; n < last; ++n) out[n] = values[n - first] + bias[n];
      } else {
        std::memcpy(out + first, values, (last - first) * sizeof(float));
      }
    }
  };
  if constexpr (!packed) {
    if (row_runs > 1) {  // rows read in place by several runs: each column tile packed once, then multiplied by each
      share_tasks(column_tiles, [&](int64_t begin, int64_t end) {
        alignas(64) float sums[kRowsRun * 4 * kBlock];
        alignas(64) float panel[kPanelInputs * 4 * kBlock];
        std::vector<T> scratch(blocks_tile * block_values);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t block = task * blocks_tile, count = std::min(blocks_tile, blocks - block);
          source.pack(block, count, k, scratch.data());
          const PackedBlocks<T> tile_weights{scratch.data(), block_values};
          for (int64_t run = 0; run < rows; run += kRowsRun) run_tile(tile_weights, 0, block, count, run, sums, panel);
        }
      });
      if (picks) picks->write(tokens);
      return;
    }
  }
  share_tasks(column_tiles * row_runs, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kRowsRun * 4 * kBlock];
    alignas(64) float panel[kPanelInputs * 4 * kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task / row_runs * blocks_tile, run = task % row_runs * kRowsRun;
      run_tile(source, block, block, std::min(blocks_tile, blocks - block), run, sums, panel);
    }
  });
  if (picks) picks->write(tokens);
}

void check_linear_input(const torch::Tensor& x, const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1,
              "x must be a float32 CPU tensor (..., K)");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(), "bias must be contiguous float32 (out_features,)");
  }
}

// An empty float32 output (..., out_features) for x (..., K).
torch::Tensor linear_output(const torch::Tensor& x, int64_t out_features) {
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  return torch::empty(sizes, x.options());
}

// half_linear (with `greedy`: half_greedy, each row's pick (...) int64 instead of the outputs).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     int64_t out_features, Path path, bool greedy = false) {
  check_linear_input(x, bias, out_features);
  TORCH_CHECK(packed.dim() == 3 && is_storage_type(packed.scalar_type()) && packed.size(2) == kBlock &&
                  packed.is_contiguous(),
              "packed must be contiguous bfloat16, float16 or float32 (N/16, K, 16)");
  const int64_t blocks = packed.size(0), k = x.size(-1);
  TORCH_CHECK(packed.size(1) == k, "x's last dimension does not match the packed weight");
  TORCH_CHECK(out_features > 0 && out_features <= blocks * kBlock && out_features > (blocks - 1) * kBlock,
              "out_features does not match the packed weight");
  const auto input = x.contiguous();
  const int64_t rows = k ? input.numel() / k : 0;
  auto out = greedy ? torch::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong))
                    : linear_output(x, out_features);
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  ZOO_DISPATCH_FLOATS(packed.scalar_type(), "half_linear", [&] {
    const PackedBlocks<scalar_t> source{packed.data_ptr<scalar_t>(), k * kBlock};
    multiply<scalar_t>(input.data_ptr<float>(), rows, k, source, blocks, b, out_features,
                       greedy ? nullptr : out.data_ptr<float>(), path, greedy ? out.data_ptr<int64_t>() : nullptr);
  });
  return out;
}

// y = x @ [W_0 | W_1 | ...]^T (+ bias) with the weights' rows read where they lie: each part (N_i, K) bfloat16 or
// float16 with unit column stride, every part but the last N_i a multiple of 16 (with `greedy`: each row's pick
// (...) int64 instead of the outputs).
torch::Tensor rows_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                          const c10::optional<torch::Tensor>& bias, Path path, bool greedy = false) {
  TORCH_CHECK(!parts.empty(), "parts must hold at least one weight");
  const int64_t k = x.size(-1);
  const auto dtype = parts[0].scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "the parts must be bfloat16 or float16");
  const int64_t out_features = checked_rows(parts, k, {at::kBFloat16, at::kHalf}, "16-bit");
  check_linear_input(x, bias, out_features);
  const auto input = x.contiguous();
  const int64_t rows = k ? input.numel() / k : 0;
  auto out = greedy ? torch::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong))
                    : linear_output(x, out_features);
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  ZOO_DISPATCH_HALVES(dtype, "half_linear_rows", [&] {
    std::vector<RowBlock<scalar_t>> blocks;  // 16 rows each, part after part
    for (const auto& part : parts) append_row_blocks(part, blocks);
    const std::vector<scalar_t> zeros(k);
    const RowBlocks<scalar_t> source{blocks.data(), zeros.data(), path};
    multiply<scalar_t>(input.data_ptr<float>(), rows, k, source, blocks.size(), b, out_features,
                       greedy ? nullptr : out.data_ptr<float>(), path, greedy ? out.data_ptr<int64_t>() : nullptr);
  });
  return out;
}

TimedChoice path_choice;

// The faster path on this CPU: the GEMM timed with each on a decode-sized call whose weights stay in the L2 cache
// (the steady state of a GEMM).
Path path_in_use() {
  return static_cast<Path>(path_choice.get([] {
    constexpr int64_t kRows = 96, kIn = 576, kOut = 256;
    const auto x = torch::full({kRows, kIn}, 0.5f);
    const auto packed = torch::full({kOut / kBlock, kIn, kBlock}, 0.25f, torch::dtype(at::kBFloat16));
    return std::function<void(int)>([=](int path) { linear(x, packed, c10::nullopt, kOut, static_cast<Path>(path)); });
  }, avx512_built() ? 2 : 1));
}

}  // namespace

torch::Tensor half_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features) {
  return linear(x, packed, bias, out_features, path_in_use());
}

torch::Tensor half_greedy(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features) {
  return linear(x, packed, bias, out_features, path_in_use(), true);
}

torch::Tensor half_linear_rows(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                               const c10::optional<torch::Tensor>& bias) {
  return rows_linear(x, parts, bias, path_in_use());
}

torch::Tensor half_greedy_rows(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                               const c10::optional<torch::Tensor>& bias) {
  return rows_linear(x, parts, bias, path_in_use(), true);
}

namespace {

void check_half_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && is_storage_type(weight.scalar_type()),
              "weight must be a bfloat16, float16 or float32 CPU tensor (N, K)");
}

}  // namespace

torch::Tensor pack_half_weight(const torch::Tensor& weight, const c10::optional<torch::Tensor>& out) {
  check_half_weight(weight);
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + kBlock - 1) / kBlock;
  if (out) {
    TORCH_CHECK(out->device().is_cpu() && out->scalar_type() == w.scalar_type() && out->is_contiguous() &&
                    out->sizes() == at::IntArrayRef({blocks, k, kBlock}),
                "out must be a contiguous CPU tensor of the weight's dtype, shaped (ceil(N/16), K, 16)");
  }
  auto packed = out ? *out : torch::empty({blocks, k, kBlock}, w.options());
  ZOO_DISPATCH_FLOATS(w.scalar_type(), "pack_half_weight", [&] {
    const auto* src = w.data_ptr<scalar_t>();
    auto* dst = packed.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        pack_block(src + b * kBlock * k, k, std::min(kBlock, n - b * kBlock), k, dst + b * k * kBlock);
    });
  });
  return packed;
}

std::string half_gemm_path(const std::string& use) {
  TORCH_CHECK(use.empty() || use == "avx2" || (use == "avx512" && avx512_built()),
              "path is avx2", avx512_built() ? " or avx512" : " (this build has no AVX-512)", ", not ", use);
  if (!use.empty()) path_choice.set(static_cast<int>(use == "avx512" ? Path::kAvx512 : Path::kAvx2));
  return path_in_use() == Path::kAvx512 ? "avx512" : "avx2";
}

}  // namespace zoo
