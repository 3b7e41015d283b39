"""Generation over a fixed set of cache slots, with in-flight refill.

`num_slots` rows decode together, one forward per step. When a row stops, its slot takes the next pending request
at once (continuous batching). The decode step itself is `DecodeStep` (step.py): fixed shapes, state in place, stops
decided on the device; this module is the host side around it (admission, prefill, release), which reads which rows
finished once per step (every few on a GPU). Admitted prompts are prefilled together, grouped by length; a prefix
the first ones share (a chat template) is prefilled once (`SharedPrefix`). A step runs every slot (idle ones on a
throwaway row at position 0), a fixed shape whose weights the CPU GEMMs prepack; where the caller allows smaller
steps (`step_rows`, row counts below the slots), a step with fewer rows in flight (a job's last steps, a call with
fewer requests than slots) runs the smallest that holds them, its own fixed shape, warmed up as the full one is.

Tokens are the argmax of the logits unless a `TokenChoice` (sampling, repetition control) is given; rows with a
response format (`StructuredRows`) choose among the tokens their grammar allows, fed each new token after every
step. With a drafter (speculative decoding, greedy only) each step feeds every slot's last token and K drafted
tokens at once and keeps the drafts up to the first one the model disagrees with, plus the model's own next token:
the same tokens plain greedy decoding would produce.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import numpy as np
import torch
from torch import nn

from modelzoo.errors import past_learned_positions
from modelzoo.cuda.attention_backends import AttentionBackends
from modelzoo.models.kv_cache import KVCache, aligned
from modelzoo.generation.options import GenerationOptions, RequestVariety
from modelzoo.generation.prefill import prefill_groups, prefill_inputs
from modelzoo.generation.sampling import TokenChoice
from modelzoo.generation.shared_prefix import SharedPrefix
from modelzoo.generation.step import (DecodeStep, SlotState, choose_tokens, length_bucket, length_buckets,
                                      reachable_buckets)
from modelzoo.generation.stopping import REASON_NAMES, StopChecker
from modelzoo.generation.structured import StructuredRows, apply_token_bitmask

if TYPE_CHECKING:
    from modelzoo.generation.speculative import Drafter

log = logging.getLogger("zoo-infer")

STEPS_PER_READ_CUDA = 4


@dataclass(frozen=True)
class PromptSpan:
    """What a job knows of its prompts before generating: the shortest and longest, the most tokens a row may
    generate (None: up to max_seq_len), and the prompt tokens of all its rows."""

    shortest: int
    longest: int
    most_tokens: int | None
    total: int


@dataclass
class Request:
    """One prompt to complete. `index` is the caller's key (the sample index); prompt: (p,), p >= 1; options: the
    request's own (the engine's defaults with its values put in), None: the defaults."""

    index: int
    prompt: np.ndarray
    options: GenerationOptions | None = None
    adapter: int = -1  # the LoRA adapter of the model's adapter bank the request runs with; -1: none


@dataclass
class Completion:
    """The generated tokens of one request (the stop sequence included) and why it stopped."""

    index: int
    tokens: np.ndarray
    reason: str
    logprobs: np.ndarray | None = None  # (n,) float32 with `logprobs`: each token's under what it was picked from
    top_ids: np.ndarray | None = None  # (n, K) int32 with top_logprobs K: the K likeliest tokens at each position
    top_logprobs: np.ndarray | None = None  # (n, K) float32: theirs, descending


class GenerationEngine:
    """Runs requests through `model` with `num_slots` sequences in flight."""

    def __init__(self, model: nn.Module, num_slots: int, max_seq_len: int, device: torch.device, dtype: torch.dtype,
                 defaults: GenerationOptions = GenerationOptions(), variety: RequestVariety = RequestVariety(), *,
                 prefill_token_budget: int = 1024, drafter: Drafter | None = None, step_rows: tuple[int, ...] = (),
                 structured: StructuredRows | None = None, attention: AttentionBackends = AttentionBackends()) -> None:
        """`defaults`: the options of a request without its own; `variety`: what requests may bring besides them;
        `structured`: the grammars of the response formats requests may follow; `attention`: the SDPA backends pinned
        for prefill and decode (CUDA)."""
        config = model.config
        self.model = model
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.device = device
        self.prefill_token_budget = prefill_token_budget
        self.step_rows = tuple(rows for rows in sorted(step_rows) if rows < num_slots)  # smaller steps' row counts
        if drafter is not None and structured is not None:
            raise ValueError("speculative decoding does not take response formats")
        self.drafter = drafter
        self.structured = structured
        # Prompts packed side by side in one row on the CPU (its attention kernel takes the row in one call; a drafter's
        # model would need the same inputs); on a GPU, right-padded rows attend in one fused kernel a layer.
        self.packs_prompts = (bool(getattr(model, "packs_prompts", False)) and drafter is None
                              and device.type == "cpu")
        self.attention = attention
        self.cache = KVCache(config.num_layers, num_slots, config.num_kv_heads, max_seq_len, config.head_dim,
                             dtype, device)
        self.owner: list[int | None] = [None] * num_slots  # request index held by each slot
        self.adopt(defaults, variety)  # the token choice, stop rules, slot state and decode step
        # An upper bound of each slot's length, known on the host: it sizes the cache length bucket of each step.
        self.length_bound = np.zeros(num_slots, dtype=np.int64)
        # Decode steps between two reads of which rows finished: every few on a GPU (a read waits for the queued
        # steps); every step on the CPU, and with response formats (each grammar needs its row's new token).
        self.steps_per_read = (STEPS_PER_READ_CUDA if device.type == "cuda" and drafter is None and structured is None
                               else 1)
        # Lengths a row may reach: max_seq_len, or less where the model's learned position table ends.
        self.position_limit = min(max_seq_len, getattr(model, "position_limit", None) or max_seq_len)
        # The cache length a step reads at most: the positions rows may reach, aligned as the cache stores them.
        self.read_limit = aligned(self.position_limit)
        # The prompt prefix shared by the first admitted requests of a `generate` call, once known, by LoRA adapter (a
        # prefix's keys and values differ with it; -1: none); not with a drafter (its model would need them too).
        self.shared_prefixes: dict[int, SharedPrefix] = {}
        self.shared_prefix_decided = drafter is not None
        self.adapters = getattr(model, "adapter_bank", None)  # LoRA adapters per row (modelzoo/models/lora.py)
        self.generated_tokens = 0  # over the engine's life, for throughput reports
        self.prefilled_tokens = 0  # prompt tokens run through the model (a shared prefix or a repeated prompt once)
        self.prefill_seconds = 0.0  # spent prefilling admitted prompts (their first tokens included)
        self.decode_steps = 0  # decode (or verification) steps run
        self.drafted_tokens = 0  # speculative decoding: drafts proposed for active rows
        self.accepted_tokens = 0  # ... and drafts the model agreed with

    @property
    def acceptance_rate(self) -> float | None:
        """Fraction of drafted tokens accepted (None without speculative decoding)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

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
        self.shared_prefixes, self.shared_prefix_decided = {}, self.drafter is not None  # this call's own
        self.state.active.zero_()
        self.state.reason.zero_()
        exhausted = False
        step = self._decode_step if self.drafter is None else self._speculative_step
        while not should_stop():
            admitted: list[tuple[int, Request]] = []
            while free and not exhausted:
                request = next(pending, None)
                if request is None:
                    exhausted = True
                else:
                    admitted.append((free.popleft(), request))
            if admitted:
                start = time.perf_counter()
                with self.attention.prefill_context():
                    self._prefill(admitted)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the release below waits for it anyway
                self.prefill_seconds += time.perf_counter() - start
                yield from self._release(free)
            if all(owner is None for owner in self.owner):
                if exhausted:
                    return
                continue
            for _ in range(self.steps_per_read):
                step()
            self.decode_steps += self.steps_per_read
            yield from self._release(free)

    def time_split(self) -> dict[str, object]:
        """Where the generation's time went, for summary.json: prefill seconds, decode steps, the graphs captured
        during generation (their seconds, compilation included) and the (rows, length) of every captured graph."""
        decode = self.decode
        return {"prefill_seconds": round(self.prefill_seconds, 3), "decode_steps": self.decode_steps,
                "captures_in_flight": decode.captures_in_flight,
                "capture_seconds_in_flight": round(decode.capture_seconds_in_flight, 3),
                "captured": [list(shape) for shape in decode.captured_shapes]}

    def step_shapes(self) -> list[tuple[torch.Tensor | None, int]]:
        """Every (slots, length) a decode step of this engine can take: each length bucket, with every slot
        and with each of `step_rows` slots."""
        rows = [None, *(torch.arange(count, device=self.device) for count in self.step_rows)]
        return [(slots, length) for slots in rows for length in length_buckets(self.read_limit)]

    def warm_up(self, prompts: PromptSpan | None = None, rows: int = 0) -> float:
        """Runs the decode step before any prompt (see `DecodeStep.warm_up`): compiled, once per shape it can take;
        eager on a GPU (whose cost does not depend on the length bucket) and captured (one graph compiled for every
        length, each bucket captured when a step first reaches it), once per row count, over the longest bucket (where
        rows that run to max_seq_len end). Captured, for `rows` rows of these `prompts`: every bucket a step of every
        slot can reach (none captured while rows are in flight then), and each smaller step over the longest of them.
        Eager on the CPU: none. A GEMM's first call of a shape there costs about a millisecond more than the next
        (oneDNN's primitive; prefill meets a new row count every group anyway), where a warm-up step would cost a
        whole step per row count, thrown away. Returns seconds."""
        shapes = self.warm_up_shapes(prompts, rows)
        with torch.inference_mode():
            return self.decode.warm_up(shapes)

    def warm_up_shapes(self, prompts: PromptSpan | None, rows: int) -> list[tuple[torch.Tensor | None, int]]:
        """The (slots, length) `warm_up` runs (see there)."""
        shapes = self.step_shapes()
        if self.decode.mode == "compiled":
            return shapes
        if self.decode.mode == "eager" and self.device.type == "cpu":
            return []
        shapes = list({None if slots is None else len(slots): (slots, length) for slots, length in shapes}.values())
        if self.decode.mode != "cuda_graph" or prompts is None:
            return shapes
        # A row's last step reads max_tokens - 1 positions past its prompt; steps_per_read - 1 more may run before the
        # host sees it stopped.
        generated = (prompts.most_tokens or self.max_seq_len) + self.steps_per_read - 2
        reached = reachable_buckets(prompts.shortest, prompts.longest, generated, rows <= self.num_slots,
                                    self.read_limit)
        smaller = [(slots, reached[-1]) for slots, _ in shapes if slots is not None]
        return [(None, length) for length in reached] + smaller

    def adopt(self, defaults: GenerationOptions, variety: RequestVariety) -> None:
        """Takes requests of these defaults and variety from now on, while no row is in flight: the token choice, stop
        rules, slot state and decode step (eager: an eager step needs no warm-up) made anew over the same cache."""
        if any(owner is not None for owner in self.owner):
            raise RuntimeError("an engine adopts new options only while no row is in flight")
        choice = TokenChoice.from_options(defaults, variety)
        self.choice = None if choice.is_plain_greedy else choice
        if self.drafter is not None and (self.choice is not None or defaults.logprobs):
            raise ValueError("speculative decoding needs plain greedy decoding, without logprobs")
        self.defaults, self.variety = defaults, variety
        self.stops = StopChecker(defaults.stop_sequences + variety.stop_sequences, self.max_seq_len, self.num_slots,
                                 self.device)
        self.state = SlotState.allocate(self.num_slots, self.max_seq_len, self.device, defaults.logprobs,
                                        defaults.top_logprobs)
        self.decode = DecodeStep(self.model, self.cache, self.state, self.stops, self.choice,
                                 None if self.structured is None else self.structured.mask, self.attention.decode_context)

    def accepts(self, options: GenerationOptions) -> bool:
        """Whether a request with these options can run on this engine (RequestVariety.check)."""
        try:
            self.variety.check(self.defaults, options)
        except ValueError:
            return False
        return True

    def _prefill(self, admitted: list[tuple[int, Request]]) -> None:
        """Runs the prompts of newly admitted requests and appends each one's first token. A prompt admitted
        several times at once (a request's n samples) runs once: its keys and values and its last logits are
        copied to the other slots, which then draw their own first tokens."""
        for slot, request in admitted:
            if not 1 <= len(request.prompt) < self.max_seq_len:
                raise ValueError(f"sample {request.index}: prompt length {len(request.prompt)} leaves no room "
                                 f"in max_seq_len {self.max_seq_len}")
            if request.options is not None and request.options is not self.defaults:
                self.variety.check(self.defaults, request.options)
            self.owner[slot] = request.index
        state = self.state
        state.active[[slot for slot, _ in admitted]] = True
        if self.adapters is not None:
            self.cache.slot_adapter[[slot for slot, _ in admitted]] = torch.tensor(
                [request.adapter for _, request in admitted], device=self.device)
        copies = self._repeated_prompts(admitted)  # first slot of a prompt -> the other slots given it
        copied = {slot for repeats in copies.values() for slot, _ in repeats}
        leading = [(slot, request) for slot, request in admitted if slot not in copied]
        if not self.shared_prefix_decided and len(leading) >= 2:
            self.shared_prefix_decided = True
            self._find_shared_prefixes(leading)
        for group in prefill_groups(leading, self._shared_offset, self.packs_prompts, self.prefill_token_budget):
            run_slots = torch.tensor([slot for slot, _, _ in group], device=self.device)
            rows = [(slot, request) for slot, request, _ in group]  # the group's rows, then their copies
            source = list(range(len(group)))  # the prefilled row whose logits each row takes
            for row, (slot, _, _) in enumerate(group):
                rows += copies.get(slot, [])
                source += [row] * len(copies.get(slot, []))
            requests = [request for _, request in rows]
            options = [request.options or self.defaults for request in requests]
            slots = torch.tensor([slot for slot, _ in rows], device=self.device)
            prompt_len = torch.tensor([len(r.prompt) for r in requests], device=self.device)
            prompts = np.zeros((len(rows), max(len(r.prompt) for r in requests)), dtype=np.int64)
            for row, request in enumerate(requests):
                prompts[row, : len(request.prompt)] = request.prompt
            state.sequences[slots, : prompts.shape[1]] = torch.from_numpy(prompts).to(self.device)  # zeros past each prompt
            state.seq_len[slots] = state.prompt_len[slots] = prompt_len
            state.sample_index[slots] = torch.tensor([r.index for r in requests], device=self.device)
            if self.choice is not None:
                self.state.sampling.put(slots, options)
            for adapter, prefix in self.shared_prefixes.items():
                prefixed = [slot for slot, request, offset in group if offset and request.adapter == adapter]
                if prefixed:
                    prefix.copy_into(self.cache, torch.tensor(prefixed, device=self.device))
            tokens, positions, token_slots, last = prefill_inputs(group, run_slots, self.packs_prompts, self.device)
            self.prefilled_tokens += sum(len(request.prompt) - offset for _, request, offset in group)
            # The head's own argmax where a decode step takes it (plain greedy, nothing else reading the logits).
            head_picks = self.decode.head_picks
            if head_picks:
                logits = self.model(tokens, positions, self.cache, token_slots, last, greedy=True)
            else:
                logits = self.model(tokens, positions, self.cache, token_slots, last)
            if self.packs_prompts:
                logits = logits[0]  # (1, G, vocab) -> (G, vocab); picks (1, G) -> (G,)
            if self.drafter is not None:  # never with packed prompts or copies
                self.drafter.prefill(tokens, positions, run_slots, last)
            if len(rows) > len(group):
                source_slots = run_slots[source[len(group):]]
                self.cache.copy_slots(source_slots, slots[len(group):], int(prompt_len[len(group):].max()))
                logits = logits[torch.tensor(source, device=self.device)]  # (G, vocab) -> (B, vocab); or (B,)
            if self.structured is not None:
                self.structured.admit([slot for slot, _ in rows], [o.response_format for o in options])
                logits = apply_token_bitmask(logits, self.structured.mask[slots])
            if head_picks:
                first, logprob, top = logits, None, None  # (B,) tokens
            else:
                first, logprob, top = choose_tokens(logits, state, slots, self.choice)  # (B,), (B,), (B, K) pair
            self.stops.reset(slots, [o.max_tokens for o in options], [o.stop_sequences for o in options])
            state.append(first, torch.ones_like(first, dtype=torch.bool), self.stops, slots, logprob, top)
            if self.structured is not None:
                self.structured.advance(state.last_token, [slot for slot, _ in rows])
            for slot, request in rows:
                self.length_bound[slot] = len(request.prompt) + 1

    def _shared_offset(self, request: Request) -> int:
        """The length of the shared prefix `request`'s prompt starts with (its keys are copied, not computed), else 0."""
        shared = self.shared_prefixes.get(request.adapter)
        return len(shared) if shared is not None and shared.starts(request.prompt) else 0

    def _find_shared_prefixes(self, leading: list[tuple[int, Request]]) -> None:
        """The prefix the first prompts of each adapter share (-1: no adapter), prefilled once in the first one's
        slot (its adapter set there) and kept."""
        by_adapter: dict[int, list[tuple[int, Request]]] = {}
        for slot, request in leading:
            by_adapter.setdefault(request.adapter, []).append((slot, request))
        for adapter, rows in by_adapter.items():
            prefix = SharedPrefix.compute(self.model, self.cache, [r.prompt for _, r in rows], rows[0][0], self.device)
            if prefix is not None:
                self.shared_prefixes[adapter] = prefix
                self.prefilled_tokens += len(prefix)
                log.info("the first %d prompts%s share a %d-token prefix: prefilled once, its keys and values copied "
                         "into every slot whose prompt starts with it", len(rows),
                         f" of adapter {self.adapters.names[adapter]!r}" if adapter >= 0 else "", len(prefix))

    def _repeated_prompts(self, admitted: list[tuple[int, Request]]) -> dict[int, list[tuple[int, Request]]]:
        """For each prompt admitted more than once, its first (slot, request) -> the others (not with a drafter,
        whose own cache would need them too)."""
        if self.drafter is not None:
            return {}
        first: dict[bytes, int] = {}
        copies: dict[int, list[tuple[int, Request]]] = {}
        for slot, request in admitted:
            key = np.append(np.asarray(request.prompt, dtype=np.int64), request.adapter).tobytes()  # an adapter's own
            if key in first:
                copies.setdefault(first[key], []).append((slot, request))
            else:
                first[key] = slot
        return copies

    def _decode_step(self) -> None:
        """One token for every active slot, through the fixed-shape step over the length bucket of the longest row."""
        owned = [slot for slot, owner in enumerate(self.owner) if owner is not None]
        slots = self._step_slots(owned)
        longest, limit = int(self.length_bound[owned].max()), self.position_limit
        if longest > limit:  # the bound may count steps of rows already stopped: read the true lengths once
            lengths = torch.where(self.state.active, self.state.seq_len, 0).cpu().numpy()
            self.length_bound[owned] = lengths[owned]
            longest = int(self.length_bound[owned].max())
            if longest > limit:
                raise past_learned_positions(longest - 1, limit)
        self.decode(slots, length_bucket(longest, self.read_limit))
        if self.structured is not None:
            self.structured.advance(self.state.last_token)
        self.length_bound[owned] = np.minimum(self.length_bound[owned] + 1, self.max_seq_len)

    def _step_slots(self, owned: list[int]) -> torch.Tensor | None:
        """The slots a step runs: None for every slot, or the smallest of `step_rows` that holds the `owned` ones:
        those slots, then idle ones (throwaway rows, as in a full step)."""
        rows = next((count for count in self.step_rows if count >= len(owned)), None)
        if rows is None:
            return None
        idle = [slot for slot, owner in enumerate(self.owner) if owner is None]
        return torch.tensor((owned + idle)[:rows], device=self.device)

    def _speculative_step(self) -> None:
        """Verifies K drafted tokens per slot in one forward; appends the agreed ones plus the model's next.

        Rows near max_seq_len feed positions clamped to the last one: those keys are only read by queries
        whose outputs are never used.
        """
        state = self.state
        active = state.active
        drafts = self.drafter.propose(state.sequences, state.seq_len, active)  # (S, K)
        width = drafts.shape[1] + 1
        offsets = torch.arange(width, device=self.device)
        positions = torch.where(active[:, None], (state.seq_len - 1)[:, None] + offsets, offsets)
        positions = positions.clamp(max=self.max_seq_len - 1)  # (S, K + 1)
        tokens = torch.cat((state.last_token[:, None], drafts), dim=1)  # (S, K + 1)
        logits = self.model(tokens, positions, self.cache, None, offsets.expand(self.num_slots, width))
        verified = logits.argmax(-1)  # (S, K + 1): the model's token after each fed one
        accepted = (drafts == verified[:, :-1]).long().cumprod(1).sum(1)  # (S,) leading drafts agreed with
        self.drafted_tokens += int(active.sum()) * (width - 1)
        self.accepted_tokens += int(accepted[active].sum())
        emitting = active.clone()
        for j in range(width):
            emitting &= (accepted >= j) & state.active  # a row that stopped emits no more
            if not bool(emitting.any()):
                break
            state.append(verified[:, j], emitting, self.stops)

    def _release(self, free: deque) -> Iterator[Completion]:
        """Turns the slots whose rows stopped into Completions and hands the slots back: which rows stopped is read
        from the device once, then their tokens (and log-probabilities) in one copy for all of them."""
        state = self.state
        finished = state.finished_slots()
        if not finished:
            return
        slots = torch.tensor([slot for slot, _ in finished], device=self.device)
        bounds = torch.stack((state.prompt_len[slots], state.seq_len[slots]), dim=1).tolist()  # (F, 2) begin, end
        width = max(end for _, end in bounds)
        sequences = state.sequences[slots, :width].cpu().numpy()  # (F, width)
        logprobs = None if state.logprobs is None else state.logprobs[slots, :width].cpu().numpy()
        top_ids, top_values = (None, None) if state.top_ids is None else (
            state.top_ids[slots, :width].cpu().numpy(), state.top_values[slots, :width].cpu().numpy())  # (F, width, K)
        state.active[slots] = False
        state.reason[slots] = 0
        for row, ((slot, reason), (begin, end)) in enumerate(zip(finished, bounds)):
            tokens = sequences[row, begin:end].astype(np.int32)
            index = self.owner[slot]
            self.owner[slot] = None
            if self.structured is not None:
                self.structured.release(slot)
            free.append(slot)
            self.generated_tokens += len(tokens)
            yield Completion(index=index, tokens=tokens, reason=REASON_NAMES[reason],
                             logprobs=None if logprobs is None else logprobs[row, begin:end].copy(),
                             top_ids=None if top_ids is None else top_ids[row, begin:end].astype(np.int32),
                             top_logprobs=None if top_values is None else top_values[row, begin:end].copy())
