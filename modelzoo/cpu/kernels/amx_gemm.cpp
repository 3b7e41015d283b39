// bf16_linear's GEMM on Intel AMX tiles: the same packed bfloat16 weights, the same inputs rounded to bfloat16,
// float32 sums and outputs; tdpbf16ps on 16 x 16 output tiles instead of vdpbf16ps on 16-wide registers.
//
// Weights: bf16_linear's packed (N/16, K/2, 16, 2) bfloat16 (modelzoo/cpu/precision.py), read as it is: 16 input
// pairs of one block of 16 outputs are 16 consecutive rows of 64 bytes, one AMX B tile in the layout tdpbf16ps takes.
// Inputs: each row rounded to bfloat16 into a buffer padded with zeros to whole tasks of 32 rows and whole tiles of
// 16 pairs: an A tile is 16 rows x 16 pairs. A weight whose K/2 is not a multiple of 16 has its last B tile copied,
// zero-padded.
//
// Each output is one float32 accumulator summing its row's input pairs in ascending order (tile by tile, and within
// a tile as tdpbf16ps does), whatever the other rows of the call: the result does not depend on the batch. The zero
// pairs padding K add nothing.
//
// Tiles (palette 1, every tile 16 rows x 64 bytes): C tiles 0-3 (output rows half r, block b -> 2r + b), A tiles 4-5
// (the two halves of 32 rows), B tiles 6-7 (two blocks): each step loads 4 tiles for 4 tile products, and, for the
// first row tile of a group, prefetches the weights a few steps on (a prefetch past a tensor's end is harmless: it
// never faults); the later row tiles find the weights in L2 and load them with the streaming hint, which keeps the
// row tile's inputs in L1. A task of whole tiles with no bias or gate stores its C tiles straight into the output;
// the others through a scratch, whose epilogue (the SiLU gate's exp and division, a bias, a residual's addition, the
// picks) runs a row at a time between the steps of the next column tile's products, so the vector units work while
// the AMX unit multiplies, not after it.
//
// amx_bf16_silu_gate is bf16_silu_gate's counterpart: the gate | up weight packed in tiles of 2 gate + 2 up blocks,
// silu(gate) * up written with silu_mul's bits, or `rounded` to bfloat16 as the next GEMM rounds its inputs.
// amx_bf16_linear_add_ adds its outputs into a residual as it writes them (as residual + amx_bf16_linear would).
// amx_bf16_greedy writes no outputs, only each row's pick (greedy_picks.h).
#include "amx_tiles.h"
#include "cpu_caches.h"
#include "greedy_picks.h"
#include "kernels.h"
#include "storage.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace zoo {

#if defined(__AMX_TILE__)
// Linux (5.16 and later) hands out the tiles' state only to a process that asks for it once.
bool amx_tiles_granted() {
  static const bool granted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}
