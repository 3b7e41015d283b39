"""Scoring as a batch job: context / continuation pairs -> create_inference_h5.py --continuation_field ->
run_inference.py -> predictions files holding each continuation's token log-probabilities and is_greedy, equal to
transformers' float32 log-softmax, the same at batch_size 1, 7 and 32 and after a stop and resume; bad inputs are
one-line errors."""
from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from data_tools import create_inference_h5 as create  # noqa: E402
from data_tools import decode_predictions as decode  # noqa: E402
from harness import SMOLLM2_DIR, load_predictions, run_job, write_params  # noqa: E402

START = 49152
PAIRS = [("The capital of France is", " Paris"), ("The capital of France is", " Rome"),
         ("The capital of France is ", "Berlin"),  # the trailing space goes to the continuation
         ("2 + 2 =", " 4"), ("", "Hello world"),  # an empty context is scored after BOS / EOS
         ("def add(a, b):\n    return", " a + b"), ("Once upon a time", " there was a little girl who lived"),
         ("Q: What color is the sky?\nA:", " Blue"), ("Q: What color is the sky?\nA:", " Green")]


def write_pairs(path: Path, pairs=PAIRS) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "context": c, "continuation": x}) + "\n"
                            for i, (c, x) in enumerate(pairs)))
    return path


