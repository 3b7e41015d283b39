// Sampling's two passes over whole vocabularies (modelzoo/generation/sampling.py), each with the results of its
// PyTorch spelling, row by row on PyTorch's threads:
// - sort_rows: torch.sort(scores, -1, stable=True) of float32 rows: ascending, NaN last, equal values (-0.0 and 0.0
//   among them, every NaN alike) in index order. A least-significant-digit radix sort of each value's order key, three
//   stable passes of 11, 11 and 10 bits.
// - draw_rows: draw()'s inverse-CDF pick, the first index whose float64 running sum exceeds u times the row's total,
//   from the same sums in the same order (left to right, as cumsum adds them) without writing them out.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace zoo {
namespace {

// A float's place in torch.sort's ascending order as an unsigned key: -0.0 as 0.0, every NaN the largest key.
inline uint32_t order_key(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if (value != value) return std::numeric_limits<uint32_t>::max();
  if (bits == 0x80000000u) bits = 0;
  return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

constexpr int kPasses = 3, kDigitBits = 11;  // digits of 11, 11 and 10 bits, the lowest first
constexpr int64_t kBuckets = int64_t{1} << kDigitBits;

// The indices [0, n) of one row's keys ordered by key, equal keys by index (each pass a stable counting sort by one
// digit) -> order. scratch: room for n indices.
void radix_order(const uint32_t* keys, int64_t n, int32_t* order, int32_t* scratch) {
  std::vector<int64_t> starts(kPasses * kBuckets, 0);  // every pass's digit counts, from one read of the keys
  for (int64_t i = 0; i < n; ++i) {
    for (int pass = 0; pass < kPasses; ++pass) {
      ++starts[pass * kBuckets + ((keys[i] >> (pass * kDigitBits)) & (kBuckets - 1))];
    }
  }
  for (int64_t i = 0; i < n; ++i) order[i] = static_cast<int32_t>(i);
  int32_t *from = order, *to = scratch;
  for (int pass = 0; pass < kPasses; ++pass) {
    const int shift = pass * kDigitBits;
    int64_t* start = starts.data() + pass * kBuckets;
    if (start[(keys[0] >> shift) & (kBuckets - 1)] == n) continue;  // one digit for the whole row: the order stands
    int64_t total = 0;
    for (int64_t b = 0; b < kBuckets; ++b) {
      const int64_t count = start[b];
      start[b] = total;
      total += count;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int32_t index = from[i];
      to[start[(keys[index] >> shift) & (kBuckets - 1)]++] = index;
    }
    std::swap(from, to);
  }
  if (from != order) std::memcpy(order, from, n * sizeof(int32_t));
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), name,
              " must be contiguous float32 CPU rows (B, V)");
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> sort_rows(const torch::Tensor& scores) {
  check_rows(scores, "scores");
  const int64_t rows = scores.size(0), n = scores.size(1);
  TORCH_CHECK(n <= std::numeric_limits<int32_t>::max(), "rows of at most 2^31 - 1 values");
  auto values = torch::empty_like(scores);
  auto indices = torch::empty({rows, n}, scores.options().dtype(at::kLong));
  if (n == 0) return {values, indices};
  const float* in = scores.data_ptr<float>();
  float* out = values.data_ptr<float>();
  int64_t* index_out = indices.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> keys(n);
    std::vector<int32_t> order(n), scratch(n);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in + r * n;
      for (int64_t i = 0; i < n; ++i) keys[i] = order_key(row[i]);
      radix_order(keys.data(), n, order.data(), scratch.data());
      for (int64_t i = 0; i < n; ++i) {
        out[r * n + i] = row[order[i]];
        index_out[r * n + i] = order[i];
      }
    }
  });
  return {values, indices};
}

torch::Tensor draw_rows(const torch::Tensor& probs, const torch::Tensor& u) {
  check_rows(probs, "probs");
  const int64_t rows = probs.size(0), n = probs.size(1);
  TORCH_CHECK(n >= 1, "probs has no columns");
  TORCH_CHECK(u.device().is_cpu() && u.scalar_type() == at::kDouble && u.dim() == 1 && u.size(0) == rows,
              "u must be float64 (B,), one per row of probs");
  auto tokens = torch::empty({rows}, probs.options().dtype(at::kLong));
  const float* p = probs.data_ptr<float>();
  auto uc = u.contiguous();
  const double* up = uc.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = p + r * n;
      double total = 0.0;
      for (int64_t i = 0; i < n; ++i) total += static_cast<double>(row[i]);
      if (!(total > 0.0)) {  // nothing to draw from (a NaN total included): token 0, as draw() gives
        out[r] = 0;
        continue;
      }
      // The first running sum > u * total (searchsorted, right), capped at the first that reaches the total (the
      // last token of positive weight) and at the last column.
      const double threshold = up[r] * total;
      int64_t token = n - 1;
      double sum = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        sum += static_cast<double>(row[i]);
        if (sum > threshold || sum >= total) {
          token = i;
          break;
        }
      }
      out[r] = token;
    }
  });
  return tokens;
}

}  // namespace zoo
