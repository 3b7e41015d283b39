"""Beyond greedy, through run_inference.py on a tiny random Llama: repetition control against
transformers, seeded sampling that does not depend on batching or resumes, and speculative
decoding (prompt lookup, draft model) that reproduces greedy decoding exactly."""
from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import yaml

from harness import (expected_rows, hf_greedy, load_predictions, prompt_rows, run_job, save_tiny_model,
                     stacked_predictions, write_h5, write_params)
from tiny_configs import VOCAB, tiny_llama_config

START = VOCAB  # outside the vocabulary, as recommended

MAX_SEQ_LEN = 48


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Mixed lengths; several prompts repeat a pattern, so their own n-grams predict them."""
    rng = np.random.default_rng(7)
    repeating = [(rng.integers(3, VOCAB, size=n).tolist() * 4)[:m] for n, m in ((3, 11), (5, 19), (2, 9))]
    return repeating + [rng.integers(3, VOCAB, size=n).tolist() for n in (1, 4, 13, 7)]


def run(tmp_path: Path, checkpoint: Path, prompts: list[list[int]], name: str, batch_size: int = 3,
        **model_keys) -> Path:
    """Runs the job with extra `model:` keys (and runconfig keys given as runconfig={...}); returns model_dir."""
    data = tmp_path / "data"
    if not data.exists():
        write_h5(data, prompt_rows(prompts, MAX_SEQ_LEN, START))
    runconfig = model_keys.pop("runconfig", {})
    path = write_params(tmp_path / f"{name}.yaml", checkpoint, data, batch_size, START,
                        max_tokens=model_keys.pop("max_tokens", None),
                        stop_sequences=model_keys.pop("stop_sequences", None), **runconfig)
    params = yaml.safe_load(path.read_text())
    params["model"].update(model_keys)
    path.write_text(yaml.safe_dump(params))
    model_dir = tmp_path / name
    assert run_job(path, model_dir) == 0
    return model_dir


def rows_by_sample(model_dir: Path) -> dict[int, list[int]]:
    """sample index -> predictions row, whatever the batch layout."""
    out = {}
    for arrays in load_predictions(model_dir).values():
        for index, row in zip(arrays["sample_index"], arrays["predictions"]):
            if index >= 0:
                out[int(index)] = row.tolist()
    return out


def hf_generate(checkpoint: Path, prompts: list[list[int]], **generation) -> list[list[int]]:
    """transformers generate() one prompt at a time up to MAX_SEQ_LEN with extra generation options."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # stopping is ours to decide
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            config = GenerationConfig(max_new_tokens=MAX_SEQ_LEN - len(prompt), eos_token_id=None, pad_token_id=0,
                                      **generation)
            ids = torch.tensor([prompt])
            out.append(model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("options", [
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.8, "no_repeat_ngram_size": 2},
    {"no_repeat_ngram_size": 1},
])
def test_repetition_control_matches_transformers(tmp_path, checkpoint, prompts, options):
    expected = expected_rows(prompts, hf_generate(checkpoint, prompts, do_sample=False, **options), MAX_SEQ_LEN, START)
    got = stacked_predictions(run(tmp_path, checkpoint, prompts, "run", **options))
    np.testing.assert_array_equal(got[: len(prompts)], expected)
    plain = expected_rows(prompts, hf_greedy(checkpoint, prompts, MAX_SEQ_LEN), MAX_SEQ_LEN, START)
    assert (got[: len(prompts)] != plain).any(), "the option must change some tokens, or the test shows nothing"


