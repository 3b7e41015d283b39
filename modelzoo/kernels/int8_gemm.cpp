// int8 x int8 linear layers on AVX512-VNNI: y = x @ W^T (+ bias) with W stored as group-wise int8.
//
// Weights: q (N, K) int8 with one float32 scale per output row and group of `group` inputs
// (w ~= q * scale), packed by modelzoo/int8_compute.py into blocks of 16 output rows:
//   packed (N/16, K/4, 16, 4) uint8 = q + 128: for each 4 inputs, 16 rows' 4 bytes side by side (one VNNI
//   operand; VNNI's vpdpbusd multiplies unsigned by signed bytes);  scales (N/16, G, 16) float32.
// N and K are padded with zeros (q = 0) to multiples of 16 and of `group`; G = K / group.
//
// Activations are quantized on the fly, per row and per group: s = absmax / 127, xq = round(x * 127 / absmax)
// (nearest even; 0 for an all-zero group), with c = -128 * sum of the group's xq taking the weights' +128
// back out. Then, for each row m and output n,
//   y[m, n] = sum over groups g, in order, of float(c[m, g] + sum_k (q + 128) * xq) * (ws[n, g] * xs[m, g])
// with integer sums (exact) and one float32 fused multiply-add per group. A row's arithmetic is the same
// whatever the other rows of the call, so the result does not depend on the batch.
#include "kernels.h"
#include "storage.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace zoo {

bool int8_vnni_available() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
namespace {

constexpr int64_t kBlock = 16;   // output rows per packed block (one 512-bit register of int32 sums)
constexpr int64_t kRowsTile = 4; // activation rows per register tile
constexpr int64_t kBlocksTile = 2;  // packed blocks per register tile: 4 x 2 int32 and 4 x 2 float accumulators

// One activation row of k values (widened to float32, zero-padded to k_padded) -> int8 xq, the group scales
// and the groups' corrections -128 * sum(xq).
void quantize_row(const float* x, int64_t k_padded, int64_t group, int8_t* out, float* scales, int32_t* corrections) {
  for (int64_t start = 0; start < k_padded; start += group) {
    __m512 peak = _mm512_setzero_ps();
    for (int64_t i = start; i < start + group; i += kBlock)
      peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    const float absmax = _mm512_reduce_max_ps(peak);
    const float inverse = absmax > 0.f ? 127.f / absmax : 0.f;
    scales[start / group] = absmax / 127.f;
    const __m512 multiplier = _mm512_set1_ps(inverse);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = start; i < start + group; i += kBlock) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), multiplier));  // nearest even
      const __m512i clamped = _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
      sum = _mm512_add_epi32(sum, clamped);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtsepi32_epi8(clamped));
    }
    corrections[start / group] = -128 * _mm512_reduce_add_epi32(sum);
  }
}

// rows (<= kRowsTile) activation rows x blocks (<= kBlocksTile) packed blocks -> out[r][b * 16 + j], float32.
template <int64_t Rows, int64_t Blocks>
void tile(const int8_t* xq, const float* xs, const int32_t* xc, int64_t k_padded, int64_t groups, int64_t group,
          const uint8_t* packed, const float* scales, float* out) {
  const int64_t block_bytes = k_padded * kBlock, block_groups = groups * kBlock;
  __m512 sums[Rows][Blocks];
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t b = 0; b < Blocks; ++b) sums[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dots[Rows][Blocks];
    for (int64_t r = 0; r < Rows; ++r) {
      const __m512i start = _mm512_set1_epi32(xc[r * groups + g]);
      for (int64_t b = 0; b < Blocks; ++b) dots[r][b] = start;
    }
    for (int64_t k = g * group; k < (g + 1) * group; k += 4) {
      __m512i weights[Blocks];
      for (int64_t b = 0; b < Blocks; ++b) weights[b] = _mm512_loadu_si512(packed + b * block_bytes + k * kBlock);
      for (int64_t r = 0; r < Rows; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * k_padded + k, sizeof four);
        const __m512i x4 = _mm512_set1_epi32(four);
        for (int64_t b = 0; b < Blocks; ++b) dots[r][b] = _mm512_dpbusd_epi32(dots[r][b], weights[b], x4);
      }
    }
    for (int64_t b = 0; b < Blocks; ++b) {
      const __m512 weight_scales = _mm512_loadu_ps(scales + b * block_groups + g * kBlock);
      for (int64_t r = 0; r < Rows; ++r) {
        const __m512 scale = _mm512_mul_ps(weight_scales, _mm512_set1_ps(xs[r * groups + g]));
        sums[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][b]), scale, sums[r][b]);
      }
    }
  }
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t b = 0; b < Blocks; ++b) _mm512_storeu_ps(out + r * kBlocksTile * kBlock + b * kBlock, sums[r][b]);
}

