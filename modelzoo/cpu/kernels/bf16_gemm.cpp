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
// bf16_linear_rows and bf16_silu_gate_rows read the weights where they lie instead (a checkpoint's memory map, parts
// side by side), in rows of K values: 16 rows' 32-bit words (their pairs) transposed in registers are the packed
// operands, so the same instructions run on the same values in the same order: the same bits.
//
// bf16_silu_gate is the same GEMM for a SwiGLU MLP's gate | up projection, whose SiLU gate it applies to each
// register tile as it leaves (silu(gate) * up, silu_mul's bits): the tile pairs 32 features' gate and up blocks
// (modelzoo/precision.py packs them so), and the full gate | up output is never written. With `rounded` it writes
// those outputs rounded to bfloat16, as the next bfloat16 GEMM rounds its inputs (half the bytes, the same bits
// there), and a bfloat16 input of even K is multiplied where it lies (its words are the pairs).
#include "greedy_picks.h"
#include "kernels.h"
#include "shared_tasks.h"
#include "storage.h"
#include "timed_choice.h"
#include "weight_rows.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

namespace zoo {

namespace {

void check_bias(const c10::optional<torch::Tensor>& bias, int64_t out_features, bool silu_gate) {
  if (bias) {
    TORCH_CHECK(!silu_gate && bias->dim() == 1 && bias->size(0) == out_features && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(), "bias must be contiguous float32 (out_features,), and none with a SiLU gate");
  }
}

// x's and the bias's checks, and the output (..., out_features): any bfloat16 GEMM's, whatever its weights; float32,
// or bfloat16 for SiLU-gated outputs `rounded` (bf16_silu_gate).
torch::Tensor checked_output(const torch::Tensor& x, const c10::optional<torch::Tensor>& bias, int64_t out_features,
                             bool silu_gate, bool rounded = false) {
  check_bias(bias, out_features, silu_gate);
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  return torch::empty(sizes, x.options().dtype(rounded && silu_gate ? at::kBFloat16 : at::kFloat));
}

void check_input(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && is_storage_type(x.scalar_type()) && x.dim() >= 1,
              "x must be a float32, bfloat16 or float16 CPU tensor (..., K)");
  TORCH_CHECK(x.size(-1) >= 1, "x has no inputs (K = 0): a weight multiplies at least one");
}

}  // namespace

void check_bf16_gemm(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     int64_t out_features, bool silu_gate) {
  constexpr int64_t kBlock = 16, kBlocksTile = 4;  // outputs per packed block; blocks per SiLU-gated tile
  check_input(x);
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
  check_bias(bias, out_features, silu_gate);
}

void check_residual(const torch::Tensor& residual, const torch::Tensor& x, int64_t out_features) {
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  TORCH_CHECK(residual.device().is_cpu() && residual.scalar_type() == at::kFloat && residual.is_contiguous() &&
                  residual.sizes() == at::IntArrayRef(sizes),
              "residual must be a contiguous float32 CPU tensor (..., out_features) for x (..., K)");
}

