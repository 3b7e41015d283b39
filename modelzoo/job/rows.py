"""The .h5 row format, declared once: what data_tools/create_inference_h5.py writes and modelzoo/job/data.py reads.

A file holds `data`, an integer dataset of shape (num_samples, max_seq_len) ((max_seq_len, num_samples) with
loop_dim 0): each row a prompt's token ids, then the start token from position len(prompt) to the end (the room
for the completion); `prompt_lengths` (num_samples,) int32; and, where the input brings them, per-row datasets of
shape (num_samples,), listed in ROW_DATASETS with their dtype and the value of a row that brings none:
- each GenerationOptions field declared with a row dataset (modelzoo/generation/options.py): the row's own value,
  `stop_sequences` as JSON token-id lists;
- `sample_id`: the user's id; `sample`: the row's number among the consecutive rows of one prompt's samples;
  `continuation_length`: scoring data, the row's last that many prompt tokens are a continuation to score after the
  rest (0: a row to generate from); `adapter`: the LoRA adapter the row runs with ("" : the default).
A batch's dummy rows (after the last sample) take each dataset's missing value too. Torch-free: the data tool
imports it.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from modelzoo.generation.options import BOUNDS, ROW_OPTION_DATASETS, RowDataset

DATA, PROMPT_LENGTHS = "data", "prompt_lengths"
ROW_DATASETS: dict[str, RowDataset] = {
    "sample_id": RowDataset("str", ""),
    **ROW_OPTION_DATASETS,
    "sample": RowDataset("int32", -1),
    "continuation_length": RowDataset("int32", 0),
    "adapter": RowDataset("str", ""),
}


def is_missing(name: str, values: Any) -> Any:
    """Where `values` (a value, or an array) of dataset `name` are its missing marker."""
    missing = ROW_DATASETS[name].missing
    if isinstance(missing, float) and np.isnan(missing):
        return np.isnan(values)
    return values == missing


def column(name: str, values: Sequence | np.ndarray) -> np.ndarray | list[str]:
    """Values of dataset `name` as written: a list of str for a string dataset, else an array of its dtype."""
    dtype = ROW_DATASETS[name].dtype
    return [str(v) for v in values] if dtype == "str" else np.asarray(values, dtype=dtype)


def padded(name: str, values: list, size: int) -> np.ndarray:
    """A batch's column of dataset `name`: `values` (read from the file, strings decoded), then the missing value
    up to `size` rows (the dummy rows)."""
    values = column(name, list(values) + [ROW_DATASETS[name].missing] * (size - len(values)))
    return np.array(values, dtype=str) if isinstance(values, list) else values


def check_values(name: str, values: np.ndarray) -> str | None:
    """Why some of the values of a row option's dataset are out of its declared range (None: they are all fine):
    each must be the option's missing marker or a value in range (an integer for an integer option)."""
    bound = BOUNDS.get(name)
    if bound is None:
        return None
    kinds = "iu" if bound.integer else "fiu"
    missing = ROW_DATASETS[name].missing
    wanted = f"{bound.text()} ({'NaN' if missing != missing else missing}: the params' {name})"
    if values.dtype.kind not in kinds:
        return f"{wanted}, got {values[0].item()!r}"
    ok = is_missing(name, values) | bound.holds(values)
    return None if ok.all() else f"{wanted}, got {values[~ok][0].item()!r}"


def stop_sequences_of(text: str) -> tuple[tuple[int, ...], ...] | None:
    """One `stop_sequences` entry, a JSON list of non-empty token-id lists, as tuples ("" : none); None where it is
    not one."""
    if text == "":
        return ()
    try:
        sequences = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(sequences, list) and all(isinstance(s, list) and s and all(
            isinstance(t, int) and not isinstance(t, bool) for t in s) for s in sequences)):
        return None
    return tuple(tuple(s) for s in sequences)


def repeat_rows(values: np.ndarray | list, counts: np.ndarray | int) -> np.ndarray | list:
    """Each value repeated counts[i] times (or `counts` times each), in order: an array or a list alike."""
    counts = np.broadcast_to(counts, (len(values),))
    if isinstance(values, np.ndarray):
        return np.repeat(values, counts, axis=0)
    return [value for value, count in zip(values, counts) for _ in range(int(count))]


def repeated_for_samples(per_row: dict[str, Any], counts: np.ndarray) -> dict[str, Any]:
    """The per-row datasets of some prompts with each prompt's row repeated for its samples (counts (prompts,)), and
    the `sample` dataset numbering a prompt's rows 0..n-1."""
    repeated = {name: repeat_rows(values, counts) for name, values in per_row.items()}
    repeated["sample"] = column("sample", np.concatenate([np.arange(n) for n in counts]))
    return repeated
