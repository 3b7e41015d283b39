// int8-weight linear layers on AVX512-VNNI: y = x @ W^T (+ bias) with W stored as group-wise int8 and the
// activations quantized on the fly to 8 or 16 bits.
//
// Weights: q (N, K) int8 with one float32 scale per output row and group of `group` inputs
// (w ~= q * scale), packed by modelzoo/int8_compute.py into blocks of 16 output rows:
//   packed (N/16, K/4, 16, 4) uint8 = q + 128: for each 4 inputs, 16 rows' 4 bytes side by side (one VNNI
//   operand);  scales (N/16, G, 16) float32.
// N and K are padded with zeros (q = 0) to multiples of 16 and of `group`; G = K / group.
//
// Activations are quantized per row and per chunk of `chunk` inputs (the weight group, or for a group over
// 256 inputs the largest multiple of 16 up to 256 dividing it): s = absmax / qmax, xq = round(x / s)
// (nearest even; 0 for an all-zero chunk), qmax = 127 (8 bits) or 32767 (16 bits). Then, for each row m and
// output n,
//   y[m, n] = sum over chunks c, in order, of float(sum_k q * xq) * (ws[n, group of c] * xs[m, c])
// with exact integer sums and one float32 fused multiply-add per chunk. The sums multiply the unsigned
// q + 128 by xq, starting from c = -128 * sum(xq), which takes the +128 back out:
//   8 bits:  vpdpbusd, 4 inputs per 32-bit lane;
//   16 bits: q + 128 zero-extended to 16 bits (even and odd bytes apart), vpdpwssd, 2 inputs per lane, xq
//            stored in the order x0 x2 x1 x3 within each 4 inputs to match. The activations' error is about
//            2^-16 of the chunk's absmax: the result is the weight-only int8 product to float32 rounding.
// A row's arithmetic is the same whatever the other rows of the call, so the result does not depend on the batch.
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
constexpr int64_t kMaxChunk = 256;  // inputs per int32 sum at most: 256 * 255 * 32767 < 2^31

// 8-bit activations: vpdpbusd on 4 inputs per lane, the weights' +128 corrected per chunk.
struct Int8Activations {
  using type = int8_t;
  static constexpr int32_t kMax = 127;
  static void store(const __m512i& q, type* out) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(q));
  }
  // dots[r] += the 4 inputs at k of row r times `weights` (16 rows' 4 bytes), for Rows rows.
  template <int64_t Rows>
  static void multiply(__m512i (&dots)[Rows], const __m512i& weights, const type* xq, int64_t stride, int64_t k) {
    for (int64_t r = 0; r < Rows; ++r) {
      int32_t four;
      std::memcpy(&four, xq + r * stride + k, sizeof four);
      dots[r] = _mm512_dpbusd_epi32(dots[r], weights, _mm512_set1_epi32(four));
    }
  }
};

// 16-bit activations: the 4 weight bytes (q + 128) zero-extended into two pairs of int16, two vpdpwssd per
// 4 inputs, the +128 corrected per chunk.
struct Int16Activations {
  using type = int16_t;
  static constexpr int32_t kMax = 32767;
  static void store(const __m512i& q, type* out) {  // x0 x1 x2 x3 -> x0 x2 x1 x3 in each 4
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        _mm512_cvtsepi32_epi16(_mm512_shuffle_epi32(q, static_cast<_MM_PERM_ENUM>(0xD8))));
  }
  template <int64_t Rows>
  static void multiply(__m512i (&dots)[Rows], const __m512i& weights, const type* xq, int64_t stride, int64_t k) {
    const __m512i even = _mm512_and_si512(weights, _mm512_set1_epi16(0xFF));  // bytes 0 and 2 of each 4, as int16
    const __m512i odd = _mm512_srli_epi16(weights, 8);                         // bytes 1 and 3
    for (int64_t r = 0; r < Rows; ++r) {
      int32_t pairs[2];
      std::memcpy(pairs, xq + r * stride + k, sizeof pairs);  // (x0, x2), (x1, x3)
      dots[r] = _mm512_dpwssd_epi32(dots[r], even, _mm512_set1_epi32(pairs[0]));
      dots[r] = _mm512_dpwssd_epi32(dots[r], odd, _mm512_set1_epi32(pairs[1]));
    }
  }
};

