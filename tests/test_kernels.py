"""The C++ kernels: cached attention against a float64 softmax reference (and the cache writes it does
first), with the rotary embedding it can apply; the fused RMSNorm and SiLU-gate ops bit for bit
against the PyTorch spelling they replace; their input checks; the engine with and without them."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from modelzoo.models.checkpoint import load_model
from modelzoo.generation.engine import GenerationEngine, Request
from modelzoo.generation.options import GenerationOptions
import modelzoo.cpu.kernels
from modelzoo.cpu.kernels import cpu_kernels
from modelzoo.models import layers
from modelzoo.models.config import RopeConfig
from modelzoo.models.positions import RotaryEmbedding, apply_rotary
from harness import family_prompts, save_tiny_model
from tiny_configs import tiny_llama_config

kernels = cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="the C++ kernels could not be built here")


def test_a_failed_build_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    from torch.utils import cpp_extension

    def no_compiler(**_):
        raise RuntimeError("Error building extension\ng++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(modelzoo.cpu.kernels, "BUILD_ROOT", tmp_path)  # no build in any root
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("ZOO_INFER_KERNEL_DIR", raising=False)
    assert modelzoo.cpu.kernels.cpu_kernels.__wrapped__() is None
    assert "C++ CPU kernels unavailable (RuntimeError: g++: command not found)" in caplog.text


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, start: torch.Tensor,
              end: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v for each query over its row's keys [start, end), in float64;
    q (B, T, H, D) -> (B, T, H, D)."""
    group = q.shape[2] // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, slot in enumerate(slots.tolist()):
        for t in range(q.shape[1]):
            lo, hi = int(start[b, t]), int(end[b, t])
            k = keys[slot, :, lo:hi].double().repeat_interleave(group, 0)  # (H, n, D)
            v = values[slot, :, lo:hi].double().repeat_interleave(group, 0)
            weights = torch.softmax((k @ q[b, t].double()[:, :, None])[..., 0] * scale, -1)  # (H, n)
            out[b, t] = (weights[:, None, :] @ v)[:, 0]
    return out


def random_call(group: int, head_dim: int, positions: torch.Tensor, window: int | None = None, seed: int = 0):
    """Inputs for rows at `positions` (B, T) of a 6-slot, 70-position cache with 2 kv heads."""
    generator = torch.Generator().manual_seed(seed)
    batch, width = positions.shape
    kv_heads = 2
    q = torch.randn(batch, width, kv_heads * group, head_dim, generator=generator)
    keys = torch.randn(6, kv_heads, 70, head_dim, generator=generator) * 2
    values = torch.randn(6, kv_heads, 70, head_dim, generator=generator)
    new_keys = torch.randn(batch, width, kv_heads, head_dim, generator=generator)
    new_values = torch.randn(batch, width, kv_heads, head_dim, generator=generator)
    slots = torch.tensor([5, 0, 3, 1, 2])[:batch]
    end = positions + 1
    start = (end - window).clamp(min=0) if window else torch.zeros_like(end)
    return q, new_keys, new_values, keys, values, slots, start, end


