"""The inference job: data -> generation engine -> predictions files.

It owns the steps of its shard, skips those already on disk (same manifest), stops cleanly on a
preemption signal, and reports progress and a summary. Under tensor parallel every rank of a group
runs this same job in lockstep; only the group's rank 0 writes files and logs.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import yaml

from modelzoo.errors import UserError
from modelzoo.files import WriteError
from modelzoo.generation.engine import GenerationEngine, PromptSpan, Request
from modelzoo.generation.scoring import Scorer, ScoreRequest
from modelzoo.generation.stopping import DUMMY, EMPTY_PROMPT, NO_START_TOKEN, SCORED
from modelzoo.job.data import Batch, GptHDF5MapDataProcessor, start_positions
from modelzoo.job.distributed import Shard
from modelzoo.job.manifest import build_manifest
from modelzoo.job.output_folder import OutputFolder
from modelzoo.job.params import InferenceParams
from modelzoo.job.predictions import StepAssembly
from modelzoo.job.preemption import Interrupted, StopRequest
from modelzoo.job.reporting import (Progress, RunStats, log_totals, read_shard_stats, shard_stats_path, summary_of,
                                    write_json)
from modelzoo.job.tensor_group import AgreedStop, open_group
from modelzoo.models.tensor_parallel import TensorParallelGroup
from modelzoo.runtime import Runtime, RuntimePlan

log = logging.getLogger("zoo-infer")


class InferenceJob:
    """One run of `run_inference.py`, top to bottom: open the data and check the runtime's plan (`open`), take the
    output folder, open the runtime, stream the batches through its engine, write each step's file (`run`)."""

    def __init__(self, params: InferenceParams, model_dir: str | Path, data: GptHDF5MapDataProcessor,
                 plan: RuntimePlan, shard: Shard = Shard(), overwrite: bool = False) -> None:
        self.params, self.data, self.plan = params, data, plan
        self.shard, self.overwrite = shard, overwrite
        self.model_dir = Path(model_dir)
        self.writes = shard.writes  # tensor parallel: only rank 0 of the group writes files
        self.start_tokens = np.array(params.model.start_token, dtype=np.int64)
        self.pad_token = int(params.model.start_token[0])
        self.device, self.vocab_size, self.adapters = plan.device, plan.vocab_size, plan.adapters
        self.defaults = params.model.generation_defaults()  # the options of every row without its own
        self.stats = RunStats()
        self.written: set[int] = set()  # steps this run wrote
        self.shape = ((params.inference_input.batch_size, data.max_seq_len) if params.model.loop_dim == 1
                      else (data.max_seq_len, params.inference_input.batch_size))  # of `predictions`
        self.steps_of_shard = [step for step in self.steps() if shard.owns(step)]
        self.todo = self.steps_of_shard  # until the resume check says which are left
        self.output = OutputFolder(self.model_dir, shard.index, shard.count, self.writes)
        self.artifacts, self.predictions_dir = self.output.artifacts, self.output.predictions_dir
        self.output_taken = False  # True once this run writes into the folder (lock held, steps planned)
        self.prompts: PromptSpan | None = None  # the to-do rows' prompt lengths, once read (`_take_output`)
        self.tp = TensorParallelGroup(device=self.device)  # this rank's group: opened with the output folder (torchrun)
        self.runtime: Runtime | None = None  # opened by run() once the output folder is taken
        self.scorer: Scorer | None = None  # for scoring data: the continuations' log-probabilities

    @classmethod
    def open(cls, params: InferenceParams, model_dir: str | Path, shard: Shard = Shard(),
             overwrite: bool = False) -> InferenceJob:
        """The job of these params: the data opened and checked against the checkpoint, the runtime's plan checked
        (device, dtypes, decode step, LoRA adapters read); nothing loaded or written yet."""
        model = params.model
        if not model.checkpoint_path:
            raise UserError("no checkpoint: set model.checkpoint_path in params or pass --checkpoint_path")
        if params.runconfig.tensor_parallel != shard.tp_size:
            raise UserError(f"runconfig.tensor_parallel is {params.runconfig.tensor_parallel} but this process is one "
                            f"of {shard.tp_size} tensor-parallel ranks; launch with torchrun "
                            f"--nproc_per_node={params.runconfig.tensor_parallel} run_inference.py ...")
        pad_token = int(model.start_token[0])
        data = GptHDF5MapDataProcessor(params.inference_input.data_dir, params.inference_input.batch_size,
                                       model.loop_dim, pad_token)
        # Ranks on one machine share its cores rather than each taking them all.
        threads = params.runconfig.num_threads or max(1, len(os.sched_getaffinity(0)) // shard.local_count)
        plan = RuntimePlan.of(params.runtime_spec(data.max_seq_len, data.distinct_values("adapter"), threads))
        data.check_against_model(np.array(model.start_token, dtype=np.int64), plan.vocab_size)
        return cls(params, model_dir, data, plan, shard, overwrite)

    def steps(self) -> list[int]:
        """Global steps this run processes: all, or the first `inference_steps` (clamped, with a warning)."""
        wanted = self.params.runconfig.inference_steps
        if wanted is not None and wanted > self.data.num_steps:
            log.warning("inference_steps %d is more than the data holds; clamped to %d", wanted, self.data.num_steps)
        return list(range(1, min(wanted or self.data.num_steps, self.data.num_steps) + 1))

    def run(self) -> RunStats:
        """Takes the output folder, opens the runtime, then either checks one forward pass (compile_only) or
        streams this shard's steps through the engine into their files. A stop signal during set-up ends the run at
        once; a UserError after the output folder is taken is recorded in summary.json first."""
        with StopRequest() as request, contextlib.closing(self.output):
            try:
                with request.raising():
                    todo = self._take_output()
                    if todo is None:
                        return self.stats
                    setup_start = time.perf_counter()
                    with self._out_of_memory_named("setting up"):
                        self.runtime = Runtime(self.plan, self.defaults, self.data.request_variety(),
                                               sum(self._real_samples(step) for step in todo), self._response_formats(),
                                               self.tp, self.prompts)
                    if "continuation_length" in self.data.per_row:
                        self.scorer = self.runtime.scorer(beside_generation=True)
                    self.stats.setup_seconds = time.perf_counter() - setup_start
                    if self.params.runconfig.compile_only:
                        self._check_forward(self.runtime.model, self.runtime.engine)
                        return self.stats
                    log.info("%d samples, %d steps of %d rows (shard %d of %d: %d steps, %d to do), max_seq_len %d; "
                             "writing to %s", self.data.num_samples, self.data.num_steps,
                             self.params.inference_input.batch_size, self.shard.index, self.shard.count,
                             len(self.steps_of_shard), len(todo), self.data.max_seq_len, self.predictions_dir)
                stop = AgreedStop(request, self.tp) if self.tp.size > 1 else request
                gc.freeze()  # the garbage collector's full passes skip the objects of imports and set-up from here on
                with self._out_of_memory_named("generating"):
                    self._generate(self.runtime.engine, todo, stop)
            except Interrupted as interrupted:
                request.signum = interrupted.signum
            except UserError as error:
                if self.output_taken:
                    self.stats.error = str(error)
                    self._count_remaining()
                    self._finish_quietly()
                raise
            self._count_remaining()
            if request.signum is not None:
                self.stats.interrupted_by = signal_name(request.signum)
            self.stats.finished = True
            if self.output_taken:
                self._finish()
        return self.stats

    def _take_output(self) -> list[int] | None:
        """Takes the output folder, works out which steps are still to do, checks their prompts'
        token ids and readies the folder for them, all before the model loads; None when there is
        nothing to do (and nothing was written)."""
        self.output.take()
        self.tp = open_group(self.shard, self.device)
        params_yaml = yaml.safe_dump(self.params.to_dict(), sort_keys=False) if self.shard.is_first else None
        if self.params.runconfig.compile_only:
            self.data.check_prompt_tokens(self.todo, self.vocab_size, self.start_tokens)
            if self.writes and params_yaml:
                self.output.write_params(params_yaml)
            return self.todo
        manifest = build_manifest(self.params, self.data.files)
        self.todo = self.output.plan(self.steps_of_shard, manifest, self.shape, self.overwrite)
        if self.tp.size > 1:  # the group runs the same steps: its rank 0 decided which
            self.todo = self.tp.first_ranks_choice(self.todo, self.steps_of_shard)
        done = [step for step in self.steps_of_shard if step not in set(self.todo)]
        self.stats.batches_skipped = len(done)
        self.stats.samples_skipped = sum(self._real_samples(step) for step in done)
        if not self.todo:
            log.info("all %d steps of this shard are already in %s: nothing to do", len(self.steps_of_shard),
                     self.predictions_dir)
            if self.writes and not self.output.unwritable:
                self.output.repair_manifest()  # the one write of a finished run, where its manifest was lost
            return None
        if done:
            log.info("resuming: %d of this shard's %d steps are already on disk and skipped", len(done),
                     len(self.steps_of_shard))
        if self.writes and self.output.unwritable:
            raise self.output.unwritable
        shortest, longest, total = self.data.check_prompt_tokens(self.todo, self.vocab_size, self.start_tokens)
        # a row's own max_tokens is capped by the defaults' (Batch.options): the most any row makes, where known
        cap = self.defaults.max_tokens
        most_tokens = cap if cap or "max_tokens" not in self.data.per_row else None
        self.prompts = PromptSpan(shortest, longest, most_tokens, total) if longest else None
        self.output_taken = True
        if self.writes:
            self.output.prepare(self.todo, params_yaml)
            self._write_summary()  # status "running"
        return self.todo

    @contextlib.contextmanager
    def _out_of_memory_named(self, phase: str) -> Iterator[None]:
        """An allocation failure (another process took the GPU's memory, a capture that does not fit) as one
        error line naming the settings to lower; every predictions file written before it is complete."""
        try:
            yield
        except torch.OutOfMemoryError as error:
            detail = str(error).strip().splitlines()[0][:160] if str(error).strip() else "no detail"
            raise UserError(f"out of memory on {self.device} while {phase} ({detail}); lower runconfig.rows_in_flight "
                            f"(this run: {self._rows_in_flight()}) or the data's max_seq_len, then rerun: it "
                            f"resumes after the files already written") from None

    def _count_remaining(self) -> None:
        """Steps and samples of this run left undone."""
        remaining = [step for step in self.todo if step not in self.written]
        self.stats.batches_remaining = len(remaining)
        self.stats.samples_remaining = sum(self._real_samples(step) for step in remaining)

    def _real_samples(self, step: int) -> int:
        """Samples (not dummy rows) in global step `step`."""
        batch_size = self.params.inference_input.batch_size
        return min(batch_size, self.data.num_samples - (step - 1) * batch_size)

    def _check_forward(self, model: torch.nn.Module, engine: GenerationEngine) -> None:
        """compile_only: one forward pass over the first sample's prompt (one token 0 if it has none)."""
        row = self.data.batch(1).rows[0]
        starts, has_start = start_positions(row[None], self.start_tokens)
        prompt = row[: starts[0]] if has_start[0] and starts[0] > 0 else np.zeros(1, dtype=np.int32)
        tokens = torch.as_tensor(prompt, dtype=torch.long, device=self.device)[None]  # (1, T)
        with torch.inference_mode():
            logits = model(tokens, torch.arange(tokens.shape[1], device=self.device)[None], engine.cache,
                           torch.zeros(1, dtype=torch.long, device=self.device))
        if not torch.isfinite(logits).all():
            raise UserError("compile_only: the forward pass produced non-finite logits; check the checkpoint and dtype")
        log.info("compile_only: params, data and checkpoint are valid; one forward pass gave logits %s; "
                 "no predictions written", tuple(logits.shape))

    def _response_formats(self) -> list[str]:
        """Every response format the job's rows follow: model.json_schema's and the rows' own."""
        own = self.data.row_response_formats()
        return [self.defaults.response_format] + own if self.defaults.response_format else own

    def _assemble(self, batch: Batch) -> tuple[StepAssembly, list[Request]]:
        """Output arrays for a batch, with pass-through rows final, and the requests of the rest."""
        rows = batch.rows
        size, width = rows.shape
        starts, has_start = start_positions(rows, self.start_tokens)
        dummy = batch.sample_index < 0
        generate = has_start & (starts > 0) & ~dummy
        reason = np.where(dummy, DUMMY, np.where(~has_start, NO_START_TOKEN, EMPTY_PROMPT)).astype("<U16")
        prompt_length = np.where(has_start, starts, width).astype(np.int32)
        prompt_length[dummy] = 0
        predictions = rows.copy()
        requests, scored = [], []
        continuation = batch.columns.get("continuation_length", np.zeros(size, int))
        adapters = batch.columns.get("adapter", [""] * size)
        for row in np.flatnonzero(generate):
            prompt = rows[row, : starts[row]]  # its token ids were checked up front
            predictions[row, starts[row]:] = self.pad_token
            if continuation[row] >= starts[row]:
                raise UserError(f"sample {int(batch.sample_index[row])}: its continuation_length {continuation[row]} "
                                f"leaves no context token in its prompt of {starts[row]} tokens")
            adapter = self.adapters.index(adapters[row]) if self.adapters else -1
            if continuation[row]:  # scoring data: the prompt is a context, then the continuation to score
                scored.append(ScoreRequest(int(row), prompt[: -continuation[row]], prompt[-continuation[row]:],
                                           adapter))
            else:
                requests.append(Request(int(batch.sample_index[row]), prompt, batch.options(row, self.defaults),
                                        adapter))
        assembly = StepAssembly(predictions, batch.sample_index, prompt_length, np.zeros(size, dtype=np.int32),
                                reason, remaining=len(requests), sample_id=batch.columns.get("sample_id"),
                                sample=batch.columns.get("sample"),
                                logprobs=(np.zeros(rows.shape, np.float32)
                                          if self.params.model.logprobs or self.scorer is not None else None))
        if self.adapters is not None:  # the adapter each row ran with
            assembly.adapter = np.array([self.adapters.resolved(adapters[row])
                                         if index >= 0 else "" for row, index in enumerate(batch.sample_index)],
                                        dtype=str)
        if self.params.model.top_logprobs:
            assembly.top_logprob_ids = np.zeros((*rows.shape, self.params.model.top_logprobs), np.int32)
            assembly.top_logprobs = np.zeros((*rows.shape, self.params.model.top_logprobs), np.float32)
        if self.scorer is not None:
            self._score(assembly, scored)
        return assembly, requests

    def _score(self, assembly: StepAssembly, requests: list[ScoreRequest]) -> None:
        """Scores a batch's scoring rows (index: the row) into its assembly: each continuation's token log-probabilities
        where its tokens sit, is_greedy, the context as the prompt and the continuation as the tokens after it."""
        assembly.is_greedy = np.zeros(len(assembly.predictions), dtype=bool)
        for score in self.scorer.score(requests):
            row, count = score.index, len(score.logprobs)
            begin = int(assembly.prompt_length[row]) - count
            assembly.prompt_length[row], assembly.num_generated[row] = begin, count
            assembly.fill(row, begin, count, None, score.logprobs, score.top_ids, score.top_logprobs)
            assembly.is_greedy[row] = score.is_greedy
            assembly.stop_reason[row] = SCORED

    def _generate(self, engine: GenerationEngine, steps: list[int], stop: Callable[[], bool]) -> None:
        """Streams the steps' rows through the engine and writes each step's file as soon as its rows are all done:
        a step whose rows all pass through (dummy, no start token, scored) as soon as it is read."""
        batch_size = self.params.inference_input.batch_size
        pending: dict[int, StepAssembly] = {}  # steps read whose rows are not all done
        progress = Progress(len(steps), self.params.runconfig.log_steps, show=self.writes)

        def requests() -> Iterator[Request]:
            """The engine's requests, batch by batch, each batch's output arrays pending until its rows are done."""
            for batch in self.data.batches(steps):
                if stop():
                    return
                pending[batch.step], batch_requests = self._assemble(batch)
                self._write_done(batch.step, pending, progress, engine)
                yield from batch_requests

        start = time.perf_counter()
        for completion in engine.generate(requests(), stop):
            step, row = completion.index // batch_size + 1, completion.index % batch_size
            assembly = pending[step]
            tokens = completion.tokens
            assembly.fill(row, int(assembly.prompt_length[row]), len(tokens), tokens, completion.logprobs,
                          completion.top_ids, completion.top_logprobs)
            assembly.num_generated[row] = len(tokens)
            assembly.stop_reason[row] = completion.reason
            assembly.remaining -= 1
            self._write_done(step, pending, progress, engine)
        self.stats.generation_seconds = time.perf_counter() - start
        self.stats.drafted_tokens, self.stats.accepted_tokens = engine.drafted_tokens, engine.accepted_tokens
        self.stats.prefilled_tokens = engine.prefilled_tokens
        if self.runtime.decode_step is not None:
            self.runtime.decode_step.update(engine.time_split())
        progress.close()

    def _write_done(self, step: int, pending: dict[int, StepAssembly], progress: Progress,
                    engine: GenerationEngine) -> None:
        """Writes step `step` if its rows are all done (the one place a step's file is written from)."""
        if pending[step].remaining == 0:
            self._write(step, pending.pop(step), progress, engine)

    def _write(self, step: int, assembly: StepAssembly, progress: Progress, engine: GenerationEngine) -> None:
        """Writes one complete step (rank 0 of a tensor-parallel group) and counts it (every rank)."""
        if self.writes:
            self.output.write_step(step, assembly.arrays(self.params.model.loop_dim))
        real = assembly.sample_index >= 0
        self.written.add(step)
        self.stats.batches_done += 1
        self.stats.generated_tokens += int(assembly.num_generated[assembly.stop_reason != SCORED].sum())
        self.stats.samples_done += int(real.sum())
        self.stats.rows_without_start_token += int((assembly.stop_reason[real] == NO_START_TOKEN).sum())
        self.stats.rows_with_empty_prompt += int((assembly.stop_reason[real] == EMPTY_PROMPT).sum())
        self.stats.count_reasons(assembly.stop_reason[real])
        progress.update(step, self.stats.samples_done, engine.generated_tokens)

    def _write_summary(self) -> None:
        """artifacts/summary.json (one shard) or summary_shard<i>.json (several) from this run's stats."""
        if self.shard.count == 1:
            write_json(self.artifacts / "summary.json", self._summary([self.stats]))
        else:
            write_json(shard_stats_path(self.artifacts, self.shard.index), asdict(self.stats))

    def _finish(self) -> None:
        """Logs the totals and writes the summary; with several shards, the first one also sums
        every shard's stats into summary.json."""
        log_totals(self.stats)
        if self.writes:
            self._write_summary()
        if self.shard.count == 1:
            return
        if self.stats.interrupted_by is None and self.stats.error is None:
            self.shard.barrier()  # torchrun: rank 0 sums every rank's stats once all are written
        if self.shard.is_first and self.writes:
            stats = read_shard_stats(self.artifacts, self.shard.count)
            write_json(self.artifacts / "summary.json", self._summary(stats))

    def _summary(self, stats: list[RunStats]) -> dict[str, Any]:
        """summary.json's content over `stats` (one per shard), with this process's setup."""
        runtime = self.runtime
        gemm = runtime.gemm.to_dict() if runtime is not None and runtime.gemm else None
        return summary_of(stats, str(self.device), self.plan.policy.describe(), self.shard.count, gemm,
                          self._rows_in_flight(), runtime.decode_step if runtime is not None else None,
                          runtime.setup_parts if runtime is not None else None)

    def _rows_in_flight(self) -> int:
        """The runtime's rows in flight; batch_size before it is open."""
        return self.runtime.rows_in_flight if self.runtime is not None else self.params.inference_input.batch_size

    def _finish_quietly(self) -> None:
        """`_finish` for a run that is failing: a summary that cannot be written only adds a warning."""
        try:
            self._finish()
        except WriteError as error:
            log.warning("the failure could not be recorded in summary.json either: %s", error)


def signal_name(signum: int) -> str:
    """SIGTERM, SIGINT, ..."""
    return signal.Signals(signum).name
