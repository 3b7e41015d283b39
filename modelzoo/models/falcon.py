"""The Falcon family: tiiuae/falcon-7b, falcon-40b, falcon-180b, falcon-rw and their instruct variants.

Attention and MLP in parallel (or sequential with parallel_attn false), rotary positions or ALiBi,
optional biases, lm_head tied to the word embeddings. The fused query_key_value projection has one
layout for all three attention variants: kv groups of (queries of the group, k, v) — Falcon-7B's
multi_query is one group of all heads, the classic per-head (q, k, v) is one group per head, and
new_decoder_architecture (40B / 180B) has num_kv_heads groups, with separate ln_attn / ln_mlp.
Module names equal the Hugging Face ones, so checkpoints load by name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelzoo.errors import UserError
from modelzoo.models.kv_cache import KVCache
from modelzoo.models.base import CausalLM
from modelzoo.models.config import DecoderConfig, RopeConfig
from modelzoo.models.layers import DenseMLP, ForwardContext, cached_attention
from modelzoo.models.positions import RotaryEmbedding, alibi_slopes, apply_rotary


@dataclass(frozen=True)
class FalconDecoderConfig(DecoderConfig):
    """DecoderConfig plus Falcon's block layout options."""

    alibi: bool = False  # ALiBi instead of rotary positions
    parallel_attn: bool = True  # x + attn(ln(x)) + mlp(ln(x)) instead of two sequential residuals
    separate_norms: bool = False  # ln_attn and ln_mlp (new_decoder_architecture) instead of input_layernorm


def config_from_hf(hf: Any) -> FalconDecoderConfig:
    """FalconDecoderConfig from a transformers FalconConfig."""
    new_arch = bool(hf.new_decoder_architecture)
    num_ln = getattr(hf, "num_ln_in_parallel_attn", None)
    if new_arch and not hf.parallel_attn:
        raise UserError("Falcon new_decoder_architecture=true with parallel_attn=false is not supported "
                        "(transformers' Falcon cannot run it either)")
    if not new_arch and hf.parallel_attn and num_ln == 2:
        raise UserError("Falcon num_ln_in_parallel_attn=2 needs new_decoder_architecture=true "
                        "(transformers' Falcon cannot run it otherwise)")
    if new_arch:
        num_kv_heads = hf.num_kv_heads or hf.num_attention_heads
    else:
        num_kv_heads = 1 if hf.multi_query else hf.num_attention_heads
    return FalconDecoderConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=num_kv_heads,
        head_dim=hf.hidden_size // hf.num_attention_heads,
        intermediate_size=hf.ffn_hidden_size or 4 * hf.hidden_size,
        norm_eps=hf.layer_norm_epsilon,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        attention_bias=bool(hf.bias),
        mlp_bias=bool(hf.bias),
        hidden_act=hf.activation,
        rope=RopeConfig() if hf.alibi else RopeConfig.from_hf(hf),
        alibi=bool(hf.alibi),
        parallel_attn=new_arch or bool(hf.parallel_attn),
        separate_norms=new_arch and num_ln in (None, 2),
    )


