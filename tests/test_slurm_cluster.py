"""The local Slurm test cluster itself, and the sbatch templates of scripts/slurm on it.

The templates run against a stub run_inference.py (it records its arguments and environment, and
answers SIGTERM like the runner: exit 143), so these tests check the Slurm plumbing in seconds:
srun task ranks, job arrays, shard flags, torchrun ranks, and SIGTERM -> runner stops -> requeue ->
the next run starts with SLURM_RESTART_COUNT=1.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_cluster import (REPO, SETUP_SCRIPT, SlurmJobError, clean_env, ensure_slurm, job_info, sbatch,
                           sbatch_wait, srun, wait_for_job)

pytestmark = pytest.mark.slurm

TEMPLATES = REPO / "scripts" / "slurm"

STUB_RUNNER = '''\
"""Stands in for run_inference.py: appends one JSON line per event to calls.jsonl."""
import json, os, signal, sys, time

KEYS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_RESTART_COUNT", "SLURM_ARRAY_TASK_ID", "RANK", "WORLD_SIZE")
record = {"argv": sys.argv[1:], "pid": os.getpid(), **{k: os.environ.get(k) for k in KEYS}}


def log(event):
    with open("calls.jsonl", "a") as f:
        f.write(json.dumps({**record, "event": event}) + "\\n")


def on_term(signum, frame):
    log("term")
    sys.exit(143)  # what the runner does after writing the batches in flight


signal.signal(signal.SIGTERM, on_term)
log("start")
if os.environ.get("STUB_BLOCK_FIRST_RUN") and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
    open("started" + os.environ.get("SLURM_ARRAY_TASK_ID", ""), "w").close()
    time.sleep(300)
    log("not stopped")
    sys.exit(1)
log("done")
'''


@pytest.fixture(scope="module", autouse=True)
def _cluster() -> None:
    ensure_slurm()


@pytest.fixture
def submit_dir(tmp_path: Path) -> Path:
    """A submit dir like the repository root: run_inference.py (the stub), .venv/bin/activate, logs/."""
    (tmp_path / "run_inference.py").write_text(STUB_RUNNER)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    # The stub's "venv" puts the interpreter running the tests (and its torchrun) first on PATH.
    (tmp_path / ".venv" / "bin" / "activate").write_text(f'export PATH="{Path(sys.executable).parent}:$PATH"\n')
    (tmp_path / "logs").mkdir()
    return tmp_path


def read_calls(submit_dir: Path) -> list[dict]:
    path = submit_dir / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def logs_text(submit_dir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((submit_dir / "logs").iterdir()))


def test_srun_two_tasks_get_ranks_0_and_1(tmp_path: Path) -> None:
    proc = srun(["bash", "-c", 'echo "$SLURM_PROCID $SLURM_NTASKS $(hostname -s)"'], tmp_path, ntasks=2)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout
    assert sorted(line.split()[0] for line in lines) == ["0", "1"]
    assert {line.split()[1] for line in lines} == {"2"}


def test_job_array_writes_one_file_per_task(tmp_path: Path) -> None:
    script = tmp_path / "task.sh"
    script.write_text('#!/bin/bash\necho "$SLURM_ARRAY_TASK_COUNT" > "task_${SLURM_ARRAY_TASK_ID}.txt"\n')
    sbatch_wait(["--array=0-1", f"--output={tmp_path}/%A_%a.out", str(script)], cwd=tmp_path)
    assert sorted(p.name for p in tmp_path.glob("task_*.txt")) == ["task_0.txt", "task_1.txt"]
    assert {p.read_text().strip() for p in tmp_path.glob("task_*.txt")} == {"2"}


def test_failed_job_raises_with_its_output(tmp_path: Path) -> None:
    with pytest.raises(SlurmJobError, match="something went wrong"):
        sbatch_wait([f"--output={tmp_path}/%j.out", "--wrap", "echo something went wrong; exit 3"], cwd=tmp_path)


def term_and_requeue(job: str, started: Path) -> dict[str, str]:
    """Once the stub has started, does what --signal=B:TERM@120 does; returns the job's final record."""
    deadline = time.monotonic() + 120
    while not started.exists():
        assert time.monotonic() < deadline, f"first run never started: {job_info(job)}"
        time.sleep(0.2)
    # SIGTERM to the batch shell only, as Slurm does 120 s before the time limit.
    subprocess.run(["scancel", "--batch", "--signal=TERM", job], check=True, env=clean_env())
    wait_for_job(job, lambda i: i.get("JobState") == "PENDING" and int(i.get("Restarts", 0)) >= 1)
    # A requeued job waits ~2 min before it is eligible again; start it now, but not within the
    # second the old run's credential was revoked (slurmd would kill the new run as "revoked").
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"jobid={job}", "starttime=now"], check=True, env=clean_env())
    return wait_for_job(job, lambda i: i.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))


