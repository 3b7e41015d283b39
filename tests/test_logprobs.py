"""model.logprobs: each generated token's log-probability under the distribution it was picked from, in the
predictions files and the decoded output; checked against transformers on a tiny model (to 1e-4)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (AutoModelForCausalLM, LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper)

from data_tools import decode_predictions as decode
from harness import family_prompts, load_predictions, prompt_rows, run_job, save_tiny_model, write_h5, write_params
from tiny_configs import VOCAB, tiny_llama_config

MAX_SEQ_LEN, MAX_TOKENS, BATCH = 64, 10, 3
TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"  # decodes the tiny ids too


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("logprobs") / "llama", seed=5)


def run(tmp_path: Path, checkpoint: Path, name: str, loop_dim: int = 1, **model_keys) -> Path:
    prompts = family_prompts(VOCAB)
    data = tmp_path / f"data{loop_dim}"
    if not data.exists():
        write_h5(data, prompt_rows(prompts, MAX_SEQ_LEN, VOCAB), loop_dim=loop_dim)
    params = write_params(tmp_path / f"{name}.yaml", checkpoint, data, batch_size=BATCH, start_token=VOCAB,
                          max_tokens=MAX_TOKENS, loop_dim=loop_dim, model_keys={"logprobs": True, **model_keys})
    assert run_job(params, tmp_path / name) == 0
    return tmp_path / name


def rows_of(model_dir: Path) -> list[tuple[list[int], list[int], np.ndarray, np.ndarray]]:
    """(prompt, generated tokens, their logprobs, the logprobs row) of every real row, in sample order."""
    out = {}
    for arrays in load_predictions(model_dir).values():
        transposed = int(arrays["loop_dim"]) == 0
        predictions = arrays["predictions"].T if transposed else arrays["predictions"]
        logprobs = arrays["logprobs"].T if transposed else arrays["logprobs"]
        assert logprobs.dtype == np.float32 and logprobs.shape == predictions.shape
        for row, index in enumerate(arrays["sample_index"].tolist()):
            if index >= 0:
                begin, count = int(arrays["prompt_length"][row]), int(arrays["num_generated"][row])
                out[index] = (predictions[row, :begin].tolist(), predictions[row, begin:begin + count].tolist(),
                              logprobs[row, begin:begin + count], logprobs[row])
    return [out[i] for i in sorted(out)]


def reference_logprobs(checkpoint: Path, prompt: list[int], generated: list[int],
                       processors: LogitsProcessorList) -> np.ndarray:
    """transformers' log-softmax of the processed scores at each generated position, for our tokens."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + generated])
    with torch.inference_mode():
        logits = model(ids).logits[0].float()  # (T, V)
    out = []
    for step, token in enumerate(generated):
        position = len(prompt) + step - 1  # the logits that chose this token
        scores = processors(ids[:, : position + 1], logits[position][None].clone())
        out.append(float(torch.log_softmax(scores, dim=-1)[0, token]))
    return np.array(out, dtype=np.float32)


def test_greedy_logprobs_equal_transformers_transition_scores(checkpoint, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for prompt, generated, logprobs, row in rows_of(run(tmp_path, checkpoint, "greedy")):
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                             output_scores=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        assert out.sequences[0, len(prompt):].tolist() == generated
        want = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0].numpy()
        np.testing.assert_allclose(logprobs, want, atol=1e-4, rtol=1e-4)
        assert (logprobs <= 0).all() and not row[: len(prompt)].any() and not row[len(prompt) + len(generated):].any()


@pytest.mark.parametrize("keys, processors", [
    ({"repetition_penalty": 1.3}, LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)])),
    ({"temperature": 0.7, "top_k": 20, "seed": 4},
     LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(20)])),
], ids=["repetition_penalty", "sampling"])
def test_processed_logprobs_equal_transformers_processors(checkpoint, tmp_path, keys, processors):
    """Under the distribution the token was picked from: after the penalty, temperature and top-k."""
    for prompt, generated, logprobs, _ in rows_of(run(tmp_path, checkpoint, "processed", **keys)):
        np.testing.assert_allclose(logprobs, reference_logprobs(checkpoint, prompt, generated, processors),
                                   atol=1e-4, rtol=1e-4)
        assert np.isfinite(logprobs).all()


