"""Ids from prompt files carried through create_inference_h5.py, the run and decode_predictions.py; bad ids and bad
per-row datasets are one-line errors."""
from __future__ import annotations

import json
import os

import h5py
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from data_tools import create_inference_h5 as create  # noqa: E402
from data_tools import decode_predictions as decode  # noqa: E402
from harness import load_predictions, prompt_rows, run_job, save_tiny_model, write_h5, write_params  # noqa: E402
from openai_requests import MODEL, write_jsonl, write_run_params  # noqa: E402
from tiny_configs import VOCAB, tiny_llama_config  # noqa: E402


def test_csv_ids_reach_the_predictions_and_the_decoded_lines(tmp_path):
    source = tmp_path / "prompts.csv"
    source.write_text("id,prompt\nq-7,Name a color.\nq-3,Name a fruit.\nq-9,Name a tree.\n")
    assert create.main(["--input", str(source), "--tokenizer", str(MODEL), "--chat_template",
                        "--max_seq_len", "40", "--output_dir", str(tmp_path / "data")]) == 0
    params = write_run_params(tmp_path / "params.yaml", tmp_path / "data")
    assert run_job(params, tmp_path / "run", "--inference_steps", "1") == 0  # a partial run: 2 of 3
    files = load_predictions(tmp_path / "run")
    assert files[1]["sample_id"].tolist() == ["q-7", "q-3"]
    assert run_job(params, tmp_path / "run") == 0  # resumed: the last batch, one dummy row
    assert load_predictions(tmp_path / "run")[2]["sample_id"].tolist() == ["q-9", ""]
    out = tmp_path / "out.jsonl"
    assert decode.main(["--model_dir", str(tmp_path / "run"), "--tokenizer", str(MODEL), "--output", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["sample_index"], r["sample_id"]) for r in records] == [(0, "q-7"), (1, "q-3"), (2, "q-9")]


def test_jsonl_id_field(tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", [{"key": 11, "prompt": "a"}, {"key": "b7", "prompt": "b"}])
    assert create.main(["--input", str(source), "--tokenizer", str(MODEL), "--id_field", "key",
                        "--max_seq_len", "16", "--output_dir", str(tmp_path / "data")]) == 0
    with h5py.File(tmp_path / "data" / "data.h5") as h5:
        assert [s.decode() for s in h5["sample_id"][:]] == ["11", "b7"]


def test_files_without_ids_write_no_sample_id(tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    assert create.main(["--input", str(source), "--tokenizer", str(MODEL), "--max_seq_len", "16",
                        "--output_dir", str(tmp_path / "data")]) == 0
    with h5py.File(tmp_path / "data" / "data.h5") as h5:
        assert "sample_id" not in h5


@pytest.mark.parametrize("name, text, extra, message", [
    ("p.csv", "id,prompt\na,x\nb,y\na,z\nb,w\n", [], "ids must be unique; used more than once: 'a' (rows 1, 3), "
                                                     "'b' (rows 2, 4)"),
    ("p.jsonl", '{"id": "a", "prompt": "x"}\n{"prompt": "y"}\n', [], "line 2 has no id field 'id'"),
    ("p.jsonl", '{"id": null, "prompt": "x"}\n', [], "id field 'id' must be a non-empty string or an integer"),
    ("p.csv", "prompt\nx\n", ["--id_field", "uid"], "no id column 'uid' (columns: 'prompt'"),
    ("p.txt", "x\n", ["--id_field", "uid"], "a .txt file has no fields, so no --id_field"),
])
def test_bad_ids_are_one_line_errors(tmp_path, capsys, name, text, extra, message):
    source = tmp_path / name
    source.write_text(text)
    assert create.main(["--input", str(source), "--tokenizer", str(MODEL), "--max_seq_len", "16",
                        "--output_dir", str(tmp_path / "data"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_decode_openai_needs_a_batch_made_data(tmp_path, capsys):
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    assert create.main(["--input", str(source), "--tokenizer", str(MODEL), "--max_seq_len", "16",
                        "--output_dir", str(tmp_path / "data")]) == 0
    params = write_run_params(tmp_path / "params.yaml", tmp_path / "data")
    assert run_job(params, tmp_path / "run") == 0
    assert decode.main(["--model_dir", str(tmp_path / "run"), "--tokenizer", str(MODEL),
                        "--format", "openai_batch"]) == 2
    assert "holds no OpenAI batch requests: make it with create_inference_h5.py --format openai_batch" in \
        capsys.readouterr().err


@pytest.mark.parametrize("layout, message", [
    ({"a.h5": {"sample_id": ["x", "y"]}, "b.h5": {}}, "has the per-row dataset 'sample_id' but"),
    ({"a.h5": {"sample_id": ["x"]}}, "dataset 'sample_id' has shape (1,), expected (2,)"),
    ({"a.h5": {"stop_sequences": ["[[1]]", "[1, 2]"]}}, "a stop_sequences entry is not a JSON list of token-id lists: "
                                                        "'[1, 2]'"),
])
def test_bad_per_row_datasets_are_one_line_errors(tmp_path, capsys, layout, message):
    for name, per_row in layout.items():
        path = write_h5(tmp_path / "data", prompt_rows([[5, 6], [7]], 16, VOCAB), name=name)
        with h5py.File(path, "a") as h5:
            for key, values in per_row.items():
                h5.create_dataset(key, data=values, dtype=h5py.string_dtype())
    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "model")
    capsys.readouterr()  # the checkpoint writer's progress bar
    params = write_params(tmp_path / "params.yaml", checkpoint, tmp_path / "data", batch_size=2, start_token=VOCAB,
                          max_tokens=2)
    assert run_job(params, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
