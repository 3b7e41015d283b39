"""The fixed-shape decode step: one token for every slot, over state tensors allocated once per job.

Everything the step reads or writes lives at fixed addresses: the KV cache, the stop rules' state and
`SlotState` (each slot's tokens, length, prompt length, last token, sample index, whether it generates and
why it stopped). Lengths and positions are tensors, never Python ints; attention reads a cache-length
bucket the host fixes (`length_bucket`: the longest row rounded up), with each row's own length as a
mask; the token choice (greedy, seeded sampling, repetition control) and the stop rules (stop sequences,
max_tokens, max_seq_len) are decided on the device. The step reads nothing back: the host looks at
`SlotState.reason` when it chooses to (`finished_slots`), every step on the CPU, where that costs nothing.

So one function runs three ways (`DecodeStep.mode`): eager (the CPU's default: its C++ kernels and
measured GEMMs), compiled by `torch.compile(fullgraph=True, dynamic=False)` (one graph per rows and
length bucket, compiled before generation by `warm_up`), or, on CUDA, replayed as a CUDA graph captured
once per bucket (`modelzoo/cuda/graphs.py`). A step over slots that are all idle changes nothing but the cache
at position 0 of each slot (overwritten when the slot takes a prompt), which is what lets `warm_up` run it before
any prompt.

On CUDA the step is compiled with the cache length symbolic (one graph for every bucket) and each bucket is
captured the first time a step reaches it, so a job captures only the buckets its rows reach (a fraction of a
second each once compiled). While rows are in flight, the state the step writes and every slot's cache entry at
position 0 (where a row that stops feeds the next run) are saved before a capture and put back after, so the rows
go on as if nothing had run.
"""
from __future__ import annotations

import contextlib
import logging
import time
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager

import torch
from torch import nn

from modelzoo.cuda.graphs import StepGraphs
from modelzoo.models.kv_cache import KVCache
from modelzoo.generation.sampling import RowSampling, greedy_tokens
from modelzoo.generation.stopping import CONTINUE, StopChecker
from modelzoo.generation.structured import apply_token_bitmask

if TYPE_CHECKING:
    from modelzoo.generation.sampling import TokenChoice

log = logging.getLogger("zoo-infer")

# Granularity of the cache length a decode step attends over: one compiled graph per bucket, and at most
# LENGTH_BUCKET - 1 masked keys read beyond the longest row.
LENGTH_BUCKET = 128
# The smallest decode step where steps may run fewer rows than slots: the smallest of 8, 16, 32, ... rows that
# holds the rows in flight (`smaller_steps`), so a step's cost follows the rows left, not the slots.
SMALLEST_STEP_ROWS = 8
# Logits a token choice takes at once (rows x vocab) where it copies them (sampling, log-probabilities), by device: on
# a GPU 16M (64 MB in float32), so a choice's copies stay within a few hundred MB however many rows a step runs; on
# the CPU 2M, so that each copy (16 MB at most: top-p's int64 order) stays under glibc's largest mmap threshold
# (32 MB) and a step reuses the memory the last one freed, instead of mapping fresh pages and faulting them in.
SAMPLING_VALUES = {"cpu": 1 << 21, "cuda": 1 << 24}


