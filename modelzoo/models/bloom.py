"""The BLOOM family: bigscience/bloom and bloomz, every size.

ALiBi positions (no position embeddings), a LayerNorm right after the word embeddings, one fused
query_key_value projection laid out per head as (q, k, v), BLOOM's own tanh-approximated GELU,
biases on every linear layer, lm_head tied to the word embeddings. Module names equal the Hugging
Face ones, so checkpoints load by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelzoo.errors import UserError
from modelzoo.models.kv_cache import KVCache
from modelzoo.models.base import CausalLM
from modelzoo.models.config import DecoderConfig
from modelzoo.models.layers import DenseMLP, ForwardContext, cached_attention
from modelzoo.models.positions import alibi_bias, alibi_slopes


@dataclass(frozen=True)
class BloomDecoderConfig(DecoderConfig):
    """DecoderConfig plus BLOOM's choice of residual (HF `apply_residual_connection_post_layernorm`)."""

    residual_post_layernorm: bool = False


def config_from_hf(hf: Any) -> BloomDecoderConfig:
    """BloomDecoderConfig from a transformers BloomConfig."""
    if getattr(hf, "slow_but_exact", False) and (getattr(hf, "pretraining_tp", 1) or 1) > 1:
        # transformers' slow_but_exact path sums tensor-parallel slices of dense layers and drops their biases.
        raise UserError("BLOOM slow_but_exact=true with pretraining_tp > 1 is not supported; "
                        "set slow_but_exact to false")
    return BloomDecoderConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        intermediate_size=4 * hf.hidden_size,
        norm_eps=hf.layer_norm_epsilon,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        attention_bias=True,
        mlp_bias=True,
        hidden_act="bloom_gelu",
        residual_post_layernorm=bool(getattr(hf, "apply_residual_connection_post_layernorm", False)),
    )



def bloom_gelu(x: torch.Tensor) -> torch.Tensor:
    """BLOOM's GELU (transformers' bloom_gelu_forward): tanh approximation with its own constants and op order."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class BloomAttention(nn.Module):
    """Multi-head self-attention with an ALiBi bias (carried by the context's mask), over the KV cache."""

    def __init__(self, config: BloomDecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.query_key_value(x).view(batch, seq, self.num_heads, 3, self.head_dim)  # per head: q, k, v
        q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))  # (B, nh, T, hd) each
        return self.dense(cached_attention(q, k, v, self.layer, ctx))


class BloomBlock(nn.Module):
    """Pre-norm block; the residual is the block input, or the normed input when
    `residual_post_layernorm` is set."""

    def __init__(self, config: BloomDecoderConfig, layer: int) -> None:
        super().__init__()
        self.residual_post_layernorm = config.residual_post_layernorm
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.self_attention = BloomAttention(config, layer)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, bloom_gelu, True, ("dense_h_to_4h", "dense_4h_to_h"))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        normed = self.input_layernorm(x)
        x = ctx.kept(normed if self.residual_post_layernorm else x) + self.self_attention(normed, ctx)
        normed = self.post_attention_layernorm(x)
        return (normed if self.residual_post_layernorm else x) + self.mlp(normed)


class BloomModel(nn.Module):
    """Embeddings and their norm, blocks, final norm (HF's `transformer.` prefix)."""

    def __init__(self, config: BloomDecoderConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.word_embeddings_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.h = nn.ModuleList(BloomBlock(config, i) for i in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


class BloomForCausalLM(CausalLM):
    """BLOOM decoder with a language-model head and ALiBi (modelzoo/models/base.py)."""

    config_from_hf = staticmethod(config_from_hf)
    embedding_name, layers_name = "transformer.word_embeddings", "transformer.h"

    def __init__(self, config: BloomDecoderConfig) -> None:
        super().__init__(config)
        self.transformer = BloomModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("alibi_slopes", torch.empty(0), persistent=False)

    def build_buffers(self, device: torch.device) -> None:
        self.alibi_slopes = alibi_slopes(self.config.num_heads).to(device)

    def prepare(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor | None,
                last: torch.Tensor | None, length: int | None = None,
                ) -> tuple[torch.Tensor, list[ForwardContext], tuple[torch.Tensor, ...]]:
        """The ALiBi bias rides on the context's mask; the embeddings have a norm of their own."""
        x = self.transformer.word_embeddings(tokens)  # (B, T, hidden)
        ctx = ForwardContext.build(cache, slots, positions, length=length)
        ctx.add_position_bias(alibi_bias(self.alibi_slopes, ctx.length), x.dtype)
        return self.transformer.word_embeddings_layernorm(x), [ctx] * self.config.num_layers, ()

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer.ln_f(x)
