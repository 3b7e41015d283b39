"""The Llama family's KernelChain: under the bfloat16 policy on the CPU, a decoder layer runs as one chain of C++ kernel
calls with the bits of its modules' own path, and steps aside wherever a module would not take those kernels (a hook,
another GEMM, the last layer of a prompt); cached_attention_qkv reads the fused projection where it lies."""
from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from modelzoo.cpu import precision
from modelzoo.cpu.kernels import cpu_kernels
from modelzoo.models.kv_cache import KVCache
from modelzoo.models.llama import KernelChain, chain_modules
from harness import save_tiny_model
from precision_policies import F16, amx_tiles, needs_bf16, needs_kernels
from test_precision_models import bfloat16_setup
from tiny_configs import VOCAB, mistral_config, qwen2_config, tiny_llama_config

CONFIGS = {"llama": tiny_llama_config, "mistral_window": mistral_config, "qwen2_qkv_bias": qwen2_config}


@pytest.fixture
def bf16_model(tmp_path, monkeypatch, request):
    """A tiny model of CONFIGS[request.param] opened as a bfloat16 job opens it, every weight packed for bf16_linear."""
    from modelzoo.cpu import gemm

    monkeypatch.setattr(gemm, "available_bf16_kernels", lambda: ["bf16_linear"])  # an AMX CPU: not amx_bf16_linear
    monkeypatch.setattr(gemm, "layout_gain", lambda *_: float("inf"))  # every weight packed
    _, model, _ = bfloat16_setup(save_tiny_model(CONFIGS[request.param](), tmp_path / "model"))
    return model


def passes(model: nn.Module) -> tuple[list[torch.Tensor], KVCache]:
    """Logits of a prefill of two 40-token prompts side by side (slots 0, 1), of two packed prompts of 23 and 9 tokens
    in one row (slots 2, 3), then of a decode step of all four rows; and the cache they fill."""
    c = model.config
    cache = KVCache(c.num_layers, 4, c.num_kv_heads, 64, c.head_dim, F16, torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, 40), generator=generator)
    packed = torch.randint(0, VOCAB, (1, 32), generator=generator)
    with torch.inference_mode():
        logits = [model(tokens, torch.arange(40).expand(2, 40), cache, torch.tensor([0, 1]))]
        slots = torch.tensor([[2] * 23 + [3] * 9])
        positions = torch.cat([torch.arange(23), torch.arange(9)])[None]
        logits.append(model(packed, positions, cache, slots, last=torch.tensor([[22, 31]])))
        step = torch.randint(0, VOCAB, (4, 1), generator=generator)
        logits.append(model(step, torch.tensor([[40], [40], [23], [9]]), cache, torch.arange(4)))
    return logits, cache


def put_on_amx(model: nn.Module, gemms: str) -> list[bool]:
    """Sets which of the layers' bfloat16 GEMMs multiply on AMX tiles (their weights are packed alike for both):
    none, all, or every other one (the first layer's q | k | v and gate | up, then o and down, ...); returns the flags
    in the layers' order (q | k | v, o, gate | up, down each)."""
    flags = []
    for i, layer in enumerate(model.model.layers):
        for j, module in enumerate(chain_modules(layer)[:4]):
            module.amx = gemms == "amx_bf16_linear" or (gemms == "mixed" and (i + j) % 2 == 0)
            flags.append(module.amx)
    return flags


ON_AMX = pytest.mark.skipif(not amx_tiles, reason="amx_bf16_linear needs an AMX-BF16 CPU and Linux granting its tiles")


@needs_bf16
@pytest.mark.parametrize("gemms", ["bf16_linear", pytest.param("amx_bf16_linear", marks=ON_AMX),
                                   pytest.param("mixed", marks=ON_AMX)])
