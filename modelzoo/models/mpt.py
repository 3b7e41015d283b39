"""The MPT family: mosaicml/mpt-7b, mpt-30b and their instruct / chat variants.

ALiBi positions with MPT's own slopes, no biases anywhere (LayerNorms without bias too), one fused
Wqkv projection laid out as (all q, all k, all v), optional clip_qkv and softmax_scale, GELU MLP.
Module names equal the Hugging Face ones, so checkpoints load by name. Options transformers' MPT
does not implement are refused by name rather than silently run differently.
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
from modelzoo.models.config import DecoderConfig
from modelzoo.models.layers import DenseMLP, ForwardContext, cached_attention, split_heads
from modelzoo.models.positions import alibi_bias

# attn_config options transformers' MPT ignores: any value but these would make it compute something
# other than the checkpoint was trained for (it always uses ALiBi with alibi_bias_max 8, full multi-head
# attention, no qk LayerNorm, plain causal masking).
SUPPORTED_ATTN_OPTIONS = {"attn_type": "multihead_attention", "prefix_lm": False, "qk_ln": False, "alibi": True,
                          "alibi_bias_max": 8}
# Top-level options its weights' shapes or arithmetic fix: biases, MLP width, logit scaling.
SUPPORTED_OPTIONS = {"no_bias": True, "expansion_ratio": 4, "logit_scale": None}


@dataclass(frozen=True)
class MptDecoderConfig(DecoderConfig):
    """DecoderConfig plus MPT's attention options."""

    clip_qkv: float | None = None  # clamp q, k, v to [-clip_qkv, clip_qkv]
    softmax_scale: float | None = None  # None = 1 / sqrt(head_dim)
    alibi_bias_max: float = 8.0


def config_from_hf(hf: Any) -> MptDecoderConfig:
    """MptDecoderConfig from a transformers MptConfig; UserError naming any option it does not support."""
    attn = hf.attn_config
    get = attn.get if isinstance(attn, dict) else (lambda name, default=None: getattr(attn, name, default))
    for option, supported in SUPPORTED_ATTN_OPTIONS.items():
        if get(option, supported) != supported:
            raise UserError(f"MPT attn_config.{option}={get(option)!r} is not supported "
                            f"(transformers' MPT implements only {option}={supported!r})")
    for option, supported in SUPPORTED_OPTIONS.items():
        if getattr(hf, option, supported) != supported:
            raise UserError(f"MPT {option}={getattr(hf, option)!r} is not supported "
                            f"(transformers' MPT implements only {option}={supported!r})")
    return MptDecoderConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.d_model,
        num_layers=hf.n_layers,
        num_heads=hf.n_heads,
        intermediate_size=4 * hf.d_model,
        norm_eps=hf.layer_norm_epsilon,
        max_position_embeddings=hf.max_seq_len,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        hidden_act="gelu",
        clip_qkv=get("clip_qkv") or None,  # transformers tests `if clip_qkv`: 0 means off
        softmax_scale=get("softmax_scale"),
        alibi_bias_max=float(get("alibi_bias_max", 8)),
    )


def mpt_alibi_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> torch.Tensor:
    """MPT's ALiBi slopes (heads,) float32: 1 / 2^(alibi_bias_max * i / n) for i = 1..n, n the next power
    of two; for other head counts the odd-indexed slopes first, then the even ones, cut to num_heads."""
    pow2 = 2 ** math.ceil(math.log2(num_heads))
    base = torch.arange(1, pow2 + 1, dtype=torch.int64).float() * (alibi_bias_max / pow2)
    slopes = 1.0 / torch.pow(2, base)
    if pow2 != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


class MptAttention(nn.Module):
    """Multi-head self-attention with an ALiBi bias (carried by the context's mask), over the KV cache."""

    def __init__(self, config: MptDecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.clip_qkv = config.clip_qkv
        self.scale = config.softmax_scale if config.softmax_scale is not None else 1 / math.sqrt(config.head_dim)
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        qkv = self.Wqkv(x)  # (B, T, 3 * hidden): all q, then all k, then all v
        if self.clip_qkv is not None:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = (split_heads(part, self.num_heads, self.head_dim) for part in qkv.chunk(3, dim=2))  # (B, nh, T, hd)
        return self.out_proj(cached_attention(q, k, v, self.layer, ctx, scale=self.scale))


class MptBlock(nn.Module):
    """Pre-norm block: x + attn(norm_1(x)), then x + ffn(norm_2(x)); LayerNorms have no bias."""

    def __init__(self, config: MptDecoderConfig, layer: int) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)
        self.attn = MptAttention(config, layer)
        self.norm_2 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)
        self.ffn = DenseMLP(config.hidden_size, config.intermediate_size, config.hidden_act, False, ("up_proj", "down_proj"))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.attn(self.norm_1(x), ctx) + ctx.kept(x)
        return self.ffn(self.norm_2(x)) + x


class MptModel(nn.Module):
    """Embeddings, blocks and final norm (HF's `transformer.` prefix)."""

    def __init__(self, config: MptDecoderConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(MptBlock(config, i) for i in range(config.num_layers))
        self.norm_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)


class MptForCausalLM(CausalLM):
    """MPT decoder with a language-model head and ALiBi (modelzoo/models/base.py)."""

    config_from_hf = staticmethod(config_from_hf)
    embedding_name, layers_name = "transformer.wte", "transformer.blocks"

    def __init__(self, config: MptDecoderConfig) -> None:
        super().__init__(config)
        self.transformer = MptModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("alibi_slopes", torch.empty(0), persistent=False)

    def build_buffers(self, device: torch.device) -> None:
        self.alibi_slopes = mpt_alibi_slopes(self.config.num_heads, self.config.alibi_bias_max).to(device)

    def prepare(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor | None,
                last: torch.Tensor | None, length: int | None = None,
                ) -> tuple[torch.Tensor, list[ForwardContext], tuple[torch.Tensor, ...]]:
        """The ALiBi bias rides on the context's mask, in the states' dtype."""
        x = self.transformer.wte(tokens)  # (B, T, hidden)
        ctx = ForwardContext.build(cache, slots, positions, length=length)
        ctx.add_position_bias(alibi_bias(self.alibi_slopes, ctx.length), x.dtype)
        return x, [ctx] * self.config.num_layers, ()

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer.norm_f(x)
