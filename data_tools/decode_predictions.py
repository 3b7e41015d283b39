#!/usr/bin/env python
"""Turns the prediction files of a zoo-infer inference run into readable JSONL.

    python data_tools/decode_predictions.py --model_dir runs/smollm2 \\
        --tokenizer models/smollm2-135m-instruct --output completions.jsonl

Reads MODEL_DIR/artifacts/predictions/predictions_<global_step>.npz in step order and writes one
JSON line per real sample (dummy padding rows are skipped), in increasing sample_index order:

    {"sample_index": 0, "sample_id": "q1", "prompt": "...", "completion": "...", "num_generated": 12,
     "stop_reason": "stop_sequence"}

Rows of scoring data (create_inference_h5.py --continuation_field) say `stop_reason` "scored", their
`prompt` is the context and their `completion` the continuation, with its `loglikelihood` (the sum),
`is_greedy` and each token's `logprobs`.
(`sample_id` where the data has ids; `sample`, the row's number among its prompt's samples, where the data
has several per prompt (create_inference_h5.py --n, or an OpenAI request's n); `adapter`, the LoRA adapter the
row ran with, where the job had model.adapters; `logprobs`, one per generated token, with --logprobs). The prompt
and completion are decoded with the given tokenizer; --skip_special_tokens drops tokens such as
<|im_start|> from both.

--format openai_batch answers an OpenAI batch file made into data with create_inference_h5.py --format
openai_batch: one line per request of that file, in its order, in the OpenAI batch output format
(data_tools/openai_batch.py), error records included. The requests are read from the run's data
(inference_input.data_dir of MODEL_DIR/artifacts/params_inference.yaml, or --data_dir).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, TextIO

import numpy as np

import h5py
import yaml

from data_tools.openai_batch import response_line
from data_tools.prompts import load_tokenizer
from modelzoo.errors import UserError
from modelzoo.job.predictions import OPTIONAL_PER_ROW_KEYS, PER_ROW_KEYS, REQUIRED_KEYS, SEQUENCE_KEYS

PREDICTIONS_SUBDIR = Path("artifacts") / "predictions"
FILE_PATTERN = re.compile(r"^predictions_(\d+)\.npz$")
# Keys every file must have (modelzoo/job/predictions.py owns the schema); `loop_dim` is optional (absent means 1).
# sample_index of the rows that only pad the last batch.
DUMMY_INDEX = -1


@dataclass
class PredictionBatch:
    """The contents of one predictions_<step>.npz, with predictions as (batch_size, max_seq_len)."""

    path: Path
    global_step: int
    predictions: np.ndarray
    sample_index: np.ndarray
    prompt_length: np.ndarray
    num_generated: np.ndarray
    stop_reason: np.ndarray
    sample_id: np.ndarray | None = None  # where the data has ids
    sample: np.ndarray | None = None  # where the data has several samples of a prompt: each row's, from 0
    is_greedy: np.ndarray | None = None  # scoring data: whether greedy decoding gives each row's continuation
    adapter: np.ndarray | None = None  # a job with LoRA adapters: each row's ("" for the bare base model)
    logprobs: np.ndarray | None = None  # (batch_size, max_seq_len) float32, where the run has them
    top_logprob_ids: np.ndarray | None = None  # (batch_size, max_seq_len, K) int32, with model.top_logprobs K
    top_logprobs: np.ndarray | None = None  # (batch_size, max_seq_len, K) float32


def find_prediction_files(model_dir: Path | str) -> list[Path]:
    """Returns the predictions_<step>.npz files of a run, sorted by their integer step."""
    folder = Path(model_dir) / PREDICTIONS_SUBDIR
    if not folder.is_dir():
        raise UserError(f"no predictions folder {folder} (is --model_dir the run's model_dir?)")
    matches = [(int(m.group(1)), p) for p in folder.iterdir() if (m := FILE_PATTERN.match(p.name))]
    if not matches:
        raise UserError(f"no predictions_<step>.npz files in {folder}")
    # Numeric, not lexicographic: predictions_10 comes after predictions_9.
    return [path for _, path in sorted(matches)]


def load_batch(path: Path) -> PredictionBatch:
    """Loads and checks one predictions file; predictions are transposed back if loop_dim is 0."""
    try:
        # allow_pickle=False: a predictions file is data, never code to run.
        with np.load(path, allow_pickle=False) as npz:
            for key in REQUIRED_KEYS:
                if key not in npz.files:
                    raise UserError(
                        f"{path}: missing key {key!r}; decoding needs the per-row keys zoo-infer writes "
                        f"({', '.join(REQUIRED_KEYS)})"
                    )
            arrays = {key: npz[key] for key in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise UserError(f"{path}: cannot read ({exc})") from None
    loop_dim = int(arrays["loop_dim"]) if "loop_dim" in arrays else 1
    if loop_dim not in (0, 1):
        raise UserError(f"{path}: loop_dim must be 0 or 1, got {loop_dim}")
    if arrays["predictions"].ndim != 2:
        raise UserError(f"{path}: predictions must be 2-D, got shape {arrays['predictions'].shape}")
    sequences = {key: np.swapaxes(arrays[key], 0, 1) if loop_dim == 0 else arrays[key]
                 for key in SEQUENCE_KEYS if key in arrays}
    for key, array in sequences.items():
        if array.shape[:2] != sequences["predictions"].shape or array.ndim != (3 if key.startswith("top_") else 2):
            raise UserError(f"{path}: {key} has shape {arrays[key].shape}, expected {arrays['predictions'].shape}"
                            + (" plus the top_logprobs count" if key.startswith("top_") else ""))
    batch = PredictionBatch(
        path=path,
        global_step=int(arrays["global_step"]),
        **sequences,
        **{key: arrays[key] for key in PER_ROW_KEYS + OPTIONAL_PER_ROW_KEYS if key in arrays},
    )
    check_batch(batch)
    return batch


def check_batch(batch: PredictionBatch) -> None:
    """Raises a UserError if the per-row arrays do not match the predictions' shape."""
    batch_size, max_seq_len = batch.predictions.shape
    for key in PER_ROW_KEYS + OPTIONAL_PER_ROW_KEYS:
        if getattr(batch, key) is None:
            continue
        shape = getattr(batch, key).shape
        if shape != (batch_size,):
            raise UserError(f"{batch.path}: {key} has shape {shape}, expected ({batch_size},)")
    real = batch.sample_index != DUMMY_INDEX
    ends = batch.prompt_length.astype(np.int64) + batch.num_generated.astype(np.int64)
    bad = real & ((batch.prompt_length < 0) | (batch.num_generated < 0) | (ends > max_seq_len))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise UserError(
            f"{batch.path}: row {row}: prompt_length {int(batch.prompt_length[row])} + num_generated "
            f"{int(batch.num_generated[row])} does not fit in max_seq_len {max_seq_len}"
        )