@pytest.mark.parametrize("bf16_model", list(CONFIGS), indirect=True)
def test_chains_give_the_bits_of_the_modules_path(bf16_model, gemms, monkeypatch):
    model = bf16_model
    layers = model.model.layers
    on_amx = put_on_amx(model, gemms)
    assert all(layer.kernel_chain() is not None for layer in layers)
    assert [flag for layer in layers for flag in layer.kernel_chain().mlp_args[-1]] == on_amx
    chained = []
    call = KernelChain.__call__
    monkeypatch.setattr(KernelChain, "__call__", lambda self, *args, **kwargs: chained.append(self.layer)
                        or call(self, *args, **kwargs))
    with_chains, cache = passes(model)
    # The prompts' last layers read their last positions alone (the modules' path); a decode step chains them all.
    every, but_last = list(range(len(layers))), list(range(len(layers) - 1))
    assert chained == but_last + but_last + every
    monkeypatch.setattr(model, "layer_chains", lambda x, contexts, extra: [None] * len(contexts))
    chained.clear()
    without, modules_cache = passes(model)
    assert chained == []
    for got, want in zip(with_chains, without):
        assert torch.equal(got, want)
    for got, want in zip(cache.keys + cache.values, modules_cache.keys + modules_cache.values):
        assert torch.equal(got, want)


@needs_bf16
@pytest.mark.parametrize("bf16_model", ["llama"], indirect=True)
def test_a_hook_or_another_gemm_sets_the_chain_aside(bf16_model):
    model = bf16_model
    layer = model.model.layers[0]
    chain = layer.kernel_chain()
    assert chain is not None and layer.kernel_chain() is chain  # found once for the same modules
    for module in (layer.self_attn.o_proj, layer.input_layernorm, layer.mlp, layer):
        seen = []
        handle = module.register_forward_hook(lambda *_: seen.append(1))
        assert layer.kernel_chain() is None
        passes(model)
        assert seen  # the modules' path ran, and with it the hook
        handle.remove()
        assert layer.kernel_chain() is chain
    c = model.config
    cache = KVCache(c.num_layers, 1, c.num_kv_heads, 8, c.head_dim, F16, torch.device("cpu"))
    x, contexts, extra = model.prepare(torch.tensor([[5]]), torch.tensor([[3]]), cache, None, None)
    assert all(model.layer_chains(x, contexts, extra))
    handle = nn.modules.module.register_module_forward_pre_hook(lambda *_: None)  # around every module
    try:
        assert model.layer_chains(x, contexts, extra) == [None] * c.num_layers
    finally:
        handle.remove()
    o_proj = layer.self_attn.o_proj
    replacement = precision.BF16Linear(nn.Linear(o_proj.in_features, o_proj.out_features, bias=False))
    layer.self_attn.o_proj = replacement  # another packed weight: a new chain over it
    assert layer.kernel_chain() is not chain and layer.kernel_chain().mlp_args[0] is replacement.packed
    layer.self_attn.o_proj = nn.Linear(o_proj.in_features, o_proj.out_features, bias=False)  # PyTorch's GEMM
    assert layer.kernel_chain() is None
    layer.self_attn.o_proj = o_proj
    assert layer.kernel_chain() is not None


@needs_bf16
@pytest.mark.parametrize("bf16_model", ["llama"], indirect=True)
def test_a_pickled_layer_leaves_its_chain_behind(bf16_model):
    layer = bf16_model.model.layers[0]
    assert layer.kernel_chain() is not None
    copy = pickle.loads(pickle.dumps(layer))
    assert "_kernel_chain" not in copy.__dict__
    assert copy.kernel_chain() is not None and copy.kernel_chain().attention_args[2] is copy.self_attn.qkv_proj.packed


