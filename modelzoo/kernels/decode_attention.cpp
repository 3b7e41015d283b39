// Decode-step attention over a slot KV cache, on the CPU, in float32.
//
// One query token per slot attends over that slot's own keys [start, end): only the filled part of
// each row is read, however long the longest row of the batch is. Grouped-query attention reads
// each key and value once for all the query heads that share it. Work is split over
// (slot, kv head) pairs with at::parallel_for (PyTorch's own OpenMP pool).
//
// The arithmetic is softmax(q . k * scale) @ v with the maximum subtracted before exp, as in
// PyTorch's attention; the summation order and exp's last bits differ (rounding at the 1e-7 level).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// 16 floats in one register (AVX-512) or two (AVX2): GCC / Clang vector extensions, no intrinsics.
typedef float vec16 __attribute__((vector_size(64)));
constexpr int64_t W = 16;

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof v); }

typedef int32_t lanes16 __attribute__((vector_size(64)));

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

// exp(x) for x <= 0 (a softmax's shifted scores), within 2 ulp of expf, in plain arithmetic so that
// the softmax loop vectorizes (glibc's expf is a scalar call). Cephes' method: x = n ln2 + r,
// |r| <= ln2 / 2, exp(r) by a degree-6 polynomial, 2^n written into the float's exponent bits.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below, expf is subnormal or 0; the weight is negligible either way
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float power;
  std::memcpy(&power, &bits, sizeof power);
  return y * power;
}

constexpr int64_t kMaxChunks = 16;  // head_dim up to 256

// Attention of G query heads (G, D) over n keys and values (n, D) each; writes out (G, D).
// D is a multiple of 16 and at most 256 (checked by the caller). scores: room for G * n floats.
template <int G>
void attend_group(const float* q, const float* k, const float* v, float* out, int64_t D, int64_t n, float scale,
                  float* scores) {
  const int64_t C = D / W;
  vec16 qv[G][kMaxChunks];
  for (int g = 0; g < G; ++g)
    for (int64_t c = 0; c < C; ++c) qv[g][c] = load16(q + g * D + c * W);
  // Scores, sixteen keys at a time: one dot-product vector per key and head, then reduced together.
  vec16 dots[G][W];
  for (int64_t first = 0; first < n; first += W) {
    const int64_t count = std::min<int64_t>(W, n - first);
    for (int64_t i = 0; i < W; ++i) {
      for (int g = 0; g < G; ++g) dots[g][i] = vec16{};
      if (i >= count) continue;
      const float* key = k + (first + i) * D;
      for (int64_t c = 0; c < C; ++c) {
        const vec16 part = load16(key + c * W);
        for (int g = 0; g < G; ++g) dots[g][i] += qv[g][c] * part;
      }
    }
    for (int g = 0; g < G; ++g) {
      const vec16 sums = horizontal_sums(dots[g]) * scale;
      std::memcpy(scores + g * n + first, &sums, count * sizeof(float));
    }
  }
  for (int g = 0; g < G; ++g) {
    float* row = scores + g * n;
    const float peak = *std::max_element(row, row + n);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < n; ++j) {
      row[j] = exp_nonpositive(row[j] - peak);
      total += row[j];
    }
    const float inverse = 1.f / total;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] *= inverse;
  }
  // Weighted values, one 16-float chunk of the head at a time, the G heads' sums in registers.
  for (int64_t c = 0; c < C; ++c) {
    vec16 acc[G] = {};
    for (int64_t j = 0; j < n; ++j) {
      const vec16 value = load16(v + j * D + c * W);
      for (int g = 0; g < G; ++g) acc[g] += scores[g * n + j] * value;
    }
    for (int g = 0; g < G; ++g) store16(out + g * D + c * W, acc[g]);
  }
}

using AttendGroup = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, float, float*);

// The instance for G query heads per kv head (1 to 8); nullptr for other ratios.
AttendGroup attend_group_for(int64_t G) {
  switch (G) {
    case 1: return attend_group<1>;
    case 2: return attend_group<2>;
    case 3: return attend_group<3>;
    case 4: return attend_group<4>;
    case 5: return attend_group<5>;
    case 6: return attend_group<6>;
    case 7: return attend_group<7>;
    case 8: return attend_group<8>;
    default: return nullptr;
  }
}

// q: (S, H, D); keys, values: (S, Hkv, M, D), contiguous in their last two dims; starts, ends: (S,).
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               const torch::Tensor& starts, const torch::Tensor& ends, double scale) {
  TORCH_CHECK(q.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(), "q (S, H, D), cache (S, Hkv, M, D)");
  TORCH_CHECK(q.is_contiguous(), "q must be contiguous");
  TORCH_CHECK(keys.stride(3) == 1 && keys.stride(2) == keys.size(3) && values.stride(3) == 1 &&
                  values.stride(2) == values.size(3), "cache rows must be contiguous");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = keys.size(1), M = keys.size(2);
  TORCH_CHECK(keys.size(0) == S && keys.size(3) == D && H % Hkv == 0, "q and cache shapes disagree");
  TORCH_CHECK(D % W == 0 && D <= W * kMaxChunks, "head_dim must be a multiple of ", W, " up to ", W * kMaxChunks);
  TORCH_CHECK(starts.numel() == S && ends.numel() == S, "one start and end per slot");
  auto starts64 = starts.to(at::kLong).contiguous();
  auto ends64 = ends.to(at::kLong).contiguous();
  const int64_t* start = starts64.data_ptr<int64_t>();
  const int64_t* end = ends64.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(0 <= start[s] && start[s] < end[s] && end[s] <= M, "slot ", s, ": keys [", start[s], ", ", end[s],
                ") outside the cache's ", M, " positions");
  }
  const int64_t G = H / Hkv;
  const AttendGroup attend = attend_group_for(G);
  TORCH_CHECK(attend != nullptr, "1 to 8 query heads per kv head, not ", G);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), vs0 = values.stride(0), vs1 = values.stride(1);
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, S * Hkv, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores;
    for (int64_t task = first; task < last; ++task) {
      const int64_t s = task / Hkv, h = task % Hkv;
      const int64_t lo = start[s], n = end[s] - lo;
      const float* k = kp + s * ks0 + h * ks1 + lo * D;
      const float* v = vp + s * vs0 + h * vs1 + lo * D;
      const float* qg = qp + (s * H + h * G) * D;  // the G query heads of kv head h
      scores.resize(G * n);
      attend(qg, k, v, op + (s * H + h * G) * D, D, n, fscale, scores.data());
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "One query per slot over that slot's cached keys [start, end): q (S, H, D), cache (S, Hkv, M, D)");
}
