"""CUDA graphs of the decode step: one captured per (rows, cache length) bucket the first time a step reaches it,
replayed after that.

A captured graph reads its inputs from fixed addresses, so the step's slot indices are copied into a buffer kept
per row count before each replay. Capturing runs the step three times (two warm-up runs on a side stream, then
the recorded one); while rows are in flight, whatever those runs write that a row still needs (`written`) is
saved first and put back after, so the rows go on as if nothing had run. Every graph shares one memory pool:
they replay one after another, never at once.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, ContextManager

import torch

log = logging.getLogger("zoo-infer")

StepFunction = Callable[[torch.Tensor | None, int], None]  # (slots (R,) or None for every slot, cache length)


def captured(run: Callable[[], object], warm_runs: int, pool: tuple[int, int] | None = None) -> torch.cuda.CUDAGraph:
    """`run` recorded into a CUDA graph (in `pool`, if given), after `warm_runs` runs on a side stream (allocations
    and lazy initialisation happen there, not in the graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warm_runs):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    return graph


class StepGraphs:
    """Captures and replays `step` as CUDA graphs keyed by (rows, length), rows -1 for every slot."""

    def __init__(self, step: StepFunction, written: Callable[[], list[torch.Tensor]],
                 in_flight: Callable[[], bool],
                 attention: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        """`step`: the (compiled) step to record; `written`: the tensors its runs write that a row in flight still
        needs; `in_flight`: whether any row is in flight now; `attention`: the context every run is recorded in."""
        self.step, self.written, self.in_flight, self.attention = step, written, in_flight, attention
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (rows, length) -> captured step
        self._slots: dict[int, torch.Tensor] = {}  # rows -> the captured steps' slot buffer
        self._pool = torch.cuda.graph_pool_handle()
        self.captures_in_flight = 0  # graphs captured while rows were in flight (their state saved and put back)
        self.capture_seconds_in_flight = 0.0  # ... and the seconds they took (compilation included, if any)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """(rows, length) of every captured graph, rows -1 for every slot."""
        return sorted(self._graphs)

    def __call__(self, slots: torch.Tensor | None, length: int) -> None:
        """Replays the graph of this (rows, length), the slots copied in; captures it first if no step took this
        shape yet."""
        key = (-1 if slots is None else len(slots), length)
        if key not in self._graphs:
            self._capture_keeping_rows(slots, length, key)
        if slots is not None:
            self._slots[len(slots)].copy_(slots)
        self._graphs[key].replay()

    def _capture_keeping_rows(self, slots: torch.Tensor | None, length: int, key: tuple[int, int]) -> None:
        """Captures the graph of `key`, the rows in flight (if any) left as they were."""
        start = time.perf_counter()
        in_flight = self.in_flight()
        saved = [tensor.clone() for tensor in self.written()] if in_flight else []
        self._capture(slots, length, key)
        for tensor, copy in zip(self.written(), saved):
            tensor.copy_(copy)
        torch.cuda.synchronize()
        if in_flight:
            self.captures_in_flight += 1
            self.capture_seconds_in_flight += time.perf_counter() - start
        log.info("decode step of %s rows over %d cache positions captured in %.1fs%s", "all" if key[0] < 0 else key[0],
                 length, time.perf_counter() - start, " (rows in flight)" if in_flight else "")

    def _capture(self, slots: torch.Tensor | None, length: int, key: tuple[int, int]) -> None:
        """Warms the step up on a side stream, then records it into a CUDA graph."""
        if slots is not None:
            slots = self._slots.setdefault(len(slots), slots.clone())
        with self.attention():
            self._graphs[key] = captured(lambda: self.step(slots, length), warm_runs=2, pool=self._pool)