def attention_inputs(dtype: torch.dtype = torch.float32) -> tuple:
    """A fused projection (3, 5, (4 + 2 x 2) x 16) and a cache (4 slots, 2 kv heads, 16 positions, 16 features) with
    rows, starts and ends for the 5 queries of each row, and rotary tables (3, 5, 16)."""
    generator = torch.Generator().manual_seed(11)
    qkv = torch.randn(3, 5, 8 * 16, generator=generator).to(dtype)
    cache = [torch.randn(4, 2, 16, 16, generator=generator).to(dtype) for _ in range(2)]
    slots = torch.tensor([2, 0, 3])
    ends = torch.tensor([[3, 4, 5, 6, 7], [1, 2, 3, 4, 5], [8, 9, 10, 11, 12]])
    starts = torch.zeros_like(ends)
    cos, sin = torch.randn(3, 5, 16, generator=generator).to(dtype), torch.randn(3, 5, 16, generator=generator).to(dtype)
    return qkv, cache, slots, starts, ends, cos, sin


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_attention_qkv_is_cached_attention_over_the_projection_views(dtype):
    kernels = cpu_kernels()
    qkv, (keys, values), slots, starts, ends, cos, sin = attention_inputs(dtype)
    q, k, v = (part.unflatten(-1, (-1, 16)) for part in qkv.split((64, 32, 32), dim=-1))  # (B, T, heads, 16)
    want_keys, want_values = keys.clone(), values.clone()
    want = kernels.cached_attention(q, k, v, want_keys, want_values, slots, starts, ends, 0.25, cos, sin)
    got = kernels.cached_attention_qkv(qkv, 4, keys, values, slots, starts, ends, 0.25, cos, sin)
    assert got.shape == (3, 5, 64) and torch.equal(got, want.flatten(-2))
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


@needs_kernels
def test_cached_attention_qkv_refuses_a_projection_of_another_shape():
    kernels = cpu_kernels()
    qkv, (keys, values), slots, starts, ends, cos, sin = attention_inputs()
    with pytest.raises(RuntimeError, match=r"qkv's last dimension is 128, not \(heads \+ 2 kv_heads\) head_dim = "
                                           r"\(6 \+ 2 x 2\) x 16"):
        kernels.cached_attention_qkv(qkv, 6, keys, values, slots, starts, ends, 0.25, cos, sin)
    with pytest.raises(RuntimeError, match="qkv's last dimension is 128"):
        kernels.cached_attention_qkv(qkv, 0, keys, values, slots, starts, ends, 0.25, cos, sin)
    with pytest.raises(RuntimeError, match="unit last stride"):
        strided = torch.zeros(3, 5, 128, 2)[..., 0]
        kernels.cached_attention_qkv(strided, 4, keys, values, slots, starts, ends, 0.25, cos, sin)
    with pytest.raises(RuntimeError, match=r"qkv must be \(B, T, \(heads \+ 2 kv_heads\) head_dim\)"):
        kernels.cached_attention_qkv(qkv[0], 4, keys, values, slots, starts, ends, 0.25, cos, sin)


@needs_bf16
@pytest.mark.parametrize("bf16_model", ["llama"], indirect=True)
def test_the_layer_call_refuses_states_it_cannot_add_into(bf16_model):
    model = bf16_model
    c = model.config
    chain = model.model.layers[0].kernel_chain()
    cache = KVCache(c.num_layers, 1, c.num_kv_heads, 8, c.head_dim, F16, torch.device("cpu"))
    x, contexts, extra = model.prepare(torch.tensor([[5]]), torch.tensor([[3]]), cache, None, None)
    cos, sin = extra[0][0][:, 0], extra[0][1][:, 0]
    for states in (x.bfloat16(), torch.zeros(1, 1, 2 * c.hidden_size)[..., ::2], x[0]):  # 16-bit, strided, 2-D
        with pytest.raises(RuntimeError, match=r"x must be contiguous float32 \(B, T, hidden\)"):
            chain(states, contexts[0], cos, sin)
    assert torch.equal(chain(x.clone(), contexts[0], cos, sin), model.model.layers[0](x.clone(), *extra, contexts[0]))
    chain.mlp_args = (*chain.mlp_args[:-1], [False] * 3)
    with pytest.raises(RuntimeError, match=r"on_amx must say for each GEMM \(q \| k \| v, o, gate \| up, down\) "
                                           r"whether it runs on AMX tiles, got 3 values"):
        chain(x.clone(), contexts[0], cos, sin)
