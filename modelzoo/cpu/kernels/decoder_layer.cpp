// A pre-norm decoder layer with a SwiGLU MLP (the Llama family) under the bfloat16 policy, as one call: the kernels
// its modules call, in their order, with their arguments (modelzoo/models/llama.py's KernelChain), so the same bits,
// with nothing between them (the Python between the calls costs more than the small kernels once the large ones have
// pushed the interpreter out of the CPU's caches). Each GEMM on AVX512-BF16 dot products (bf16_linear, bf16_silu_gate,
// bf16_linear_add_) or, where its module multiplies on AMX tiles, on those (amx_bf16_linear, amx_bf16_silu_gate,
// amx_bf16_linear_add_).
#include "kernels.h"

namespace zoo {

torch::Tensor bf16_decoder_layer(torch::Tensor& x, const torch::Tensor& input_norm, double input_eps,
                                 const torch::Tensor& qkv_packed, const c10::optional<torch::Tensor>& qkv_bias,
                                 int64_t qkv_features, int64_t heads, const torch::Tensor& keys,
                                 const torch::Tensor& values, const torch::Tensor& slots, const torch::Tensor& starts,
                                 const torch::Tensor& ends, double scale, const torch::Tensor& cos,
                                 const torch::Tensor& sin, const torch::Tensor& o_packed,
                                 const c10::optional<torch::Tensor>& o_bias, const torch::Tensor& post_norm,
                                 double post_eps, const torch::Tensor& gate_up_packed, int64_t intermediate,
                                 const torch::Tensor& down_packed, const c10::optional<torch::Tensor>& down_bias,
                                 const std::vector<bool>& on_amx) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be contiguous float32 (B, T, hidden): the layer adds into it in place");
  TORCH_CHECK(on_amx.size() == 4, "on_amx must say for each GEMM (q | k | v, o, gate | up, down) whether it runs on "
              "AMX tiles, got ", on_amx.size(), " values");
  const bool qkv_amx = on_amx[0], o_amx = on_amx[1], gate_up_amx = on_amx[2], down_amx = on_amx[3];
  const auto linear = [](bool amx, const torch::Tensor& in, const torch::Tensor& packed,
                         const c10::optional<torch::Tensor>& bias, int64_t features) {
    return amx ? amx_bf16_linear(in, packed, bias, features) : bf16_linear(in, packed, bias, features);
  };
  const int64_t hidden = x.size(2);
  const auto qkv = linear(qkv_amx, rms_norm(x, input_norm, input_eps, true), qkv_packed, qkv_bias, qkv_features);
  const auto attended = cached_attention_qkv(qkv, heads, keys, values, slots, starts, ends, scale, cos, sin);
  const auto normed = add_rms_norm_(x, linear(o_amx, attended, o_packed, o_bias, hidden), post_norm, post_eps, true);
  const auto gated = gate_up_amx ? amx_bf16_silu_gate(normed, gate_up_packed, intermediate, true)
                                 : bf16_silu_gate(normed, gate_up_packed, intermediate, true);
  return down_amx ? amx_bf16_linear_add_(x, gated, down_packed, down_bias, hidden)
                  : bf16_linear_add_(x, gated, down_packed, down_bias, hidden);
}

}  // namespace zoo
