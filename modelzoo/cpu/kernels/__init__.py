"""Optional C++ CPU kernels, compiled once per machine type with torch.utils.cpp_extension:
attention over the KV cache (cached_attention.cpp) and the fused small ops of a decoder layer
(decoder_ops.cpp: RMSNorm, residual add + RMSNorm, SiLU gate), each a template over float32,
bfloat16 and float16 storage (storage.h) computing in float32; and the GEMMs of int8 weights on AVX512-VNNI
(int8_gemm.cpp), of bfloat16 weights with float32 outputs on AVX512-BF16 (bf16_gemm.cpp) or AMX tiles
(amx_gemm.cpp) and of bfloat16 or float16 weights widened to float32 on any AVX2 CPU (half_gemm.cpp); the
updates of LoRA adapters chosen per row (lora_update.cpp); and sampling's passes over a whole vocabulary, its sort and
its draw (token_draws.cpp).

`make setup` builds them (`python -m modelzoo.cpu.kernels`); a process that finds them missing builds
them itself (about a minute, once), and one that cannot (no C++ compiler) logs why and runs the
PyTorch code path instead: the kernels change speed, not results beyond float rounding (the fused
ops not even that: they are bit-identical to the PyTorch ops they replace). They need an x86-64 CPU
with AVX2 (the SiLU gate calls libtorch's own vector exp); elsewhere the build fails, with the same
fallback.

They are compiled with -march=native (-march=x86-64-v3 -mtune=native where PyTorch is held to AVX2 on
an AVX-512 CPU: ATEN_CPU_CAPABILITY=avx2, modelzoo/cpu/facts.py), so the build directory is keyed by this CPU's model,
instruction sets and the torch version (then by the sources and flags): nodes of another CPU type sharing
the checkout build their own copy instead of loading one that could hit an illegal instruction.

Where builds (and modelzoo/cpu/gemm.py's measured choices) live, `kernel_roots()`, in order:
$ZOO_INFER_KERNEL_DIR if set, the checkout's modelzoo/cpu/kernels/build, the user cache
(${XDG_CACHE_HOME:-~/.cache}/zoo-infer/kernels). A build found in any of them is loaded directly,
without torch's build lock, so a read-only shared install with its kernels built works as is; a
missing one is built into `writable_root()`: $ZOO_INFER_KERNEL_DIR if set, else the checkout's
folder if writable, else the user cache.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

import torch

from modelzoo.cpu.facts import cpu_flags, cpu_model, held_to_avx2

log = logging.getLogger("zoo-infer")

SOURCES = [Path(__file__).with_name(name) for name in ("bindings.cpp", "cached_attention.cpp", "decoder_layer.cpp",
                                                         "decoder_ops.cpp",
                                                         "int8_gemm.cpp", "bf16_gemm.cpp", "amx_gemm.cpp",
                                                         "half_gemm.cpp", "lora_update.cpp",
                                                         "token_draws.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("amx_tiles.h", "attention_tiles.h", "cpu_caches.h",
                                                         "greedy_picks.h", "kernels.h", "shared_tasks.h", "storage.h",
                                                         "timed_choice.h", "weight_rows.h")]
BUILD_ROOT = Path(__file__).with_name("build")
MODULE_NAME = "zoo_infer_cpu_kernels"  # torch names the library <name>.so (<name>_v1.so, ... on a rebuild in-process)
LDFLAGS = ("-fopenmp",)


def compile_flags() -> tuple[str, ...]:
    """The compiler's flags: for this CPU, or for any AVX2 CPU (tuned for this one) where PyTorch is held to AVX2."""
    target = ("-march=x86-64-v3", "-mtune=native") if held_to_avx2() else ("-march=native",)
    return ("-O3", *target, "-fopenmp")


def _target() -> str:
    """What the build is for, as the log says it."""
    return "x86-64-v3, as PyTorch is held to AVX2" if held_to_avx2() else "this CPU"