def length_bucket(longest: int, max_len: int) -> int:
    """The cache length a step reads when its longest row holds `longest` tokens: rounded up to a multiple of
    LENGTH_BUCKET, at most `max_len`."""
    return min(max_len, -(-max(longest, 1) // LENGTH_BUCKET) * LENGTH_BUCKET)


def length_buckets(max_len: int) -> list[int]:
    """Every length `length_bucket` can return for a cache of `max_len` positions."""
    return sorted({length_bucket(n, max_len) for n in range(1, max_len + 1, LENGTH_BUCKET)} | {max_len})


def reachable_buckets(shortest: int, longest: int, generated: int, all_at_once: bool, max_len: int) -> list[int]:
    """The length buckets a job's steps of every slot can read: its prompts of `shortest` to `longest` tokens each
    grow by at most `generated` positions (max_tokens, plus the steps run before the host sees a row stop); with
    `all_at_once` (every row in flight from the start) the first step already reads the longest prompt's bucket, else
    a step may hold only short rows."""
    low = min((longest if all_at_once else shortest) + 1, max_len)
    high = min(longest + generated, max_len)
    return sorted({length_bucket(n, max_len) for n in (*range(low, high + 1, LENGTH_BUCKET), low, high)})


def smaller_steps(rows: int) -> tuple[int, ...]:
    """The row counts of decode steps smaller than `rows`: SMALLEST_STEP_ROWS, twice that, ... below `rows`."""
    counts = []
    while (SMALLEST_STEP_ROWS << len(counts)) < rows:
        counts.append(SMALLEST_STEP_ROWS << len(counts))
    return tuple(counts)


@dataclass
class SlotState:
    """Per-slot generation state, on the device, allocated once; every update is in place."""

    sequences: torch.Tensor  # (S, L) long: the prompt, then the generated tokens
    seq_len: torch.Tensor  # (S,) long: prompt + generated
    prompt_len: torch.Tensor  # (S,) long
    last_token: torch.Tensor  # (S,) long: the token to feed next
    sample_index: torch.Tensor  # (S,) long: the sample's global index, the key of its random stream
    active: torch.Tensor  # (S,) bool: the slot generates
    reason: torch.Tensor  # (S,) long: why the slot's row stopped (stopping.py's codes), CONTINUE until then
    logprobs: torch.Tensor | None  # (S, L) float32 with logprobs: each generated token's, where it sits
    sampling: RowSampling  # each slot's temperature, top-p cut and seed key (S,), read when the job samples
    top_ids: torch.Tensor | None = None  # (S, L, K) long with top_logprobs K: the K likeliest tokens, where it sits
    top_values: torch.Tensor | None = None  # (S, L, K) float32: their log-probabilities, in descending order

    @classmethod
    def allocate(cls, num_slots: int, max_len: int, device: torch.device, logprobs: bool,
                 top_logprobs: int = 0) -> SlotState:
        """Zeroed state for `num_slots` slots of `max_len` positions."""
        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(zeros(num_slots, max_len), zeros(num_slots), zeros(num_slots), zeros(num_slots), zeros(num_slots),
                   zeros(num_slots, dtype=torch.bool), zeros(num_slots),
                   zeros(num_slots, max_len, dtype=torch.float32) if logprobs else None,
                   RowSampling(zeros(num_slots, dtype=torch.float32), zeros(num_slots, dtype=torch.float32),
                               zeros(num_slots)),
                   zeros(num_slots, max_len, top_logprobs) if top_logprobs else None,
                   zeros(num_slots, max_len, top_logprobs, dtype=torch.float32) if top_logprobs else None)

    @property
    def num_slots(self) -> int:
        return self.sequences.shape[0]

    def written(self) -> list[torch.Tensor]:
        """The tensors a decode step writes in place."""
        return [t for t in (self.sequences, self.seq_len, self.last_token, self.active, self.reason, self.logprobs,
                            self.top_ids, self.top_values) if t is not None]

    def append(self, token: torch.Tensor, taken: torch.Tensor, stops: StopChecker, slots: torch.Tensor | None = None,
               logprob: torch.Tensor | None = None, top: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Appends `token` (R,) to the rows of `slots` (R,) (None = every slot, in order) where `taken` (R,) is
        true, with its `logprob` (R,) and `top` (ids, log-probabilities (R, K)) if kept; records the reason of
        each row that stops and makes it inactive."""
        rows = slice(None) if slots is None else slots
        index = torch.arange(self.num_slots, device=token.device)[rows]  # (R,) the slots of these rows
        seq_len = self.seq_len[rows]  # (R,)
        column = seq_len.clamp(max=self.sequences.shape[1] - 1)  # rows that take a token are below max_len
        self.sequences[index, column] = torch.where(taken, token, self.sequences[index, column])
        if logprob is not None and self.logprobs is not None:
            self.logprobs[index, column] = torch.where(taken, logprob, self.logprobs[index, column])
        if top is not None and self.top_ids is not None:
            self.top_ids[index, column] = torch.where(taken[:, None], top[0], self.top_ids[index, column])
            self.top_values[index, column] = torch.where(taken[:, None], top[1], self.top_values[index, column])
        seq_len = seq_len + taken
        self.seq_len[rows] = seq_len
        self.last_token[rows] = torch.where(taken, token, self.last_token[rows])
        reason = stops.check(slots, token, seq_len - self.prompt_len[rows], seq_len, taken=taken)  # (R,)
        self.reason[rows] = torch.where(reason != CONTINUE, reason, self.reason[rows])
        self.active[rows] = self.active[rows] & (reason == CONTINUE)

    def finished_slots(self) -> list[tuple[int, int]]:
        """(slot, reason) of every slot whose row has stopped and not been released (reads the device: the
        host's one wait of a step)."""
        stopped = (self.reason != CONTINUE).nonzero().flatten()
        if stopped.numel() == 0:
            return []
        return list(zip(stopped.tolist(), self.reason[stopped].tolist()))


def choose_tokens(logits: torch.Tensor, state: SlotState, slots: torch.Tensor | None, choice: TokenChoice | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """Next token (R,) from logits (R, vocab) of `slots` (None = every slot, in order); where the state keeps
    them, its log-probability (R,) under the distribution it was picked from (after repetition control and
    temperature, top-k, top-p: the scores transformers' processors leave), and the K likeliest tokens of that
    distribution with theirs, ((R, K) long, (R, K) float32, descending). No host sync.

    Rows are chosen SAMPLING_VALUES logits at a time where sampling or log-probabilities make (rows, vocab) float32
    and float64 copies of them: a row's choice is its own, and those copies of 4096 rows over a 128k vocabulary would
    take several GB each (on the CPU, copies of a few MB are also the fast ones)."""
    if choice is None and state.logprobs is None:  # the plain argmax: no copies
        return greedy_tokens(logits), None, None
    rows_at_once = max(1, SAMPLING_VALUES.get(logits.device.type, SAMPLING_VALUES["cuda"]) // logits.shape[-1])
    parts = [_choose_rows(logits[first:first + rows_at_once], state,
                          slice(first, first + rows_at_once) if slots is None else slots[first:first + rows_at_once],
                          choice)
             for first in range(0, logits.shape[0], rows_at_once)]
    if len(parts) == 1:
        return parts[0]
    tokens, logprobs, tops = zip(*parts)
    top = None if tops[0] is None else (torch.cat([ids for ids, _ in tops]), torch.cat([values for _, values in tops]))
    return torch.cat(tokens), None if logprobs[0] is None else torch.cat(logprobs), top


def _choose_rows(logits: torch.Tensor, state: SlotState, rows: torch.Tensor | slice, choice: TokenChoice | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """choose_tokens for logits (R, vocab) of the slots `rows` (a tensor of slots, or a slice of every slot)."""
    if choice is None:
        tokens, scores = greedy_tokens(logits), logits
    else:
        own = state.sampling.rows(rows)
        tokens, scores = choice.choose_rows(logits, state.sequences[rows], state.seq_len[rows],
                                            state.sample_index[rows], own, state.prompt_len[rows])  # (R,), (R, V)
    if state.logprobs is None:
        return tokens, None, None
    logprobs = torch.log_softmax(scores.float(), dim=-1)  # (R, V)
    top = None
    if state.top_ids is not None:
        values, ids = logprobs.topk(state.top_ids.shape[-1], dim=-1)  # (R, K) each
        top = (ids, values)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0], top


class DecodeStep:
    """One decode step of `model` over `state`, `cache` and `stops`, run `mode`'s way (see the module docstring).

    Call it with the slots of the step's rows (None: every slot) and the cache length bucket it reads.
    """

    def __init__(self, model: nn.Module, cache: KVCache, state: SlotState, stops: StopChecker,
                 choice: TokenChoice | None, token_mask: torch.Tensor | None = None,
                 attention: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        """`attention`: the context every step runs in (the SDPA backend pinned for decode on CUDA)."""
        self.model, self.cache, self.state, self.stops, self.choice = model, cache, state, stops, choice
        self.token_mask = token_mask  # (S, ceil(V / 32)) int32: each slot's allowed tokens (structured output)
        self.attention = attention
        self.mode = "eager"
        self._compiled: Callable[[torch.Tensor | None, int], None] | None = None
        self._graphs: StepGraphs | None = None  # the captured steps, once `capture` has run

    @property
    def head_picks(self) -> bool:
        """Whether the step takes each row's token from the head's own argmax, its logits never written: plain greedy
        with nothing else reading the logits (no log-probabilities, no token mask), eager (the fused head is a C++
        call, which a compiled graph cannot hold), and a head that fuses it (CausalLM.fuses_greedy_head)."""
        return (self.mode == "eager" and self.choice is None and self.token_mask is None and self.state.logprobs is None
                and bool(getattr(self.model, "fuses_greedy_head", lambda: False)()))

    def run(self, slots: torch.Tensor | None, length: int) -> None:
        """tokens (R, 1) fed from each row's last token at its position; the chosen token appended in place.
        Idle rows (not active) feed position 0 and keep their state."""
        state, rows = self.state, slice(None) if slots is None else slots
        active = state.active[rows]  # (R,)
        tokens = state.last_token[rows][:, None]  # (R, 1)
        positions = torch.where(active, state.seq_len[rows] - 1, 0)[:, None]  # (R, 1): where the fed token sits
        if self.head_picks:
            token = self.model(tokens, positions, self.cache, slots, length=length, greedy=True)  # (R,)
            state.append(token, active, self.stops, slots, None, None)
            return
        logits = self.model(tokens, positions, self.cache, slots, length=length)  # (R, vocab)
        if self.token_mask is not None:
            logits = apply_token_bitmask(logits, self.token_mask[rows])
        token, logprob, top = choose_tokens(logits, state, slots, self.choice)
        state.append(token, active, self.stops, slots, logprob, top)

    def __call__(self, slots: torch.Tensor | None, length: int) -> None:
        if self._graphs is not None:
            self._graphs(slots, length)
            return
        with self.attention():
            if self.mode == "eager":
                self.run(slots, length)
            else:
                self._compiled(slots, length)

    def compile(self, graphs: int, backend: str | Callable = "inductor", symbolic_length: bool = False) -> None:
        """From now on the step runs compiled: one graph, no graph break (fullgraph), per rows and length, for
        `graphs` shapes; with `symbolic_length`, one graph per rows for every length. Dynamo limits the graphs of
        one code object (8 by default; past it, fullgraph fails): each step raises the limit by its own graphs."""
        import torch._dynamo.config as dynamo_config

        dynamo_config.recompile_limit += graphs
        dynamo_config.accumulated_recompile_limit += graphs
        # A copy of `_run_over`'s code for this step alone: dynamo keeps its graphs, and its record of which sizes
        # changed between calls, per code object, so another engine of the process (another model) never makes this
        # one's sizes symbolic, nor counts against its recompile limit.
        own = types.FunctionType(DecodeStep._run_over.__code__.replace(), DecodeStep._run_over.__globals__)
        # emulate_precision_casts: fused kernels round each intermediate where the eager step would (bfloat16).
        options = {"emulate_precision_casts": True} if backend == "inductor" else None
        compiled = torch.compile(types.MethodType(own, self), backend=backend, fullgraph=True, dynamic=False,
                                 options=options)

        def call(slots: torch.Tensor | None, length: int) -> None:
            keys = torch.empty(length, dtype=torch.uint8)  # only its size is read
            if symbolic_length:
                torch._dynamo.maybe_mark_dynamic(keys, 0)
            compiled(slots, keys)

        self._compiled = call
        self.mode = "compiled"

    def _run_over(self, slots: torch.Tensor | None, keys: torch.Tensor) -> None:
        """`run` over as many cache positions as `keys` (L,) has entries: torch.compile can keep a tensor's size
        symbolic from the first call, not an int argument's value."""
        self.run(slots, keys.shape[0])

    def capture(self, graphs: int) -> None:
        """From now on (CUDA only) the step replays a CUDA graph per (rows, length) bucket, up to `graphs` of them,
        each captured from the compiled step the first time a step takes its shape (modelzoo/cuda/graphs.py)."""
        if self.state.sequences.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.compile(graphs, symbolic_length=True)
        self._graphs = StepGraphs(self._compiled, self._written, lambda: bool(self.state.active.any()), self.attention)
        self.mode = "cuda_graph"

    @property
    def captured_shapes(self) -> list[tuple[int, int]]:
        """(rows, length) of every captured graph, rows -1 for every slot."""
        return self._graphs.shapes if self._graphs is not None else []

    @property
    def captures_in_flight(self) -> int:
        """Graphs captured while rows were in flight (their state saved and put back)."""
        return self._graphs.captures_in_flight if self._graphs is not None else 0

    @property
    def capture_seconds_in_flight(self) -> float:
        """The seconds those captures took (compilation included, if any)."""
        return self._graphs.capture_seconds_in_flight if self._graphs is not None else 0.0

    def _written(self) -> list[torch.Tensor]:
        """What the runs of a capture write that a row in flight still needs: the slot state, the stop rules' history
        and every slot's cache entry at position 0 (where a row that stopped in the first run feeds the next).
        The other cache entries they write lie past each row's position, rewritten before any step reads them."""
        first = [cache[:, :, 0] for cache in (*self.cache.keys, *self.cache.values)]  # views (S, kv_heads, hd)
        return [*self.state.written(), self.stops.history, *first]

    def warm_up(self, shapes: list[tuple[torch.Tensor | None, int]]) -> float:
        """Runs the step once per (slots, length) in `shapes` while every slot is idle: kernel builds, GEMM
        primitives, compilation and graph capture happen here, before generation. Returns the seconds spent."""
        if bool(self.state.active.any()):
            raise RuntimeError("warm_up runs only while every slot is idle")
        start = time.perf_counter()
        for slots, length in shapes:
            self(slots, length)
        if self.state.sequences.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start
