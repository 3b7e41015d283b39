"""Preallocated per-slot KV cache: one slot holds one sequence, reused when that sequence ends."""
from __future__ import annotations

import math
import sys

import torch

from modelzoo.cpu.memory import huge_page_bytes


def zeroed_cache_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor for the cache. On a Linux CPU: fresh memory on transparent huge pages (huge_page_bytes: attention
    reads every row's keys and values once per decode step, a few KiB per row and head), then touched (zeroed) so that
    the job holds it from the start."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return huge_page_bytes(nbytes).view(dtype).view(shape).zero_()


def to_cache_storage(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """x in the cache's `storage` dtype; into float16 from a wider type, values beyond float16's range saturate at
    its largest finite value, as the C++ attention kernel stores them (a key of inf would make its row's scores NaN)."""
    if storage == torch.float16 and x.dtype in (torch.float32, torch.bfloat16, torch.float64):
        limit = torch.finfo(torch.float16).max
        x = x.clamp(-limit, limit)
    return x.to(storage)


POSITION_ALIGNMENT = 8


def aligned(length: int) -> int:
    """`length` rounded up to a multiple of POSITION_ALIGNMENT."""
    return -(-length // POSITION_ALIGNMENT) * POSITION_ALIGNMENT


def stored_positions(max_len: int) -> int:
    """Positions a cache of `max_len` holds: rounded up to a multiple of POSITION_ALIGNMENT, so that every length a
    decode step reads can be one (the GPU's attention kernels want a mask's rows aligned), plus POSITION_ALIGNMENT
    never read: no step reads the whole cache, whose contiguous slice a compiled step would take as another shape."""
    return aligned(max_len) + POSITION_ALIGNMENT


class KVCache:
    """Keys and values of every layer, shape (num_slots, num_kv_heads, stored_positions(max_len), head_dim) each;
    positions from max_len on are never written.

    A slot is a row of the running batch. A new sequence overwrites its slot from position 0; stale
    entries past its length are never read because attention masks keys after the query position.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_slots, num_kv_heads, stored_positions(max_len), head_dim)
        self.keys = [zeroed_cache_tensor(shape, dtype, device) for _ in range(num_layers)]
        self.values = [zeroed_cache_tensor(shape, dtype, device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len
        # The LoRA adapter each slot's row runs with (index into the model's AdapterBank, -1: none; modelzoo/models/lora.py).
        self.slot_adapter = torch.full((num_slots,), -1, dtype=torch.long, device=device)

    @staticmethod
    def nbytes(num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
               dtype: torch.dtype) -> int:
        """Memory the cache would take, without allocating it."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_slots * num_kv_heads * stored_positions(max_len) * head_dim * element

    def update(self, layer: int, slots: torch.Tensor | None, positions: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores k, v (B, kv_heads, T, head_dim) at `positions` (B, T) of `slots` (B,) (None = all, in order)."""
        rows = torch.arange(k.shape[0], device=k.device) if slots is None else slots
        # Advanced indices on dims 0 and 2 (broadcast to (B, T)) move to the front: target (B, T, kv_heads, hd).
        index = (rows[:, None], slice(None), positions)
        self.keys[layer][index] = k.transpose(1, 2)
        self.values[layer][index] = v.transpose(1, 2)

    def read(self, layer: int, slots: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `length` positions: (B, kv_heads, length, head_dim) each."""
        k, v = self.keys[layer][:, :, :length], self.values[layer][:, :, :length]
        if slots is None:
            return k, v  # a view: no copy when every slot takes part
        return k.index_select(0, slots), v.index_select(0, slots)

    def copy_slots(self, sources: torch.Tensor, targets: torch.Tensor, length: int) -> None:
        """Copies the first `length` positions of slots `sources` (B,) into slots `targets` (B,), every layer. On the
        CPU slot by slot (each a few contiguous blocks, where indexing gathers a temporary copy first); on a GPU in
        one indexed copy a layer."""
        if sources.device.type != "cpu":
            for cache in (*self.keys, *self.values):
                cache[targets, :, :length] = cache[sources, :, :length]
            return
        pairs = list(zip(sources.tolist(), targets.tolist()))
        for cache in (*self.keys, *self.values):
            for source, target in pairs:
                cache[target, :, :length].copy_(cache[source, :, :length])
