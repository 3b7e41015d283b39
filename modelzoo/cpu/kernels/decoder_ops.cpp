// The small ops between a decoder layer's matrix multiplies, each fused into one call: RMSNorm
// (optionally after the residual add), SiLU(gate) * up, and the rotary embedding of one head. Each
// is a template over the storage type (float, bfloat16, float16; storage.h) computing in float32.
//
// Each reproduces its PyTorch spelling bit for bit, as transformers writes it, so that greedy
// decoding stays token-exact with the Hugging Face reference (in bfloat16 and float16 too, where
// PyTorch rounds where the spelling rounds: the norm's x * rsqrt before the weight, SiLU before the
// product, the residual sum):
// - RMSNorm: x.pow(2).mean(-1) is torch.sum's order of additions (8-lane vectors, four interleaved
//   accumulators, its cascade levels, lanes added one by one) then a division by n;
//   x * rsqrt(var + eps) is 1 / sqrt; then weight * x.
// - SiLU: x / (1 + exp(-x)) with PyTorch's own vector exp (SLEEF's, exported by libtorch), in
//   8-lane blocks as ATen runs it, and glibc's expf for the tail it runs one element at a time.
// - Rotary: x * cos + rotate_half(x) * sin, two products and a sum each rounded.
// No a * b + c may become one fused multiply-add here, or the roundings change:
#pragma GCC optimize("fp-contract=off")

#include "kernels.h"
#include "storage.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

// SLEEF's exp as ATen's float kernels run it, from libtorch_cpu: its AVX2 build, or on AVX-512 its AVX-512 build (the
// same bits as the AVX2 one for every one of the 2^32 floats, compared over all of them; 16 lanes at a time).
#if defined(__AVX512F__)
typedef __m512 ExpVector;
extern "C" __m512 Sleef_expf16_u10(__m512);
inline __m512 sleef_exp(__m512 x) { return Sleef_expf16_u10(x); }
#else
typedef __m256 ExpVector;
extern "C" __m256 Sleef_expf8_u10(__m256);
inline __m256 sleef_exp(__m256 x) { return Sleef_expf8_u10(x); }
#endif

namespace zoo {
namespace {

typedef float vec8 __attribute__((vector_size(32)));
constexpr int64_t L = 8;  // lanes of ATen's reduction and activation kernels on this build


// Sum of x[i]^2 over n floats, in the order of ATen's vectorized inner sum: the n / 8 vectors are read
// as rows of 4 (one accumulator each) summed with its cascade (levels of 16 rows), leftover vectors go
// to accumulator 0, accumulators 1-3 are added to it, then a scalar sum of the tail and the 8 lanes.
float sum_of_squares(const float* x, int64_t n) {
  constexpr int64_t ilp = 4, levels = 4;
  const int64_t vectors = n / L, rows = vectors / ilp;
  auto square = [&](int64_t vector) {
    const vec8 v = load8(x + vector * L);
    return v * v;
  };
  int64_t ceil_log2 = 1;
  if (rows > 2) {
    ceil_log2 = 0;
    while ((int64_t{1} << ceil_log2) < rows) ++ceil_log2;
  }
  const int64_t power = std::max<int64_t>(4, ceil_log2 / levels), step = int64_t{1} << power, mask = step - 1;
  vec8 acc[levels][ilp] = {};
  int64_t row = 0;
  while (row + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++row)
      for (int64_t k = 0; k < ilp; ++k) acc[0][k] += square(row * ilp + k);
    for (int64_t level = 1; level < levels; ++level) {
      for (int64_t k = 0; k < ilp; ++k) {
        acc[level][k] += acc[level - 1][k];
        acc[level - 1][k] = vec8{};
      }
      if (row & (mask << (level * power))) break;
    }
  }
  for (; row < rows; ++row)
    for (int64_t k = 0; k < ilp; ++k) acc[0][k] += square(row * ilp + k);
  for (int64_t level = 1; level < levels; ++level)
    for (int64_t k = 0; k < ilp; ++k) acc[0][k] += acc[level][k];
  for (int64_t vector = rows * ilp; vector < vectors; ++vector) acc[0][0] += square(vector);
  for (int64_t k = 1; k < ilp; ++k) acc[0][0] += acc[0][k];
  float total = 0.f;
  for (int64_t i = vectors * L; i < n; ++i) total += x[i] * x[i];
  for (int64_t lane = 0; lane < L; ++lane) total += acc[0][0][lane];
  return total;
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)) for one row of n values, x already widened to float32.
template <typename T>
void rms_norm_row(const float* x, const T* weight, float eps, T* out, int64_t n) {
  const float variance = sum_of_squares(x, n) / static_cast<float>(n);
  const float inverse = 1.f / std::sqrt(variance + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(to_float(weight[i]) * to_float(from_float<T>(x[i] * inverse)));
}

void check_rows(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && is_storage_type(x.scalar_type()) && x.is_contiguous(),
              "x must be a contiguous float32, bfloat16 or float16 CPU tensor");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(), "weight must be (n,) of x's dtype for x (..., n)");
}

