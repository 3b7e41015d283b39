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
needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ kernels could not be built here")


HALF = {dtype: precision.PrecisionPolicy(dtype, F32, F32, half_gemm=True) for dtype in (BF16, F16)}
WIDENED = {dtype: precision.PrecisionPolicy(dtype, F32, F32) for dtype in (BF16, F16)}  # weights widened at load
