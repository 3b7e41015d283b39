"""The family contract: what the loader, the engine, int8 quantization and tensor parallel read from
a decoder family, in one place, and the forward every family shares.

A family subclasses `CausalLM`, builds its modules in `__init__` under Hugging Face's names (so the
checkpoint's weights load by name), names three of them in class attributes, and overrides only the
hooks where it differs. Capabilities are class attributes (or properties where the config decides):

    config_from_hf     staticmethod: transformers config -> the family's frozen config, which has at
                       least num_layers, num_heads, num_kv_heads, head_dim, hidden_size, vocab_size,
                       max_position_embeddings and tie_word_embeddings
    packs_prompts      forward takes packed prompts: slots and positions (1, T), ForwardContext.packed
    position_limit     the size of a learned position table (positions must stay below it), None without one
    splits_over_ranks  modelzoo/models/tensor_parallel.py can split it (runconfig.tensor_parallel)
    embedding_name     dotted name of the token embedding; register it before any position table
                       (int8 quantizes the first embedding with vocab_size rows)
    layers_name        dotted name of the nn.ModuleList of decoder layers
    head_name          dotted name of the output projection, tied to the embedding when the config
                       says tie_word_embeddings (checkpoints then omit it)

Every linear layer is an nn.Linear (quantized for int8, re-laid out by the GEMM backends) or
declares `weight_is_in_out` (GPT-2's Conv1D: quantized, not re-laid out).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from modelzoo.models.kv_cache import KVCache
from modelzoo.models.layers import ForwardContext, attention_kernel, last_token_states


class CausalLM(nn.Module):
    """A decoder with a language-model head; `forward` returns the logits of chosen positions."""

    config_from_hf: Callable[[Any], Any]
    packs_prompts: bool = False
    position_limit: int | None = None
    splits_over_ranks: bool = False
    embedding_name: str
    layers_name: str
    head_name: str = "lm_head"
    adapter_bank: Any = None  # a modelzoo.models.lora.AdapterBank once LoRA adapters are attached per row

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.rotary: nn.Module | None = None  # a RotaryEmbedding for rotary families, built by build_buffers

    def tied_weights(self) -> dict[str, str]:
        """Weights that may be absent from a checkpoint because they share another's storage."""
        tied = self.config.tie_word_embeddings
        return {f"{self.head_name}.weight": f"{self.embedding_name}.weight"} if tied else {}

    def fused_weights(self) -> dict[str, list[str]]:
        """Our fused weight -> the Hugging Face weights concatenated (dim 0, in order) to make it."""
        return {}

    def build_buffers(self, device: torch.device) -> None:
        """Computes the non-persistent buffers (rotary tables, ALiBi slopes) once the weights are on `device`."""
        if self.rotary is not None:
            self.rotary.build_tables(device)

    def prepare(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor | None,
                last: torch.Tensor | None, length: int | None = None,
                ) -> tuple[torch.Tensor, Sequence[ForwardContext], tuple[torch.Tensor, ...]]:
        """The input states (B, T, hidden), each layer's attention context, and the arguments every
        layer takes before its context (the rotary tables); `last` and `length` as in forward. Default:
        token embedding, one shared context, rotary tables where the family has them."""
        ctx = ForwardContext.build(cache, slots, positions, length=length)
        x = self.get_submodule(self.embedding_name)(tokens)  # (B, T, hidden)
        extra = (self.rotary(positions, x.dtype),) if self.rotary is not None else ()
        return x, [ctx] * self.config.num_layers, extra

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The chosen positions' states (B, hidden) -> the head's input: the final norm."""
        raise NotImplementedError

    def layer_chains(self, x: torch.Tensor, contexts: Sequence[ForwardContext], extra: tuple[torch.Tensor, ...]
                     ) -> list[Callable[[torch.Tensor, ForwardContext], torch.Tensor] | None]:
        """Per layer, what runs it in place of its modules for this forward's input states x (B, T, hidden), its
        context and `extra` (as `prepare` returns them): a callable (x, ctx) -> x with the modules' bits that skips
        the Python between their kernels (modelzoo/models/llama.py's KernelChain), or None for the layer itself.
        Found once a forward, not layer by layer between the kernels. Default: none."""
        return [None] * len(contexts)

    def decode_attention(self, cache: KVCache, compiled: bool) -> str:
        """Which attention a decode step runs over `cache`, for the log and summary.json: `cpu_kernel` (the C++
        kernel), or SDPA, over grouped queries where query heads share kv heads; `compiled`: under torch.compile,
        which takes PyTorch's ops. Decided as the step decides it, on a one-token context of the first layer."""
        c = self.config
        if not compiled:
            token = torch.zeros((1, 1), dtype=torch.long, device=cache.keys[0].device)
            x, contexts, _ = self.prepare(token, token, cache, None, None, 1)
            q = torch.empty((1, c.num_heads, 1, c.head_dim), dtype=x.dtype, device=token.device)
            if attention_kernel(q, contexts[0]) is not None:
                return "cpu_kernel"
        return "sdpa_grouped_queries" if c.num_kv_heads < c.num_heads else "sdpa"

    def fuses_greedy_head(self) -> bool:
        """Whether forward(greedy=True) can pick each row's largest logit inside the head's GEMM, so that the logits
        are never written: a head that offers it (a packed bfloat16 or half_linear head, modelzoo/cpu/precision.py),
        and nothing after the head that would see its logits: no hook on the head or on the model (tensor parallel
        gathers the ranks' logits in one), no family forward of its own (BTLM scales the logits, which may round two
        of them equal)."""
        head = self.get_submodule(self.head_name)
        return (bool(getattr(head, "fuses_greedy", False)) and not head._forward_hooks and not head._forward_pre_hooks
                and not self._forward_hooks and type(self).forward is CausalLM.forward)

    def positions_read(self, tokens: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor | None:
        """The positions (B, N) into T whose last-layer outputs the head reads (`last`, or each row's final one), where
        forward computes that layer's outputs at those alone: several positions a row (a prompt). None: every
        position's (one a row: a decode step)."""
        batch, width = tokens.shape[:2]
        if width == 1:
            return None
        if last is None:
            return torch.full((batch, 1), width - 1, dtype=torch.long, device=tokens.device)
        return last[:, None] if last.dim() == 1 else last

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                slots: torch.Tensor | None, last: torch.Tensor | None = None, length: int | None = None,
                greedy: bool = False) -> torch.Tensor:
        """tokens, positions: (B, T); slots: (B,) cache rows, None for all, or (1, T) for packed
        prompts; last: (B,) index into T, or (B, N) for N positions per row; length: the cache
        positions attended over (ForwardContext.build), None to derive it from the positions.

        Returns the logits (B, vocab) of position `last` of each row (default: the final one), or
        (B, N, vocab); with `greedy` (where fuses_greedy_head()), their argmax (B,) or (B, N) long instead: the
        first largest logit's index, the logits never written.
        """
        read = self.positions_read(tokens, last)  # (B, N) or None
        if self.adapter_bank is not None:  # each row's (or packed token's) LoRA adapter, its cache slot's
            self.adapter_bank.select(cache.slot_adapter, slots, tokens.shape, read)
        x, contexts, extra = self.prepare(tokens, positions, cache, slots, last, length)
        if read is not None:  # the last layer's outputs only where the head reads them; every position's keys
            contexts = [*contexts[:-1], contexts[-1].reading(read)]
        layers = self.get_submodule(self.layers_name)
        for layer, ctx, chain in zip(layers, contexts, self.layer_chains(x, contexts, extra)):
            x = layer(x, *extra, ctx) if chain is None else chain(x, ctx)
        if read is not None:  # x: (B, N, hidden), at `last`
            x = x if last is not None and last.dim() == 2 else x[:, 0]
        else:
            x = last_token_states(x, last)
        x = self.finish(x)  # (B, hidden) or (B, N, hidden)
        head = self.get_submodule(self.head_name)
        return head.greedy(x) if greedy else head(x)  # (B,) or (B, vocab)
