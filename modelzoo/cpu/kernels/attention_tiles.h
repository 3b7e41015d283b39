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

// The 8 x 8 floats at in (row i at in + i * in_stride) transposed to out (row j at out + j * out_stride). Rows i
// and i + 4 share a register from the start (one in each 128-bit half), so the transpose never crosses halves.
__attribute__((always_inline)) inline void transpose8(const float* in, int64_t in_stride, float* out, int64_t out_stride) {
  __m256 low[4], high[4], t[4];
  for (int i = 0; i < 4; ++i) {
    const float* a = in + i * in_stride;
    const float* b = in + (i + 4) * in_stride;
    low[i] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(a)), _mm_loadu_ps(b), 1);
    high[i] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(a + 4)), _mm_loadu_ps(b + 4), 1);
  }
  for (int part = 0; part < 2; ++part) {  // columns 0-3 from the low halves of the rows, 4-7 from the high
    const __m256* r = part == 0 ? low : high;
    t[0] = _mm256_unpacklo_ps(r[0], r[1]);
    t[1] = _mm256_unpackhi_ps(r[0], r[1]);
    t[2] = _mm256_unpacklo_ps(r[2], r[3]);
    t[3] = _mm256_unpackhi_ps(r[2], r[3]);
    float* column = out + 4 * part * out_stride;
    _mm256_storeu_ps(column, _mm256_shuffle_ps(t[0], t[2], _MM_SHUFFLE(1, 0, 1, 0)));
    _mm256_storeu_ps(column + out_stride, _mm256_shuffle_ps(t[0], t[2], _MM_SHUFFLE(3, 2, 3, 2)));
    _mm256_storeu_ps(column + 2 * out_stride, _mm256_shuffle_ps(t[1], t[3], _MM_SHUFFLE(1, 0, 1, 0)));
    _mm256_storeu_ps(column + 3 * out_stride, _mm256_shuffle_ps(t[1], t[3], _MM_SHUFFLE(3, 2, 3, 2)));
  }
}

// n keys (n, D) of T -> packed (ceil(n / 16), D, 16) float32: 16 keys side by side for each feature, zeros past
// the n-th key. rows: room for 16 x D floats.
template <typename T>
void pack_keys(const T* keys, int64_t n, int64_t D, float* packed, float* rows) {
  for (int64_t first = 0; first < n; first += W) {
    const int64_t count = std::min<int64_t>(W, n - first);
    const float* source = rows;
    if (std::is_same_v<T, float> && count == W) {  // read in place
      source = reinterpret_cast<const float*>(keys + first * D);
    } else {
      for (int64_t i = 0; i < count; ++i)
        for (int64_t c = 0; c < D; c += W) store16(rows + i * D + c, load16(keys + (first + i) * D + c));
      std::fill(rows + count * D, rows + W * D, 0.f);
    }
    float* block = packed + first * D;  // (D, 16)
    for (int64_t half = 0; half < 2; ++half)
      for (int64_t d = 0; d < D; d += 8) transpose8(source + half * 8 * D + d, D, block + d * W + half * 8, W);
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

// Scale, mask and peaks of `count` keys' raw scores tile (R, count) from key `first` on into rows of scores: the
// scores past a row's keys -inf; peaks: each row's lane-wise maxima.
template <int R>
inline void keep_scores(const float* tile, int64_t count, int64_t first, const int64_t* lengths, float scale,
                        float* scores, int64_t stride, vecn* peaks) {
  vecn lane;
  for (int i = 0; i < N; ++i) lane[i] = static_cast<float>(i);
  for (int r = 0; r < R; ++r) {
    for (int64_t v = 0; v < count; v += N) {
      const vecn kept = lane < static_cast<float>(lengths[r] - first - v) ? loadn(tile + r * count + v) * scale
                                                                          : vecn{} - kInfinity;
      storen(scores + r * stride + first + v, kept);
      peaks[r] = kept > peaks[r] ? kept : peaks[r];
    }
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
  vecn peaks[R];
  float tile[R * KB * W];
  for (int r = 0; r < R; ++r) peaks[r] = vecn{} - kInfinity;
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
  for (int r = 0; r < R; ++r) {
    float peak = peaks[r][0];
    for (int i = 1; i < N; ++i) peak = std::max(peak, peaks[r][i]);
    softmax_row(scores + r * stride, padded, peak);
  }
  weigh<T, O, R>(scores, stride, values, n, D, outs);
}

// attend_tile over `rows` query heads, kTileRows at a time; scores: room for kTileRows rows of stride floats.
template <typename T, typename O>
void attend_rows(const float* q, int64_t rows, const int64_t* lengths, const float* packed, const T* values, int64_t D,
                 float scale, float* scores, int64_t stride, O* const* outs) {
  for (int64_t r = 0; r < rows; r += kTileRows) {
    switch (std::min<int64_t>(kTileRows, rows - r)) {
#define ZOO_TILE(R)                                                                                                  \
  case R:                                                                                                            \
    attend_tile<T, O, R>(q + r * D, lengths + r, packed, values, D, scale, scores, stride, outs + r);              \
    break;
      ZOO_TILE(1) ZOO_TILE(2) ZOO_TILE(3) ZOO_TILE(4) ZOO_TILE(5) ZOO_TILE(6)
#undef ZOO_TILE
    }
  }
}

}  // namespace zoo
