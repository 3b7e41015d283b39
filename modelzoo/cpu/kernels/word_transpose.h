// Transposes of 4-byte words in registers: 16 rows' 16 words (AVX-512) or 8 rows' 8 words (AVX2) into each word's
// rows side by side. A weight read where it lies, in rows, becomes the kernels' packed blocks this way (a pair of
// 16-bit values per word): half_gemm.cpp widens the pairs, bf16_gemm.cpp multiplies them as they are.
#pragma once

#include <immintrin.h>

namespace zoo {

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
