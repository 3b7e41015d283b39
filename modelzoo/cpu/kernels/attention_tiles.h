// The arithmetic of cached_attention.cpp, on float32 tiles: a block of queries' scores against keys read in place,
// their softmax, and the weighted sums of the values. Every score, weight and output is computed the same way
// whatever the tile or block it falls in, so a query's result does not depend on the queries beside it:
//   score(q, k) = (the sum of q[d] * k[d] in 8 lanes, d in lane d % 8 by one fused multiply-add chain from zero over
//                  ascending d, then the lanes added ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))) * scale;
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

// The CPU's own vector width (GCC's code for wider vector types than the CPU has is poor) for the softmax and the
// values: 16 lanes of scores or features are P vectors of N lanes. Lanes never mix, so either width gives the same
// bits. Scores are summed in 8 lanes on every CPU (score_keys).
#if defined(__AVX512F__)
constexpr int N = 16;
#else
constexpr int N = 8;
#endif
typedef float vecn __attribute__((vector_size(N * 4)));
typedef int32_t intn __attribute__((vector_size(N * 4)));
constexpr int P = W / N;
constexpr int kTileRows = 6;  // query heads per register tile

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

// The lane sums of a, b, c and d, each ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline __m128 lane_sums(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 halves = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // a's l0-3 sum, b's, .. | l4-7
  return _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
}

// Accumulator registers a tile keeps: a sum over keys or features is a chain of fused multiply-adds, one after the
// other, so a tile needs about (FMA latency x FMA units) independent ones to keep the units busy.
constexpr int kAccumulators = N == 8 ? 12 : 24;
// Keys scored at once by a tile of R query heads over keys in place: R x K accumulators, K keys and a query in AVX2's
// 16 registers; on AVX-512, R x K / 2 accumulators of two keys' 8 lanes each (score_keys), K dividing 16: 8 keys, or
// with `Narrow` 4 for tiles of 4-6 heads (12 accumulators, not 24: each query load then serves half the products).
// Which of the two is faster differs between CPUs (cached_attention.cpp times them); the scores are the same bits.
template <int R, bool Narrow>
constexpr int kKeysAtOnce = N == 16 ? (R >= 4 && Narrow ? 4 : 8) : R >= 4 ? 2 : R == 3 ? 3 : 4;
constexpr int kKeyTileWays = N == 16 ? 2 : 1;  // ways of scoring a tile that differ: wide (0) and narrow (1)

#if defined(__AVX512F__)
// 8 values at a and 8 at b as float32 in one AVX-512 register (a's in lanes 0-7).
inline __m512 load8x2(const float* a, const float* b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(a))),
                                             _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}
inline __m256i load_halves(const void* a, const void* b) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
}
inline __m512 load8x2(const c10::BFloat16* a, const c10::BFloat16* b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_halves(a, b)), 16));
}
inline __m512 load8x2(const c10::Half* a, const c10::Half* b) { return _mm512_cvtph_ps(load_halves(a, b)); }

// lane_sums of the two 8-lane halves of a, b, c and d at once, in 512-bit shuffles (half as many as lane_sums needs
// for the same sums, which compete with the fused multiply-adds for a port): the same additions of the same lanes,
// so the same bits. Returns a's lanes 0-7 sum, a's lanes 8-15 sum, then b's, c's and d's.
inline __m256 pair_lane_sums(__m512 a, __m512 b, __m512 c, __m512 d) {
  // Each 128-bit lane i: x + y of the even and odd elements: [a(4i) + a(4i+1), a(4i+2) + a(4i+3), b(4i) + .., ..].
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_ps(c, d, 0x88), _mm512_shuffle_ps(c, d, 0xDD));
  // 128-bit lane i: [a(4i..4i+3), b(..), c(..), d(..)], each (x0 + x1) + (x2 + x3).
  const __m512 quads = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x88), _mm512_shuffle_ps(ab, cd, 0xDD));
  // 128-bit lanes 0 and 2: lanes 0-3 plus lanes 4-7 of each half (addition commutes exactly).
  const __m512 sums = _mm512_add_ps(quads, _mm512_shuffle_f32x4(quads, quads, 0xB1));
  const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, sums));
}
#endif
// 16-feature groups of the values summed at once by a tile of R query heads.
template <int R>
constexpr int kValueGroups = std::clamp(kAccumulators / (R * P), 1, 8);