def test_sampling_is_reproducible_across_batch_sizes_and_resume(tmp_path, checkpoint, prompts):
    sampling = {"temperature": 1.2, "top_k": 20, "top_p": 0.9, "seed": 11}
    by_three = rows_by_sample(run(tmp_path, checkpoint, prompts, "b3", batch_size=3, **sampling))
    by_five = rows_by_sample(run(tmp_path, checkpoint, prompts, "b5", batch_size=5, **sampling))
    assert by_three == by_five
    # A run that stops after one step, then resumes, gives the same files as an uninterrupted one.
    partial = run(tmp_path, checkpoint, prompts, "b3", batch_size=3, runconfig={"inference_steps": 1}, **sampling)
    (partial / "artifacts" / "predictions" / "predictions_2.npz").unlink()
    resumed = run(tmp_path, checkpoint, prompts, "b3", batch_size=3, **sampling)
    assert rows_by_sample(resumed) == by_three
    other_seed = rows_by_sample(run(tmp_path, checkpoint, prompts, "seed12", **{**sampling, "seed": 12}))
    assert other_seed != by_three
    greedy = expected_rows(prompts, hf_greedy(checkpoint, prompts, MAX_SEQ_LEN), MAX_SEQ_LEN, START).tolist()
    assert [by_three[i] for i in range(len(prompts))] != greedy


def test_top_k_one_sampling_is_greedy(tmp_path, checkpoint, prompts):
    got = stacked_predictions(run(tmp_path, checkpoint, prompts, "topk1", temperature=0.7, top_k=1, seed=3))
    expected = expected_rows(prompts, hf_greedy(checkpoint, prompts, MAX_SEQ_LEN), MAX_SEQ_LEN, START)
    np.testing.assert_array_equal(got[: len(prompts)], expected)


@pytest.fixture(scope="module")
def plain_greedy(tmp_path_factory, checkpoint, prompts) -> Path:
    """Our own plain greedy run with a stop sequence and max_tokens, the reference for speculative runs."""
    return run(tmp_path_factory.mktemp("plain"), checkpoint, prompts, "plain", stop_sequences=[[5, 6]],
               max_tokens=30)


def summary(model_dir: Path) -> dict:
    return json.loads((model_dir / "artifacts" / "summary.json").read_text())


@pytest.mark.parametrize("num_tokens", [1, 3, 6])
def test_prompt_lookup_speculation_equals_greedy(tmp_path, checkpoint, prompts, plain_greedy, num_tokens):
    spec = run(tmp_path, checkpoint, prompts, "spec", stop_sequences=[[5, 6]], max_tokens=30,
               speculative={"method": "prompt_lookup", "num_tokens": num_tokens})
    for step, arrays in load_predictions(plain_greedy).items():
        got = load_predictions(spec)[step]
        for key in ("predictions", "num_generated", "stop_reason"):
            np.testing.assert_array_equal(got[key], arrays[key])
    stats = summary(spec)
    assert stats["drafted_tokens"] > 0 and 0 < stats["accepted_tokens"] <= stats["drafted_tokens"]
    assert summary(plain_greedy)["speculative_acceptance_rate"] is None


def test_prompt_lookup_speculation_matches_transformers_to_max_seq_len(tmp_path, checkpoint, prompts):
    """No stop rule: rows run into max_seq_len, where verification positions are clamped."""
    got = stacked_predictions(run(tmp_path, checkpoint, prompts, "spec",
                                  speculative={"method": "prompt_lookup", "num_tokens": 5, "max_ngram": 2}))
    expected = expected_rows(prompts, hf_greedy(checkpoint, prompts, MAX_SEQ_LEN), MAX_SEQ_LEN, START)
    np.testing.assert_array_equal(got[: len(prompts)], expected)


def test_draft_model_speculation_equals_greedy(tmp_path, checkpoint, prompts, plain_greedy):
    # A different random model of the same vocabulary: poor drafts, same output.
    other = save_tiny_model(tiny_llama_config(num_hidden_layers=1), tmp_path / "draft", seed=5)
    for draft, name in ((other, "other"), (checkpoint, "self")):
        spec = run(tmp_path, checkpoint, prompts, name, stop_sequences=[[5, 6]], max_tokens=30,
                   speculative={"method": "draft_model", "checkpoint_path": str(draft), "num_tokens": 4})
        np.testing.assert_array_equal(stacked_predictions(spec), stacked_predictions(plain_greedy))
        rate = summary(spec)["speculative_acceptance_rate"]
        if name == "self":
            assert rate > 0.95, "the model drafting for itself agrees with itself"
        else:
            assert rate < 0.9