torch::Tensor bf16_gemm_output(const torch::Tensor& x, const torch::Tensor& packed,
                               const c10::optional<torch::Tensor>& bias, int64_t out_features, bool silu_gate,
                               bool rounded) {
  check_bf16_gemm(x, packed, bias, out_features, silu_gate);
  return checked_output(x, bias, out_features, silu_gate, rounded);
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
constexpr int64_t kRowsAhead = 128;  // values ahead of its reads that a weight read in rows is prefetched

enum class Broadcast { kEmbedded, kRegister };

// rows (<= kRowsTile) x blocks (<= kBlocksTile) -> out[r * stride + b * 16 + j]. xb: the rows'
// inputs as bfloat16 pairs (one uint32 per pair), pairs per row; packed: the first block's weights.
template <int64_t Rows, int64_t Blocks, Broadcast Mode>
void tile(const uint32_t* xb, int64_t pairs, const uint16_t* packed, float* out, int64_t stride) {
  // A weight has at least one input (pair): said to the compiler, which otherwise keeps a copy of the zeroed sums on
  // the stack for a loop that never runs (24 stores more a tile, and a third longer code).
  if (pairs < 1) __builtin_unreachable();
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
    for (int64_t b = 0; b < Blocks; ++b) _mm512_storeu_ps(out + r * stride + b * kBlock, sums[r][b]);
}

template <int64_t Blocks, Broadcast Mode>
void tile_rows(int64_t rows, const uint32_t* xb, int64_t pairs, const uint16_t* packed, float* out, int64_t stride) {
  switch (rows) {
    case 6: return tile<6, Blocks, Mode>(xb, pairs, packed, out, stride);
    case 5: return tile<5, Blocks, Mode>(xb, pairs, packed, out, stride);
    case 4: return tile<4, Blocks, Mode>(xb, pairs, packed, out, stride);
    case 3: return tile<3, Blocks, Mode>(xb, pairs, packed, out, stride);
    case 2: return tile<2, Blocks, Mode>(xb, pairs, packed, out, stride);
    default: return tile<1, Blocks, Mode>(xb, pairs, packed, out, stride);
  }
}

template <Broadcast Mode>
void tile_any(int64_t rows, int64_t blocks, const uint32_t* xb, int64_t pairs, const uint16_t* packed, float* out,
              int64_t stride) {
  switch (blocks) {
    case 4: return tile_rows<4, Mode>(rows, xb, pairs, packed, out, stride);
    case 3: return tile_rows<3, Mode>(rows, xb, pairs, packed, out, stride);
    case 2: return tile_rows<2, Mode>(rows, xb, pairs, packed, out, stride);
    default: return tile_rows<1, Mode>(rows, xb, pairs, packed, out, stride);
  }
}

// 16 weight rows read where they lie (bfloat16, k values each, row r at rows[r]; a row of zeros past a weight's last)
// as bf16_linear's packed operands: pair p of the 16 rows side by side, (pairs, 16, 2).
inline __m512i column_pair(const uint16_t* const rows[kBlock], int64_t p, int64_t k) {
  alignas(64) uint32_t words[kBlock];
  for (int64_t r = 0; r < kBlock; ++r)  // an odd k's last pair: its second value a zero, as packed
    words[r] = rows[r][2 * p] | (2 * p + 1 < k ? static_cast<uint32_t>(rows[r][2 * p + 1]) << 16 : 0u);
  return _mm512_load_si512(words);
}

// Pairs [p, p + 16) of the 16 rows as packed operands: v[j] pair p + j of the 16 rows side by side (their words
// transposed in registers), each row prefetched kRowsAhead values ahead.
__attribute__((always_inline)) inline void load_pairs(const uint16_t* const rows[kBlock], int64_t p,
                                                      __m512i v[kBlock]) {
#pragma GCC unroll 16
  for (int64_t r = 0; r < kBlock; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(rows[r] + 2 * p + kRowsAhead), _MM_HINT_T0);
    v[r] = _mm512_loadu_si512(rows[r] + 2 * p);
  }
  transpose16_words(v);
}

// The 16 rows' pairs into out (pairs, 16, 2), 16 pairs at a time.
void pack_rows(const uint16_t* const rows[kBlock], int64_t k, uint16_t* out) {
  const int64_t pairs = (k + 1) / 2, whole = k / 2;
  int64_t p = 0;
  for (; p + kBlock <= whole; p += kBlock) {
    __m512i v[kBlock];
    load_pairs(rows, p, v);
#pragma GCC unroll 16
    for (int64_t j = 0; j < kBlock; ++j) _mm512_storeu_si512(out + (p + j) * 2 * kBlock, v[j]);
  }
  for (; p < pairs; ++p) _mm512_storeu_si512(out + p * 2 * kBlock, column_pair(rows, p, k));
}

