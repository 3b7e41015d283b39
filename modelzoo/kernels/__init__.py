"""Optional C++ CPU kernels, compiled once per machine type with torch.utils.cpp_extension:
attention over the KV cache (cached_attention.cpp) and the fused small ops of a decoder layer
(decoder_ops.cpp: RMSNorm, residual add + RMSNorm, SiLU gate), each a template over float32,
bfloat16 and float16 storage (storage.h) computing in float32.

`make setup` builds them (`python -m modelzoo.kernels`); a process that finds them missing builds
them itself (about a minute, once), and one that cannot (no C++ compiler) logs why and runs the
PyTorch code path instead: the kernels change speed, not results beyond float rounding (the fused
ops not even that: they are bit-identical to the PyTorch ops they replace). They need an x86-64 CPU
with AVX2 (the SiLU gate calls libtorch's own vector exp); elsewhere the build fails, with the same
fallback.

They are compiled with -march=native, so the build directory is keyed by this CPU's model,
instruction sets and the torch version (then by the sources): nodes of another CPU type sharing
the checkout build their own copy instead of loading one that could hit an illegal instruction.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path
from types import ModuleType

import torch

from modelzoo.cpu import cpu_flags, cpu_model

log = logging.getLogger("zoo-infer")

SOURCES = [Path(__file__).with_name(name) for name in ("bindings.cpp", "cached_attention.cpp", "decoder_ops.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("kernels.h", "storage.h")]
BUILD_ROOT = Path(__file__).with_name("build")


def _machine_key() -> str:
    """Hash of what the compiled code and the measured GEMM choices (modelzoo/gemm.py) depend on on
    this machine: CPU model and instruction sets, architecture, torch version."""
    text = f"{platform.machine()} {cpu_model()} {' '.join(sorted(cpu_flags()))} {torch.__version__}"
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def machine_dir() -> Path:
    """This machine type's folder: its kernel builds and its GEMM choices."""
    return BUILD_ROOT / _machine_key()


def kernel_build_dir() -> Path:
    """Where this machine type's build of the current sources lives: a source or header edit gets a
    fresh folder (torch's own check sees the .cpp files only, not the headers they include)."""
    sources = hashlib.sha1(b"".join(path.read_bytes() for path in SOURCES + HEADERS)).hexdigest()[:12]
    return machine_dir() / f"kernels-{sources}"


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled kernel module, building it if needed; None where it cannot be built."""
    from torch.utils import cpp_extension

    build_dir = kernel_build_dir()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)  # a read-only checkout fails here and falls back
        module = cpp_extension.load(name="zoo_infer_cpu_kernels", sources=[str(s) for s in SOURCES],
                                    build_directory=str(build_dir), extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # no compiler, no headers, a read-only checkout: the torch path still works
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else ""
        log.warning("C++ CPU kernels unavailable (%s: %s); the PyTorch code path runs instead",
                    type(error).__name__, reason)
        return None
    log.info("C++ CPU kernels loaded from %s", build_dir)
    return module

