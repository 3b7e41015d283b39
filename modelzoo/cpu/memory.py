"""Host memory: what this process may still use (MemAvailable, capped by a cgroup limit: a Slurm job's --mem, a
container's, when that is lower), checkpoint files mapped privately, and pages given back once their values were
copied elsewhere."""
from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

# (limit, usage) files of cgroup v2, then v1
_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def available_host_memory() -> int:
    """Bytes: MemAvailable of /proc/meminfo (else physical memory), or the cgroup's room if lower."""
    available = 0
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if not available:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_path, usage_path in _CGROUP_FILES:
        try:
            limit = Path(limit_path).read_text().strip()
            if limit == "max":
                continue
            room = int(limit) - int(Path(usage_path).read_text().strip())
        except (OSError, ValueError):
            continue
        if 0 < room < available:
            available = room
    return available


# Base address -> a checkpoint file's memory map, while any tensor views it (map_private).
_MAPPINGS: weakref.WeakValueDictionary[int, mmap.mmap] = weakref.WeakValueDictionary()


def map_private(handle) -> mmap.mmap:
    """A private (copy-on-write) memory map of an open file, remembered while any tensor views it so that
    release_mapped can drop its pages."""
    mapping = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    _MAPPINGS[torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()] = mapping
    return mapping


def _mapping_of(tensor: torch.Tensor) -> tuple[int, mmap.mmap] | None:
    """(base address, map) of the checkpoint memory map `tensor` views, if any."""
    start = tensor.data_ptr()
    return next(((base, mapping) for base, mapping in list(_MAPPINGS.items()) if base <= start < base + len(mapping)),
                None)


def release_mapped(tensor: torch.Tensor) -> None:
    """Drops the whole pages of `tensor` from this process if it views a checkpoint's memory map (read_safetensors),
    once its values were copied elsewhere; they are read again from the file if the tensor is used. Anything else:
    nothing happens."""
    mapped = _mapping_of(tensor)
    if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    base, mapping = mapped
    start = tensor.data_ptr()
    stop = start + tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
    first = -(-(start - base) // mmap.PAGESIZE) * mmap.PAGESIZE  # pages wholly inside: never a neighbour's
    last = (stop - base) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        mapping.madvise(mmap.MADV_DONTNEED, first, last - first)


HUGE_PAGE_BYTES = 2 * 2**20


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """nbytes of fresh anonymous memory (uint8, untouched, so reading zero) aligned to 2 MiB, its whole 2 MiB pages
    advised to transparent huge pages where the kernel has them (on Linux). For tensors read whole, streamed
    once per step (the KV cache, the weights a decode step reads): over 4 KiB pages every 4 KiB is a TLB miss and a
    restart of the hardware prefetcher. (Memory the allocator hands back may already be backed by small pages,
    which advice cannot change: hence a mapping of its own, kept by the tensor, whose storage is those nbytes.)"""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    whole_pages = nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if whole_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE, offset, whole_pages)
        except OSError:  # a kernel without transparent huge pages
            pass
    if not nbytes:
        return raw[:0]
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)  # not the alignment's bytes


Memory = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]  # (shape, dtype) -> an uninitialised tensor


