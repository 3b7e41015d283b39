// Attention over a slot KV cache, on the CPU: decode steps, speculative verification and prefill
// alike. One template over the storage type Q of q, the new keys and values and the output, and T of the
// cache (float, bfloat16, float16; storage.h; T is Q, or Q is float32 over a 16-bit cache); scores, softmax
// and sums are float32.
//
// Each query attends over its own row's cached keys [start, end) (end = its position + 1, start > 0
// under a sliding window): only the filled part of each row is read, however long the longest row
// of the batch is, and causal prefill skips the hidden keys instead of masking them. The forward's new
// keys and values are written into the cache first, by the same call, rotated first where the
// caller passes the rotary tables (so are the queries): q, k and v may be strided views of one
// fused projection.
//
// Consecutive queries of one sequence (a prompt's, or a speculative step's) form blocks of up to 16 that share their
// keys: each block and kv head scores every query head sharing them in register tiles over the cached keys in place
// (attention_tiles.h), so a prefill reads each key once for up to 6 query heads, a decode step once for the heads of
// its group. Every query's result is computed the same way in any block (attention_tiles.h). Work is split
// over (block, kv head) pairs on PyTorch's own OpenMP threads, shared out as they come free (shared_tasks.h).
//
// The arithmetic is softmax(q . k * scale) @ v with the maximum subtracted before exp, as in
// PyTorch's attention; the summation order and exp's last bits differ (rounding at the 1e-7 level).
#include "attention_tiles.h"
#include "cpu_caches.h"
#include "kernels.h"
#include "shared_tasks.h"
#include "storage.h"
#include "timed_choice.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

namespace zoo {
namespace {

constexpr int64_t kBlockQueries = 16;  // most queries of a block

// Queries first .. first + count - 1 (i = b * T + t) of one sequence: one row's cache slot and key start, each
// query's keys ending one after the previous one's.
struct QueryBlock {
  int64_t first, count;
};

// n values of Q into T: a copy where they are one type, else widened and rounded. Into a float16 cache from a wider
// type, values beyond float16's range saturate at its largest finite value (a key of inf would turn every score
// of its row into NaN).
template <typename Q, typename T>
void store_row(const Q* in, T* out, int64_t n, float* scratch) {
  if constexpr (std::is_same_v<Q, T>) {
    std::memcpy(out, in, n * sizeof(T));
  } else {
    widen(in, scratch, n);
    if constexpr (std::is_same_v<T, c10::Half>) {
      for (int64_t i = 0; i < n; ++i) scratch[i] = std::clamp(scratch[i], -HALF_MAX, HALF_MAX);
    }
    narrow(scratch, out, n);
  }
}

TimedChoice key_tile_choice;

// The way tiles of query heads score their keys on this CPU (attend_rows: 0 wide, 1 narrow), the faster of the two
// timed at the first call on that call's cache type T: 6 query heads over 512 keys, 16 times over other keys (from the
// L2 cache, as a prefill's blocks find theirs; a decode step's tiles of 1-3 heads are the same either way).
template <typename T>
int key_tile_way() {
  return key_tile_choice.get([] {
    constexpr int64_t kD = 64, kKeys = 512, kHeads = 6, kBlocks = 16;
    auto keys = std::make_shared<std::vector<T>>(kBlocks * kKeys * kD);
    for (size_t i = 0; i < keys->size(); ++i) (*keys)[i] = static_cast<T>(static_cast<float>(i % 97) / 97.f - 0.5f);
    auto queries = std::make_shared<std::vector<float>>(kHeads * kD, 0.1f);
    auto outs = std::make_shared<std::vector<float>>(kHeads * kD);
    return std::function<void(int)>([=](int way) {
      std::vector<float> scores(kTileRows * kKeys);
      std::vector<int64_t> lengths(kHeads, kKeys);
      std::vector<float*> heads(kHeads);
      for (int64_t h = 0; h < kHeads; ++h) heads[h] = outs->data() + h * kD;
      for (int64_t b = 0; b < kBlocks; ++b) {
        const T* block = keys->data() + b * kKeys * kD;
        attend_rows<T, float>(way, queries->data(), kHeads, lengths.data(), block, block, kD, 0.125f, scores.data(),
                              kKeys, heads.data());
      }
    });
  }, kKeyTileWays);
}

// The attention of cached_attention() once its inputs are checked: Q is the storage type of q, the new keys and
// values and the output, T the cache's.
template <typename Q, typename T>
void attend_all(const torch::Tensor& q, const torch::Tensor& new_keys, const torch::Tensor& new_values,
                const torch::Tensor& keys, const torch::Tensor& values, const int64_t* slot, int64_t slots_per_row,
                const int64_t* start, const int64_t* end, float scale, const c10::optional<torch::Tensor>& cos,
                const c10::optional<torch::Tensor>& sin, torch::Tensor& out) {
  const int64_t B = q.size(0), T_ = q.size(1), H = q.size(2), D = q.size(3), Hkv = keys.size(1);
  const int64_t G = H / Hkv;
  const bool rotary = cos.has_value();
  const Q* qp = q.data_ptr<Q>();
  const Q* nkp = new_keys.data_ptr<Q>();
  const Q* nvp = new_values.data_ptr<Q>();
  const Q* cosp = rotary ? cos->data_ptr<Q>() : nullptr;
  const Q* sinp = rotary ? sin->data_ptr<Q>() : nullptr;
  T* kp = keys.data_ptr<T>();
  T* vp = values.data_ptr<T>();
  Q* op = out.data_ptr<Q>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), vs0 = values.stride(0), vs1 = values.stride(1);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int way = key_tile_way<T>();
  // The cache row of query i = b * T + t.
  auto slot_of = [&](int64_t i) { return slot[slots_per_row == 1 ? i / std::max<int64_t>(T_, 1) : i]; };