def format_steps(steps: Sequence[int]) -> str:
    """Formats sorted steps compactly: [3, 4, 5, 8] -> '3-5, 8'."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def missing_steps(steps: Sequence[int]) -> list[int]:
    """Returns the steps absent from 1 (or the lowest step, if lower) up to the highest one."""
    first = min(min(steps), 1)
    return sorted(set(range(first, max(steps) + 1)) - set(steps))


def as_text(value: Any) -> str:
    """Returns a stop_reason entry as str, whether it was saved as unicode or as bytes."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def likeliest_pieces(batch: PredictionBatch, row: int, start: int, end: int, tokenizer: Any) -> list[list[tuple[str, float]]]:
    """Each generated position's likeliest tokens as (text, log-probability), descending (model.top_logprobs)."""
    return [[(tokenizer.decode([int(i)]), float(v)) for i, v in zip(ids, values)]
            for ids, values in zip(batch.top_logprob_ids[row, start:end], batch.top_logprobs[row, start:end])]


def decode_batch(batch: PredictionBatch, tokenizer: Any, skip_special_tokens: bool,
                 logprobs: bool = False) -> list[dict]:
    """Returns one record per real row of a batch (dummy rows skipped); with `logprobs`, each generated
    token's log-probability too (the run must have written them), and where the run kept them
    (model.top_logprobs) the likeliest tokens at each position, as {"token", "token_id", "logprob"} lists."""
    if logprobs and batch.logprobs is None:
        raise UserError(f"{batch.path}: no logprobs in this run's files (set model.logprobs: true in the params)")
    records = []
    for row in range(batch.predictions.shape[0]):
        index = int(batch.sample_index[row])
        if index == DUMMY_INDEX:
            continue
        start = int(batch.prompt_length[row])
        end = start + int(batch.num_generated[row])
        ids = batch.predictions[row]
        records.append(
            {
                "sample_index": index,
                **({"sample_id": as_text(batch.sample_id[row])} if batch.sample_id is not None else {}),
                **({"sample": int(batch.sample[row])} if batch.sample is not None else {}),
                **({"adapter": as_text(batch.adapter[row])} if batch.adapter is not None else {}),
                "prompt": tokenizer.decode(ids[:start].tolist(), skip_special_tokens=skip_special_tokens),
                "completion": tokenizer.decode(ids[start:end].tolist(), skip_special_tokens=skip_special_tokens),
                "num_generated": end - start,
                "stop_reason": as_text(batch.stop_reason[row]),
                **({"logprobs": batch.logprobs[row, start:end].tolist()} if logprobs else {}),
            }
        )
        if as_text(batch.stop_reason[row]) == "scored":  # scoring data: the completion is the scored continuation
            values = batch.logprobs[row, start:end]
            records[-1].update({"loglikelihood": float(values.astype(np.float64).sum()),
                                "is_greedy": bool(batch.is_greedy[row]), "logprobs": values.tolist()})
        if logprobs and batch.top_logprob_ids is not None:
            records[-1]["top_logprobs"] = [
                [{"token": text, "token_id": int(i), "logprob": value}
                 for (text, value), i in zip(pieces, batch.top_logprob_ids[row, position])]
                for position, pieces in zip(range(start, end), likeliest_pieces(batch, row, start, end, tokenizer))]
    return records


