// The arithmetic of cached_attention.cpp, on float32 tiles: a block of queries' scores against keys transposed 16 at
// a time, their softmax, and the weighted sums of the values. Every score, weight and output is computed the same
// way whatever the tile or block it falls in, so a query's result does not depend on the queries beside it:
//   score(q, k) = (sum over d ascending of q[d] * k[d], one fused multiply-add each from zero for each 16 features,
//                  the 16-feature sums added in order) * scale;
//   weights     = exp(score - max) / their sum (summed in 16 lanes by key index, then the lanes in order);
//   out[d]      = sum over keys j ascending of weight[j] * v[j][d], one fused multiply-add each from zero.
// Scores past a query's own keys are -inf (weight 0), and a zero weight adds an exact zero to the sums.
#pragma once

#include "storage.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace zoo {

constexpr float kInfinity = std::numeric_limits<float>::infinity();

// The CPU's own vector width (GCC's code for wider vector types than the CPU has is poor): 16 lanes of a packed key
// block are P vectors of N lanes. Lanes never mix, so either width gives the same bits.
#if defined(__AVX512F__)
constexpr int N = 16;
#else
constexpr int N = 8;
#endif
typedef float vecn __attribute__((vector_size(N * 4)));
typedef int32_t intn __attribute__((vector_size(N * 4)));
constexpr int P = W / N;
constexpr int kTileRows = 6;  // query heads per register tile: 6 x 16 lanes of accumulators fit AVX2's 16 registers

