"""The scorer's rounds on tiny random models: contexts that begin alike (few-shot examples before each question)
prefill that beginning once, and every score equals the same request scored alone and transformers' log-softmax,
on the C++ attention kernel with continuations packed in one row (LLaMA) and PyTorch's over padded rows (BLOOM's
ALiBi)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from harness import save_tiny_model
from modelzoo.generation.scoring import MIN_SHARED_SAVING, Scorer, ScoreRequest
from modelzoo.models.checkpoint import load_model
from modelzoo.models.kv_cache import KVCache
from tiny_configs import bloom_config, tiny_llama_config

SLOTS, WINDOW, SHOTS = 16, 96, 40


def few_shot_requests(vocab: int) -> list[ScoreRequest]:
    """4 questions after the same 40 tokens, 3 choices each (1 to 3 tokens), then a context sharing nothing with a
    continuation of 20 tokens (a rolling window's shape)."""
    rng = np.random.default_rng(0)
    shots = rng.integers(3, vocab, SHOTS)
    requests = []
    for question in range(4):
        context = np.concatenate([shots, rng.integers(3, vocab, 5 + 3 * question)])
        requests += [ScoreRequest(len(requests) + choice, context, rng.integers(3, vocab, 1 + choice))
                     for choice in range(3)]
    return requests + [ScoreRequest(len(requests), rng.integers(3, vocab, 9), rng.integers(3, vocab, 20))]


@pytest.fixture(scope="module", params=["llama", "bloom"])
def checkpoint(request, tmp_path_factory) -> Path:
    config = tiny_llama_config() if request.param == "llama" else bloom_config()
    return save_tiny_model(config, tmp_path_factory.mktemp(request.param))


def scorer(checkpoint: Path, token_budget: int = 1024) -> Scorer:
    model, _ = load_model(checkpoint, torch.float32, torch.device("cpu"))
    c = model.config
    cache = KVCache(c.num_layers, SLOTS, c.num_kv_heads, WINDOW, c.head_dim, torch.float32, torch.device("cpu"))
    return Scorer(model, cache, torch.device("cpu"), token_budget=token_budget)


def test_a_shared_beginning_is_prefilled_once_and_scores_are_unchanged(checkpoint):
    vocab = AutoModelForCausalLM.from_pretrained(checkpoint).config.vocab_size
    requests = few_shot_requests(vocab)
    together = scorer(checkpoint)
    assert together.packs == ("llama" in checkpoint.name)  # LLaMA packs continuations; BLOOM's ALiBi does not
    scores = {score.index: score for score in together.score(requests)}
    contexts = {r.context.tobytes(): len(r.context) for r in requests}
    continuations = sum(len(r.continuation) - 1 for r in requests)
    # one round: the 40 shared tokens once, then each of the 5 contexts' padded rest; the last context shares
    # nothing, so the round's shared beginning is empty (no saving): every context whole, as padded rows
    assert together.prefilled_tokens == sum(contexts.values()) + continuations
    shared = scorer(checkpoint)
    first_four = {score.index: score for score in shared.score(requests[:12])}
    assert 3 * SHOTS >= MIN_SHARED_SAVING
    assert shared.prefilled_tokens == SHOTS + sum(n - SHOTS for n in list(contexts.values())[:4]) + sum(
        len(r.continuation) - 1 for r in requests[:12])
    alone = scorer(checkpoint, token_budget=1)  # below any request: every round holds one request
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for request in requests:
        single = next(iter(alone.score([request])))
        for got in (scores[request.index], first_four.get(request.index, scores[request.index])):
            np.testing.assert_allclose(got.logprobs, single.logprobs, rtol=0, atol=1e-5)
            assert np.array_equal(got.greedy, single.greedy)
        ids = torch.tensor(np.concatenate([request.context, request.continuation]))[None]
        with torch.no_grad():
            logprobs = torch.log_softmax(reference(ids).logits[0].float(), -1)
        at = torch.arange(len(request.context) - 1, ids.shape[1] - 1)
        np.testing.assert_allclose(first_four.get(request.index, single).logprobs,
                                   logprobs[at, ids[0, len(request.context):]].numpy(), rtol=0, atol=1e-4)
