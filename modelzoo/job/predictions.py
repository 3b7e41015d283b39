"""`predictions_{global_step}.npz` files: deterministic atomic writes and the resume check.

A file is written through `modelzoo.files.write_atomic`, so it appears whole under its final name
or not at all. Its bytes depend only on the arrays (fixed zip timestamps), so a resumed run writes
exactly the files an uninterrupted run would have. Each file records `inputs_sha256`, the digest
of the run's manifest (params, data, checkpoint, version): a file vouches for its own inputs, so a
lost or damaged manifest can be rebuilt from the files that carry this run's digest.
"""
from __future__ import annotations

import zipfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import BinaryIO

import numpy as np

from modelzoo.files import write_atomic

# The file's keys: global_step (0-d), predictions (2-D), one value per row of each PER_ROW_KEYS, loop_dim
# (0-d), inputs_sha256 (0-d); readers need REQUIRED_KEYS (files of older versions lack the last two). Where
# the run has them: sample_id (per row), logprobs (float32, shaped like predictions, 0 but where a token
# was generated), top_logprob_ids and top_logprobs (int32 / float32, shaped like predictions plus K: the K
# likeliest tokens at each generated position and their log-probabilities, descending).
PER_ROW_KEYS = ("sample_index", "prompt_length", "num_generated", "stop_reason")
# Where the data has them: sample_id (unicode, "" for dummy rows); sample (int32, the row's number among the
# samples of its prompt, from 0; -1 for dummy rows); is_greedy (bool, scoring data: whether greedy decoding from
# the context gives the whole continuation; False for other rows); adapter (unicode, a job with LoRA adapters:
# the adapter the row ran with, "" for the bare base model and dummy rows).
OPTIONAL_PER_ROW_KEYS = ("sample_id", "sample", "is_greedy", "adapter")
# (batch_size, max_seq_len[, K]), stored with the first two axes swapped when loop_dim is 0
SEQUENCE_KEYS = ("predictions", "logprobs", "top_logprob_ids", "top_logprobs")
REQUIRED_KEYS = ("global_step", "predictions", *PER_ROW_KEYS)
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest zip timestamp: no wall-clock time in the file


class FileState(Enum):
    """What the resume check found for one step."""

    MISSING = "missing"
    COMPLETE = "complete"  # whole, of this run's shape, made from this run's inputs
    DAMAGED = "damaged"  # unreadable, truncated, a bad CRC, or of another shape
    OTHER_INPUTS = "other inputs"  # whole, but made from other params, data or checkpoint


@dataclass
class StepAssembly:
    """The output arrays of one global step, filled row by row as completions arrive."""

    predictions: np.ndarray  # (batch_size, max_seq_len) int32
    sample_index: np.ndarray  # (batch_size,) int64, -1 for dummy rows
    prompt_length: np.ndarray  # (batch_size,) int32
    num_generated: np.ndarray  # (batch_size,) int32
    stop_reason: np.ndarray  # (batch_size,) unicode
    remaining: int  # rows still generating
    sample_id: np.ndarray | None = None  # (batch_size,) unicode, where the data has ids
    sample: np.ndarray | None = None  # (batch_size,) int32, where the data has several samples per prompt
    is_greedy: np.ndarray | None = None  # (batch_size,) bool, where the data has rows to score
    adapter: np.ndarray | None = None  # (batch_size,) unicode, where the job runs LoRA adapters
    logprobs: np.ndarray | None = None  # (batch_size, max_seq_len) float32, with model.logprobs
    top_logprob_ids: np.ndarray | None = None  # (batch_size, max_seq_len, K) int32, with model.top_logprobs K
    top_logprobs: np.ndarray | None = None  # (batch_size, max_seq_len, K) float32

    def fill(self, row: int, begin: int, count: int, tokens: np.ndarray | None = None,
             logprobs: np.ndarray | None = None, top_ids: np.ndarray | None = None,
             top_logprobs: np.ndarray | None = None) -> None:
        """Row `row`'s `count` tokens from position `begin`: the tokens (None: already in place) and, where given,
        their log-probabilities and top log-probabilities."""
        end = begin + count
        if tokens is not None:
            self.predictions[row, begin:end] = tokens
        if logprobs is not None:
            self.logprobs[row, begin:end] = logprobs
        if top_ids is not None:
            self.top_logprob_ids[row, begin:end] = top_ids
            self.top_logprobs[row, begin:end] = top_logprobs

    def arrays(self, loop_dim: int) -> dict[str, np.ndarray]:
        """The npz payload; SEQUENCE_KEYS as (max_seq_len, batch_size[, K]) when loop_dim is 0."""
        keys = SEQUENCE_KEYS + PER_ROW_KEYS + OPTIONAL_PER_ROW_KEYS
        arrays = {key: getattr(self, key) for key in keys if getattr(self, key) is not None}
        for key in SEQUENCE_KEYS:
            if loop_dim == 0 and key in arrays:
                arrays[key] = np.ascontiguousarray(np.swapaxes(arrays[key], 0, 1))
        return {**arrays, "loop_dim": np.array(loop_dim, dtype=np.int64)}


