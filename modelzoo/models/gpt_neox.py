"""The GPT-NeoX family: Pythia, GPT-NeoX-20B, and checkpoints of the same architecture.

LayerNorm, partial rotary embeddings (the first `rotary_pct` of each head, GPT-NeoX / Llama layout),
a fused query_key_value projection laid out per head as [q | k | v], a GELU MLP, and a parallel
(attn and MLP both read x) or sequential residual. Module names equal the Hugging Face ones
(`gpt_neox.embed_in`, `embed_out`), so checkpoints load by name.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from modelzoo.models.base import CausalLM
from modelzoo.models.config import DecoderConfig, RopeConfig
from modelzoo.models.layers import DenseMLP, ForwardContext, cached_attention
from modelzoo.models.positions import RotaryEmbedding, apply_rotary


@dataclass(frozen=True)
class NeoXConfig(DecoderConfig):
    """DecoderConfig plus GPT-NeoX's rotated width per head and its residual layout."""

    rotary_dim: int = 0  # features rotated per head: int(head_dim * rotary_pct)
    use_parallel_residual: bool = True


def config_from_hf(hf: Any) -> NeoXConfig:
    """NeoXConfig from a transformers GPTNeoXConfig (transformers 5 moves rotary_pct and rotary_emb_base
    into rope_parameters as partial_rotary_factor and rope_theta; older versions keep them top-level)."""
    head_dim = hf.hidden_size // hf.num_attention_heads
    params = dict(getattr(hf, "rope_parameters", None) or {})
    pct = params.get("partial_rotary_factor", getattr(hf, "rotary_pct", 0.25))
    rope = RopeConfig.from_hf(hf)
    if not params and getattr(hf, "rotary_emb_base", None) is not None:  # transformers 4 spelling
        rope = replace(rope, theta=float(hf.rotary_emb_base))
    return NeoXConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=hf.intermediate_size,
        norm_eps=hf.layer_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf, "attention_bias", True)),
        mlp_bias=True,
        hidden_act=hf.hidden_act,
        rope=rope,
        rotary_dim=int(head_dim * pct),
        use_parallel_residual=bool(getattr(hf, "use_parallel_residual", True)),
    )


class GPTNeoXAttention(nn.Module):
    """Multi-head self-attention from a fused projection, partial rotary, over the KV cache."""

    def __init__(self, config: NeoXConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        hidden = config.hidden_size
        self.query_key_value = nn.Linear(hidden, 3 * hidden, bias=config.attention_bias)
        self.dense = nn.Linear(hidden, hidden, bias=config.attention_bias)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.query_key_value(x).view(batch, seq, self.num_heads, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)  # (B, nh, T, hd) each: head h's slice is [q_h | k_h | v_h]
        cos, sin = rotary  # (B, 1, T, rotary_dim): only the first rotary_dim features turn
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.dense(cached_attention(q, k, v, self.layer, ctx))


class GPTNeoXLayer(nn.Module):
    """Parallel: x + attn(ln1(x)) + mlp(ln2(x)); sequential: h = x + attn(ln1(x)), h + mlp(ln2(h))."""

    def __init__(self, config: NeoXConfig, layer: int) -> None:
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attention = GPTNeoXAttention(config, layer)
        self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, config.hidden_act, True, ("dense_h_to_4h", "dense_4h_to_h"))

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        attn = self.attention(self.input_layernorm(x), rotary, ctx)
        x = ctx.kept(x)
        if self.use_parallel_residual:
            return self.mlp(self.post_attention_layernorm(x)) + attn + x  # HF's summation order
        attn = attn + x
        return self.mlp(self.post_attention_layernorm(attn)) + attn


class GPTNeoXModel(nn.Module):
    """Embeddings, layers and final norm (HF's `gpt_neox.` prefix)."""

    def __init__(self, config: NeoXConfig) -> None:
        super().__init__()
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GPTNeoXLayer(config, i) for i in range(config.num_layers))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


class GPTNeoXForCausalLM(CausalLM):
    """GPT-NeoX decoder with its output projection `embed_out` (modelzoo/models/base.py)."""

    config_from_hf = staticmethod(config_from_hf)
    packs_prompts = True
    embedding_name, layers_name, head_name = "gpt_neox.embed_in", "gpt_neox.layers", "embed_out"

    def __init__(self, config: NeoXConfig) -> None:
        super().__init__(config)
        self.gpt_neox = GPTNeoXModel(config)
        self.rotary = RotaryEmbedding(config.rope, config.rotary_dim, config.max_position_embeddings)
        self.embed_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.gpt_neox.final_layer_norm(x)
