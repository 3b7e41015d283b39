"""The GPT-J family: GPT-J-6B and checkpoints of the same architecture.

LayerNorm, interleaved (GPT-J layout) rotary embeddings on the first `rotary_dim` features of each
head, bias-free q / k / v / out projections, attention and MLP in parallel off one shared `ln_1`, a
GELU MLP (fc_in / fc_out) and an lm_head with a bias. Module names equal the Hugging Face ones
(`transformer.wte`, `transformer.h.N`, `transformer.ln_f`), so checkpoints load by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelzoo.models.base import CausalLM
from modelzoo.models.config import DecoderConfig, RopeConfig
from modelzoo.models.layers import DenseMLP, ForwardContext, cached_attention, split_heads
from modelzoo.models.positions import RotaryEmbedding, apply_rotary


@dataclass(frozen=True)
class GPTJConfig(DecoderConfig):
    """DecoderConfig plus the rotated width of each head."""

    rotary_dim: int = 0  # features rotated per head; HF's None (or 0) = the whole head


def config_from_hf(hf: Any) -> GPTJConfig:
    """GPTJConfig from a transformers GPTJConfig (n_embd, n_layer, n_head, n_positions, n_inner)."""
    head_dim = hf.n_embd // hf.n_head
    return GPTJConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.n_embd,
        num_layers=hf.n_layer,
        num_heads=hf.n_head,
        head_dim=head_dim,
        intermediate_size=getattr(hf, "n_inner", None) or 4 * hf.n_embd,
        norm_eps=hf.layer_norm_epsilon,
        max_position_embeddings=hf.n_positions,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        mlp_bias=True,
        hidden_act=hf.activation_function,
        rope=RopeConfig(theta=10000.0),  # GPT-J's sinusoid table hard-codes base 10000, no scaling
        rotary_dim=getattr(hf, "rotary_dim", None) or head_dim,
    )


class GPTJAttention(nn.Module):
    """Multi-head self-attention with interleaved partial rotary, over the KV cache."""

    def __init__(self, config: GPTJConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        hidden = config.hidden_size
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.out_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        cos, sin = rotary  # (B, 1, T, rotary_dim), interleaved: f0 f0 f1 f1 ...
        q = apply_rotary(split_heads(self.q_proj(x), self.num_heads, self.head_dim), cos, sin, interleaved=True)
        k = apply_rotary(split_heads(self.k_proj(x), self.num_heads, self.head_dim), cos, sin, interleaved=True)
        v = split_heads(self.v_proj(x), self.num_heads, self.head_dim)  # (B, nh, T, hd)
        return self.out_proj(cached_attention(q, k, v, self.layer, ctx))


class GPTJBlock(nn.Module):
    """Parallel block: h = ln_1(x); x + attn(h) + mlp(h) (HF's summation order: attn + mlp + x)."""

    def __init__(self, config: GPTJConfig, layer: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = GPTJAttention(config, layer)
        self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, config.hidden_act, True, ("fc_in", "fc_out"))

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        h = self.ln_1(x)
        return self.attn(h, rotary, ctx) + self.mlp(ctx.kept(h)) + ctx.kept(x)


class GPTJModel(nn.Module):
    """Embeddings, blocks and final norm (HF's `transformer.` prefix)."""

    def __init__(self, config: GPTJConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList(GPTJBlock(config, i) for i in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


class GPTJForCausalLM(CausalLM):
    """GPT-J decoder with a biased language-model head (modelzoo/models/base.py)."""

    config_from_hf = staticmethod(config_from_hf)
    packs_prompts = True
    embedding_name, layers_name = "transformer.wte", "transformer.h"

    def __init__(self, config: GPTJConfig) -> None:
        super().__init__(config)
        self.transformer = GPTJModel(config)
        self.rotary = RotaryEmbedding(config.rope, config.rotary_dim, config.max_position_embeddings, interleaved=True)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer.ln_f(x)