#else
bool amx_tiles_granted() { return false; }
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
namespace {

constexpr int64_t kBlock = 16;     // outputs per packed block: the columns of a C tile
constexpr int64_t kHalfRows = 16;  // rows of an A or C tile
constexpr int64_t kChunk = 16;     // input pairs per A or B tile (64 bytes a row)
constexpr int64_t kTileRows = 2 * kHalfRows;  // rows per task
constexpr int64_t kTileBlocks = 4;  // blocks per task: 2 tile products of 2 blocks (a SiLU gate's 2 gate + 2 up)
constexpr int64_t kAhead = 4;       // weight tiles prefetched ahead of the one multiplied

struct FreeMemory {
  void operator()(void* p) const { std::free(p); }
};
// n values of T starting on a cache line: each 64-byte row of a tile then lies in one line, not two.
template <typename T>
std::unique_ptr<T[], FreeMemory> line_aligned(int64_t n) {
  const size_t bytes = std::max<size_t>(64, (n * sizeof(T) + 63) / 64 * 64);
  T* memory = static_cast<T*>(std::aligned_alloc(64, bytes));
  TORCH_CHECK(memory, "out of memory: ", bytes, " bytes for a GEMM's rounded inputs");
  return std::unique_ptr<T[], FreeMemory>(memory);
}

// Every thread configures its own tiles before using them.
void configure_tiles() {
  load_tile_config({16, 16, 16, 16, 16, 16, 16, 16}, {64, 64, 64, 64, 64, 64, 64, 64});
}

// C (Halves * 16 rows, Blocks * 16 outputs) of the rows at `a` (stride a_stride bytes, `chunks` tiles of pairs) times
// the blocks at b[0], b[1] (the last chunk from tail[] where the weight's pairs end mid-tile) -> out (out_stride
// floats a row). Fetch: prefetch the weights kAhead tiles on. between(): called after each step's tile products, for
// vector work that runs while the AMX unit multiplies.
template <int Halves, int Blocks, bool Fetch, typename Between>
void tile_product(const uint16_t* a, int64_t a_stride, int64_t chunks, const uint16_t* const* b,
                  const uint16_t* const* tail, float* out, int64_t out_stride, Between& between) {
  _tile_zero(0);
  if constexpr (Blocks == 2) _tile_zero(1);
  if constexpr (Halves == 2) _tile_zero(2);
  if constexpr (Halves == 2 && Blocks == 2) _tile_zero(3);
  const auto* second_half = reinterpret_cast<const char*>(a) + kHalfRows * a_stride;
  const auto step = [&](int64_t c, const uint16_t* b0, const uint16_t* b1) {  // input pairs [16 c, 16 c + 16)
    _tile_loadd(4, a + c * 2 * kChunk, a_stride);
    if constexpr (Halves == 2) _tile_loadd(5, second_half + c * 4 * kChunk, a_stride);
    for (int line = 0; Fetch && line < 16; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(b0 + kAhead * kChunk * 2 * kBlock) + 64 * line, _MM_HINT_T0);
      if constexpr (Blocks == 2)
        _mm_prefetch(reinterpret_cast<const char*>(b1 + kAhead * kChunk * 2 * kBlock) + 64 * line, _MM_HINT_T0);
    }
    if constexpr (Fetch) {  // from memory, into L1 as the prefetches brought them
      _tile_loadd(6, b0, 64);
      if constexpr (Blocks == 2) _tile_loadd(7, b1, 64);
    } else {  // from L2, where the next row tile finds them again: loaded without pushing the inputs out of L1
      _tile_stream_loadd(6, b0, 64);
      if constexpr (Blocks == 2) _tile_stream_loadd(7, b1, 64);
    }
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (Blocks == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (Halves == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (Halves == 2 && Blocks == 2) _tile_dpbf16ps(3, 5, 7);
    between();
  };
  const int64_t whole = tail ? chunks - 1 : chunks;
  for (int64_t c = 0; c < whole; ++c) step(c, b[0] + c * kChunk * 2 * kBlock, b[1] + c * kChunk * 2 * kBlock);
  if (tail) step(whole, tail[0], tail[1]);
  const int64_t stride = out_stride * sizeof(float);
  _tile_stored(0, out, stride);
  if constexpr (Blocks == 2) _tile_stored(1, out + kBlock, stride);
  if constexpr (Halves == 2) _tile_stored(2, out + kHalfRows * out_stride, stride);
  if constexpr (Halves == 2 && Blocks == 2) _tile_stored(3, out + kHalfRows * out_stride + kBlock, stride);
}

template <bool Fetch, typename Between>
void tile_fetching(int64_t halves, int64_t blocks, const uint16_t* a, int64_t a_stride, int64_t chunks,
                   const uint16_t* const* b, const uint16_t* const* tail, float* out, int64_t out_stride,
                   Between& between) {
  if (halves == 2) {
    return blocks == 2 ? tile_product<2, 2, Fetch>(a, a_stride, chunks, b, tail, out, out_stride, between)
                       : tile_product<2, 1, Fetch>(a, a_stride, chunks, b, tail, out, out_stride, between);
  }
  return blocks == 2 ? tile_product<1, 2, Fetch>(a, a_stride, chunks, b, tail, out, out_stride, between)
                     : tile_product<1, 1, Fetch>(a, a_stride, chunks, b, tail, out, out_stride, between);
}

// fetch: prefetch the weights (a thread's first rows of a group meet them in memory, the later ones in its L2 cache).
template <typename Between>
void tile_any(bool fetch, int64_t halves, int64_t blocks, const uint16_t* a, int64_t a_stride, int64_t chunks,
              const uint16_t* const* b, const uint16_t* const* tail, float* out, int64_t out_stride,
              Between& between) {
  return fetch ? tile_fetching<true>(halves, blocks, a, a_stride, chunks, b, tail, out, out_stride, between)
               : tile_fetching<false>(halves, blocks, a, a_stride, chunks, b, tail, out, out_stride, between);
}

// What multiply() writes: x @ W^T (+ bias), silu(gate) * up, each row's first largest output's index, or the
// residual plus x @ W^T (+ bias).
enum class Epilogue { kOutputs, kSiluGate, kGreedy, kAdd };

// rounded: a SiLU gate's outputs written as bfloat16; residual: kAdd's.
torch::Tensor multiply(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                       int64_t out_features, Epilogue epilogue, bool rounded = false,
                       torch::Tensor* residual = nullptr) {
  TORCH_CHECK(amx_tiles_granted(), "Linux did not grant this process the AMX tiles (arch_prctl)");
  const bool silu_gate = epilogue == Epilogue::kSiluGate, greedy = epilogue == Epilogue::kGreedy;
  const bool add = epilogue == Epilogue::kAdd;
  check_bf16_gemm(x, packed, bias, out_features, silu_gate);
  if (add) check_residual(*residual, x, out_features);
  // (..., out_features) float32 outputs (the residual's), or (...) int64 picks
  auto out = add      ? *residual
             : greedy ? torch::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong))
                      : bf16_gemm_output(x, packed, bias, out_features, silu_gate, rounded);
  const int64_t blocks = packed.size(0), pairs = packed.size(1), k = x.size(-1);
  const auto input = x.contiguous();
  const int64_t rows = k ? input.numel() / k : 0;
  if (rows == 0) return out;
  // The rows as bfloat16, zero-padded to whole tiles: (row_tiles * 32, chunks * 16 pairs).
  const int64_t chunks = (pairs + kChunk - 1) / kChunk, padded_pairs = chunks * kChunk;
  const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows;
  const auto xb = line_aligned<uint32_t>(row_tiles * kTileRows * padded_pairs);
  ZOO_DISPATCH_FLOATS(x.scalar_type(), "amx_bf16_linear", [&] {
    const scalar_t* xp = input.data_ptr<scalar_t>();
    at::parallel_for(0, row_tiles * kTileRows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        uint32_t* row = xb.get() + r * padded_pairs;
        if (r < rows) {
          round_row(xp + r * k, k, pairs, row);
          std::fill(row + pairs, row + padded_pairs, 0u);
        } else {
          std::fill(row, row + padded_pairs, 0u);
        }
      }
    });
  });
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = greedy || rounded ? nullptr : out.data_ptr<float>();
  c10::BFloat16* gated16 = rounded ? out.data_ptr<c10::BFloat16>() : nullptr;
  const int64_t column_tiles = (blocks + kTileBlocks - 1) / kTileBlocks;
  std::unique_ptr<GreedyPicks> picks(greedy ? new GreedyPicks(rows, column_tiles) : nullptr);
  const int64_t tail_pairs = pairs % kChunk;
  // Each block's last pairs, zero-padded to a whole tile, where the weight's pairs end mid-tile: copied once a call
  // (every row tile multiplies them).
  constexpr int64_t kTileValues = kChunk * 2 * kBlock;
  const auto tail_tiles = line_aligned<uint16_t>(tail_pairs ? blocks * kTileValues : 0);
  if (tail_pairs) {
    at::parallel_for(0, blocks, 64, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        uint16_t* copy = tail_tiles.get() + b * kTileValues;
        const uint16_t* last = wp + (b * pairs + pairs - tail_pairs) * 2 * kBlock;
        std::memcpy(copy, last, tail_pairs * 2 * kBlock * sizeof(uint16_t));
        std::fill(copy + tail_pairs * 2 * kBlock, copy + kTileValues, uint16_t{0});
      }
    });
  }
  const int64_t a_stride = padded_pairs * 4;  // bytes per row of xb
  constexpr int64_t kGated = kTileBlocks / 2 * kBlock;  // a gated tile's output features
  // Rows in groups whose inputs fill half the L2 cache (as Linux reports it), then output columns in groups whose
  // weights fill a quarter of it, then the row group's rows, each multiplied by its column group's columns in turn: a
  // thread streams its share of the weights from memory once per row group, the weights and the inputs stay in its L2
  // cache, and a row tile's inputs in L1 while it meets its column group (the weights' tiles alone come from L2).
  const int64_t group_tiles = std::max<int64_t>(1, l2_cache_bytes() / 2 / (kTileRows * a_stride));
  const int64_t whole_groups = row_tiles / group_tiles;
  const int64_t tile_weights = kTileBlocks * pairs * 2 * kBlock * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t quarter_l2 = std::max<int64_t>(1, l2_cache_bytes() / 4);
  // Column groups: as many as the weights need, and enough for four tasks a thread.
  const int64_t needed = std::max((column_tiles * tile_weights + quarter_l2 - 1) / quarter_l2,
                                  (4 * at::get_num_threads() + row_tiles - 1) / row_tiles);
  const int64_t group_columns = (column_tiles + std::min(needed, column_tiles) - 1) / std::min(needed, column_tiles);
  const int64_t column_groups = (column_tiles + group_columns - 1) / group_columns;
  at::parallel_for(0, column_groups * row_tiles, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float result[2][2][kTileRows * 2 * kBlock];  // two buffers of two tile products, 32 rows x 32 outputs
    // A column tile's sums waiting in result[buffer] for their epilogue, applied a row at a time between the steps of
    // the next column tile's products: the vector units run it while the AMX unit multiplies.
    struct Waiting {
      int64_t row = 0, block = 0, tile_blocks = 0, rows = 0, done = 0;  // rows: those to finish (none if stored)
      int buffer = 0;
    } waiting;
    // The epilogue of the waiting tile's next row.
    const auto finish_row = [&] {
      const int64_t r = waiting.done++, row = waiting.row, block = waiting.block, tile_blocks = waiting.tile_blocks;
      const auto& sums = result[waiting.buffer];
      if (greedy) {  // the task's outputs [first, last): its two halves' 32 each, side by side in `values`
        const int64_t first = block * kBlock, last = std::min(out_features, (block + tile_blocks) * kBlock);
        alignas(64) float values[2 * 2 * kBlock];
        for (int64_t half = 0; half * 2 < tile_blocks; ++half)
          std::memcpy(values + half * 2 * kBlock, sums[half] + r * 2 * kBlock, 2 * kBlock * sizeof(float));
        picks->keep(row + r, block / kTileBlocks, values, bp ? bp + first : nullptr, first, last - first);
        return;
      }
      if (silu_gate) {  // silu(gate) * up, as silu_mul computes it from the full output
        const float* gate = sums[0] + r * 2 * kBlock;
        const float* up = sums[1] + r * 2 * kBlock;
        const int64_t first = (row + r) * out_features + block / 2 * kBlock;
        if (rounded) {
          silu_times_up(gate, up, kGated, gated16 + first);
        } else {
          silu_times_up(gate, up, kGated, yp + first);
        }
        return;
      }
      float* y = yp + (row + r) * out_features;
      for (int64_t half = 0; half * 2 < tile_blocks; ++half) {
        const float* values = sums[half] + r * 2 * kBlock;
        const int64_t first = (block + 2 * half) * kBlock;
        write_outputs(y, values, bp, first, std::min(out_features, first + 2 * kBlock), add);
      }
    };
    const auto between_steps = [&] {
      if (waiting.done < waiting.rows) finish_row();
    };
    // Rows [row, row + 32) times the column tile of blocks [block, block + 4); its epilogue then waits for the next
    // tile's steps (the waiting one's finished first). fetch: prefetch the weights (the first rows of a row group to
    // meet them find them in memory, the later ones in L2).
    const auto column_tile = [&](int64_t row, int64_t block, bool fetch) {
      const int64_t tile_rows_count = std::min(kTileRows, rows - row);
      const int64_t tile_blocks = std::min(kTileBlocks, blocks - block);
      const int64_t halves = tile_rows_count > kHalfRows ? 2 : 1;
      const uint16_t* a = reinterpret_cast<const uint16_t*>(xb.get() + row * padded_pairs);
      // The C tiles go straight to the output where they hold only its values (whole tiles of rows and outputs,
      // nothing to add): else through `result`.
      const bool direct = epilogue == Epilogue::kOutputs && !bp && tile_rows_count == halves * kHalfRows &&
                          (block + tile_blocks) * kBlock <= out_features;
      const int buffer = waiting.buffer ^ 1;
      for (int64_t half = 0; half * 2 < tile_blocks; ++half) {
        const int64_t first = block + 2 * half, count = std::min<int64_t>(2, tile_blocks - 2 * half);
        const uint16_t* b[2] = {wp + first * pairs * 2 * kBlock, wp + (first + count - 1) * pairs * 2 * kBlock};
        const uint16_t* tail[2] = {tail_tiles.get() + first * kTileValues,
                                   tail_tiles.get() + (first + count - 1) * kTileValues};
        const uint16_t* const* tails = tail_pairs ? tail : nullptr;
        if (direct) {
          tile_any(fetch, halves, count, a, a_stride, chunks, b, tails, yp + row * out_features + first * kBlock,
                   out_features, between_steps);
        } else {
          tile_any(fetch, halves, count, a, a_stride, chunks, b, tails, result[buffer][half], 2 * kBlock,
                   between_steps);
        }
      }
      while (waiting.done < waiting.rows) finish_row();
      waiting = {row, block, tile_blocks, direct ? 0 : tile_rows_count, 0, buffer};
    };
    for (int64_t task = begin; task < end; ++task) {
      const int64_t group = std::min(task / (group_tiles * column_groups), whole_groups);
      const int64_t in_group = task - group * group_tiles * column_groups;  // the task's place in its row group
      const int64_t group_size = std::min(group_tiles, row_tiles - group * group_tiles);  // row tiles in the group
      const int64_t first_tile = in_group / group_size * group_columns;
      const int64_t row = (group * group_tiles + in_group % group_size) * kTileRows;
      const bool fetch = task == begin || in_group % group_size == 0;
      for (int64_t tile = first_tile; tile < std::min(column_tiles, first_tile + group_columns); ++tile)
        column_tile(row, tile * kTileBlocks, fetch);
    }
    while (waiting.done < waiting.rows) finish_row();
    _tile_release();
  });
  if (greedy) picks->write(out.data_ptr<int64_t>());
  return out;
}

}  // namespace

