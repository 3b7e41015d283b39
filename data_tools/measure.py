"""Runs a command as a child process and measures it from the outside: exit code, wall time, peak RSS."""
from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Measured:
    """What is measured of one child process from the outside."""

    returncode: int
    process_seconds: float
    peak_rss_mib: float


def run_measured(command: list[str], log_path: Path, timeout_s: float | None = None,
                 cwd: Path | None = None) -> Measured:
    """Runs `command` (output to `log_path`); returns exit code, wall seconds and peak RSS (MiB).

    os.wait4 gives the resource usage of exactly this child (with the children it waited for), so
    other processes on the machine do not enter the number. A child still running after
    `timeout_s` is killed.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        timer = threading.Timer(timeout_s, proc.kill) if timeout_s else None
        if timer:
            timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            if timer:
                timer.cancel()
        seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # the child is reaped; tell Popen
    return Measured(proc.returncode, seconds, usage.ru_maxrss / 1024)  # Linux: KiB
