"""Prompts in, token ids out: reading prompt files (.jsonl, .txt, .csv, .parquet) and the tokenizer that
turns them into ids, with a one-line error for every file or folder it cannot use."""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from modelzoo.errors import UserError
from modelzoo.generation.pairs import split_pair

SUFFIXES = (".jsonl", ".txt", ".csv", ".parquet")


# --------------------------------------------------------------------------------------------
# Reading prompts
# --------------------------------------------------------------------------------------------


ID_DEFAULTS = ("custom_id", "id")  # the id field or column used when --id_field is not given, if present


@dataclass
class PromptFile:
    """The prompts of a file in order, and each one's id (None: the file has no ids)."""

    prompts: list[str]
    ids: list[str] | None = None
    # Each prompt's optional text fields by role, where the file has them: "continuation" (a continuation to score,
    # --continuation_field), "adapter" (the LoRA adapter the prompt runs with, --adapter_field).
    texts: dict[str, list[str]] = field(default_factory=dict)

    @property
    def continuations(self) -> list[str] | None:
        """Scoring data: each prompt is a context, this its continuation."""
        return self.texts.get("continuation")

    def part(self, rows: slice) -> PromptFile:
        """The prompts of `rows`, with their ids and text fields."""
        return PromptFile(self.prompts[rows], None if self.ids is None else self.ids[rows],
                          {role: values[rows] for role, values in self.texts.items()})


TextFields = dict[str, str]  # role -> the field or column that holds it


def _option(role: str) -> str:
    return f"--{role}_field"


def _id_text(path: Path, where: str, value: Any, id_field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise UserError(f"{path}: {where}: id field {id_field!r} must be a non-empty string or an integer, "
                        f"got {value!r}")
    return str(value)


def json_records(path: Path, text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line number, object) of every JSON object line of a .jsonl text; one-line errors otherwise."""
    for line_no, line in enumerate(text.splitlines(), start=1):
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
        yield line_no, record


def read_jsonl_prompts(path: Path, field: str, id_field: str | None = None,
                       text_fields: TextFields | None = None) -> PromptFile:
    """The string in `field` of every JSON object line of a .jsonl file, its `id_field` (None: the
    first of ID_DEFAULTS the first record has, if any) and its `text_fields`."""
    text_fields = text_fields or {}
    prompts, ids = [], []
    texts: dict[str, list[str]] = {role: [] for role in text_fields}
    for line_no, record in json_records(path, read_text(path)):
        for name, option in ((field, "--field"), *((name, _option(role)) for role, name in text_fields.items())):
            if name not in record:
                raise UserError(f"{path}: line {line_no} has no field {name!r} (use {option} to pick another)")
            if not isinstance(record[name], str):
                raise UserError(f"{path}: line {line_no}: field {name!r} is a {type(record[name]).__name__}, "
                                "not a string")
        value = record[field]
        for role, name in text_fields.items():
            texts[role].append(record[name])
        if not prompts and id_field is None:
            id_field = next((name for name in ID_DEFAULTS if name in record), "")
        if id_field:
            if id_field not in record:
                raise UserError(f"{path}: line {line_no} has no id field {id_field!r} (use --id_field to pick another)")
            ids.append(_id_text(path, f"line {line_no}", record[id_field], id_field))
        prompts.append(value)
    return PromptFile(prompts, ids if id_field else None, texts)


def read_txt_prompts(path: Path) -> PromptFile:
    """Every line of a .txt file as one prompt, blank lines included (no ids)."""
    # splitlines() drops the final newline without adding an empty row, and keeps blank lines in
    # the middle so row i of the output is line i of the input.
    return PromptFile(read_text(path).splitlines())


def read_csv_prompts(path: Path, column: str, id_column: str | None = None,
                     text_columns: TextFields | None = None) -> PromptFile:
    """The values of `column` of a .csv file with a header row, of `id_column` (None: the first of
    ID_DEFAULTS in the header, if any) and of its `text_columns`."""
    text_columns = text_columns or {}
    # utf-8-sig strips the byte-order mark that spreadsheet programs put before the header.
    with open(path, newline="", encoding="utf-8-sig") as handle:
        try:
            reader = csv.DictReader(handle)
            columns = reader.fieldnames or []
            existing = ", ".join(repr(name) for name in columns) or "none"
            if column not in columns:
                raise UserError(f"{path}: no column {column!r} (columns: {existing}; use --column to pick one)")
            for role, name in text_columns.items():
                if name not in columns:
                    raise UserError(f"{path}: no column {name!r} (columns: {existing}; use {_option(role)} to pick one)")
            if id_column is None:
                id_column = next((name for name in ID_DEFAULTS if name in columns), "")
            elif id_column not in columns:
                raise UserError(f"{path}: no id column {id_column!r} (columns: {existing}; use --id_field to pick one)")
            rows = list(reader)
        except UnicodeDecodeError as exc:
            raise UserError(f"{path}: not UTF-8 text ({exc.reason})") from None
        except csv.Error as exc:
            raise UserError(f"{path}: malformed CSV ({exc})") from None
    # A short row has no value for the column (None): it is an empty prompt, still a row.
    prompts = [row[column] or "" for row in rows]
    texts = {role: [row[name] or "" for row in rows] for role, name in text_columns.items()}
    if not id_column:
        return PromptFile(prompts, None, texts)
    return PromptFile(prompts, [_id_text(path, f"row {i}", row[id_column] or "", id_column)
                                for i, row in enumerate(rows, start=1)], texts)


def read_text(path: Path) -> str:
    """Returns the contents of a UTF-8 text file, as a UserError if it cannot be decoded."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason})") from None


