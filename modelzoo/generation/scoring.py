"""Teacher-forced scoring: the log-probability of a given continuation after a given context, token by token.

No token is chosen: the model reads context + continuation and, at each continuation position, the engine
keeps the log-probability of the token that is there (float32 log-softmax of the same logits greedy
decoding takes its argmax of) and whether it is that argmax. Requests that share a context (the choices of one
multiple-choice question) prefill it once: its keys and values are copied into one cache slot per
continuation, then every continuation of the round runs in one padded forward, all its positions' logits
kept. Distinct contexts of a round that begin alike (the same few-shot examples before each question) prefill
that shared beginning once too, copied into each context's slot before the rest of each is prefilled after
it. A round takes as many continuations as there are cache slots and as many tokens as the budget allows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from modelzoo.models.kv_cache import KVCache

# Prefill tokens that prefilling the distinct contexts' shared beginning once must save (it costs a forward of
# its own and a copy per context).
MIN_SHARED_SAVING = 32


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


def _shared_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class _Round:
    """The requests of one round as they are gathered, with what sizes it: its distinct contexts, the tokens
    they all begin with (never a whole context: each keeps a token whose logits score its first continuation
    token) and its longest context and continuation."""

    def __init__(self) -> None:
        self.requests: list[ScoreRequest] = []
        self.contexts: dict[bytes, ScoreRequest] = {}  # each distinct context's first request
        self.shared = 0
        self.longest = self.width = 0
        self.fed = 0  # continuation tokens fed (each one's last is only scored)

    def sizes_with(self, request: ScoreRequest) -> tuple[int, int, int, int, int, int]:
        """(requests, distinct contexts, shared tokens, longest context, widest continuation, continuation tokens
        fed) with `request` in."""
        key, first = _context_key(request), next(iter(self.contexts.values()), None)
        distinct, shared = len(self.contexts), self.shared
        if key not in self.contexts:
            distinct += 1
            if first is None:
                shared = len(request.context) - 1
            elif first.adapter != request.adapter:
                shared = 0
            else:
                shared = min(shared, _shared_length(first.context, request.context), len(request.context) - 1)
        return (len(self.requests) + 1, distinct, shared, max(self.longest, len(request.context)),
                max(self.width, len(request.continuation)), self.fed + len(request.continuation) - 1)

    def add(self, request: ScoreRequest) -> None:
        _, _, self.shared, self.longest, self.width, self.fed = self.sizes_with(request)
        self.contexts.setdefault(_context_key(request), request)
        self.requests.append(request)

    def shared_prefix(self) -> int:
        """The tokens prefilled once for every distinct context (`prefilled_once`)."""
        return prefilled_once(len(self.contexts), self.shared)


def prefilled_once(contexts: int, shared: int) -> int:
    """Of `shared` tokens that `contexts` distinct contexts begin with, those prefilled once for all: every one where
    that saves at least MIN_SHARED_SAVING prefill tokens (it costs a forward of its own), else none."""
    return shared if (contexts - 1) * shared >= MIN_SHARED_SAVING else 0


class Scorer:
    """Scores requests with `model` in the slots of `cache` (its rows are overwritten), `token_budget` tokens of
    logits and prefill per forward at most; top_k > 0 also keeps each position's top_k likeliest tokens."""

    def __init__(self, model: nn.Module, cache: KVCache, device: torch.device, token_budget: int = 1024,
                 top_k: int = 0) -> None:
        self.model, self.cache, self.device, self.token_budget = model, cache, device, token_budget
        self.top_k = top_k
        # Continuations packed side by side in one row, without padding, where the model takes that (on the CPU, as
        # the engine packs prompts).
        self.packs = bool(getattr(model, "packs_prompts", False)) and device.type == "cpu"
        self.prefilled_tokens = 0  # context and continuation tokens run through the model

    @torch.inference_mode()
    def score(self, requests: Iterable[ScoreRequest]) -> Iterator[Score]:
        """Yields a Score for every request, a round of them at a time (requests sharing a context next to each
        other share its prefill, and contexts beginning alike next to each other their beginning's; the caller may
        sort them so)."""
        round_ = _Round()
        for request in requests:
            self._check(request)
            if round_.requests and not self._fits(*round_.sizes_with(request)):
                yield from self._run(round_)
                round_ = _Round()
            round_.add(request)
        if round_.requests:
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

    def _fits(self, requests: int, contexts: int, shared: int, longest: int, width: int, fed: int) -> bool:
        """Whether one round of these sizes (`_Round.sizes_with`) fits: a slot per request; within the budget both
        the contexts' prefill (padded rows after their shared beginning) and the continuations' logits (packed: the
        tokens fed; else the widest row's length, every row); and every row's padding inside the window (a padded
        position past it would overwrite a real one)."""
        logits, shared = fed if self.packs else requests * width, prefilled_once(contexts, shared)
        return (requests <= self.cache.num_slots and shared + contexts * (longest - shared) <= self.token_budget
                and logits <= self.token_budget and longest + width - 1 <= self.cache.max_len)

    def _run(self, round_: _Round) -> list[Score]:
        """One round: the distinct contexts prefilled (each in its first request's slot, after their shared
        beginning, prefilled once and copied; then copied to the other requests' slots), then every continuation
        but its last token in one forward over the cached contexts."""
        requests = round_.requests
        keys = [_context_key(request) for request in requests]
        distinct = list(round_.contexts)
        self.cache.slot_adapter[: len(requests)] = torch.tensor([r.adapter for r in requests], device=self.device)
        first_slot = {key: keys.index(key) for key in distinct}
        group = torch.tensor([distinct.index(key) for key in keys], device=self.device)  # (R,) each row's context
        contexts = [round_.contexts[key].context for key in distinct]
        slots = [first_slot[key] for key in distinct]
        shared = round_.shared_prefix()
        if shared:
            self._prefill([contexts[0][:shared]], slots[:1])
            self.cache.copy_slots(torch.tensor(slots[:1] * (len(slots) - 1), device=self.device),
                                  torch.tensor(slots[1:], device=self.device), shared)
        first_logits = self._prefill([context[shared:] for context in contexts], slots, start=shared)  # (G, V)
        copies = [(first_slot[key], row) for row, key in enumerate(keys) if first_slot[key] != row]
        if copies:
            sources, targets = (torch.tensor(side, device=self.device) for side in zip(*copies))
            self.cache.copy_slots(sources, targets, round_.longest)
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

    def _prefill(self, contexts: list[np.ndarray], slots: list[int], start: int = 0) -> torch.Tensor:
        """Runs each context (padded rows) into its slot from position `start` on (the positions before it already
        cached there); the logits after each one's last token (G, V)."""
        width = max(len(c) for c in contexts)
        tokens = np.zeros((len(contexts), width), dtype=np.int64)
        for row, context in enumerate(contexts):
            tokens[row, : len(context)] = context
        positions = np.tile(np.arange(start, start + width), (len(contexts), 1))
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
        self.prefilled_tokens += sum(len(r.continuation) - 1 for r in requests)
        if self.packs:
            return self._packed_continuations(requests, tokens, width)
        fed = torch.zeros((len(requests), width), dtype=torch.long, device=self.device)
        target = torch.zeros_like(fed)
        for row, (request, ids) in enumerate(zip(requests, tokens)):
            fed[row, : len(ids) - 1] = ids[:-1]
            target[row, : len(ids) - 1] = ids[1:]
        offsets = torch.arange(width, device=self.device)
        context_len = torch.tensor([len(r.context) for r in requests], device=self.device)
        positions = context_len[:, None] + offsets  # (R, K - 1), inside the window (`_fits`)
        logits = self.model(fed, positions, self.cache, torch.arange(len(requests), device=self.device),
                            offsets.expand(len(requests), width))  # (R, K - 1, V)
        return _Picked.of(logits, target, self.top_k)

    def _packed_continuations(self, requests: list[ScoreRequest], tokens: list[torch.Tensor], width: int) -> _Picked:
        """`_continuations` with every row's fed tokens side by side in one row (N tokens in all, no padding), its
        results laid out as (R, K - 1) again."""
        lengths = torch.tensor([len(ids) - 1 for ids in tokens], device=self.device)  # (R,)
        rows = torch.repeat_interleave(torch.arange(len(requests), device=self.device), lengths)  # (N,)
        columns = torch.cat([torch.arange(n, device=self.device) for n in lengths.tolist()])  # (N,)
        context_len = torch.tensor([len(r.context) for r in requests], device=self.device)
        fed = torch.cat([ids[:-1] for ids in tokens])  # (N,)
        logits = self.model(fed[None], (context_len[rows] + columns)[None], self.cache, rows[None],
                            torch.arange(len(fed), device=self.device)[None])[0]  # (N, V)
        picked = _Picked.of(logits, torch.cat([ids[1:] for ids in tokens]), self.top_k)  # (N,) or (N, T) each

        def laid_out(values: torch.Tensor | None) -> torch.Tensor | None:
            if values is None:
                return None
            out = values.new_zeros((len(requests), width, *values.shape[1:]))  # (R, K - 1, ...)
            out[rows, columns] = values
            return out

        return _Picked(*(laid_out(getattr(picked, name)) for name in ("logprobs", "greedy", "top_values", "top_ids")))
