"""The dtypes, the precision policies and the skip marks the precision tests share."""
from __future__ import annotations

import pytest
import torch

from modelzoo.cpu import precision
from modelzoo.cpu.kernels import cpu_kernels


BF16, F32, F16 = torch.bfloat16, torch.float32, torch.float16
MIXED = precision.PrecisionPolicy(BF16, F32, F16, bf16_gemm=True)
needs_bf16 = pytest.mark.skipif(not precision.bf16_kernel_available(),
                                reason="bf16_linear needs an AVX512-BF16 CPU and the C++ kernels")
amx_tiles = cpu_kernels() is not None and cpu_kernels().amx_bf16_available()
# The bfloat16 policy's two GEMMs, as BF16Linear's `amx` argument: bf16_linear, amx_bf16_linear (an AMX-BF16 CPU).
BF16_GEMMS = [pytest.param(False, id="bf16_linear"),
              pytest.param(True, id="amx_bf16_linear", marks=pytest.mark.skipif(
                  not amx_tiles, reason="amx_bf16_linear needs an AMX-BF16 CPU, Linux granting its tiles, the kernels"))]
needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ kernels could not be built here")


HALF = {dtype: precision.PrecisionPolicy(dtype, F32, F32, half_gemm=True) for dtype in (BF16, F16)}
WIDENED = {dtype: precision.PrecisionPolicy(dtype, F32, F32) for dtype in (BF16, F16)}  # weights widened at load


def bf16_layout(weight: torch.Tensor) -> torch.Tensor:
    """bf16_linear's layout of W (N, K), spelled in PyTorch: packed[b, p, r, h] = W[16 b + r, 2 p + h], zeros past N
    and K."""
    out_features, in_features = weight.shape
    rows, cols = -(-out_features // 16) * 16, in_features + in_features % 2
    padded = torch.zeros(rows, cols, dtype=BF16)
    padded[:out_features, :in_features] = weight
    return padded.view(rows // 16, 16, cols // 2, 2).transpose(1, 2).contiguous()
