#!/usr/bin/env python
"""Turns a file of prompts into the HDF5 file that a zoo-infer inference run reads.

Each prompt becomes one int32 row of length --max_seq_len: the prompt's token ids, then the
start token at position len(prompt) and on to the end of the row. The runner generates from the
first start token on; everything after the prompt is room for the completion.

    python data_tools/create_inference_h5.py --input data_tools/examples/prompts.jsonl \\
        --tokenizer models/smollm2-135m-instruct --chat_template --max_seq_len 256 \\
        --output_dir data/prompts

Input formats, chosen by the file suffix:
  .jsonl  one JSON object per line; the prompt is in --field (blank lines are skipped)
  .txt    one prompt per line; every line is a row, blank ones included
  .csv    a header row; the prompt is in --column

The output folder gets data.h5 with the datasets `data` and `prompt_lengths` and attributes that
record how it was made. A YAML snippet for the params file is printed at the end.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import h5py
import numpy as np
import yaml

from modelzoo import __version__
from modelzoo.errors import UserError
from modelzoo.files import describe

TOOL_NAME = "zoo-infer create_inference_h5"
OUTPUT_NAME = "data.h5"
SUFFIXES = (".jsonl", ".txt", ".csv")
INT32_MAX = int(np.iinfo(np.int32).max)
# Offending rows listed in an error message before "and N more".
MAX_LISTED_ROWS = 10


# --------------------------------------------------------------------------------------------
# Reading prompts
# --------------------------------------------------------------------------------------------


def read_jsonl_prompts(path: Path, field: str) -> list[str]:
    """Returns the string in `field` of every JSON object line of a .jsonl file."""
    prompts = []
    for line_no, line in enumerate(read_text(path).splitlines(), start=1):
        # A blank line is not a record (editors often leave one at the end); skipping it keeps the
        # rows aligned with the records, which is what users count.
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: line {line_no} is not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise UserError(f"{path}: line {line_no} is not a JSON object")
        if field not in record:
            raise UserError(f"{path}: line {line_no} has no field {field!r} (use --field to pick another)")
        value = record[field]
        if not isinstance(value, str):
            raise UserError(f"{path}: line {line_no}: field {field!r} is a {type(value).__name__}, not a string")
        prompts.append(value)
    return prompts


def read_txt_prompts(path: Path) -> list[str]:
    """Returns every line of a .txt file as one prompt, blank lines included."""
    # splitlines() drops the final newline without adding an empty row, and keeps blank lines in
    # the middle so row i of the output is line i of the input.
    return read_text(path).splitlines()


def read_csv_prompts(path: Path, column: str) -> list[str]:
    """Returns the values of `column` of a .csv file with a header row."""
    # utf-8-sig strips the byte-order mark that spreadsheet programs put before the header.
    with open(path, newline="", encoding="utf-8-sig") as handle:
        try:
            reader = csv.DictReader(handle)
            columns = reader.fieldnames or []
            if column not in columns:
                existing = ", ".join(repr(name) for name in columns) or "none"
                raise UserError(f"{path}: no column {column!r} (columns: {existing}; use --column to pick one)")
            # A short row has no value for the column (None): it is an empty prompt, still a row.
            return [row[column] or "" for row in reader]
        except UnicodeDecodeError as exc:
            raise UserError(f"{path}: not UTF-8 text ({exc.reason})") from None
        except csv.Error as exc:
            raise UserError(f"{path}: malformed CSV ({exc})") from None


def read_text(path: Path) -> str:
    """Returns the contents of a UTF-8 text file, as a UserError if it cannot be decoded."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason})") from None


