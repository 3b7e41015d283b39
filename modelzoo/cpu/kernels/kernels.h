// The C++ CPU kernels of zoo-infer, for float32, bfloat16 and float16 tensors (storage.h), computing in
// float32; bound to Python in bindings.cpp.
#pragma once

#include <torch/extension.h>

#include <cstring>

namespace zoo {

// cached_attention.cpp: stores the forward's keys and values in the cache, attends over it.
torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& new_keys, const torch::Tensor& new_values,
                               const torch::Tensor& keys, const torch::Tensor& values, const torch::Tensor& slots,
                               const torch::Tensor& starts, const torch::Tensor& ends, double scale,
                               const c10::optional<torch::Tensor>& cos, const c10::optional<torch::Tensor>& sin);
// cached_attention of one fused projection qkv (B, T, (H + 2 Hkv) D), q | k | v, read where it lies: (B, T, H D).
torch::Tensor cached_attention_qkv(const torch::Tensor& qkv, int64_t heads, const torch::Tensor& keys,
                                   const torch::Tensor& values, const torch::Tensor& slots, const torch::Tensor& starts,
                                   const torch::Tensor& ends, double scale, const c10::optional<torch::Tensor>& cos,
                                   const c10::optional<torch::Tensor>& sin);
// decoder_layer.cpp: a Llama-family layer under the bfloat16 policy as one call of the kernels above and below;
// returns x, added into in place.
torch::Tensor bf16_decoder_layer(torch::Tensor& x, const torch::Tensor& input_norm, double input_eps,
                                 const torch::Tensor& qkv_packed, const c10::optional<torch::Tensor>& qkv_bias,
                                 int64_t qkv_features, int64_t heads, const torch::Tensor& keys,
                                 const torch::Tensor& values, const torch::Tensor& slots, const torch::Tensor& starts,
                                 const torch::Tensor& ends, double scale, const torch::Tensor& cos,
                                 const torch::Tensor& sin, const torch::Tensor& o_packed,
                                 const c10::optional<torch::Tensor>& o_bias, const torch::Tensor& post_norm,
                                 double post_eps, const torch::Tensor& gate_up_packed, int64_t intermediate,
                                 const torch::Tensor& down_packed, const c10::optional<torch::Tensor>& down_bias,
                                 const std::vector<bool>& on_amx);
// Keys a tile of 6 query heads scores at once on this CPU (the faster way, timed at the first call; `use` sets it).
int64_t attention_keys_at_once(int64_t use);

// decoder_ops.cpp: the fused small ops, bitwise equal to their PyTorch spelling.
// With `rounded` (float32 x alone): the outputs rounded to bfloat16, for a GEMM that rounds its inputs so anyway.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool rounded);
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& weight, double eps,
                            bool rounded);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
// out[0, n) = silu(gate[0, n)), as ATen computes it (silu_mul's and bf16_linear's SiLU gate).
void silu_row(const float* gate, float* out, int64_t n);
// out[0, n) = silu(gate) * up, silu_row's values times up, each product rounded once to O (float, or c10::BFloat16
// to the nearest even), in registers: a GEMM's SiLU gate as its tiles leave.
template <typename O>
void silu_times_up(const float* gate, const float* up, int64_t n, O* out);
// int8_gemm.cpp: group-wise int8 weights times activations quantized per row and chunk to 8 bits (AVX512-VNNI or AMX)
// or 16 bits (AVX2, AVX512-VNNI or AMX).
bool int8_vnni_available();
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& bias, int64_t out_features, int64_t activation_bits);
// The code paths int8_linear has here ("avx2", then "vnni" and "amx" where built and granted), and which it takes for
// a call of `rows` rows: the fastest here, timed once for calls of up to 4 rows and once for longer ones (on weights in
// groups of `group` inputs, or the first call's); `use` sets it for both. Every path gives the same bits.
std::vector<std::string> int8_gemm_paths();
std::string int8_gemm_path(const std::string& use, int64_t group, int64_t rows);
// bf16_gemm.cpp: bfloat16 weights times activations rounded to bfloat16, float32 sums and outputs, on AVX512-BF16.
bool bf16_dot_available();
// Both bfloat16 GEMMs' (bf16_linear's and amx_bf16_linear's) arguments checked (a TORCH_CHECK error if one fails);
// bf16_gemm_output also returns their uninitialised output (..., out_features): float32, or bfloat16 for SiLU-gated
// outputs `rounded`.
void check_bf16_gemm(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     int64_t out_features, bool silu_gate);
torch::Tensor bf16_gemm_output(const torch::Tensor& x, const torch::Tensor& packed,
                               const c10::optional<torch::Tensor>& bias, int64_t out_features, bool silu_gate,
                               bool rounded = false);
// One row's GEMM outputs [first, last) from their float32 sums (values[0] is output first), plus the bias where there
// is one: written into y, or with `add` added into it as y + linear(x) adds them.
inline void write_outputs(float* y, const float* values, const float* bias, int64_t first, int64_t last, bool add) {
  if (add) {
    for (int64_t n = first; n < last; ++n) y[n] += bias ? values[n - first] + bias[n] : values[n - first];
  } else if (bias) {
    for (int64_t n = first; n < last; ++n) y[n] = values[n - first] + bias[n];
  } else {
    std::memcpy(y + first, values, (last - first) * sizeof(float));
  }
}
// A residual the outputs of x (..., K) are added into checked: contiguous float32 (..., out_features).
void check_residual(const torch::Tensor& residual, const torch::Tensor& x, int64_t out_features);
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features);
// The same for a gate | up projection packed in tiles of 2 gate + 2 up blocks: silu(gate) * up (..., out_features).
torch::Tensor bf16_silu_gate(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features, bool rounded);
// bf16_linear's outputs never written: each row's index of its first largest output (the first NaN where there is
// one), as torch.max(-1) picks it from bf16_linear's (greedy_picks.h); (...) int64. amx_bf16_greedy below likewise.
torch::Tensor bf16_greedy(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features);
// The two with the weight read where it lies, in rows: x @ [W_0 | W_1 | ...]^T (+ bias) for parts (N_i, K) bfloat16
// with unit column stride (every N_i but the last a multiple of 16), and silu(gate) * up for gate and up (I, K), I a
// multiple of 32; the packed GEMMs' bits.
torch::Tensor bf16_linear_rows(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                               const c10::optional<torch::Tensor>& bias);
torch::Tensor bf16_silu_gate_rows(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& up,
                                  bool rounded);
