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
  .parquet  a table; the prompt is the string column --column; read row group by row group with
          pyarrow, and the .h5 written chunk by chunk, so a table of millions of rows never has to fit
          in memory (the other formats are tokenized and written in chunks too)
or, with --format openai_batch, an OpenAI batch file (data_tools/openai_batch.py): chat requests through
the chat template, completion requests as raw prompts, per-request max_tokens and stop strings.

Ids: --id_field names the .jsonl field or .csv column holding each prompt's id (default: `custom_id` or
`id` when the file has one; an OpenAI batch file's `custom_id`). Ids must be unique; they travel into
every predictions file (`sample_id`) and every decoded line.

The output folder gets data.h5 with the datasets `data` and `prompt_lengths` (and `sample_id`,
`max_tokens`, `stop_sequences`, `requests` where the input has them) and attributes that record how it
was made. A YAML snippet for the params file is printed at the end.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import yaml

from data_tools.batch_rows import openai_rows
from data_tools.h5_writer import RowsWriter
from data_tools.openai_batch import BatchRequest
from data_tools.prompts import PromptFile, iter_prompt_file, load_tokenizer, tokenize_pairs, tokenize_prompts
from modelzoo import __version__
from modelzoo.errors import UserError
from modelzoo.generation.options import MAX_SAMPLES
from modelzoo.job.rows import column, repeat_rows, repeated_for_samples

