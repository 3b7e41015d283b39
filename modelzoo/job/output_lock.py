"""One job per shard per output folder: an advisory `flock` on `artifacts/.lock.shard<i>-of-<k>`.

Two identical jobs started into one model_dir would both compute every step and race on the
files; the second one now stops with an error naming the first one's host and pid. Shards of a
job array and data-parallel ranks own different steps, hence different lock files, and still
share the folder. The kernel drops the lock when its holder exits, however it exits (SIGKILL
included), so a stale lock never blocks a rerun. (On NFS, Linux maps flock to POSIX locks; on
Lustre it needs the `flock` mount option, without which the lock is taken locally only.)
"""
from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from modelzoo.errors import UserError
from modelzoo.files import WriteError, describe


class OutputLock:
    """The lock of one shard's steps in an artifacts folder; held until the process exits."""

    def __init__(self, artifacts: Path, shard_index: int, shard_count: int) -> None:
        self.path = artifacts / f".lock.shard{shard_index}-of-{shard_count}"
        self.fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock and records the holder. A WriteError where the folder cannot be written
        (read-only, no permission); a UserError naming the holder where another job has it."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise WriteError(f"cannot write to {self.path.parent}: {describe(error)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "a process that has not said who it is"
            os.close(fd)
            raise UserError(f"{self.path.parent.parent} is in use: another job ({holder}) is running the same steps "
                            "there; wait for it to end, or use another --model_dir") from None
        self.fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # a full disk: the lock holds all the same; the first real write will say why it fails

    def close(self) -> None:
        """Drops the lock (the file stays: deleting it would race with a job about to lock it)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
