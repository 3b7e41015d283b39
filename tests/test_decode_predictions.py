"""data_tools/decode_predictions.py: a run's prediction files decoded with the real tokenizer, and its errors."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

from data_tools import decode_predictions as decode  # noqa: E402
from prompt_files import EOS_ID, TOKENIZER_DIR, VOCAB_SIZE  # noqa: E402

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