TOOL_NAME = "zoo-infer create_inference_h5"
CHUNK_PROMPTS = 4096  # prompts tokenized and written at a time
INT32_MAX = int(np.iinfo(np.int32).max)
# Offending rows listed in an error message before "and N more".
MAX_LISTED_ROWS = 10


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
    first_row: int = 1,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Packs prompts into rows: (data int32 (N, max_seq_len), prompt_lengths int32 (N,), num truncated).

    Row i holds prompt i, then `start_token` from position len(prompt) to the end. A prompt may
    use at most max_seq_len - min_new_tokens positions; longer ones are cut from the left when
    truncate == "left" (the end of a prompt is what the completion continues) or are an error.
    first_row: the 1-based number of the first prompt in the input, for the messages.
    """
    if truncate not in ("none", "left"):
        raise UserError(f"truncate must be 'none' or 'left', not {truncate!r}")
    if not token_lists:
        raise UserError("no prompts to write")
    room = max_seq_len - min_new_tokens
    too_long = [(row, len(ids)) for row, ids in enumerate(token_lists, start=first_row) if len(ids) > room]
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
    check_start_token_absent(data, lengths, start_token, first_row)
    return data, lengths, len(too_long)


def check_start_token_absent(data: np.ndarray, lengths: np.ndarray, start_token: int, first_row: int = 1) -> None:
    """Raises a UserError if any prompt contains the start token (the runner would start there)."""
    offending = []
    for index, length in enumerate(lengths.tolist()):
        positions = np.flatnonzero(data[index, :length] == start_token)
        if positions.size:
            offending.append((first_row + index, int(positions[0])))
    if offending:
        raise UserError(
            f"the start token {start_token} occurs inside {len(offending)} prompt(s): "
            f"{format_rows(offending, 'first at position')}; "
            "use an id outside the vocabulary (the default, len(tokenizer))"
        )


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def write_h5(output_dir: Path, data: np.ndarray, prompt_lengths: np.ndarray, loop_dim: int, attrs: dict,
             per_row: dict[str, np.ndarray | list] | None = None, tables: dict[str, list[str]] | None = None) -> Path:
    """Writes data.h5 into output_dir atomically, in one piece, and returns its path.

    With loop_dim 0 `data` is stored transposed, (max_seq_len, num_samples). per_row: more datasets
    (lists of str become UTF-8 string datasets); tables: whole-file string datasets.
    """
    with RowsWriter(output_dir, data.shape[1], loop_dim) as writer:
        writer.append(data, prompt_lengths, per_row or {})
        return writer.finish(attrs, tables)


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
    model_keys: dict[str, Any] | None = None,
) -> str:
    """Returns the human-readable report and the YAML snippet printed after writing (`model_keys`: more model: keys
    the data needs, e.g. the logprobs its requests ask for)."""
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
        *(f"  {key}: {yaml_scalar(value) if isinstance(value, str) else str(value).lower()}"
          for key, value in (model_keys or {}).items()),
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
    parser.add_argument("--input", type=Path, required=True, help="prompts file: .jsonl, .txt, .csv or .parquet "
                        "(by suffix)")
    parser.add_argument("--tokenizer", required=True, help="Hugging Face checkpoint or tokenizer folder")
    parser.add_argument(
        "--max_seq_len", type=int, required=True,
        help="length of every row: prompt plus room for generated tokens (>= 2)",
    )
    parser.add_argument("--output_dir", type=Path, required=True, help="folder to write data.h5 into (created if missing)")
    parser.add_argument("--field", default="prompt", help="JSON field that holds the prompt in a .jsonl file (default: prompt)")
    parser.add_argument("--column", default="prompt", help="column that holds the prompt in a .csv or .parquet file "
                        "(default: prompt)")
    parser.add_argument("--id_field", default=None, help="field (.jsonl) or column (.csv, .parquet) holding each "
                        "prompt's unique id (default: custom_id or id when present)")
    parser.add_argument("--continuation_field", default=None,
                        help="scoring data: the field (.jsonl) or column (.csv, .parquet) of each row's continuation; "
                        "the prompt is then its context, and the runner writes the continuation's token "
                        "log-probabilities and whether greedy decoding would produce it, instead of generating "
                        "(split as lm-evaluation-harness splits a pair: trailing spaces of the context go to the "
                        "continuation; an empty context is the BOS token)")
    parser.add_argument("--adapter_field", default=None,
                        help="the field (.jsonl) or column (.csv, .parquet) naming the LoRA adapter each row runs with: "
                        "one of the params' model.adapters; empty: model.adapter, or the bare base model (the runner "
                        "checks the names)")
    parser.add_argument("--format", choices=("prompts", "openai_batch"), default="prompts",
                        help="prompts: a prompt file as above; openai_batch: an OpenAI batch file of "
                        "/v1/chat/completions and /v1/completions requests (default: prompts)")
    parser.add_argument("--params", type=Path, default=None, help="openai_batch: the run's params.yaml; a request may "
                        "set presence_penalty, frequency_penalty or logprobs only to its values (default: 0, 0, no "
                        "logprobs), ask at most its top_logprobs, and its `model` names one of its model.adapters "
                        "(LoRA), or the base")
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
        "--n", type=int, default=1,
        help=f"samples per prompt (1 to {MAX_SAMPLES}): each prompt becomes N consecutive rows, numbered 0..N-1 in the "
        "per-row dataset `sample`; the runner prefills the prompt once for them; with model.temperature > 0 "
        "each row draws its own completion (pass@k) (default: 1; an OpenAI batch file's requests say their own n)",
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
    if not 1 <= args.n <= MAX_SAMPLES:
        raise UserError(f"--n must be between 1 and {MAX_SAMPLES}, got {args.n}")
    if args.continuation_field is not None and (args.format == "openai_batch" or args.chat_template or args.n > 1):
        raise UserError("--continuation_field makes scoring data from a prompt file, without --chat_template or --n")
    if args.adapter_field is not None and args.format == "openai_batch":
        raise UserError("--adapter_field is for prompt files; in an OpenAI batch file each request's model names its "
                        "adapter (pass --params)")
    if args.n > 1 and args.format == "openai_batch":
        raise UserError("--n is for prompt files; in an OpenAI batch file each request says its own n")
    if args.start_token is not None and not 0 <= args.start_token <= INT32_MAX:
        raise UserError(f"--start_token must be between 0 and {INT32_MAX}, got {args.start_token}")


def prompt_chunks(tokenizer: Any, read: Iterable[PromptFile], chat_template: bool
                  ) -> Iterator[tuple[PromptFile, list[list[int]], dict]]:
    """Each chunk of a prompt file as (prompts, token ids, per-row datasets): scoring pairs (each row's context and
    continuation, the per-row `continuation_length`) where the file has continuations; each row's `adapter` where
    it names them."""
    row = 1
    for chunk in read:
        per_row: dict[str, Any] = {}
        if chunk.continuations is None:
            token_lists = tokenize_prompts(tokenizer, chunk.prompts, chat_template)
        else:
            token_lists, lengths = tokenize_pairs(tokenizer, chunk.prompts, chunk.continuations, first_row=row)
            per_row["continuation_length"] = column("continuation_length", lengths)
        if "adapter" in chunk.texts:
            per_row["adapter"] = [name.strip() for name in chunk.texts["adapter"]]
        yield chunk, token_lists, per_row
        row += len(chunk.prompts)


def run(args: argparse.Namespace) -> str:
    """Reads, tokenizes, packs and writes the prompts, chunk by chunk; returns the summary to print."""
    check_args(args)
    if not args.input.is_file():
        raise UserError(f"input file not found: {args.input}")
    tokenizer = load_tokenizer(args.tokenizer)
    vocab_size = len(tokenizer)
    start_token = vocab_size if args.start_token is None else args.start_token
    eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else -1
    tables: dict[str, list[str]] = {}
    rejected: list[BatchRequest] = []
    model_keys: dict[str, Any] = {}  # more params model: keys the data needs
    if args.format == "openai_batch":
        prompts, token_lists, per_row, tables["requests"], rejected, model_keys = openai_rows(args, tokenizer)
        if not prompts.prompts:
            raise UserError(f"{args.input}: no request can run here: " + "; ".join(
                f"{r.custom_id}: {r.error}" for r in rejected[:MAX_LISTED_ROWS]))
        chunks: Iterable[tuple[PromptFile, list[list[int]], dict]] = [(prompts, token_lists, per_row)]
    else:
        fields = {role: name for role, name in (("continuation", args.continuation_field),
                                                ("adapter", args.adapter_field)) if name is not None}
        read = iter_prompt_file(args.input, args.field, args.column, args.id_field, CHUNK_PROMPTS, fields)
        chunks = prompt_chunks(tokenizer, read, args.chat_template)
    lengths: list[np.ndarray] = []
    empty_rows: list[int] = []
    num_truncated, row = 0, 1
    with RowsWriter(args.output_dir, args.max_seq_len, args.loop_dim) as writer:
        for prompts, token_lists, per_row in chunks:
            data, prompt_lengths, cut = build_rows(token_lists, args.max_seq_len, start_token, args.min_new_tokens,
                                                   args.truncate, first_row=row)
            if "continuation_length" in per_row:  # a truncated row must keep its whole continuation and a context
                short = np.flatnonzero(prompt_lengths <= per_row["continuation_length"])
                if short.size:
                    raise UserError(f"{short.size} continuation(s) do not fit max_seq_len - min_new_tokens with a "
                                    f"context token before them: " + format_rows(
                                        [(row + i, int(per_row["continuation_length"][i])) for i in short], "tokens"))
            if prompts.ids is not None:
                per_row = {**per_row, "sample_id": prompts.ids}
            if args.n > 1:  # every prompt n times, numbered
                data, prompt_lengths = repeat_rows(data, args.n), repeat_rows(prompt_lengths, args.n)
                per_row = repeated_for_samples(per_row, np.full(len(prompts.prompts), args.n))
            writer.append(data, prompt_lengths, per_row)
            # "Empty" is judged on the text: with a chat template an empty prompt still has tokens.
            empty_rows += [row + i for i, prompt in enumerate(prompts.prompts) if not prompt.strip()]
            lengths.append(prompt_lengths)
            num_truncated, row = num_truncated + cut, row + len(prompts.prompts)
        if row == 1:
            raise UserError(f"{args.input}: no prompts found")
        attrs = {
            "tokenizer": str(args.tokenizer),
            "vocab_size": vocab_size,
            "start_token": start_token,
            "max_seq_len": args.max_seq_len,
            "loop_dim": args.loop_dim,
            "eos_token_id": int(eos_token_id),
            "chat_template": bool(args.chat_template or args.format == "openai_batch"),
            "format": args.format,
            "source": args.input.name,
            "tool": TOOL_NAME,
            "tool_version": __version__,
            "num_samples": writer.rows,
        }
        target = writer.finish(attrs, tables)
    summary = summary_text(target, np.concatenate(lengths), num_truncated, empty_rows, start_token, int(eos_token_id),
                           vocab_size, str(args.output_dir), model_keys)
    if rejected:
        shown = "; ".join(f"line {r.line} ({r.custom_id}): {r.error}" for r in rejected[:MAX_LISTED_ROWS])
        more = f" and {len(rejected) - MAX_LISTED_ROWS} more" if len(rejected) > MAX_LISTED_ROWS else ""
        summary = (f"warning: {len(rejected)} request(s) cannot run here and will be error records in the output: "
                   f"{shown}{more}\n" + summary)
    return summary


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
