"""create_inference_h5.py's errors: one line each on stderr, nothing on stdout, no data.h5 written."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

from data_tools import create_inference_h5 as create  # noqa: E402
from prompt_files import create_args, write_jsonl  # noqa: E402


def _error_case(tmp_path: Path, name: str) -> tuple[list[str], str]:
    """Builds the input of one error case; returns (argv, expected message fragment)."""
    out = tmp_path / "out"
    if name == "missing_input":
        return create_args(tmp_path / "nope.jsonl", out), f"input file not found: {tmp_path / 'nope.jsonl'}"
    if name == "bad_suffix":
        (tmp_path / "p.json").write_text("{}", encoding="utf-8")
        return create_args(tmp_path / "p.json", out), "unsupported input suffix '.json' (use one of .jsonl, .txt, .csv, .parquet)"
    if name == "invalid_json":
        (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n', encoding="utf-8")
        return create_args(tmp_path / "p.jsonl", out), "line 2 is not valid JSON"
    if name == "missing_field":
        (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n\n{"text": "b"}\n', encoding="utf-8")
        return create_args(tmp_path / "p.jsonl", out), "line 3 has no field 'prompt'"
    if name == "field_not_string":
        (tmp_path / "p.jsonl").write_text('{"prompt": 5}\n', encoding="utf-8")
        return create_args(tmp_path / "p.jsonl", out), "line 1: field 'prompt' is a int, not a string"
    if name == "json_not_object":
        (tmp_path / "p.jsonl").write_text('["a"]\n', encoding="utf-8")
        return create_args(tmp_path / "p.jsonl", out), "line 1 is not a JSON object"
    if name == "csv_missing_column":
        (tmp_path / "p.csv").write_text("id,text\n1,a\n", encoding="utf-8")
        return create_args(tmp_path / "p.csv", out), "no column 'prompt' (columns: 'id', 'text'"
    if name == "zero_prompts_jsonl":
        (tmp_path / "p.jsonl").write_text("\n", encoding="utf-8")
        return create_args(tmp_path / "p.jsonl", out), "no prompts found"
    if name == "zero_prompts_txt":
        (tmp_path / "p.txt").write_text("", encoding="utf-8")
        return create_args(tmp_path / "p.txt", out), "no prompts found"
    if name == "zero_prompts_csv":
        (tmp_path / "p.csv").write_text("prompt\n", encoding="utf-8")
        return create_args(tmp_path / "p.csv", out), "no prompts found"
    if name == "negative_start_token":
        src = write_jsonl(tmp_path / "p.jsonl", ["a"])
        return create_args(src, out, 8, "--start_token", "-1"), "--start_token must be between 0 and 2147483647, got -1"
    if name == "max_seq_len_too_small":
        src = write_jsonl(tmp_path / "p.jsonl", ["a"])
        return create_args(src, out, 1), "--max_seq_len must be at least 2, got 1"
    if name == "min_new_tokens_too_large":
        src = write_jsonl(tmp_path / "p.jsonl", ["a"])
        return create_args(src, out, 4, "--min_new_tokens", "4"), "--min_new_tokens must be between 1 and max_seq_len - 1 = 3"
    if name == "missing_tokenizer":
        src = write_jsonl(tmp_path / "p.jsonl", ["a"])
        argv = create_args(src, out)
        argv[argv.index("--tokenizer") + 1] = str(tmp_path / "no_tok")
        return argv, f"tokenizer folder not found: {tmp_path / 'no_tok'}"
    if name == "not_utf8":
        (tmp_path / "p.txt").write_bytes(b"caf\xe9\n")
        return create_args(tmp_path / "p.txt", out), "not UTF-8 text"
    raise AssertionError(name)


@pytest.mark.parametrize(
    "name",
    [
        "missing_input", "bad_suffix", "invalid_json", "missing_field", "field_not_string", "json_not_object",
        "csv_missing_column", "zero_prompts_jsonl", "zero_prompts_txt", "zero_prompts_csv",
        "negative_start_token", "max_seq_len_too_small", "min_new_tokens_too_large", "missing_tokenizer",
        "not_utf8",
    ],
)
def test_create_errors(tmp_path, capsys, name):
    argv, fragment = _error_case(tmp_path, name)

    assert create.main(argv) == 2

    captured = capsys.readouterr()
    assert captured.err.startswith("error: ")
    assert fragment in captured.err
    assert captured.err.count("\n") == 1  # one line, no traceback
    assert captured.out == ""
    assert not (tmp_path / "out" / "data.h5").exists()


@pytest.mark.parametrize("files, needs", [
    ({"config.json": '{"model_type": "llama"}', "model.safetensors": ""},
     "it needs tokenizer.json, or tokenizer_config.json with the vocabulary files of its tokenizer class "
     "(found: config.json, model.safetensors)"),
    ({"tokenizer_config.json": '{"tokenizer_class": "GPT2Tokenizer"}'},  # transformers 5 loads an empty one
     "it needs tokenizer.json, or the vocabulary files of GPT2Tokenizer: vocab.json, merges.txt "
     "(found: tokenizer_config.json)"),
])
def test_a_folder_without_tokenizer_files_is_named_with_what_it_lacks(tmp_path, capsys, files, needs):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    argv = create_args(write_jsonl(tmp_path / "p.jsonl", ["a"]), tmp_path / "out")
    argv[argv.index("--tokenizer") + 1] = str(folder)
    assert create.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: no tokenizer in {folder}: {needs}\n" and captured.out == ""