def test_loop_dim_0_transposes_logprobs_with_predictions(checkpoint, tmp_path):
    plain = rows_of(run(tmp_path, checkpoint, "rows"))
    transposed = rows_of(run(tmp_path, checkpoint, "columns", loop_dim=0))
    for a, b in zip(plain, transposed):
        assert a[1] == b[1] and np.array_equal(a[2], b[2])


def test_decode_writes_logprobs_and_refuses_a_run_without(checkpoint, tmp_path, capsys):
    model_dir = run(tmp_path, checkpoint, "greedy")
    out = tmp_path / "out.jsonl"
    assert decode.main(["--model_dir", str(model_dir), "--tokenizer", str(TOKENIZER), "--logprobs",
                        "--output", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for record, (_, generated, logprobs, _) in zip(records, rows_of(model_dir)):
        assert record["logprobs"] == logprobs.tolist() and len(record["logprobs"]) == len(generated)
    params = write_params(tmp_path / "plain.yaml", checkpoint, tmp_path / "data1", batch_size=BATCH,
                          start_token=VOCAB, max_tokens=MAX_TOKENS)
    assert run_job(params, tmp_path / "plain") == 0
    assert not any("logprobs" in arrays for arrays in load_predictions(tmp_path / "plain").values())
    capsys.readouterr()
    assert decode.main(["--model_dir", str(tmp_path / "plain"), "--tokenizer", str(TOKENIZER), "--logprobs"]) == 2
    assert "no logprobs in this run's files (set model.logprobs: true in the params)" in capsys.readouterr().err


@pytest.mark.parametrize("keys, message", [
    ({"logprobs": "yes"}, "model.logprobs must be true or false"),
    ({"speculative": {"method": "prompt_lookup", "num_tokens": 2}},
     "model.logprobs cannot be combined with model.speculative yet"),
    ({"top_logprobs": 21}, "model.top_logprobs must be an integer from 0 to 20, got 21"),
    ({"logprobs": False, "top_logprobs": 3}, "model.top_logprobs needs model.logprobs: true"),
])
def test_bad_logprobs_params_are_one_line_errors(checkpoint, tmp_path, capsys, keys, message):
    write_h5(tmp_path / "data", prompt_rows([[5, 6, 7]], 16, VOCAB))
    params = write_params(tmp_path / "params.yaml", checkpoint, tmp_path / "data", batch_size=1, start_token=VOCAB,
                          model_keys={"logprobs": True, **keys})
    assert run_job(params, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def top_of(model_dir: Path) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """sample -> (generated tokens' logprobs, top ids (n, K), top logprobs (n, K)), read back in the row layout."""
    out = {}
    for arrays in load_predictions(model_dir).values():
        swap = (lambda a: np.swapaxes(a, 0, 1)) if int(arrays["loop_dim"]) == 0 else (lambda a: a)
        ids, values, logprobs = swap(arrays["top_logprob_ids"]), swap(arrays["top_logprobs"]), swap(arrays["logprobs"])
        assert ids.dtype == np.int32 and values.dtype == np.float32 and ids.shape == (*logprobs.shape, 4)
        for row, index in enumerate(arrays["sample_index"].tolist()):
            if index >= 0:
                begin, count = int(arrays["prompt_length"][row]), int(arrays["num_generated"][row])
                assert not values[row, :begin].any() and not values[row, begin + count:].any()
                out[index] = (logprobs[row, begin:begin + count], ids[row, begin:begin + count],
                              values[row, begin:begin + count])
    return out


@pytest.mark.parametrize("loop_dim", [1, 0])
def test_top_logprobs_equal_transformers_top_k_of_the_distribution(checkpoint, tmp_path, loop_dim):
    """model.top_logprobs 4 (sampled, temperature 0.7 and top-k 20): at each generated position the 4 likeliest
    tokens of the distribution the token was picked from and their log-probabilities, as transformers' scores
    give them; the file holds them in both layouts."""
    model_dir = run(tmp_path, checkpoint, f"top{loop_dim}", loop_dim=loop_dim, top_logprobs=4, temperature=0.7,
                    top_k=20, seed=4)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(20)])
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    rows = rows_of(model_dir)
    for index, (logprobs, ids, values) in top_of(model_dir).items():
        prompt, generated = rows[index][0], rows[index][1]
        sequence = torch.tensor([prompt + generated])
        with torch.inference_mode():
            logits = model(sequence).logits[0].float()
        for step, token in enumerate(generated):
            position = len(prompt) + step - 1
            want = torch.log_softmax(processors(sequence[:, : position + 1], logits[position][None].clone()), -1)[0]
            np.testing.assert_allclose(values[step], want.topk(4).values.numpy(), atol=1e-4, rtol=1e-4)
            np.testing.assert_allclose(want[torch.from_numpy(ids[step]).long()].numpy(), values[step], atol=1e-4)
            assert (np.diff(values[step]) <= 0).all()
        assert np.allclose(logprobs, [v[list(i).index(t)] if t in i else lp for v, i, t, lp in
                                      zip(values, ids, generated, logprobs)])


def test_decode_writes_top_logprobs(checkpoint, tmp_path):
    model_dir = run(tmp_path, checkpoint, "top", top_logprobs=4)
    out = tmp_path / "out.jsonl"
    assert decode.main(["--model_dir", str(model_dir), "--tokenizer", str(TOKENIZER), "--logprobs",
                        "--output", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    tops = top_of(model_dir)
    for index, record in enumerate(records):
        _, ids, values = tops[index]
        assert [[entry["token_id"] for entry in position] for position in record["top_logprobs"]] == ids.tolist()
        assert [[entry["logprob"] for entry in position] for position in record["top_logprobs"]] == values.tolist()
        assert record["top_logprobs"][0][0]["token"] == decode_token(ids[0][0])
        assert [position[0]["token_id"] for position in record["top_logprobs"]] == tops[index][1][:, 0].tolist()


def decode_token(token_id: int) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER).decode([int(token_id)])


def test_rows_chosen_in_chunks_equal_all_rows_at_once(checkpoint, tmp_path, monkeypatch):
    """Where a step's logits exceed step.SAMPLING_VALUES (the CPU's), its rows are chosen a chunk at a time (here 1
    row, then 2 rows and a remainder of 1): the same tokens, log-probabilities and top tokens as all rows at once,
    sampling under a repetition penalty, temperature and top-p."""
    from modelzoo.generation import step as step_module

    keys = {"temperature": 0.9, "top_p": 0.9, "repetition_penalty": 1.3, "top_logprobs": 3, "seed": 7}
    choose_rows, chunk_rows = step_module._choose_rows, []
    monkeypatch.setattr(step_module, "_choose_rows",
                        lambda logits, *args: chunk_rows.append(logits.shape[0]) or choose_rows(logits, *args))
    whole = load_predictions(run(tmp_path, checkpoint, "whole", **keys))
    assert max(chunk_rows) >= 3  # steps of 3 rows or more, each choosing all its rows at once
    vocab = tiny_llama_config().vocab_size
    for rows in (1, 2):
        chunk_rows.clear()
        monkeypatch.setitem(step_module.SAMPLING_VALUES, "cpu", rows * vocab + vocab - 1)
        chunked = load_predictions(run(tmp_path, checkpoint, f"chunks_of_{rows}", **keys))
        assert max(chunk_rows) == rows  # those steps in chunks
        assert chunked.keys() == whole.keys()
        for step, arrays in whole.items():
            for name in ("predictions", "logprobs", "top_logprob_ids", "top_logprobs"):
                assert np.array_equal(chunked[step][name], arrays[name]), (rows, step, name)
