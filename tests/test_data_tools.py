"""Tests for data_tools/create_inference_h5.py: prompt files to data.h5, row by row.

They use the real SmolLM2-135M-Instruct tokenizer (vocab 49152, eos <|im_end|> = 2), so the
token ids checked here are the ones a real run would see.
"""
from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

from data_tools import create_inference_h5 as create  # noqa: E402
from data_tools.prompts import read_prompts  # noqa: E402
from modelzoo import __version__  # noqa: E402
from modelzoo.errors import UserError  # noqa: E402
from prompt_files import EOS_ID, TOKENIZER_DIR, VOCAB_SIZE, create_args, write_jsonl  # noqa: E402


def ids_of(tokenizer, text: str) -> list[int]:
    """Token ids the tool must produce for `text` without --chat_template."""
    return tokenizer(text)["input_ids"]


def chat_ids_of(tokenizer, text: str) -> list[int]:
    """Token ids the tool must produce for `text` with --chat_template."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def read_h5(out_dir: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """Returns data, prompt_lengths and the attributes of out_dir/data.h5."""
    with h5py.File(out_dir / "data.h5", "r") as h5:
        return h5["data"][()], h5["prompt_lengths"][()], dict(h5.attrs)


def expected_row(ids: list[int], max_seq_len: int, start: int = VOCAB_SIZE) -> list[int]:
    """A row as the tool must write it: the prompt, then the start token to the end."""
    return ids + [start] * (max_seq_len - len(ids))


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