// bf16_greedy over those parts: each row's first largest output, the outputs never written; (...) int64.
torch::Tensor bf16_greedy_rows(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                               const c10::optional<torch::Tensor>& bias);
// residual += bf16_linear(x, packed, bias, out_features) (bf16_linear_rows(x, parts, bias)) in place, each output
// added as residual + linear(x) adds it; residual (..., out_features) float32, returned.
torch::Tensor bf16_linear_add_(torch::Tensor& residual, const torch::Tensor& x, const torch::Tensor& packed,
                               const c10::optional<torch::Tensor>& bias, int64_t out_features);
torch::Tensor bf16_linear_rows_add_(torch::Tensor& residual, const torch::Tensor& x,
                                    const std::vector<torch::Tensor>& parts, const c10::optional<torch::Tensor>& bias);
// Those parts (gate and up with `silu_gate`) packed into out (N/16 rounded up, K/2 rounded up, 16, 2) bfloat16: the
// packed GEMMs' layout, zero rows and a zero input padding it.
torch::Tensor pack_bf16_rows(const std::vector<torch::Tensor>& parts, bool silu_gate, const torch::Tensor& out);
// How the two GEMMs broadcast each input pair, "embedded" or "register": the faster on this CPU, timed at the first
// call; `use` ("embedded" or "register") sets it instead. Either gives the same bits.
std::string bf16_gemm_broadcast(const std::string& use);
// amx_gemm.cpp: whether this build has AMX tiles and Linux grants them to this process (asked once);
bool amx_tiles_granted();
// bf16_linear and bf16_silu_gate on AMX tiles (the same packed weights, inputs and float32 outputs).
bool amx_bf16_available();
torch::Tensor amx_bf16_linear(const torch::Tensor& x, const torch::Tensor& packed,
                              const c10::optional<torch::Tensor>& bias, int64_t out_features);
torch::Tensor amx_bf16_silu_gate(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                                 bool rounded);
// residual += amx_bf16_linear(x, ...) in place, each output added as it is written; returns residual.
torch::Tensor amx_bf16_linear_add_(torch::Tensor& residual, const torch::Tensor& x, const torch::Tensor& packed,
                                   const c10::optional<torch::Tensor>& bias, int64_t out_features);
// amx_bf16_linear's outputs never written: bf16_greedy's pick from amx_bf16_linear's; (...) int64.
torch::Tensor amx_bf16_greedy(const torch::Tensor& x, const torch::Tensor& packed,
                              const c10::optional<torch::Tensor>& bias, int64_t out_features);
// half_gemm.cpp: bfloat16 or float16 weights widened to float32 as they are read (float32 weights read as they are),
// times float32 activations, float32 sums and outputs (AVX2, or AVX-512 where built).
torch::Tensor half_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features);
// half_linear's outputs never written: bf16_greedy's pick from half_linear's; (...) int64.
torch::Tensor half_greedy(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features);
// half_linear with the weight read where it lies, in rows: x @ [W_0 | W_1 | ...]^T (+ bias) for parts (N_i, K)
// bfloat16 or float16 with unit column stride (every N_i but the last a multiple of 16); half_linear's bits.
torch::Tensor half_linear_rows(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                               const c10::optional<torch::Tensor>& bias);
// half_greedy over those parts: each row's first largest output, the outputs never written; (...) int64.
torch::Tensor half_greedy_rows(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                               const c10::optional<torch::Tensor>& bias);
// W (N, K) bfloat16, float16 or float32 -> (N/16 rounded up, K, 16) in its dtype, zero rows padding N: half_linear's
// layout, written into `out` where given (memory the caller chose), else into new memory.
torch::Tensor pack_half_weight(const torch::Tensor& weight, const c10::optional<torch::Tensor>& out);
// Which code path half_linear takes, "avx2" or "avx512": the faster here, timed at the first call; `use` sets it.
std::string half_gemm_path(const std::string& use);
// lora_update.cpp: out[m] += B_g A_g x[m], the update of each row's own LoRA adapter g (modelzoo/lora.py).
void lora_update_(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& row_adapter, const torch::Tensor& a,
                  const torch::Tensor& b_t, const torch::Tensor& segments);
// token_draws.cpp: sampling's whole-vocabulary passes, with their PyTorch spellings' results.
// torch.sort(scores, -1, stable=True) of float32 rows (B, V): (values (B, V), indices (B, V) int64).
std::tuple<torch::Tensor, torch::Tensor> sort_rows(const torch::Tensor& scores);
// sampling.draw(probs, u): each row's first index whose float64 running sum of probs (B, V) float32 exceeds u (B,)
// float64 times the row's total, capped at its last positive weight; 0 where the total is not positive. (B,) int64.
torch::Tensor draw_rows(const torch::Tensor& probs, const torch::Tensor& u);
// out[0, d) = x * cos + rotate_half(x) * sin in float32 for one head of d values of T (the two halves' layout).
template <typename T>
void rotate_half(const T* x, const T* cos, const T* sin, float* out, int64_t d);

}  // namespace zoo