template <int64_t Blocks>
void tile_rows(int64_t rows, const int8_t* xq, const float* xs, const int32_t* xc, int64_t k_padded, int64_t groups,
               int64_t group, const uint8_t* packed, const float* scales, float* out) {
  switch (rows) {
    case 4: return tile<4, Blocks>(xq, xs, xc, k_padded, groups, group, packed, scales, out);
    case 3: return tile<3, Blocks>(xq, xs, xc, k_padded, groups, group, packed, scales, out);
    case 2: return tile<2, Blocks>(xq, xs, xc, k_padded, groups, group, packed, scales, out);
    default: return tile<1, Blocks>(xq, xs, xc, k_padded, groups, group, packed, scales, out);
  }
}

}  // namespace

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && is_storage_type(x.scalar_type()) && x.dim() >= 1,
              "x must be a float32, bfloat16 or float16 CPU tensor (..., K)");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.size(2) == kBlock &&
                  packed.size(3) == 4 && packed.is_contiguous(), "packed must be contiguous uint8 (N/16, K/4, 16, 4)");
  const int64_t blocks = packed.size(0), k_padded = packed.size(1) * 4, groups = scales.size(1);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == blocks && scales.size(2) == kBlock && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat && groups > 0 && k_padded % groups == 0,
              "scales must be contiguous float32 (N/16, G, 16), G dividing the padded K");
  const int64_t group = k_padded / groups, k = x.size(-1);
  TORCH_CHECK(group % kBlock == 0, "the group size must be a multiple of 16");
  TORCH_CHECK(k <= k_padded && k_padded - k < group, "x's last dimension does not match the packed weight");
  TORCH_CHECK(out_features > 0 && out_features <= blocks * kBlock && out_features > (blocks - 1) * kBlock,
              "out_features does not match the packed weight");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->scalar_type() == x.scalar_type() &&
                    bias->is_contiguous(), "bias must be contiguous (out_features,) of x's dtype");
  }
  const auto input = x.contiguous();
  const int64_t rows = k ? input.numel() / k : 0;
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  auto out = torch::empty(sizes, x.options());
  std::vector<int8_t> xq(rows * k_padded);
  std::vector<float> xs(rows * groups);
  std::vector<int32_t> xc(rows * groups);
  ZOO_DISPATCH_FLOATS(x.scalar_type(), "int8_linear", [&] {
    const scalar_t* xp = input.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> wide(k_padded, 0.f);
      for (int64_t r = begin; r < end; ++r) {
        widen(xp + r * k, wide.data(), k);
        quantize_row(wide.data(), k_padded, group, xq.data() + r * k_padded, xs.data() + r * groups,
                     xc.data() + r * groups);
      }
    });
    const uint8_t* wp = packed.data_ptr<uint8_t>();
    const float* sp = scales.data_ptr<float>();
    const scalar_t* bp = bias ? bias->data_ptr<scalar_t>() : nullptr;
    scalar_t* yp = out.data_ptr<scalar_t>();
    const int64_t column_tiles = (blocks + kBlocksTile - 1) / kBlocksTile;
    const int64_t row_tiles = (rows + kRowsTile - 1) / kRowsTile;
    // Output columns outer, rows inner: each thread streams its share of the weights once.
    at::parallel_for(0, column_tiles * row_tiles, 1, [&](int64_t begin, int64_t end) {
      float result[kRowsTile * kBlocksTile * kBlock];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t block = task / row_tiles * kBlocksTile, row = task % row_tiles * kRowsTile;
        const int64_t tile_rows_count = std::min(kRowsTile, rows - row);
        const int64_t tile_blocks = std::min(kBlocksTile, blocks - block);
        const int8_t* xrow = xq.data() + row * k_padded;
        const float* srow = xs.data() + row * groups;
        const int32_t* crow = xc.data() + row * groups;
        const uint8_t* wblock = wp + block * k_padded * kBlock;
        const float* sblock = sp + block * groups * kBlock;
        if (tile_blocks == kBlocksTile)
          tile_rows<kBlocksTile>(tile_rows_count, xrow, srow, crow, k_padded, groups, group, wblock, sblock, result);
        else
          tile_rows<1>(tile_rows_count, xrow, srow, crow, k_padded, groups, group, wblock, sblock, result);
        const int64_t first = block * kBlock, last = std::min(out_features, (block + tile_blocks) * kBlock);
        for (int64_t r = 0; r < tile_rows_count; ++r) {
          scalar_t* y = yp + (row + r) * out_features;
          const float* values = result + r * kBlocksTile * kBlock;
          for (int64_t n = first; n < last; ++n)
            y[n] = from_float<scalar_t>(bp ? values[n - first] + to_float(bp[n]) : values[n - first]);
        }
      }
    });
  });
  return out;
}
#else
torch::Tensor int8_linear(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                          const c10::optional<torch::Tensor>&, int64_t) {
  TORCH_CHECK(false, "int8_linear needs AVX512-VNNI, which this build's CPU lacks");
}
#endif

}  // namespace zoo
