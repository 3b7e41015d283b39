"""Which float type the arithmetic runs in, given the weights' dtype and the device.

bfloat16 and float16 weights compute in their own type on CUDA and on CPUs that multiply them
natively (AVX512-BF16 / AMX-BF16, AVX512-FP16 / AMX-FP16). On other CPUs PyTorch emulates them:
measured on this project's 2-core AVX-512 machines, a bf16 GEMM runs at less than half the fp32
rate (M=256: 55 against 159 GFLOP/s), and a bf16 job at 0.35x the fp32 job's tokens/s. There the
weights keep their half-precision values (rounded once, at load) and the arithmetic is float32:
faster, and closer to the float32 reference than bf16 arithmetic.
"""
from __future__ import annotations

import torch

from modelzoo.cpu import cpu_flags

# dtype -> CPU flags (/proc/cpuinfo) of which any one means native matrix multiplies.
NATIVE_CPU_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def arithmetic_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`dtype` itself, or float32 for half-precision weights on a CPU without native support."""
    flags = NATIVE_CPU_FLAGS.get(dtype)
    if device.type != "cpu" or flags is None or cpu_flags() & set(flags):
        return dtype
    return torch.float32
