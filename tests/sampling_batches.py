"""Random logits batches for the sampling tests, and bitwise equality of score tensors."""
from __future__ import annotations

import torch

NEG_INF = -float("inf")


def batch(num_rows: int, width: int, vocab: int, seed: int, garbage: int | None = None):
    """Random logits (B, V) with both signs, sequences (B, L) and lengths in [1, L] (L and 1 always present).

    Past its length a row holds `garbage` if given, else more random in-vocabulary ids, so that reading past the
    length would change the result.
    """
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    sequences = torch.randint(0, vocab, (num_rows, width), generator=gen)
    lengths = torch.randint(1, width + 1, (num_rows,), generator=gen)
    lengths[0], lengths[-1] = width, 1
    if garbage is not None:
        sequences[torch.arange(width)[None, :] >= lengths[:, None]] = garbage
    return logits, sequences, lengths


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, -inf included."""
    return a.shape == b.shape and torch.equal(a, b)
