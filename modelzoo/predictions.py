"""`predictions_{global_step}.npz` files: atomic, deterministic writes and the resume check.

A file appears whole under its final name or not at all (temp name in the same folder, flush,
fsync, rename, fsync the folder), so SIGKILL at any moment leaves no partial file. The bytes
depend only on the arrays (fixed zip timestamps), so a resumed run writes exactly the files an
uninterrupted run would have.
"""
from __future__ import annotations

import os
import socket
import zipfile
from pathlib import Path

import numpy as np

STOP_REASONS = ("stop_sequence", "max_tokens", "max_seq_len", "no_start_token", "empty_prompt", "dummy")
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest zip timestamp: no wall-clock time in the file


def predictions_path(folder: Path, step: int) -> Path:
    """`<folder>/predictions_{step}.npz`."""
    return folder / f"predictions_{step}.npz"


def temp_files(folder: Path, step: int) -> list[Path]:
    """Leftover temp files of `step` (from a killed writer, on any host)."""
    return list(folder.glob(f".predictions_{step}.npz.*.tmp"))


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """An uncompressed .npz (readable by np.load) with fixed timestamps, fsynced."""
    with open(path, "wb") as handle:
        with zipfile.ZipFile(handle, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, array in arrays.items():
                info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_EPOCH)
                with archive.open(info, "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)
        handle.flush()
        os.fsync(handle.fileno())


def write_predictions(folder: Path, step: int, arrays: dict[str, np.ndarray]) -> Path:
    """Writes one step's arrays under a temp name, then renames it into place and fsyncs the folder."""
    final = predictions_path(folder, step)
    tmp = folder / f".{final.name}.{socket.gethostname()}.{os.getpid()}.tmp"
    write_npz(tmp, {"global_step": np.array(step, dtype=np.int64), **arrays})
    os.replace(tmp, final)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)
    return final


def is_complete(folder: Path, step: int, shape: tuple[int, int]) -> bool:
    """True when the step's file loads, holds `global_step` == step and `predictions` of `shape`."""
    path = predictions_path(folder, step)
    if not path.is_file():
        return False
    try:
        with np.load(path, allow_pickle=False) as npz:
            return (int(npz["global_step"]) == step and npz["predictions"].shape == shape
                    and npz["predictions"].dtype == np.int32 and "stop_reason" in npz.files)
    except Exception:  # truncated, not a zip, missing key...: redo the step
        return False
