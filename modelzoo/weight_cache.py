"""A job's model saved as the GEMMs read it, for the next job of the same checkpoint to map instead of building.

A 16-bit or int8 model's set-up on the CPU reads the checkpoint, fuses, casts or quantizes its weights and packs
each into its kernel's layout: every weight is written once into fresh memory, seconds per GB. With
`runconfig.weight_cache: FOLDER`, the first job writes the model as it stands after that (its modules and packed
weights, `torch.save`) to FOLDER; a later job with the same key maps that file (`torch.load(mmap=True)`): nothing
is copied, the weights are the file's pages in the page cache, shared by every process that maps them, read in at
set-up where they fit in the memory left (as llama.cpp maps a GGUF and reads it ahead).

The key covers everything the saved model depends on: the checkpoint's config and weight files (names, sizes,
modification times), the precision policy, the options that shape the weights (dtype, int8 and its group size, the
GEMM and int8 backends asked for), this CPU and the C++ kernels' build, torch's version, and the source of zoo-infer
itself (the saved modules are its classes): any change is another file, never a stale one. Files are written under
a temporary name and renamed, so a job killed while writing leaves no entry another job could read (the next
writer on that host deletes what it left), and never where they would leave less than a GiB free. The file is a
pickle: keep the folder writable by its owner only (as it is created here), like any code you run.

Only layouts that are plain tensors are saved: bfloat16 and float16 weights packed for bf16_linear or half_linear,
and int8 weights; oneDNN's float32 layout is an opaque object that cannot be written, so float32 jobs skip the
cache (and say so).
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

import modelzoo
from modelzoo.cpu.memory import available_host_memory, populate
from modelzoo.files import remove_dead_temps, write_atomic

log = logging.getLogger("zoo-infer")

FORMAT = 1  # of the saved payload below
FREE_SPACE_MARGIN = 2**30  # left free on the cache's disk: a cache never fills it


@dataclass
class CachedLayout:
    """What a cache file holds: the model after its GEMM layout and the plan that laid it out."""

    model: nn.Module
    gemm: Any  # modelzoo.cpu.gemm.GemmPlan


def _source_digest() -> str:
    """A digest of zoo-infer's Python source: the saved modules are instances of its classes."""
    digest = hashlib.sha1()
    root = Path(modelzoo.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key(checkpoint: str | Path, options: dict[str, Any], kernels: str) -> str:
    """The cache file's name for this checkpoint (its config and weight files as they are on disk), these options
    (plain values: the policy, dtypes, backends) and this kernel build (its folder: the CPU and the kernels' source)."""
    folder = Path(checkpoint).resolve()
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".json") and p.is_file())
    described = {
        "format": FORMAT, "checkpoint": str(folder), "options": options, "kernels": kernels,
        "torch": torch.__version__, "source": _source_digest(),
        "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
        "config": hashlib.sha1((folder / "config.json").read_bytes()).hexdigest(),
    }
    return hashlib.sha1(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]


def _tensors(model: nn.Module) -> Iterator[tuple[str, dict, str, torch.Tensor]]:
    """(module name, the dict holding it, its name there, tensor) for every tensor a module of `model` holds: its
    parameters, buffers and plain tensor attributes (a packed weight)."""
    for module_name, module in model.named_modules():
        for holder in (module._parameters, module._buffers, vars(module)):
            for name, tensor in list(holder.items()):
                if isinstance(tensor, torch.Tensor):
                    yield module_name, holder, name, tensor


def unsaveable(model: nn.Module) -> str | None:
    """Why `model` cannot be written as plain tensors (the first opaque one named), or None."""
    for module_name, _, name, tensor in _tensors(model):
        if tensor.is_mkldnn or tensor.layout != torch.strided:
            return f"{module_name or 'model'}.{name} is an opaque {tensor.layout} tensor (oneDNN's layout)"
    return None