inline vecn loadn(const float* p) {
  vecn v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storen(float* p, vecn v) { std::memcpy(p, &v, sizeof v); }

// exp(x) for x <= 0 (a softmax's shifted scores), N at a time, within 2 ulp of expf, in plain vector
// arithmetic (glibc's expf is a scalar call). Cephes' method: x = n ln2 + r, |r| <= ln2 / 2, exp(r)
// by a degree-6 polynomial, 2^n written into the floats' exponent bits.
inline vecn exp_nonpositive(vecn x) {
  const vecn lowest = vecn{} - 87.0f;  // below, expf is subnormal or 0; the weight is negligible either way
  x = x < lowest ? lowest : x;
  const vecn shifter = vecn{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  const vecn n = (x * 1.44269504088896341f + shifter) - shifter;
  const vecn r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  vecn p = vecn{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vecn y = p * r * r + r + 1.0f;
  const intn bits = (__builtin_convertvector(n, intn) + 127) << 23;
  vecn power;
  std::memcpy(&power, &bits, sizeof power);
  return y * power;
}

// A row of scores (n of them, a multiple of 16) <- its softmax. peak: the row's largest score; scores past its
// keys hold -inf (weight 0). The total is summed in 16 lanes by key index, then the lanes in order.
inline void softmax_row(float* scores, int64_t n, float peak) {
  vecn totals[P] = {};
  for (int64_t j = 0; j < n; j += W) {
    for (int p = 0; p < P; ++p) {
      const vecn score = loadn(scores + j + p * N);
      const vecn weights = score == -kInfinity ? vecn{} : exp_nonpositive(score - peak);
      storen(scores + j + p * N, weights);
      totals[p] += weights;
    }
  }
  float total = 0.f;
  for (int p = 0; p < P; ++p)
    for (int64_t i = 0; i < N; ++i) total += totals[p][i];
  const float inverse = 1.f / total;
  for (int64_t j = 0; j < n; j += N) storen(scores + j, loadn(scores + j) * inverse);
}

// Asks for the cache lines of `bytes` bytes from p into the CPU's caches (Locality 3: into L1, 2: into L2).
template <int Locality>
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(static_cast<const char*>(p) + line, 0, Locality);
}

// The 8 x 8 floats of r (row i = r[i]) transposed in place.
inline void transpose8(__m256* r) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}

// How far ahead pack_keys asks for the keys it is about to read: about what one core has in flight from memory in
// the time it takes (latency ~100 ns x ~40 GB/s).
constexpr int64_t PREFETCH_BYTES = 4096;

// n keys (n, D) of T -> packed (ceil(n / 16), D, 16) float32: 16 keys side by side for each feature, zeros past
// the n-th key. rows: room for 16 x D floats. The values (n, D) of T are asked into the caches on the way, for
// the weighted sums that read them next.
template <typename T>
void pack_keys(const T* keys, const T* values, int64_t n, int64_t D, float* packed, float* rows) {
  const int64_t row_bytes = D * sizeof(T), ahead = std::max<int64_t>(W, PREFETCH_BYTES / row_bytes);
  for (int64_t first = 0; first < n; first += W) {
    const int64_t count = std::min<int64_t>(W, n - first);
    prefetch_bytes<3>(keys + (first + ahead) * D, W * row_bytes);  // past the end: a hint, never a fault
    prefetch_bytes<2>(values + first * D, count * row_bytes);
    const float* source = rows;
    if (std::is_same_v<T, float> && count == W) {
      source = reinterpret_cast<const float*>(keys + first * D);
    } else {
      for (int64_t i = 0; i < count; ++i)
        for (int64_t c = 0; c < D; c += W) store16(rows + i * D + c, load16(keys + (first + i) * D + c));
      std::fill(rows + count * D, rows + W * D, 0.f);
    }
    float* block = packed + first * D;  // (D, 16)
    for (int64_t half = 0; half < 2; ++half) {
      for (int64_t d = 0; d < D; d += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(source + (half * 8 + i) * D + d);
        transpose8(r);
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(block + (d + i) * W + half * 8, r[i]);
      }
    }
  }
}

// Accumulator registers a tile keeps: a sum over keys or features is a chain of fused multiply-adds, one after the
// other, so a tile needs about (FMA latency x FMA units) independent ones to keep the units busy.
constexpr int kAccumulators = N == 8 ? 12 : 24;
// Key blocks scored at once by a tile of R query heads, and 16-feature groups of the values summed at once.
template <int R>
constexpr int kKeyBlocks = std::clamp(kAccumulators / (R * P), 1, 4);
template <int R>
constexpr int kValueGroups = std::clamp(kAccumulators / (R * P), 1, 8);

// The scores of R query heads q (R, D) against KB packed blocks of 16 keys (D, 16) each, lane l of block b = key
// 16 b + l: a chain of fused multiply-adds from zero over each 16 features, the chains added in order (a 16-term
// chain's rounding, not a D-term one's). out: (R, KB x 16).
template <int R, int KB>
inline void score_tile(const float* q, const float* blocks, int64_t D, float* out) {
  constexpr int V = KB * P;  // vectors per query head
  for (int64_t c = 0; c < D; c += W) {
    vecn acc[R][V] = {};
    for (int64_t d = c; d < c + W; ++d) {
      vecn key[V];
      for (int v = 0; v < V; ++v) key[v] = loadn(blocks + (v / P) * W * D + d * W + (v % P) * N);
      for (int r = 0; r < R; ++r) {
        const float x = q[r * D + d];
        for (int v = 0; v < V; ++v) acc[r][v] += x * key[v];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) {
        float* at = out + (r * V + v) * N;
        storen(at, c == 0 ? acc[r][v] : loadn(at) + acc[r][v]);
      }
  }
}

// outs[r][c, c + 16 G) (values of O) = the sum over keys j < n of weights[r * stride + j] * values[j][c, c + 16 G),
// for each c a multiple of 16 G below D.
template <typename T, typename O, int R, int G>
inline void weigh_tile(const float* weights, int64_t stride, const T* values, int64_t n, int64_t D, O* const* outs) {
  constexpr int V = G * P;  // vectors per query head
  for (int64_t c = 0; c < D; c += G * W) {
    vecn acc[R][V] = {};
    for (int64_t j = 0; j < n; ++j) {
      vecn value[V];
      const T* row = values + j * D + c;
      if constexpr (std::is_same_v<T, float>) {
        for (int v = 0; v < V; ++v) value[v] = loadn(row + v * N);
      } else {
        for (int g = 0; g < G; ++g) {
          const vec16 wide = load16(row + g * W);
          std::memcpy(value + g * P, &wide, sizeof wide);
        }
      }
      for (int r = 0; r < R; ++r) {
        const float w = weights[r * stride + j];
        for (int v = 0; v < V; ++v) acc[r][v] += w * value[v];
      }
    }
    for (int r = 0; r < R; ++r) {
      float sums[V * N];
      for (int v = 0; v < V; ++v) storen(sums + v * N, acc[r][v]);
      for (int g = 0; g < G; ++g) store16(outs[r] + c + g * W, load16(sums + g * W));
    }
  }
}

// weigh_tile with as many 16-feature groups at once as the accumulators hold (D is 16, 32, 64 or 128).
template <typename T, typename O, int R>
void weigh(const float* weights, int64_t stride, const T* values, int64_t n, int64_t D, O* const* outs) {
  switch (std::min<int64_t>(kValueGroups<R>, D / W)) {
    case 8: return weigh_tile<T, O, R, std::min(8, kValueGroups<R>)>(weights, stride, values, n, D, outs);
    case 4: return weigh_tile<T, O, R, std::min(4, kValueGroups<R>)>(weights, stride, values, n, D, outs);
    case 2: return weigh_tile<T, O, R, std::min(2, kValueGroups<R>)>(weights, stride, values, n, D, outs);
    default: return weigh_tile<T, O, R, 1>(weights, stride, values, n, D, outs);
  }
}

// Scale, mask and peaks of `count` keys' raw scores tile (R, count) from key `first` on into rows of scores.
template <int R>
inline void keep_scores(const float* tile, int64_t count, int64_t first, const int64_t* lengths, float scale,
                        float* scores, int64_t stride, float* peaks) {
  for (int r = 0; r < R; ++r) {
    const int64_t keys = std::clamp<int64_t>(lengths[r] - first, 0, count);
    float* row = scores + r * stride + first;
    for (int64_t l = 0; l < keys; ++l) {
      row[l] = tile[r * count + l] * scale;
      peaks[r] = std::max(peaks[r], row[l]);
    }
    std::fill(row + keys, row + count, -kInfinity);
  }
}

// One tile of R query heads (rows of q, R <= kTileRows) over the packed keys: scores -> softmax -> the weighted
// values into outs. lengths[r]: row r's keys (its first lengths[r] of the block's); scores: room for R rows of
// stride floats, stride >= the longest length rounded up to 16.
template <typename T, typename O, int R>
void attend_tile(const float* q, const int64_t* lengths, const float* packed, const T* values, int64_t D, float scale,
                 float* scores, int64_t stride, O* const* outs) {
  constexpr int KB = kKeyBlocks<R>;
  const int64_t n = *std::max_element(lengths, lengths + R);
  float peaks[R], tile[R * KB * W];
  for (int r = 0; r < R; ++r) peaks[r] = -kInfinity;
  int64_t first = 0;
  for (; first + KB * W <= n; first += KB * W) {
    score_tile<R, KB>(q, packed + first * D, D, tile);
    keep_scores<R>(tile, KB * W, first, lengths, scale, scores, stride, peaks);
  }
  for (; first < n; first += W) {
    score_tile<R, 1>(q, packed + first * D, D, tile);
    keep_scores<R>(tile, W, first, lengths, scale, scores, stride, peaks);
  }
  const int64_t padded = (n + W - 1) / W * W;
  for (int r = 0; r < R; ++r) softmax_row(scores + r * stride, padded, peaks[r]);
  weigh<T, O, R>(scores, stride, values, n, D, outs);
}

// attend_tile over `rows` query heads, kTileRows at a time; scores: room for kTileRows rows of stride floats.
template <typename T, typename O>
void attend_rows(const float* q, int64_t rows, const int64_t* lengths, const float* packed, const T* values, int64_t D,
                 float scale, float* scores, int64_t stride, O* const* outs) {
  for (int64_t r = 0; r < rows; r += kTileRows) {
    const int64_t at = r;
    switch (std::min<int64_t>(kTileRows, rows - r)) {
#define ZOO_TILE(R)                                                                                                  \
  case R:                                                                                                            \
    attend_tile<T, O, R>(q + at * D, lengths + at, packed, values, D, scale, scores, stride, outs + at);          \
    break;
      ZOO_TILE(1) ZOO_TILE(2) ZOO_TILE(3) ZOO_TILE(4) ZOO_TILE(5) ZOO_TILE(6)
#undef ZOO_TILE
    }
  }
}

}  // namespace zoo
