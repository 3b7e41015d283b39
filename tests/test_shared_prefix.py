"""Prompts sharing a prefix (a chat template): the prefix is prefilled once and copied into each
slot, and predictions stay token-exact with transformers across position schemes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GPT2Config

from harness import assert_family_matches_transformers, save_tiny_model, shared_prefix_prompts
from modelzoo.models.checkpoint import load_model
from modelzoo.generation.engine import GenerationEngine, Request
from modelzoo.generation.options import GenerationOptions
from modelzoo.generation.shared_prefix import MIN_SHARED_TOKENS, common_prefix
from tiny_configs import VOCAB, bloom_config, mistral_config, qwen2_config, tiny_llama_config


@pytest.mark.parametrize("config", [
    pytest.param(lambda: qwen2_config(), id="qwen2-rotary-gqa"),
    pytest.param(mistral_config, id="mistral-window-8-shorter-than-the-prefix"),
    pytest.param(lambda: GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                    architectures=["GPT2LMHeadModel"]), id="gpt2-learned-positions"),
    pytest.param(lambda: bloom_config(), id="bloom-alibi"),
])
def test_shared_prefix_matches_transformers(tmp_path, config):
    assert_family_matches_transformers(config(), tmp_path, prompts=shared_prefix_prompts(VOCAB))


@pytest.mark.parametrize("prompts, expected", [
    ([[1, 2, 3, 4], [1, 2, 3, 5]], [1, 2, 3]),
    ([[1, 2, 3], [1, 2, 3, 4]], [1, 2]),  # each prompt keeps a token to prefill
    ([[7, 2], [1, 2]], []),
    ([[5, 5, 5]], [5, 5]),
])
def test_common_prefix(prompts, expected):
    assert common_prefix([np.array(p) for p in prompts]).tolist() == expected


def run_engine(tmp_path, prompts, num_slots=3):
    config = tiny_llama_config(vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=2, architectures=None)
    model, _ = load_model(save_tiny_model(config, tmp_path / "llama"), torch.float32, torch.device("cpu"))
    engine = GenerationEngine(model, num_slots, 96, torch.device("cpu"), torch.float32, GenerationOptions(max_tokens=8))
    out = {c.index: c.tokens.tolist() for c in engine.generate(Request(i, np.array(p)) for i, p in enumerate(prompts))}
    return engine, out


def test_prefix_found_in_the_first_admission_and_reused_by_later_requests(tmp_path):
    prompts = shared_prefix_prompts(VOCAB)
    engine, out = run_engine(tmp_path, prompts)
    assert list(engine.shared_prefixes) == [-1] and engine.shared_prefixes[-1].tokens.tolist() == prompts[0][:20]
    _, alone = run_engine(tmp_path, prompts, num_slots=1)  # one slot: no admission of two, no shared prefix
    assert out == alone and len(out) == len(prompts)


def test_short_common_prefix_is_not_used(tmp_path):
    prompts = [p[20 - MIN_SHARED_TOKENS + 1:] for p in shared_prefix_prompts(VOCAB)]  # 15 shared tokens
    engine, _ = run_engine(tmp_path, prompts)
    assert engine.shared_prefixes == {}