def predictions_path(folder: Path, step: int) -> Path:
    """`<folder>/predictions_{step}.npz`."""
    return folder / f"predictions_{step}.npz"


def written_steps(folder: Path) -> set[int]:
    """The steps that have a file under its final name (complete or not): one listing of the folder."""
    names = (path.name.removeprefix("predictions_").removesuffix(".npz") for path in folder.glob("predictions_*.npz"))
    return {int(name) for name in names if name.isdigit()}


def temp_files(folder: Path) -> dict[int, list[Path]]:
    """Leftover temp files of killed writers (on any host), by step: one listing of the folder."""
    found: dict[int, list[Path]] = {}
    for path in folder.glob(".predictions_*.npz.*.tmp"):
        step = path.name.split(".")[1].removeprefix("predictions_")
        if step.isdigit():
            found.setdefault(int(step), []).append(path)
    return found


def _write_npz(handle: BinaryIO, arrays: dict[str, np.ndarray]) -> None:
    """An uncompressed .npz (readable by np.load) with fixed timestamps."""
    with zipfile.ZipFile(handle, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_EPOCH)
            with archive.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


def write_predictions(folder: Path, step: int, inputs_sha256: str, arrays: dict[str, np.ndarray]) -> Path:
    """Writes one step's file atomically (a WriteError when the folder refuses)."""
    final = predictions_path(folder, step)
    payload = {"global_step": np.array(step, dtype=np.int64), **arrays, "inputs_sha256": np.array(inputs_sha256)}
    write_atomic(final, lambda handle: _write_npz(handle, payload))
    return final


def file_state(folder: Path, step: int, shape: tuple[int, int], inputs_sha256: str) -> FileState:
    """Reads every entry of the step's file, which exists (so zip's CRC checks every byte), and classifies it."""
    try:
        with np.load(predictions_path(folder, step), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except Exception:  # truncated, not a zip, a flipped byte (BadZipFile: bad CRC), ...
        return FileState.DAMAGED
    predictions = arrays.get("predictions")
    if (predictions is None or predictions.shape != shape or predictions.dtype != np.int32
            or "global_step" not in arrays or int(arrays["global_step"]) != step or "stop_reason" not in arrays):
        return FileState.DAMAGED
    if str(arrays.get("inputs_sha256", "")) != inputs_sha256:
        return FileState.OTHER_INPUTS
    return FileState.COMPLETE


def file_states(folder: Path, steps: list[int], shape: tuple[int, int], inputs_sha256: str) -> dict[int, FileState]:
    """`file_state` of every step: one listing of the folder (no per-step lookup on a fresh run), then
    the files there, one after another (reader threads were 2.4x slower on 2 cores: the parsing holds
    the GIL)."""
    written = written_steps(folder) if folder.is_dir() else set()
    states = dict.fromkeys(steps, FileState.MISSING)
    states.update({step: file_state(folder, step, shape, inputs_sha256) for step in steps if step in written})
    return states
