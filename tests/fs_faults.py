"""File-system faults for the failure tests: a small tmpfs (a disk that fills), a read-only view of
a folder, and the run as a real process. Mounting needs root with CAP_SYS_ADMIN (the CI machine's
case); without it a test falls back to what it can do, or skips saying why."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from harness import REPO_ROOT


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


def can_mount() -> bool:
    """Whether this process may mount a tmpfs (root with CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        return False
    probe = Path(f"/tmp/zoo-infer-mount-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        if _mount("-t", "tmpfs", "-o", "size=16k", "tmpfs", str(probe)).returncode != 0:
            return False
        subprocess.run(["umount", str(probe)], check=True)
        return True
    finally:
        probe.rmdir()


@contextlib.contextmanager
def small_disk(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "64k") mounted on `folder` (created) for the block's duration."""
    if not can_mount():
        pytest.skip("needs root with CAP_SYS_ADMIN to mount a small tmpfs")
    folder.mkdir(parents=True, exist_ok=True)
    assert _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)).returncode == 0
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def grow(folder: Path, size: str) -> None:
    """Makes the tmpfs on `folder` larger (the user frees space)."""
    assert _mount("-o", f"remount,size={size}", str(folder)).returncode == 0


def fill(folder: Path) -> None:
    """Writes a file into `folder` until the disk is full."""
    try:
        with open(folder / "filler", "wb", buffering=0) as handle:
            while True:
                handle.write(b"\0" * 4096)
    except OSError:
        pass


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[Path]:
    """`folder` made read-only for the block: a read-only bind mount over itself as root (root
    ignores permission bits), else its permission bits."""
    if can_mount():
        assert _mount("--bind", str(folder), str(folder)).returncode == 0
        try:
            assert _mount("-o", "remount,bind,ro", str(folder)).returncode == 0
            yield folder
        finally:
            subprocess.run(["umount", "-l", str(folder)], check=True)
    elif os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")] if p.is_dir()}
        for path in modes:
            path.chmod(0o555)
        try:
            yield folder
        finally:
            for path, mode in modes.items():
                path.chmod(mode)
    else:
        pytest.skip("root without CAP_SYS_ADMIN can neither mount read-only nor be refused by permission bits")


def start_job(params: Path, model_dir: Path, *flags: str) -> subprocess.Popen:
    """run_inference.py as a real process, as a scheduler would start it (stdout and stderr merged)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(REPO_ROOT / "run_inference.py"), "--params", str(params),
                             "--model_dir", str(model_dir), *flags], env=env, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_process(params: Path, model_dir: Path, *flags: str, timeout: float = 300) -> tuple[int, str, str]:
    """Runs the job as a process to its end: (exit code, stdout, stderr)."""
    process = start_job(params, model_dir, *flags)
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def error_lines(stderr: str) -> list[str]:
    """The `error:` lines of a run's stderr (the log goes there too)."""
    return [line for line in stderr.splitlines() if line.startswith("error:")]
