"""runconfig.rows_in_flight (modelzoo/runtime.py): how many rows generate together, apart from the
files' batch_size. Any count gives the same files, equal to transformers' greedy rows; auto takes every
row to do up to its cap and within the memory share; bad values are one-line errors."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

import modelzoo.runtime as runtime
from modelzoo.models.kv_cache import stored_positions
from harness import (expected_rows, hf_greedy, load_predictions, prompt_rows, run_job, save_tiny_model,
                     stacked_predictions, write_h5, write_params)
from tiny_configs import tiny_llama_config

VOCAB = 96
START = VOCAB
MAX_SEQ_LEN = 40
MAX_TOKENS = 6
BATCH = 3
PROMPT_LENGTHS = (3, 9, 1, 17, 5, 12, 2)  # 7 prompts: 3 files of 3 rows, the last with 2 dummy rows


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(2)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]


def run(tmp_path: Path, checkpoint: Path, prompts: list[list[int]], name: str, rows_in_flight, *flags: str) -> Path:
    data = tmp_path / "data"
    if not data.exists():
        write_h5(data, prompt_rows(prompts, MAX_SEQ_LEN, START))
    params = write_params(tmp_path / f"{name}.yaml", checkpoint, data, batch_size=BATCH, start_token=START,
                          max_tokens=MAX_TOKENS, rows_in_flight=rows_in_flight)
    assert run_job(params, tmp_path / name, *flags) == 0
    return tmp_path / name


def summary(model_dir: Path) -> dict:
    return json.loads((model_dir / "artifacts" / "summary.json").read_text())


def test_every_count_writes_the_same_files_as_transformers(tiny_llama, prompts, tmp_path):
    """1 row at a time, fewer than batch_size, batch_size, more, every row: identical files, transformers' rows."""
    want = expected_rows(prompts, hf_greedy(tiny_llama, prompts, MAX_TOKENS), MAX_SEQ_LEN, START)
    for count in (1, 2, 3, 5, 7, "auto"):
        model_dir = run(tmp_path, tiny_llama, prompts, f"r{count}", count)
        assert sorted(load_predictions(model_dir)) == [1, 2, 3], count
        np.testing.assert_array_equal(stacked_predictions(model_dir)[:len(prompts)], want, err_msg=str(count))
        assert summary(model_dir)["rows_in_flight"] == (7 if count == "auto" else count)


def test_auto_takes_every_row_to_do_and_logs_why(tiny_llama, prompts, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="zoo-infer"):
        model_dir = run(tmp_path, tiny_llama, prompts, "auto", "auto", "--inference_steps", "2")
    assert summary(model_dir)["rows_in_flight"] == 6  # 2 files of 3 rows to do
    assert "rows in flight: 6 (auto: 6 rows to do, at most 256, KV cache within 50% of the free memory" in caplog.text
    assert "(6 rows in flight x max_seq_len 40)" in caplog.text


def test_auto_never_goes_below_batch_size(tiny_llama, prompts, tmp_path):
    model_dir = run(tmp_path, tiny_llama, prompts, "one", "auto", "--inference_steps", "1")
    assert summary(model_dir)["rows_in_flight"] == BATCH
    model_dir = run(tmp_path / "one_row", tiny_llama, prompts[:1], "last", "auto")  # one real row, batch_size 3
    assert summary(model_dir)["rows_in_flight"] == BATCH


def test_auto_keeps_the_kv_cache_within_its_memory_share(tiny_llama, prompts, tmp_path, monkeypatch):
    config = tiny_llama_config()
    per_row = 2 * config.num_hidden_layers * config.num_key_value_heads * stored_positions(MAX_SEQ_LEN) * \
        (config.hidden_size // config.num_attention_heads) * 4  # keys and values, float32, the positions cached
    monkeypatch.setattr(runtime, "available_memory", lambda device: 10 * per_row)  # 50%: 5 rows
    model_dir = run(tmp_path, tiny_llama, prompts, "capped", "auto")
    assert summary(model_dir)["rows_in_flight"] == 5
    monkeypatch.setattr(runtime, "AUTO_ROWS_IN_FLIGHT", 4)
    model_dir = run(tmp_path, tiny_llama, prompts, "cap", "auto")
    assert summary(model_dir)["rows_in_flight"] == 4


def test_a_count_whose_cache_does_not_fit_is_a_one_line_error(tiny_llama, prompts, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runtime, "available_memory", lambda device: 1000)
    write_h5(tmp_path / "data", prompt_rows(prompts, MAX_SEQ_LEN, START))
    params = write_params(tmp_path / "p.yaml", tiny_llama, tmp_path / "data", batch_size=BATCH, start_token=START,
                          max_tokens=MAX_TOKENS, rows_in_flight=4)
    assert run_job(params, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the KV cache needs ") and err.count("\n") == 1
    assert "lower runconfig.rows_in_flight (or inference_input.batch_size) or the data's max_seq_len" in err


@pytest.mark.parametrize("value", [0, -3, 2.5, "many", True, None])
def test_bad_rows_in_flight_is_a_one_line_error(tiny_llama, prompts, tmp_path, capsys, value):
    write_h5(tmp_path / "data", prompt_rows(prompts, MAX_SEQ_LEN, START))
    params = write_params(tmp_path / "p.yaml", tiny_llama, tmp_path / "data", batch_size=BATCH, start_token=START,
                          rows_in_flight=value)
    assert run_job(params, tmp_path / "run") == 2
    assert capsys.readouterr().err == ("error: runconfig.rows_in_flight must be auto or an integer >= 1 (rows "
                                       f"generated together), got {value!r}\n")


def test_a_resumed_run_counts_only_the_rows_left_and_writes_the_same_files(tiny_llama, prompts, tmp_path):
    whole = run(tmp_path, tiny_llama, prompts, "whole", "auto")
    resumed = run(tmp_path, tiny_llama, prompts, "resumed", "auto", "--inference_steps", "1")
    assert summary(resumed)["rows_in_flight"] == BATCH
    run(tmp_path, tiny_llama, prompts, "resumed", "auto")  # steps 2 and 3 left: 4 real rows
    assert summary(resumed)["rows_in_flight"] == 4 and summary(resumed)["samples_skipped"] == BATCH
    np.testing.assert_array_equal(stacked_predictions(resumed), stacked_predictions(whole))
