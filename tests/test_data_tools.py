"""Tests for data_tools/create_inference_h5.py and data_tools/decode_predictions.py.

They use the real SmolLM2-135M-Instruct tokenizer (vocab 49152, eos <|im_end|> = 2), so the
token ids checked here are the ones a real run would see.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

from data_tools import create_inference_h5 as create  # noqa: E402
from data_tools import decode_predictions as decode  # noqa: E402
from data_tools.prompts import read_prompts  # noqa: E402
from modelzoo import __version__  # noqa: E402
from modelzoo.errors import UserError  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
VOCAB_SIZE = 49152
EOS_ID = 2


@pytest.fixture(scope="session")
def tokenizer():
    """The real tokenizer; a missing checkpoint is a failure, not a skip."""
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.fail(f"tokenizer not found at {TOKENIZER_DIR}: run `make setup` to create it")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def ids_of(tokenizer, text: str) -> list[int]:
    """Token ids the tool must produce for `text` without --chat_template."""
    return tokenizer(text)["input_ids"]


def chat_ids_of(tokenizer, text: str) -> list[int]:
    """Token ids the tool must produce for `text` with --chat_template."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def create_args(input_path: Path, out_dir: Path, max_seq_len: int = 16, *extra: str) -> list[str]:
    """The command line of create_inference_h5 with the real tokenizer."""
    return [
        "--input", str(input_path), "--tokenizer", str(TOKENIZER_DIR),
        "--max_seq_len", str(max_seq_len), "--output_dir", str(out_dir), *extra,
    ]


