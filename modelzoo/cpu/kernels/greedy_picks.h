// Greedy decoding inside a GEMM (amx_bf16_greedy, bf16_greedy): a head's outputs are never written. Each task keeps
// its rows' first largest output among its own outputs, as torch.max(-1) picks it (the first NaN where there is one,
// else the first index of the largest value), and each row's picks over the column tiles, in ascending order, end the
// call: a later tile's pick replaces an earlier one only where it is strictly larger, or a NaN after none.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>

namespace zoo {

// The first largest of values[0, n) (+ bias[0, n) where given), n >= 1: its value (with the bias) and index.
inline std::pair<float, int64_t> first_largest(const float* values, const float* bias, int64_t n) {
#if defined(__AVX512F__)
  if (n <= 64) {  // a task's outputs: four registers, the lanes past n -inf (never picked before a real one)
    __m512 v[4];
    __mmask16 nan = 0;
    for (int i = 0; i < 4; ++i) {
      const int64_t left = std::clamp<int64_t>(n - 16 * i, 0, 16);
      const __mmask16 lanes = static_cast<__mmask16>((1u << left) - 1);
      v[i] = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), lanes, values + 16 * i);
      if (bias) v[i] = _mm512_mask_add_ps(v[i], lanes, v[i], _mm512_maskz_loadu_ps(lanes, bias + 16 * i));
      nan |= _mm512_cmp_ps_mask(v[i], v[i], _CMP_UNORD_Q);
    }
    const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(v[0], v[1]), _mm512_max_ps(v[2], v[3])));
    for (int i = 0; i < 4; ++i) {
      const __mmask16 hits = nan ? _mm512_cmp_ps_mask(v[i], v[i], _CMP_UNORD_Q)
                                 : _mm512_cmp_ps_mask(v[i], _mm512_set1_ps(largest), _CMP_EQ_OQ);
      if (hits) return {v[i][__builtin_ctz(hits)], 16 * i + __builtin_ctz(hits)};
    }
  }
#endif
  std::pair<float, int64_t> best{values[0] + (bias ? bias[0] : 0.f), 0};
  for (int64_t i = 1; i < n && !std::isnan(best.first); ++i) {
    const float value = values[i] + (bias ? bias[i] : 0.f);
    if (std::isnan(value) || value > best.first) best = {value, i};
  }
  return best;
}

// Each row's pick per column tile, then per row.
class GreedyPicks {
 public:
  GreedyPicks(int64_t rows, int64_t column_tiles)
      : rows_(rows), tiles_(column_tiles), values_(new float[rows * column_tiles]),
        indices_(new int64_t[rows * column_tiles]) {}

  // Row `row`'s pick in column tile `tile`: among values[0, n) (+ bias[0, n)), the outputs `first` on.
  void keep(int64_t row, int64_t tile, const float* values, const float* bias, int64_t first, int64_t n) {
    const auto [value, index] = first_largest(values, bias, n);
    values_[row * tiles_ + tile] = value;
    indices_[row * tiles_ + tile] = first + index;
  }

  // Each row's pick over its column tiles -> tokens (rows,).
  void write(int64_t* tokens) const {
    at::parallel_for(0, rows_, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* values = values_.get() + r * tiles_;
        int64_t best = 0;
        for (int64_t t = 1; t < tiles_ && !std::isnan(values[best]); ++t) {
          if (std::isnan(values[t]) || values[t] > values[best]) best = t;
        }
        tokens[r] = indices_[r * tiles_ + best];
      }
    });
  }

 private:
  int64_t rows_, tiles_;
  std::unique_ptr<float[]> values_;
  std::unique_ptr<int64_t[]> indices_;
};

}  // namespace zoo
