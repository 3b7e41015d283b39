"""GptHDF5MapDataProcessor: the `.h5` files of `data_dir` -> fixed-size batches of rows, streamed.

Files are read in sorted name order and concatenated; their format (`data`, the per-row datasets, what a row that
brings nothing holds) is modelzoo/job/rows.py's. Batches are read slice by slice, never the whole file, so memory
stays flat in the number of samples.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import h5py
import numpy as np

from modelzoo.errors import UserError
from modelzoo.generation.options import BOUNDS, ROW_OPTION_DATASETS, GenerationOptions, RequestVariety
from modelzoo.job.rows import DATA, ROW_DATASETS, check_values, is_missing, padded, stop_sequences_of


@dataclass
class Batch:
    """One global step: rows (batch_size, max_seq_len) int32 and sample_index (batch_size,), -1 = dummy; `columns`:
    each per-row dataset the data has (modelzoo/job/rows.py), dummy rows holding its missing value, stop sequences
    as tuples."""

    step: int
    rows: np.ndarray
    sample_index: np.ndarray
    columns: dict[str, Any] = field(default_factory=dict)

    def options(self, row: int, defaults: GenerationOptions) -> GenerationOptions:
        """Row `row`'s GenerationOptions: `defaults` with the values the row brings of its own (its max_tokens, the
        smaller of its own and the defaults' holding; its stop sequences besides the defaults'). The defaults
        themselves where the row brings nothing."""
        own: dict[str, Any] = {}
        for name in ROW_OPTION_DATASETS:
            values = self.columns.get(name)
            if values is None:
                continue
            value = values[row]
            if name == "stop_sequences":
                if value:
                    own[name] = defaults.stop_sequences + value
            elif not is_missing(name, value):
                bound = BOUNDS.get(name)
                own[name] = str(value) if bound is None else int(value) if bound.integer else float(value)
        if "max_tokens" in own:
            own["max_tokens"] = min(own["max_tokens"], defaults.max_tokens or own["max_tokens"])
        return defaults.overridden(**own) if own else defaults


def start_positions(rows: np.ndarray, start_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of the first start token in each row (B,), and whether the row has one (B,): a row's
    prompt is what comes before it."""
    is_start = np.isin(rows, start_tokens)
    return is_start.argmax(axis=1), is_start.any(axis=1)


