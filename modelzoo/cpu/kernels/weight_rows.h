// 16-bit weights read where they lie, in rows (a checkpoint's memory map, parts side by side), by the C++ GEMMs: the
// parts checked, their blocks of 16 rows, and transposes of 4-byte words in registers (16 rows' 16 words on AVX-512,
// 8 rows' 8 words on AVX2) that turn a block's rows into the kernels' packed operands, a pair of 16-bit values per
// word: half_gemm.cpp widens the pairs, bf16_gemm.cpp multiplies them as they are.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <initializer_list>
#include <vector>

namespace zoo {

constexpr int64_t kRowBlock = 16;  // rows per block: one packed block of outputs

// A block of 16 weight rows where they lie: its first row, the distance from one row to the next, and how many of its
// 16 rows the weight has (the rest read as zeros).
template <typename T>
struct RowBlock {
  const T* first;
  int64_t stride;
  int64_t rows;

  // Its 16 rows, `zeros` (a row of K zeros) standing in for those past the weight's last.
  void pointers(const T* zeros, const T* out[kRowBlock]) const {
    for (int64_t r = 0; r < kRowBlock; ++r) out[r] = r < rows ? first + r * stride : zeros;
  }
};

// Checks parts (N_i, K) to be read in rows: CPU tensors of one dtype among `dtypes` (`what` names them), K = x's last
// dimension, unit column stride, every part but the last in whole blocks of 16 rows. Returns their rows in all.
inline int64_t checked_rows(const std::vector<torch::Tensor>& parts, int64_t k,
                            std::initializer_list<at::ScalarType> dtypes, const char* what) {
  TORCH_CHECK(!parts.empty(), "parts must hold at least one weight");
  const auto dtype = parts[0].scalar_type();
  const bool known = std::find(dtypes.begin(), dtypes.end(), dtype) != dtypes.end();
  int64_t rows = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& part = parts[i];
    TORCH_CHECK(known && part.device().is_cpu() && part.dim() == 2 && part.scalar_type() == dtype &&
                    part.size(1) == k && part.size(0) > 0 && (part.stride(1) == 1 || k == 1),
                "every part must be a ", what, " CPU tensor (N_i, K) of the first part's dtype, K = x's last "
                "dimension, with unit column stride");
    TORCH_CHECK(i + 1 == parts.size() || part.size(0) % kRowBlock == 0,
                "every part but the last must have a multiple of 16 rows");
    rows += part.size(0);
  }
  return rows;
}

// `count` blocks of 16 rows of `part` (default: to its end) from row `row` on, appended to `blocks`.
template <typename T>
void append_row_blocks(const torch::Tensor& part, std::vector<RowBlock<T>>& blocks, int64_t row = 0,
                       int64_t count = -1) {
  const auto* first = static_cast<const T*>(part.data_ptr());
  const int64_t end = count < 0 ? part.size(0) : std::min(part.size(0), row + count * kRowBlock);
  for (; row < end; row += kRowBlock)
    blocks.push_back({first + row * part.stride(0), part.stride(0), std::min(kRowBlock, part.size(0) - row)});
}

#if defined(__AVX512F__)
// v[r] (16 words of row r) -> v[j] (word j of the 16 rows).
__attribute__((always_inline)) inline void transpose16_words(__m512i v[16]) {
  __m512i t[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
#pragma GCC unroll 16
  for (int g = 0; g < 16; g += 4) {  // v[g + c]'s 128-bit lane l: word 4l + c of rows g .. g + 3
    v[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    v[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    v[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    v[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
#pragma GCC unroll 16
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(v[c], v[4 + c], 0x44), b = _mm512_shuffle_i32x4(v[c], v[4 + c], 0xEE);
    const __m512i e = _mm512_shuffle_i32x4(v[8 + c], v[12 + c], 0x44), f = _mm512_shuffle_i32x4(v[8 + c], v[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(a, e, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);
  }
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) v[j] = t[j];
}
#endif

// v[r] (8 words of row r) -> v[j] (word j of the 8 rows).
__attribute__((always_inline)) inline void transpose8_words(__m256i v[8]) {
  __m256i t[8];
#pragma GCC unroll 16
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  }
#pragma GCC unroll 16
  for (int g = 0; g < 8; g += 4) {  // v[g + c]'s 128-bit lane l: word 4l + c of rows g .. g + 3
    v[g] = _mm256_unpacklo_epi64(t[g], t[g + 2]);
    v[g + 1] = _mm256_unpackhi_epi64(t[g], t[g + 2]);
    v[g + 2] = _mm256_unpacklo_epi64(t[g + 1], t[g + 3]);
    v[g + 3] = _mm256_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
#pragma GCC unroll 16
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm256_permute2x128_si256(v[c], v[4 + c], 0x20);
    t[4 + c] = _mm256_permute2x128_si256(v[c], v[4 + c], 0x31);
  }
#pragma GCC unroll 16
  for (int j = 0; j < 8; ++j) v[j] = t[j];
}

}  // namespace zoo