def read_prompts(path: Path | str, field: str = "prompt", column: str = "prompt") -> list[str]:
    """Reads the prompts of a .jsonl, .txt or .csv file (format chosen by suffix), in file order."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise UserError(f"{path}: unsupported input suffix {path.suffix!r} (use one of {', '.join(SUFFIXES)})")
    if not path.is_file():
        raise UserError(f"input file not found: {path}")
    if suffix == ".jsonl":
        prompts = read_jsonl_prompts(path, field)
    elif suffix == ".txt":
        prompts = read_txt_prompts(path)
    else:
        prompts = read_csv_prompts(path, column)
    if not prompts:
        raise UserError(f"{path}: no prompts found")
    return prompts


# --------------------------------------------------------------------------------------------
# Tokenizing
# --------------------------------------------------------------------------------------------


def no_tokenizer(path: Path, needs: str) -> UserError:
    """The error for a folder without the tokenizer files: what it needs and what it holds."""
    found = sorted(entry.name for entry in path.iterdir())
    listed = ", ".join(found[:12]) + (f" and {len(found) - 12} more" if len(found) > 12 else "")
    return UserError(f"no tokenizer in {path}: it needs {needs} (found: {listed or 'nothing'})")


def load_tokenizer(path: Path | str) -> Any:
    """Loads a Hugging Face tokenizer from a local checkpoint or tokenizer folder: tokenizer.json, or
    the vocabulary files of the tokenizer class it names (transformers 5 otherwise builds an empty
    tokenizer for some classes, with no error)."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"tokenizer folder not found: {path}")
    # Imported here so that --help and argument errors do not pay for importing transformers.
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        if not (path / "tokenizer.json").is_file():
            raise no_tokenizer(path, "tokenizer.json, or tokenizer_config.json with the vocabulary files of its "
                                     "tokenizer class") from None
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"could not load a tokenizer from {path}: {first_line}") from None
    vocabulary = [name for key, name in getattr(tokenizer, "vocab_files_names", {}).items()
                  if key in ("vocab_file", "merges_file") and not (path / name).is_file()]
    if vocabulary and not (path / "tokenizer.json").is_file():
        raise no_tokenizer(path, f"tokenizer.json, or the vocabulary files of {type(tokenizer).__name__}: "
                                 f"{', '.join(vocabulary)}")
    return tokenizer


def tokenize_prompts(tokenizer: Any, prompts: Sequence[str], chat_template: bool) -> list[list[int]]:
    """Returns the token ids of each prompt, optionally wrapped in the tokenizer's chat template."""
    if not chat_template:
        # The tokenizer's own default (add_special_tokens=True) adds a BOS where the model expects one.
        return [list(ids) for ids in tokenizer(list(prompts))["input_ids"]]
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError("--chat_template was given but the tokenizer has no chat template")
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        for prompt in prompts
    ]
    # The template already writes every special token the model expects; adding them again would
    # put e.g. a second BOS in front.
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


# --------------------------------------------------------------------------------------------
# Building rows
# --------------------------------------------------------------------------------------------


def format_rows(rows: Sequence[tuple[int, int]], what: str) -> str:
    """Formats (1-based row, length) pairs as 'row 3 (300 tokens), ...', the first few only."""
    shown = ", ".join(f"row {row} ({length} {what})" for row, length in rows[:MAX_LISTED_ROWS])
    if len(rows) > MAX_LISTED_ROWS:
        shown += f" and {len(rows) - MAX_LISTED_ROWS} more"
    return shown


def build_rows(
    token_lists: Sequence[Sequence[int]],
    max_seq_len: int,
    start_token: int,
    min_new_tokens: int = 1,
    truncate: str = "none",
) -> tuple[np.ndarray, np.ndarray, int]:
    """Packs prompts into rows: (data int32 (N, max_seq_len), prompt_lengths int32 (N,), num truncated).

    Row i holds prompt i, then `start_token` from position len(prompt) to the end. A prompt may
    use at most max_seq_len - min_new_tokens positions; longer ones are cut from the left when
    truncate == "left" (the end of a prompt is what the completion continues) or are an error.
    """
    if truncate not in ("none", "left"):
        raise UserError(f"truncate must be 'none' or 'left', not {truncate!r}")
    if not token_lists:
        raise UserError("no prompts to write")
    room = max_seq_len - min_new_tokens
    too_long = [(row, len(ids)) for row, ids in enumerate(token_lists, start=1) if len(ids) > room]
    if too_long and truncate != "left":
        raise UserError(
            f"{len(too_long)} prompt(s) longer than max_seq_len - min_new_tokens = {room} tokens: "
            f"{format_rows(too_long, 'tokens')}; raise --max_seq_len, or pass --truncate left"
        )
    data = np.full((len(token_lists), max_seq_len), start_token, dtype=np.int32)
    lengths = np.zeros(len(token_lists), dtype=np.int32)
    for index, ids in enumerate(token_lists):
        # Keep the tail: room >= 1 is guaranteed by the argument checks, so [-room:] is a real tail.
        kept = list(ids)[-room:] if len(ids) > room else list(ids)
        data[index, : len(kept)] = kept
        lengths[index] = len(kept)
    check_start_token_absent(data, lengths, start_token)
    return data, lengths, len(too_long)