class UniqueIds:
    """Ids seen so far, fed a chunk at a time; `add` raises naming the ids used more than once, with their
    1-based rows (the first few), among the rows seen up to the end of that chunk."""

    def __init__(self, path: Path) -> None:
        self.path, self.first_row, self.rows = path, 1, {}

    def add(self, ids: Sequence[str]) -> None:
        repeated: dict[str, list[int]] = {}
        for row, sample_id in enumerate(ids, start=self.first_row):
            if sample_id in self.rows:
                repeated.setdefault(sample_id, [self.rows[sample_id]]).append(row)
            else:
                self.rows[sample_id] = row
        self.first_row += len(ids)
        if repeated:
            shown = ", ".join(f"{sample_id!r} (rows {', '.join(map(str, where))})"
                              for sample_id, where in list(repeated.items())[:10])
            more = f" and {len(repeated) - 10} more" if len(repeated) > 10 else ""
            raise UserError(f"{self.path}: ids must be unique; used more than once: {shown}{more}")


def iter_parquet_prompts(path: Path, column: str, id_column: str | None, rows: int,
                         text_columns: TextFields | None = None) -> Iterator[PromptFile]:
    """The prompts (and ids, and the `text_columns`) of a parquet table in chunks
    of at most `rows`, read row group by row group with pyarrow, so that the table never has to fit in memory;
    ids checked unique as they come."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise UserError(f"{path}: not a readable parquet file ({str(error).splitlines()[0]})") from None
    fields = {field.name: field.type for field in table.schema_arrow}
    existing = ", ".join(repr(name) for name in fields) or "none"
    text_columns = text_columns or {}
    for name, option in ((column, "--column"), *((name, _option(role)) for role, name in text_columns.items())):
        if name not in fields:
            raise UserError(f"{path}: no column {name!r} (columns: {existing}; use {option} to pick one)")
        if not (pa.types.is_string(fields[name]) or pa.types.is_large_string(fields[name])):
            raise UserError(f"{path}: column {name!r} holds {fields[name]}, not strings")
    if id_column is None:
        id_column = next((name for name in ID_DEFAULTS if name in fields), "")
    elif id_column not in fields:
        raise UserError(f"{path}: no id column {id_column!r} (columns: {existing}; use --id_field to pick one)")
    unique, first_row = UniqueIds(path), 1
    try:
        wanted = [column] + ([id_column] if id_column else []) + list(dict.fromkeys(text_columns.values()))
        for batch in table.iter_batches(batch_size=rows, columns=wanted):
            prompts = [text or "" for text in batch.column(column).to_pylist()]  # a null prompt: empty, still a row
            texts = {role: [text or "" for text in batch.column(name).to_pylist()] for role, name in text_columns.items()}
            ids = None
            if id_column:
                ids = [_id_text(path, f"row {first_row + i}", value if value is not None else "", id_column)
                       for i, value in enumerate(batch.column(id_column).to_pylist())]
                unique.add(ids)
            first_row += len(prompts)
            yield PromptFile(prompts, ids, texts)
    except (pa.ArrowException, OSError) as error:  # a damaged row group
        raise UserError(f"{path}: cannot read row {first_row} on ({str(error).splitlines()[0]})") from None


def iter_prompt_file(path: Path | str, field: str = "prompt", column: str = "prompt", id_field: str | None = None,
                     rows: int = 4096, text_fields: TextFields | None = None) -> Iterator[PromptFile]:
    """The prompts (and ids, see read_jsonl_prompts / read_csv_prompts; and their `text_fields`, role -> the field or
    column of each prompt's continuation or adapter) of a .jsonl, .txt, .csv or .parquet file (format chosen by suffix), in
    file order, in chunks of at most `rows`: a parquet table row group by row group, never whole; the text formats
    are read whole (their text is small next to the rows made of it)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise UserError(f"{path}: unsupported input suffix {path.suffix!r} (use one of {', '.join(SUFFIXES)})")
    if not path.is_file():
        raise UserError(f"input file not found: {path}")
    if suffix == ".txt" and (id_field or text_fields):
        option = "--id_field" if id_field else _option(next(iter(text_fields)))
        raise UserError(f"{path}: a .txt file has no fields, so no {option}")
    if suffix == ".parquet":
        yield from iter_parquet_prompts(path, column, id_field, rows, text_fields)
        return
    if suffix == ".jsonl":
        read = read_jsonl_prompts(path, field, id_field, text_fields)
    elif suffix == ".txt":
        read = read_txt_prompts(path)
    else:
        read = read_csv_prompts(path, column, id_field, text_fields)
    if not read.prompts:
        raise UserError(f"{path}: no prompts found")
    if read.ids is not None:
        UniqueIds(path).add(read.ids)
    for begin in range(0, len(read.prompts), rows):
        yield read.part(slice(begin, begin + rows))


def read_prompts(path: Path | str, field: str = "prompt", column: str = "prompt") -> list[str]:
    """Reads the prompts of a prompt file (format chosen by suffix), in file order."""
    return [prompt for chunk in iter_prompt_file(path, field, column) for prompt in chunk.prompts]


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


def tokenize_pairs(tokenizer: Any, contexts: Sequence[str], continuations: Sequence[str], first_row: int = 1
                   ) -> tuple[list[list[int]], list[int]]:
    """Each (context, continuation) as one token list and its continuation's length, split as lm-evaluation-harness
    splits a pair (modelzoo/generation/pairs.py). A continuation of no token is an error naming its row (`first_row`:
    the 1-based row of the first pair)."""
    rows, lengths = [], []
    for row, (context, continuation) in enumerate(zip(contexts, continuations), start=first_row):
        head, tail = split_pair(tokenizer, context, continuation)
        if not tail:
            raise UserError(f"row {row}: its continuation {continuation!r} has no token to score")
        rows.append(list(head) + list(tail))
        lengths.append(len(tail))
    return rows, lengths
