"""Teacher-forced scoring: the log-probability of a given continuation after a given context, token by token.

No token is chosen: the model reads context + continuation and, at each continuation position, the engine
keeps the log-probability of the token that is there (float32 log-softmax of the same logits greedy
decoding takes its argmax of) and whether it is that argmax. Requests that share a context (the choices of one
multiple-choice question) prefill it once: its keys and values are copied into one cache slot per
continuation, then every continuation of the round runs in one padded forward, all its positions' logits
kept. A round takes as many continuations as there are cache slots and as many tokens as the budget allows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from modelzoo.models.kv_cache import KVCache


@dataclass
class ScoreRequest:
    """Score `continuation` (k,) after `context` (c,), c, k >= 1; `index` is the caller's key; `adapter` the LoRA
    adapter of the model's adapter bank to score with (-1: none)."""

    index: int
    context: np.ndarray
    continuation: np.ndarray
    adapter: int = -1


@dataclass
class Score:
    """Each continuation token's log-probability (k,) float32 and whether it was the argmax (k,) bool; with a
    scorer's top_k T, the T likeliest tokens at each position (k, T) int32 and their log-probabilities (k, T)
    float32, descending."""

    index: int
    logprobs: np.ndarray
    greedy: np.ndarray
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None

    @property
    def total(self) -> float:
        """The continuation's log-likelihood: the sum of its tokens' (float64)."""
        return float(self.logprobs.astype(np.float64).sum())

    @property
    def is_greedy(self) -> bool:
        """Whether greedy decoding from the context would have produced the whole continuation."""
        return bool(self.greedy.all())


@dataclass
class _Picked:
    """What scoring keeps of the log-probabilities at some positions (...): the target tokens' (...), whether each
    is the argmax (...), and the top_k likeliest (..., T) or None."""

    logprobs: torch.Tensor
    greedy: torch.Tensor
    top_values: torch.Tensor | None
    top_ids: torch.Tensor | None

    @staticmethod
    def of(logits: torch.Tensor, target: torch.Tensor, top_k: int) -> _Picked:
        """logits (..., V), target (...) long."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(-1, target[..., None])[..., 0]
        if not top_k:
            return _Picked(chosen, logprobs.argmax(-1) == target, None, None)
        top = logprobs.topk(top_k, dim=-1)  # its first entry is the argmax: one pass over the vocabulary
        return _Picked(chosen, top.indices[..., 0] == target, top.values, top.indices)


def _row(first: _Picked, rest: _Picked | None, name: str, row: int, k: int) -> np.ndarray | None:
    """Row `row`'s `name` over its k continuation tokens: the first token's from `first`, the others' from `rest`."""
    head = getattr(first, name)
    if head is None:
        return None
    tail = getattr(rest, name)[row, : k - 1] if rest is not None else head[:0]
    return torch.cat((head[row:row + 1], tail)).cpu().numpy()


def _context_key(request: ScoreRequest) -> bytes:
    """What requests must share to share a context's prefill: its tokens and the adapter they run with."""
    return np.append(request.context.astype(np.int64), request.adapter).tobytes()


