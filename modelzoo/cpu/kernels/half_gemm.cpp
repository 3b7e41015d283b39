// 16-bit-weight linear layers in float32 arithmetic: y = x @ W^T (+ bias), W bfloat16 or float16, x and y float32.
// (float32 weights pack and multiply the same way, read as they are: the float32 GEMM candidate `packed` of
// modelzoo/cpu/gemm.py, batch-invariant by construction.)
//
// The GEMM of the precision policy on a CPU without native multiplies for the job's 16-bit dtype
// (modelzoo/precision.py): the weights stay in their own 2 bytes, are widened to float32 as they are read (into
// registers, or into a small float32 panel that up to 48 rows share: `multiply`), and multiply the float32 inputs as
// they are (no rounding of the inputs): the arithmetic of a float32 GEMM over the 16-bit values, at half the bytes of
// weights read per decode step.
//
// Weights: W (N, K), packed by pack_half_weight (below) into blocks of 16 output rows:
//   packed (N/16, K, 16) bfloat16 or float16: for each input, 16 rows' values side by side.
// N is padded with zero rows to a multiple of 16. Each output is one float32 lane summing x[k] * w[k] with one fused
// multiply-add per input, in ascending k, from zero: whatever the other rows of the call, and whichever code path
// runs, an output's bits are the same (batch-invariant, and the AVX2 and AVX-512 paths agree bit for bit).
//
// Two code paths: AVX2 + FMA (+ F16C for float16; every AVX2 CPU has it) with tiles of 6 rows x 16 outputs, and,
// where the build has AVX-512, tiles of 6 rows x 64 outputs. The faster on this CPU is timed once per process
// (`half_gemm_path`); tests set each.
#include "kernels.h"
#include "storage.h"
#include "timed_choice.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>

