"""A real local Slurm for the HPC tests (a helper module, not a test file).

`ensure_slurm()` runs scripts/slurm/setup_local_slurm.sh once per test session: as root it installs
Debian's slurm-wlm and munge where missing and starts a one-node cluster (partition `debug`); the
daemons are left running for the next session, which then finds everything up in well under 2 s.
Not root, or a setup that cannot work here, skips the test with the script's one-line reason
(ZOO_INFER_REQUIRE_SLURM=1 turns that skip into a failure, for CI machines that must test Slurm).

`sbatch_wait`, `sbatch` and `srun` submit with a clean environment: SLURM_* variables of an outer
allocation (pytest itself run inside a Slurm job) would otherwise leak into the local cluster's jobs.
"""
from __future__ import annotations

import functools
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SETUP_SCRIPT = REPO / "scripts" / "slurm" / "setup_local_slurm.sh"
SETUP_TIMEOUT_S = 900  # a first install downloads ~20 MB of packages


class SlurmJobError(RuntimeError):
    """A job that failed, was cancelled or ran out of time; the message holds its output."""


@functools.cache
def _setup_failure() -> str | None:
    """Runs the setup script (once per process); returns why Slurm is unavailable, or None."""
    if os.geteuid() != 0:
        return "local Slurm needs root: scripts/slurm/setup_local_slurm.sh installs packages and starts daemons"
    try:
        proc = subprocess.run(["bash", str(SETUP_SCRIPT)], capture_output=True, text=True,
                              timeout=SETUP_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"{SETUP_SCRIPT.name} did not finish in {SETUP_TIMEOUT_S}s"
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "ERROR:" in line]
    return (errors or lines or [f"{SETUP_SCRIPT.name} exited {proc.returncode}"])[-1]


def ensure_slurm() -> None:
    """Makes sure the local cluster is up, or skips the calling test with the reason why not."""
    reason = _setup_failure()
    if reason is None:
        return
    if os.environ.get("ZOO_INFER_REQUIRE_SLURM") == "1":
        pytest.fail(f"local Slurm unavailable: {reason}")
    pytest.skip(f"local Slurm unavailable: {reason}")


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ without the variables of an outer Slurm allocation, plus `extra`."""
    prefixes = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(extra or {})
    return env


def job_records(job_id: str) -> list[dict[str, str]]:
    """`scontrol show job -o` as dicts, one per record (an array job has one per task); [] once purged."""
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                          env=clean_env())
    records = []
    for line in proc.stdout.splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if fields:
            records.append(fields)
    return records


def job_info(job_id: str) -> dict[str, str]:
    """The first record of `scontrol show job -o JOB_ID` (JobState, Restarts, StdOut...), {} if none."""
    records = job_records(job_id)
    return records[0] if records else {}


def job_output(job_id: str, max_chars: int = 4000) -> str:
    """The end of each output/error file of the job (every task of an array), for error messages."""
    parts = []
    paths = dict.fromkeys(rec[key] for rec in job_records(job_id) for key in ("StdOut", "StdErr") if rec.get(key))
    for path in paths:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError as exc:
            text = f"<unreadable: {exc}>"
        parts.append(f"--- {path}\n{text[-max_chars:]}")
    return "\n".join(parts) or "<no output file known>"


def sbatch(script_or_args: list[str], cwd: str | os.PathLike[str], env: dict[str, str] | None = None) -> str:
    """Submits without waiting (`sbatch --parsable ...`) and returns the job id."""
    proc = subprocess.run(["sbatch", "--parsable", *script_or_args], cwd=cwd, capture_output=True, text=True,
                          env=clean_env(env), timeout=60)
    if proc.returncode != 0:
        raise SlurmJobError(f"sbatch {' '.join(script_or_args)} refused the job: {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]


def sbatch_wait(script_or_args: list[str], cwd: str | os.PathLike[str], timeout: float = 300,
                env: dict[str, str] | None = None) -> str:
    """Submits with `sbatch --parsable --wait ...`, waits for the end, and returns the job id.

    Raises SlurmJobError, with the job's output files, when the job (any array task) fails, and
    cancels it when it runs past `timeout` seconds.
    """
    cmd = ["sbatch", "--parsable", "--wait", *script_or_args]
    proc = subprocess.Popen(cmd, cwd=cwd, env=clean_env(env), text=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    job_id = proc.stdout.readline().strip().split(";")[0]  # printed at submission, before the wait
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if job_id:
            subprocess.run(["scancel", job_id], env=clean_env(), check=False)
        proc.kill()
        proc.communicate()
        raise SlurmJobError(f"job {job_id or '?'} ({' '.join(cmd)}) still running after {timeout}s; "
                            f"cancelled\n{job_output(job_id) if job_id else ''}") from None
    if not job_id:
        raise SlurmJobError(f"sbatch refused the job ({' '.join(cmd)}): {stderr.strip()}")
    if proc.returncode != 0:
        states = ", ".join(f"{r.get('JobId')}: {r.get('JobState')} exit {r.get('ExitCode')}"
                           for r in job_records(job_id))
        raise SlurmJobError(f"job {job_id} failed (sbatch --wait exit {proc.returncode}; {states}) "
                            f"{stderr.strip()}\n{job_output(job_id)}")
    return job_id


def srun(args: list[str], cwd: str | os.PathLike[str], ntasks: int = 1, timeout: float = 120,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs `srun --ntasks=N ARGS...` (a job of its own) and returns the finished process, text mode.

    `--overcommit` lets a test ask for more tasks than the node has CPUs; the return code is not
    checked (look at `.returncode`).
    """
    cmd = ["srun", f"--ntasks={ntasks}", "--overcommit", "--kill-on-bad-exit=1", *args]
    return subprocess.run(cmd, cwd=cwd, env=clean_env(env), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def wait_for_job(job_id: str, predicate: Callable[[dict[str, str]], bool], timeout: float = 120,
                 poll_s: float = 0.2) -> dict[str, str]:
    """Polls `job_info(job_id)` until `predicate(info)` holds; returns that info, or raises TimeoutError."""
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if info and predicate(info):
            return info
        time.sleep(poll_s)
    raise TimeoutError(f"job {job_id}: condition not met after {timeout}s; last state {info.get('JobState')}, "
                       f"reason {info.get('Reason')}\n{job_output(job_id)}")
