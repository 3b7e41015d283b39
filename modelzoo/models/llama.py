"""The Llama family: Llama 1/2/3, SmolLM2, and Mistral and Qwen2 as aliases.

RMSNorm, rotary embeddings (default, linear, llama3 scaling), grouped-query attention, SwiGLU MLP,
tied or untied embeddings. Module names equal the Hugging Face ones, except two fusions that make
fewer, wider matrix multiplies (the decode step is GEMM-bound): `qkv_proj` = q_proj | k_proj | v_proj
and `mlp.gate_up_proj` = gate_proj | up_proj, declared in `fused_weights()` for the loader.
Mistral adds a sliding attention window on every layer; Qwen2 adds biases on q, k, v (not o) and a
sliding window on the layers its config marks "sliding_attention" (only with use_sliding_window).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from modelzoo.cpu.kernels import cpu_kernels
from modelzoo.cpu.precision import BF16Linear, SiluGatedBF16Linear
from modelzoo.models.kv_cache import KVCache
from modelzoo.models.base import CausalLM
from modelzoo.models.config import DecoderConfig, RopeConfig
from modelzoo.models.layers import (ForwardContext, GatedMLP, RMSNorm, attention_kernel_for, cached_attention,
                                    rounds_inputs_to_bf16, split_heads)
from modelzoo.models.positions import RotaryEmbedding


@dataclass(frozen=True)
class LlamaFamilyConfig(DecoderConfig):
    """DecoderConfig plus what Mistral and Qwen2 change.

    qkv_bias: biases on q, k, v only (Qwen2); `attention_bias` (Llama) puts them on all four.
    sliding_windows: per layer, the attention window or None for full attention; () = full everywhere.
    """

    qkv_bias: bool = False
    sliding_windows: tuple[int | None, ...] = ()


def sliding_windows(hf: Any) -> tuple[int | None, ...]:
    """Per-layer windows as transformers applies them: Mistral's `sliding_window` on every layer;
    Qwen2's only with use_sliding_window, on its "sliding_attention" layers (layer_types, by default
    the layers from max_window_layers on); Llama never."""
    window = getattr(hf, "sliding_window", None)
    model_type = getattr(hf, "model_type", None)
    if window is None or model_type not in ("mistral", "qwen2"):
        return ()
    if model_type == "mistral":
        return (int(window),) * hf.num_hidden_layers
    if not getattr(hf, "use_sliding_window", False):
        return ()
    layer_types = getattr(hf, "layer_types", None) or [
        "sliding_attention" if i >= getattr(hf, "max_window_layers", 0) else "full_attention"
        for i in range(hf.num_hidden_layers)]
    windows = tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
    return windows if any(w is not None for w in windows) else ()


def config_from_hf(hf: Any) -> LlamaFamilyConfig:
    """LlamaFamilyConfig from a transformers Llama, Mistral or Qwen2 config (same field names)."""
    return LlamaFamilyConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        intermediate_size=hf.intermediate_size,
        norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        hidden_act=hf.hidden_act,
        rope=RopeConfig.from_hf(hf),
        qkv_bias=getattr(hf, "model_type", None) == "qwen2",
        sliding_windows=sliding_windows(hf),
    )


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with rotary positions, over the KV cache."""

    def __init__(self, config: LlamaFamilyConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias or config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=bias)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = split_heads(q, self.num_heads, self.head_dim)  # (B, nh, T, hd), views of the projection
        k = split_heads(k, self.num_kv_heads, self.head_dim)  # (B, nkv, T, hd)
        v = split_heads(v, self.num_kv_heads, self.head_dim)
        return self.o_proj(cached_attention(q, k, v, self.layer, ctx, rotary=rotary))