namespace zoo {
namespace {

constexpr int64_t kBlock = 16;    // output rows per packed block
constexpr int64_t kRowsTile = 6;  // activation rows per register tile

enum class Path { kAvx2, kAvx512 };

constexpr bool avx512_built() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// Calls f with std::integral_constant n, for n in 1 .. N (a tile's row or block count as a compile-time constant).
template <int64_t N, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (N > 1) {
    if (n >= N) return f(std::integral_constant<int64_t, N>{});
    return with_count<N - 1>(n, std::forward<F>(f));
  } else {
    f(std::integral_constant<int64_t, 1>{});
  }
}

// AVX2 tile: Rows rows x one block of 16 outputs (two 8-wide halves), inputs [0, kc) of x (the first row; rows k
// apart). weights(i, h): half h of input i's 16 weights as float32. sums: Rows x 16 floats at `stride`, the running
// sums, loaded unless `first` and stored back.
template <int64_t Rows, typename Weights>
inline void tile_avx2(const float* x, int64_t k, int64_t kc, const Weights& weights, float* sums, int64_t stride,
                      bool first) {
  __m256 acc[Rows][2];
#pragma GCC unroll 8
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t h = 0; h < 2; ++h)
      acc[r][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + r * stride + 8 * h);
  for (int64_t i = 0; i < kc; ++i) {
    const __m256 low = weights(i, 0), high = weights(i, 1);
#pragma GCC unroll 8
    for (int64_t r = 0; r < Rows; ++r) {
      const __m256 input = _mm256_broadcast_ss(x + r * k + i);
      acc[r][0] = _mm256_fmadd_ps(input, low, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(input, high, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t h = 0; h < 2; ++h) _mm256_storeu_ps(sums + r * stride + 8 * h, acc[r][h]);
}

#if defined(__AVX512F__)
template <typename T>
inline __m512 widen16(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm512_loadu_ps(p);
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  return _mm512_cvtph_ps(bits);
}

// AVX-512 tile: Rows rows x Blocks blocks of 16 outputs; weights(i, b): block b's 16 weights of input i as float32;
// otherwise as tile_avx2.
template <int64_t Rows, int64_t Blocks, typename Weights>
inline void tile_avx512(const float* x, int64_t k, int64_t kc, const Weights& weights, float* sums, int64_t stride,
                        bool first) {
  __m512 acc[Rows][Blocks];
#pragma GCC unroll 8
  for (int64_t r = 0; r < Rows; ++r)
#pragma GCC unroll 4
    for (int64_t b = 0; b < Blocks; ++b)
      acc[r][b] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + r * stride + b * kBlock);
  for (int64_t i = 0; i < kc; ++i) {
    __m512 w[Blocks];
#pragma GCC unroll 4
    for (int64_t b = 0; b < Blocks; ++b) w[b] = weights(i, b);
#pragma GCC unroll 8
    for (int64_t r = 0; r < Rows; ++r) {
      const __m512 input = _mm512_set1_ps(x[r * k + i]);
#pragma GCC unroll 4
      for (int64_t b = 0; b < Blocks; ++b) acc[r][b] = _mm512_fmadd_ps(input, w[b], acc[r][b]);
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < Rows; ++r)
#pragma GCC unroll 4
    for (int64_t b = 0; b < Blocks; ++b) _mm512_storeu_ps(sums + r * stride + b * kBlock, acc[r][b]);
}
#endif

// A tile of `rows` (<= 6) x `blocks` (<= 4; one at a time on the AVX2 path) over inputs [0, kc): with
// `packed` the blocks' packed weights (block_values apart), widened in registers as they are multiplied; else
// `panel` (kc, blocks * 16), widened before.
template <typename T>
void tile(Path path, int64_t rows, int64_t blocks, const float* x, int64_t k, int64_t kc, const T* packed,
          int64_t block_values, const float* panel, float* sums, int64_t stride, bool first) {
#if defined(__AVX512F__)
  if (path == Path::kAvx512) {
    return with_count<kRowsTile>(rows, [&](auto r) {
      with_count<4>(blocks, [&](auto b) {
        constexpr int64_t kBlocks = decltype(b)::value;
        if (packed) {
          tile_avx512<decltype(r)::value, kBlocks>(x, k, kc, [=](int64_t i, int64_t block) {
            return widen16<T>(packed + block * block_values + i * kBlock);
          }, sums, stride, first);
        } else {
          tile_avx512<decltype(r)::value, kBlocks>(x, k, kc, [=](int64_t i, int64_t block) {
            return _mm512_loadu_ps(panel + (i * kBlocks + block) * kBlock);
          }, sums, stride, first);
        }
      });
    });
  }
#endif
  with_count<kRowsTile>(rows, [&](auto r) {
    for (int64_t b = 0; b < blocks; ++b) {  // the tile's rows of x stay in the L1 cache from block to block
      if (packed) {
        tile_avx2<decltype(r)::value>(x, k, kc, [=](int64_t i, int64_t h) {
          return load8(packed + b * block_values + i * kBlock + 8 * h);  // widened to float32
        }, sums + b * kBlock, stride, first);
      } else {
        tile_avx2<decltype(r)::value>(x, k, kc, [=](int64_t i, int64_t h) {
          return _mm256_loadu_ps(panel + (i * blocks + b) * kBlock + 8 * h);
        }, sums + b * kBlock, stride, first);
      }
    }
  });
}

// inputs [k0, k0 + kc) of `blocks` packed blocks (the first at w, block_values apart) widened into panel (kc, blocks
// * 16) float32.
template <typename T>
void widen_panel(const T* w, int64_t blocks, int64_t block_values, int64_t k0, int64_t kc, float* panel) {
  for (int64_t i = 0; i < kc; ++i)
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t half = 0; half < 2; ++half)
        _mm256_storeu_ps(panel + (i * blocks + b) * kBlock + half * 8,
                         load8(w + b * block_values + (k0 + i) * kBlock + half * 8));
}

// y (rows, out_features) = x (rows, k) @ W^T (+ bias) over the packed weight. Tasks: a column tile (4 blocks; 1 on
// the AVX2 path for a call of one row tile, whose weights are all its work) times a run of up to kRowsRun rows,
// column tiles outer: each thread streams its share of the weights once, and a row tile's inputs, read once from
// memory, serve the 64 outputs of its column tile. A task of one row tile widens each weight as it multiplies it
// (decode with few rows); a longer one widens kPanelInputs inputs of its column tile at a time into a float32 panel
// that all its row tiles share (float32 weights are read in place, as many inputs at a time), keeping its running
// sums in `sums` between panels. Either way each output's fused multiply-adds run in ascending k from zero: the
// same bits.
constexpr int64_t kRowsRun = 8 * kRowsTile;
constexpr int64_t kPanelInputs = 128;

template <typename T>
void multiply(const float* x, int64_t rows, int64_t k, const T* w, int64_t blocks, const float* bias,
              int64_t out_features, float* y, Path path) {
  const int64_t blocks_tile = path == Path::kAvx512 || rows > kRowsTile ? 4 : 1;
  const int64_t column_tiles = (blocks + blocks_tile - 1) / blocks_tile;
  const int64_t row_runs = (rows + kRowsRun - 1) / kRowsRun;
  const int64_t block_values = k * kBlock;
  at::parallel_for(0, column_tiles * row_runs, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kRowsRun * 4 * kBlock];
    alignas(64) float panel[kPanelInputs * 4 * kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task / row_runs * blocks_tile, run = task % row_runs * kRowsRun;
      const int64_t run_rows = std::min(kRowsRun, rows - run), tile_blocks = std::min(blocks_tile, blocks - block);
      const int64_t stride = blocks_tile * kBlock;  // of sums
      const float* xr = x + run * k;
      const T* wb = w + block * block_values;
      if (run_rows <= kRowsTile) {
        tile<T>(path, run_rows, tile_blocks, xr, k, k, wb, block_values, nullptr, sums, stride, true);
      } else {
        constexpr bool widen = !std::is_same_v<T, float>;  // float32 weights are read in place
        for (int64_t k0 = 0; k0 < k; k0 += kPanelInputs) {
          const int64_t kc = std::min(kPanelInputs, k - k0);
          if constexpr (widen) widen_panel<T>(wb, tile_blocks, block_values, k0, kc, panel);
          for (int64_t row = 0; row < run_rows; row += kRowsTile)
            tile<T>(path, std::min(kRowsTile, run_rows - row), tile_blocks, xr + row * k + k0, k, kc,
                    widen ? nullptr : wb + k0 * kBlock, block_values, panel, sums + row * stride, stride, k0 == 0);
        }
      }
      const int64_t first = block * kBlock, last = std::min(out_features, (block + tile_blocks) * kBlock);
      for (int64_t r = 0; r < run_rows; ++r) {
        float* out = y + (run + r) * out_features;
        const float* values = sums + r * stride;
        if (bias) {
          for (int64_t n = first; n < last; ++n) out[n] = values[n - first] + bias[n];
        } else {
          std::memcpy(out + first, values, (last - first) * sizeof(float));
        }
      }
    }
  });
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     int64_t out_features, Path path) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1,
              "x must be a float32 CPU tensor (..., K)");
  TORCH_CHECK(packed.dim() == 3 && is_storage_type(packed.scalar_type()) && packed.size(2) == kBlock &&
                  packed.is_contiguous(),
              "packed must be contiguous bfloat16, float16 or float32 (N/16, K, 16)");
  const int64_t blocks = packed.size(0), k = x.size(-1);
  TORCH_CHECK(packed.size(1) == k, "x's last dimension does not match the packed weight");
  TORCH_CHECK(out_features > 0 && out_features <= blocks * kBlock && out_features > (blocks - 1) * kBlock,
              "out_features does not match the packed weight");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(), "bias must be contiguous float32 (out_features,)");
  }
  const auto input = x.contiguous();
  const int64_t rows = k ? input.numel() / k : 0;
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  auto out = torch::empty(sizes, x.options());
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  ZOO_DISPATCH_FLOATS(packed.scalar_type(), "half_linear", [&] {
    multiply<scalar_t>(input.data_ptr<float>(), rows, k, packed.data_ptr<scalar_t>(), blocks, b, out_features,
                       out.data_ptr<float>(), path);
  });
  return out;
}