// Rows (<= kRowsTile) x the 16 outputs of rows[0 .. 16) over every pair, the rows' words transposed in registers
// as they are multiplied -> out[r * stride + j].
template <int64_t Rows>
void tile16(const uint16_t* const rows[kBlock], const uint32_t* xb, int64_t pairs, int64_t k, float* out,
            int64_t stride) {
  __m512 sums[Rows];
#pragma GCC unroll 8
  for (int64_t r = 0; r < Rows; ++r) sums[r] = _mm512_setzero_ps();
  const int64_t whole = k / 2;
  int64_t p = 0;
  for (; p + kBlock <= whole; p += kBlock) {
    __m512i v[kBlock];
    load_pairs(rows, p, v);
#pragma GCC unroll 16
    for (int64_t j = 0; j < kBlock; ++j)
#pragma GCC unroll 8
      for (int64_t r = 0; r < Rows; ++r)
        sums[r] = _mm512_dpbf16_ps(sums[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[r * pairs + p + j])),
                                   (__m512bh)v[j]);
  }
  for (; p < pairs; ++p) {
    const __m512bh column = (__m512bh)column_pair(rows, p, k);
    for (int64_t r = 0; r < Rows; ++r)
      sums[r] = _mm512_dpbf16_ps(sums[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[r * pairs + p])), column);
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < Rows; ++r) _mm512_storeu_ps(out + r * stride, sums[r]);
}

template <int64_t Rows = kRowsTile>
void tile16_any(int64_t rows, const uint16_t* const pointers[kBlock], const uint32_t* xb, int64_t pairs, int64_t k,
                float* out, int64_t stride) {
  if constexpr (Rows > 1) {
    if (rows < Rows) return tile16_any<Rows - 1>(rows, pointers, xb, pairs, k, out, stride);
  }
  tile16<Rows>(pointers, xb, pairs, k, out, stride);
}

// The weights as `multiply` reads them: packed (N/16, K/2, 16, 2), or blocks of rows where they lie (then `zeros`, a
// row of K zeros, stands in for the rows past a weight's last).
struct Weights {
  const uint16_t* packed;
  const RowBlock<uint16_t>* blocks;
  const uint16_t* zeros;

  void row_pointers(int64_t b, const uint16_t* rows[kBlock]) const { blocks[b].pointers(zeros, rows); }
};

