// Attention over a slot KV cache, on the CPU: decode steps, speculative verification and prefill
// alike. One template over the storage type Q of q, the new keys and values and the output, and T of the
// cache (float, bfloat16, float16; storage.h; T is Q, or Q is float32 over a 16-bit cache); scores, softmax
// and sums are float32.
//
// Each query attends over its own row's cached keys [start, end) (end = its position + 1, start > 0
// under a sliding window): only the filled part of each row is read, however long the longest row
// of the batch is, and causal prefill skips the hidden keys instead of masking them. Grouped-query
// attention reads each key and value once for all the query heads that share it. The forward's new
// keys and values are written into the cache first, by the same call, rotated first where the
// caller passes the rotary tables (so are the queries): q, k and v may be strided views of one
// fused projection. Work is split over (row, kv head, query) triples on PyTorch's own OpenMP
// threads, handed out in runs of consecutive ones, about 16 runs per thread since rows differ in length.
//
// The arithmetic is softmax(q . k * scale) @ v with the maximum subtracted before exp, as in
// PyTorch's attention; the summation order and exp's last bits differ (rounding at the 1e-7 level).
#include "kernels.h"
#include "storage.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace zoo {
namespace {

typedef int32_t lanes16 __attribute__((vector_size(64)));
constexpr float kInfinity = std::numeric_limits<float>::infinity();

// Sixteen vectors in, their sixteen horizontal sums out (lane i = sum of v[i]), by four halving
// steps of shuffles instead of sixteen separate reductions.
inline vec16 horizontal_sums(vec16* v) {
  static const lanes16 low[4] = {
      {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
      {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
      {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
      {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
  static const lanes16 high[4] = {
      {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
      {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31},
      {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31},
      {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};
  // Step t pairs vectors holding 2^t groups each (v0's, v1's...) into one holding 2^(t+1) halves.
  for (int step = 0, count = W; step < 4; ++step, count /= 2) {
    for (int i = 0; i < count / 2; ++i) {
      v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], low[step]) + __builtin_shuffle(v[2 * i], v[2 * i + 1], high[step]);
    }
  }
  return v[0];
}

typedef int32_t ints16 __attribute__((vector_size(64)));

// exp(x) for x <= 0 (a softmax's shifted scores), 16 at a time, within 2 ulp of expf, in plain vector
// arithmetic (glibc's expf is a scalar call). Cephes' method: x = n ln2 + r, |r| <= ln2 / 2, exp(r)
// by a degree-6 polynomial, 2^n written into the floats' exponent bits.
inline vec16 exp_nonpositive(vec16 x) {
  const vec16 lowest = vec16{} - 87.0f;  // below, expf is subnormal or 0; the weight is negligible either way
  x = x < lowest ? lowest : x;
  const vec16 shifter = vec16{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  const vec16 n = (x * 1.44269504088896341f + shifter) - shifter;
  const vec16 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  vec16 p = vec16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vec16 y = p * r * r + r + 1.0f;
  const ints16 bits = (__builtin_convertvector(n, ints16) + 127) << 23;
  vec16 power;
  std::memcpy(&power, &bits, sizeof power);
  return y * power;
}

// The G rows of scores (G, stride) <- their softmax, G rows at a time so that their reductions overlap. peaks: each
// row's lane-wise maxima; lanes past its n keys hold -inf (weight 0).
template <int G>
inline void softmax_rows(float* scores, int64_t stride, const vec16* peaks) {
  float peak[G];
  for (int g = 0; g < G; ++g) {
    peak[g] = peaks[g][0];
    for (int64_t i = 1; i < W; ++i) peak[g] = std::max(peak[g], peaks[g][i]);
  }
  vec16 totals[G] = {};
  for (int64_t j = 0; j < stride; j += W) {
    for (int g = 0; g < G; ++g) {
      float* row = scores + g * stride + j;
      const vec16 e = exp_nonpositive(load16(row) - peak[g]);
      const vec16 weights = load16(row) == -kInfinity ? vec16{} : e;
      store16(row, weights);
      totals[g] += weights;
    }
  }
  float total[G] = {};
  for (int64_t i = 0; i < W; ++i)
    for (int g = 0; g < G; ++g) total[g] += totals[g][i];
  for (int g = 0; g < G; ++g) {
    const float inverse = 1.f / total[g];
    for (int64_t j = 0; j < stride; j += W) store16(scores + g * stride + j, load16(scores + g * stride + j) * inverse);
  }
}

// How far ahead of the key being scored attend_group asks for the next keys: about what one core has in flight
// from memory in the time it takes (latency ~100 ns x ~40 GB/s).
constexpr int64_t PREFETCH_BYTES = 4096;

// Asks for the cache lines of `bytes` bytes from p into the CPU's caches (Locality 3: into L1).
template <int Locality>
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(static_cast<const char*>(p) + line, 0, Locality);
}

// Attention of G float32 query heads (G, C * 16) over n keys and values (n, C * 16) each of T; writes
// out (G, C * 16) of O. G and C are compile-time, so the heads' dot products and sums stay in
// registers. scores: room for G rows of n rounded up to 16 floats.
template <typename T, typename O, int G, int C>
void attend_group(const float* q, const T* k, const T* v, O* out, int64_t n, float scale, float* scores) {
  constexpr int64_t D = C * W;
  const int64_t stride = (n + W - 1) / W * W;  // one padded score row per head
  vec16 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = load16(q + g * D + c * W);
  // The hardware's prefetchers follow each row's keys too late to hide memory's latency (a row's keys are short
  // streams): while key j is scored, the key PREFETCH_BYTES further is fetched, and value j, which the weighted sum
  // reads after the softmax.
  constexpr int64_t row_bytes = D * sizeof(T), ahead = std::max<int64_t>(1, PREFETCH_BYTES / row_bytes);
  prefetch_bytes<3>(k, std::min(n, ahead) * row_bytes);
  // Scores, sixteen keys at a time: one dot-product vector per key and head, then reduced together; each head's
  // lane-wise maxima kept for its softmax.
  vec16 dots[G][W];
  vec16 peaks[G];
  for (int g = 0; g < G; ++g) peaks[g] = vec16{} - kInfinity;
  const vec16 lane_index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t first = 0; first < n; first += W) {
    const int64_t count = std::min<int64_t>(W, n - first);
    for (int64_t i = 0; i < W; ++i) {
      if (i >= count) {
        for (int g = 0; g < G; ++g) dots[g][i] = vec16{};
        continue;
      }
      const T* key = k + (first + i) * D;
      prefetch_bytes<3>(key + ahead * D, row_bytes);  // past the end: a hint, never a fault
      prefetch_bytes<3>(v + (first + i) * D, row_bytes);
      vec16 part[C];
      for (int c = 0; c < C; ++c) part[c] = load16(key + c * W);
      for (int g = 0; g < G; ++g) {
        vec16 dot = qv[g][0] * part[0];
        for (int c = 1; c < C; ++c) dot += qv[g][c] * part[c];
        dots[g][i] = dot;
      }
    }
    for (int g = 0; g < G; ++g) {
      vec16 sums = horizontal_sums(dots[g]) * scale;
      if (count < W) sums = lane_index < static_cast<float>(count) ? sums : vec16{} - kInfinity;  // no key: weight 0
      store16(scores + g * stride + first, sums);
      peaks[g] = sums > peaks[g] ? sums : peaks[g];
    }
  }
  softmax_rows<G>(scores, stride, peaks);
  // Weighted values: every head's sums, all C chunks, in registers over one pass of the values.
  vec16 acc[G][C] = {};
  for (int64_t j = 0; j < n; ++j) {
    vec16 value[C];
    for (int c = 0; c < C; ++c) value[c] = load16(v + j * D + c * W);
    for (int g = 0; g < G; ++g) {
      const float weight = scores[g * stride + j];
      for (int c = 0; c < C; ++c) acc[g][c] += weight * value[c];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) store16(out + g * D + c * W, acc[g][c]);
}

template <typename T, typename O>
using AttendGroup = void (*)(const float*, const T*, const T*, O*, int64_t, float, float*);

template <typename T, typename O, int G>
AttendGroup<T, O> attend_group_for_chunks(int64_t C) {
  switch (C) {
    case 1: return attend_group<T, O, G, 1>;
    case 2: return attend_group<T, O, G, 2>;
    case 4: return attend_group<T, O, G, 4>;
    case 8: return attend_group<T, O, G, 8>;
    default: return nullptr;
  }
}

// The instance for G query heads per kv head (1 to 8) and head_dim D (16, 32, 64 or 128); nullptr
// for other shapes.
template <typename T, typename O>
AttendGroup<T, O> attend_group_for(int64_t G, int64_t D) {
  if (D % W) return nullptr;
  switch (G) {
    case 1: return attend_group_for_chunks<T, O, 1>(D / W);
    case 2: return attend_group_for_chunks<T, O, 2>(D / W);
    case 3: return attend_group_for_chunks<T, O, 3>(D / W);
    case 4: return attend_group_for_chunks<T, O, 4>(D / W);
    case 5: return attend_group_for_chunks<T, O, 5>(D / W);
    case 6: return attend_group_for_chunks<T, O, 6>(D / W);
    case 7: return attend_group_for_chunks<T, O, 7>(D / W);
    case 8: return attend_group_for_chunks<T, O, 8>(D / W);
    default: return nullptr;
  }
}

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

// The attention of cached_attention() once its inputs are checked: Q is the storage type of q, the new keys and
// values and the output, T the cache's.
template <typename Q, typename T>
void attend_all(const torch::Tensor& q, const torch::Tensor& new_keys, const torch::Tensor& new_values,
                const torch::Tensor& keys, const torch::Tensor& values, const int64_t* slot, int64_t slots_per_row,
                const int64_t* start, const int64_t* end, float scale, const c10::optional<torch::Tensor>& cos,
                const c10::optional<torch::Tensor>& sin, torch::Tensor& out) {
  const int64_t B = q.size(0), T_ = q.size(1), H = q.size(2), D = q.size(3), Hkv = keys.size(1);
  const int64_t G = H / Hkv;
  const AttendGroup<T, Q> attend = attend_group_for<T, Q>(G, D);
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
  const int threads = std::max(1, at::get_num_threads());
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
  // Tasks (row, kv head, query), consecutive ones sharing a row's keys while they are in cache.
  const int64_t tasks = B * Hkv * T_;
  const int64_t chunk = std::max<int64_t>(1, tasks / (16 * threads));  // tasks per hand-out
  // float32 queries are read in place when the G heads are one contiguous block; others are gathered.
  const bool gather = !std::is_same_v<Q, float> || rotary || qs2 != D;
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(threads, tasks)))
  {
    std::vector<float> scores;
    std::vector<float> queries(gather ? G * D : 0);
#pragma omp for schedule(dynamic, chunk)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / (Hkv * T_), h = task / T_ % Hkv, t = task % T_;
      const int64_t i = b * T_ + t, lo = start[i], n = end[i] - lo;
      const T* k = kp + slot_of(i) * ks0 + h * ks1 + lo * D;
      const T* v = vp + slot_of(i) * vs0 + h * vs1 + lo * D;
      const Q* query = qp + b * qs0 + t * qs1 + h * G * qs2;  // the G heads of kv head h
      const float* query_floats = reinterpret_cast<const float*>(query);  // used as is only when Q is float
      if (gather) {
        for (int64_t g = 0; g < G; ++g) {
          const Q* head = query + g * qs2;
          if (rotary) {
            rotate_half(head, cosp + i * D, sinp + i * D, queries.data() + g * D, D);
          } else {
            widen(head, queries.data() + g * D, D);
          }
        }
        query_floats = queries.data();
      }
      scores.resize(G * ((n + W - 1) / W * W));
      attend(query_floats, k, v, op + (i * H + h * G) * D, n, scale, scores.data());
    }
  }
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
  TORCH_CHECK((attend_group_for<float, float>(G, D) != nullptr), "1 to 8 query heads per kv head and head_dim 16, 32, 64 or 128, not ",
              G, " and ", D);
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

}  // namespace zoo