TimedChoice path_choice;

// The faster path on this CPU: the GEMM timed with each on a decode-sized call whose weights stay in the L2 cache
// (the steady state of a GEMM).
Path path_in_use() {
  return static_cast<Path>(path_choice.get([] {
    constexpr int64_t kRows = 96, kIn = 576, kOut = 256;
    const auto x = torch::full({kRows, kIn}, 0.5f);
    const auto packed = torch::full({kOut / kBlock, kIn, kBlock}, 0.25f, torch::dtype(at::kBFloat16));
    return std::function<void(int)>([=](int path) { linear(x, packed, c10::nullopt, kOut, static_cast<Path>(path)); });
  }, avx512_built() ? 2 : 1));
}

}  // namespace

torch::Tensor half_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features) {
  return linear(x, packed, bias, out_features, path_in_use());
}

namespace {

void check_half_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && is_storage_type(weight.scalar_type()),
              "weight must be a bfloat16, float16 or float32 CPU tensor (N, K)");
}

// One block: `rows` (<= 16) rows of k values -> (k, 16), zero rows padding it.
template <typename E>
void pack_block(const E* in, int64_t rows, int64_t k, E* out) {
  if (rows < kBlock) {
    std::memset(out, 0, k * kBlock * sizeof(E));
    for (int64_t i = 0; i < k; ++i)
      for (int64_t r = 0; r < rows; ++r) out[i * kBlock + r] = in[r * k + i];
    return;
  }
  for (int64_t i = 0; i < k; ++i)  // 16 rows read side by side, each output line written whole
    for (int64_t r = 0; r < kBlock; ++r) out[i * kBlock + r] = in[r * k + i];
}

}  // namespace

torch::Tensor pack_half_weight(const torch::Tensor& weight, const c10::optional<torch::Tensor>& out) {
  check_half_weight(weight);
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + kBlock - 1) / kBlock;
  if (out) {
    TORCH_CHECK(out->device().is_cpu() && out->scalar_type() == w.scalar_type() && out->is_contiguous() &&
                    out->sizes() == at::IntArrayRef({blocks, k, kBlock}),
                "out must be a contiguous CPU tensor of the weight's dtype, shaped (ceil(N/16), K, 16)");
  }
  auto packed = out ? *out : torch::empty({blocks, k, kBlock}, w.options());
  ZOO_DISPATCH_FLOATS(w.scalar_type(), "pack_half_weight", [&] {
    const auto* src = w.data_ptr<scalar_t>();
    auto* dst = packed.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        pack_block(src + b * kBlock * k, std::min(kBlock, n - b * kBlock), k, dst + b * k * kBlock);
    });
  });
  return packed;
}

std::string half_gemm_path(const std::string& use) {
  TORCH_CHECK(use.empty() || use == "avx2" || (use == "avx512" && avx512_built()),
              "path is avx2", avx512_built() ? " or avx512" : " (this build has no AVX-512)", ", not ", use);
  if (!use.empty()) path_choice.set(static_cast<int>(use == "avx512" ? Path::kAvx512 : Path::kAvx2));
  return path_in_use() == Path::kAvx512 ? "avx512" : "avx2";
}

}  // namespace zoo
