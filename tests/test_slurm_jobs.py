"""The real runner under a real (local) Slurm: a 2-task srun job, a 2-task job array through the
sbatch template, and a preempted-then-requeued job all give the files of one plain process."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from harness import REPO_ROOT, prompt_rows, run_job, save_tiny_model, write_h5, write_params
from slurm_cluster import ensure_slurm, sbatch, sbatch_wait, srun, wait_for_job
from tiny_configs import tiny_llama_config

pytestmark = pytest.mark.slurm
VOCAB = 64
STEPS = 10


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict[str, Path]:
    """Tiny model, 38 prompts in 10 steps of 4 (4 rows in flight: files appear one after another, as in a
    long job), params, and the files of one uninterrupted process."""
    ensure_slurm()
    root = tmp_path_factory.mktemp("slurm_jobs")
    config = tiny_llama_config(vocab_size=VOCAB, num_hidden_layers=2)
    checkpoint = save_tiny_model(config, root / "ckpt")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, size=rng.integers(1, 16)).tolist() for _ in range(38)]
    write_h5(root / "data", prompt_rows(prompts, 96, VOCAB))
    params = write_params(root / "params.yaml", checkpoint, root / "data", batch_size=4, start_token=VOCAB,
                          max_tokens=60, log_steps=1, rows_in_flight=4)
    assert run_job(params, root / "reference") == 0
    return {"root": root, "params": params, "reference": root / "reference"}


def files(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (model_dir / "artifacts" / "predictions").glob("predictions_*.npz")}


def test_srun_two_tasks_equal_one_process(job):
    model_dir = job["root"] / "srun"
    result = srun([sys.executable, str(REPO_ROOT / "run_inference.py"), "--params", str(job["params"]),
                   "--model_dir", str(model_dir)], cwd=REPO_ROOT, ntasks=2, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "shard 0 of 2" in result.stderr and "shard 1 of 2" in result.stderr
    assert files(model_dir) == files(job["reference"])


def test_job_array_template_equals_one_process(job):
    model_dir = job["root"] / "array"
    logs = job["root"] / "logs"
    logs.mkdir()
    sbatch_wait(["--array=0-1", f"--output={logs}/%x-%A_%a.out", str(REPO_ROOT / "scripts/slurm/run_inference_array.sbatch"),
                 str(job["params"]), str(model_dir)], cwd=REPO_ROOT, timeout=300)
    assert files(model_dir) == files(job["reference"])
    for log in logs.iterdir():
        assert "shard" in log.read_text()


def test_preempted_job_is_requeued_and_resumes(job):
    """SIGTERM to the batch script (what --signal=B:TERM@120 sends before the time limit): the runner
    stops, the template requeues the job, and the second run skips the steps on disk."""
    model_dir = job["root"] / "requeue"
    log = job["root"] / "requeue.log"
    job_id = sbatch([f"--output={log}", str(REPO_ROOT / "scripts/slurm/run_inference.sbatch"), str(job["params"]),
                     str(model_dir)], cwd=REPO_ROOT)
    predictions = model_dir / "artifacts" / "predictions"
    deadline = time.monotonic() + 180
    while not list(predictions.glob("predictions_*.npz")):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.05)
    subprocess.run(["scancel", "--batch", "--signal=TERM", job_id], check=True)
    wait_for_job(job_id, lambda info: info.get("JobState") == "PENDING" and int(info.get("Restarts", "0")) >= 1,
                 timeout=120)
    # Skip Slurm's requeue delay, but not within the second the old run's credential was revoked
    # (slurmd compares at one-second resolution and would kill the new run as "credential revoked").
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"jobid={job_id}", "starttime=now"], check=True)
    wait_for_job(job_id, lambda info: info.get("JobState") == "COMPLETED", timeout=300)
    text = log.read_text()
    assert "interrupted by SIGTERM" in text and "requeued" in text
    assert "steps are already on disk and skipped" in text
    assert files(model_dir) == files(job["reference"])