class KernelChain:
    """A decoder layer's forward as the chain of C++ kernel calls its modules make on the CPU under the bfloat16
    policy, made in one call (bf16_decoder_layer): the input norm (rms_norm), q | k | v (bf16_linear), the attention
    over the cache read from that projection where it lies (cached_attention_qkv), o (bf16_linear), the residual add
    and the next norm (add_rms_norm_), gate | up with its SiLU gate (bf16_silu_gate), down with the residual add
    (bf16_linear_add_); each GEMM on AMX tiles where its module multiplies there (amx_bf16_linear, amx_bf16_silu_gate,
    amx_bf16_linear_add_). The same kernels on the same inputs with the same options as the modules' own path
    (LlamaDecoderLayer.forward), so the same bits, without the Python and PyTorch views between the calls, which cost
    more than the small kernels between them once the large ones have pushed the interpreter out of the CPU's caches.
    Built where every part takes that path (`of`); valid while the layer holds the same modules."""

    def __init__(self, layer: "LlamaDecoderLayer") -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.layer = attention.layer
        self.scale = attention.head_dim ** -0.5
        norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
        qkv, o, gate_up, down = attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj
        # bf16_decoder_layer's arguments before the cache's, between the attention's and the MLP's, after them
        self.attention_args = (norm.weight, norm.eps, qkv.packed, qkv.bias, qkv.out_features, attention.num_heads)
        self.mlp_args = (o.packed, o.bias, post_norm.weight, post_norm.eps, gate_up.packed, gate_up.out_features,
                         down.packed, down.bias, [gemm.amx for gemm in (qkv, o, gate_up, down)])

    @classmethod
    def of(cls, layer: "LlamaDecoderLayer") -> "KernelChain | None":
        """The chain of `layer`, or None where a part of it takes another path: a GEMM other than packed bf16_linear
        or amx_bf16_linear (and their SiLU gates for gate | up), norms not in float32."""
        gemms = tuple(type(module) for module in chain_modules(layer)[:4])
        if gemms != (BF16Linear, BF16Linear, SiluGatedBF16Linear, BF16Linear):
            return None
        if any(norm.weight.dtype != torch.float32 for norm in (layer.input_layernorm, layer.post_attention_layernorm)):
            return None
        return cls(layer)

    def __call__(self, x: torch.Tensor, ctx: ForwardContext, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, T, hidden) float32 -> the layer's output: x itself, updated in place. cos, sin: the rotary tables
        (B, T, hd)."""
        return cpu_kernels().bf16_decoder_layer(x, *self.attention_args, ctx.cache.keys[self.layer],
                                                ctx.cache.values[self.layer], ctx.rows, *ctx.key_ranges, self.scale,
                                                cos, sin, *self.mlp_args)


def global_module_hooks() -> bool:
    """Whether hooks run around every module's forward (torch.nn.modules.module.register_module_forward_hook)."""
    return bool(module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks)


def chain_modules(layer: "LlamaDecoderLayer") -> tuple[nn.Module, ...]:
    """The modules a KernelChain stands for: q | k | v, o, gate | up and down first, then the rest of the attention's
    and the MLP's, the layer's own (its norms, the attention, the MLP) and the layer (read from their module dicts:
    a forward's chains are looked up before the first layer runs, every layer's at once)."""
    attention, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
    return (attention["qkv_proj"], attention["o_proj"], mlp["gate_up_proj"], mlp["down_proj"], *attention.values(),
            *mlp.values(), *layer._modules.values(), layer)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); on the CPU under the bfloat16 policy, run by the
    model as one chain of kernel calls (KernelChain)."""

    def __init__(self, config: LlamaFamilyConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)

    def __getstate__(self) -> dict:
        """The layer's state for pickling (the weight cache) without its KernelChain, found again when next run."""
        state = super().__getstate__()
        state.pop("_kernel_chain", None)
        return state

    def kernel_chain(self) -> KernelChain | None:
        """This layer's KernelChain for its present modules (found again when one was replaced), or None: none to
        build, or a hook on one of its modules, or on the layer, that the chain would not call."""
        modules = chain_modules(self)
        if any(module._forward_hooks or module._forward_pre_hooks for module in modules):
            return None
        found = self.__dict__.get("_kernel_chain")  # (the modules it was found for, the chain)
        if found is None or found[0] != modules:  # modules compare by identity
            found = self.__dict__["_kernel_chain"] = (modules, KernelChain.of(self))
        return found[1]

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        # Each norm's outputs rounded to bfloat16 where its GEMM rounds them so anyway; the MLP's added into x.
        normed = self.input_layernorm(x, round_to_bf16=rounds_inputs_to_bf16(self.self_attn.qkv_proj))
        attended = self.self_attn(normed, rotary, ctx)
        x, normed = self.post_attention_layernorm.add_and_norm(
            ctx.kept(x), attended, round_to_bf16=rounds_inputs_to_bf16(self.mlp.gate_up_proj))
        return self.mlp.add_to(x, normed)


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, config: LlamaFamilyConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)