// One activation row of k values (widened to float32, zero-padded to k_padded) -> xq, the chunk scales
// and the chunks' corrections.
template <typename Policy>
void quantize_row(const float* x, int64_t k_padded, int64_t chunk, typename Policy::type* out, float* scales,
                  int32_t* corrections) {
  const __m512i low = _mm512_set1_epi32(-Policy::kMax), high = _mm512_set1_epi32(Policy::kMax);
  for (int64_t start = 0; start < k_padded; start += chunk) {
    __m512 peak = _mm512_setzero_ps();
    for (int64_t i = start; i < start + chunk; i += kBlock)
      peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    const float absmax = _mm512_reduce_max_ps(peak);
    const __m512 multiplier = _mm512_set1_ps(absmax > 0.f ? Policy::kMax / absmax : 0.f);
    scales[start / chunk] = absmax / Policy::kMax;
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = start; i < start + chunk; i += kBlock) {
      const __m512i q = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i),
                                                                                           multiplier)), low), high);
      sum = _mm512_add_epi32(sum, q);
      Policy::store(q, out + i);
    }
    corrections[start / chunk] = -128 * _mm512_reduce_add_epi32(sum);  // takes the weights' +128 back out
  }
}

struct Shape {
  int64_t k_padded, group, chunk;  // inputs (padded), per weight scale, per activation scale
};

// rows (<= kRowsTile) activation rows x blocks (<= kBlocksTile) packed blocks -> out[r][b * 16 + j], float32.
template <typename Policy, int64_t Rows, int64_t Blocks>
void tile(const typename Policy::type* xq, const float* xs, const int32_t* xc, const Shape& shape,
          const uint8_t* packed, const float* scales, float* out) {
  const int64_t chunks = shape.k_padded / shape.chunk, block_bytes = shape.k_padded * kBlock;
  const int64_t block_groups = shape.k_padded / shape.group * kBlock;
  __m512 sums[Rows][Blocks];
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t b = 0; b < Blocks; ++b) sums[r][b] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i dots[Blocks][Rows];
    for (int64_t r = 0; r < Rows; ++r) {
      const __m512i start = _mm512_set1_epi32(xc[r * chunks + c]);
      for (int64_t b = 0; b < Blocks; ++b) dots[b][r] = start;
    }
    for (int64_t k = c * shape.chunk; k < (c + 1) * shape.chunk; k += 4)
      for (int64_t b = 0; b < Blocks; ++b)
        Policy::template multiply<Rows>(dots[b], _mm512_loadu_si512(packed + b * block_bytes + k * kBlock), xq,
                                        shape.k_padded, k);
    const int64_t g = c * shape.chunk / shape.group;
    for (int64_t b = 0; b < Blocks; ++b) {
      const __m512 weight_scales = _mm512_loadu_ps(scales + b * block_groups + g * kBlock);
      for (int64_t r = 0; r < Rows; ++r) {
        const __m512 scale = _mm512_mul_ps(weight_scales, _mm512_set1_ps(xs[r * chunks + c]));
        sums[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[b][r]), scale, sums[r][b]);
      }
    }
  }
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t b = 0; b < Blocks; ++b) _mm512_storeu_ps(out + r * kBlocksTile * kBlock + b * kBlock, sums[r][b]);
}

template <typename Policy, int64_t Blocks>
void tile_rows(int64_t rows, const typename Policy::type* xq, const float* xs, const int32_t* xc, const Shape& shape,
               const uint8_t* packed, const float* scales, float* out) {
  switch (rows) {
    case 4: return tile<Policy, 4, Blocks>(xq, xs, xc, shape, packed, scales, out);
    case 3: return tile<Policy, 3, Blocks>(xq, xs, xc, shape, packed, scales, out);
    case 2: return tile<Policy, 2, Blocks>(xq, xs, xc, shape, packed, scales, out);
    default: return tile<Policy, 1, Blocks>(xq, xs, xc, shape, packed, scales, out);
  }
}

// The activation chunk: the group, or for a group over kMaxChunk inputs the largest multiple of 16 dividing it.
int64_t chunk_size(int64_t group) {
  int64_t chunk = std::min(group, kMaxChunk);
  while (group % chunk) chunk -= kBlock;
  return chunk;
}

