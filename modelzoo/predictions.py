"""Atomic writer of `predictions_{global_step}.npz`: a file appears whole under its final name or not at all."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

STOP_REASONS = ("stop_sequence", "max_tokens", "max_seq_len", "no_start_token", "empty_prompt", "dummy")


def predictions_path(folder: Path, step: int) -> Path:
    """`<folder>/predictions_{step}.npz`."""
    return folder / f"predictions_{step}.npz"


def write_predictions(folder: Path, step: int, arrays: dict[str, np.ndarray]) -> Path:
    """Writes one step's arrays: temp name in the same folder, flush, fsync, rename, fsync the folder."""
    final = predictions_path(folder, step)
    tmp = folder / f".{final.name}.{os.getpid()}.tmp"
    with open(tmp, "wb") as handle:
        np.savez(handle, global_step=np.array(step, dtype=np.int64), **arrays)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)
    return final
