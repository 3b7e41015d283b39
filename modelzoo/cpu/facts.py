"""This machine's CPU as /proc/cpuinfo describes it (its first processor), read once, at the vector level PyTorch
runs at: what the dtype policy (precision.py), the kernels' build and GEMM choices (kernels/) and the benchmark look
at. PyTorch's ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU hides the flags above AVX2 here too, so a job runs as it
would on an AVX2 CPU of the same cores: its kernels built for x86-64-v3, its choices made without AVX-512."""
from __future__ import annotations

import functools

import torch

# Prefixes of the flags of instructions past x86-64-v3 (AVX2, FMA, F16C): AVX-512, AMX, AVX-VNNI, AVX-NE-CONVERT.
_ABOVE_AVX2 = ("avx512", "amx", "avx_")


@functools.cache
def _first_processor() -> dict[str, str]:
    """'key: value' lines of the first processor in /proc/cpuinfo (empty where it is unreadable)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """'AMD EPYC', 'Intel(R) Xeon(R) Platinum 8480+', ... ('' where unknown)."""
    return _first_processor().get("model name", "")


def cpu_capability() -> str:
    """PyTorch's vector level for its CPU kernels: 'AVX512', 'AVX2', 'DEFAULT'...: this CPU's best, or the lower
    one ATEN_CPU_CAPABILITY names."""
    return torch.backends.cpu.get_cpu_capability()


def _all_flags() -> frozenset[str]:
    return frozenset(_first_processor().get("flags", "").split())


def held_to_avx2() -> bool:
    """Whether PyTorch runs at AVX2 on a CPU with AVX-512 (ATEN_CPU_CAPABILITY=avx2)."""
    return cpu_capability() == "AVX2" and "avx512f" in _all_flags()


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags (avx2, avx512_bf16, amx_bf16, ...; empty where unknown); those past AVX2 left out
    where PyTorch is held to AVX2 (module docstring)."""
    if held_to_avx2():
        return frozenset(flag for flag in _all_flags() if not flag.startswith(_ABOVE_AVX2))
    return _all_flags()
