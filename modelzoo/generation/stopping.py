"""Vectorised stop rules: stop sequences, max_tokens, max_seq_len; checked on tensors, per slot."""
from __future__ import annotations

from typing import Sequence

import torch

# Stop reason codes (0 = keep going); names are what the predictions files and logs show.
CONTINUE, STOP_SEQUENCE, MAX_TOKENS, MAX_SEQ_LEN = 0, 1, 2, 3
REASON_NAMES = {STOP_SEQUENCE: "stop_sequence", MAX_TOKENS: "max_tokens", MAX_SEQ_LEN: "max_seq_len"}
# The reasons of rows nothing is generated for: passed through as they are, or (SCORED) scored.
DUMMY, NO_START_TOKEN, EMPTY_PROMPT, SCORED = "dummy", "no_start_token", "empty_prompt", "scored"


class StopChecker:
    """Decides, for every slot at once, whether its sequence ends after the token just generated.

    Keeps the last K generated tokens of each slot (K = longest stop sequence), so a stop
    sequence matches only within generated tokens, never across the prompt boundary. Every stop
    sequence any row may use is given to the constructor; `reset` sets which of them end each
    slot's row, and its max_tokens.
    """

    def __init__(self, stop_sequences: Sequence[Sequence[int]], max_seq_len: int, num_slots: int,
                 device: torch.device) -> None:
        self.max_seq_len = max_seq_len
        table = [list(s) for s in dict.fromkeys(map(tuple, stop_sequences))]
        self.row_of = {tuple(seq): i for i, seq in enumerate(table)}
        width = max((len(s) for s in table), default=0)
        # Right-aligned stop sequences, left-padded with -2 and a mask of the real entries: (S, K).
        self.sequences = torch.full((len(table), width), -2, dtype=torch.long, device=device)
        self.valid = torch.zeros((len(table), width), dtype=torch.bool, device=device)
        for i, seq in enumerate(table):
            self.sequences[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            self.valid[i, width - len(seq):] = True
        # Which sequences stop each slot, and each slot's max_tokens: (num_slots, S), (num_slots,).
        self.enabled = torch.zeros((num_slots, len(table)), dtype=torch.bool, device=device)
        self.limit = torch.full((num_slots,), max_seq_len, dtype=torch.long, device=device)
        # Last K generated tokens per slot, -1 where nothing was generated yet: (num_slots, K).
        self.history = torch.full((num_slots, width), -1, dtype=torch.long, device=device)

    def reset(self, slots: torch.Tensor, max_tokens: Sequence[int | None],
              stop_sequences: Sequence[Sequence[Sequence[int]]]) -> None:
        """Forgets the history of `slots` (B,) when they take new sequences, and sets each one's max_tokens (None:
        until max_seq_len) and stop sequences (each given to the constructor)."""
        self.history[slots] = -1
        limits = [own or self.max_seq_len for own in max_tokens]
        self.limit[slots] = torch.tensor(limits, dtype=torch.long, device=self.limit.device)
        enabled = torch.zeros((len(slots), self.enabled.shape[1]), dtype=torch.bool)
        for row, sequences in enumerate(stop_sequences):
            for seq in sequences:
                if tuple(seq) not in self.row_of:
                    raise ValueError(f"stop sequence {list(seq)} was not given to the StopChecker")
                enabled[row, self.row_of[tuple(seq)]] = True
        self.enabled[slots] = enabled.to(self.enabled.device)

    def check(self, slots: torch.Tensor | None, tokens: torch.Tensor, num_generated: torch.Tensor,
              seq_lengths: torch.Tensor, taken: torch.Tensor | None = None) -> torch.Tensor:
        """Records `tokens` (B,) and returns a reason code per slot (B,), 0 where the slot goes on.

        num_generated: (B,) tokens generated so far including `tokens`; seq_lengths: (B,) prompt +
        generated; taken: (B,) bool, the rows that really took a token (None = all); the others
        keep their history and get 0. Priority when several rules hold: stop sequence, max_tokens,
        max_seq_len.
        """
        # Elementwise selections only (no boolean indexing): no host sync, the same shapes every call.
        reason = torch.zeros_like(tokens)
        rows = slice(None) if slots is None else slots
        if self.history.shape[1]:
            history = torch.cat((self.history[rows][:, 1:], tokens[:, None]), dim=1)  # (B, K)
            if taken is not None:
                history = torch.where(taken[:, None], history, self.history[rows])
            self.history[rows] = history  # in place: the history keeps its storage
            # (B, 1, K) vs (1, S, K): a sequence matches when every real entry equals the history.
            equal = (history[:, None, :] == self.sequences[None]) | ~self.valid[None]
            reason = torch.where((equal.all(-1) & self.enabled[rows]).any(-1), STOP_SEQUENCE, reason)
        reason = torch.where((reason == CONTINUE) & (num_generated >= self.limit[rows]), MAX_TOKENS, reason)
        reason = torch.where((reason == CONTINUE) & (seq_lengths >= self.max_seq_len), MAX_SEQ_LEN, reason)
        return reason if taken is None else reason * taken
