"""This machine's CPU as /proc/cpuinfo describes it (its first processor), read once: what the dtype
policy (precision.py), the kernels' build key and GEMM choices (kernels/) and the benchmark look at."""
from __future__ import annotations

import functools


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


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags (avx2, avx512_bf16, amx_bf16, ...; empty where unknown)."""
    return frozenset(_first_processor().get("flags", "").split())
