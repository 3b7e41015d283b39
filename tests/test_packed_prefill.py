"""Packed prefill: newly admitted prompts side by side in one row, no padding. The C++ kernel reads
the packed row as it is (one cache row per query); the PyTorch path runs each prompt as its own
segment. Tokens must equal those of padded prefill and of transformers."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from harness import assert_family_matches_transformers, family_prompts, save_tiny_model, shared_prefix_prompts
from modelzoo.models.checkpoint import load_model
from modelzoo.generation.engine import GenerationEngine, Request
from modelzoo.generation.options import GenerationOptions
from modelzoo.models.kv_cache import KVCache
from modelzoo.cpu.kernels import cpu_kernels
from modelzoo.models import layers
from modelzoo.models.layers import ForwardContext
from tiny_configs import (TINY, VOCAB, bloom_config, falcon_config, gptj_config, mistral_config, mpt_config,
                          neox_config, tiny_llama_config)

kernels = cpu_kernels()


def llama_config() -> LlamaConfig:
    return tiny_llama_config(vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=2, architectures=None)


def generate(checkpoint, prompts, packed: bool, budget: int = 1024, num_slots: int = 4) -> tuple[dict, list[int]]:
    """Completions {index: tokens} and the number of tokens each prefill forward ran."""
    model, _ = load_model(checkpoint, torch.float32, torch.device("cpu"))
    engine = GenerationEngine(model, num_slots, 96, torch.device("cpu"), torch.float32, GenerationOptions(max_tokens=8),
                              prefill_token_budget=budget)
    engine.packs_prompts = packed
    widths = []
    forward = model.forward

    def recorded(tokens, positions, cache, slots, last=None, length=None):
        if last is not None:  # prefill (decode passes no `last`)
            widths.append(tokens.numel())
        return forward(tokens, positions, cache, slots, last, length)

    model.forward = recorded
    out = {c.index: c.tokens.tolist() for c in engine.generate(Request(i, np.array(p)) for i, p in enumerate(prompts))}
    return out, widths


@pytest.mark.parametrize("use_kernels", [True, False], ids=["cpp-kernel", "pytorch"])
@pytest.mark.parametrize("prompts", [family_prompts(VOCAB), shared_prefix_prompts(VOCAB)], ids=["mixed", "shared-prefix"])
def test_packed_prefill_gives_the_tokens_of_padded_prefill(tmp_path, monkeypatch, use_kernels, prompts):
    if use_kernels and kernels is None:
        pytest.skip("the C++ kernels could not be built here")
    if not use_kernels:
        monkeypatch.setattr(layers, "attention_kernel", lambda q, ctx: None)
        monkeypatch.setattr(layers, "fused_kernels", lambda x: None)
    checkpoint = save_tiny_model(llama_config(), tmp_path / "llama")
    packed, packed_widths = generate(checkpoint, prompts, packed=True)
    padded, padded_widths = generate(checkpoint, prompts, packed=False)
    assert packed == padded and len(packed) == len(prompts)
    assert sum(packed_widths) < sum(padded_widths)  # no padding tokens run


@pytest.mark.parametrize("config, packs", [
    pytest.param(lambda: GPT2Config(**TINY, architectures=["GPT2LMHeadModel"]), True, id="gpt2"),
    pytest.param(lambda: neox_config(parallel=True), True, id="gpt-neox"),
    pytest.param(gptj_config, True, id="gpt-j"),
    pytest.param(lambda: falcon_config(alibi=False), True, id="falcon-rotary"),
    pytest.param(lambda: falcon_config(alibi=True), False, id="falcon-alibi"),
    pytest.param(bloom_config, False, id="bloom-alibi"),
    pytest.param(mpt_config, False, id="mpt-alibi"),
])
def test_families_pack_unless_they_use_alibi(tmp_path, config, packs):
    """Families whose attention takes a plain causal context pack their prompts; ALiBi's bias is built
    per padded row, so those families keep padded prefill. Both give the same tokens."""
    hf_config = config()
    checkpoint = save_tiny_model(hf_config, tmp_path / "model")
    model, _ = load_model(checkpoint, torch.float32, torch.device("cpu"))
    engine = GenerationEngine(model, 2, 96, torch.device("cpu"), torch.float32, GenerationOptions(max_tokens=8))
    assert engine.packs_prompts == packs
    if packs:
        prompts = family_prompts(hf_config.vocab_size)
        packed, packed_widths = generate(checkpoint, prompts, packed=True)
        padded, padded_widths = generate(checkpoint, prompts, packed=False)
        assert packed == padded and sum(packed_widths) < sum(padded_widths)


def test_packed_groups_keep_to_the_token_budget(tmp_path):
    prompts = family_prompts(VOCAB, lengths=(30, 20, 25, 10, 40, 5, 3, 12))
    checkpoint = save_tiny_model(llama_config(), tmp_path / "llama")
    out, widths = generate(checkpoint, prompts, packed=True, budget=45, num_slots=8)
    # Sorted by length (3 5 10 12 | 20 25 | 30 | 40): each group within 45 tokens.
    assert widths == [30, 45, 30, 40]
    expected, _ = generate(checkpoint, prompts, packed=False, num_slots=8)
    assert out == expected


def test_packed_prefill_matches_transformers_under_a_sliding_window(tmp_path):
    """Mistral's window of 8 is shorter than most prompts: each packed query's key range starts later."""
    assert_family_matches_transformers(mistral_config(), tmp_path, prompts=family_prompts(VOCAB, lengths=(12, 3, 30, 9)))


@pytest.mark.skipif(kernels is None, reason="the C++ kernels could not be built here")
def test_kernel_packed_row_equals_separate_rows():
    """Two sequences side by side in one row with per-query slots: the same outputs and cache writes
    as the same sequences given as two rows."""
    generator = torch.Generator().manual_seed(3)
    lengths, slots = (5, 3), torch.tensor([2, 0])
    q, k, v = (torch.randn(1, 8, heads, 32, generator=generator) for heads in (4, 2, 2))
    keys, values = torch.randn(3, 2, 16, 32, generator=generator), torch.randn(3, 2, 16, 32, generator=generator)
    positions = torch.tensor([[0, 1, 2, 3, 4, 6, 7, 8]])  # the second continues after 6 cached positions
    packed_keys, packed_values = keys.clone(), values.clone()
    out = kernels.cached_attention(q, k, v, packed_keys, packed_values, slots.repeat_interleave(torch.tensor(lengths))[None],
                                   torch.zeros_like(positions), positions + 1, 0.2)
    for row, (begin, end) in enumerate(((0, 5), (5, 8))):
        expected = kernels.cached_attention(q[:, begin:end], k[:, begin:end], v[:, begin:end], keys, values,
                                            slots[row:row + 1], torch.zeros_like(positions[:, begin:end]),
                                            positions[:, begin:end] + 1, 0.2)
        assert torch.equal(out[:, begin:end], expected)
    assert torch.equal(packed_keys, keys) and torch.equal(packed_values, values)


def test_packed_context_rejects_bad_inputs():
    cache = KVCache(1, 2, 1, 8, 4, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"one shape \(1, T\)"):
        ForwardContext.build(cache, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"one shape \(1, T\)"):
        ForwardContext.build(cache, torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="no ALiBi"):
        ForwardContext.build(cache, torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None]).add_position_bias(
            torch.ones(1, 1, 1, 3), torch.float32)


def test_packed_context_splits_the_row_into_its_sequences():
    cache = KVCache(1, 3, 1, 16, 4, torch.float32, torch.device("cpu"))
    slots = torch.tensor([[2, 2, 2, 0, 0, 1]])
    positions = torch.tensor([[0, 1, 2, 4, 5, 0]])
    ctx = ForwardContext.build(cache, slots, positions, sliding_window=2)
    assert [(begin, end) for begin, end, _ in ctx.segments] == [(0, 3), (3, 5), (5, 6)]
    assert [context.slots.tolist() for _, _, context in ctx.segments] == [[2], [0], [1]]
    assert ctx.segments[0][2].fresh and not ctx.segments[1][2].fresh
    assert ctx.mask is None and ctx.length == 6
    assert ctx.key_ranges[0].tolist() == [[0, 0, 1, 3, 4, 0]] and ctx.key_ranges[1].tolist() == [[1, 2, 3, 5, 6, 1]]