// y = x @ W^T (+ bias), or with `silu_gate` silu(gate) * up of the gate | up projection whose tiles of 4 blocks are 2
// gate blocks then the same 2 features' up blocks (as modelzoo/precision.py packs it): (rows, out_features). Tasks:
// column tiles (4 blocks) x row tiles (6 rows) over packed weights. Weights in rows: a call of one row tile (decode)
// transposes them in registers as it multiplies them, a task a column tile; a longer one packs each column tile once
// into a scratch that all its row tiles read. Either way each output sums its pairs in ascending order from zero.
void multiply(const uint32_t* xb, int64_t rows, int64_t pairs, int64_t k, const Weights& weights, int64_t blocks,
              const float* bias, int64_t out_features, bool silu_gate, Broadcast mode, float* y,
              GreedyPicks* picks = nullptr, c10::BFloat16* gated16 = nullptr, bool accumulate = false) {
  const int64_t column_tiles = (blocks + kBlocksTile - 1) / kBlocksTile;
  const int64_t row_tiles = (rows + kRowsTile - 1) / kRowsTile;
  const int64_t block_values = pairs * 2 * kBlock;
  constexpr int64_t kGated = kBlocksTile / 2 * kBlock;  // a gated tile's output features
  // Plain outputs (no bias, SiLU gate, picks or residual) in whole blocks: each tile stores its sums straight into y
  // (row stride out_features), not into a `result` on the stack for emit to copy (row stride kBlocksTile * 16).
  const bool straight = !picks && !silu_gate && !accumulate && !bias && out_features % kBlock == 0;
  const int64_t stride = straight ? out_features : kBlocksTile * kBlock;
  const auto sums_at = [&](float* result, int64_t row, int64_t block) {
    return straight ? y + row * out_features + block * kBlock : result;
  };
  // The row tile from `row` of the column tile from `block`: its sums `result` to y (unless stored there already).
  const auto emit = [&](int64_t row, int64_t block, int64_t tile_blocks, const float* result) {
    if (straight) return;
    for (int64_t r = 0; r < std::min(kRowsTile, rows - row); ++r) {
      const float* values = result + r * kBlocksTile * kBlock;
      if (picks) {  // greedy: no output written, the row's pick among the tile's
        const int64_t first = block * kBlock, last = std::min(out_features, (block + tile_blocks) * kBlock);
        picks->keep(row + r, block / kBlocksTile, values, bias ? bias + first : nullptr, first, last - first);
        continue;
      }
      if (silu_gate) {  // silu(gate) * up, as silu_mul computes it from the full output
        const int64_t first = (row + r) * out_features + block / 2 * kBlock;
        if (gated16) {
          silu_times_up(values, values + kGated, kGated, gated16 + first);
        } else {
          silu_times_up(values, values + kGated, kGated, y + first);
        }
        continue;
      }
      float* out = y + (row + r) * out_features;
      const int64_t first = block * kBlock, last = std::min(out_features, (block + tile_blocks) * kBlock);
      write_outputs(out, values, bias, first, last, accumulate);
    }
  };
  // The lines of y (or gated16) written for the row tile from `row` of the column tile from `block` (by emit(), or
  // by the tile itself for straight outputs), fetched for writing before the tile's sums are computed: they have left
  // the CPU's caches since the norm or the previous GEMM wrote them, and each store would otherwise wait for its line
  // (a residual's lines are read as well).
  const auto prefetch_outputs = [&](int64_t row, int64_t block, int64_t tile_blocks) {
    if (picks) return;
    for (int64_t r = 0; r < std::min(kRowsTile, rows - row); ++r) {
      const char* first;
      int64_t bytes;
      if (silu_gate) {
        const int64_t offset = (row + r) * out_features + block / 2 * kBlock;
        first = gated16 ? reinterpret_cast<const char*>(gated16 + offset) : reinterpret_cast<const char*>(y + offset);
        bytes = kGated * (gated16 ? 2 : 4);
      } else {
        const int64_t begin = block * kBlock, end = std::min(out_features, (block + tile_blocks) * kBlock);
        first = reinterpret_cast<const char*>(y + (row + r) * out_features + begin);
        bytes = (end - begin) * 4;
      }
      for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(first + line, 1, 3);
    }
  };
  // A row tile over packed blocks (a branch, not a function pointer: each tile stays inlined, its sums in registers).
  const auto packed_tile = [&](int64_t row, int64_t block, int64_t tile_blocks, const uint16_t* packed,
                                float* result) {
    const int64_t count = std::min(kRowsTile, rows - row);
    float* out = sums_at(result, row, block);
    if (mode == Broadcast::kRegister) {
      tile_any<Broadcast::kRegister>(count, tile_blocks, xb + row * pairs, pairs, packed, out, stride);
    } else {
      tile_any<Broadcast::kEmbedded>(count, tile_blocks, xb + row * pairs, pairs, packed, out, stride);
    }
  };
  if (weights.packed) {  // output columns outer, rows inner: each thread streams its share of the weights once
    share_tasks(column_tiles * row_tiles, [&](int64_t begin, int64_t end) {
      float result[kRowsTile * kBlocksTile * kBlock];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t block = task / row_tiles * kBlocksTile, row = task % row_tiles * kRowsTile;
        const int64_t tile_blocks = std::min(kBlocksTile, blocks - block);
        prefetch_outputs(row, block, tile_blocks);
        packed_tile(row, block, tile_blocks, weights.packed + block * block_values, result);
        emit(row, block, tile_blocks, result);
      }
    });
    return;
  }
  share_tasks(column_tiles, [&](int64_t begin, int64_t end) {
    float result[kRowsTile * kBlocksTile * kBlock];
    std::unique_ptr<uint16_t[]> scratch(row_tiles > 1 ? new uint16_t[kBlocksTile * block_values] : nullptr);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task * kBlocksTile, tile_blocks = std::min(kBlocksTile, blocks - block);
      if (row_tiles == 1) prefetch_outputs(0, block, tile_blocks);
      for (int64_t b = 0; b < tile_blocks; ++b) {
        const uint16_t* pointers[kBlock];
        weights.row_pointers(block + b, pointers);
        if (row_tiles > 1) {
          pack_rows(pointers, k, scratch.get() + b * block_values);
        } else {
          tile16_any(rows, pointers, xb, pairs, k, sums_at(result, 0, block) + b * kBlock, stride);
        }
      }
      for (int64_t row = 0; row < rows; row += kRowsTile) {
        if (row_tiles > 1) {
          prefetch_outputs(row, block, tile_blocks);
          packed_tile(row, block, tile_blocks, scratch.get(), result);
        }
        emit(row, block, tile_blocks, result);
      }
    }
  });
}