def new_memory(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised memory from torch's allocator (a PackedWeightArena's `take` where there is no arena)."""
    return torch.empty(shape, dtype=dtype)


class PackedWeightArena:
    """Memory for the weights the C++ GEMMs read in layouts of their own, handed out side by side at 64-byte boundaries
    from one fresh mapping of `nbytes` on transparent huge pages (huge_page_bytes; on Linux), each weight written
    there as it is packed: a decode step streams every weight once from memory, and over 4 KiB pages a weight of a
    few MiB is a TLB miss and a restart of the hardware prefetcher every 4 KiB. Only the pages written are resident,
    so `nbytes` may be a bound. Its pieces share one dtype, the first's (torch.save, hence the weight cache, cannot
    write one storage viewed as two types); a piece of another dtype, one past `nbytes` or any off Linux is
    new_memory."""

    def __init__(self, nbytes: int) -> None:
        self.memory = huge_page_bytes(nbytes) if nbytes > 0 and sys.platform.startswith("linux") else None
        self.used, self.dtype = 0, None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next piece: an uninitialised tensor of `shape` and `dtype`."""
        size = math.prod(shape) * dtype.itemsize
        start = -(-self.used // 64) * 64
        if self.memory is None or start + size > self.memory.numel() or self.dtype not in (None, dtype):
            return new_memory(shape, dtype)
        self.used, self.dtype = start + size, dtype
        return self.memory[start: start + size].view(dtype).view(shape)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    libc = ctypes.CDLL(None)  # the C library this process already uses
    return getattr(libc, "malloc_trim", None)  # glibc only


def release_freed_memory() -> None:
    """Asks the C allocator to give freed memory back to the system (glibc's malloc_trim; a no-op
    elsewhere). Loading int8 weights frees one full-precision tensor per weight, and malloc keeps
    much of that memory between the int8 tensors allocated meanwhile. Measured loading SmolLM2-135M
    in a process at 220 MiB: peak RSS 598 MiB without this, 478 MiB with it (float32: 871 MiB)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# While generating: allocations under this many bytes come from malloc's heap, and its free top is kept up to as much.
KEPT_ALLOCATION_BYTES = 256 * 2**20
KEPT_HEAP_TOP_BYTES = 2**30


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    libc = ctypes.CDLL(None)
    mallopt = getattr(libc, "mallopt", None)  # glibc (and musl, where it does nothing)
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def keep_freed_memory() -> str | None:
    """Asks glibc's malloc to keep memory freed while generating for the next allocations instead of giving it back
    to the system: a step's activations (a few MiB to tens of MiB each, freed at the end of the step) then reuse pages
    already faulted in. By default malloc serves an allocation over a threshold that moves with the sizes freed so far
    (128 KiB to 32 MiB) from a fresh mapping, and returns its heap's free top past twice that: from one run of the
    same job to the next, a different number of pages faulted in and zeroed afresh every step, the runs with the most
    the slowest (benchmarks/README.md). Called once the weights are laid out (loading keeps malloc's defaults, and
    malloc_trim, release_freed_memory, still returns memory when called). Returns what was set, for the log; None off
    glibc."""
    mallopt = _mallopt()
    if mallopt is None or not sys.platform.startswith("linux"):
        return None
    if not (mallopt(M_MMAP_THRESHOLD, KEPT_ALLOCATION_BYTES) and mallopt(M_TRIM_THRESHOLD, KEPT_HEAP_TOP_BYTES)):
        return None
    return (f"malloc keeps freed memory for reuse (allocations under {KEPT_ALLOCATION_BYTES // 2**20} MiB from its "
            f"heap, up to {KEPT_HEAP_TOP_BYTES // 2**20} MiB of it kept free)")


MADV_POPULATE_READ = 22  # Linux 5.14 and later (Python's mmap module does not name it)


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = getattr(libc, "madvise", None)
    if madvise is not None:
        madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return madvise


def populate(tensors: list[torch.Tensor]) -> bool:
    """Faults in every page of the storages of `tensors` now (MADV_POPULATE_READ), in address order: a mapped file's
    pages are read from disk with the kernel's full read-ahead and entered in this process's page tables in one call
    per storage, instead of one page fault at a time, each stalling the thread that met it, inside the first forwards.
    False where the kernel cannot (before Linux 5.14, not Linux): the pages then come in as they are first read."""
    madvise = _madvise()
    if madvise is None or not sys.platform.startswith("linux"):
        return False
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    for start, nbytes in sorted(storages.items()):
        first = start // mmap.PAGESIZE * mmap.PAGESIZE  # pages are whole: a neighbour's shared page is read too
        if nbytes and madvise(first, start + nbytes - first, MADV_POPULATE_READ) != 0:
            if ctypes.get_errno() == 22:  # EINVAL: this kernel does not know the advice
                return False
    return True