def warn_if_held_in_part() -> None:
    """Where PyTorch is held to AVX2, warns about the libraries under it that are not (oneDNN's and MKL's GEMMs)."""
    wanted = {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    unheld = [f"{name}={value}" for name, value in wanted.items() if os.environ.get(name, "").upper() != value]
    if held_to_avx2() and unheld:
        log.warning("PyTorch is held to AVX2 (ATEN_CPU_CAPABILITY) but its GEMM libraries still use AVX-512: set %s "
                    "too for the whole job to run as on an AVX2 CPU", " and ".join(unheld))


def kernel_roots() -> list[Path]:
    """The folders holding builds and GEMM choices, searched in this order (see the module docstring)."""
    chosen = os.environ.get("ZOO_INFER_KERNEL_DIR")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "zoo-infer" / "kernels"
    return ([Path(chosen).expanduser()] if chosen else []) + [BUILD_ROOT, cache]


def writable(path: Path) -> bool:
    """Whether `path`, or its nearest existing ancestor, can be written (os.access sees read-only mounts too)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return os.access(path, os.W_OK)


def writable_root() -> Path:
    """Where new builds and GEMM choices go: $ZOO_INFER_KERNEL_DIR if set (writable or not: it was asked
    for), else the checkout's build folder if writable, else the user cache."""
    roots = kernel_roots()
    if os.environ.get("ZOO_INFER_KERNEL_DIR"):
        return roots[0]
    return next((root for root in roots if writable(root)), roots[-1])


def _machine_key() -> str:
    """Hash of what the compiled code and the measured GEMM choices (modelzoo/cpu/gemm.py) depend on on
    this machine: CPU model and instruction sets, architecture, torch version."""
    text = f"{platform.machine()} {cpu_model()} {' '.join(sorted(cpu_flags()))} {torch.__version__}"
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def machine_dir(root: Path | None = None) -> Path:
    """This machine type's folder under `root` (default `writable_root()`): its kernel builds, its GEMM choices."""
    return (root or writable_root()) / _machine_key()


def read_machine_choices(name: str, version: int) -> dict:
    """The entries of this machine type's choices file `name` (GEMM backends, SDPA backends) in every kernel root,
    merged, the first root's entry winning (a read-only shared install's, then those measured since into the
    writable root); files of another format `version` are ignored."""
    entries = {}
    for root in reversed(kernel_roots()):
        try:
            cached = json.loads((machine_dir(root) / name).read_text())
        except (OSError, ValueError):
            continue
        if cached.get("version") == version:
            entries.update(cached.get("shapes", {}))
    return entries


def write_machine_choices(name: str, version: int, entries: dict) -> Exception | None:
    """Writes the choices file `name` into the writable root; best effort: the error where it cannot (the next job
    measures again), None once written."""
    from modelzoo.files import WriteError, make_folder, write_text_atomic

    path = machine_dir() / name
    try:
        make_folder(path.parent)
        write_text_atomic(path, json.dumps({"version": version, "shapes": entries}, indent=1, sort_keys=True))
    except WriteError as error:
        return error
    return None


def _built_library(build_dir: Path) -> Path | None:
    """The finished library in `build_dir`, if any (none while torch's build lock is there: a build under way)."""
    if (build_dir / "lock").exists():
        return None
    return next(iter(sorted(build_dir.glob(f"{MODULE_NAME}*.so"))), None)


def kernel_build_dir(root: Path | None = None) -> Path:
    """This machine type's build of the current sources under `root`; by default the first root holding
    one, else where one would be built. A source, header or flag edit gets a fresh folder (torch's own
    check sees the .cpp files only, not the headers they include; a found build is loaded unchecked)."""
    if root is None:
        found = (build_dir for build_dir in map(kernel_build_dir, kernel_roots()) if _built_library(build_dir))
        return next(found, None) or kernel_build_dir(writable_root())
    flags = " ".join(compile_flags() + LDFLAGS).encode()
    sources = hashlib.sha1(b"".join(path.read_bytes() for path in SOURCES + HEADERS) + flags).hexdigest()[:12]
    return machine_dir(root) / f"kernels-{sources}"


def _load_library(library: Path) -> ModuleType:
    """Imports a built library as torch's loader does, without its build lock (torch is imported, so
    the library's libtorch symbols resolve). The module is named after its build folder as well: loaded under
    its bare name, a second build would come back as the module of the first one loaded (benchmarks/
    kernel_builds.py loads several builds in one process)."""
    name = f"{library.parent.name.replace('-', '_')}.{library.stem}"  # the PyInit symbol is the last part's
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled kernel module, loaded from the first root holding a build, else built into
    `writable_root()`; None where it cannot be built."""
    from torch.utils import cpp_extension

    warn_if_held_in_part()
    for build_dir in map(kernel_build_dir, kernel_roots()):
        library = _built_library(build_dir)
        if library is None:
            continue
        try:
            module = _load_library(library)
        except Exception as error:  # a damaged file: building afresh below replaces it where writable
            log.warning("C++ CPU kernels in %s not loadable (%s: %s)", build_dir, type(error).__name__, error)
            continue
        log.info("C++ CPU kernels (%s) loaded from %s", _target(), build_dir)
        return module
    build_dir = kernel_build_dir(writable_root())
    try:
        if not writable(build_dir):
            raise PermissionError(f"{build_dir} is not writable; set ZOO_INFER_KERNEL_DIR to a writable folder")
        build_dir.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(name=MODULE_NAME, sources=[str(s) for s in SOURCES],
                                    build_directory=str(build_dir), extra_cflags=list(compile_flags()),  # load appends
                                    extra_ldflags=list(LDFLAGS), verbose=False)
    except Exception as error:  # no compiler, no headers, no writable folder: the torch path still works
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else ""
        log.warning("C++ CPU kernels unavailable (%s: %s); the PyTorch code path runs instead",
                    type(error).__name__, reason)
        return None
    log.info("C++ CPU kernels (%s) built and loaded from %s", _target(), build_dir)
    return module