  // The new keys first, every query's at its own position, split over the threads: a query reads those of earlier
  // queries of its row.
  at::parallel_for(0, B * T_, 64, [&](int64_t begin, int64_t finish) {
    std::vector<float> rotated(D);
    for (int64_t i = begin; i < finish; ++i) {
      const int64_t b = i / T_, t = i % T_;
      for (int64_t h = 0; h < Hkv; ++h) {
        const Q* key = nkp + b * new_keys.stride(0) + t * new_keys.stride(1) + h * new_keys.stride(2);
        const Q* value = nvp + b * new_values.stride(0) + t * new_values.stride(1) + h * new_values.stride(2);
        T* key_slot = kp + slot_of(i) * ks0 + h * ks1 + (end[i] - 1) * D;
        if (rotary) {
          rotate_half(key, cosp + i * D, sinp + i * D, rotated.data(), D);
          narrow(rotated.data(), key_slot, D);
        } else {
          store_row(key, key_slot, D, rotated.data());
        }
        store_row(value, vp + slot_of(i) * vs0 + h * vs1 + (end[i] - 1) * D, D, rotated.data());
      }
    }
  });
  std::vector<QueryBlock> blocks;
  for (int64_t i = 0; i < B * T_; ++i) {
    if (!blocks.empty()) {
      QueryBlock& last = blocks.back();
      const int64_t previous = last.first + last.count - 1;
      if (last.count < kBlockQueries && i / T_ == previous / T_ && slot_of(i) == slot_of(previous) &&
          start[i] == start[previous] && end[i] == end[previous] + 1) {
        ++last.count;
        continue;
      }
    }
    blocks.push_back({i, 1});
  }
  // Tasks (block, kv head), shared out as the threads come free (shared_tasks.h): blocks differ in length. A task
  // fetches into L2 at most an eighth of it of the next task's keys, and as much of its values, so that a long
  // context's do not push out the keys and values it reads itself.
  const int64_t most_ahead = l2_cache_bytes() / 8;
  // Query i's head `head` (its D values; i = b * T + t).
  const auto query_head = [&](int64_t i, int64_t head) { return qp + i / T_ * qs0 + i % T_ * qs1 + head * qs2; };
  // The query heads of the task from `block` and kv head h, fetched a task ahead (the projection that wrote them has
  // pushed them out of this core's caches since): the task reads them first, to rotate them.
  const auto prefetch_queries = [&](const QueryBlock& block, int64_t h) {
    for (int64_t i = block.first; i < block.first + block.count; ++i) {
      for (int64_t g = 0; g < G; ++g) fetch_lines<_MM_HINT_T0>(query_head(i, h * G + g), D * sizeof(Q));
    }
  };
  const auto run = [&](int64_t begin, int64_t finish) {  // tasks [begin, finish), one after the other
    thread_local std::vector<float> scores, queries;  // each thread's, kept from call to call
    thread_local std::vector<int64_t> lengths;
    thread_local std::vector<Q*> outs;
    for (int64_t task = begin; task < finish; ++task) {
      const QueryBlock& block = blocks[task / Hkv];
      const int64_t h = task % Hkv, first = block.first, heads = block.count * G;
      const int64_t lo = start[first], n = end[first + block.count - 1] - lo;
      const int64_t stride = (n + W - 1) / W * W;
      const T* k = kp + slot_of(first) * ks0 + h * ks1 + lo * D;
      const T* v = vp + slot_of(first) * vs0 + h * vs1 + lo * D;
      Ahead ahead;  // the next task's keys and values, where this thread runs it next
      if (task + 1 < finish) {
        const QueryBlock& next = blocks[(task + 1) / Hkv];
        const int64_t next_lo = start[next.first], next_h = (task + 1) % Hkv;
        ahead.lines = reinterpret_cast<const char*>(kp + slot_of(next.first) * ks0 + next_h * ks1 + next_lo * D);
        ahead.bytes = std::min(most_ahead,
                               (end[next.first + next.count - 1] - next_lo) * D * static_cast<int64_t>(sizeof(T)));
        ahead.value_lines = reinterpret_cast<const char*>(vp + slot_of(next.first) * vs0 + next_h * vs1 + next_lo * D);
        ahead.value_bytes = ahead.bytes;
        prefetch_queries(next, next_h);
      }
      queries.resize(heads * D);
      lengths.resize(heads);
      outs.resize(heads);
      for (int64_t j = 0; j < block.count; ++j) {
        const int64_t i = first + j;
        for (int64_t g = 0; g < G; ++g) {
          const Q* head = query_head(i, h * G + g);
          float* row = queries.data() + (j * G + g) * D;
          if (rotary) {
            rotate_half(head, cosp + i * D, sinp + i * D, row, D);
          } else {
            widen(head, row, D);
          }
          lengths[j * G + g] = end[i] - lo;
          outs[j * G + g] = op + (i * H + h * G + g) * D;
        }
      }
      scores.resize(std::min<int64_t>(heads, kTileRows) * stride);
      attend_rows(way, queries.data(), heads, lengths.data(), k, v, D, scale, scores.data(), stride, outs.data(),
                  ahead);
    }
  };
  share_tasks(static_cast<int64_t>(blocks.size()) * Hkv, run);
}

}  // namespace