// A GEMM's inputs as bfloat16 pairs (rows, pairs): `data`, in `owned` where they had to be rounded.
struct Pairs {
  std::unique_ptr<uint32_t[]> owned;
  const uint32_t* data;
};

// x (..., K) contiguous float32, bfloat16 or float16 -> its rows' inputs rounded to bfloat16 pairs (rows, pairs), the
// last pair of an odd K completed by a zero; a bfloat16 x of even K (4-byte aligned) is its own pairs, read in place.
Pairs rounded_pairs(const torch::Tensor& input, int64_t rows, int64_t k, int64_t pairs) {
  const bool aligned = reinterpret_cast<uintptr_t>(input.data_ptr()) % alignof(uint32_t) == 0;
  if (input.scalar_type() == at::kBFloat16 && k == 2 * pairs && aligned) {
    return {nullptr, reinterpret_cast<const uint32_t*>(input.data_ptr<at::BFloat16>())};
  }
  std::unique_ptr<uint32_t[]> xb(new uint32_t[rows * pairs]);  // every value written below
  ZOO_DISPATCH_FLOATS(input.scalar_type(), "bf16_linear", [&] {
    const scalar_t* xp = input.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) round_row(xp + r * k, k, pairs, xb.get() + r * pairs);
    });
  });
  const uint32_t* data = xb.get();
  return {std::move(xb), data};
}

// What a bfloat16 GEMM call leaves: its outputs in a new tensor (float32, or bfloat16 SiLU-gated outputs with
// `rounded`), each row's pick among them (`greedy`: int64 (...), the outputs never written), or its outputs added to
// `residual` (float32 (..., out_features)) in place.
struct Target {
  bool rounded = false;
  bool greedy = false;
  torch::Tensor* residual = nullptr;
};

// The call's output for x (..., K), `target`'s kind, checked (the bias too).
torch::Tensor target_output(const torch::Tensor& x, const c10::optional<torch::Tensor>& bias, int64_t out_features,
                            bool silu_gate, const Target& target) {
  if (target.residual) {
    check_bias(bias, out_features, silu_gate);
    check_residual(*target.residual, x, out_features);
    return *target.residual;
  }
  if (target.greedy) {
    check_bias(bias, out_features, silu_gate);
    return torch::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong));  // (...)
  }
  return checked_output(x, bias, out_features, silu_gate, target.rounded);
}

// multiply() of x's rows into `out`, target_output's for `target`.
void multiply_into(const torch::Tensor& x, int64_t k, int64_t pairs, const Weights& weights, int64_t blocks,
                   const c10::optional<torch::Tensor>& bias, int64_t out_features, bool silu_gate, Broadcast mode,
                   const Target& target, torch::Tensor& out) {
  const auto input = x.contiguous();
  const int64_t rows = k ? input.numel() / k : 0;
  if (rows == 0) return;
  const auto xb = rounded_pairs(input, rows, k, pairs);
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  if (target.greedy) {
    GreedyPicks picks(rows, (blocks + kBlocksTile - 1) / kBlocksTile);
    multiply(xb.data, rows, pairs, k, weights, blocks, b, out_features, false, mode, nullptr, &picks);
    picks.write(out.data_ptr<int64_t>());
    return;
  }
  const bool rounded = out.scalar_type() == at::kBFloat16;
  multiply(xb.data, rows, pairs, k, weights, blocks, b, out_features, silu_gate, mode,
           rounded ? nullptr : out.data_ptr<float>(), nullptr, rounded ? out.data_ptr<c10::BFloat16>() : nullptr,
           target.residual != nullptr);
}

