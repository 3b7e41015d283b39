// Storage types of the C++ kernels: float, bfloat16 and float16 values, read and written as float32.
//
// Every kernel is written once, as a template over the storage type T of its tensors, and
// accumulates in float32: loads widen to float32, stores round to T to the nearest even (as
// PyTorch's own conversions do). 16 values at a time use GCC / Clang vector extensions (one AVX-512
// register, or two AVX2 ones), and AVX-512's or F16C's conversions for float16.
#pragma once

#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace zoo {

typedef float vec16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
constexpr int64_t W = 16;
constexpr float HALF_MAX = 65504.0f;  // float16's largest finite value

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bfloat16 is the high half of a float32: each value moved into one (AVX512-BW: one word permute, with the
// low halves zeroed by its mask), else widened and shifted.
inline vec16 load16(const c10::BFloat16* p) {
#if defined(__AVX512BW__)
  const __m512i high_halves = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0,
                                               4, 0, 3, 0, 2, 0, 1, 0, 0, 0);  // word 2i + 1 <- value i
  const __m512i values = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i bits = _mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, high_halves, values);
#else
  u16x16 half;
  std::memcpy(&half, p, sizeof half);
  const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
#endif
  vec16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// float16 through AVX-512's 16-wide conversion, else F16C's (every AVX2 CPU has it) 8 at a time.
inline vec16 load16(const c10::Half* p) {
#if defined(__AVX512F__)
  const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  vec16 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
#else
  const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 high = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  vec16 v;
  std::memcpy(&v, &low, sizeof low);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof low, &high, sizeof high);
  return v;
#endif
}

// 8 values at p as float32 in one AVX2 register: bfloat16 is the high half of a float32, float16 through F16C.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof v); }

// Round to nearest even on the 16 bits dropped; NaN stays a (quiet) NaN.
inline void store16(c10::BFloat16* p, vec16 v) {
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const u32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const u32x16 result = (bits & 0x7fffffffu) > 0x7f800000u ? u32x16{} + 0x7fc0u : rounded;
  const u16x16 half = __builtin_convertvector(result, u16x16);
  std::memcpy(p, &half, sizeof half);
}

inline void store16(c10::Half* p, vec16 v) {
#if defined(__AVX512F__)
  __m512 wide;
  std::memcpy(&wide, &v, sizeof wide);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(wide, _MM_FROUND_TO_NEAREST_INT));
#else
  __m256 low, high;
  std::memcpy(&low, &v, sizeof low);
  std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof low, sizeof high);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(low, _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(high, _MM_FROUND_TO_NEAREST_INT));
#endif
}

// One value: to float32 exactly, back to T rounded to nearest even.
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

// n values of T as float32 into out (a copy for float).
template <typename T>
inline void widen(const T* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_float(in[i]);
}

// n float32 values rounded into T.
template <typename T>
inline void narrow(const float* in, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(in[i]);
}

// n values of T rounded to bfloat16 to the nearest even (NaN a quiet NaN), 16 at a time.
template <typename T>
inline void round_to_bf16(const T* x, int64_t n, c10::BFloat16* out) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store16(out + i, load16(x + i));
  for (; i < n; ++i) out[i] = c10::BFloat16(to_float(x[i]));
}

// A row of x (k values of T) as bfloat16 pairs, rounded to nearest even, a zero appended for an odd k.
template <typename T>
inline void round_row(const T* x, int64_t k, int64_t pairs, uint32_t* out) {
  auto* halves = reinterpret_cast<c10::BFloat16*>(out);
  round_to_bf16(x, k, halves);
  if (k < 2 * pairs) halves[k] = c10::BFloat16(0.f);
}

}  // namespace zoo

// Calls the lambda with `scalar_t` bound to the C++ storage type of a float32, bfloat16 or float16 tensor.
#define ZOO_DISPATCH_FLOATS(dtype, name, ...)                                                          \
  AT_DISPATCH_SWITCH(dtype, name, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                            \
                                      AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// The same for a bfloat16 or float16 tensor.
#define ZOO_DISPATCH_HALVES(dtype, name, ...) \
  AT_DISPATCH_SWITCH(dtype, name, AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace zoo {
inline bool is_storage_type(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
}
}  // namespace zoo