def test_one_node_template_stops_on_term_and_requeues(submit_dir: Path) -> None:
    job = sbatch([str(TEMPLATES / "run_inference.sbatch"), "params/my.yaml", "runs/eval1", "--inference_steps", "2"],
                 cwd=submit_dir, env={"STUB_BLOCK_FIRST_RUN": "1"})
    try:
        info = term_and_requeue(job, submit_dir / "started")
    finally:
        subprocess.run(["scancel", job], env=clean_env(), check=False, capture_output=True)
    assert info["JobState"] == "COMPLETED", logs_text(submit_dir)
    calls = read_calls(submit_dir)
    assert [(c["SLURM_RESTART_COUNT"], c["event"]) for c in calls] == [
        (None, "start"), (None, "term"), ("1", "start"), ("1", "done")], logs_text(submit_dir)
    assert calls[0]["argv"] == ["--params", "params/my.yaml", "--model_dir", "runs/eval1", "--inference_steps", "2"]
    log = logs_text(submit_dir)
    assert "requeued" in log and "run 2" in log  # one log, appended to by both runs


def test_array_template_requeues_only_the_signalled_task(submit_dir: Path) -> None:
    # Task 1's SLURM_JOB_ID is also the array's id: signalling or requeueing "that job" would hit both.
    array = sbatch(["--array=0-1", str(TEMPLATES / "run_inference_array.sbatch"), "p.yaml", "runs/x"],
                   cwd=submit_dir, env={"STUB_BLOCK_FIRST_RUN": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (submit_dir / "started0").exists():
            assert time.monotonic() < deadline, f"task 0 never started: {job_info(array + '_0')}"
            time.sleep(0.2)
        info = term_and_requeue(f"{array}_1", submit_dir / "started1")
        task0 = job_info(f"{array}_0")
        calls = read_calls(submit_dir)
    finally:
        subprocess.run(["scancel", array], env=clean_env(), check=False, capture_output=True)
    assert info["JobState"] == "COMPLETED", logs_text(submit_dir)
    assert task0["JobState"] == "RUNNING" and task0.get("Restarts") == "0", logs_text(submit_dir)
    events = sorted((c["SLURM_ARRAY_TASK_ID"], c["SLURM_RESTART_COUNT"] or "0", c["event"]) for c in calls)
    assert events == [("0", "0", "start"), ("1", "0", "start"), ("1", "0", "term"), ("1", "1", "done"),
                      ("1", "1", "start")], logs_text(submit_dir)


def test_array_template_passes_shard_flags(submit_dir: Path) -> None:
    job = sbatch_wait(["--array=0-1", str(TEMPLATES / "run_inference_array.sbatch"), "p.yaml", "runs/x"],
                      cwd=submit_dir)
    starts = [c for c in read_calls(submit_dir) if c["event"] == "start"]
    assert sorted(c["argv"] for c in starts) == [
        ["--params", "p.yaml", "--model_dir", "runs/x", "--num_shards", "2", "--shard_index", str(i)] for i in (0, 1)]
    assert sorted(p.name for p in (submit_dir / "logs").iterdir()) == [
        f"zoo-infer-array-{job}_{i}.out" for i in (0, 1)]  # %x-%A_%a


def test_torchrun_template_starts_ranks(submit_dir: Path) -> None:
    if shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("no torchrun next to the test interpreter")
    sbatch_wait(["--nodes=1", str(TEMPLATES / "run_inference_torchrun.sbatch"), "p.yaml", "runs/x"],
                cwd=submit_dir, env={"ZOO_INFER_NPROC_PER_NODE": "2"})
    done = [c for c in read_calls(submit_dir) if c["event"] == "done"]
    assert sorted((c["RANK"], c["WORLD_SIZE"]) for c in done) == [("0", "2"), ("1", "2")], logs_text(submit_dir)
    assert done[0]["argv"] == ["--params", "p.yaml", "--model_dir", "runs/x"]


def test_setup_script_is_idempotent_and_quick() -> None:
    start = time.monotonic()
    proc = subprocess.run(["bash", str(SETUP_SCRIPT)], capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert "already up" in proc.stdout, proc.stdout + proc.stderr
    assert elapsed < 5, f"second run took {elapsed:.1f}s"  # < 2 s on an idle machine