// bf16_linear, bf16_silu_gate or bf16_greedy over packed weights, leaving `target`.
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias, int64_t out_features, bool silu_gate,
                            Broadcast mode, const Target& target = {}) {
  check_bf16_gemm(x, packed, bias, out_features, silu_gate);
  auto out = target_output(x, bias, out_features, silu_gate, target);
  const Weights weights{reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), nullptr, nullptr};
  multiply_into(x, x.size(-1), packed.size(1), weights, packed.size(0), bias, out_features, silu_gate, mode, target,
                out);
  return out;
}

// The blocks of 16 rows of parts (N_i, K) bfloat16 with unit column stride, part after part (with `silu_gate`: parts
// gate and up, each tile's 2 gate blocks then its 2 up blocks), checked; out_features: the GEMM's outputs.
std::vector<RowBlock<uint16_t>> row_blocks(const std::vector<torch::Tensor>& parts, int64_t k, bool silu_gate,
                                           int64_t& out_features) {
  out_features = checked_rows(parts, k, {at::kBFloat16}, "bfloat16");
  std::vector<RowBlock<uint16_t>> blocks;
  if (!silu_gate) {
    for (const auto& part : parts) append_row_blocks(part, blocks);
    return blocks;
  }
  constexpr int64_t kHalfTile = kBlocksTile / 2;  // blocks of gate (then of up) rows per tile
  TORCH_CHECK(parts.size() == 2 && parts[0].sizes() == parts[1].sizes() && parts[0].size(0) % (kHalfTile * kBlock) == 0,
              "a SiLU-gated weight is two parts, gate and up, of the same shape (I, K), I a multiple of 32");
  out_features /= 2;
  for (int64_t row = 0; row < out_features; row += kHalfTile * kBlock) {
    append_row_blocks(parts[0], blocks, row, kHalfTile);
    append_row_blocks(parts[1], blocks, row, kHalfTile);
  }
  return blocks;
}

// bf16_linear (bf16_silu_gate with `silu_gate`: parts gate and up; bf16_greedy) over weights read where they lie:
// parts (N_i, K) bfloat16 with unit column stride, side by side; leaving `target`.
torch::Tensor rows_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                          const c10::optional<torch::Tensor>& bias, bool silu_gate, Broadcast mode,
                          const Target& target = {}) {
  check_input(x);
  const int64_t k = x.size(-1), pairs = (k + 1) / 2;
  int64_t out_features;
  const auto blocks = row_blocks(parts, k, silu_gate, out_features);
  auto out = target_output(x, bias, out_features, silu_gate, target);
  const std::vector<uint16_t> zeros(k + 1);
  const Weights weights{nullptr, blocks.data(), zeros.data()};
  multiply_into(x, k, pairs, weights, blocks.size(), bias, out_features, silu_gate, mode, target, out);
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
      packed_linear(x, packed, c10::nullopt, kOut, false, static_cast<Broadcast>(mode));
    });
  }, 2));
}

}  // namespace

torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features) {
  return packed_linear(x, packed, bias, out_features, false, broadcast_mode());
}

torch::Tensor bf16_silu_gate(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features, bool rounded) {
  return packed_linear(x, packed, c10::nullopt, out_features, true, broadcast_mode(), {rounded});
}

torch::Tensor bf16_linear_add_(torch::Tensor& residual, const torch::Tensor& x, const torch::Tensor& packed,
                               const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  return packed_linear(x, packed, bias, out_features, false, broadcast_mode(), {false, false, &residual});
}

torch::Tensor bf16_greedy(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features) {
  return packed_linear(x, packed, bias, out_features, false, broadcast_mode(), {false, true});
}

