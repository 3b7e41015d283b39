"""The real default model, SmolLM2-135M-Instruct, end to end: prompts file -> .h5 -> run -> JSONL,
token-exact with transformers greedy in fp32."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data_tools import create_inference_h5, decode_predictions
from harness import SMOLLM2_DIR, expected_rows, hf_greedy, run_job, stacked_predictions, write_params

EOS = 2  # <|im_end|>
START = 49152  # the vocabulary size: an id outside it
MAX_TOKENS = 24
EXAMPLES = Path(__file__).resolve().parents[1] / "data_tools" / "examples" / "prompts.jsonl"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    if not (SMOLLM2_DIR / "model.safetensors").is_file():
        pytest.fail(f"default model missing at {SMOLLM2_DIR}: run `make setup`")
    return SMOLLM2_DIR


@pytest.fixture(scope="module")
def job(smollm2, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """12 real prompts of mixed lengths through the data tool and the runner (batch 5: a partial last batch)."""
    work = tmp_path_factory.mktemp("smollm2")
    lines = EXAMPLES.read_text().splitlines()[:12]
    (work / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    assert create_inference_h5.main(["--input", str(work / "prompts.jsonl"), "--tokenizer", str(smollm2),
                                     "--max_seq_len", "160", "--chat_template", "--output_dir", str(work / "data")]) == 0
    params = write_params(work / "params.yaml", smollm2, work / "data", batch_size=5, start_token=START,
                          stop_sequences=[[EOS]], max_tokens=MAX_TOKENS)
    assert run_job(params, work / "run") == 0
    import h5py

    with h5py.File(work / "data" / "data.h5") as handle:
        lengths = handle["prompt_lengths"][:]
        prompts = [row[:n].tolist() for row, n in zip(handle["data"][:], lengths)]
    assert len(set(lengths)) >= 6  # mixed lengths
    return work / "run", prompts


def test_predictions_equal_transformers_greedy(smollm2, job):
    model_dir, prompts = job
    reference = hf_greedy(smollm2, prompts, MAX_TOKENS, stop_sequences=[[EOS]])
    assert any(r[-1] == EOS for r in reference) and any(len(r) == MAX_TOKENS for r in reference)
    got = stacked_predictions(model_dir)
    np.testing.assert_array_equal(got[:12], expected_rows(prompts, reference, 160, START))
    np.testing.assert_array_equal(got[12:], np.full((3, 160), START))  # dummy rows of the last batch


def test_decoded_text_is_the_models_answer(smollm2, job, tmp_path):
    model_dir, _ = job
    out = tmp_path / "out.jsonl"
    assert decode_predictions.main(["--model_dir", str(model_dir), "--tokenizer", str(smollm2),
                                    "--skip_special_tokens", "--output", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["sample_index"] for r in records] == list(range(12))
    first = records[0]
    assert first["prompt"].endswith("What is the capital of Australia?\nassistant\n")
    assert first["completion"] == "The capital of Australia is Canberra."
    assert first["stop_reason"] == "stop_sequence" and first["num_generated"] == 8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_do_not_depend_on_the_batch_or_a_resume(smollm2, job, tmp_path, dtype):
    """The same 12 prompts at batch_size 1, 7 and 32, and at 7 resumed after one step: every sample's row
    is the same bits, whatever rows shared its decode steps and prefill groups (the GEMM backends are
    chosen batch-invariant; the small last steps and packed prefill change nothing)."""
    data = job[0].parent / "data"
    rows = {}
    for batch_size in (1, 7, 32):
        params = write_params(tmp_path / f"params_{batch_size}.yaml", smollm2, data, batch_size=batch_size,
                              start_token=START, stop_sequences=[[EOS]], max_tokens=MAX_TOKENS, dtype=dtype)
        assert run_job(params, tmp_path / f"run_{batch_size}") == 0
        rows[batch_size] = stacked_predictions(tmp_path / f"run_{batch_size}")[:12]
    assert run_job(tmp_path / "params_7.yaml", tmp_path / "resumed", "--inference_steps", "1") == 0
    assert run_job(tmp_path / "params_7.yaml", tmp_path / "resumed") == 0
    for other in (rows[7], rows[32], stacked_predictions(tmp_path / "resumed")[:12]):
        np.testing.assert_array_equal(other, rows[1])
