"""Every file the job writes goes through here: whole or not at all, and a file-system failure
(disk full, read-only folder, quota) becomes one `WriteError` naming the path and the errno.

A file is written under a temp name in its own folder (`.<name>.<host>.<pid>.tmp`), flushed,
fsynced, renamed into place, and the folder fsynced, so SIGKILL at any moment leaves either the
old file or the new one. A failed write removes its temp file.
"""
from __future__ import annotations

import errno
import os
import re
import socket
from pathlib import Path
from typing import BinaryIO, Callable

from modelzoo.errors import UserError

_TEMP = re.compile(r"^\..+\.(?P<host>[^.]+)\.(?P<pid>\d+)\.tmp$")


class WriteError(UserError):
    """The output folder refused a write: reported as one line, like any input problem."""


def describe(error: OSError) -> str:
    """'No space left on device (errno ENOSPC)' (the system's words: h5py's own are a paragraph)."""
    if not error.errno:
        return str(error)
    return f"{os.strerror(error.errno)} (errno {errno.errorcode.get(error.errno, error.errno)})"


def temp_path(path: Path) -> Path:
    """The temp name of `path` for this process (the host keeps shards on several nodes apart)."""
    return path.with_name(f".{path.name}.{socket.gethostname().split('.')[0]}.{os.getpid()}.tmp")


def fsync_folder(folder: Path) -> None:
    """Makes a rename inside `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Calls `write(handle)` on a temp file, then renames it to `path`; raises WriteError on failure."""
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_folder(path.parent)
    except OSError as error:
        raise WriteError(f"cannot write {path}: {describe(error)}") from None
    finally:  # also on an interrupt: no temp file outlives its writer
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def write_text_atomic(path: Path, text: str) -> None:
    """Writes text atomically."""
    write_atomic(path, lambda handle: handle.write(text.encode()))


def overwrite_in_place(path: Path, text: str) -> None:
    """Rewrites an existing small file in place: the last resort on a full disk, where a temp file
    cannot get a block but the file's own block, freed by the truncation, can be reused."""
    try:
        with open(path, "r+b") as handle:
            handle.truncate(0)
            handle.write(text.encode())
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        raise WriteError(f"cannot write {path}: {describe(error)}") from None


def make_folder(path: Path) -> None:
    """mkdir -p, with the reason in a WriteError when it cannot be made."""
    if path.exists() and not path.is_dir():
        raise WriteError(f"{path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise WriteError(f"cannot create the folder {path}: {describe(error)}") from None


def remove(path: Path) -> None:
    """Deletes a file if present; a WriteError when the folder refuses."""
    try:
        path.unlink(missing_ok=True)
    except OSError as error:
        raise WriteError(f"cannot remove {path}: {describe(error)}") from None


def remove_dead_temps(folder: Path, name: str = "*") -> int:
    """Removes temp files left in `folder` by killed writers of this host; returns how many. name: only the temp
    files of that file (a glob; default: every file's).

    A temp file names its writer's host and pid: one of this host whose process is gone is dead;
    those of other hosts are left alone (their writers may still be running).
    """
    host, removed = socket.gethostname().split(".")[0], 0
    for path in folder.glob(f".{name}.*.*.tmp"):
        match = _TEMP.match(path.name)
        if match and match["host"] == host and not _alive(int(match["pid"])):
            remove(path)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    """Whether a process of this host has `pid` (a reused pid counts as alive: the safe side)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