def _compact(model: nn.Module) -> int:
    """Every tensor of `model` that views part of a larger storage of which the model's tensors view less than half (a
    checkpoint's memory map, a fused weight) made its own copy, so the file holds each tensor's bytes, not the whole
    storage it came from; a storage they mostly view (the packed weights' arena, PackedWeightArena) is written
    whole, once, its tensors left where they are. A tensor held in several places (a tied weight) gets one copy,
    held in all of them. Returns the bytes the file will hold."""
    viewed: dict[int, int] = {}  # storage address -> the bytes of it the model's tensors view
    for tensor in {id(tensor): tensor for *_, tensor in _tensors(model)}.values():
        address = tensor.untyped_storage().data_ptr()
        viewed[address] = viewed.get(address, 0) + tensor.numel() * tensor.element_size()
    copies: dict[int, torch.Tensor] = {}
    storages: dict[int, int] = {}
    for _, holder, name, tensor in _tensors(model):
        storage = tensor.untyped_storage()
        if id(tensor) in copies:
            tensor = holder[name] = copies[id(tensor)]
        elif (storage.nbytes() > tensor.numel() * tensor.element_size()
              and 2 * viewed[storage.data_ptr()] < storage.nbytes()):
            copy = tensor.detach().clone()
            copy = nn.Parameter(copy, requires_grad=False) if isinstance(tensor, nn.Parameter) else copy
            tensor = copies[id(tensor)] = holder[name] = copy
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def _reason(error: Exception) -> str:
    """An exception's first line, or its type where it says nothing."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def load(folder: Path, key: str) -> CachedLayout | None:
    """The cached model under `key`, mapped from its file, or None where there is none (or it cannot be read: then
    it is rebuilt and written again)."""
    path = folder / f"{key}.pt"
    if not path.is_file():
        return None
    started = time.perf_counter()
    try:
        with torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE):  # writes never reach the file
            payload = torch.load(path, mmap=True, weights_only=False)
        cached = CachedLayout(payload["model"], payload["gemm"])
    except Exception as exc:  # a file from another build, cut short on a full disk...: rebuilt, not fatal
        log.warning("weight cache: cannot read %s (%s); building the model from the checkpoint", path, _reason(exc))
        return None
    log.info("weight cache: mapped %s (%.2f GiB) in %.1fs instead of loading and laying out the checkpoint", path,
             path.stat().st_size / 2**30, time.perf_counter() - started)
    _read_in(path, cached.model)
    return cached


def _read_in(path: Path, model: nn.Module) -> None:
    """Reads the mapped model's pages in now, where they fit in the memory left (memory.populate): a file not in the
    page cache (a cold node, a shared file system) would otherwise be read a page fault at a time by the first
    forwards, whose threads each wait on their own faults."""
    size, room = path.stat().st_size, available_host_memory()
    if size > room:
        log.info("weight cache: %.2f GiB do not fit in the %.2f GiB of memory left: its pages are read as the forwards "
                 "meet them", size / 2**30, room / 2**30)
        return
    started = time.perf_counter()
    if populate([tensor for *_, tensor in _tensors(model)]):
        seconds = time.perf_counter() - started
        log.info("weight cache: its pages read in in %.1fs (%.2f GiB/s)", seconds, size / 2**30 / max(seconds, 1e-3))


def save(folder: Path, key: str, layout: CachedLayout) -> Path | None:
    """Writes `layout` under `key` (files.write_atomic: a temporary file renamed); returns its path, or None with a
    warning where it cannot be written (the job goes on without)."""
    reason = unsaveable(layout.model)
    if reason is not None:
        log.info("weight cache: not written: %s", reason)
        return None
    started = time.perf_counter()
    path = folder / f"{key}.pt"
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        if remove_dead_temps(folder, f"{key}.pt"):
            log.info("weight cache: removed what a writer of %s.pt that was stopped left", key)
        size = _compact(layout.model)
        free = shutil.disk_usage(folder).free
        if size + FREE_SPACE_MARGIN > free:
            log.warning("weight cache: not written: %s has %.2f GiB free, the model needs %.2f GiB (and %.0f GiB are "
                        "left free)", folder, free / 2**30, size / 2**30, FREE_SPACE_MARGIN / 2**30)
            return None
        log.info("weight cache: writing %.2f GiB to %s (once; later jobs map it)", size / 2**30, folder)
        write_atomic(path, lambda handle: torch.save({"model": layout.model, "gemm": layout.gemm}, handle))
    except Exception as exc:  # WriteError, a full disk, an object that cannot be pickled: no file, no failed job
        log.warning("weight cache: could not write %s (%s); the job goes on without it", path, _reason(exc))
        return None
    log.info("weight cache: wrote %s (%.2f GiB) in %.1fs; the next job of this checkpoint and options maps it", path,
             path.stat().st_size / 2**30, time.perf_counter() - started)
    return path