@pytest.mark.parametrize("model_keys, message", [
    ({"temperature": 0.5, "speculative": {"method": "prompt_lookup"}}, "model.speculative needs greedy decoding"),
    ({"repetition_penalty": 1.2, "speculative": {"method": "prompt_lookup"}}, "cannot be combined"),
    ({"top_p": 0.9}, "model.top_k, model.top_p and model.min_p only apply when sampling"),
    ({"speculative": {"method": "draft_model"}}, "model.speculative.checkpoint_path is required"),
    ({"speculative": {"method": "draft_model", "checkpoint_path": "/nonexistent"}},
     "checkpoint folder /nonexistent does not exist"),
    ({"repetition_penalty": 0}, "model.repetition_penalty must be a number > 0.0"),
    ({"no_repeat_ngram_size": -1}, "model.no_repeat_ngram_size must be an integer >= 0"),
    ({"seed": 1.5}, "model.seed must be an integer >= 0"),
])
def test_bad_generation_options_are_errors(tmp_path, checkpoint, prompts, capsys, model_keys, message):
    data = tmp_path / "data"
    write_h5(data, prompt_rows(prompts, MAX_SEQ_LEN, START))
    path = write_params(tmp_path / "p.yaml", checkpoint, data, 3, START)
    params = yaml.safe_load(path.read_text())
    params["model"].update(model_keys)
    path.write_text(yaml.safe_dump(params))
    assert run_job(path, tmp_path / "run") == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("family", ["gpt2", "bloom"])
def test_speculation_equals_greedy_in_other_families(tmp_path, prompts, family):
    """Learned positions (GPT-2) and ALiBi (BLOOM) verify several positions per row the same way."""
    from transformers import BloomConfig, GPT2Config

    config = (GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128)
              if family == "gpt2" else BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4))
    checkpoint = save_tiny_model(config, tmp_path / family)
    got = stacked_predictions(run(tmp_path, checkpoint, prompts, "spec",
                                  speculative={"method": "prompt_lookup", "num_tokens": 3}))
    expected = expected_rows(prompts, hf_greedy(checkpoint, prompts, MAX_SEQ_LEN), MAX_SEQ_LEN, START)
    np.testing.assert_array_equal(got[: len(prompts)], expected)


# --- each row's own temperature, top_p and seed ----------------------------------------------------------

ROW_OPTIONS = [  # (temperature, top_p, seed) of each prompt; NaN / -1: the params' (greedy, 1.0, 0)
    (np.nan, np.nan, -1), (0.8, np.nan, 3), (1.3, 0.9, 3), (0.0, 0.5, 7), (0.8, np.nan, 11), (np.nan, 0.7, 4),
    (2.0, 0.95, -1),
]


def test_rows_sample_with_their_own_options_side_by_side(tmp_path, checkpoint, prompts):
    """Greedy rows and rows sampled at their own temperature, top_p and seed share batches; each row equals
    the same sample in a job whose params give every row that row's options, at batch sizes 1, 3 and 7."""
    columns = np.array(ROW_OPTIONS, dtype=np.float64).T
    write_h5(tmp_path / "data", prompt_rows(prompts, MAX_SEQ_LEN, START))
    with h5py.File(tmp_path / "data" / "data.h5", "a") as h5:
        h5["temperature"], h5["top_p"] = columns[0].astype(np.float32), columns[1].astype(np.float32)
        h5["seed"] = columns[2].astype(np.int64)
    mixed = {size: rows_by_sample(run(tmp_path, checkpoint, prompts, f"mixed_{size}", batch_size=size, max_tokens=12,
                                      repetition_penalty=1.2))
             for size in (1, 3, 7)}
    assert mixed[1] == mixed[3] == mixed[7]
    for index, (temperature, top_p, seed) in enumerate(ROW_OPTIONS):
        greedy = np.isnan(temperature) or temperature == 0  # the params take top_p only when sampling
        own = {"temperature": 0.0 if greedy else temperature,
               "top_p": 1.0 if np.isnan(top_p) or greedy else top_p, "seed": 0 if seed < 0 else int(seed)}
        alone = tmp_path / f"alone_{index}"
        write_h5(alone / "data", prompt_rows(prompts, MAX_SEQ_LEN, START))
        reference = rows_by_sample(run(alone, checkpoint, prompts, "run", max_tokens=12, repetition_penalty=1.2,
                                       **own))
        assert mixed[3][index] == reference[index], (index, own)


