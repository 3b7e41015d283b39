"""Parquet prompt tables: read row group by row group, written to the .h5 chunk by chunk, ids carried
through; the same rows as the same prompts given as a CSV file."""
from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from data_tools import create_inference_h5 as create  # noqa: E402
from data_tools import decode_predictions as decode  # noqa: E402
from data_tools.prompts import iter_parquet_prompts  # noqa: E402
from harness import run_job  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"
PROMPTS = ["Name a color.", "", "What is 2 + 2?", "Say hi.", "List three fruits.", "Why is the sky blue?",
           "Spell cat.", "One word for happy?", "Count to three.", "Name a tree."]
IDS = [f"q{i:02d}" for i in range(len(PROMPTS))]


def write_parquet(path: Path, columns: dict[str, list], row_group_size: int = 3) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def create_h5(source: Path, out: Path, *extra: str) -> int:
    return create.main(["--input", str(source), "--tokenizer", str(MODEL), "--max_seq_len", "64",
                        "--output_dir", str(out), *extra])


def contents(folder: Path) -> dict:
    with h5py.File(folder / "data.h5") as h5:
        return {"data": h5["data"][()], "prompt_lengths": h5["prompt_lengths"][()],
                "sample_id": [s.decode() for s in h5["sample_id"][()]], "num_samples": int(h5.attrs["num_samples"]),
                "resizable": h5["data"].maxshape[0] is None and h5["data"].chunks is not None}


def test_row_groups_are_read_one_chunk_at_a_time(tmp_path):
    source = write_parquet(tmp_path / "p.parquet", {"id": IDS, "prompt": PROMPTS})
    chunks = list(iter_parquet_prompts(source, "prompt", None, 3))
    assert [len(c.prompts) for c in chunks] == [3, 3, 3, 1]
    assert [p for c in chunks for p in c.prompts] == PROMPTS and [i for c in chunks for i in c.ids] == IDS


def test_parquet_gives_the_rows_the_csv_gives(tmp_path, monkeypatch):
    source = write_parquet(tmp_path / "p.parquet", {"id": IDS, "prompt": PROMPTS, "other": list(range(10))})
    csv = tmp_path / "p.csv"
    csv.write_text("id,prompt\n" + "".join(f'{i},"{p}"\n' for i, p in zip(IDS, PROMPTS)))
    monkeypatch.setattr(create, "CHUNK_PROMPTS", 4)  # several chunks: 4 + 4 + 2 rows
    assert create_h5(source, tmp_path / "parquet", "--chat_template") == 0
    assert create_h5(csv, tmp_path / "csv", "--chat_template") == 0
    got, want = contents(tmp_path / "parquet"), contents(tmp_path / "csv")
    assert np.array_equal(got["data"], want["data"]) and np.array_equal(got["prompt_lengths"], want["prompt_lengths"])
    assert got["sample_id"] == want["sample_id"] == IDS and got["num_samples"] == 10 and got["resizable"]


def test_parquet_ids_reach_the_decoded_lines(tmp_path):
    source = write_parquet(tmp_path / "p.parquet", {"key": ["a", "b", "c"], "text": PROMPTS[:3]}, row_group_size=2)
    assert create_h5(source, tmp_path / "data", "--column", "text", "--id_field", "key", "--chat_template") == 0
    params = tmp_path / "params.yaml"
    params.write_text(json.dumps({
        "model": {"checkpoint_path": str(MODEL), "dtype": "float32", "start_token": 49152, "stop_sequences": [[2]],
                  "max_tokens": 4},
        "inference_input": {"data_processor": "GptHDF5MapDataProcessor", "data_dir": str(tmp_path / "data"),
                            "batch_size": 2},
        "runconfig": {"device": "cpu"}}))
    assert run_job(params, tmp_path / "run") == 0
    out = tmp_path / "out.jsonl"
    assert decode.main(["--model_dir", str(tmp_path / "run"), "--tokenizer", str(MODEL), "--output", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["sample_index"], r["sample_id"]) for r in records] == [(0, "a"), (1, "b"), (2, "c")]


@pytest.mark.parametrize("columns, extra, message", [
    ({"text": ["a"]}, [], "no column 'prompt' (columns: 'text'; use --column to pick one)"),
    ({"prompt": [1, 2]}, [], "column 'prompt' holds int64, not strings"),
    ({"prompt": ["a", "b"], "id": ["x", None]}, [], "row 2: id field 'id' must be a non-empty string or an integer"),
    ({"prompt": ["a"] * 8, "id": ["x", "y", "z", "w", "v", "u", "t", "y"]}, [],
     "ids must be unique; used more than once: 'y' (rows 2, 8)"),
    ({"prompt": ["a"]}, ["--id_field", "uid"], "no id column 'uid' (columns: 'prompt'; use --id_field to pick one)"),
])
def test_bad_tables_are_one_line_errors(tmp_path, capsys, columns, extra, message):
    source = write_parquet(tmp_path / "p.parquet", columns)
    assert create_h5(source, tmp_path / "out", *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()  # nothing left behind, not even the folder


def test_a_file_that_is_not_parquet_is_named(tmp_path, capsys):
    source = tmp_path / "p.parquet"
    source.write_bytes(b"not a parquet file at all")
    assert create_h5(source, tmp_path / "out") == 2
    assert f"error: {source}: not a readable parquet file" in capsys.readouterr().err