def check_start_token_absent(data: np.ndarray, lengths: np.ndarray, start_token: int) -> None:
    """Raises a UserError if any prompt contains the start token (the runner would start there)."""
    offending = []
    for index, length in enumerate(lengths.tolist()):
        positions = np.flatnonzero(data[index, :length] == start_token)
        if positions.size:
            offending.append((index + 1, int(positions[0])))
    if offending:
        raise UserError(
            f"the start token {start_token} occurs inside {len(offending)} prompt(s): "
            f"{format_rows(offending, 'first at position')}; "
            "use an id outside the vocabulary (the default, len(tokenizer))"
        )


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def write_h5(output_dir: Path, data: np.ndarray, prompt_lengths: np.ndarray, loop_dim: int, attrs: dict) -> Path:
    """Writes data.h5 into output_dir atomically and returns its path.

    With loop_dim 0 `data` is stored transposed, (max_seq_len, num_samples).
    """
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create output folder {output_dir}: {describe(error)}") from None
    target = output_dir / OUTPUT_NAME
    # A temporary name that does not end in .h5, so a reader globbing the folder never sees a
    # half-written file; os.replace then swaps it in whole. The pid keeps two concurrent runs
    # apart, and letting h5py create the file keeps the user's umask (mkstemp would force 0600).
    tmp_name = output_dir / f".{OUTPUT_NAME}.{os.getpid()}.tmp"
    try:
        with h5py.File(tmp_name, "w") as h5:
            h5.create_dataset("data", data=np.ascontiguousarray(data.T if loop_dim == 0 else data))
            h5.create_dataset("prompt_lengths", data=prompt_lengths.astype(np.int32))
            for key, value in attrs.items():
                h5.attrs[key] = value
        os.replace(tmp_name, target)
    except OSError as error:  # a full disk, a quota, a read-only folder
        tmp_name.unlink(missing_ok=True)
        raise UserError(f"cannot write {target}: {describe(error)}") from None
    except BaseException:
        tmp_name.unlink(missing_ok=True)
        raise
    return target


def yaml_scalar(text: str) -> str:
    """Returns `text` as a YAML scalar: plain when it reads back unchanged, else double-quoted."""
    try:
        if yaml.safe_load(f"key: {text}") == {"key": text}:
            return text
    except yaml.YAMLError:
        pass
    return json.dumps(text)  # a JSON string is a valid double-quoted YAML scalar


