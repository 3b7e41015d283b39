"""Drafters for speculative decoding: cheap guesses of each row's next K tokens.

The engine feeds the guesses to the model in one forward and keeps those the model agrees with,
so the output is the greedy output whatever the drafts; a good drafter only makes it faster.

- PromptLookupDrafter: finds the row's latest earlier occurrence of its last n tokens (n from
  max_ngram down to 1) in its own prompt and output, and proposes what followed it. Free, and
  strong on outputs that copy from the prompt (code edits, extraction, summaries).
- DraftModelDrafter: a small model of the same vocabulary decodes K tokens greedily over its own
  KV cache.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from modelzoo.models.kv_cache import KVCache
from modelzoo.generation.ngrams import earlier_occurrences


class Drafter(Protocol):
    """What the engine needs of a drafter."""

    num_tokens: int

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, last: torch.Tensor) -> None:
        """Sees the prompts of newly admitted rows: tokens, positions (B, T) into `slots` (B,)."""

    def propose(self, sequences: torch.Tensor, lengths: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Drafts (S, K) for every slot from its tokens `sequences` (S, L), valid up to `lengths` (S,)."""


class PromptLookupDrafter:
    """Drafts the continuation of the latest earlier match of the row's last n-gram."""

    def __init__(self, num_tokens: int, max_ngram: int) -> None:
        self.num_tokens = num_tokens
        self.max_ngram = max_ngram

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, last: torch.Tensor) -> None:
        """Nothing to do: drafts come from the engine's token rows."""

    def propose(self, sequences: torch.Tensor, lengths: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        slots, width = sequences.shape
        device = sequences.device
        starts = torch.arange(width, device=device)
        # Where the continuation begins for each row: after the best match found so far, -1 = none.
        begin = torch.full((slots,), -1, dtype=torch.long, device=device)
        for n in range(min(self.max_ngram, width - 1), 0, -1):
            found = earlier_occurrences(sequences, lengths, n)  # (S, width - n): an earlier copy with a successor
            latest = torch.where(found, starts[None, : found.shape[1]], -1).max(dim=1).values  # (S,)
            begin = torch.where((begin < 0) & (latest >= 0), latest + n, begin)
        # A continuation that runs past the row's end wraps around to its own start (a repeating
        # pattern goes on repeating). No match: the row's last token, cheap to reject.
        last = (lengths - 1).clamp(min=0)[:, None]  # (S, 1)
        period = (lengths[:, None] - begin[:, None]).clamp(min=1)
        index = begin[:, None] + torch.arange(self.num_tokens, device=device) % period  # (S, K)
        index = torch.where(begin[:, None] >= 0, index, last)
        return sequences.gather(1, index)


class DraftModelDrafter:
    """A smaller model that drafts K tokens greedily, keeping its own KV cache in step with the rows.

    After a verification the draft cache is valid up to the row's second-to-last token at worst
    (when every draft was accepted, the last draft was never fed): each proposal starts by feeding
    the row's last two tokens, which refreshes that position when needed and is harmless otherwise.
    """

    def __init__(self, model: nn.Module, num_tokens: int, num_slots: int, max_seq_len: int, vocab_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        config = model.config
        self.model = model
        self.num_tokens = num_tokens
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size  # of the verifying model: drafts beyond it are replaced
        self.draft_vocab_size = config.vocab_size  # tokens beyond it are fed to the draft as 0
        self.cache = KVCache(config.num_layers, num_slots, config.num_kv_heads, max_seq_len, config.head_dim,
                             dtype, device)

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, last: torch.Tensor) -> None:
        self.model(self._embeddable(tokens), positions, self.cache, slots, last)

    def propose(self, sequences: torch.Tensor, lengths: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        device = sequences.device
        pair = torch.arange(2, device=device)
        positions = torch.where(active[:, None], (lengths - 2)[:, None] + pair, pair)  # (S, 2); lengths >= 2
        tokens = self._embeddable(sequences.gather(1, positions))
        draft = self._valid(self.model(tokens, positions, self.cache, None).argmax(-1))  # (S,)
        drafts = [draft]
        for i in range(1, self.num_tokens):
            position = torch.where(active, lengths - 1 + i, 0).clamp(max=self.max_seq_len - 1)[:, None]  # (S, 1)
            draft = self._valid(self.model(draft[:, None], position, self.cache, None).argmax(-1))
            drafts.append(draft)
        return torch.stack(drafts, dim=1)  # (S, K)

    def _embeddable(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens the draft model can embed (its vocabulary may be padded less than the model's)."""
        return torch.where(tokens < self.draft_vocab_size, tokens, 0)

    def _valid(self, tokens: torch.Tensor) -> torch.Tensor:
        """Draft ids the verifying model can embed (a larger draft vocabulary may propose others)."""
        return torch.where(tokens < self.vocab_size, tokens, 0)
