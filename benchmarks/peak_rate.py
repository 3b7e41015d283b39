"""This CPU's arithmetic peak per dtype, measured (benchmarks/peak_rate.c): the rate of its widest
multiply-add instruction for that dtype, every thread issuing it on registers only. No GEMM in that
dtype can beat it on these threads, so a workload's FLOPs over it bound every engine's tokens/s.

    python benchmarks/peak_rate.py            # prints the peaks and the read bandwidth with every core available

Which instruction bounds which dtype:
  - float32: vfmadd231ps on zmm (AVX-512F), else on ymm (AVX2 + FMA).
  - bfloat16: tdpbf16ps on AMX tiles where the CPU has AMX-BF16 (Sapphire Rapids and later); else
    vdpbf16ps on zmm where it has AVX512-BF16; without either bfloat16 is multiplied in float32
    (zoo-infer's and oneDNN's way there), so the float32 peak bounds it.
  - float16: the float32 peak, where the CPU lacks AVX512-FP16 and AMX-FP16.
  - int8: tdpbssd on AMX tiles where the CPU has AMX-INT8 (ops, not FLOPs).
A CPU with AVX512-FP16 or AMX-FP16 multiplies float16 faster than any of these loops: no bound is
given there for float16 (None), rather than a wrong one; nor for int8 without AMX.

Also the rate at which the same threads read memory (`measure_bandwidth`): every thread streams a buffer of its
own, together far larger than the last-level cache, so the rate is DRAM's. A decode step reads every weight and
the rows' KV cache once; those bytes over this rate bound its time however few FLOPs it does.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Set as AbstractSet
from pathlib import Path
from typing import TypeVar

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from modelzoo.cpu.facts import cpu_flags  # noqa: E402

SOURCE = Path(__file__).with_name("peak_rate.c")
FP32_ZMM, FP32_YMM, BF16_ZMM, BF16_AMX, INT8_AMX = 0, 1, 2, 3, 4  # peak_gflops()'s `kind` in peak_rate.c
T = TypeVar("T")
INSTRUCTIONS = {FP32_ZMM: "vfmadd231ps zmm", FP32_YMM: "vfmadd231ps ymm", BF16_ZMM: "vdpbf16ps zmm",
                BF16_AMX: "tdpbf16ps tiles", INT8_AMX: "tdpbssd tiles"}
AMX_ITERATIONS_SHARE = 16  # an AMX iteration does 85-340x the FLOPs of a vector one: fewer of them
ITERATIONS = 20_000_000  # 240M instructions a thread: about 0.1 s at 4 GHz and two ports
REPEATS = 5  # the best of these runs is kept (the rate moves a few percent between runs)
BANDWIDTH_BYTES = 2**30  # read by all threads together, at least: several times any last-level cache
BANDWIDTH_PASSES, BANDWIDTH_REPEATS = 2, 3


def _compiler() -> str:
    """The system's C compiler ($CC, else cc, else gcc)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc / gcc / $CC)")
    return compiler


def _build(folder: Path, compiler: str) -> ctypes.CDLL:
    """Compiles peak_rate.c into `folder` with `compiler` and loads it."""
    library = folder / "peak_rate.so"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-pthread", str(SOURCE), "-o", str(library)],
                   check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(library))
    lib.peak_gflops.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.peak_gflops.restype = ctypes.c_double
    lib.read_gbps.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_int]
    lib.read_gbps.restype = ctypes.c_double
    return lib


@functools.lru_cache(maxsize=None)
def _built_once(compiler: str) -> ctypes.CDLL:
    """peak_rate.c built by `compiler` and loaded, once per process (the loaded library outlives its file)."""
    with tempfile.TemporaryDirectory(prefix="zoo-peak-") as folder:
        return _build(Path(folder), compiler)


def _measured(measure: Callable[[ctypes.CDLL], T]) -> tuple[T | None, str]:
    """(measure(the library), "") or (None, why the library could not be had)."""
    try:
        return measure(_built_once(_compiler())), ""
    except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        return None, f"not measured ({detail.strip().splitlines()[-1][:200]})"


def instructions_for(flags: AbstractSet[str]) -> dict[str, int | None]:
    """dtype -> the instruction (peak_rate.c's kind) whose rate bounds its GEMMs on a CPU with these
    flags; None where a faster unit (AVX512-FP16, AMX-FP16) is not measured or the CPU has no AVX2 + FMA."""
    if "avx512f" in flags:
        fp32 = FP32_ZMM
    elif {"avx2", "fma"} <= flags:
        fp32 = FP32_YMM
    else:
        fp32 = None
    if {"amx_bf16", "amx_tile"} <= flags:
        bf16 = BF16_AMX
    elif "avx512_bf16" in flags:
        bf16 = BF16_ZMM
    else:
        bf16 = fp32
    fp16 = None if flags & {"amx_fp16", "avx512_fp16"} else fp32
    int8 = INT8_AMX if {"amx_int8", "amx_tile"} <= flags else None
    return {"float32": fp32, "bfloat16": bf16, "float16": fp16, "int8": int8}


