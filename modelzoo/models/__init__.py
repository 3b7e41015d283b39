"""Registry of decoder families, keyed by the Hugging Face `architectures` string.

Families are imported lazily, so an unused family costs nothing. A family that differs from
another only in config values is an alias: it points at the same class.
"""
from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from modelzoo.errors import UserError

# architectures string -> (module, class)
REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("modelzoo.models.llama", "LlamaForCausalLM"),
    "GPT2LMHeadModel": ("modelzoo.models.gpt2", "GPT2LMHeadModel"),
    "OPTForCausalLM": ("modelzoo.models.opt", "OPTForCausalLM"),
    "GPTBigCodeForCausalLM": ("modelzoo.models.gpt_bigcode", "GPTBigCodeForCausalLM"),
    "BTLMLMHeadModel": ("modelzoo.models.btlm", "BTLMLMHeadModel"),
    "BloomForCausalLM": ("modelzoo.models.bloom", "BloomForCausalLM"),
    "MptForCausalLM": ("modelzoo.models.mpt", "MptForCausalLM"),
    "FalconForCausalLM": ("modelzoo.models.falcon", "FalconForCausalLM"),
    "MistralForCausalLM": ("modelzoo.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("modelzoo.models.llama", "LlamaForCausalLM"),
    "GPTNeoXForCausalLM": ("modelzoo.models.gpt_neox", "GPTNeoXForCausalLM"),
    "GPTJForCausalLM": ("modelzoo.models.gptj", "GPTJForCausalLM"),
}


def supported_architectures() -> list[str]:
    """The `architectures` values a checkpoint may declare."""
    return sorted(REGISTRY)


def registered_class(architecture: str) -> type[nn.Module]:
    """The family class registered for an `architectures` string (imported now)."""
    module, cls = REGISTRY[architecture]
    return getattr(importlib.import_module(module), cls)


def model_class(hf_config: Any) -> type[nn.Module]:
    """The family class for a transformers config; one-line error listing what is supported."""
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in REGISTRY:
            return registered_class(name)
    shown = ", ".join(names) or f"none (model_type {getattr(hf_config, 'model_type', '?')!r})"
    raise UserError(f"unsupported architecture {shown}; supported: {', '.join(supported_architectures())}")