def read_h5(out_dir: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """Returns data, prompt_lengths and the attributes of out_dir/data.h5."""
    with h5py.File(out_dir / "data.h5", "r") as h5:
        return h5["data"][()], h5["prompt_lengths"][()], dict(h5.attrs)


def expected_row(ids: list[int], max_seq_len: int, start: int = VOCAB_SIZE) -> list[int]:
    """A row as the tool must write it: the prompt, then the start token to the end."""
    return ids + [start] * (max_seq_len - len(ids))


def write_jsonl(path: Path, prompts: list[str], field: str = "prompt") -> Path:
    path.write_text("".join(json.dumps({field: p, "id": i}) + "\n" for i, p in enumerate(prompts)), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------
# create_inference_h5: round trips
# --------------------------------------------------------------------------------------------


def test_jsonl_round_trip(tokenizer, tmp_path, capsys):
    prompts = ["Hello there", "What is the capital of France?", "Café ☕ naïve"]
    src = write_jsonl(tmp_path / "p.jsonl", prompts)
    out = tmp_path / "out"

    assert create.main(create_args(src, out, 16)) == 0

    data, lengths, attrs = read_h5(out)
    assert data.dtype == np.int32 and lengths.dtype == np.int32
    assert data.shape == (3, 16)
    for row, prompt in zip(data.tolist(), prompts):
        assert row == expected_row(ids_of(tokenizer, prompt), 16)
    assert lengths.tolist() == [len(ids_of(tokenizer, p)) for p in prompts]
    assert attrs == {
        "tokenizer": str(TOKENIZER_DIR),
        "vocab_size": VOCAB_SIZE,
        "start_token": VOCAB_SIZE,
        "max_seq_len": 16,
        "loop_dim": 1,
        "eos_token_id": EOS_ID,
        "chat_template": False,
        "format": "prompts",
        "source": "p.jsonl",
        "tool": "zoo-infer create_inference_h5",
        "tool_version": __version__,
        "num_samples": 3,
    }
    assert isinstance(attrs["tokenizer"], str) and isinstance(attrs["source"], str)
    assert sorted(os.listdir(out)) == ["data.h5"]  # no temporary file left behind

    stdout = capsys.readouterr().out
    lens = sorted(lengths.tolist())
    assert f"wrote {out / 'data.h5'}" in stdout
    assert "rows:          3" in stdout
    assert f"prompt length: min {lens[0]}, median {lens[1]}, max {lens[2]} tokens" in stdout
    assert "truncated:     0" in stdout
    assert "empty:         0" in stdout
    assert stdout.rstrip().endswith(
        "model:\n"
        f"  start_token: {VOCAB_SIZE}\n"
        f"  stop_sequences: [[{EOS_ID}]]\n"
        "inference_input:\n"
        "  data_processor: GptHDF5MapDataProcessor\n"
        f"  data_dir: {out}"
    )


def test_jsonl_custom_field_and_blank_lines(tokenizer, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text('{"text": "one"}\n\n{"text": "two"}\n\n', encoding="utf-8")
    out = tmp_path / "out"

    assert create.main(create_args(src, out, 8, "--field", "text")) == 0

    data, lengths, _ = read_h5(out)
    assert data.tolist() == [expected_row(ids_of(tokenizer, "one"), 8), expected_row(ids_of(tokenizer, "two"), 8)]


def test_txt_round_trip_keeps_blank_lines(tokenizer, tmp_path, capsys):
    lines = ["first line", "", "third line", "  "]
    src = tmp_path / "p.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"

    assert create.main(create_args(src, out, 12)) == 0

    data, lengths, attrs = read_h5(out)
    assert data.shape == (4, 12)
    for row, line in zip(data.tolist(), lines):
        assert row == expected_row(ids_of(tokenizer, line), 12)
    assert lengths[1] == 0  # the empty line is a row of start tokens only
    assert attrs["source"] == "p.txt" and attrs["num_samples"] == 4
    stdout = capsys.readouterr().out
    assert "empty:         2" in stdout
    assert "warning: 2 empty prompt(s) kept as rows (rows 2, 4)" in stdout


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a\nb\n", ["a", "b"]),
        ("a\nb", ["a", "b"]),
        ("a\n\nb\n", ["a", "", "b"]),
        ("a\r\nb\r\n", ["a", "b"]),
        ("a\n\n", ["a", ""]),
    ],
)
def test_txt_trailing_newline_makes_no_row(tmp_path, text, expected):
    src = tmp_path / "p.txt"
    src.write_bytes(text.encode("utf-8"))
    assert read_prompts(src) == expected


def test_csv_round_trip(tokenizer, tmp_path):
    src = tmp_path / "p.csv"
    src.write_text('id,text\n1,"Hello, world"\n2,"two\nlines"\n3,plain\n', encoding="utf-8")
    out = tmp_path / "out"

    assert create.main(create_args(src, out, 10, "--column", "text")) == 0

    data, lengths, attrs = read_h5(out)
    prompts = ["Hello, world", "two\nlines", "plain"]
    assert data.shape == (3, 10)
    for row, prompt in zip(data.tolist(), prompts):
        assert row == expected_row(ids_of(tokenizer, prompt), 10)
    assert lengths.tolist() == [len(ids_of(tokenizer, p)) for p in prompts]
    assert attrs["source"] == "p.csv" and attrs["num_samples"] == 3


def test_csv_with_byte_order_mark(tmp_path):
    src = tmp_path / "p.csv"
    src.write_bytes("prompt\nhi\n".encode("utf-8-sig"))
    assert read_prompts(src) == ["hi"]


def test_loop_dim_0_stores_transpose(tokenizer, tmp_path):
    prompts = ["short", "a somewhat longer prompt"]
    src = write_jsonl(tmp_path / "p.jsonl", prompts)

    assert create.main(create_args(src, tmp_path / "d1", 12)) == 0
    assert create.main(create_args(src, tmp_path / "d0", 12, "--loop_dim", "0")) == 0

    data1, lengths1, _ = read_h5(tmp_path / "d1")
    data0, lengths0, attrs0 = read_h5(tmp_path / "d0")
    assert data0.shape == (12, 2) and data0.dtype == np.int32
    assert np.array_equal(data0, data1.T)
    assert data0[:, 0].tolist() == expected_row(ids_of(tokenizer, "short"), 12)
    assert np.array_equal(lengths0, lengths1)
    assert attrs0["loop_dim"] == 0


def test_chat_template_ids(tokenizer, tmp_path, capsys):
    prompts = ["Hi", "What is 2 + 2?"]
    src = write_jsonl(tmp_path / "p.jsonl", prompts)
    out = tmp_path / "out"

    assert create.main(create_args(src, out, 64, "--chat_template")) == 0

    data, lengths, attrs = read_h5(out)
    for row, prompt in zip(data.tolist(), prompts):
        ids = chat_ids_of(tokenizer, prompt)
        assert ids[-4:] == tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        assert row == expected_row(ids, 64)
    assert lengths.tolist() == [len(chat_ids_of(tokenizer, p)) for p in prompts]
    assert attrs["chat_template"] == True  # noqa: E712 (h5py returns numpy.bool_)


def test_custom_start_token_and_min_new_tokens(tokenizer, tmp_path, capsys):
    src = write_jsonl(tmp_path / "p.jsonl", ["Hello there"])
    out = tmp_path / "out"

    assert create.main(create_args(src, out, 6, "--start_token", "50000", "--min_new_tokens", "4")) == 0

    data, _, attrs = read_h5(out)
    assert data.tolist() == [expected_row(ids_of(tokenizer, "Hello there"), 6, start=50000)]
    assert attrs["start_token"] == 50000
    assert "  start_token: 50000\n" in capsys.readouterr().out


def test_truncate_left_keeps_exact_tail(tokenizer, tmp_path, capsys):
    long_prompt = "one two three four five six seven eight nine ten eleven twelve"
    short_prompt = "hi"
    ids = ids_of(tokenizer, long_prompt)
    max_seq_len, min_new = 8, 3
    assert len(ids) > max_seq_len - min_new  # the test needs a prompt that is really too long
    src = write_jsonl(tmp_path / "p.jsonl", [short_prompt, long_prompt])
    out = tmp_path / "out"

    args = create_args(src, out, max_seq_len, "--truncate", "left", "--min_new_tokens", str(min_new))
    assert create.main(args) == 0

    data, lengths, _ = read_h5(out)
    tail = ids[-(max_seq_len - min_new):]
    assert data.tolist() == [expected_row(ids_of(tokenizer, short_prompt), max_seq_len), expected_row(tail, max_seq_len)]
    assert lengths.tolist() == [len(ids_of(tokenizer, short_prompt)), max_seq_len - min_new]
    assert "truncated:     1" in capsys.readouterr().out


def test_prompt_exactly_at_the_limit_is_accepted(tokenizer, tmp_path):
    ids = ids_of(tokenizer, "one two three four")
    src = write_jsonl(tmp_path / "p.jsonl", ["one two three four"])
    out = tmp_path / "out"
    assert create.main(create_args(src, out, len(ids) + 1)) == 0
    data, lengths, _ = read_h5(out)
    assert data.tolist() == [ids + [VOCAB_SIZE]]
    assert lengths.tolist() == [len(ids)]


def test_too_long_prompt_is_an_error(tokenizer, tmp_path, capsys):
    long_prompt = "one two three four five six seven eight nine ten"
    n = len(ids_of(tokenizer, long_prompt))
    src = write_jsonl(tmp_path / "p.jsonl", ["hi", long_prompt])
    out = tmp_path / "out"

    assert create.main(create_args(src, out, 6)) == 2

    err = capsys.readouterr().err
    assert err.startswith("error: 1 prompt(s) longer than max_seq_len - min_new_tokens = 5 tokens: ")
    assert f"row 2 ({n} tokens)" in err
    assert "--truncate left" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_build_rows_lists_first_ten_offending_rows():
    token_lists = [[5, 6, 7]] * 13 + [[5]]
    with pytest.raises(UserError) as info:
        create.build_rows(token_lists, max_seq_len=3, start_token=99)
    message = str(info.value)
    assert message.startswith("13 prompt(s) longer than max_seq_len - min_new_tokens = 2 tokens: row 1 (3 tokens), ")
    assert "row 10 (3 tokens) and 3 more" in message
    assert "row 11" not in message


def test_build_rows_direct():
    data, lengths, truncated = create.build_rows([[1, 2, 3, 4, 5], [], [7]], 5, 100, 2, "left")
    assert data.dtype == np.int32 and data.shape == (3, 5)
    assert data.tolist() == [[3, 4, 5, 100, 100], [100] * 5, [7, 100, 100, 100, 100]]
    assert lengths.dtype == np.int32 and lengths.tolist() == [3, 0, 1]
    assert truncated == 1


def test_start_token_inside_prompt(tokenizer, tmp_path, capsys):
    ids = ids_of(tokenizer, "Hello there")
    src = write_jsonl(tmp_path / "p.jsonl", ["ok", "Hello there"])

    assert create.main(create_args(src, tmp_path / "out", 8, "--start_token", str(ids[1]))) == 2

    err = capsys.readouterr().err
    assert err.startswith(f"error: the start token {ids[1]} occurs inside 1 prompt(s): row 2 (1 first at position)")


def test_chat_template_with_eos_as_start_token_is_refused(tmp_path, capsys):
    # Every chat-formatted prompt contains <|im_end|>: using it as the start token must fail.
    src = write_jsonl(tmp_path / "p.jsonl", ["a", "b"])
    assert create.main(create_args(src, tmp_path / "out", 64, "--chat_template", "--start_token", str(EOS_ID))) == 2
    assert "occurs inside 2 prompt(s): row 1" in capsys.readouterr().err


def test_empty_prompt_kept_and_counted(tokenizer, tmp_path, capsys):
    src = write_jsonl(tmp_path / "p.jsonl", ["Hello there", "", "bye"])
    out = tmp_path / "out"

    assert create.main(create_args(src, out, 8)) == 0

    data, lengths, attrs = read_h5(out)
    assert data.shape == (3, 8) and attrs["num_samples"] == 3
    assert data[1].tolist() == [VOCAB_SIZE] * 8
    assert data[2].tolist() == expected_row(ids_of(tokenizer, "bye"), 8)
    assert lengths.tolist() == [len(ids_of(tokenizer, "Hello there")), 0, len(ids_of(tokenizer, "bye"))]
    stdout = capsys.readouterr().out
    assert "empty:         1" in stdout
    assert "warning: 1 empty prompt(s) kept as rows (rows 2)" in stdout


def test_rerun_replaces_output(tokenizer, tmp_path):
    out = tmp_path / "out"
    assert create.main(create_args(write_jsonl(tmp_path / "a.jsonl", ["a", "b"]), out, 8)) == 0
    assert create.main(create_args(write_jsonl(tmp_path / "c.jsonl", ["c"]), out, 8)) == 0
    data, _, attrs = read_h5(out)
    assert data.tolist() == [expected_row(ids_of(tokenizer, "c"), 8)]
    assert attrs["source"] == "c.jsonl"
    assert sorted(os.listdir(out)) == ["data.h5"]


# --------------------------------------------------------------------------------------------
# create_inference_h5: errors
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# decode_predictions
# --------------------------------------------------------------------------------------------

MAX_SEQ_LEN = 24
START = VOCAB_SIZE


def write_predictions(
    model_dir: Path, step: int, rows: list[tuple[int, list[int], list[int], str]], batch_size: int,
    loop_dim: int | None = None, drop: str | None = None,
) -> Path:
    """Writes predictions_<step>.npz like a zoo-infer run: rows are (sample_index, prompt, completion, reason).

    Rows past len(rows) are dummy padding (sample_index -1). With loop_dim 0 predictions are stored
    transposed; `drop` leaves one key out.
    """
    folder = model_dir / "artifacts" / "predictions"
    folder.mkdir(parents=True, exist_ok=True)
    predictions = np.full((batch_size, MAX_SEQ_LEN), START, dtype=np.int32)
    sample_index = np.full(batch_size, -1, dtype=np.int64)
    prompt_length = np.zeros(batch_size, dtype=np.int32)
    num_generated = np.zeros(batch_size, dtype=np.int32)
    stop_reason = np.array(["dummy"] * batch_size, dtype="<U13")
    for i, (index, prompt, completion, reason) in enumerate(rows):
        predictions[i, : len(prompt) + len(completion)] = prompt + completion
        sample_index[i], prompt_length[i], num_generated[i], stop_reason[i] = index, len(prompt), len(completion), reason
    arrays = {
        "global_step": np.array(step),
        "predictions": predictions.T if loop_dim == 0 else predictions,
        "sample_index": sample_index,
        "prompt_length": prompt_length,
        "num_generated": num_generated,
        "stop_reason": stop_reason,
    }
    if loop_dim is not None:
        arrays["loop_dim"] = np.array(loop_dim)
    if drop:
        del arrays[drop]
    path = folder / f"predictions_{step}.npz"
    np.savez(path, **arrays)
    return path


def decode_args(model_dir: Path, output: Path, *extra: str) -> list[str]:
    return ["--model_dir", str(model_dir), "--tokenizer", str(TOKENIZER_DIR), "--output", str(output), *extra]


def expected_record(tokenizer, index, prompt, completion, reason, skip=False) -> dict:
    return {
        "sample_index": index,
        "prompt": tokenizer.decode(prompt, skip_special_tokens=skip),
        "completion": tokenizer.decode(completion, skip_special_tokens=skip),
        "num_generated": len(completion),
        "stop_reason": reason,
    }


@pytest.fixture
def ten_step_run(tokenizer, tmp_path):
    """A run of 10 steps, batch size 2: samples 0..18 (the last batch has a dummy row).

    Step 2 is stored with loop_dim 0. Sample i's prompt is 'Question i' in chat markup, its
    completion 'Answer i' ending in <|im_end|> (stop_sequence) except in odd samples (max_tokens).
    """
    model_dir = tmp_path / "run"
    samples = {}
    for index in range(19):
        prompt = [1] + tokenizer(f"Question {index}", add_special_tokens=False)["input_ids"] + [2]
        answer = tokenizer(f"Answer {index} é", add_special_tokens=False)["input_ids"]
        completion = answer + [EOS_ID] if index % 2 == 0 else answer
        reason = "stop_sequence" if index % 2 == 0 else "max_tokens"
        samples[index] = (index, prompt, completion, reason)
    for step in range(1, 11):
        rows = [samples[i] for i in (2 * step - 2, 2 * step - 1) if i in samples]
        write_predictions(model_dir, step, rows, batch_size=2, loop_dim=0 if step == 2 else None)
    return model_dir, samples


def test_files_sorted_numerically(ten_step_run):
    model_dir, _ = ten_step_run
    files = decode.find_prediction_files(model_dir)
    assert [f.name for f in files] == [f"predictions_{step}.npz" for step in range(1, 11)]


def test_decode_exact_jsonl(tokenizer, ten_step_run, tmp_path, capsys):
    model_dir, samples = ten_step_run
    output = tmp_path / "completions.jsonl"

    assert decode.main(decode_args(model_dir, output)) == 0

    lines = output.read_text(encoding="utf-8").splitlines()
    expected = [expected_record(tokenizer, *samples[i]) for i in range(19)]
    assert lines == [json.dumps(record, ensure_ascii=False) for record in expected]
    assert list(json.loads(lines[0])) == ["sample_index", "prompt", "completion", "num_generated", "stop_reason"]
    # Spot-check the decoded text itself, independent of the expected-value helper.
    assert json.loads(lines[3])["prompt"] == "<|im_start|>Question 3<|im_end|>"
    assert json.loads(lines[3])["completion"] == "Answer 3 é"
    assert json.loads(lines[4])["completion"] == "Answer 4 é<|im_end|>"
    assert json.loads(lines[2])["prompt"] == "<|im_start|>Question 2<|im_end|>"  # from the loop_dim 0 file
    assert capsys.readouterr().err.strip().endswith(f"decoded 19 sample(s) to {output}")


def test_decode_skip_special_tokens(tokenizer, ten_step_run, tmp_path):
    model_dir, samples = ten_step_run
    output = tmp_path / "completions.jsonl"

    assert decode.main(decode_args(model_dir, output, "--skip_special_tokens")) == 0

    records = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    assert records == [expected_record(tokenizer, *samples[i], skip=True) for i in range(19)]
    assert records[4]["prompt"] == "Question 4" and records[4]["completion"] == "Answer 4 é"


def test_decode_to_stdout(tokenizer, tmp_path, capsys):
    model_dir = tmp_path / "run"
    prompt, completion = tokenizer("Hi", add_special_tokens=False)["input_ids"], [EOS_ID]
    write_predictions(model_dir, 1, [(0, prompt, completion, "stop_sequence")], batch_size=3)

    assert decode.main(["--model_dir", str(model_dir), "--tokenizer", str(TOKENIZER_DIR)]) == 0

    captured = capsys.readouterr()
    assert captured.out == json.dumps(
        {"sample_index": 0, "prompt": "Hi", "completion": "<|im_end|>", "num_generated": 1, "stop_reason": "stop_sequence"}
    ) + "\n"
    assert "decoded 1 sample(s) to stdout" in captured.err


def test_decode_sorts_by_sample_index_and_later_step_wins(tokenizer, tmp_path, capsys):
    model_dir = tmp_path / "run"
    a, b, c = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("alpha", "beta", "gamma"))
    write_predictions(model_dir, 1, [(5, a, b, "max_tokens"), (2, b, a, "max_tokens")], batch_size=2)
    write_predictions(model_dir, 2, [(5, a, c, "max_seq_len")], batch_size=2)

    records = decode.decode_predictions(model_dir, tokenizer)

    assert records == [
        {"sample_index": 2, "prompt": "beta", "completion": "alpha", "num_generated": len(a), "stop_reason": "max_tokens"},
        {"sample_index": 5, "prompt": "alpha", "completion": "gamma", "num_generated": len(c), "stop_reason": "max_seq_len"},
    ]
    assert "sample_index 5 appears more than once; keeping the one from predictions_2.npz" in capsys.readouterr().err


def test_decode_missing_step_warns(tokenizer, tmp_path, capsys):
    model_dir = tmp_path / "run"
    ids = tokenizer("x", add_special_tokens=False)["input_ids"]
    for step in (1, 2, 5, 7):
        write_predictions(model_dir, step, [(step, ids, ids, "max_tokens")], batch_size=1)
    output = tmp_path / "out.jsonl"

    assert decode.main(decode_args(model_dir, output)) == 0

    assert [json.loads(line)["sample_index"] for line in output.read_text().splitlines()] == [1, 2, 5, 7]
    err = capsys.readouterr().err
    assert "warning: predictions for global step(s) 3-4, 6 are missing" in err


def test_decode_no_warning_for_complete_run(ten_step_run, tmp_path, capsys):
    model_dir, _ = ten_step_run
    assert decode.main(decode_args(model_dir, tmp_path / "o.jsonl")) == 0
    assert not any(line.startswith("warning:") for line in capsys.readouterr().err.splitlines())


@pytest.mark.parametrize("key", ["sample_index", "stop_reason", "predictions", "global_step"])
def test_decode_missing_key(tmp_path, capsys, key):
    model_dir = tmp_path / "run"
    path = write_predictions(model_dir, 1, [(0, [5, 6], [7], "max_tokens")], batch_size=1, drop=key)
    output = tmp_path / "out.jsonl"

    assert decode.main(decode_args(model_dir, output)) == 2

    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: missing key {key!r}; decoding needs the per-row keys zoo-infer writes")
    assert err.count("\n") == 1
    assert not output.exists()


