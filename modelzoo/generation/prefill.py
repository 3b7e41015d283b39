"""How newly admitted prompts are prefilled: grouped into forwards within a token budget, and each group's inputs,
packed side by side in one row (families that pack prompts) or right-padded rows."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

if TYPE_CHECKING:
    from modelzoo.generation.engine import Request

Group = list[tuple[int, "Request", int]]  # (slot, request, offset) of one prefill forward


def prefill_groups(admitted: list[tuple[int, Request]], offset: Callable[[Request], int], packs_prompts: bool,
                   token_budget: int) -> list[Group]:
    """Splits admitted requests into groups of (slot, request, offset) run by one forward each: offset = the
    shared prefix's length for prompts that start with it (their keys are copied, not computed), else 0. Sorted by
    what is left to run, each group within the token budget: its real tokens when packed, else its rows padded to
    the longest."""
    ordered = sorted(((slot, r, offset(r)) for slot, r in admitted), key=lambda item: len(item[1].prompt) - item[2])
    groups: list[Group] = []
    tokens = 0  # real tokens in the last group
    for slot, request, skipped in ordered:
        width = len(request.prompt) - skipped  # sorted ascending: the widest of its group so far
        rows = len(groups[-1]) + 1 if groups else 1
        cost = tokens + width if packs_prompts else rows * width
        if not groups or cost > token_budget:
            groups.append([])
            tokens = 0
        groups[-1].append((slot, request, skipped))
        tokens += width
    return groups


def prefill_inputs(group: Group, slots: torch.Tensor, packs_prompts: bool,
                   device: torch.device) -> tuple[torch.Tensor, ...]:
    """(tokens, positions, slots, last) of one prefill forward over what each prompt has left after its offset.
    Packed: the prompts side by side in one row, (1, N) each and last (1, B). Else right-padded rows (B, T) (padding
    is never attended), slots and last (B,)."""
    suffixes = [request.prompt[offset:] for _, request, offset in group]
    lengths = np.array([len(suffix) for suffix in suffixes])
    offsets = np.array([offset for _, _, offset in group])
    if packs_prompts:
        tokens = np.concatenate(suffixes)[None]
        positions = np.concatenate([offset + np.arange(n) for offset, n in zip(offsets, lengths)])[None]
        token_slots = torch.repeat_interleave(slots, torch.from_numpy(lengths).to(device))[None]
        last = (np.cumsum(lengths) - 1)[None]
    else:
        width = lengths.max()
        tokens = np.zeros((len(group), width), dtype=np.int64)
        for row, suffix in enumerate(suffixes):
            tokens[row, : len(suffix)] = suffix
        positions = offsets[:, None] + np.arange(width)[None]
        token_slots, last = slots, lengths - 1

    def as_tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(array, dtype=np.int64)).to(device)

    return as_tensor(tokens), as_tensor(positions), token_slots, as_tensor(last)
