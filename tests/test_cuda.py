"""The job on a CUDA GPU: every family token-exact in float32 through the captured decode step; in bfloat16 the
captured step's files equal to the eager step's, with the rows' agreement with transformers' bfloat16 `generate()`
recorded; the captured step equal to the eager one with rows leaving and joining across three cache length buckets,
one captured while rows are in flight; the set-up timing of the attention backends; and each option on CUDA.
Skipped where no CUDA device is present (CI); run on a GPU machine with `pytest tests/test_cuda.py`
(`--junitxml=FILE` keeps the bfloat16 agreement figures as test properties)."""
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
# Families whose compiled bfloat16 step rounds some sum otherwise than the eager step, seen on an H100 (GPT-J: one
# row of seven flips at a near tie); the rest match bit for bit.
COMPILED_ROUNDS_OTHERWISE = {"gptj"}


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


@pytest.mark.parametrize("family", sorted(INT8_FAMILIES))
def test_family_bfloat16_on_cuda(tmp_path, family, record_property):
    """bfloat16 through the captured step writes the eager step's files; its rows against transformers' bfloat16
    generate() on the same GPU: the agreement recorded, and at least half the rows equal (a wrong attention mask
    or cache read agrees with almost none)."""
    config = INT8_FAMILIES[family]()
    checkpoint = save_tiny_model(config, tmp_path / "checkpoint")
    vocab = config.vocab_size
    prompts = family_prompts(vocab)
    write_h5(tmp_path / "data", prompt_rows(prompts, MAX_SEQ_LEN, vocab))
    captured = run_on(tmp_path, "captured", checkpoint, tmp_path / "data", vocab, dtype="bfloat16",
                      decode_step="cuda_graph")
    eager = run_on(tmp_path, "eager", checkpoint, tmp_path / "data", vocab, dtype="bfloat16", decode_step="eager")
    same = int((stacked_predictions(captured) == stacked_predictions(eager)).all(1).sum())
    record_property("bfloat16_captured_rows_equal_to_eager", f"{same}/{len(stacked_predictions(eager))}")
    if family in COMPILED_ROUNDS_OTHERWISE:
        assert same >= len(prompts) - 1
    else:
        np.testing.assert_array_equal(stacked_predictions(captured), stacked_predictions(eager))
    expected = expected_rows(prompts, hf_greedy(checkpoint, prompts, MAX_TOKENS, dtype=torch.bfloat16, device="cuda"),
                             MAX_SEQ_LEN, vocab)
    equal = int((stacked_predictions(captured)[: len(prompts)] == expected).all(1).sum())
    record_property("bfloat16_rows_equal_to_generate", f"{equal}/{len(prompts)}")
    assert equal >= len(prompts) / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_captured_step_equals_eager_across_buckets(tmp_path, dtype):
    """The captured step writes the eager step's tokens while rows leave and join (7 prompts in 2 slots) and cross
    the cache length buckets 128, 256 and 304 (max_seq_len 300, rounded up to a multiple of 8): the longest captured
    in the warm-up, the other two while rows are in flight, and no other."""
    from modelzoo.models.checkpoint import load_model
    from modelzoo.generation.engine import GenerationEngine, Request
    from modelzoo.generation.options import GenerationOptions

    checkpoint = save_tiny_model(tiny_llama_config(max_position_embeddings=512), tmp_path / "checkpoint")
    device = torch.device("cuda")
    prompts = family_prompts(VOCAB, lengths=(120, 3, 250, 130, 60, 240, 7))

    def generate(mode: str) -> tuple[dict[int, list[int]], GenerationEngine]:
        model, _ = load_model(checkpoint, dtype, device)
        engine = GenerationEngine(model, 2, 300, device, dtype, GenerationOptions(max_tokens=40))
        if mode == "cuda_graph":
            engine.decode.capture(len(engine.step_shapes()))
        engine.warm_up()
        out = {c.index: c.tokens.tolist() for c in engine.generate(Request(i, np.array(p))
                                                                   for i, p in enumerate(prompts))}
        return out, engine

    eager, _ = generate("eager")
    captured, engine = generate("cuda_graph")
    assert len(captured) == len(prompts) and all(len(tokens) == 40 for tokens in captured.values())
    assert captured == eager
    assert engine.decode.captured_shapes == [(-1, 128), (-1, 256), (-1, 304)]
    assert engine.decode.captures_in_flight == 2


def test_the_additive_mask_is_built_once_a_forward():
    """On a GPU a boolean mask becomes additive once for every layer's context, the last layer's (which reads the
    head's positions alone) included."""
    from modelzoo.models.kv_cache import KVCache
    from modelzoo.models.layers import ForwardContext

    device = torch.device("cuda")
    cache = KVCache(1, 2, 1, 8, 4, torch.bfloat16, device)
    ctx = ForwardContext.build(cache, None, torch.arange(5, device=device).expand(2, -1))
    mask = ctx.sdpa_mask(torch.bfloat16)  # (2, 1, 5, 5): 0 where visible, -inf where hidden
    assert ctx.reading(torch.tensor([[4], [2]], device=device)).sdpa_mask(torch.bfloat16) is mask
    assert torch.equal(mask == 0, ctx.mask) and bool(torch.isneginf(mask[~ctx.mask]).all())


def test_attention_backends_timed_on_cuda():
    """The set-up timing on the GPU: prefill under each SDPA backend called, decode under each replayed from a CUDA
    graph; the backends chosen are the fastest of those timed."""
    from modelzoo.cuda.attention_backends import time_attention_backends

    choice = time_attention_backends(8, 2, 64, torch.bfloat16, torch.device("cuda"), 16)
    decode = {name: t for name, t in choice.timings["decode"].items() if t is not None}
    prefill = {name: t for name, t in choice.timings["prefill"].items() if t is not None}
    assert decode and prefill and "flash" not in decode  # flash takes no mask
    assert choice.decode == min(decode, key=decode.get) and choice.prefill == min(prefill, key=prefill.get)


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