// n values of T as float32: the values themselves for float, else widened into `buffer`.
template <typename T>
const float* as_floats(const T* values, std::vector<float>& buffer, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return values;
  } else {
    buffer.resize(n);
    widen(values, buffer.data(), n);
    return buffer.data();
  }
}

constexpr int64_t kRowsPerTask = 16;  // a decode step's 32 rows are two tasks, a prefill's thousand many

}  // namespace

namespace {

// silu of the 16 floats at gate, as silu_row computes them: SLEEF's exp on one AVX-512 vector or two AVX2 ones.
inline vec16 silu16(const float* gate) {
  const vec16 g = load16(gate), negated = -g;
  vec16 exp_minus;
  for (size_t part = 0; part < sizeof(vec16); part += sizeof(ExpVector)) {
    ExpVector minus;
    std::memcpy(&minus, reinterpret_cast<const char*>(&negated) + part, sizeof minus);
    const ExpVector e = sleef_exp(minus);
    std::memcpy(reinterpret_cast<char*>(&exp_minus) + part, &e, sizeof e);
  }
  return g / (1.f + exp_minus);
}

}  // namespace

// silu(gate) = gate / (1 + exp(-gate)) over n floats, in ATen's order: 8-lane blocks two vectors at a
// time with SLEEF's exp, then one element at a time with glibc's.
void silu_row(const float* gate, float* out, int64_t n) {
  static_assert(2 * L == W, "ATen's blocks of two 8-lane vectors are silu16's 16 floats");
  const int64_t blocks = n / W * W;
  for (int64_t i = 0; i < blocks; i += W) store16(out + i, silu16(gate + i));
  for (int64_t i = blocks; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i]));
}

template <typename O>
void silu_times_up(const float* gate, const float* up, int64_t n, O* out) {
  const int64_t blocks = n / W * W;
  for (int64_t i = 0; i < blocks; i += W) store16(out + i, silu16(gate + i) * load16(up + i));
  for (int64_t i = blocks; i < n; ++i) out[i] = from_float<O>(gate[i] / (1.f + std::exp(-gate[i])) * up[i]);
}

template void silu_times_up<float>(const float*, const float*, int64_t, float*);
template void silu_times_up<c10::BFloat16>(const float*, const float*, int64_t, c10::BFloat16*);

// The norm's output for x: x's dtype, or with `rounded` (float32 x alone) bfloat16.
torch::Tensor norm_output(const torch::Tensor& x, bool rounded) {
  TORCH_CHECK(!rounded || x.scalar_type() == at::kFloat, "a norm rounds its outputs to bfloat16 from float32 x alone");
  return torch::empty_like(x, rounded ? x.options().dtype(at::kBFloat16) : x.options());
}