// Writes new_keys, new_values (B, T, Hkv, D) at positions ends - 1 of cache rows `slots`, then attends
// each query of q (B, T, H, D) over its row's keys [start, end). q, new_keys, new_values: any strides
// with each head's D values contiguous. keys, values: (S, Hkv, M, D), contiguous in their last two
// dims; slots: (B,), or (B, T) when a row packs several sequences side by side (one cache row per
// query); starts, ends: (B, T); cos, sin: none, or (B, T, D) contiguous to rotate q and the new keys
// by. q, the new keys and values, cos and sin share one dtype (float32, bfloat16 or float16), the cache that
// dtype or, under float32 queries, bfloat16 or float16. Returns (B, T, H, D) of q's dtype.
torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& new_keys, const torch::Tensor& new_values,
                               const torch::Tensor& keys, const torch::Tensor& values, const torch::Tensor& slots,
                               const torch::Tensor& starts, const torch::Tensor& ends, double scale,
                               const c10::optional<torch::Tensor>& cos, const c10::optional<torch::Tensor>& sin) {
  for (const auto& t : {q, new_keys, new_values}) {
    TORCH_CHECK(t.device().is_cpu() && is_storage_type(t.scalar_type()) && t.scalar_type() == q.scalar_type(),
                "q and the new keys and values must be CPU tensors of one dtype: float32, bfloat16 or float16");
  }
  const auto cache_type = keys.scalar_type();
  TORCH_CHECK(keys.device().is_cpu() && values.device().is_cpu() && values.scalar_type() == cache_type &&
                  (cache_type == q.scalar_type() ||
                   (q.scalar_type() == at::kFloat && (cache_type == at::kBFloat16 || cache_type == at::kHalf))),
              "the cache must be q's dtype, or bfloat16 or float16 under float32 queries");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(), "q (B, T, H, D), cache (S, Hkv, M, D)");
  TORCH_CHECK(q.stride(3) == 1 && new_keys.stride(3) == 1 && new_values.stride(3) == 1,
              "each head of q and of the new keys and values must be contiguous");
  TORCH_CHECK(keys.stride(3) == 1 && keys.stride(2) == keys.size(3) && values.stride(3) == 1 &&
                  values.stride(2) == values.size(3), "cache rows must be contiguous");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t S = keys.size(0), Hkv = keys.size(1), M = keys.size(2);
  TORCH_CHECK(keys.size(3) == D && H % Hkv == 0, "q and cache shapes disagree");
  TORCH_CHECK(new_keys.sizes() == at::IntArrayRef({B, T, Hkv, D}) && new_values.sizes() == new_keys.sizes(),
              "new keys and values must be (B, T, Hkv, D)");
  TORCH_CHECK((slots.numel() == B || slots.numel() == B * T) && starts.numel() == B * T && ends.numel() == B * T,
              "one slot per row or per query, one start and end per query");
  const int64_t slots_per_row = slots.numel() / std::max<int64_t>(B, 1);  // 1 or T
  TORCH_CHECK(cos.has_value() == sin.has_value(), "cos and sin come together");
  if (cos.has_value()) {
    for (const auto& table : {*cos, *sin}) {
      TORCH_CHECK(table.sizes() == at::IntArrayRef({B, T, D}) && table.is_contiguous() &&
                      table.scalar_type() == q.scalar_type() && table.device().is_cpu(),
                  "cos and sin must be contiguous (B, T, D) of q's dtype");
    }
  }
  const int64_t G = H / Hkv;
  TORCH_CHECK(1 <= G && G <= 8 && (D == 16 || D == 32 || D == 64 || D == 128),
              "1 to 8 query heads per kv head and head_dim 16, 32, 64 or 128, not ", G, " and ", D);
  auto slots64 = slots.to(at::kLong).contiguous();
  auto starts64 = starts.to(at::kLong).contiguous();
  auto ends64 = ends.to(at::kLong).contiguous();
  const int64_t* slot = slots64.data_ptr<int64_t>();
  const int64_t* start = starts64.data_ptr<int64_t>();
  const int64_t* end = ends64.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = b * T + t, row_slot = slot[slots_per_row == 1 ? b : i];
      TORCH_CHECK(0 <= row_slot && row_slot < S, "row ", b, " query ", t, ": slot ", row_slot,
                  " outside the cache's ", S, " slots");
      TORCH_CHECK(0 <= start[i] && start[i] < end[i] && end[i] <= M, "row ", b, " query ", t, ": keys [", start[i],
                  ", ", end[i], ") outside the cache's ", M, " positions");
    }
  }
  auto out = torch::empty({B, T, H, D}, q.options());
  if (cache_type == q.scalar_type()) {
    ZOO_DISPATCH_FLOATS(q.scalar_type(), "cached_attention", [&] {
      attend_all<scalar_t, scalar_t>(q, new_keys, new_values, keys, values, slot, slots_per_row, start, end,
                                     static_cast<float>(scale), cos, sin, out);
    });
  } else {  // float32 queries over a 16-bit cache
    ZOO_DISPATCH_FLOATS(cache_type, "cached_attention", [&] {
      attend_all<float, scalar_t>(q, new_keys, new_values, keys, values, slot, slots_per_row, start, end,
                                  static_cast<float>(scale), cos, sin, out);
    });
  }
  return out;
}

