// The C++ CPU kernels of zoo-infer, float32; bound to Python in bindings.cpp.
#pragma once

#include <torch/extension.h>

namespace zoo {

// cached_attention.cpp: stores the forward's keys and values in the cache, attends over it.
torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& new_keys, const torch::Tensor& new_values,
                               const torch::Tensor& keys, const torch::Tensor& values, const torch::Tensor& slots,
                               const torch::Tensor& starts, const torch::Tensor& ends, double scale,
                               const c10::optional<torch::Tensor>& cos, const c10::optional<torch::Tensor>& sin);

// decoder_ops.cpp: the fused small ops, bitwise equal to their PyTorch spelling.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& weight, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
// out[0, d) = x * cos + rotate_half(x) * sin for one head of d floats (the two halves' layout).
void rotate_half(const float* x, const float* cos, const float* sin, float* out, int64_t d);

}  // namespace zoo
