// bfloat16-weight linear layers with float32 activations on AVX512-BF16: y = x @ W^T (+ bias), y in float32.
//
// The GEMM of the bfloat16 precision policy (modelzoo/precision.py): the inputs are rounded to bfloat16 (as
// oneDNN's bfloat16 GEMM takes them), the products summed in float32, and the sums kept in float32 instead of
// being rounded to bfloat16 on the way out (PyTorch's bfloat16 GEMMs offer no float32 output on the CPU).
//
// Weights: W (N, K) bfloat16, packed by modelzoo/precision.py into blocks of 16 output rows:
//   packed (N/16, K/2, 16, 2) bfloat16: for each 2 inputs, 16 rows' 2 values side by side (one vdpbf16ps
//   operand). N is padded with zero rows to a multiple of 16 and K with a zero column to an even count.
// Each output sums the pairs of inputs in ascending order in one float32 lane (vdpbf16ps), whatever the other
// rows of the call: the result does not depend on the batch.
//
// Each input pair reaches the 4 products of its row one of two ways, chosen by timing both once per process
// (`broadcast_mode`): read from memory by each product ({1to16}, an embedded broadcast: no extra instruction,
// but 24 loads per 24 products), or broadcast into a register once (6 loads, 6 more instructions). Which is faster
// depends on the CPU's load ports and vector pipes; the sums are the same bits either way.
//
// bf16_silu_gate is the same GEMM for a SwiGLU MLP's gate | up projection, whose SiLU gate it applies to each
// register tile as it leaves (silu(gate) * up, silu_mul's bits): the tile pairs 32 features' gate and up blocks
// (modelzoo/precision.py packs them so), and the full gate | up output is never written.
#include "kernels.h"
#include "storage.h"
#include "timed_choice.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>

namespace zoo {

torch::Tensor bf16_gemm_output(const torch::Tensor& x, const torch::Tensor& packed,
                               const c10::optional<torch::Tensor>& bias, int64_t out_features, bool silu_gate) {
  constexpr int64_t kBlock = 16, kBlocksTile = 4;  // outputs per packed block; blocks per SiLU-gated tile
  TORCH_CHECK(x.device().is_cpu() && is_storage_type(x.scalar_type()) && x.dim() >= 1,
              "x must be a float32, bfloat16 or float16 CPU tensor (..., K)");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == kBlock &&
                  packed.size(3) == 2 && packed.is_contiguous(), "packed must be contiguous bfloat16 (N/16, K/2, 16, 2)");
  const int64_t blocks = packed.size(0), pairs = packed.size(1), k = x.size(-1);
  TORCH_CHECK(k == 2 * pairs || k == 2 * pairs - 1, "x's last dimension does not match the packed weight");
  if (silu_gate) {
    TORCH_CHECK(blocks % kBlocksTile == 0 && out_features * 2 == blocks * kBlock,
                "a SiLU-gated weight packs gate | up of out_features each, in tiles of 2 + 2 blocks");
  } else {
    TORCH_CHECK(out_features > 0 && out_features <= blocks * kBlock && out_features > (blocks - 1) * kBlock,
                "out_features does not match the packed weight");
  }
  if (bias) {
    TORCH_CHECK(!silu_gate && bias->dim() == 1 && bias->size(0) == out_features && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(), "bias must be contiguous float32 (out_features,), and none with a SiLU gate");
  }
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  return torch::empty(sizes, x.options().dtype(at::kFloat));
}

