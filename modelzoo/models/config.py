"""The typed model config every family builds from a Hugging Face `config.json`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modelzoo.errors import UserError


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters (HF `rope_parameters` / `rope_theta` + `rope_scaling`)."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default", "linear" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    SUPPORTED = ("default", "linear", "llama3")

    @classmethod
    def from_hf(cls, hf_config: Any) -> "RopeConfig":
        """Reads both spellings: transformers >= 5 `rope_parameters`, older `rope_theta` + `rope_scaling`."""
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        if not params:
            params = dict(getattr(hf_config, "rope_scaling", None) or {})
            params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in cls.SUPPORTED:
            raise UserError(f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(cls.SUPPORTED)}")
        return cls(
            theta=float(params.get("rope_theta", 10000.0)),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class DecoderConfig:
    """What the shared decoder blocks need to know; derived fields are filled in `__post_init__`."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    num_kv_heads: int = 0  # 0 = num_heads (plain multi-head attention)
    head_dim: int = 0  # 0 = hidden_size // num_heads
    norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rope: RopeConfig = field(default_factory=RopeConfig)

    def __post_init__(self) -> None:
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache elements per token over all layers (multiply by the element size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim
