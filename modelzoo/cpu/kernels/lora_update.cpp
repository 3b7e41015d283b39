// The low-rank updates of LoRA adapters chosen per row (modelzoo/lora.py): out[m] += B_g (A_g x[m]) for the
// adapter g of each row m, computing only that adapter's update (not every adapter's, masked).
//
// Layout, every adapter's update of one (possibly fused) projection stacked:
//   a        (C, Kp) float32: the A rows of every adapter and piece, K zero-padded to a multiple of 16;
//   b_t      (C, N) float32: B transposed and times the adapter's scaling, column c of the segment holding it
//            nonzero only in that segment's output rows;
//   segments (S, 5) int64: adapter, first and last+1 column of C, first and last+1 output of N (a fused
//            projection's piece: q, k or v of qkv_proj).
// Rows are taken in tiles of up to kTile rows of the same adapter, so each A and B value read serves the tile.
// Every row's arithmetic is the same whatever its tile-mates, so a row's result does not depend on the batch.
#include "kernels.h"
#include "storage.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

namespace zoo {
namespace {

constexpr int64_t kTile = 4;  // rows sharing each A and B value loaded

struct Segment {
  int64_t adapter, first_column, end_column, first_output, end_output;
};

typedef int32_t lanes16 __attribute__((vector_size(64)));

// The sum of v's 16 lanes, halving the vector four times (four shuffles and adds, not fifteen scalar adds).
inline float lanes_sum(vec16 v) {
  v += __builtin_shuffle(v, lanes16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, lanes16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, lanes16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, lanes16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

// One tile: rows (count <= kTile) of one adapter, their inputs widened in xs (count, kp); adds into out.
template <typename T>
void update_tile(const float* xs, int64_t count, int64_t kp, const float* a, const float* b_t, int64_t n,
                 const std::vector<Segment>& segments, T* const* out_rows, std::vector<float>& h) {
  for (const Segment& s : segments) {
    const int64_t rank = s.end_column - s.first_column;
    h.resize(static_cast<size_t>(kTile * rank));
    for (int64_t c = 0; c < rank; ++c) {  // h[i][c] = A[c] . x_i
      const float* a_row = a + (s.first_column + c) * kp;
      vec16 acc[kTile] = {};
      for (int64_t k = 0; k < kp; k += W) {
        const vec16 weights = load16(a_row + k);
        for (int64_t i = 0; i < count; ++i) acc[i] += weights * load16(xs + i * kp + k);
      }
      for (int64_t i = 0; i < count; ++i) h[i * rank + c] = lanes_sum(acc[i]);
    }
    int64_t o = s.first_output;
    for (; o + W <= s.end_output; o += W) {  // out_i[o, o+16) += sum_c h[i][c] * B^T[c, o, o+16)
      vec16 delta[kTile] = {};
      for (int64_t c = 0; c < rank; ++c) {
        const vec16 weights = load16(b_t + (s.first_column + c) * n + o);
        for (int64_t i = 0; i < count; ++i) delta[i] += h[i * rank + c] * weights;
      }
      for (int64_t i = 0; i < count; ++i) store16(out_rows[i] + o, load16(out_rows[i] + o) + delta[i]);
    }
    for (; o < s.end_output; ++o) {
      for (int64_t i = 0; i < count; ++i) {
        float delta = 0.f;
        for (int64_t c = 0; c < rank; ++c) delta += h[i * rank + c] * b_t[(s.first_column + c) * n + o];
        out_rows[i][o] = from_float<T>(to_float(out_rows[i][o]) + delta);
      }
    }
  }
}

}  // namespace

void lora_update_(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& row_adapter, const torch::Tensor& a,
                  const torch::Tensor& b_t, const torch::Tensor& segments) {
  TORCH_CHECK(x.device().is_cpu() && is_storage_type(x.scalar_type()) && x.is_contiguous() && x.dim() == 2,
              "x must be a contiguous float32, bfloat16 or float16 CPU tensor (M, K)");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0),
              "out must be contiguous (M, N) of x's dtype");
  TORCH_CHECK(row_adapter.scalar_type() == at::kLong && row_adapter.dim() == 1 && row_adapter.size(0) == x.size(0) &&
                  row_adapter.is_contiguous(), "row_adapter must be contiguous int64 (M,)");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(a.scalar_type() == at::kFloat && a.dim() == 2 && a.is_contiguous() && a.size(1) % W == 0 &&
                  a.size(1) >= k && a.size(1) < k + W, "a must be contiguous float32 (C, K rounded up to 16)");
  TORCH_CHECK(b_t.scalar_type() == at::kFloat && b_t.dim() == 2 && b_t.is_contiguous() && b_t.size(0) == a.size(0) &&
                  b_t.size(1) == n, "b_t must be contiguous float32 (C, N)");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 5 &&
                  segments.is_contiguous(), "segments must be contiguous int64 (S, 5)");
  const int64_t kp = a.size(1), columns = a.size(0);
  const int64_t* sp = segments.data_ptr<int64_t>();
  int64_t adapters = 0;
  for (int64_t s = 0; s < segments.size(0); ++s) {
    const Segment seg{sp[s * 5], sp[s * 5 + 1], sp[s * 5 + 2], sp[s * 5 + 3], sp[s * 5 + 4]};
    TORCH_CHECK(seg.adapter >= 0 && 0 <= seg.first_column && seg.first_column < seg.end_column &&
                    seg.end_column <= columns && 0 <= seg.first_output && seg.first_output < seg.end_output &&
                    seg.end_output <= n, "segment ", s, " is out of range");
    adapters = std::max(adapters, seg.adapter + 1);
  }
  std::vector<std::vector<Segment>> by_adapter(static_cast<size_t>(adapters));
  for (int64_t s = 0; s < segments.size(0); ++s)
    by_adapter[sp[s * 5]].push_back({sp[s * 5], sp[s * 5 + 1], sp[s * 5 + 2], sp[s * 5 + 3], sp[s * 5 + 4]});
  // Rows grouped by adapter (a counting sort; -1, the bare base, and adapters without an update here skipped),
  // then cut into tiles.
  const int64_t* rp = row_adapter.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows_of(static_cast<size_t>(adapters));
  for (int64_t row = 0; row < m; ++row) {
    TORCH_CHECK(rp[row] >= -1, "row_adapter holds ", rp[row], " (an adapter index, or -1 for none)");
    if (rp[row] >= 0 && rp[row] < adapters && !by_adapter[rp[row]].empty()) rows_of[rp[row]].push_back(row);
  }
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (adapter, index of the tile's first row in rows_of)
  for (int64_t g = 0; g < adapters; ++g)
    for (int64_t first = 0; first < static_cast<int64_t>(rows_of[g].size()); first += kTile) tiles.push_back({g, first});
  const float* ap = a.data_ptr<float>();
  const float* bp = b_t.data_ptr<float>();
  ZOO_DISPATCH_FLOATS(x.scalar_type(), "lora_update_", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> xs(static_cast<size_t>(kTile * kp), 0.f), h;
      for (int64_t t = begin; t < end; ++t) {
        const auto [g, first] = tiles[t];
        const int64_t count = std::min<int64_t>(kTile, static_cast<int64_t>(rows_of[g].size()) - first);
        std::array<scalar_t*, kTile> out_rows{};
        for (int64_t i = 0; i < count; ++i) {
          const int64_t row = rows_of[g][first + i];
          widen(xp + row * k, xs.data() + i * kp, k);  // the padding past k stays 0
          out_rows[i] = op + row * n;
        }
        update_tile(xs.data(), count, kp, ap, bp, n, by_adapter[g], out_rows.data(), h);
      }
    });
  });
}

}  // namespace zoo
