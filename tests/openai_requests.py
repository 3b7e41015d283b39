"""OpenAI batch requests for the SmolLM2 tests, and the params and tools that run them: run_inference.py, then
decode_predictions.py."""
from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from data_tools import decode_predictions as decode  # noqa: E402
from harness import run_job  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = REPO_ROOT / "models" / "smollm2-135m-instruct"
EOS, START, MAX_SEQ_LEN, RUN_MAX_TOKENS = 2, 49152, 80, 16


def request(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "smollm2", **body}}


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_run_params(path: Path, data_dir: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "model": {"checkpoint_path": str(MODEL), "dtype": "float32", "start_token": START, "stop_sequences": [[EOS]],
                  "max_tokens": RUN_MAX_TOKENS},
        "inference_input": {"data_processor": "GptHDF5MapDataProcessor", "data_dir": str(data_dir), "batch_size": 2},
        "runconfig": {"device": "cpu"}}))
    return path


def run_and_decode(tmp_path: Path, **model_keys) -> dict[str, dict]:
    """The job on tmp_path/data under the test params with more `model_keys`, decoded as an OpenAI batch:
    custom_id -> output line."""
    params = write_run_params(tmp_path / "params.yaml", tmp_path / "data")
    raw = yaml.safe_load(params.read_text())
    raw["model"].update(model_keys)
    params.write_text(yaml.safe_dump(raw))
    assert run_job(params, tmp_path / "run") == 0
    out = tmp_path / "responses.jsonl"
    assert decode.main(["--model_dir", str(tmp_path / "run"), "--tokenizer", str(MODEL), "--format", "openai_batch",
                        "--output", str(out)]) == 0
    return {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}