def load_run(model_dir: Path | str) -> list[PredictionBatch]:
    """Loads and checks every prediction file of a run, in step order; warns about missing steps.

    A gap is a warning, not an error: a stopped run still has useful predictions.
    """
    batches = sorted((load_batch(path) for path in find_prediction_files(model_dir)), key=lambda b: b.global_step)
    gaps = missing_steps([batch.global_step for batch in batches])
    if gaps:
        print(
            f"warning: predictions for global step(s) {format_steps(gaps)} are missing "
            "(partial run?); their samples are not in the output",
            file=sys.stderr,
        )
    return batches


def decode_batches(batches: Sequence[PredictionBatch], tokenizer: Any, skip_special_tokens: bool = False,
                   logprobs: bool = False) -> list[dict]:
    """Returns the decoded records of the batches (in step order), sorted by sample_index."""
    by_index: dict[int, dict] = {}
    for batch in batches:
        for record in decode_batch(batch, tokenizer, skip_special_tokens, logprobs):
            if record["sample_index"] in by_index:
                # The later step wins, as it does when a run is resumed over older files.
                print(
                    f"warning: sample_index {record['sample_index']} appears more than once; "
                    f"keeping the one from {batch.path.name}",
                    file=sys.stderr,
                )
            by_index[record["sample_index"]] = record
    return [by_index[index] for index in sorted(by_index)]


def decode_predictions(model_dir: Path | str, tokenizer: Any, skip_special_tokens: bool = False) -> list[dict]:
    """Returns the decoded records of all prediction files of a run, sorted by sample_index."""
    return decode_batches(load_run(model_dir), tokenizer, skip_special_tokens)


def read_requests(model_dir: Path, data_dir: Path | None) -> list[dict]:
    """The `requests` table of the run's data (every .h5 file of its data_dir, in order), each request's
    row made a global sample_index."""
    if data_dir is None:
        params_path = Path(model_dir) / "artifacts" / "params_inference.yaml"
        try:
            data_dir = Path(yaml.safe_load(params_path.read_text())["inference_input"]["data_dir"])
        except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
            raise UserError(f"cannot find the run's data from {params_path} ({exc}); pass --data_dir") from None
    files = sorted(Path(data_dir).glob("*.h5"))
    if not files:
        raise UserError(f"no .h5 file in {data_dir} (the run's data, which holds its requests); pass --data_dir")
    requests, offset = [], 0
    for path in files:
        with h5py.File(path, "r") as h5:
            if "requests" not in h5:
                raise UserError(f"{path} holds no OpenAI batch requests: make it with create_inference_h5.py "
                                "--format openai_batch")
            for entry in h5["requests"][:]:
                request = json.loads(as_text(entry))
                request["sample_index"] = offset + request["row"] if request["row"] >= 0 else -1
                requests.append(request)
            offset += len(h5["prompt_lengths"])
    return requests


def openai_records(batches: Sequence[PredictionBatch], requests: Sequence[dict], tokenizer: Any) -> list[dict]:
    """One OpenAI batch output line per request, in the requests' order."""
    rows = {}
    for batch in batches:  # the later step wins, as in decode_batches
        for row, index in enumerate(batch.sample_index.tolist()):
            if index != DUMMY_INDEX:
                rows[index] = (batch, row)
    created = int(max((b.path.stat().st_mtime for b in batches), default=0))
    lines = []
    for number, request in enumerate(requests, start=1):
        first = request["sample_index"]
        samples = [rows.get(first + k) for k in range(request.get("n", 1))] if first >= 0 else [None]
        completions = None if None in samples else [_completion(*sample, request, tokenizer) for sample in samples]
        lines.append(response_line(number, request, completions, created))
    return lines


