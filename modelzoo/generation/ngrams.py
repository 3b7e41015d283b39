"""Where a row's last tokens occurred before: the n-gram search shared by the no-repeat-n-gram rule
(sampling.py) and prompt-lookup drafting (speculative.py)."""
from __future__ import annotations

import torch
from torch import Tensor


def earlier_occurrences(sequences: Tensor, lengths: Tensor, size: int) -> Tensor:
    """(B, L - size) bool: True at start j where tokens j .. j + size - 1 equal the row's last `size`
    tokens and their successor, token j + size, lies inside the row (j + size < lengths[b]).

    sequences: (B, L) long, valid in [:lengths[b]]; size 0 matches every j < lengths[b].
    """
    width = sequences.shape[1]
    starts = torch.arange(max(width - size, 0), device=sequences.device)
    inside = starts[None, :] < (lengths[:, None] - size)  # (B, L - size)
    if size == 0 or width <= size:
        return inside
    offsets = torch.arange(size, device=sequences.device)
    suffix = sequences.gather(1, (lengths[:, None] - size + offsets).clamp(0, width - 1))  # (B, size)
    windows = sequences[:, :-1].unfold(1, size, 1)  # (B, L - size, size): the n-gram starting at each j
    return (windows == suffix[:, None, :]).all(-1) & inside