def check_against_reference(q, new_keys, new_values, keys, values, slots, start, end):
    expected_keys, expected_values = keys.clone(), values.clone()
    for b, slot in enumerate(slots.tolist()):  # the call stores the forward's keys and values first
        expected_keys[slot, :, end[b] - 1] = new_keys[b].transpose(0, 1).to(keys.dtype)  # rounded to a 16-bit cache
        expected_values[slot, :, end[b] - 1] = new_values[b].transpose(0, 1).to(values.dtype)
    scale = 1 / math.sqrt(q.shape[-1])
    out = kernels.cached_attention(q, new_keys, new_values, keys, values, slots, start, end, scale)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    torch.testing.assert_close(out.double(), reference(q, keys, values, slots, start, end, scale), rtol=1e-5, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_decode_step_matches_float64_softmax(group, head_dim, cache_dtype):
    """float32 queries over a float32 cache, or a 16-bit one the kernel widens as it reads."""
    positions = torch.tensor([[0], [16], [69], [32], [15]])  # around the 16-key blocks; one row full
    q, new_keys, new_values, keys, values, slots, start, end = random_call(group, head_dim, positions,
                                                                           seed=group * 1000 + head_dim)
    check_against_reference(q, new_keys, new_values, keys.to(cache_dtype), values.to(cache_dtype), slots, start, end)


@needs_kernels
@pytest.mark.parametrize("window", [None, 8])
def test_prefill_and_verification_rows_match_float64_softmax(window):
    causal = torch.arange(33).expand(3, 33)  # new prompts: each query sees the keys up to its own
    check_against_reference(*random_call(3, 64, causal, window))
    offset = 20 + torch.arange(5).expand(2, 5)  # after a shared prefix, or K = 4 drafts to verify
    check_against_reference(*random_call(4, 32, offset, window))


@needs_kernels
@pytest.mark.parametrize("group, head_dim, cache_dtype", [(3, 64, torch.float32), (1, 128, torch.float32),
                                                         (4, 32, torch.float16), (8, 16, torch.bfloat16)])
def test_a_query_gets_the_same_bits_in_any_block(group, head_dim, cache_dtype):
    """Prompts packed in one row (blocks of up to 16 queries, cut where a prompt ends), each prompt as a row of its
    own, and every query alone as a decode step: the same output and cache, bit for bit."""
    generator = torch.Generator().manual_seed(group * 1000 + head_dim)
    lengths, kv_heads = [23, 1, 40, 16, 17], 2
    total = sum(lengths)
    q = torch.randn(1, total, kv_heads * group, head_dim, generator=generator)
    new_keys = torch.randn(1, total, kv_heads, head_dim, generator=generator)
    new_values = torch.randn(1, total, kv_heads, head_dim, generator=generator)
    slots = torch.cat([torch.full((n,), slot) for slot, n in enumerate(lengths)])[None]  # (1, N)
    ends = torch.cat([torch.arange(1, n + 1) for n in lengths])[None]
    starts = torch.zeros_like(ends)

    def run(pieces):  # [(first, last)] of the packed queries, one call each, in order, on one fresh cache
        keys, values = (torch.zeros(len(lengths), kv_heads, 48, head_dim, dtype=cache_dtype) for _ in range(2))
        outs = [kernels.cached_attention(q[:, a:b], new_keys[:, a:b], new_values[:, a:b], keys, values, slots[:, a:b],
                                         starts[:, a:b], ends[:, a:b], 0.125) for a, b in pieces]
        return torch.cat(outs, dim=1), keys, values

    packed = run([(0, total)])
    bounds = np.cumsum([0] + lengths)
    for pieces in (list(zip(bounds[:-1], bounds[1:])), [(i, i + 1) for i in range(total)]):
        out, keys, values = run(pieces)
        assert torch.equal(out, packed[0]) and torch.equal(keys, packed[1]) and torch.equal(values, packed[2])


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_both_ways_of_scoring_a_tile_give_the_same_bits(cache_dtype):
    """The kernel times its two ways of scoring a tile of 4-6 query heads (8 or 4 keys at once with AVX-512; AVX2 has
    one, 2 keys) and keeps the faster: prompts over tiles of every height (1-6 query heads) give the same bits and
    cache either way, so the choice changes speed only."""
    chosen = kernels.attention_keys_at_once()
    ways = [2] if chosen == 2 else [8, 4]
    assert chosen in ways
    causal = torch.arange(33).expand(2, 33)  # blocks of 16, 16 and 1 queries: 6-head tiles and the rest
    outputs = {}
    try:
        for way in ways:
            assert kernels.attention_keys_at_once(way) == way
            outputs[way] = []
            for group in (3, 5, 7):
                q, new_keys, new_values, keys, values, slots, start, end = random_call(group, 64, causal, seed=group)
                keys, values = keys.to(cache_dtype), values.to(cache_dtype)
                out = kernels.cached_attention(q, new_keys, new_values, keys, values, slots, start, end, 0.125)
                outputs[way] += [out, keys, values]
    finally:
        kernels.attention_keys_at_once(chosen)
    assert all(torch.equal(a, b) for a, b in zip(outputs[ways[0]], outputs[ways[-1]]))
    with pytest.raises(RuntimeError, match="keys at once: 0 \\(as timed\\), .* on this build, not 5"):
        kernels.attention_keys_at_once(5)


@needs_kernels
def test_kernel_ignores_positions_past_end_and_reads_a_strided_cache_view():
    q, new_keys, new_values, keys, values, slots, start, end = random_call(2, 32, torch.tensor([[4], [39], [11]]))
    expected = kernels.cached_attention(q, new_keys, new_values, keys, values, slots, start, end, 0.3)
    poisoned = keys.clone(), values.clone()
    for b, slot in enumerate(slots.tolist()):
        for cache in poisoned:
            cache[slot, :, int(end[b, 0]):] = float("nan")  # never read
    out = kernels.cached_attention(q, new_keys, new_values, *poisoned, slots, start, end, 0.3)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    wide_keys, wide_values = torch.randn(6, 2, 90, 32), torch.randn(6, 2, 90, 32)
    wide_keys[:, :, :70], wide_values[:, :, :70] = keys, values  # a view with the stride of a longer cache
    out = kernels.cached_attention(q, new_keys, new_values, wide_keys[:, :, :70], wide_values[:, :, :70], slots, start,
                                   end, 0.3)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("change, message", [
    (dict(start=torch.tensor([[3], [0]])), "outside the cache"),
    (dict(end=torch.tensor([[4], [9]])), "outside the cache"),
    (dict(end=torch.tensor([[0], [4]])), "outside the cache"),
    (dict(slots=torch.tensor([0, 2])), "outside the cache's 2 slots"),
    (dict(slots=torch.tensor([0])), "one slot per row"),
    (dict(q=torch.randn(2, 1, 18, 16)), "1 to 8 query heads per kv head"),
    (dict(q=torch.randn(2, 1, 4, 16).double()), "of one dtype: float32, bfloat16 or float16"),
    (dict(q=torch.randn(2, 1, 4, 16).bfloat16()), "of one dtype"),
    (dict(keys=torch.randn(2, 2, 8, 16).bfloat16()), "the cache must be q's dtype"),  # values float32
    (dict(q=torch.randn(2, 1, 4, 16).bfloat16(), new_keys=torch.randn(2, 1, 2, 16).bfloat16(),
          new_values=torch.randn(2, 1, 2, 16).bfloat16()), "the cache must be q's dtype"),  # 16-bit q, float32 cache
    (dict(q=torch.randn(2, 1, 16, 4).transpose(2, 3)), "contiguous"),
    (dict(keys=torch.randn(2, 2, 16, 8).transpose(2, 3)), "cache rows must be contiguous"),
    (dict(q=torch.randn(2, 1, 4, 8), new_keys=torch.randn(2, 1, 2, 8), new_values=torch.randn(2, 1, 2, 8),
          keys=torch.randn(2, 2, 8, 8), values=torch.randn(2, 2, 8, 8)), "head_dim 16, 32, 64 or 128"),
    (dict(new_keys=torch.randn(2, 1, 3, 16)), r"new keys and values must be \(B, T, Hkv, D\)"),
    (dict(new_values=torch.randn(2, 1, 16, 2).transpose(2, 3)), "must be contiguous"),
])
def test_kernel_rejects_bad_inputs(change, message):
    inputs = dict(q=torch.randn(2, 1, 4, 16), new_keys=torch.randn(2, 1, 2, 16), new_values=torch.randn(2, 1, 2, 16),
                  keys=torch.randn(2, 2, 8, 16), values=torch.randn(2, 2, 8, 16), slots=torch.tensor([0, 1]),
                  start=torch.tensor([[0], [0]]), end=torch.tensor([[3], [8]]))
    inputs.update(change)
    with pytest.raises(RuntimeError, match=message):
        kernels.cached_attention(*inputs.values(), 1.0)


@needs_kernels
@pytest.mark.parametrize("head_dim", [32, 64])
def test_rotary_inside_the_kernel_equals_rotating_first(head_dim):
    """q, k, v as strided views of one fused projection, rotated by the kernel: the cache holds the keys
    apply_rotary gives, bit for bit, and the output equals the kernel's on pre-rotated inputs."""
    generator = torch.Generator().manual_seed(head_dim)
    batch, width, heads, kv_heads = 3, 5, 6, 2
    qkv = torch.randn(batch, width, (heads + 2 * kv_heads) * head_dim, generator=generator)
    q, k, v = qkv.view(batch, width, heads + 2 * kv_heads, head_dim).split((heads, kv_heads, kv_heads), dim=2)
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 64)
    rope.build_tables(torch.device("cpu"))
    positions = 30 + torch.arange(width).expand(batch, width)
    cos, sin = rope(positions, torch.float32)  # (B, 1, T, hd)
    keys, values = torch.randn(4, kv_heads, 64, head_dim, generator=generator), torch.randn(4, kv_heads, 64, head_dim)
    slots, start, end = torch.tensor([3, 0, 2]), torch.zeros_like(positions), positions + 1
    rotated_keys, rotated_values = keys.clone(), values.clone()
    out = kernels.cached_attention(q, k, v, rotated_keys, rotated_values, slots, start, end, 0.125, cos[:, 0], sin[:, 0])
    q_rotated = apply_rotary(q.transpose(1, 2), cos, sin).transpose(1, 2).contiguous()
    k_rotated = apply_rotary(k.transpose(1, 2), cos, sin).transpose(1, 2).contiguous()
    expected = kernels.cached_attention(q_rotated, k_rotated, v.contiguous(), keys, values, slots, start, end, 0.125)
    assert torch.equal(rotated_keys, keys) and torch.equal(rotated_values, values)
    assert torch.equal(out, expected)


