"""Greedy generation over a fixed set of cache slots, with in-flight refill.

`batch_size` slots decode together, one forward per step for all of them. When a sequence stops,
its slot takes the next pending request at once (continuous batching), instead of idling until
every row of its batch is done. Newly admitted prompts are prefilled together, grouped by length
so that padding stays small. The decode step always runs every slot (idle ones on a throwaway
row at position 0): a fixed batch shape costs about the same as a smaller one at these sizes, and
it is what lets the CPU decode GEMMs use weights prepacked for that shape.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from torch import nn

from modelzoo.generation.kv_cache import KVCache
from modelzoo.generation.stopping import CONTINUE, REASON_NAMES, StopChecker


@dataclass
class Request:
    """One prompt to complete. `index` is the caller's key (the sample index); prompt: (p,), p >= 1."""

    index: int
    prompt: np.ndarray


@dataclass
class Completion:
    """The generated tokens of one request (the stop sequence included) and why it stopped."""

    index: int
    tokens: np.ndarray
    reason: str


class GenerationEngine:
    """Runs requests through `model` with `num_slots` sequences in flight."""

    def __init__(self, model: nn.Module, num_slots: int, max_seq_len: int, stop_sequences: list[list[int]],
                 max_tokens: int | None, device: torch.device, dtype: torch.dtype,
                 prefill_token_budget: int = 8192) -> None:
        config = model.config
        self.model = model
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.device = device
        self.prefill_token_budget = prefill_token_budget
        self.cache = KVCache(config.num_layers, num_slots, config.num_kv_heads, max_seq_len, config.head_dim,
                             dtype, device)
        self.stops = StopChecker(stop_sequences, max_tokens, max_seq_len, num_slots, device)
        # Per-slot state, on the device: tokens in the row (prompt + generated), generated count,
        # the token to feed next, and the generated tokens themselves.
        self.seq_len = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.num_generated = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.last_token = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.generated = torch.zeros((num_slots, max_seq_len), dtype=torch.long, device=device)
        self.active = torch.zeros(num_slots, dtype=torch.bool, device=device)
        self.owner: list[int | None] = [None] * num_slots  # request index held by each slot
        self.generated_tokens = 0  # over the engine's life, for throughput reports

    @torch.inference_mode()
    def generate(self, requests: Iterable[Request],
                 should_stop: Callable[[], bool] = lambda: False) -> Iterator[Completion]:
        """Yields a Completion for every request, in the order they finish.

        `should_stop` is polled before every step: once true, rows in flight are dropped and the
        generator ends (a preempted job keeps only what it finished).
        """
        pending = iter(requests)
        free = deque(range(self.num_slots))
        self.owner = [None] * self.num_slots
        self.active.zero_()
        exhausted = False
        while not should_stop():
            admitted: list[tuple[int, Request]] = []
            while free and not exhausted:
                request = next(pending, None)
                if request is None:
                    exhausted = True
                else:
                    admitted.append((free.popleft(), request))
            if admitted:
                yield from self._release(self._prefill(admitted), free)
            if all(owner is None for owner in self.owner):
                if exhausted:
                    return
                continue
            yield from self._release(self._decode_step(), free)

    def _prefill(self, admitted: list[tuple[int, Request]]) -> list[tuple[int, int]]:
        """Runs the prompts of newly admitted requests; returns (slot, reason) of those already done."""
        for slot, request in admitted:
            if not 1 <= len(request.prompt) < self.max_seq_len:
                raise ValueError(f"sample {request.index}: prompt length {len(request.prompt)} leaves no room "
                                 f"in max_seq_len {self.max_seq_len}")
            self.owner[slot] = request.index
        self.active[[slot for slot, _ in admitted]] = True
        finished = []
        for group in self._length_groups(admitted):
            lengths = [len(r.prompt) for _, r in group]
            width = max(lengths)
            tokens = np.zeros((len(group), width), dtype=np.int64)  # right-padded; padding is never attended
            for row, (_, request) in enumerate(group):
                tokens[row, : len(request.prompt)] = request.prompt
            slots = torch.tensor([slot for slot, _ in group], device=self.device)
            positions = torch.arange(width, device=self.device).expand(len(group), width)  # (B, T)
            last = torch.tensor(lengths, device=self.device) - 1
            logits = self.model(torch.from_numpy(tokens).to(self.device), positions, self.cache, slots, last)
            first = logits.argmax(-1)  # (B,)
            self.seq_len[slots] = last + 2
            self.num_generated[slots] = 1
            self.last_token[slots] = first
            self.generated[slots, 0] = first
            self.stops.reset(slots)
            reason = self.stops.check(slots, first, self.num_generated[slots], self.seq_len[slots])
            finished += self._done(slots, reason)
        self.generated_tokens += len(admitted)
        return finished

    def _length_groups(self, admitted: list[tuple[int, Request]]) -> list[list[tuple[int, Request]]]:
        """Splits admitted requests, sorted by prompt length, into groups of at most the token budget."""
        ordered = sorted(admitted, key=lambda item: len(item[1].prompt))
        groups: list[list[tuple[int, Request]]] = [[]]
        for item in ordered:
            # Sorted ascending, so the newcomer is the longest: the padded group is (n + 1) x its length.
            if groups[-1] and (len(groups[-1]) + 1) * len(item[1].prompt) > self.prefill_token_budget:
                groups.append([])
            groups[-1].append(item)
        return groups

    def _decode_step(self) -> list[tuple[int, int]]:
        """One token for every active slot; returns (slot, reason) of those that stopped."""
        active = self.active
        tokens = self.last_token[:, None]  # (S, 1)
        positions = torch.where(active, self.seq_len - 1, 0)[:, None]  # (S, 1): where the fed token sits
        logits = self.model(tokens, positions, self.cache, None)
        next_token = torch.where(active, logits.argmax(-1), self.last_token)  # (S,)
        num_generated = self.num_generated + active
        seq_len = self.seq_len + active
        rows = torch.arange(self.num_slots, device=self.device)
        column = (num_generated - 1).clamp(min=0)
        self.generated[rows, column] = torch.where(active, next_token, self.generated[rows, column])
        self.num_generated, self.seq_len, self.last_token = num_generated, seq_len, next_token
        self.generated_tokens += int(active.sum())
        reason = self.stops.check(None, next_token, num_generated, seq_len) * active
        return self._done(rows, reason)

    @staticmethod
    def _done(slots: torch.Tensor, reason: torch.Tensor) -> list[tuple[int, int]]:
        """(slot, reason) pairs where reason is not CONTINUE; one device sync."""
        stopped = (reason != CONTINUE).nonzero().flatten()
        if stopped.numel() == 0:
            return []
        return list(zip(slots[stopped].tolist(), reason[stopped].tolist()))

    def _release(self, finished: list[tuple[int, int]], free: deque) -> Iterator[Completion]:
        """Turns stopped slots into Completions and hands the slots back."""
        for slot, reason in finished:
            count = int(self.num_generated[slot])
            tokens = self.generated[slot, :count].cpu().numpy().astype(np.int32)
            index = self.owner[slot]
            self.owner[slot] = None
            self.active[slot] = False
            free.append(slot)
            yield Completion(index=index, tokens=tokens, reason=REASON_NAMES[reason])
