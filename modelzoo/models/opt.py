"""The OPT family: OPTForCausalLM (OPT-125m ... OPT-66b, OPT-350m, Galactica-style configs).

Learned positions with OPT's offset of 2, LayerNorm before (pre-norm) or after (post-norm, OPT-350m)
each sub-block, separate q/k/v projections with the query scaled before the product, ReLU MLP,
optional down-projection of the word embeddings (word_embed_proj_dim != hidden_size), tied lm_head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelzoo.models.kv_cache import KVCache
from modelzoo.models.base import CausalLM
from modelzoo.models.config import DecoderConfig
from modelzoo.models.gpt2 import check_learned_positions
from modelzoo.models.layers import ForwardContext, activation, cached_attention, split_heads

POSITION_OFFSET = 2  # OPT's position table starts 2 rows in (a fairseq padding-index leftover)


@dataclass(frozen=True)
class OPTDecoderConfig(DecoderConfig):
    """DecoderConfig plus OPT's norm placement and embedding projection."""

    word_embed_proj_dim: int = 0  # 0 = hidden_size (no project_in / project_out)
    do_layer_norm_before: bool = True  # False: post-norm (OPT-350m)
    final_layer_norm: bool = True  # a final norm after the last layer (pre-norm checkpoints only)
    layer_norm_affine: bool = True  # layer_norm_elementwise_affine


def config_from_hf(hf: Any) -> OPTDecoderConfig:
    """OPTDecoderConfig from a transformers OPTConfig."""
    pre_norm = bool(getattr(hf, "do_layer_norm_before", True))
    return OPTDecoderConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        intermediate_size=hf.ffn_dim,
        norm_eps=1e-5,  # OPT's LayerNorms use torch's default eps
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        attention_bias=bool(getattr(hf, "enable_bias", True)),
        mlp_bias=bool(getattr(hf, "enable_bias", True)),
        hidden_act=hf.activation_function,
        word_embed_proj_dim=getattr(hf, "word_embed_proj_dim", None) or hf.hidden_size,
        do_layer_norm_before=pre_norm,
        final_layer_norm=pre_norm and not getattr(hf, "_remove_final_layer_norm", False),
        layer_norm_affine=bool(getattr(hf, "layer_norm_elementwise_affine", True)),
    )


class OPTAttention(nn.Module):
    """Multi-head self-attention over the KV cache; the query is scaled by 1 / sqrt(hd) before q @ k."""

    def __init__(self, config: OPTDecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(hidden, hidden, bias=bias)
        self.v_proj = nn.Linear(hidden, hidden, bias=bias)
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q = split_heads(self.q_proj(x) * self.scaling, self.num_heads, self.head_dim)  # (B, nh, T, hd)
        k = split_heads(self.k_proj(x), self.num_heads, self.head_dim)
        v = split_heads(self.v_proj(x), self.num_heads, self.head_dim)
        return self.out_proj(cached_attention(q, k, v, self.layer, ctx, scale=1.0))


class OPTDecoderLayer(nn.Module):
    """Pre-norm: x + attn(norm(x)), x + fc2(act(fc1(norm(x)))). Post-norm: norm(x + attn(x)), norm(x + mlp(x))."""

    def __init__(self, config: OPTDecoderConfig, layer: int) -> None:
        super().__init__()
        self.pre_norm = config.do_layer_norm_before
        hidden, affine = config.hidden_size, config.layer_norm_affine
        self.self_attn = OPTAttention(config, layer)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, eps=config.norm_eps, elementwise_affine=affine)
        self.fc1 = nn.Linear(hidden, config.intermediate_size, bias=config.mlp_bias)
        self.fc2 = nn.Linear(config.intermediate_size, hidden, bias=config.mlp_bias)
        self.final_layer_norm = nn.LayerNorm(hidden, eps=config.norm_eps, elementwise_affine=affine)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.self_attn(self.self_attn_layer_norm(x) if self.pre_norm else x, ctx)
        x = ctx.kept(x) + h
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.fc2(self.act(self.fc1(self.final_layer_norm(x) if self.pre_norm else x)))
        x = x + h
        return x if self.pre_norm else self.final_layer_norm(x)


class OPTDecoder(nn.Module):
    """Embeddings, optional projections, layers and optional final norm (HF's `model.decoder.` prefix)."""

    def __init__(self, config: OPTDecoderConfig) -> None:
        super().__init__()
        hidden, proj = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, proj)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, hidden)
        self.project_in = nn.Linear(proj, hidden, bias=False) if proj != hidden else None
        self.project_out = nn.Linear(hidden, proj, bias=False) if proj != hidden else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config, i) for i in range(config.num_layers))
        self.final_layer_norm = (nn.LayerNorm(hidden, eps=config.norm_eps, elementwise_affine=config.layer_norm_affine)
                                 if config.final_layer_norm else None)


class OPTModel(nn.Module):
    """HF's `model.` level: only holds the decoder."""

    def __init__(self, config: OPTDecoderConfig) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(CausalLM):
    """OPT decoder with a language-model head (modelzoo/models/base.py): learned positions, optional
    projections in and out of a narrower embedding, an optional final norm."""

    config_from_hf = staticmethod(config_from_hf)
    packs_prompts = True
    embedding_name, layers_name = "model.decoder.embed_tokens", "model.decoder.layers"

    @property
    def position_limit(self) -> int | None:
        return self.config.max_position_embeddings

    def __init__(self, config: OPTDecoderConfig) -> None:
        super().__init__(config)
        self.model = OPTModel(config)
        self.lm_head = nn.Linear(config.word_embed_proj_dim, config.vocab_size, bias=False)

    def prepare(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor | None,
                last: torch.Tensor | None, length: int | None = None,
                ) -> tuple[torch.Tensor, list[ForwardContext], tuple[torch.Tensor, ...]]:
        decoder = self.model.decoder
        ctx = ForwardContext.build(cache, slots, positions, length=length)
        check_learned_positions(ctx, self.config.max_position_embeddings)
        x = decoder.embed_tokens(tokens)  # (B, T, word_embed_proj_dim)
        if decoder.project_in is not None:
            x = decoder.project_in(x)  # (B, T, hidden)
        return x + decoder.embed_positions(positions + POSITION_OFFSET), [ctx] * self.config.num_layers, ()

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        decoder = self.model.decoder
        if decoder.final_layer_norm is not None:
            x = decoder.final_layer_norm(x)
        return decoder.project_out(x) if decoder.project_out is not None else x  # (B, word_embed_proj_dim)