@needs_kernels
@pytest.mark.parametrize("change, message", [
    (dict(cos=torch.randn(2, 1, 16), sin=None), "cos and sin come together"),
    (dict(cos=torch.randn(2, 1, 8), sin=torch.randn(2, 1, 8)), r"cos and sin must be contiguous \(B, T, D\) of q's dtype"),
    (dict(cos=torch.randn(2, 1, 32)[..., ::2], sin=torch.randn(2, 1, 16)), "must be contiguous"),
])
def test_kernel_rejects_bad_rotary_tables(change, message):
    inputs = dict(q=torch.randn(2, 1, 4, 16), new_keys=torch.randn(2, 1, 2, 16), new_values=torch.randn(2, 1, 2, 16),
                  keys=torch.randn(2, 2, 8, 16), values=torch.randn(2, 2, 8, 16), slots=torch.tensor([0, 1]),
                  start=torch.tensor([[0], [0]]), end=torch.tensor([[3], [8]]), scale=1.0)
    inputs.update(change)
    with pytest.raises(RuntimeError, match=message):
        kernels.cached_attention(*inputs.values())


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, spelled out: float32 inside, rounded to x's dtype before the weight."""
    wide = x.float()
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(x.dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [8, 40, 64, 576, 960, 2048])  # below, at and past the sum's cascade levels
def test_rms_norm_is_bitwise_torch(width, dtype):
    """Bit for bit in every dtype (any x86-64 CPU runs the half-precision ones: the conversions are
    plain integer and F16C work, no bf16 instructions needed)."""
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(2, 150, width, generator=generator) * 3).to(dtype)
    delta = torch.randn(2, 150, width, generator=generator).to(dtype)
    weight = torch.randn(width, generator=generator).to(dtype)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-5), torch_rms_norm(x, weight, 1e-5))
    summed = x.clone()
    normed = kernels.add_rms_norm_(summed, delta, weight, 1e-6)
    assert torch.equal(summed, x + delta)
    assert torch.equal(normed, torch_rms_norm(x + delta, weight, 1e-6))
    if dtype == torch.float32:  # `rounded`: the same norms rounded to bfloat16, for a GEMM that rounds them so
        assert torch.equal(kernels.rms_norm(x, weight, 1e-5, True), torch_rms_norm(x, weight, 1e-5).bfloat16())
        summed = x.clone()
        rounded = kernels.add_rms_norm_(summed, delta, weight, 1e-6, True)
        assert torch.equal(summed, x + delta) and torch.equal(rounded, normed.bfloat16())