def test_decode_no_predictions_folder(tmp_path, capsys):
    assert decode.main(decode_args(tmp_path, tmp_path / "o.jsonl")) == 2
    assert capsys.readouterr().err.startswith(
        f"error: no predictions folder {tmp_path / 'artifacts' / 'predictions'}"
    )


def test_decode_no_prediction_files(tmp_path, capsys):
    folder = tmp_path / "artifacts" / "predictions"
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("x")
    assert decode.main(decode_args(tmp_path, tmp_path / "o.jsonl")) == 2
    assert capsys.readouterr().err == f"error: no predictions_<step>.npz files in {folder}\n"


def test_decode_row_that_does_not_fit(tmp_path, capsys):
    model_dir = tmp_path / "run"
    path = write_predictions(model_dir, 1, [(0, [5, 6], [7], "max_tokens")], batch_size=1)
    with np.load(path) as npz:
        arrays = dict(npz)
    arrays["num_generated"] = np.array([MAX_SEQ_LEN], dtype=np.int32)
    np.savez(path, **arrays)
    assert decode.main(decode_args(model_dir, tmp_path / "o.jsonl")) == 2
    assert f"does not fit in max_seq_len {MAX_SEQ_LEN}" in capsys.readouterr().err


def test_format_and_missing_steps():
    assert decode.format_steps([3, 4, 5, 8]) == "3-5, 8"
    assert decode.missing_steps([1, 2, 5, 7]) == [3, 4, 6]
    assert decode.missing_steps([3, 4]) == [1, 2]
    assert decode.missing_steps([0, 1, 2]) == []
