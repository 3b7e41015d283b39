"""The job on a CUDA GPU: every family token-exact in float32 through the captured decode step, the captured
step equal to the eager one with rows leaving and joining and nothing recaptured, and each option on CUDA.
Skipped where no CUDA device is present (CI); run on a GPU machine with `pytest tests/test_cuda.py`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from harness import (expected_rows, family_prompts, hf_greedy, load_predictions, prompt_rows, run_job,
                     save_tiny_model, stacked_predictions, write_h5, write_params)
from tiny_configs import INT8_FAMILIES, VOCAB, tiny_llama_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MAX_SEQ_LEN, BATCH, MAX_TOKENS = 64, 3, 16


def run_on(tmp_path: Path, name: str, checkpoint: Path, data: Path, vocab: int, device: str = "cuda",
           **options) -> Path:
    """Runs one job on `device`; returns its model_dir."""
    model_keys = {key: options.pop(key) for key in list(options) if key not in ("decode_step", "rows_in_flight")}
    params = write_params(tmp_path / f"params_{name}.yaml", checkpoint, data, batch_size=BATCH, start_token=vocab,
                          max_tokens=MAX_TOKENS, device=device, model_keys=model_keys or None, **options)
    assert run_job(params, tmp_path / name) == 0
    return tmp_path / name


@pytest.mark.parametrize("family", sorted(INT8_FAMILIES))
def test_family_token_exact_on_cuda(tmp_path, family):
    """float32 through the captured step (decode_step auto on CUDA): transformers greedy, token for token, with
    a stop sequence and a padded last batch."""
    config = INT8_FAMILIES[family]()
    checkpoint = save_tiny_model(config, tmp_path / "checkpoint")
    vocab = config.vocab_size
    prompts = family_prompts(vocab)
    write_h5(tmp_path / "data", prompt_rows(prompts, MAX_SEQ_LEN, vocab))
    stops = [[5, 6]]
    params = write_params(tmp_path / "params.yaml", checkpoint, tmp_path / "data", batch_size=BATCH,
                          start_token=vocab, max_tokens=MAX_TOKENS, stop_sequences=stops, device="cuda")
    assert run_job(params, tmp_path / "run") == 0
    expected = expected_rows(prompts, hf_greedy(checkpoint, prompts, MAX_TOKENS, stops), MAX_SEQ_LEN, vocab)
    np.testing.assert_array_equal(stacked_predictions(tmp_path / "run")[: len(prompts)], expected)
    summary = json.loads((tmp_path / "run" / "artifacts" / "summary.json").read_text())
    assert summary["decode_step"]["mode"] == "cuda_graph"


def test_captured_step_equals_eager_without_recapture(tmp_path):
    """The captured step writes the eager step's files; rows leave and join (7 prompts in 2 slots) while the
    graphs captured in the warm-up are the only ones."""
    from modelzoo.checkpoint import load_model
    from modelzoo.generation.engine import GenerationEngine, Request
    from modelzoo.generation.options import GenerationOptions

    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "checkpoint")
    device = torch.device("cuda")
    prompts = family_prompts(VOCAB)

    def generate(mode: str) -> tuple[dict[int, list[int]], GenerationEngine]:
        model, _ = load_model(checkpoint, torch.float32, device)
        engine = GenerationEngine(model, 2, MAX_SEQ_LEN + 8, device, torch.float32,
                                  GenerationOptions(max_tokens=MAX_TOKENS))
        if mode == "cuda_graph":
            engine.decode.capture(len(engine.step_shapes()))
        engine.warm_up()
        out = {c.index: c.tokens.tolist() for c in engine.generate(Request(i, np.array(p))
                                                                   for i, p in enumerate(prompts))}
        return out, engine

    eager, _ = generate("eager")
    captured, engine = generate("cuda_graph")
    assert captured == eager and len(captured) == len(prompts)
    assert sorted(engine.decode._graphs) == sorted((-1, length) for _, length in engine.step_shapes())
    assert engine.decode.uncaptured_steps == 0  # every step replayed a graph


@pytest.mark.parametrize("options", [
    {"temperature": 0.8, "top_p": 0.9, "seed": 4, "logprobs": True},
    {"weight_dtype": "int8"},
    {"speculative": {"method": "prompt_lookup", "num_tokens": 3}},
    {"repetition_penalty": 1.3},
], ids=["sampling_logprobs", "int8", "prompt_lookup", "repetition_penalty"])
def test_options_on_cuda(tmp_path, options):
    """Each option runs on CUDA, and a rerun writes the same files; sampled tokens equal the CPU's (the draws
    are keyed by sample and position, never by device)."""
    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "checkpoint")
    prompts = family_prompts(VOCAB)
    write_h5(tmp_path / "data", prompt_rows(prompts, MAX_SEQ_LEN, VOCAB))
    first = run_on(tmp_path, "first", checkpoint, tmp_path / "data", VOCAB, **dict(options))
    again = run_on(tmp_path, "again", checkpoint, tmp_path / "data", VOCAB, **dict(options))
    for step, arrays in load_predictions(first).items():
        np.testing.assert_array_equal(arrays["predictions"], load_predictions(again)[step]["predictions"])
    if "temperature" in options:
        cpu = run_on(tmp_path, "cpu", checkpoint, tmp_path / "data", VOCAB, device="cpu", **dict(options))
        np.testing.assert_array_equal(stacked_predictions(first), stacked_predictions(cpu))