@needs_kernels
@pytest.mark.parametrize("width", [1536, 64, 37])  # 37: a tail past ATen's two-vector blocks
def test_silu_mul_is_bitwise_torch(width):
    gate_up = torch.randn(4, 9, 2 * width, generator=torch.Generator().manual_seed(width)) * 5
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(kernels.silu_mul(gate_up), F.silu(gate) * up)


@needs_kernels
@pytest.mark.parametrize("call, message", [
    (lambda: kernels.rms_norm(torch.randn(4, 8).t(), torch.randn(4), 1e-5), "contiguous float32, bfloat16 or float16"),
    (lambda: kernels.rms_norm(torch.randn(4, 8).double(), torch.randn(8), 1e-5), "contiguous float32, bfloat16"),
    (lambda: kernels.rms_norm(torch.randn(4, 8), torch.randn(7), 1e-5), r"weight must be \(n,\) of x's dtype"),
    (lambda: kernels.rms_norm(torch.randn(4, 8), torch.randn(8).bfloat16(), 1e-5), r"weight must be \(n,\) of x's"),
    (lambda: kernels.add_rms_norm_(torch.randn(4, 8), torch.randn(4, 7), torch.randn(8), 1e-5), "shaped like x"),
    (lambda: kernels.add_rms_norm_(torch.randn(4, 8), torch.randn(4, 8).half(), torch.randn(8), 1e-5), "of its dtype"),
    (lambda: kernels.rms_norm(torch.randn(4, 8).half(), torch.randn(8).half(), 1e-5, True), "from float32 x alone"),
    (lambda: kernels.add_rms_norm_(torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16(),
                                   torch.randn(8).bfloat16(), 1e-5, True), "from float32 x alone"),
    (lambda: kernels.silu_mul(torch.randn(4, 7)), "must be even"),
    (lambda: kernels.silu_mul(torch.randn(8, 4).t()), "contiguous float32, bfloat16 or float16"),
])
def test_fused_ops_reject_bad_inputs(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_silu_mul_rounds_like_torch(dtype):
    """SiLU in float32 (bitwise the float32 op), rounded to dtype, then the product rounded: what
    F.silu(gate) * up computes in that dtype."""
    gate_up = (torch.randn(4, 9, 2 * 1536, generator=torch.Generator().manual_seed(3)) * 5).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = kernels.silu_mul(gate_up)
    assert torch.equal(got, F.silu(gate.float()).to(dtype) * up)
    torch.testing.assert_close(got, F.silu(gate) * up)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_attention_is_the_float32_kernel_rounded(dtype):
    """Inputs and cache in `dtype`: the cache gets the keys rotated in float32 and rounded once, and the
    output is the float32 queries' kernel's over that cache, on the widened inputs, rounded once."""
    generator = torch.Generator().manual_seed(7)
    batch, width, heads, kv_heads, head_dim = 3, 4, 6, 2, 64
    qkv = torch.randn(batch, width, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    q, k, v = qkv.view(batch, width, heads + 2 * kv_heads, head_dim).split((heads, kv_heads, kv_heads), dim=2)
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 64)
    rope.build_tables(torch.device("cpu"))
    positions = 20 + torch.arange(width).expand(batch, width)
    cos, sin = rope(positions, dtype)  # (B, 1, T, hd)
    keys = torch.randn(4, kv_heads, 64, head_dim, generator=generator).to(dtype)
    values = torch.randn(4, kv_heads, 64, head_dim, generator=generator).to(dtype)
    slots, start, end = torch.tensor([3, 0, 2]), torch.zeros_like(positions), positions + 1
    half_keys, half_values = keys.clone(), values.clone()
    out = kernels.cached_attention(q, k, v, half_keys, half_values, slots, start, end, 0.125, cos[:, 0], sin[:, 0])
    assert out.dtype == dtype
    float_keys, float_values = keys.float(), values.float()
    kernels.cached_attention(q.float(), k.float(), v.float(), float_keys, float_values, slots, start, end, 0.125,
                             cos[:, 0].float().contiguous(), sin[:, 0].float().contiguous())
    assert torch.equal(half_keys, float_keys.to(dtype)) and torch.equal(half_values, float_values.to(dtype))
    q_rotated = apply_rotary(q.float().transpose(1, 2), cos.float(), sin.float()).transpose(1, 2).contiguous()
    stored_keys = half_keys[slots[:, None], :, end - 1].float()  # (B, T, Hkv, hd): what the kernel wrote
    expected = kernels.cached_attention(q_rotated, stored_keys, v.float(), half_keys.clone(), half_values.clone(), slots,
                                        start, end, 0.125)
    assert torch.equal(out, expected.to(dtype))


def generate_all(checkpoint, prompts, monkeypatch, use_kernel: bool) -> dict[int, list[int]]:
    calls = []
    real = layers.attention_kernel

    def counted(q, ctx):
        module = real(q, ctx) if use_kernel else None
        calls.append(module is not None)
        return module

    monkeypatch.setattr(layers, "attention_kernel", counted)
    monkeypatch.setattr(layers, "fused_kernels", (lambda x: kernels) if use_kernel else (lambda x: None))
    model, _ = load_model(checkpoint, torch.float32, torch.device("cpu"))
    engine = GenerationEngine(model, 3, 64, torch.device("cpu"), torch.float32, GenerationOptions(max_tokens=12))
    out = {c.index: c.tokens.tolist() for c in engine.generate(Request(i, np.array(p)) for i, p in enumerate(prompts))}
    assert all(calls) if use_kernel else not any(calls)
    return out


@needs_kernels
def test_engine_gives_the_same_tokens_with_and_without_the_kernels(tmp_path, monkeypatch):
    config = tiny_llama_config(vocab_size=96, hidden_size=96, num_hidden_layers=2, num_attention_heads=6,
                               max_position_embeddings=64, architectures=None)
    checkpoint = save_tiny_model(config, tmp_path / "llama")
    prompts = family_prompts(96)
    with_kernel = generate_all(checkpoint, prompts, monkeypatch, use_kernel=True)
    without = generate_all(checkpoint, prompts, monkeypatch, use_kernel=False)
    assert with_kernel == without and all(len(tokens) == 12 for tokens in with_kernel.values())