def summary_text(
    target: Path,
    prompt_lengths: np.ndarray,
    num_truncated: int,
    empty_rows: Sequence[int],
    start_token: int,
    eos_token_id: int,
    vocab_size: int,
    output_dir: str,
) -> str:
    """Returns the human-readable report and the YAML snippet printed after writing."""
    lines = [
        f"wrote {target}",
        f"  rows:          {len(prompt_lengths)}",
        f"  prompt length: min {int(prompt_lengths.min())}, median {float(np.median(prompt_lengths)):g}, "
        f"max {int(prompt_lengths.max())} tokens",
        f"  truncated:     {num_truncated}",
        f"  empty:         {len(empty_rows)}",
    ]
    if empty_rows:
        rows = ", ".join(str(row) for row in empty_rows[:MAX_LISTED_ROWS])
        if len(empty_rows) > MAX_LISTED_ROWS:
            rows += f" and {len(empty_rows) - MAX_LISTED_ROWS} more"
        lines.append(f"warning: {len(empty_rows)} empty prompt(s) kept as rows (rows {rows})")
    if start_token < vocab_size:
        lines.append(
            f"note: start token {start_token} is a vocabulary id; an id >= {vocab_size} cannot clash with prompts"
        )
    stop = f"[[{eos_token_id}]]" if eos_token_id >= 0 else "[]"
    lines += [
        "",
        "Add to the params YAML:",
        "model:",
        f"  start_token: {start_token}",
        f"  stop_sequences: {stop}",
        "inference_input:",
        "  data_processor: GptHDF5MapDataProcessor",
        f"  data_dir: {yaml_scalar(output_dir)}",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Returns the argument parser; every option is documented in --help."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", type=Path, required=True, help="prompts file: .jsonl, .txt or .csv (by suffix)")
    parser.add_argument("--tokenizer", required=True, help="Hugging Face checkpoint or tokenizer folder")
    parser.add_argument(
        "--max_seq_len", type=int, required=True,
        help="length of every row: prompt plus room for generated tokens (>= 2)",
    )
    parser.add_argument("--output_dir", type=Path, required=True, help="folder to write data.h5 into (created if missing)")
    parser.add_argument("--field", default="prompt", help="JSON field that holds the prompt in a .jsonl file (default: prompt)")
    parser.add_argument("--column", default="prompt", help="column that holds the prompt in a .csv file (default: prompt)")
    parser.add_argument(
        "--start_token", type=int, default=None,
        help="id that fills every position after the prompt; generation starts at the first one "
        "(default: len(tokenizer), an id outside the vocabulary, the recommended choice)",
    )
    parser.add_argument(
        "--loop_dim", type=int, choices=(0, 1), default=1,
        help="1: store data as (num_samples, max_seq_len); 0: store the transpose (default: 1)",
    )
    parser.add_argument(
        "--min_new_tokens", type=int, default=1,
        help="positions each row must leave for generated tokens; prompts may use at most "
        "max_seq_len - min_new_tokens (default: 1)",
    )
    parser.add_argument(
        "--truncate", choices=("none", "left"), default="none",
        help="too-long prompts: 'none' reports them as an error, 'left' keeps their last "
        "max_seq_len - min_new_tokens tokens (default: none)",
    )
    parser.add_argument(
        "--chat_template", action="store_true",
        help="wrap each prompt as one user message in the tokenizer's chat template, with the "
        "generation prompt; without it the raw text is encoded with the tokenizer's special tokens",
    )
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Raises a UserError for option values that cannot produce a valid file."""
    if args.max_seq_len < 2:
        raise UserError(f"--max_seq_len must be at least 2, got {args.max_seq_len}")
    if not 1 <= args.min_new_tokens <= args.max_seq_len - 1:
        # At least one position for the start token, and at least one for a prompt token.
        raise UserError(
            f"--min_new_tokens must be between 1 and max_seq_len - 1 = {args.max_seq_len - 1}, got {args.min_new_tokens}"
        )
    if args.start_token is not None and not 0 <= args.start_token <= INT32_MAX:
        raise UserError(f"--start_token must be between 0 and {INT32_MAX}, got {args.start_token}")


def run(args: argparse.Namespace) -> str:
    """Reads, tokenizes, packs and writes the prompts; returns the summary to print."""
    check_args(args)
    prompts = read_prompts(args.input, args.field, args.column)
    tokenizer = load_tokenizer(args.tokenizer)
    vocab_size = len(tokenizer)
    start_token = vocab_size if args.start_token is None else args.start_token
    eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else -1
    token_lists = tokenize_prompts(tokenizer, prompts, args.chat_template)
    data, prompt_lengths, num_truncated = build_rows(
        token_lists, args.max_seq_len, start_token, args.min_new_tokens, args.truncate
    )
    attrs = {
        "tokenizer": str(args.tokenizer),
        "vocab_size": vocab_size,
        "start_token": start_token,
        "max_seq_len": args.max_seq_len,
        "loop_dim": args.loop_dim,
        "eos_token_id": int(eos_token_id),
        "chat_template": bool(args.chat_template),
        "source": args.input.name,
        "tool": TOOL_NAME,
        "tool_version": __version__,
        "num_samples": len(prompts),
    }
    target = write_h5(args.output_dir, data, prompt_lengths, args.loop_dim, attrs)
    # "Empty" is judged on the text: with a chat template an empty prompt still has tokens.
    empty_rows = [row for row, prompt in enumerate(prompts, start=1) if not prompt.strip()]
    return summary_text(
        target, prompt_lengths, num_truncated, empty_rows, start_token, int(eos_token_id), vocab_size,
        str(args.output_dir),
    )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 for a problem in the input)."""
    args = build_parser().parse_args(argv)
    try:
        print(run(args))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