def _completion(batch: PredictionBatch, row: int, request: dict, tokenizer: Any) -> dict:
    """One sample of a request, decoded for `response_line`."""
    start, count = int(batch.prompt_length[row]), int(batch.num_generated[row])
    reason = as_text(batch.stop_reason[row])
    if reason == "scored":  # an echo request: its prompt, every token after the first scored
        return _scored_prompt(batch, row, start + count, tokenizer)
    text = tokenizer.decode(batch.predictions[row, start:start + count].tolist(), skip_special_tokens=True)
    ended = next((stop for stop in request.get("stop", []) if text.endswith(stop)), "")
    if reason == "stop_sequence" and ended:  # OpenAI leaves the stop string out (a special token is already)
        text = text[:-len(ended)]
    completion = {"text": text, "finish_reason": "stop" if reason == "stop_sequence" else "length",
                  "prompt_tokens": start, "completion_tokens": count}
    if batch.logprobs is not None:
        ids = batch.predictions[row, start:start + count].tolist()
        completion["token_logprobs"] = [(tokenizer.decode([i]), float(v))
                                        for i, v in zip(ids, batch.logprobs[row, start:start + count])]
    if batch.top_logprob_ids is not None:
        completion["top_logprobs"] = likeliest_pieces(batch, row, start, start + count, tokenizer)
    return completion


def _scored_prompt(batch: PredictionBatch, row: int, end: int, tokenizer: Any) -> dict:
    """A scored prompt of `end` tokens decoded for `response_line`: the prompt as the text, and each token's
    log-probability (the first has none, as in the OpenAI API)."""
    ids = batch.predictions[row, :end].tolist()
    completion = {"text": tokenizer.decode(ids, skip_special_tokens=True), "finish_reason": "length",
                  "prompt_tokens": end, "completion_tokens": 0,
                  "token_logprobs": [(tokenizer.decode([i]), None if at == 0 else float(batch.logprobs[row, at]))
                                     for at, i in enumerate(ids)]}
    if batch.top_logprob_ids is not None:
        completion["top_logprobs"] = [None] + likeliest_pieces(batch, row, 1, end, tokenizer)
    return completion


def write_jsonl(records: Sequence[dict], out: TextIO) -> None:
    """Writes one JSON object per line, keeping non-ASCII text readable."""
    for record in records:
        out.write(json.dumps(record, ensure_ascii=False) + "\n")


def build_parser() -> argparse.ArgumentParser:
    """Returns the argument parser; every option is documented in --help."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model_dir", type=Path, required=True,
        help="the run's model_dir; files are read from MODEL_DIR/artifacts/predictions/",
    )
    parser.add_argument("--tokenizer", required=True, help="Hugging Face checkpoint or tokenizer folder used for the run")
    parser.add_argument("--output", type=Path, default=None, help="JSONL file to write (default: stdout)")
    parser.add_argument(
        "--skip_special_tokens", action="store_true",
        help="leave special tokens (e.g. <|im_start|>, <|im_end|>) out of the decoded text",
    )
    parser.add_argument("--logprobs", action="store_true", help="jsonl: add each generated token's log-probability "
                        "(`logprobs`, a list), and with model.top_logprobs the likeliest tokens at each position "
                        "(`top_logprobs`); the run needs model.logprobs: true. openai_batch answers carry them for "
                        "the requests that asked (logprobs: true, top_logprobs: N)")
    parser.add_argument("--format", choices=("jsonl", "openai_batch"), default="jsonl",
                        help="jsonl: one record per sample; openai_batch: the OpenAI batch output of the requests the "
                        "data was made from (default: jsonl)")
    parser.add_argument("--data_dir", type=Path, default=None, help="openai_batch: the run's data folder (default: "
                        "inference_input.data_dir of MODEL_DIR/artifacts/params_inference.yaml)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Decodes the run's predictions and writes them; returns the number of records."""
    # The files are read and checked first, so a bad run fails fast, before the slow tokenizer load.
    batches = load_run(args.model_dir)
    requests = read_requests(args.model_dir, args.data_dir) if args.format == "openai_batch" else None
    tokenizer = load_tokenizer(args.tokenizer)
    if requests is None:
        records = decode_batches(batches, tokenizer, args.skip_special_tokens, args.logprobs)
    else:
        records = openai_records(batches, requests, tokenizer)
    if args.output is None:
        write_jsonl(records, sys.stdout)
    else:
        try:
            with open(args.output, "w", encoding="utf-8", newline="\n") as out:
                write_jsonl(records, out)
        except OSError as exc:
            raise UserError(f"cannot write {args.output}: {exc.strerror}") from None
    return len(records)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 for a problem in the input)."""
    args = build_parser().parse_args(argv)
    try:
        count = run(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # On stderr, so that stdout stays pure JSONL when no --output is given.
    print(f"decoded {count} sample(s) to {args.output or 'stdout'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
