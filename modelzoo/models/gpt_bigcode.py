"""The GPT-BigCode family: GPTBigCodeForCausalLM (SantaCoder, StarCoder, StarCoderBase, WizardCoder...).

GPT-2's layout (learned positions, LayerNorm, fused c_attn, biases, tied lm_head) with nn.Linear
weights and, with `multi_query`, a single key/value head shared by every query head (the KV cache
then holds one head). Without it, c_attn interleaves q, k, v per head.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from modelzoo.errors import UserError
from modelzoo.models import gpt2
from modelzoo.models.gpt2 import GPT2DecoderConfig, GPT2LMHeadModel, GPT2MLP
from modelzoo.models.layers import ForwardContext, cached_attention, split_heads


def config_from_hf(hf: Any) -> GPT2DecoderConfig:
    """GPT2DecoderConfig from a transformers GPTBigCodeConfig; num_kv_heads is 1 with multi_query."""
    if getattr(hf, "add_cross_attention", False):
        raise UserError("GPTBigCode with add_cross_attention=true is not supported")
    # GPT-2's fields (GPTBigCode has no scale_attn_by_inverse_layer_idx) plus the shared k/v head.
    return replace(gpt2.config_from_hf(hf), num_kv_heads=1 if getattr(hf, "multi_query", True) else hf.n_head,
                   scale_attn_by_inverse_layer_idx=False)


class GPTBigCodeAttention(nn.Module):
    """Multi-query (one shared k/v head) or multi-head self-attention, over the KV cache."""

    def __init__(self, config: GPT2DecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.multi_query = self.num_kv_heads == 1 and self.num_heads > 1
        self.scale = self.head_dim ** -0.5 if config.scale_attn_weights else 1.0
        hidden, kv_dim = config.hidden_size, config.num_kv_heads * config.head_dim
        self.c_attn = nn.Linear(hidden, hidden + 2 * kv_dim)
        self.c_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        qkv = self.c_attn(x)
        if self.multi_query:
            # [q (all heads) | k (one head) | v (one head)] along the features.
            q, k, v = qkv.split((self.num_heads * self.head_dim, self.head_dim, self.head_dim), dim=-1)
            q = split_heads(q, self.num_heads, self.head_dim)  # (B, nh, T, hd)
            k, v = k.unsqueeze(1), v.unsqueeze(1)  # (B, 1, T, hd)
        else:
            # Per head [q_h | k_h | v_h]: (B, T, nh, 3 hd) -> (B, nh, T, 3 hd) -> three (B, nh, T, hd).
            batch, seq, _ = x.shape
            per_head = qkv.view(batch, seq, self.num_heads, 3 * self.head_dim).transpose(1, 2)
            q, k, v = per_head.split(self.head_dim, dim=3)
        return self.c_proj(cached_attention(q, k, v, self.layer, ctx, scale=self.scale))


class GPTBigCodeMLP(GPT2MLP):
    """GPT-2's c_proj(act(c_fc(x))) with nn.Linear weights, (out, in)."""

    linear = nn.Linear


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    """GPT-BigCode with a language-model head; `forward` returns last-position logits."""

    config_from_hf = staticmethod(config_from_hf)
    attention_type = GPTBigCodeAttention
    mlp_type = GPTBigCodeMLP
