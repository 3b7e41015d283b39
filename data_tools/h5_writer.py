"""data.h5 written chunk by chunk: rows are appended to resizable datasets, so a table of millions of
prompts never has to be in memory at once, and the file appears under its name only when complete."""
from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from types import TracebackType
from typing import Any, Sequence

import h5py
import numpy as np

from modelzoo.errors import UserError
from modelzoo.files import describe
from modelzoo.job.rows import DATA, PROMPT_LENGTHS

OUTPUT_NAME = "data.h5"
CHUNK_ROWS = 1024  # rows per HDF5 chunk of `data`: the runner reads a batch as a few chunks


class RowsWriter:
    """Writes `data` (num_samples, max_seq_len) int32 (its transpose with loop_dim 0), `prompt_lengths` and
    any per-row datasets (`sample_id` strings, `max_tokens` ints, ...) as rows arrive; `finish` adds the
    attributes and whole-file tables and renames the file into place. Leaving the `with` block by an
    exception removes the temporary file."""

    def __init__(self, output_dir: Path, max_seq_len: int, loop_dim: int) -> None:
        self.created = not output_dir.exists()  # removed again if nothing is written
        self.output_dir = output_dir
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UserError(f"cannot create output folder {output_dir}: {describe(error)}") from None
        self.target = output_dir / OUTPUT_NAME
        # A temporary name that does not end in .h5, so a reader globbing the folder never sees a
        # half-written file; os.replace then swaps it in whole. The pid keeps two concurrent runs
        # apart, and letting h5py create the file keeps the user's umask (mkstemp would force 0600).
        self.temporary = output_dir / f".{OUTPUT_NAME}.{os.getpid()}.tmp"
        self.max_seq_len, self.loop_dim, self.rows = max_seq_len, loop_dim, 0
        try:
            # No chunk cache: each append reaches the disk at once, so a full disk fails that call (HDF5
            # would otherwise fail while closing, and leave the file object unusable).
            self.h5 = h5py.File(self.temporary, "w", rdcc_nbytes=0)
            if loop_dim == 0:  # stored transposed: rows are columns
                shape, most, chunks = (max_seq_len, 0), (max_seq_len, None), (max_seq_len, CHUNK_ROWS)
            else:
                shape, most, chunks = (0, max_seq_len), (None, max_seq_len), (CHUNK_ROWS, max_seq_len)
            self.h5.create_dataset(DATA, shape=shape, maxshape=most, dtype=np.int32, chunks=chunks)
            self.h5.create_dataset(PROMPT_LENGTHS, shape=(0,), maxshape=(None,), dtype=np.int32,
                                   chunks=(CHUNK_ROWS,))
        except OSError as error:
            self._discard()
            raise UserError(f"cannot write {self.target}: {describe(error)}") from None

    def __enter__(self) -> RowsWriter:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        if kind is not None:
            self._discard()

    def _discard(self) -> None:
        if getattr(self, "h5", None) is not None and self.h5.id.valid:
            try:
                self.h5.close()
            except (OSError, RuntimeError):  # the failure being reported already; the file goes anyway
                pass
        self.temporary.unlink(missing_ok=True)
        if self.created:
            try:
                self.output_dir.rmdir()  # only if still empty
            except OSError:
                pass

    def append(self, data: np.ndarray, prompt_lengths: np.ndarray, per_row: dict[str, Sequence | np.ndarray]) -> None:
        """Appends rows: data (n, max_seq_len), prompt_lengths (n,), per_row {name: n values}; the per-row
        names must be the same in every call (lists of str become UTF-8 string datasets)."""
        count = len(prompt_lengths)
        begin, end = self.rows, self.rows + count
        try:
            self._grow(DATA, end, axis=1 if self.loop_dim == 0 else 0)
            if self.loop_dim == 0:
                self.h5[DATA][:, begin:end] = data.T
            else:
                self.h5[DATA][begin:end] = data
            self._grow(PROMPT_LENGTHS, end)[begin:end] = prompt_lengths.astype(np.int32)
            for name, values in per_row.items():
                if name not in self.h5:
                    if begin:
                        raise ValueError(f"per-row dataset {name!r} starts after row {begin}")
                    strings = isinstance(values, list)
                    self.h5.create_dataset(name, shape=(0,), maxshape=(None,), chunks=(CHUNK_ROWS,),
                                           dtype=h5py.string_dtype() if strings else np.asarray(values).dtype)
                self._grow(name, end)[begin:end] = values
        except (OSError, RuntimeError) as error:  # a full disk, a quota
            raise UserError(f"cannot write {self.target}: {describe(as_os_error(error))}") from None
        self.rows = end

    def _grow(self, name: str, size: int, axis: int = 0) -> h5py.Dataset:
        dataset = self.h5[name]
        dataset.resize(size, axis=axis)
        return dataset

    def finish(self, attrs: dict[str, Any], tables: dict[str, list[str]] | None = None) -> Path:
        """Writes the attributes and whole-file string tables, closes the file and renames it into place."""
        try:
            for key, value in attrs.items():
                self.h5.attrs[key] = value
            for name, values in (tables or {}).items():
                self.h5.create_dataset(name, data=values, dtype=h5py.string_dtype())
            self.h5.close()
            os.replace(self.temporary, self.target)
        except (OSError, RuntimeError) as error:
            self._discard()
            raise UserError(f"cannot write {self.target}: {describe(as_os_error(error))}") from None
        return self.target


def as_os_error(error: Exception) -> OSError:
    """An HDF5 write failure as the OSError it reports ("errno = 28" in h5py's RuntimeError text)."""
    if isinstance(error, OSError) and error.errno:
        return error
    found = re.search(r"errno = (\d+)", str(error))
    number = int(found.group(1)) if found else errno.EIO
    return OSError(number, os.strerror(number))