// The scores of R query heads q (R, D) against K consecutive keys (K <= 4; key k at keys + k * D), each one fused
// multiply-add chain from zero per lane of 8 features (feature d in lane d % 8), the lanes then added by
// lane_sums (pair_lane_sums: the same sums). tile: score (r, k) at tile[r * 16 + k]. The keys are read in place, in
// their own type.
template <typename T, int R, int K>
inline void score_keys(const float* q, const T* keys, int64_t D, float* tile) {
#if defined(__AVX512F__)
  if constexpr (K % 2 == 0) {  // keys 2p and 2p + 1 side by side in one register: each lane's chain as below
    constexpr int P2 = K / 2;
    __m512 pairs[R * P2];  // (r, p) at r * P2 + p
    for (int i = 0; i < R * P2; ++i) pairs[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      __m512 key[P2];
      for (int p = 0; p < P2; ++p) key[p] = load8x2(keys + 2 * p * D + c, keys + (2 * p + 1) * D + c);
      for (int r = 0; r < R; ++r) {
        const __m512 x = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q + r * D + c))));
        for (int p = 0; p < P2; ++p) pairs[r * P2 + p] = _mm512_fmadd_ps(x, key[p], pairs[r * P2 + p]);
      }
    }
    float sums[(R * P2 + 3) / 4 * 8];  // score (r, k) at r * K + k: pair i = r * P2 + p holds keys 2p and 2p + 1
    for (int i = 0; i < R * P2; i += 4) {
      const int last = R * P2 - 1;
      _mm256_storeu_ps(sums + 2 * i, pair_lane_sums(pairs[i], pairs[std::min(i + 1, last)],
                                                    pairs[std::min(i + 2, last)], pairs[std::min(i + 3, last)]));
    }
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < K; ++k) tile[r * W + k] = sums[r * K + k];
    return;
  }
#endif
  {
    __m256 acc[R * K];  // (r, k) at r * K + k
    for (int i = 0; i < R * K; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      __m256 key[K];
      for (int k = 0; k < K; ++k) key[k] = load8(keys + k * D + c);
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_loadu_ps(q + r * D + c);
        for (int k = 0; k < K; ++k) acc[r * K + k] = _mm256_fmadd_ps(x, key[k], acc[r * K + k]);
      }
    }
    float sums[(R * K + 3) / 4 * 4];
    for (int i = 0; i < R * K; i += 4) {
      const int last = R * K - 1;
      _mm_storeu_ps(sums + i, lane_sums(acc[i], acc[std::min(i + 1, last)], acc[std::min(i + 2, last)],
                                        acc[std::min(i + 3, last)]));
    }
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < K; ++k) tile[r * W + k] = sums[r * K + k];
  }
}

// Memory that the next task reads, fetched into L2: its keys while a tile sums its values (the scoring pass fetched
// those values already, so without this the memory would idle through the summing pass and the next task's scoring
// would wait for every key group it starts on), a few lines per value row read; and its values while a tile scores
// its keys, a few lines per key group (a core streams from memory at half the rate when each task starts its streams
// cold: the summing pass would wait on them). Into L2, not L1: the next task's keys in L1 pushed out the values
// being summed, and a decode step's attention ran slower (prefetch_group brings each key group on into L1).
struct Ahead {
  const char* lines = nullptr;
  int64_t bytes = 0;
  const char* value_lines = nullptr;
  int64_t value_bytes = 0;
};

// The lines of `bytes` bytes from `first` fetched with `Hint` (changes no result).
template <_mm_hint Hint>
inline void fetch_lines(const void* first, int64_t bytes) {
  const char* lines = static_cast<const char*>(first);
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(lines + line, Hint);
}

// The lines of `bytes` bytes from `first`, fetched with `Hint` a few at a time over `steps` calls of next(): spread
// over a loop's steps, not in one burst (no division in the loop).
template <_mm_hint Hint>
struct SpreadFetch {
  const char* first;
  int64_t lines, per_step, line = 0;

  SpreadFetch(const char* first, int64_t bytes, int64_t steps)
      : first(first), lines((bytes + 63) / 64), per_step((lines + steps - 1) / std::max<int64_t>(steps, 1)) {}

  void next() {
    for (const int64_t last = std::min(line + per_step, lines); line < last; ++line)
      _mm_prefetch(first + line * 64, Hint);
  }
};