bool amx_bf16_available() { return amx_tiles_granted(); }

torch::Tensor amx_bf16_linear(const torch::Tensor& x, const torch::Tensor& packed,
                              const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  return multiply(x, packed, bias, out_features, Epilogue::kOutputs);
}

torch::Tensor amx_bf16_greedy(const torch::Tensor& x, const torch::Tensor& packed,
                              const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  return multiply(x, packed, bias, out_features, Epilogue::kGreedy);
}

torch::Tensor amx_bf16_linear_add_(torch::Tensor& residual, const torch::Tensor& x, const torch::Tensor& packed,
                                   const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  return multiply(x, packed, bias, out_features, Epilogue::kAdd, false, &residual);
}

torch::Tensor amx_bf16_silu_gate(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                                 bool rounded) {
  return multiply(x, packed, c10::nullopt, out_features, Epilogue::kSiluGate, rounded);
}
#else
bool amx_bf16_available() { return false; }

torch::Tensor amx_bf16_linear(const torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&, int64_t) {
  TORCH_CHECK(false, "amx_bf16_linear needs AMX-BF16, which this build's CPU lacks");
}

torch::Tensor amx_bf16_greedy(const torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&,
                              int64_t) {
  TORCH_CHECK(false, "amx_bf16_greedy needs AMX-BF16, which this build's CPU lacks");
}

torch::Tensor amx_bf16_linear_add_(torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                   const c10::optional<torch::Tensor>&, int64_t) {
  TORCH_CHECK(false, "amx_bf16_linear_add_ needs AMX-BF16, which this build's CPU lacks");
}

torch::Tensor amx_bf16_silu_gate(const torch::Tensor&, const torch::Tensor&, int64_t, bool) {
  TORCH_CHECK(false, "amx_bf16_silu_gate needs AMX-BF16, which this build's CPU lacks");
}
#endif

}  // namespace zoo