@pytest.mark.parametrize("name, values, message", [
    ("top_p", np.float32([0.5, 1.5]),
     "a row's top_p must be a number > 0.0 and <= 1.0 (NaN: the params' top_p), got 1.5"),
    ("temperature", np.float32([-0.5, 1.0]),
     "a row's temperature must be a number >= 0.0 (NaN: the params' temperature), got -0.5"),
    ("seed", np.float64([1.5, 2.0]), "a row's seed must be an integer >= 0 (-1: the params' seed), got 1.5"),
    ("seed", np.int64([3, -2]), "a row's seed must be an integer >= 0 (-1: the params' seed), got -2"),
])
def test_bad_row_sampling_options_are_named(tmp_path, checkpoint, prompts, capsys, name, values, message):
    write_h5(tmp_path / "data", prompt_rows(prompts[:2], MAX_SEQ_LEN, START))
    with h5py.File(tmp_path / "data" / "data.h5", "a") as h5:
        h5[name] = values
    path = write_params(tmp_path / "params.yaml", checkpoint, tmp_path / "data", 2, START, max_tokens=4)
    assert run_job(path, tmp_path / "run") == 2
    assert message in capsys.readouterr().err
    assert not list((tmp_path / "run" / "artifacts" / "predictions").glob("*.npz"))


def test_sampled_rows_refuse_speculative_decoding(tmp_path, checkpoint, prompts, capsys):
    write_h5(tmp_path / "data", prompt_rows(prompts[:2], MAX_SEQ_LEN, START))
    with h5py.File(tmp_path / "data" / "data.h5", "a") as h5:
        h5["temperature"] = np.float32([0.8, np.nan])
    path = write_params(tmp_path / "params.yaml", checkpoint, tmp_path / "data", 2, START, max_tokens=4,
                        model_keys={"speculative": {"method": "prompt_lookup", "num_tokens": 2}})
    assert run_job(path, tmp_path / "run") == 2
    assert "some rows of the data sample (their own temperature > 0) but model.speculative" in capsys.readouterr().err
    assert not list((tmp_path / "run" / "artifacts" / "predictions").glob("*.npz"))


def test_presence_and_frequency_penalties_follow_their_definition(tmp_path, checkpoint, prompts):
    """Greedy with the OpenAI API's presence and frequency penalties: every generated token is the argmax of
    transformers' logits less the penalties of the tokens generated before it; batch sizes 1 and 3 agree."""
    from transformers import AutoModelForCausalLM

    keys = {"max_tokens": 10, "presence_penalty": 0.6, "frequency_penalty": 0.8}
    runs = [rows_by_sample(run(tmp_path, checkpoint, prompts, f"penalised_{size}", batch_size=size, **keys))
            for size in (1, 3)]
    assert runs[0] == runs[1]
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for index, prompt in enumerate(prompts):
        row = runs[1][index]
        generated = row[len(prompt): len(prompt) + 10]
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + generated])).logits[0]
        for step, token in enumerate(generated):
            scores = logits[len(prompt) + step - 1].clone()
            before = generated[:step]
            for seen in set(before):
                scores[seen] -= 0.8 * before.count(seen) + 0.6
            assert int(scores.argmax()) == token, (index, step)
    plain = rows_by_sample(run(tmp_path, checkpoint, prompts, "plain", max_tokens=10))
    assert plain != runs[1]  # the penalties changed some row: the check above can fail
