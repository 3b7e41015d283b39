"""Graceful stop on SIGTERM / SIGINT / SIGUSR1 (what Slurm sends before a kill or at --signal).

While the job sets up (checks, model loading, kernel build, GEMM measurement) nothing it does is
worth finishing: the first signal raises `Interrupted` at once. Once it generates, the first
signal asks it to stop taking rows: batches already complete are on disk, rows in flight are
dropped, and the job exits non-zero within seconds so `--requeue` restarts it and the rerun skips
every step on disk. A second signal exits at once.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
from types import FrameType
from typing import Iterator

log = logging.getLogger("zoo-infer")
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Interrupted(BaseException):
    """A stop signal during set-up. A BaseException, like KeyboardInterrupt, so that no
    `except Exception` fallback on the way (a kernel build, a measurement) swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequest:
    """Installs the handlers; `signum` is the first signal received, None while running."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._raise = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __call__(self) -> bool:
        """True once a stop was requested (the engine polls this between steps)."""
        return self.signum is not None

    @contextlib.contextmanager
    def raising(self) -> Iterator[None]:
        """Within this block a signal raises `Interrupted` instead of setting a flag."""
        self._raise = True
        try:
            if self.signum is not None:
                raise Interrupted(self.signum)
            yield
        finally:
            self._raise = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            os._exit(128 + signum)  # second signal: the user means it
        self.signum = signum
        if self._raise:
            log.warning("received %s while setting up: stopping (nothing was being generated)",
                        signal.Signals(signum).name)
            raise Interrupted(signum)
        log.warning("received %s: stopping; finished batches are on disk, rows in flight are dropped "
                    "(a second signal exits at once)", signal.Signals(signum).name)
