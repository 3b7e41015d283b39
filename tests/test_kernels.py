"""The C++ decode-attention kernel against a float64 softmax reference, its input checks, and the
engine with and without it."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from modelzoo.checkpoint import load_model
from modelzoo.generation.engine import GenerationEngine, Request
from modelzoo.kernels import cpu_kernels
from modelzoo.models import layers
from tests.harness import family_prompts, save_tiny_model

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ kernels could not be built here")


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
              scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v per slot over keys [start, end), in float64; q (S, H, D) -> (S, H, D)."""
    group = q.shape[1] // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for s in range(q.shape[0]):
        k = keys[s, :, start[s]:end[s]].double().repeat_interleave(group, 0)  # (H, n, D)
        v = values[s, :, start[s]:end[s]].double().repeat_interleave(group, 0)
        weights = torch.softmax((k @ q[s].double()[:, :, None])[..., 0] * scale, -1)  # (H, n)
        out[s] = (weights[:, None, :] @ v)[:, 0]
    return out


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_kernel_matches_float64_softmax(group, head_dim):
    generator = torch.Generator().manual_seed(group * 1000 + head_dim)
    slots, kv_heads, max_len = 5, 2, 70
    q = torch.randn(slots, kv_heads * group, head_dim, generator=generator)
    keys = torch.randn(slots, kv_heads, max_len, head_dim, generator=generator) * 2
    values = torch.randn(slots, kv_heads, max_len, head_dim, generator=generator)
    end = torch.tensor([1, 17, 70, 33, 16])  # lengths around the 16-key blocks, one row full
    start = torch.tensor([0, 0, 50, 16, 15])  # sliding windows: start > 0, one single key
    scale = 1 / math.sqrt(head_dim)
    out = kernels.decode_attention(q, keys, values, start, end, scale)
    torch.testing.assert_close(out.double(), reference(q, keys, values, start, end, scale), rtol=1e-5, atol=1e-6)


def test_kernel_reads_a_strided_cache_view_and_ignores_positions_past_end():
    q = torch.randn(3, 4, 32)
    cache = torch.randn(3, 2, 40, 32)
    end = torch.tensor([5, 40, 12])
    start = torch.zeros(3, dtype=torch.long)
    expected = kernels.decode_attention(q, cache, cache, start, end, 0.3)
    poisoned = cache.clone()
    for s, e in enumerate(end.tolist()):
        poisoned[s, :, e:] = float("nan")  # never read
    torch.testing.assert_close(kernels.decode_attention(q, poisoned, poisoned, start, end, 0.3), expected, rtol=0, atol=0)
    wide = torch.randn(3, 2, 60, 32)
    wide[:, :, :40] = cache  # (S, Hkv, 40, D) view with the stride of a 60-position cache
    out = kernels.decode_attention(q, wide[:, :, :40], wide[:, :, :40], start, end, 0.3)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("change, message", [
    (dict(start=torch.tensor([3, 0])), "outside the cache"),
    (dict(end=torch.tensor([4, 9])), "outside the cache"),
    (dict(end=torch.tensor([0, 4])), "outside the cache"),
    (dict(q=torch.randn(2, 18, 16)), "1 to 8 query heads per kv head"),
    (dict(q=torch.randn(2, 4, 16).double()), "float32 only"),
    (dict(q=torch.randn(2, 16, 4).transpose(1, 2)), "contiguous"),
    (dict(keys=torch.randn(2, 2, 16, 8).transpose(2, 3)), "cache rows must be contiguous"),
    (dict(q=torch.randn(2, 4, 8), keys=torch.randn(2, 2, 8, 8), values=torch.randn(2, 2, 8, 8)), "multiple of 16"),
])
def test_kernel_rejects_bad_inputs(change, message):
    inputs = dict(q=torch.randn(2, 4, 16), keys=torch.randn(2, 2, 8, 16), values=torch.randn(2, 2, 8, 16),
                  start=torch.tensor([0, 0]), end=torch.tensor([3, 8]))
    inputs.update(change)
    with pytest.raises(RuntimeError, match=message):
        kernels.decode_attention(inputs["q"], inputs["keys"], inputs["values"], inputs["start"], inputs["end"], 1.0)


def generate_all(checkpoint, prompts, monkeypatch, use_kernel: bool) -> dict[int, list[int]]:
    calls = []
    real = layers.decode_kernel

    def counted(q, ctx):
        module = real(q, ctx) if use_kernel else None
        calls.append(module is not None)
        return module

    monkeypatch.setattr(layers, "decode_kernel", counted)
    model, _ = load_model(checkpoint, torch.float32, torch.device("cpu"))
    engine = GenerationEngine(model, 3, 64, [], 12, torch.device("cpu"), torch.float32)
    out = {c.index: c.tokens.tolist() for c in engine.generate(Request(i, np.array(p)) for i, p in enumerate(prompts))}
    assert any(calls) == use_kernel
    return out


def test_engine_gives_the_same_tokens_with_and_without_the_kernel(tmp_path, monkeypatch):
    config = LlamaConfig(vocab_size=96, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)
    checkpoint = save_tiny_model(config, tmp_path / "llama")
    prompts = family_prompts(96)
    with_kernel = generate_all(checkpoint, prompts, monkeypatch, use_kernel=True)
    without = generate_all(checkpoint, prompts, monkeypatch, use_kernel=False)
    assert with_kernel == without and all(len(tokens) == 12 for tokens in with_kernel.values())