bool bf16_dot_available() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
namespace {

constexpr int64_t kBlock = 16;      // output rows per packed block (one register of float32 sums)
constexpr int64_t kRowsTile = 6;    // activation rows per register tile
constexpr int64_t kBlocksTile = 4;  // packed blocks per register tile: 6 x 4 float32 accumulators

enum class Broadcast { kEmbedded, kRegister };

// rows (<= kRowsTile) x blocks (<= kBlocksTile) -> out[r * kBlocksTile * 16 + b * 16 + j]. xb: the rows'
// inputs as bfloat16 pairs (one uint32 per pair), pairs per row; packed: the first block's weights.
template <int64_t Rows, int64_t Blocks, Broadcast Mode>
void tile(const uint32_t* xb, int64_t pairs, const uint16_t* packed, float* out) {
  const int64_t block_values = pairs * 2 * kBlock;
  __m512 sums[Rows][Blocks];
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t b = 0; b < Blocks; ++b) sums[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh weights[Blocks];
    for (int64_t b = 0; b < Blocks; ++b)
      weights[b] = (__m512bh)_mm512_loadu_si512(packed + b * block_values + p * 2 * kBlock);
    for (int64_t r = 0; r < Rows; ++r) {
      if constexpr (Mode == Broadcast::kRegister) {
        const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[r * pairs + p]));
        for (int64_t b = 0; b < Blocks; ++b) sums[r][b] = _mm512_dpbf16_ps(sums[r][b], pair, weights[b]);
      } else {  // the pair read straight into each product (compilers do not fold a broadcast into it)
        for (int64_t b = 0; b < Blocks; ++b)
          asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(sums[r][b]) : "v"(weights[b]), "m"(xb[r * pairs + p]));
      }
    }
  }
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t b = 0; b < Blocks; ++b) _mm512_storeu_ps(out + r * kBlocksTile * kBlock + b * kBlock, sums[r][b]);
}

template <int64_t Blocks, Broadcast Mode>
void tile_rows(int64_t rows, const uint32_t* xb, int64_t pairs, const uint16_t* packed, float* out) {
  switch (rows) {
    case 6: return tile<6, Blocks, Mode>(xb, pairs, packed, out);
    case 5: return tile<5, Blocks, Mode>(xb, pairs, packed, out);
    case 4: return tile<4, Blocks, Mode>(xb, pairs, packed, out);
    case 3: return tile<3, Blocks, Mode>(xb, pairs, packed, out);
    case 2: return tile<2, Blocks, Mode>(xb, pairs, packed, out);
    default: return tile<1, Blocks, Mode>(xb, pairs, packed, out);
  }
}

template <Broadcast Mode>
void tile_any(int64_t rows, int64_t blocks, const uint32_t* xb, int64_t pairs, const uint16_t* packed, float* out) {
  switch (blocks) {
    case 4: return tile_rows<4, Mode>(rows, xb, pairs, packed, out);
    case 3: return tile_rows<3, Mode>(rows, xb, pairs, packed, out);
    case 2: return tile_rows<2, Mode>(rows, xb, pairs, packed, out);
    default: return tile_rows<1, Mode>(rows, xb, pairs, packed, out);
  }
}

}  // namespace