class FalconLinear(nn.Linear):
    """x @ W.T + b as two ops, as transformers' FalconLinear computes it (not one fused addmm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight.T
        return out if self.bias is None else out + self.bias


class FalconAttention(nn.Module):
    """Self-attention over kv groups (multi-query, multi-head or grouped), with rotary positions or an
    ALiBi bias carried by the context's mask, over the KV cache."""

    def __init__(self, config: FalconDecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.alibi = layer, config.alibi
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        qkv_dim = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.query_key_value = FalconLinear(config.hidden_size, qkv_dim, bias=config.attention_bias)
        self.dense = FalconLinear(config.hidden_size, config.hidden_size, bias=config.attention_bias)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                ctx: ForwardContext) -> torch.Tensor:
        batch, seq, _ = x.shape
        per_group = self.num_heads // self.num_kv_heads
        qkv = self.query_key_value(x).view(batch, seq, self.num_kv_heads, per_group + 2, self.head_dim)
        q = qkv[:, :, :, :-2].reshape(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = qkv[:, :, :, -2].transpose(1, 2)  # (B, nkv, T, hd)
        v = qkv[:, :, :, -1].transpose(1, 2)
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.dense(cached_attention(q, k, v, self.layer, ctx))


class FalconDecoderLayer(nn.Module):
    """Parallel: x + (mlp(ln(x)) + attn(ln(x))), with one shared or two separate norms.
    Sequential: x + attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x))."""

    def __init__(self, config: FalconDecoderConfig, layer: int) -> None:
        super().__init__()
        self.parallel_attn, self.separate_norms = config.parallel_attn, config.separate_norms
        hidden, eps = config.hidden_size, config.norm_eps
        if self.separate_norms:
            self.ln_attn = nn.LayerNorm(hidden, eps=eps)
            self.ln_mlp = nn.LayerNorm(hidden, eps=eps)
        else:
            self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        if not self.parallel_attn:
            self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.self_attention = FalconAttention(config, layer)
        self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias,
                            ("dense_h_to_4h", "dense_4h_to_h"), FalconLinear)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                ctx: ForwardContext) -> torch.Tensor:
        if self.separate_norms:
            attn_in, mlp_in = self.ln_attn(x), self.ln_mlp(x)
        else:
            attn_in = mlp_in = self.input_layernorm(x)
        attn_out = self.self_attention(attn_in, rotary, ctx)
        x = ctx.kept(x)
        if not self.parallel_attn:
            x = x + attn_out
            return x + self.mlp(self.post_attention_layernorm(x))
        return x + (self.mlp(ctx.kept(mlp_in)) + attn_out)  # transformers' op order: (mlp + attn), then the residual


class FalconModel(nn.Module):
    """Embeddings, decoder layers and final norm (HF's `transformer.` prefix)."""

    def __init__(self, config: FalconDecoderConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList(FalconDecoderLayer(config, i) for i in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


class FalconForCausalLM(CausalLM):
    """Falcon decoder with a language-model head (modelzoo/models/base.py): rotary, or ALiBi."""

    config_from_hf = staticmethod(config_from_hf)
    embedding_name, layers_name = "transformer.word_embeddings", "transformer.h"

    @property
    def packs_prompts(self) -> bool:
        """Packed prompts (ForwardContext.packed) with rotary positions; not with ALiBi's bias."""
        return not self.config.alibi

    def __init__(self, config: FalconDecoderConfig) -> None:
        super().__init__(config)
        self.transformer = FalconModel(config)
        self.rotary = None if config.alibi else RotaryEmbedding(config.rope, config.head_dim,
                                                                config.max_position_embeddings)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("alibi_slopes", torch.empty(0), persistent=False)

    def build_buffers(self, device: torch.device) -> None:
        """The rotary tables, or the ALiBi slopes."""
        super().build_buffers(device)
        if self.rotary is None:
            self.alibi_slopes = alibi_slopes(self.config.num_heads).to(device)

    def alibi_context(self, cache: KVCache, slots: torch.Tensor | None, positions: torch.Tensor,
                      dtype: torch.dtype, length: int | None = None) -> ForwardContext:
        """The context with Falcon's ALiBi mask: transformers rounds slope * key position to bfloat16
        (whatever the model dtype), then divides by sqrt(head_dim) since its attention scales only q @ k."""
        ctx = ForwardContext.build(cache, slots, positions, length=length)  # mask: (B, 1, T, length) bool
        keys = torch.arange(ctx.length, device=positions.device)
        bias = (self.alibi_slopes.bfloat16()[:, None] * keys[None, :]).to(dtype)  # (heads, length), bf16-rounded
        bias = bias / math.sqrt(self.config.head_dim)
        return ctx.add_position_bias(bias[None, :, None, :], dtype)

    def prepare(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor | None,
                last: torch.Tensor | None, length: int | None = None,
                ) -> tuple[torch.Tensor, list[ForwardContext], tuple[torch.Tensor, ...]]:
        if self.rotary is not None:
            return super().prepare(tokens, positions, cache, slots, last, length)
        x = self.transformer.word_embeddings(tokens)  # (B, T, hidden)
        return x, [self.alibi_context(cache, slots, positions, x.dtype, length)] * self.config.num_layers, (None,)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer.ln_f(x)