class LlamaForCausalLM(CausalLM):
    """Llama decoder with a language-model head (modelzoo/models/base.py); layers of a sliding window
    (Mistral, Qwen2) attend through a context of their own."""

    config_from_hf = staticmethod(config_from_hf)
    packs_prompts = True
    splits_over_ranks = True
    embedding_name, layers_name = "model.embed_tokens", "model.layers"

    def __init__(self, config: LlamaFamilyConfig) -> None:
        super().__init__(config)
        self.model = LlamaModel(config)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def fused_weights(self) -> dict[str, list[str]]:
        """q/k/v into qkv_proj, gate/up into gate_up_proj, one GEMM each."""
        fused = {}
        for i in range(self.config.num_layers):
            prefix = f"model.layers.{i}."
            for suffix in ("weight", "bias"):
                fused[f"{prefix}self_attn.qkv_proj.{suffix}"] = [
                    f"{prefix}self_attn.{name}_proj.{suffix}" for name in ("q", "k", "v")]
                fused[f"{prefix}mlp.gate_up_proj.{suffix}"] = [f"{prefix}mlp.{name}_proj.{suffix}" for name in ("gate", "up")]
        return fused

    def prepare(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor | None,
                last: torch.Tensor | None, length: int | None = None,
                ) -> tuple[torch.Tensor, list[ForwardContext], tuple[torch.Tensor, ...]]:
        """One context per distinct sliding window, shared by the layers that have it."""
        windows = self.config.sliding_windows or (None,) * self.config.num_layers
        contexts = {w: ForwardContext.build(cache, slots, positions, sliding_window=w, length=length) for w in set(windows)}
        x = self.model.embed_tokens(tokens)  # (B, T, hidden)
        return x, [contexts[w] for w in windows], (self.rotary(positions, x.dtype),)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x)

    def layer_chains(self, x: torch.Tensor, contexts: Sequence[ForwardContext], extra: tuple[torch.Tensor, ...]
                     ) -> list[Callable[[torch.Tensor, ForwardContext], torch.Tensor] | None]:
        """Each layer's KernelChain where the modules' path would run its kernels on x (float32, contiguous, on the
        CPU) and the layer's context (the C++ attention over its cache; every position's outputs read, which the
        last layer of a prompt does not), not under torch.compile and with no hook around every module."""
        layers = self.model.layers
        if (x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous()
                or torch.compiler.is_compiling() or global_module_hooks()):
            return [None] * len(layers)
        c = self.config
        cos, sin = extra[0][0][:, 0], extra[0][1][:, 0]  # (B, 1, T, hd) -> (B, T, hd)
        attends = {id(ctx): attention_kernel_for(x.device, x.dtype, c.num_heads, c.head_dim, ctx) is not None
                   for ctx in contexts}
        chains = []
        for layer, ctx in zip(layers, contexts):
            chain = layer.kernel_chain() if attends[id(ctx)] and ctx.read is None else None
            chains.append(None if chain is None else functools.partial(chain, cos=cos, sin=sin))
        return chains