// outs[r][c, c + 16 G) (values of O) = the sum over keys j < n of weights[r * stride + j] * values[j][c, c + 16 G),
// for each c a multiple of 16 G below D; `ahead` fetched on the way (changes no result).
template <typename T, typename O, int R, int G>
inline void weigh_tile(const float* weights, int64_t stride, const T* values, int64_t n, int64_t D, O* const* outs,
                       Ahead ahead) {
  constexpr int V = G * P;  // vectors per query head
  SpreadFetch<_MM_HINT_T1> next_keys(ahead.lines, ahead.bytes, n);
  for (int64_t c = 0; c < D; c += G * W) {
    vecn acc[R][V] = {};
    for (int64_t j = 0; j < n; ++j) {
      next_keys.next();
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
void weigh(const float* weights, int64_t stride, const T* values, int64_t n, int64_t D, O* const* outs, Ahead ahead) {
  switch (std::min<int64_t>(kValueGroups<R>, D / W)) {
    case 8: return weigh_tile<T, O, R, std::min(8, kValueGroups<R>)>(weights, stride, values, n, D, outs, ahead);
    case 4: return weigh_tile<T, O, R, std::min(4, kValueGroups<R>)>(weights, stride, values, n, D, outs, ahead);
    case 2: return weigh_tile<T, O, R, std::min(2, kValueGroups<R>)>(weights, stride, values, n, D, outs, ahead);
    default: return weigh_tile<T, O, R, 1>(weights, stride, values, n, D, outs, ahead);
  }
}

// Key groups of W fetched ahead of the one scored: a decode step reads each key once, from memory, so its keys stream
// in ahead of the arithmetic (the hardware's own prefetch stops at page boundaries).
constexpr int64_t kGroupsAhead = 2;

// One group of W keys' lines from `ahead` on (none past `end`) into L1, and the group's values at `values` into L2:
// they are read once every score is known. Changes no result.
template <typename T>
inline void prefetch_group(const T* ahead, const T* end, const T* values, int64_t D) {
  const int64_t bytes = W * D * static_cast<int64_t>(sizeof(T));
  fetch_lines<_MM_HINT_T0>(ahead, std::clamp<int64_t>((end - ahead) * static_cast<int64_t>(sizeof(T)), 0, bytes));
  fetch_lines<_MM_HINT_T1>(values, bytes);
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

// One tile of R query heads (rows of q, R <= kTileRows) over the keys (key j at keys + j * D, read in place): scores
// -> softmax -> the weighted values into outs. lengths[r]: row r's keys (its first lengths[r] of the block's);
// scores: room for R rows of stride floats, stride >= the longest length rounded up to 16.
template <typename T, typename O, int R, bool Narrow>
void attend_tile(const float* q, const int64_t* lengths, const T* keys, const T* values, int64_t D, float scale,
                 float* scores, int64_t stride, O* const* outs, Ahead ahead) {
  constexpr int K = kKeysAtOnce<R, Narrow>;
  const int64_t n = *std::max_element(lengths, lengths + R);
  vecn peaks[R];
  float tile[R * W] = {};
  for (int r = 0; r < R; ++r) peaks[r] = vecn{} - kInfinity;
  SpreadFetch<_MM_HINT_T1> next_values(ahead.value_lines, ahead.value_bytes, (n + W - 1) / W);
  for (int64_t first = 0; first < n; first += W) {
    const int64_t count = std::min<int64_t>(W, n - first);
    const T* block = keys + first * D;
    prefetch_group<T>(keys + (first + kGroupsAhead * W) * D, keys + n * D, values + first * D, D);
    next_values.next();
    int64_t k = 0;
    for (; k + K <= count; k += K) score_keys<T, R, K>(q, block + k * D, D, tile + k);
    for (; k < count; ++k) score_keys<T, R, 1>(q, block + k * D, D, tile + k);
    keep_scores<R>(tile, W, first, lengths, scale, scores, stride, peaks);
  }
  const int64_t padded = (n + W - 1) / W * W;
  for (int r = 0; r < R; ++r) {
    float peak = peaks[r][0];
    for (int i = 1; i < N; ++i) peak = std::max(peak, peaks[r][i]);
    softmax_row(scores + r * stride, padded, peak);
  }
  weigh<T, O, R>(scores, stride, values, n, D, outs, ahead);
}

// attend_tile over `rows` query heads, kTileRows at a time; scores: room for kTileRows rows of stride floats; `ahead`
// fetched by the last tile.
template <typename T, typename O, bool Narrow>
void attend_rows_as(const float* q, int64_t rows, const int64_t* lengths, const T* keys, const T* values, int64_t D,
                    float scale, float* scores, int64_t stride, O* const* outs, Ahead ahead) {
  for (int64_t r = 0; r < rows; r += kTileRows) {
    const Ahead tile_ahead = r + kTileRows >= rows ? ahead : Ahead{};
    switch (std::min<int64_t>(kTileRows, rows - r)) {
#define ZOO_TILE(R)                                                                                                  \
  case R:                                                                                                            \
    attend_tile<T, O, R, Narrow && R >= 4>(q + r * D, lengths + r, keys, values, D, scale, scores, stride, outs + r, \
                                           tile_ahead);                                                              \
    break;
      ZOO_TILE(1) ZOO_TILE(2) ZOO_TILE(3) ZOO_TILE(4) ZOO_TILE(5) ZOO_TILE(6)
#undef ZOO_TILE
    }
  }
}

// attend_rows_as in the way `way` (0 wide, 1 narrow: kKeysAtOnce).
template <typename T, typename O>
void attend_rows(int way, const float* q, int64_t rows, const int64_t* lengths, const T* keys, const T* values,
                 int64_t D, float scale, float* scores, int64_t stride, O* const* outs, Ahead ahead = {}) {
  if (way == 1) {
    return attend_rows_as<T, O, true>(q, rows, lengths, keys, values, D, scale, scores, stride, outs, ahead);
  }
  attend_rows_as<T, O, false>(q, rows, lengths, keys, values, D, scale, scores, stride, outs, ahead);
}

}  // namespace zoo