@pytest.fixture(scope="module")
def scored(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("scoring")
    assert create.main(["--input", str(write_pairs(root / "pairs.jsonl")), "--field", "context",
                        "--continuation_field", "continuation", "--tokenizer", str(SMOLLM2_DIR), "--max_seq_len", "48",
                        "--output_dir", str(root / "data")]) == 0
    runs = {}
    for batch_size in (1, 7, 32):
        params = write_params(root / f"b{batch_size}.yaml", SMOLLM2_DIR, root / "data", batch_size=batch_size,
                              start_token=START, stop_sequences=[[2]], max_tokens=8)
        assert run_job(params, root / f"b{batch_size}") == 0
        runs[batch_size] = root / f"b{batch_size}"
    return {"root": root, "runs": runs}


def rows(model_dir: Path) -> dict[int, tuple]:
    """sample_index -> (context ids, continuation ids, continuation logprobs, is_greedy, stop_reason)."""
    out = {}
    for arrays in load_predictions(model_dir).values():
        for row, index in enumerate(arrays["sample_index"].tolist()):
            if index >= 0:
                begin, count = int(arrays["prompt_length"][row]), int(arrays["num_generated"][row])
                ids = arrays["predictions"][row]
                out[index] = (ids[:begin].tolist(), ids[begin: begin + count].tolist(),
                              arrays["logprobs"][row, begin: begin + count], bool(arrays["is_greedy"][row]),
                              str(arrays["stop_reason"][row]))
    return out


def test_scores_equal_transformers_log_softmax(scored):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(SMOLLM2_DIR, dtype=torch.float32).eval()
    got = rows(scored["runs"][7])
    assert len(got) == len(PAIRS) and {r[4] for r in got.values()} == {"scored"}
    assert got[0][0] == got[2][0]  # "... is " scored as "... is" + " Berlin": the same context tokens
    greedy = []
    for index, (context, continuation, logprobs, is_greedy, _) in got.items():
        ids = torch.tensor([context + continuation])
        with torch.no_grad():
            reference = torch.log_softmax(model(ids).logits[0].float(), -1)
        at = torch.arange(len(context) - 1, ids.shape[1] - 1)
        np.testing.assert_allclose(logprobs, reference[at, ids[0, len(context):]].numpy(), rtol=0, atol=1e-4)
        assert is_greedy == bool((reference[at].argmax(-1) == ids[0, len(context):]).all()), index
        greedy.append(is_greedy)
    assert any(greedy) and not all(greedy)
    assert got[4][0] == [1]  # the empty context: SmolLM2's BOS


def test_the_python_api_scores_every_pair_as_the_job_does(scored):
    """ZooModel.score splits each text pair as the data tool does (an empty context included: BOS, though SmolLM2's
    tokenizer adds none) and gives the job's log-probabilities and is_greedy."""
    from modelzoo.api import ZooModel

    zoo = ZooModel(SMOLLM2_DIR, dtype="float32", max_seq_len=48, rows_in_flight=4)
    job = rows(scored["runs"][7])
    for index, score in enumerate(zoo.score(PAIRS)):
        context, continuation = zoo.encode_pair(*PAIRS[index])
        assert (context.tolist(), continuation.tolist()) == (job[index][0], job[index][1]), index
        np.testing.assert_allclose(score.logprobs, job[index][2], rtol=0, atol=1e-5)
        assert score.is_greedy == job[index][3], index


def test_scores_do_not_depend_on_the_batch_or_a_resume(scored):
    reference = rows(scored["runs"][7])
    for batch_size, model_dir in scored["runs"].items():
        got = rows(model_dir)
        assert all(np.array_equal(got[i][2], reference[i][2]) and got[i][3] == reference[i][3] for i in reference), \
            batch_size
    root = scored["root"]
    params = write_params(root / "resumed.yaml", SMOLLM2_DIR, root / "data", batch_size=2, start_token=START,
                          stop_sequences=[[2]], max_tokens=8)
    assert run_job(params, root / "resumed", "--inference_steps", "2") == 0
    assert len(rows(root / "resumed")) == 4
    assert run_job(params, root / "resumed") == 0
    resumed = rows(root / "resumed")
    assert all(np.array_equal(resumed[i][2], reference[i][2]) for i in reference)
    summary = json.loads((root / "resumed" / "artifacts" / "summary.json").read_text())
    assert summary["stop_reasons"] == {"scored": 5} and summary["generated_tokens"] == 0  # this run's 5 rows


def test_decoded_lines_carry_the_loglikelihood(scored, tmp_path):
    out = tmp_path / "scores.jsonl"
    assert decode.main(["--model_dir", str(scored["runs"][7]), "--tokenizer", str(SMOLLM2_DIR), "--output",
                        str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    got = rows(scored["runs"][7])
    assert [line["sample_id"] for line in lines] == [f"p{i}" for i in range(len(PAIRS))]
    for line in lines:
        index = line["sample_index"]
        assert line["stop_reason"] == "scored" and line["is_greedy"] == got[index][3]
        assert line["loglikelihood"] == pytest.approx(float(got[index][2].astype(np.float64).sum()), abs=1e-9)
        assert line["logprobs"] == got[index][2].tolist()
    assert lines[0]["completion"] == " Paris" and lines[2]["completion"] == " Berlin"
    with h5py.File(scored["root"] / "data" / "data.h5") as h5:
        assert h5["continuation_length"][:].tolist()[:2] == [1, 1]


@pytest.mark.parametrize("name, text, flags, message", [
    ("p.jsonl", '{"context": "a", "answer": "b"}\n', [], "line 1 has no field 'continuation'"),
    ("p.jsonl", '{"context": "a", "continuation": 3}\n', [], "field 'continuation' is a int, not a string"),
    ("p.jsonl", '{"context": "a", "continuation": ""}\n', [], "row 1: its continuation '' has no token to score"),
    ("p.csv", "context,other\na,b\n", [], "no column 'continuation'"),
    ("p.txt", "hello\n", [], "a .txt file has no fields, so no --continuation_field"),
    ("p.jsonl", '{"context": "a", "continuation": "' + "word " * 40 + '"}\n', ["--truncate", "left"],
     "continuation(s) do not fit max_seq_len"),
    ("p.jsonl", '{"context": "a", "continuation": "b"}\n', ["--chat_template"], "without --chat_template or --n"),
])
def test_bad_scoring_inputs_are_one_line_errors(tmp_path, capsys, name, text, flags, message):
    source = tmp_path / name
    source.write_text(text)
    assert create.main(["--input", str(source), "--field", "context", "--column", "context", "--continuation_field",
                        "continuation", "--tokenizer", str(SMOLLM2_DIR), "--max_seq_len", "16", "--output_dir",
                        str(tmp_path / "out"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "data.h5").exists()
