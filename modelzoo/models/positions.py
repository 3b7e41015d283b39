"""Where a token sits, as the families encode it: ALiBi's per-head linear biases and rotary embeddings (RoPE, its
scaled variants, and both rotation layouts)."""
from __future__ import annotations

import math

import torch
from torch import nn

from modelzoo.models.config import RopeConfig


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi head slopes of the paper, BLOOM and Falcon, (num_heads,) float32: geometric for the
    nearest power of two, the missing heads from every other slope of the next power of two.
    Computed as transformers does (float32 torch.pow), so they are bit-identical to its slopes."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = torch.full((), 2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != num_heads:
        extra = torch.full((), 2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        remaining = min(closest, num_heads - closest)
        slopes = torch.cat([slopes, torch.pow(extra, torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32))])
    return slopes


def alibi_bias(slopes: torch.Tensor, length: int) -> torch.Tensor:
    """slope * j for each head and key position j < length, (1, heads, 1, length) float32: softmax is
    shift-invariant per query, so this equals the paper's slope * (j - p) for a query at position p."""
    keys = torch.arange(length, device=slopes.device, dtype=torch.float32)
    return (slopes[:, None] * keys[None, :])[None, :, None, :]


def rope_inverse_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Inverse frequencies (dim // 2,) in float32, with the linear or Llama 3 scaling applied."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos / sin tables for every position up to max_len, gathered per token at forward time.

    `dim` is the rotated part of each head (rotary_pct / rotary_dim may leave the rest unrotated).
    `interleaved` selects GPT-J's layout (pairs (x0, x1), (x2, x3)...) over the GPT-NeoX / Llama
    layout (the two halves of the rotated part).
    """

    def __init__(self, rope: RopeConfig, dim: int, max_len: int, interleaved: bool = False) -> None:
        super().__init__()
        self.rope, self.dim, self.max_len, self.interleaved = rope, dim, max_len, interleaved
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build_tables(self, device: torch.device) -> None:
        """(Re)computes the tables in float32; called once the model sits on its device."""
        positions = torch.arange(self.max_len, dtype=torch.float32, device=device)
        freqs = positions[:, None] * rope_inverse_frequencies(self.rope, self.dim).to(device)[None, :]
        if self.interleaved:
            angles = freqs.repeat_interleave(2, dim=-1)  # (max_len, dim): f0 f0 f1 f1 ...
        else:
            angles = torch.cat((freqs, freqs), dim=-1)  # (max_len, dim): f0 f1 ... f0 f1 ...
        self.cos, self.sin = angles.cos(), angles.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` (B, T): (B, 1, T, dim) each, ready to broadcast over heads."""
        return self.cos[positions][:, None].to(dtype), self.sin[positions][:, None].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension (the GPT-NeoX / Llama layout)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): GPT-J's interleaved layout."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotates the first cos.shape[-1] features of x (B, heads, T, hd) by cos / sin (B, 1, T, rot)."""
    rot = cos.shape[-1]
    rotated, rest = (x, None) if rot == x.shape[-1] else (x[..., :rot], x[..., rot:])
    rotated = rotated * cos + (rotate_every_two(rotated) if interleaved else rotate_half(rotated)) * sin
    return rotated if rest is None else torch.cat((rotated, rest), dim=-1)