torch::Tensor bf16_linear_rows(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                               const c10::optional<torch::Tensor>& bias) {
  return rows_linear(x, parts, bias, false, broadcast_mode());
}

torch::Tensor bf16_silu_gate_rows(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& up,
                                  bool rounded) {
  return rows_linear(x, {gate, up}, c10::nullopt, true, broadcast_mode(), {rounded});
}

torch::Tensor bf16_greedy_rows(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                               const c10::optional<torch::Tensor>& bias) {
  return rows_linear(x, parts, bias, false, broadcast_mode(), {false, true});
}

torch::Tensor bf16_linear_rows_add_(torch::Tensor& residual, const torch::Tensor& x,
                                    const std::vector<torch::Tensor>& parts, const c10::optional<torch::Tensor>& bias) {
  return rows_linear(x, parts, bias, false, broadcast_mode(), {false, false, &residual});
}

torch::Tensor pack_bf16_rows(const std::vector<torch::Tensor>& parts, bool silu_gate, const torch::Tensor& out) {
  TORCH_CHECK(!parts.empty() && parts[0].dim() == 2, "parts must hold at least one weight (N_i, K)");
  const int64_t k = parts[0].size(1), pairs = (k + 1) / 2;
  int64_t out_features;
  const auto blocks = row_blocks(parts, k, silu_gate, out_features);
  const int64_t count = blocks.size();
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kBFloat16 && out.is_contiguous() &&
                  out.sizes() == at::IntArrayRef({count, pairs, kBlock, 2}),
              "out must be a contiguous bfloat16 CPU tensor (ceil(N/16), ceil(K/2), 16, 2)");
  const std::vector<uint16_t> zeros(k + 1);
  const Weights weights{nullptr, blocks.data(), zeros.data()};
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint16_t* rows[kBlock];
      weights.row_pointers(b, rows);
      pack_rows(rows, k, dst + b * pairs * 2 * kBlock);
    }
  });
  return out;
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

torch::Tensor bf16_silu_gate(const torch::Tensor&, const torch::Tensor&, int64_t, bool) {
  TORCH_CHECK(false, "bf16_silu_gate needs AVX512-BF16, which this build's CPU lacks");
}

torch::Tensor bf16_greedy(const torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&, int64_t) {
  TORCH_CHECK(false, "bf16_greedy needs AVX512-BF16, which this build's CPU lacks");
}

torch::Tensor bf16_linear_rows(const torch::Tensor&, const std::vector<torch::Tensor>&,
                               const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "bf16_linear_rows needs AVX512-BF16, which this build's CPU lacks");
}

torch::Tensor bf16_silu_gate_rows(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, bool) {
  TORCH_CHECK(false, "bf16_silu_gate_rows needs AVX512-BF16, which this build's CPU lacks");
}

torch::Tensor bf16_greedy_rows(const torch::Tensor&, const std::vector<torch::Tensor>&,
                               const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "bf16_greedy_rows needs AVX512-BF16, which this build's CPU lacks");
}

torch::Tensor bf16_linear_add_(torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                               const c10::optional<torch::Tensor>&, int64_t) {
  TORCH_CHECK(false, "bf16_linear_add_ needs AVX512-BF16, which this build's CPU lacks");
}

torch::Tensor bf16_linear_rows_add_(torch::Tensor&, const torch::Tensor&, const std::vector<torch::Tensor>&,
                                    const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "bf16_linear_rows_add_ needs AVX512-BF16, which this build's CPU lacks");
}

torch::Tensor pack_bf16_rows(const std::vector<torch::Tensor>&, bool, const torch::Tensor&) {
  TORCH_CHECK(false, "pack_bf16_rows needs AVX512-BF16, which this build's CPU lacks");
}

std::string bf16_gemm_broadcast(const std::string&) {
  TORCH_CHECK(false, "bf16_gemm_broadcast needs AVX512-BF16, which this build's CPU lacks");
}
#endif

}  // namespace zoo