class Scorer:
    """Scores requests with `model` in the slots of `cache` (its rows are overwritten), `token_budget` tokens of
    logits and prefill per forward at most; top_k > 0 also keeps each position's top_k likeliest tokens."""

    def __init__(self, model: nn.Module, cache: KVCache, device: torch.device, token_budget: int = 1024,
                 top_k: int = 0) -> None:
        self.model, self.cache, self.device, self.token_budget = model, cache, device, token_budget
        self.top_k = top_k
        self.prefilled_tokens = 0  # context and continuation tokens run through the model

    @torch.inference_mode()
    def score(self, requests: Iterable[ScoreRequest]) -> Iterator[Score]:
        """Yields a Score for every request, a round of them at a time (requests sharing a context next to each
        other share its prefill; the caller may sort them so)."""
        round_: list[ScoreRequest] = []
        for request in requests:
            self._check(request)
            if round_ and not self._fits(round_ + [request]):
                yield from self._run(round_)
                round_ = []
            round_.append(request)
        if round_:
            yield from self._run(round_)

    def _check(self, request: ScoreRequest) -> None:
        if len(request.context) < 1:
            raise ValueError(f"request {request.index}: empty context (score after at least one token, such as BOS)")
        if len(request.continuation) < 1:
            raise ValueError(f"request {request.index}: empty continuation: nothing to score")
        if len(request.context) + len(request.continuation) - 1 > self.cache.max_len:  # the last token is not fed
            raise ValueError(f"request {request.index}: context {len(request.context)} + continuation "
                             f"{len(request.continuation)} tokens do not fit the window of {self.cache.max_len} "
                             f"(+ 1: the last token is only scored)")

    def _fits(self, requests: list[ScoreRequest]) -> bool:
        """Whether one round holds `requests`: a slot each; within the budget both the contexts' prefill (padded
        rows) and the continuations' logits (the widest row's length, every row); and every row's padding inside
        the window (a padded position past it would overwrite a real one)."""
        contexts = {_context_key(request): len(request.context) for request in requests}
        width = max(len(request.continuation) for request in requests)
        return (len(requests) <= self.cache.num_slots and len(contexts) * max(contexts.values()) <= self.token_budget
                and len(requests) * width <= self.token_budget
                and max(contexts.values()) + width - 1 <= self.cache.max_len)

    def _run(self, requests: list[ScoreRequest]) -> list[Score]:
        """One round: the distinct contexts prefilled (each in its first request's slot, then copied to the others'
        slots), then every continuation but its last token in one forward over the cached contexts."""
        keys = [_context_key(request) for request in requests]
        distinct = list(dict.fromkeys(keys))
        self.cache.slot_adapter[: len(requests)] = torch.tensor([r.adapter for r in requests], device=self.device)
        first_slot = {key: keys.index(key) for key in distinct}
        group = torch.tensor([distinct.index(key) for key in keys], device=self.device)  # (R,) each row's context
        contexts = [requests[first_slot[key]].context for key in distinct]
        first_logits = self._prefill(contexts, [first_slot[key] for key in distinct])  # (G, V)
        copies = [(first_slot[key], row) for row, key in enumerate(keys) if first_slot[key] != row]
        if copies:
            sources, targets = (torch.tensor(side, device=self.device) for side in zip(*copies))
            self.cache.copy_slots(sources, targets, max(len(r.context) for r in requests))
        tokens = [torch.as_tensor(r.continuation.astype(np.int64), device=self.device) for r in requests]
        first = _Picked.of(first_logits[group], torch.stack([t[0] for t in tokens]), self.top_k)  # (R,) each
        rest = self._continuations(requests, tokens)  # (R, K - 1) each, or None
        scores = []
        for row, request in enumerate(requests):
            pick = lambda name: _row(first, rest, name, row, len(request.continuation))  # noqa: E731
            top_ids = pick("top_ids")
            scores.append(Score(request.index, pick("logprobs").astype(np.float32), pick("greedy"),
                                None if top_ids is None else top_ids.astype(np.int32), pick("top_values")))
        return scores

    def _prefill(self, contexts: list[np.ndarray], slots: list[int]) -> torch.Tensor:
        """Runs each context (padded rows) into its slot; the logits after each one's last token (G, V)."""
        width = max(len(c) for c in contexts)
        tokens = np.zeros((len(contexts), width), dtype=np.int64)
        for row, context in enumerate(contexts):
            tokens[row, : len(context)] = context
        positions = np.tile(np.arange(width), (len(contexts), 1))
        last = np.array([len(c) - 1 for c in contexts])
        self.prefilled_tokens += sum(len(c) for c in contexts)
        as_tensor = lambda array: torch.from_numpy(array.astype(np.int64)).to(self.device)  # noqa: E731
        return self.model(as_tensor(tokens), as_tensor(positions), self.cache,
                          torch.tensor(slots, device=self.device), as_tensor(last))

    def _continuations(self, requests: list[ScoreRequest], tokens: list[torch.Tensor]) -> _Picked | None:
        """Feeds every continuation but its last token after its cached context (row r in slot r), keeping every
        position's logits: the log-probability of each next continuation token and whether it is the argmax,
        (R, K - 1) each (K: the longest continuation), or None when every continuation is one token."""
        width = max(len(r.continuation) for r in requests) - 1
        if width == 0:
            return None
        fed = torch.zeros((len(requests), width), dtype=torch.long, device=self.device)
        target = torch.zeros_like(fed)
        for row, (request, ids) in enumerate(zip(requests, tokens)):
            fed[row, : len(ids) - 1] = ids[:-1]
            target[row, : len(ids) - 1] = ids[1:]
        offsets = torch.arange(width, device=self.device)
        context_len = torch.tensor([len(r.context) for r in requests], device=self.device)
        positions = context_len[:, None] + offsets  # (R, K - 1), inside the window (`_fits`)
        self.prefilled_tokens += sum(len(r.continuation) - 1 for r in requests)
        logits = self.model(fed, positions, self.cache, torch.arange(len(requests), device=self.device),
                            offsets.expand(len(requests), width))  # (R, K - 1, V)
        return _Picked.of(logits, target, self.top_k)
