"""Host memory: what this process may still use (MemAvailable, capped by a cgroup limit: a Slurm job's --mem, a
container's, when that is lower), checkpoint files mapped privately, and pages given back once their values were
copied elsewhere."""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
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


def owns_its_memory(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is contiguous and alone in memory of its own: all of its storage, not a view of a larger
    tensor or of a checkpoint's memory map (whose pages release_mapped drops)."""
    return (tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
            and _mapping_of(tensor) is None)


HUGE_PAGE_BYTES = 2 * 2**20


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """nbytes of fresh anonymous memory (uint8, untouched, so reading zero) aligned to 2 MiB, its whole 2 MiB pages
    advised to transparent huge pages where the kernel has them (on Linux). For tensors read whole, streamed
    once per step (the KV cache, the weights a decode step reads): over 4 KiB pages every 4 KiB is a TLB miss and a
    restart of the hardware prefetcher. (Memory the allocator hands back may already be backed by small pages,
    which advice cannot change: hence a mapping of its own, kept by the tensor.)"""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    whole_pages = nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if whole_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE, offset, whole_pages)
        except OSError:  # a kernel without transparent huge pages
            pass
    return raw[offset: offset + nbytes]


def huge_page_slices(sizes: list[int]) -> list[torch.Tensor]:
    """Byte views of one huge_page_bytes mapping, one per size, side by side at 64-byte boundaries."""
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // 64) * 64)
    arena = huge_page_bytes(starts[-1])
    return [arena[start: start + size] for start, size in zip(starts, sizes)]


def copy_into(place: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` (contiguous) in `place`, a byte view of its size (one of huge_page_slices)."""
    return place.view(tensor.dtype).view(tensor.shape).copy_(tensor)


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