namespace {

// y = x @ W^T (+ bias), or with `silu_gate` silu(gate) * up of the gate | up projection packed by
// modelzoo/precision.py with each tile's 4 blocks 2 gate blocks then the same 2 features' up blocks: (..., out_features).
torch::Tensor multiply(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                       int64_t out_features, bool silu_gate, Broadcast mode) {
  auto out = bf16_gemm_output(x, packed, bias, out_features, silu_gate);
  const int64_t blocks = packed.size(0), pairs = packed.size(1), k = x.size(-1);
  const auto input = x.contiguous();
  const int64_t rows = k ? input.numel() / k : 0;
  std::unique_ptr<uint32_t[]> xb(new uint32_t[rows * pairs]);  // every value written below
  ZOO_DISPATCH_FLOATS(x.scalar_type(), "bf16_linear", [&] {
    const scalar_t* xp = input.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) round_row(xp + r * k, k, pairs, xb.get() + r * pairs);
    });
  });
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  const int64_t column_tiles = (blocks + kBlocksTile - 1) / kBlocksTile;
  const int64_t row_tiles = (rows + kRowsTile - 1) / kRowsTile;
  constexpr int64_t kGated = kBlocksTile / 2 * kBlock;  // a gated tile's output features
  // Output columns outer, rows inner: each thread streams its share of the weights once.
  const bool in_register = mode == Broadcast::kRegister;
  at::parallel_for(0, column_tiles * row_tiles, 1, [&](int64_t begin, int64_t end) {
    float result[kRowsTile * kBlocksTile * kBlock];
    float silu[kGated];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task / row_tiles * kBlocksTile, row = task % row_tiles * kRowsTile;
      const int64_t tile_rows_count = std::min(kRowsTile, rows - row);
      const int64_t tile_blocks = std::min(kBlocksTile, blocks - block);
      const uint16_t* weights = wp + block * pairs * 2 * kBlock;
      if (in_register) {  // a branch, not a function pointer: each tile stays inlined, its sums in registers
        tile_any<Broadcast::kRegister>(tile_rows_count, tile_blocks, xb.get() + row * pairs, pairs, weights, result);
      } else {
        tile_any<Broadcast::kEmbedded>(tile_rows_count, tile_blocks, xb.get() + row * pairs, pairs, weights, result);
      }
      for (int64_t r = 0; r < tile_rows_count; ++r) {
        float* y = yp + (row + r) * out_features;
        const float* values = result + r * kBlocksTile * kBlock;
        if (silu_gate) {  // silu(gate) * up, as silu_mul computes it from the full output
          const int64_t first = block / 2 * kBlock;
          silu_row(values, silu, kGated);
          for (int64_t n = 0; n < kGated; ++n) y[first + n] = silu[n] * values[kGated + n];
          continue;
        }
        const int64_t first = block * kBlock, last = std::min(out_features, (block + tile_blocks) * kBlock);
        if (bp) {
          for (int64_t n = first; n < last; ++n) y[n] = values[n - first] + bp[n];
        } else {
          std::memcpy(y + first, values, (last - first) * sizeof(float));
        }
      }
    }
  });
  return out;
}

TimedChoice broadcast_choice;

// The faster broadcast on this CPU: the GEMM itself timed with each on a decode-sized call whose weights stay in the
// L2 cache (the steady state of a GEMM).
Broadcast broadcast_mode() {
  return static_cast<Broadcast>(broadcast_choice.get([] {
    constexpr int64_t kRows = 96, kIn = 576, kOut = 256;
    const auto x = torch::full({kRows, kIn}, 0.5f);
    const auto packed = torch::full({kOut / kBlock, kIn / 2, kBlock, 2}, 0.25f, torch::dtype(at::kBFloat16));
    return std::function<void(int)>([=](int mode) {
      multiply(x, packed, c10::nullopt, kOut, false, static_cast<Broadcast>(mode));
    });
  }, 2));
}

}  // namespace

torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features) {
  return multiply(x, packed, bias, out_features, false, broadcast_mode());
}

torch::Tensor bf16_silu_gate(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features) {
  return multiply(x, packed, c10::nullopt, out_features, true, broadcast_mode());
}

std::string bf16_gemm_broadcast(const std::string& use) {
  TORCH_CHECK(use.empty() || use == "embedded" || use == "register", "broadcast is embedded or register, not ", use);
  if (!use.empty())
    broadcast_choice.set(static_cast<int>(use == "register" ? Broadcast::kRegister : Broadcast::kEmbedded));
  return broadcast_mode() == Broadcast::kRegister ? "register" : "embedded";
}
#else
torch::Tensor bf16_linear(const torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&, int64_t) {
  TORCH_CHECK(false, "bf16_linear needs AVX512-BF16, which this build's CPU lacks");
}

torch::Tensor bf16_silu_gate(const torch::Tensor&, const torch::Tensor&, int64_t) {
  TORCH_CHECK(false, "bf16_silu_gate needs AVX512-BF16, which this build's CPU lacks");
}

std::string bf16_gemm_broadcast(const std::string&) {
  TORCH_CHECK(false, "bf16_gemm_broadcast needs AVX512-BF16, which this build's CPU lacks");
}
#endif

}  // namespace zoo
