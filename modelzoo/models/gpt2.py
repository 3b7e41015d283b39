"""The GPT-2 family: GPT2LMHeadModel (GPT-2, DistilGPT-2 and their fine-tunes).

Learned absolute positions (`wpe`), LayerNorm, fused q/k/v projection (`c_attn`), GELU MLP, biases
everywhere, tied or untied lm_head. GPT-2 stores its linear weights as `Conv1D`, (in, out): the
transpose of nn.Linear; `Conv1D` below keeps that shape so checkpoints load by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelzoo.errors import UserError, past_learned_positions
from modelzoo.models.kv_cache import KVCache
from modelzoo.models.base import CausalLM
from modelzoo.models.config import DecoderConfig
from modelzoo.models.layers import ForwardContext, activation, cached_attention, split_heads


@dataclass(frozen=True)
class GPT2DecoderConfig(DecoderConfig):
    """DecoderConfig plus GPT-2's attention scaling switches."""

    scale_attn_weights: bool = True  # scores / sqrt(head_dim); False: no scaling at all
    scale_attn_by_inverse_layer_idx: bool = False  # scores additionally / (layer + 1)


def config_from_hf(hf: Any) -> GPT2DecoderConfig:
    """GPT2DecoderConfig from a transformers GPT2Config (n_embd, n_layer, n_head, n_inner, n_positions)."""
    if getattr(hf, "add_cross_attention", False):
        raise UserError("GPT-2 with add_cross_attention=true (an encoder-decoder half) is not supported")
    # reorder_and_upcast_attn only changes the rounding of half-precision attention scores, and only on
    # transformers' eager path; its default sdpa path ignores it, as we do.
    return GPT2DecoderConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.n_embd,
        num_layers=hf.n_layer,
        num_heads=hf.n_head,
        intermediate_size=hf.n_inner or 4 * hf.n_embd,
        norm_eps=hf.layer_norm_epsilon,
        max_position_embeddings=hf.n_positions,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        attention_bias=True,
        mlp_bias=True,
        hidden_act=hf.activation_function,
        scale_attn_weights=bool(getattr(hf, "scale_attn_weights", True)),
        scale_attn_by_inverse_layer_idx=bool(getattr(hf, "scale_attn_by_inverse_layer_idx", False)),
    )



class Conv1D(nn.Module):
    """A linear layer whose weight is stored (in, out), as transformers' Conv1D: x @ weight + bias."""

    weight_is_in_out = True  # what modelzoo.cpu.quantization reads instead of importing this family

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)  # same kernel as transformers
        return out.view(*x.shape[:-1], out.shape[-1])


def check_learned_positions(ctx: ForwardContext, limit: int) -> None:
    """A learned position table has `limit` rows: a longer sequence is a config error, not an IndexError."""
    if ctx.length > limit:
        raise past_learned_positions(ctx.length - 1, limit)


class GPT2Attention(nn.Module):
    """Multi-head self-attention with a fused q/k/v projection, over the KV cache."""

    def __init__(self, config: GPT2DecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.head_dim, self.hidden = config.num_heads, config.head_dim, config.hidden_size
        self.scale = self.score_scale(config) if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            self.scale /= float(layer + 1)
        self.c_attn = Conv1D(self.hidden, 3 * self.hidden)
        self.c_proj = Conv1D(self.hidden, self.hidden)

    @staticmethod
    def score_scale(config: GPT2DecoderConfig) -> float:
        """The factor of the scores with scale_attn_weights: 1 / sqrt(head_dim)."""
        return config.head_dim ** -0.5

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.hidden, dim=2)  # (B, T, hidden) each
        q, k, v = (split_heads(t, self.num_heads, self.head_dim) for t in (q, k, v))  # (B, nh, T, hd)
        return self.c_proj(cached_attention(q, k, v, self.layer, ctx, scale=self.scale))


class GPT2MLP(nn.Module):
    """c_proj(act(c_fc(x)))."""

    linear: type[nn.Module] = Conv1D  # the weight layout: (in, out) Conv1D here, nn.Linear for GPT-BigCode

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.c_fc = self.linear(config.hidden_size, config.intermediate_size)
        self.c_proj = self.linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """Pre-norm block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPT2DecoderConfig, layer: int, attention: type[nn.Module] = GPT2Attention,
                 mlp: type[nn.Module] = GPT2MLP) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = attention(config, layer)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = mlp(config)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.attn(self.ln_1(x), ctx) + ctx.kept(x)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    """Token and position embeddings, blocks and final norm (HF's `transformer.` prefix)."""

    def __init__(self, config: GPT2DecoderConfig, attention: type[nn.Module] = GPT2Attention,
                 mlp: type[nn.Module] = GPT2MLP) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i, attention, mlp) for i in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


class GPT2LMHeadModel(CausalLM):
    """GPT-2 with a language-model head (modelzoo/models/base.py).

    A family on GPT-2's layout subclasses it and swaps in what differs: `config_from_hf`, the classes
    below, `embed`.
    """

    config_from_hf = staticmethod(config_from_hf)
    packs_prompts = True
    embedding_name, layers_name = "transformer.wte", "transformer.h"

    @property
    def position_limit(self) -> int | None:
        return self.config.max_position_embeddings
    transformer_type: type[GPT2Model] = GPT2Model  # the `transformer.` module
    attention_type: type[nn.Module] = GPT2Attention  # each block's `attn`
    mlp_type: type[nn.Module] = GPT2MLP  # each block's `mlp`

    def __init__(self, config: GPT2DecoderConfig) -> None:
        super().__init__(config)
        self.transformer = self.transformer_type(config, self.attention_type, self.mlp_type)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor | None,
              last: torch.Tensor | None, length: int | None = None) -> tuple[torch.Tensor, ForwardContext]:
        """The input states (B, T, hidden), token plus learned position embeddings, and the attention context."""
        ctx = ForwardContext.build(cache, slots, positions, length=length)
        check_learned_positions(ctx, self.config.max_position_embeddings)
        return self.transformer.wte(tokens) + self.transformer.wpe(positions), ctx

    def prepare(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor | None,
                last: torch.Tensor | None, length: int | None = None,
                ) -> tuple[torch.Tensor, list[ForwardContext], tuple[torch.Tensor, ...]]:
        x, ctx = self.embed(tokens, positions, cache, slots, last, length)
        return x, [ctx] * self.config.num_layers, ()

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer.ln_f(x)