template <typename Policy, typename scalar_t>
void multiply(const scalar_t* xp, int64_t rows, int64_t k, const Shape& shape, const uint8_t* wp, const float* sp,
              const scalar_t* bp, int64_t blocks, int64_t out_features, scalar_t* yp) {
  const int64_t chunks = shape.k_padded / shape.chunk;
  std::vector<typename Policy::type> xq(rows * shape.k_padded);
  std::vector<float> xs(rows * chunks);
  std::vector<int32_t> xc(rows * chunks);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(shape.k_padded, 0.f);
    for (int64_t r = begin; r < end; ++r) {
      widen(xp + r * k, wide.data(), k);
      quantize_row<Policy>(wide.data(), shape.k_padded, shape.chunk, xq.data() + r * shape.k_padded,
                           xs.data() + r * chunks, xc.data() + r * chunks);
    }
  });
  const int64_t groups = shape.k_padded / shape.group;
  const int64_t column_tiles = (blocks + kBlocksTile - 1) / kBlocksTile;
  const int64_t row_tiles = (rows + kRowsTile - 1) / kRowsTile;
  // Output columns outer, rows inner: each thread streams its share of the weights once.
  at::parallel_for(0, column_tiles * row_tiles, 1, [&](int64_t begin, int64_t end) {
    float result[kRowsTile * kBlocksTile * kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task / row_tiles * kBlocksTile, row = task % row_tiles * kRowsTile;
      const int64_t tile_rows_count = std::min(kRowsTile, rows - row);
      const int64_t tile_blocks = std::min(kBlocksTile, blocks - block);
      const auto* xrow = xq.data() + row * shape.k_padded;
      const float* srow = xs.data() + row * chunks;
      const int32_t* crow = xc.data() + row * chunks;
      const uint8_t* wblock = wp + block * shape.k_padded * kBlock;
      const float* sblock = sp + block * groups * kBlock;
      if (tile_blocks == kBlocksTile)
        tile_rows<Policy, kBlocksTile>(tile_rows_count, xrow, srow, crow, shape, wblock, sblock, result);
      else
        tile_rows<Policy, 1>(tile_rows_count, xrow, srow, crow, shape, wblock, sblock, result);
      const int64_t first = block * kBlock, last = std::min(out_features, (block + tile_blocks) * kBlock);
      for (int64_t r = 0; r < tile_rows_count; ++r) {
        scalar_t* y = yp + (row + r) * out_features;
        const float* values = result + r * kBlocksTile * kBlock;
        for (int64_t n = first; n < last; ++n)
          y[n] = from_float<scalar_t>(bp ? values[n - first] + to_float(bp[n]) : values[n - first]);
      }
    }
  });
}

}  // namespace

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& bias, int64_t out_features, int64_t activation_bits) {
  TORCH_CHECK(x.device().is_cpu() && is_storage_type(x.scalar_type()) && x.dim() >= 1,
              "x must be a float32, bfloat16 or float16 CPU tensor (..., K)");
  TORCH_CHECK(activation_bits == 8 || activation_bits == 16, "activation_bits must be 8 or 16");
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
  // 8 bits: one activation scale per weight group (whole rows per channel: no int32 overflow at 8 x 8 bits).
  const Shape shape{k_padded, group, activation_bits == 8 ? group : chunk_size(group)};
  ZOO_DISPATCH_FLOATS(x.scalar_type(), "int8_linear", [&] {
    const scalar_t* bp = bias ? bias->data_ptr<scalar_t>() : nullptr;
    if (activation_bits == 8)
      multiply<Int8Activations>(input.data_ptr<scalar_t>(), rows, k, shape, packed.data_ptr<uint8_t>(),
                                scales.data_ptr<float>(), bp, blocks, out_features, out.data_ptr<scalar_t>());
    else
      multiply<Int16Activations>(input.data_ptr<scalar_t>(), rows, k, shape, packed.data_ptr<uint8_t>(),
                                 scales.data_ptr<float>(), bp, blocks, out_features, out.data_ptr<scalar_t>());
  });
  return out;
}
#else
torch::Tensor int8_linear(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                          const c10::optional<torch::Tensor>&, int64_t, int64_t) {
  TORCH_CHECK(false, "int8_linear needs AVX512-VNNI, which this build's CPU lacks");
}
#endif

}  // namespace zoo