torch::Tensor cached_attention_qkv(const torch::Tensor& qkv, int64_t heads, const torch::Tensor& keys,
                                   const torch::Tensor& values, const torch::Tensor& slots, const torch::Tensor& starts,
                                   const torch::Tensor& ends, double scale, const c10::optional<torch::Tensor>& cos,
                                   const c10::optional<torch::Tensor>& sin) {
  TORCH_CHECK(qkv.dim() == 3 && keys.dim() == 4 && qkv.stride(2) == 1,
              "qkv must be (B, T, (heads + 2 kv_heads) head_dim) with unit last stride, the cache (S, Hkv, M, D)");
  const int64_t B = qkv.size(0), T = qkv.size(1), kv_heads = keys.size(1), D = keys.size(3);
  TORCH_CHECK(heads >= 1 && qkv.size(2) == (heads + 2 * kv_heads) * D, "qkv's last dimension is ", qkv.size(2),
              ", not (heads + 2 kv_heads) head_dim = (", heads, " + 2 x ", kv_heads, ") x ", D);
  const auto q = qkv.narrow(2, 0, heads * D).view({B, T, heads, D});
  const auto k = qkv.narrow(2, heads * D, kv_heads * D).view({B, T, kv_heads, D});
  const auto v = qkv.narrow(2, (heads + kv_heads) * D, kv_heads * D).view({B, T, kv_heads, D});
  return cached_attention(q, k, v, keys, values, slots, starts, ends, scale, cos, sin).view({B, T, heads * D});
}

int64_t attention_keys_at_once(int64_t use) {
  constexpr int64_t kWide = kKeysAtOnce<kTileRows, false>, kNarrow = kKeysAtOnce<kTileRows, true>;
  TORCH_CHECK(use == 0 || use == kWide || use == kNarrow, "keys at once: 0 (as timed), ", kWide, " or ", kNarrow,
              " on this build, not ", use);
  if (use) key_tile_choice.set(use == kWide ? 0 : 1);
  return key_tile_way<float>() == 0 ? kWide : kNarrow;
}

}  // namespace zoo
