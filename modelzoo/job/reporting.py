"""What a run tells its user: progress while it runs, `artifacts/summary.json` when it ends."""
from __future__ import annotations

import json
import logging
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import modelzoo
from modelzoo.files import WriteError, overwrite_in_place, write_text_atomic

log = logging.getLogger("zoo-infer")


@dataclass
class RunStats:
    """Counters of one process's run (one shard)."""

    samples_done: int = 0
    samples_skipped: int = 0  # already on disk from an earlier run
    samples_remaining: int = 0
    batches_done: int = 0
    batches_skipped: int = 0
    batches_remaining: int = 0
    generated_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens run through the model (a shared prefix or a repeated prompt once)
    generation_seconds: float = 0.0
    setup_seconds: float = 0.0  # loading, GEMM choice, kernel builds, compilation and capture: before generation
    rows_without_start_token: int = 0
    rows_with_empty_prompt: int = 0
    stop_reasons: dict[str, int] = field(default_factory=dict)
    interrupted_by: str | None = None  # signal name when the run was stopped early
    error: str | None = None  # the error line of a run that failed
    finished: bool = False  # False while the run is going (or if it was killed)
    drafted_tokens: int = 0  # speculative decoding: tokens proposed for verification
    accepted_tokens: int = 0  # ... and accepted by the model

    def count_reasons(self, reasons: Any) -> None:
        """Adds the stop reasons of the real rows of one written batch."""
        for reason in reasons:
            self.stop_reasons[str(reason)] = self.stop_reasons.get(str(reason), 0) + 1


def _versions() -> dict[str, str]:
    import transformers

    return {"zoo-infer": modelzoo.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def summary_of(stats: list[RunStats], device: str, dtype: str, shards: int,
               gemm: dict[str, Any] | None = None, rows_in_flight: int | None = None,
               decode_step: dict[str, Any] | None = None, setup_parts: dict[str, float] | None = None) -> dict[str, Any]:
    """One summary over the stats of every shard (shards run side by side: seconds is the longest);
    `gemm`: the GEMM backends chosen for this process's weights, with the rates measured;
    `rows_in_flight`: the rows this process generated together; `decode_step`: how its decode step ran;
    `setup_parts`: this process's set-up seconds by part (Runtime.setup_parts)."""
    total: dict[str, Any] = {}
    for key in ("samples_done", "samples_skipped", "samples_remaining", "batches_done", "batches_skipped",
                "batches_remaining", "generated_tokens", "prefilled_tokens", "rows_without_start_token", "rows_with_empty_prompt",
                "drafted_tokens", "accepted_tokens"):
        total[key] = sum(getattr(s, key) for s in stats)
    seconds = max((s.generation_seconds for s in stats), default=0.0)
    reasons: dict[str, int] = {}
    for s in stats:
        for reason, count in s.stop_reasons.items():
            reasons[reason] = reasons.get(reason, 0) + count
    interrupted = sorted({s.interrupted_by for s in stats if s.interrupted_by})
    errors = [s.error for s in stats if s.error]
    if errors:
        status = "failed"
    elif interrupted:
        status = "interrupted by " + ", ".join(interrupted)
    elif not all(s.finished for s in stats):
        status = "running"
    else:
        status = "complete" if total["batches_remaining"] == 0 and len(stats) == shards else "partial"
    return {
        "status": status,
        **({"errors": errors} if errors else {}),
        **total,
        "generation_seconds": round(seconds, 3),
        "setup_seconds": round(max((s.setup_seconds for s in stats), default=0.0), 3),
        "setup_parts": setup_parts,
        "tokens_per_second": round(total["generated_tokens"] / seconds, 2) if seconds else 0.0,
        "speculative_acceptance_rate": (round(total["accepted_tokens"] / total["drafted_tokens"], 4)
                                        if total["drafted_tokens"] else None),
        "stop_reasons": reasons, "shards_reporting": f"{len(stats)}/{shards}",
        "device": device, "dtype": dtype, "rows_in_flight": rows_in_flight, "decode_step": decode_step, "gemm": gemm,
        "versions": _versions(),
    }


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Writes JSON atomically (readers never see half a file). On a disk too full for a temp file,
    an existing file is rewritten in place, so a run that fails for want of space still says so: only the
    blocks the file already holds can be written then, so it is written compact, and without the GEMM
    rates (gemm_choices.json keeps them) where it would not fit otherwise."""
    text = json.dumps(payload, indent=2) + "\n"
    try:
        write_text_atomic(path, text)
    except WriteError:
        if not path.is_file():
            raise
        room = path.stat().st_blocks * 512
        compact = json.dumps(payload, separators=(",", ":")) + "\n"
        if len(compact.encode()) > room and isinstance(payload.get("gemm"), dict):
            payload = {**payload, "gemm": {key: value for key, value in payload["gemm"].items() if key != "measured"}}
            compact = json.dumps(payload, separators=(",", ":")) + "\n"
        overwrite_in_place(path, compact)


def shard_stats_path(artifacts: Path, index: int) -> Path:
    return artifacts / f"summary_shard{index}.json"


def read_shard_stats(artifacts: Path, shards: int) -> list[RunStats]:
    """The per-shard stats files present (a shard that has not started yet has none)."""
    stats = []
    for index in range(shards):
        path = shard_stats_path(artifacts, index)
        if path.is_file():
            stats.append(RunStats(**json.loads(path.read_text())))
    return stats


def log_totals(stats: RunStats) -> None:
    """The closing log lines of one process."""
    rate = stats.generated_tokens / stats.generation_seconds if stats.generation_seconds else 0.0
    log.info("%s: %d samples in %d steps written (%d steps skipped as already done, %d remaining), "
             "%d generated tokens in %.1fs (%.1f tokens/s; set-up before that %.1fs); stop reasons %s",
             "interrupted" if stats.interrupted_by else "done", stats.samples_done, stats.batches_done,
             stats.batches_skipped, stats.batches_remaining, stats.generated_tokens, stats.generation_seconds,
             rate, stats.setup_seconds, stats.stop_reasons)
    if stats.drafted_tokens:
        log.info("speculative decoding: %d of %d drafted tokens accepted (%.1f%%)", stats.accepted_tokens,
                 stats.drafted_tokens, 100 * stats.accepted_tokens / stats.drafted_tokens)
    if stats.rows_without_start_token or stats.rows_with_empty_prompt:
        log.warning("%d rows had no start token and %d an empty prompt: left as they are, nothing generated",
                    stats.rows_without_start_token, stats.rows_with_empty_prompt)


class Progress:
    """tqdm on a terminal; in a log file (a batch job), one line every `log_steps` written steps."""

    def __init__(self, total_steps: int, log_steps: int, show: bool = True) -> None:
        self.total, self.log_steps, self.done = total_steps, log_steps, 0
        self.start = time.perf_counter()
        self.bar = None
        self.show = show  # False: count silently (tensor-parallel ranks other than 0)
        if show and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, unit="step", desc="inference")

    def update(self, step: int, samples: int, generated_tokens: int) -> None:
        """Called after each predictions file, with this run's totals so far."""
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            return
        if self.show and (self.done % self.log_steps == 0 or self.done == self.total):
            elapsed = max(time.perf_counter() - self.start, 1e-9)
            eta = elapsed / self.done * (self.total - self.done)
            log.info("step %d: %d/%d steps written, %.2f samples/s, %.1f generated tokens/s, ETA %.0fs", step,
                     self.done, self.total, samples / elapsed, generated_tokens / elapsed, eta)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