class GptHDF5MapDataProcessor:
    """Reads the prompts of a data folder in batches of `batch_size`, padding the last with dummy rows."""

    def __init__(self, data_dir: str | Path, batch_size: int, loop_dim: int, pad_token: int) -> None:
        self.data_dir = Path(data_dir)
        self.batch_size = batch_size
        self.loop_dim = loop_dim
        self.pad_token = pad_token
        self.files = self._find_files()
        self._handles = [self._open(path) for path in self.files]
        self._datasets = [self._check_dataset(path, handle) for path, handle in zip(self.files, self._handles)]
        widths = {self._width(d) for d in self._datasets}
        if len(widths) > 1:
            shown = ", ".join(f"{p.name}: {self._width(d)}" for p, d in zip(self.files, self._datasets))
            raise UserError(f"the .h5 files in {self.data_dir} have different max_seq_len ({shown})")
        self.max_seq_len = widths.pop()
        self.sizes = [self._count(d) for d in self._datasets]
        self.num_samples = sum(self.sizes)
        if self.num_samples == 0:
            raise UserError(f"the .h5 files in {self.data_dir} hold no samples")
        self.per_row = self._check_per_row()
        self.num_steps = -(-self.num_samples // batch_size)

    @property
    def attrs(self) -> dict[str, Any]:
        """Attributes the data tool wrote on the first file (tokenizer, vocab_size, start_token, ...)."""
        return dict(self._handles[0].attrs)

    def _find_files(self) -> list[Path]:
        if not self.data_dir.is_dir():
            raise UserError(f"inference_input.data_dir {self.data_dir} does not exist or is not a folder")
        files = sorted(self.data_dir.glob("*.h5"))
        if not files:
            raise UserError(f"inference_input.data_dir {self.data_dir} holds no .h5 file")
        return files

    @staticmethod
    def _open(path: Path) -> h5py.File:
        try:
            return h5py.File(path, "r")
        except OSError as error:  # truncated, not HDF5, unreadable
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise UserError(f"cannot read {path} as HDF5 ({reason}): is it truncated or still being written?") from None

    def _check_dataset(self, path: Path, handle: h5py.File) -> h5py.Dataset:
        if DATA not in handle:
            raise UserError(f"{path} has no dataset 'data' (found: {', '.join(handle.keys()) or 'nothing'})")
        data = handle[DATA]
        if not isinstance(data, h5py.Dataset) or data.dtype.kind not in "iu":
            raise UserError(f"{path}: dataset 'data' must hold integers, found dtype {getattr(data, 'dtype', '?')}")
        if data.ndim != 2:
            layout = "(num_samples, max_seq_len)" if self.loop_dim == 1 else "(max_seq_len, num_samples)"
            raise UserError(f"{path}: dataset 'data' must be 2-D {layout}, found shape {data.shape}")
        return data

    def _check_per_row(self) -> tuple[str, ...]:
        """The per-row datasets every file has (one per sample); one some files lack is an error."""
        present = []
        for name in ROW_DATASETS:
            holders = [path for path, handle in zip(self.files, self._handles) if name in handle]
            if holders and len(holders) < len(self.files):
                lacking = next(path for path in self.files if path not in holders)
                raise UserError(f"{holders[0]} has the per-row dataset {name!r} but {lacking} does not")
            for path, handle, size in zip(self.files, self._handles, self.sizes):
                if holders and handle[name].shape != (size,):
                    raise UserError(f"{path}: dataset {name!r} has shape {handle[name].shape}, expected ({size},)")
            if holders:
                present.append(name)
        return tuple(present)

    def _width(self, data: h5py.Dataset) -> int:
        return data.shape[1] if self.loop_dim == 1 else data.shape[0]

    def _count(self, data: h5py.Dataset) -> int:
        return data.shape[0] if self.loop_dim == 1 else data.shape[1]

    def _spans(self, start: int, stop: int) -> Iterator[tuple[int, int, int, int]]:
        """(file index, lo, hi, offset) of the pieces of samples [start, stop) in each file, in order."""
        offset = 0
        for index, size in enumerate(self.sizes):
            lo, hi = max(start - offset, 0), min(stop - offset, size)
            if lo < hi:
                yield index, lo, hi, offset
            offset += size

    def read(self, start: int, stop: int) -> np.ndarray:
        """Samples [start, stop) across files: (stop - start, max_seq_len) int32."""
        parts = []
        for index, lo, hi, offset in self._spans(start, stop):
            data = self._datasets[index]
            try:
                parts.append(data[lo:hi] if self.loop_dim == 1 else data[:, lo:hi].T)
            except OSError as error:  # a chunk past the end of a truncated file
                raise UserError(f"cannot read samples {offset + lo}..{offset + hi - 1} of {self.files[index]} "
                                f"({str(error).splitlines()[0]}): is it truncated?") from None
        return np.concatenate(parts).astype(np.int32, copy=False)

    def read_per_row(self, name: str, start: int, stop: int) -> list:
        """Per-row dataset `name` for samples [start, stop) across files, strings decoded."""
        values = [value for index, lo, hi, _ in self._spans(start, stop)
                  for value in self._handles[index][name][lo:hi].tolist()]
        return [value.decode() if isinstance(value, bytes) else value for value in values]

    def row_stop_sequences(self) -> list[tuple[int, ...]]:
        """Every stop sequence some row asks for (the `stop_sequences` dataset, read in slices), once each."""
        if "stop_sequences" not in self.per_row:
            return []
        found: dict[tuple[int, ...], None] = {}
        for start in range(0, self.num_samples, 65536):
            for text in self.read_per_row("stop_sequences", start, min(start + 65536, self.num_samples)):
                found.update(dict.fromkeys(self._stops(text)))
        return list(found)

    def request_variety(self) -> RequestVariety:
        """What the rows bring besides the job's options: their stop sequences, and whether some row samples or
        keeps a top-p set; every row's own option values checked against their declared ranges (read in slices)."""
        variety = RequestVariety(tuple(self.row_stop_sequences()))
        for name in ROW_OPTION_DATASETS:
            if name not in self.per_row or name not in BOUNDS:
                continue
            for start in range(0, self.num_samples, 65536):
                values = np.asarray(self.read_per_row(name, start, min(start + 65536, self.num_samples)))
                why = check_values(name, values)
                if why:
                    raise UserError(f"the data in {self.data_dir}: a row's {name} must be {why}")
                variety = variety.union(RequestVariety.of_rows({name: values[~is_missing(name, values)]}))
        return variety

    def distinct_values(self, name: str) -> list[str] | None:
        """Every value of per-row string dataset `name` (read in slices), once each; None without the dataset."""
        if name not in self.per_row:
            return None
        found: dict[str, None] = {}
        for start in range(0, self.num_samples, 65536):
            found.update(dict.fromkeys(str(v) for v in self.read_per_row(name, start,
                                                                           min(start + 65536, self.num_samples))))
        return list(found)

    def row_response_formats(self) -> list[str]:
        """Every response format some row asks for, once each."""
        return [value for value in self.distinct_values("response_format") or [] if value]

    def _stops(self, text: str) -> tuple[tuple[int, ...], ...]:
        """One `stop_sequences` entry (modelzoo/job/rows.py), or one error line."""
        sequences = stop_sequences_of(text)
        if sequences is None:
            raise UserError(f"the data in {self.data_dir}: a stop_sequences entry is not a JSON list of token-id "
                            f"lists: {text[:80]!r}")
        return sequences

    def batch(self, step: int) -> Batch:
        """The rows of global step `step` (1-based), dummy rows (all pad token) after the last sample."""
        start = (step - 1) * self.batch_size
        stop = min(start + self.batch_size, self.num_samples)
        real = stop - start
        rows = np.full((self.batch_size, self.max_seq_len), self.pad_token, dtype=np.int32)
        rows[:real] = self.read(start, stop)
        index = np.full(self.batch_size, -1, dtype=np.int64)
        index[:real] = np.arange(start, stop)
        batch = Batch(step=step, rows=rows, sample_index=index)
        for name in self.per_row:
            values = self.read_per_row(name, start, stop)
            if name == "stop_sequences":
                batch.columns[name] = [self._stops(text) for text in values] + [()] * (self.batch_size - real)
            else:
                batch.columns[name] = padded(name, values, self.batch_size)
        return batch

    def check_against_model(self, start_tokens: np.ndarray, vocab_size: int) -> None:
        """The data tool's attributes (start_token, vocab_size) must agree with the params and the model."""
        attrs = self.attrs
        if "start_token" in attrs and int(attrs["start_token"]) not in start_tokens:
            raise UserError(f"the data in {self.data_dir} was tokenized with start_token {int(attrs['start_token'])} "
                            f"but params model.start_token is {[int(t) for t in start_tokens]}")
        if "vocab_size" in attrs and int(attrs["vocab_size"]) > vocab_size:
            raise UserError(f"the data in {self.data_dir} was tokenized with a vocabulary of {int(attrs['vocab_size'])} "
                            f"tokens ({attrs.get('tokenizer', '?')}) but the model has {vocab_size}")

    def check_prompt_tokens(self, steps: list[int], vocab_size: int,
                            start_tokens: np.ndarray) -> tuple[int, int, int]:
        """Reads the samples of `steps` once, in large slices, and raises on the first prompt token
        outside 0..vocab_size-1 (what follows a row's first start token is never read as a prompt). Returns the
        shortest and longest prompt read and the prompt tokens of all of them ((0, 0, 0) where no row has one)."""
        shortest, longest, total = None, 0, 0
        for start, stop in self._sample_ranges(steps):
            rows = self.read(start, stop)  # (n, max_seq_len)
            starts, has_start = start_positions(rows, start_tokens)
            prompt_end = np.where(has_start, starts, 0)  # no start token: no prompt
            in_prompt = np.arange(rows.shape[1])[None, :] < prompt_end[:, None]
            bad = in_prompt & ((rows < 0) | (rows >= vocab_size))
            if bad.any():
                row, column = np.argwhere(bad)[0]
                raise UserError(f"sample {start + row}: token id {rows[row, column]} in its prompt is outside the "
                                f"model's vocabulary (0..{vocab_size - 1})")
            lengths = prompt_end[prompt_end > 0]
            if lengths.size:
                shortest = int(lengths.min()) if shortest is None else min(shortest, int(lengths.min()))
                longest = max(longest, int(lengths.max()))
                total += int(lengths.sum())
        return shortest or 0, longest, total

    def _sample_ranges(self, steps: list[int]) -> Iterator[tuple[int, int]]:
        """[start, stop) sample ranges covering `steps`: runs of consecutive steps, cut to about 8 MiB
        (the check's temporaries are a few times that: small next to the model, flat in the data size)."""
        most = max(1, (8 << 20) // (4 * self.max_seq_len))
        runs: list[list[int]] = []  # [start, stop) of consecutive steps' samples
        for step in sorted(steps):
            start, stop = (step - 1) * self.batch_size, min(step * self.batch_size, self.num_samples)
            if runs and runs[-1][1] == start:
                runs[-1][1] = stop
            else:
                runs.append([start, stop])
        for start, stop in runs:
            for lo in range(start, stop, most):
                yield lo, min(lo + most, stop)

    def batches(self, steps: list[int]) -> Iterator[Batch]:
        """The batches of `steps`, in the given order."""
        for step in steps:
            yield self.batch(step)

    def close(self) -> None:
        """Closes the open files."""
        for handle in self._handles:
            handle.close()
