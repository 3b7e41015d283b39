"""The BTLM family: BTLMLMHeadModel (Cerebras BTLM-3B-8K and its fine-tunes; muP Cerebras-GPT checkpoints).

transformers has no class for it (the hub checkpoints ship remote code, which we never execute); this
is an implementation of the published modeling_btlm.py math. GPT-2's layout and weight names
(`transformer.h.N.attn.c_attn`, Conv1D weights stored (in, out)) plus:
  * ALiBi (position_embedding_type "alibi"; no `wpe`): scores += -slope_h / scale * |key - query|, with
    the slopes read from the checkpoint (`transformer.relative_pe.slopes`, (heads, 1)); `alibi_scaling`
    {"type": "linear", "factor": f} divides them by f, {"type": "linear", "train_seq_len": n} by
    max(1, sequence length / n) (the length of each row's sequence so far);
  * SwiGLU (activation_function "swiglu"): c_proj(c_fc(x) * silu(c_fc2(x)));
  * muP multipliers: embeddings (token + position) * mup_embeddings_scale, attention scores / d instead
    of / sqrt(d) with mup_scale_qk_dot_by_d, logits * mup_output_alpha * mup_width_scale.
Checkpoints from before the muP fields were renamed (embeddings_scale, output_logits_scale,
scale_qk_dot_by_d) are read too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modelzoo.errors import UserError
from modelzoo.models.kv_cache import KVCache
from modelzoo.models.gpt2 import Conv1D, GPT2Attention, GPT2DecoderConfig, GPT2LMHeadModel, GPT2Model
from modelzoo.models.layers import ForwardContext, activation


@dataclass(frozen=True)
class BTLMDecoderConfig(GPT2DecoderConfig):
    """GPT2DecoderConfig plus BTLM's position scheme and muP multipliers."""

    alibi: bool = True  # position_embedding_type "alibi"; False: learned `wpe` as GPT-2
    alibi_factor: float = 1.0  # fixed linear ALiBi scaling (alibi_scaling.factor)
    alibi_train_seq_len: int = 0  # dynamic linear ALiBi scaling past this length; 0 = off
    embeddings_scale: float = 1.0
    output_logits_scale: float = 1.0  # mup_output_alpha * mup_width_scale
    attn_scale_power: float = 0.5  # scores / head_dim ** power; 1.0 with mup_scale_qk_dot_by_d


def first_field(hf: Any, names: tuple[str, ...], default: Any) -> Any:
    """The value of the first of `names` the raw config has (BTLM renamed its muP fields once)."""
    for name in names:
        value = getattr(hf, name, None)
        if value is not None:
            return value
    return default


def config_from_hf(hf: Any) -> BTLMDecoderConfig:
    """BTLMDecoderConfig from the raw fields of a BTLM config.json (defaults: the remote BTLMConfig's)."""
    if getattr(hf, "add_cross_attention", False):
        raise UserError("BTLM with add_cross_attention=true is not supported")
    if getattr(hf, "reorder_and_upcast_attn", False):
        raise UserError("BTLM with reorder_and_upcast_attn=true is not supported")
    position_type = getattr(hf, "position_embedding_type", "learned")
    if position_type not in ("alibi", "learned"):
        raise UserError(f"BTLM position_embedding_type {position_type!r} is not supported; supported: alibi, learned")
    scaling = getattr(hf, "alibi_scaling", None) or {}
    if scaling and (scaling.get("type") != "linear" or not (scaling.get("factor") or scaling.get("train_seq_len"))):
        raise UserError(f"BTLM alibi_scaling {scaling} is not supported; supported: type 'linear' with "
                        f"'factor' or 'train_seq_len'")
    if getattr(hf, "mup_output_alpha", None) is not None or getattr(hf, "mup_width_scale", None) is not None:
        output_scale = float(getattr(hf, "mup_output_alpha", 1.0)) * float(getattr(hf, "mup_width_scale", 1.0))
    else:
        output_scale = float(getattr(hf, "output_logits_scale", None) or 1.0)
    n_embd = getattr(hf, "n_embd", 768)
    return BTLMDecoderConfig(
        vocab_size=getattr(hf, "vocab_size", 50257),
        hidden_size=n_embd,
        num_layers=getattr(hf, "n_layer", 12),
        num_heads=getattr(hf, "n_head", 12),
        intermediate_size=getattr(hf, "n_inner", None) or 4 * n_embd,
        norm_eps=getattr(hf, "layer_norm_epsilon", 1e-5),
        max_position_embeddings=getattr(hf, "n_positions", 1024),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        attention_bias=True,
        mlp_bias=True,
        hidden_act=getattr(hf, "activation_function", "gelu_new"),
        scale_attn_weights=bool(getattr(hf, "scale_attn_weights", True)),
        scale_attn_by_inverse_layer_idx=bool(getattr(hf, "scale_attn_by_inverse_layer_idx", False)),
        alibi=position_type == "alibi",
        alibi_factor=float(scaling.get("factor") or 1.0),
        alibi_train_seq_len=0 if scaling.get("factor") else int(scaling.get("train_seq_len") or 0),
        embeddings_scale=float(first_field(hf, ("mup_embeddings_scale", "embeddings_scale"), 1.0)),
        output_logits_scale=output_scale,
        attn_scale_power=1.0 if first_field(hf, ("mup_scale_qk_dot_by_d", "scale_qk_dot_by_d"), False) else 0.5,
    )


