"""The Llama family: Llama 1/2/3, SmolLM2, and Mistral and Qwen2 as aliases.

RMSNorm, rotary embeddings (default, linear, llama3 scaling), grouped-query attention, SwiGLU MLP,
tied or untied embeddings. Module names equal the Hugging Face ones, except two fusions that make
fewer, wider matrix multiplies (the decode step is GEMM-bound): `qkv_proj` = q_proj | k_proj | v_proj
and `mlp.gate_up_proj` = gate_proj | up_proj, declared in `fused_weights()` for the loader.
Mistral adds a sliding attention window on every layer; Qwen2 adds biases on q, k, v (not o) and a
sliding window on the layers its config marks "sliding_attention" (only with use_sliding_window).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelzoo.models.kv_cache import KVCache
from modelzoo.models.base import CausalLM
from modelzoo.models.config import DecoderConfig, RopeConfig
from modelzoo.models.layers import (ForwardContext, GatedMLP, RMSNorm, cached_attention, rounds_inputs_to_bf16,
                                    split_heads)
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


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaFamilyConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)

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