// A row's norm (n values from float32 x, weight of T) into `out` (T), or with `rounded` (T float32 alone) rounded to
// bfloat16 into `rounded` through the float32 scratch `normed`.
template <typename T>
void norm_row_into(const float* x, const T* weight, float eps, T* out, c10::BFloat16* rounded, int64_t n,
                   std::vector<float>& normed) {
  if constexpr (std::is_same_v<T, float>) {
    if (rounded) {
      normed.resize(n);
      rms_norm_row(x, weight, eps, normed.data(), n);
      round_to_bf16(normed.data(), n, rounded);
      return;
    }
  }
  rms_norm_row(x, weight, eps, out, n);
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool rounded) {
  check_rows(x, weight);
  auto out = norm_output(x, rounded);
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  ZOO_DISPATCH_FLOATS(x.scalar_type(), "rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t* op = rounded ? nullptr : out.data_ptr<scalar_t>();
    c10::BFloat16* bp = rounded ? out.data_ptr<c10::BFloat16>() : nullptr;
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      std::vector<float> wide, normed;
      for (int64_t r = begin; r < end; ++r)
        norm_row_into(as_floats(xp + r * n, wide, n), wp, static_cast<float>(eps), op ? op + r * n : nullptr,
                      bp ? bp + r * n : nullptr, n, normed);
    });
  });
  return out;
}

torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& weight, double eps,
                            bool rounded) {
  check_rows(x, weight);
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type() && delta.is_contiguous(),
              "delta must be a contiguous tensor shaped like x, of its dtype");
  auto out = norm_output(x, rounded);
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  ZOO_DISPATCH_FLOATS(x.scalar_type(), "add_rms_norm_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t *dp = delta.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t* op = rounded ? nullptr : out.data_ptr<scalar_t>();
    c10::BFloat16* bp = rounded ? out.data_ptr<c10::BFloat16>() : nullptr;
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      std::vector<float> wide, normed;
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = xp + r * n;
        for (int64_t i = 0; i < n; ++i) row[i] = from_float<scalar_t>(to_float(row[i]) + to_float(dp[r * n + i]));
        norm_row_into(as_floats(row, wide, n), wp, static_cast<float>(eps), op ? op + r * n : nullptr,
                      bp ? bp + r * n : nullptr, n, normed);  // on the rounded sum
      }
    });
  });
  return out;
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && is_storage_type(gate_up.scalar_type()) && gate_up.is_contiguous(),
              "gate_up must be a contiguous float32, bfloat16 or float16 CPU tensor");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "gate_up's last dimension must be even (gate | up)");
  const int64_t n = gate_up.size(-1) / 2, rows = n ? gate_up.numel() / (2 * n) : 0;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = n;
  auto out = torch::empty(sizes, gate_up.options());
  ZOO_DISPATCH_FLOATS(gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* ip = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      std::vector<float> gate_wide, silu(n);
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t *gate = ip + r * 2 * n, *up = gate + n;
        silu_row(as_floats(gate, gate_wide, n), silu.data(), n);
        scalar_t* row = op + r * n;  // silu rounded to T, then the product rounded to T
        for (int64_t i = 0; i < n; ++i) row[i] = from_float<scalar_t>(to_float(from_float<scalar_t>(silu[i])) * to_float(up[i]));
      }
    });
  });
  return out;
}

template <typename T>
void rotate_half(const T* x, const T* cos, const T* sin, float* out, int64_t d) {
  const int64_t half = d / 2;
  auto f = [](T value) { return to_float(value); };
  for (int64_t i = 0; i < half; ++i) out[i] = f(x[i]) * f(cos[i]) + (-f(x[i + half])) * f(sin[i]);
  for (int64_t i = half; i < d; ++i) out[i] = f(x[i]) * f(cos[i]) + f(x[i - half]) * f(sin[i]);
}

template void rotate_half<float>(const float*, const float*, const float*, float*, int64_t);
template void rotate_half<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, float*,
                                         int64_t);
template void rotate_half<c10::Half>(const c10::Half*, const c10::Half*, const c10::Half*, float*, int64_t);

}  // namespace zoo