class AlibiSlopes(nn.Module):
    """Holds the checkpoint's ALiBi slopes (`relative_pe.slopes`, (heads, 1)) and builds the score bias."""

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.slopes = nn.Parameter(torch.empty(num_heads, 1), requires_grad=False)

    def context(self, cache: KVCache, slots: torch.Tensor | None, positions: torch.Tensor,
                last: torch.Tensor | None, config: BTLMDecoderConfig, dtype: torch.dtype,
                length: int | None = None) -> ForwardContext:
        """ForwardContext whose mask is -slope_h / scale * |key - query| (B, heads, T, length), -inf where hidden."""
        ctx = ForwardContext.build(cache, slots, positions, length=length)
        keys = torch.arange(ctx.length, device=positions.device)
        distance = (keys[None, None, :] - positions[:, :, None]).abs().to(torch.float32)  # (B, T, length)
        slopes = self.slopes.to(torch.float32)[:, 0]  # (heads,)
        if config.alibi_train_seq_len:
            # Dynamic scaling: each row's sequence length so far (its last real position + 1).
            if last is not None and last.dim() == 2:
                raise UserError("speculative decoding is not supported with BTLM's dynamic ALiBi scaling "
                                "(alibi_train_seq_len): its scale depends on each query's own sequence length")
            final = positions[:, -1] if last is None else positions.gather(1, last[:, None])[:, 0]
            length = (final + 1).to(torch.float32)  # (B,)
            scale = torch.where(length > config.alibi_train_seq_len, length / config.alibi_train_seq_len, 1.0)
            per_head = slopes[None, :] / -scale[:, None]  # (B, heads)
        else:
            per_head = (slopes / -config.alibi_factor)[None, :].expand(positions.shape[0], -1)
        bias = per_head[:, :, None, None] * distance[:, None]  # (B, heads, T, length)
        return ctx.add_position_bias(bias, dtype)


class BTLMAttention(GPT2Attention):
    """GPT-2 self-attention with muP's 1 / d score scaling; ALiBi arrives through the context's mask."""

    @staticmethod
    def score_scale(config: BTLMDecoderConfig) -> float:
        """The factor of the scores with scale_attn_weights: 1 / head_dim ** attn_scale_power."""
        return 1.0 / config.head_dim ** config.attn_scale_power


class BTLMMLP(nn.Module):
    """SwiGLU: c_proj(c_fc(x) * silu(c_fc2(x))); otherwise GPT-2's c_proj(act(c_fc(x)))."""

    def __init__(self, config: BTLMDecoderConfig) -> None:
        super().__init__()
        self.swiglu = config.hidden_act == "swiglu"
        self.c_fc = Conv1D(config.hidden_size, config.intermediate_size)
        self.c_fc2 = Conv1D(config.hidden_size, config.intermediate_size) if self.swiglu else None
        self.c_proj = Conv1D(config.intermediate_size, config.hidden_size)
        self.act = F.silu if self.swiglu else activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.c_fc2 is not None:
            return self.c_proj(self.c_fc(x) * self.act(self.c_fc2(x)))
        return self.c_proj(self.act(self.c_fc(x)))


class BTLMModel(GPT2Model):
    """Embeddings (wpe only without ALiBi), ALiBi slopes, blocks and final norm (HF's `transformer.` prefix)."""

    def __init__(self, config: BTLMDecoderConfig, attention: type[nn.Module], mlp: type[nn.Module]) -> None:
        super().__init__(config, attention, mlp)
        if config.alibi:
            self.wpe = None  # positions enter through the slopes instead
        self.relative_pe = AlibiSlopes(config.num_heads) if config.alibi else None


class BTLMLMHeadModel(GPT2LMHeadModel):
    """BTLM with a language-model head; `forward` returns last-position logits (muP-scaled)."""

    config_from_hf = staticmethod(config_from_hf)
    transformer_type = BTLMModel
    attention_type = BTLMAttention
    mlp_type = BTLMMLP

    @property
    def packs_prompts(self) -> bool:
        """Packed prompts (ForwardContext.packed) with learned positions; not with ALiBi's bias."""
        return self.transformer.relative_pe is None

    @property
    def position_limit(self) -> int | None:
        """The learned position table's size; none with ALiBi."""
        return super().position_limit if self.transformer.relative_pe is None else None

    def build_buffers(self, device: torch.device) -> None:
        """Nothing to compute: the ALiBi slopes are checkpoint weights, the bias is built per forward."""

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor | None,
              last: torch.Tensor | None, length: int | None = None) -> tuple[torch.Tensor, ForwardContext]:
        """GPT-2's input states (B, T, hidden) and context, times the muP embeddings scale.

        With ALiBi the states are the token embeddings alone and the context's mask carries the slopes' bias.
        """
        relative_pe = self.transformer.relative_pe
        if relative_pe is None:
            x, ctx = super().embed(tokens, positions, cache, slots, last, length)
        else:
            x = self.transformer.wte(tokens)  # (B, T, hidden)
            ctx = relative_pe.context(cache, slots, positions, last, self.config, x.dtype, length)
        # The remote code multiplies by a 0-d tensor of the model dtype: the scale is rounded to it first.
        return x * torch.tensor(self.config.embeddings_scale, dtype=x.dtype, device=x.device), ctx

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                slots: torch.Tensor | None, last: torch.Tensor | None = None, length: int | None = None) -> torch.Tensor:
        """tokens, positions: (B, T); slots: (B,) cache rows, None for all, or (1, T) for packed prompts; last:
        (B,) index into T, or (B, N); length as in CausalLM.forward.

        Returns the logits (B, vocab) of position `last` of each row (default: the final one), muP-scaled.
        """
        logits = super().forward(tokens, positions, cache, slots, last, length)  # (B, vocab)
        return logits * torch.tensor(self.config.output_logits_scale, dtype=logits.dtype, device=logits.device)