def measure_peaks(threads: int, dtypes: list[str]) -> tuple[dict[str, float | None], str]:
    """({dtype: peak GFLOP/s, None where not measured}, why nothing was measured or "") for `threads` threads."""
    nothing = {dtype: None for dtype in dtypes}
    if platform.machine() not in ("x86_64", "AMD64"):
        return nothing, f"not measured on {platform.machine()} (x86-64 only)"
    kinds = instructions_for(cpu_flags())
    wanted = sorted({kinds.get(dtype) for dtype in dtypes} - {None})
    rates, why_not = _measured(lambda lib: {kind: max(lib.peak_gflops(kind, threads, iterations(kind))
                                                      for _ in range(REPEATS)) for kind in wanted})
    if rates is None:
        return nothing, why_not
    if all(rate <= 0 for rate in rates.values()):
        return nothing, f"not measured (could not start {threads} threads)"
    # A kind that failed alone (Linux before 5.16 refuses AMX's tile state) leaves only its dtypes unmeasured.
    return {dtype: rates[kinds[dtype]] if kinds.get(dtype) in rates and rates[kinds[dtype]] > 0 else None
            for dtype in dtypes}, ""


def largest_cache_bytes() -> int:
    """The largest CPU cache Linux lists for CPU 0 (its last level), in bytes; 0 where none is listed."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


def bandwidth_bytes() -> int:
    """Bytes the threads read together: BANDWIDTH_BYTES, or four times the last-level cache where that is more."""
    return max(BANDWIDTH_BYTES, 4 * largest_cache_bytes())


def measure_bandwidth(threads: int) -> tuple[float | None, str]:
    """(GB/s at which `threads` threads read memory, the best of BANDWIDTH_REPEATS; None and why where not measured)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"not measured on {platform.machine()} (x86-64 only)"
    rate, why_not = _measured(lambda lib: max(lib.read_gbps(threads, bandwidth_bytes() // threads, BANDWIDTH_PASSES)
                                              for _ in range(BANDWIDTH_REPEATS)))
    if rate is None:
        return None, why_not
    if rate <= 0:
        return None, f"not measured (could not start {threads} threads or allocate {bandwidth_bytes() >> 20} MiB)"
    return rate, ""


def describe_bandwidth(gbps: float | None, threads: int, why_not: str = "") -> str:
    """'19.6 GB/s (2 threads reading 1024 MiB, 2 passes, best of 3)', or why it was not measured."""
    if gbps is None:
        return why_not or "not measured"
    return (f"{gbps:.1f} GB/s ({threads} threads reading {bandwidth_bytes() >> 20} MiB, {BANDWIDTH_PASSES} passes, "
            f"best of {BANDWIDTH_REPEATS})")


def iterations(kind: int) -> int:
    """Loop iterations a thread runs for instruction `kind`."""
    return ITERATIONS // AMX_ITERATIONS_SHARE if kind in (BF16_AMX, INT8_AMX) else ITERATIONS


def describe(peaks: dict[str, float | None], threads: int, why_not: str = "") -> str:
    """'float32 224 (vfmadd231ps zmm), bfloat16 449 (vdpbf16ps zmm); 2 threads issuing ...'."""
    if why_not:
        return why_not
    kinds = instructions_for(cpu_flags())
    def unmeasured(dtype: str) -> str:
        if kinds["float32"] is None:
            return "no AVX2 + FMA"
        if kinds.get(dtype) is not None:
            return f"{INSTRUCTIONS[kinds[dtype]]} did not run: AMX refused by Linux?"
        return "no AMX-INT8" if dtype == "int8" else "AVX512-FP16 / AMX-FP16 multiply it faster"

    said = ", ".join(f"{dtype} {peak:.0f} ({INSTRUCTIONS[kinds[dtype]]})" if peak
                     else f"{dtype} not measured ({unmeasured(dtype)})" for dtype, peak in peaks.items())
    return f"{said}; {threads} threads issuing one instruction on registers only"


def main() -> int:
    """Prints the peaks for every dtype with every core available."""
    threads = len(os.sched_getaffinity(0))
    peaks, why_not = measure_peaks(threads, ["float32", "bfloat16", "float16", "int8"])
    print(f"arithmetic peak, GFLOP/s: {describe(peaks, threads, why_not)}")
    gbps, why_not = measure_bandwidth(threads)
    print(f"memory read bandwidth: {describe_bandwidth(gbps, threads, why_not)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
