"""Never lose work: kill the job anywhere, rerun, and get exactly the files of an uninterrupted run."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from harness import (REPO_ROOT, SMALL_BATCH, SMALL_SAMPLES, SMALL_STEPS, SMALL_VOCAB, prompt_rows, run_job, small_job,
                     write_h5)

VOCAB, NUM_SAMPLES, BATCH, STEPS = SMALL_VOCAB, SMALL_SAMPLES, SMALL_BATCH, SMALL_STEPS
START = VOCAB


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    """A tiny model, 90 prompts and its params; plus the files of one uninterrupted run."""
    return small_job(tmp_path_factory.mktemp("resume"))


def files(model_dir: Path) -> dict[str, bytes]:
    folder = model_dir / "artifacts" / "predictions"
    return {p.name: p.read_bytes() for p in folder.iterdir()} if folder.is_dir() else {}


def identities(model_dir: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of every finished file: a rewritten file changes both."""
    folder = model_dir / "artifacts" / "predictions"
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.glob("predictions_*.npz")}


def start(params: Path, model_dir: Path, *flags: str) -> subprocess.Popen:
    """run_inference.py as a real process, as a scheduler would start it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(REPO_ROOT / "run_inference.py"), "--params", str(params),
                             "--model_dir", str(model_dir), *flags], env=env, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_files(model_dir: Path, count: int, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(identities(model_dir)) < count and process.poll() is None:
        assert time.monotonic() < deadline, "the job wrote no predictions in time"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def bf16_job(tmp_path_factory) -> dict:
    """The same workload as a bfloat16 job (the bfloat16 policy's GEMMs on an AVX512-BF16 CPU, on AMX tiles where
    they time faster; 16-bit weights' GEMMs elsewhere), whose rows must not depend on which rows shared a step."""
    return small_job(tmp_path_factory.mktemp("resume_bf16"), dtype="bfloat16")


@pytest.mark.parametrize("workload", ["job", "bf16_job"])
def test_sigkill_anywhere_then_rerun_gives_identical_files(workload, tmp_path, request):
    job = request.getfixturevalue(workload)
    model_dir = tmp_path / "run"
    rng = random.Random(1234)
    for kill in range(4):
        before = identities(model_dir)
        process = start(job["params"], model_dir)
        # Kill once a random number of new files exist, plus a random delay: mid-write, mid-step, anywhere.
        wait_for_files(model_dir, len(before) + rng.randint(0, 3), process)
        time.sleep(rng.uniform(0, 0.3))
        process.kill()
        process.wait()
        after = identities(model_dir)
        assert {name: after[name] for name in before} == before, "a finished file was rewritten"
        assert not list((model_dir / "artifacts" / "predictions").glob("predictions_*.tmp"))
    before = identities(model_dir)
    assert 0 < len(before) < STEPS, "the kills should leave a partial run behind"
    process = start(job["params"], model_dir)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    assert f"resuming: {len(before)} of this shard's {STEPS} steps are already on disk and skipped" in output
    after = identities(model_dir)
    assert {name: after[name] for name in before} == before, "a finished file was rewritten"
    assert files(model_dir) == files(job["reference"])


def test_sigterm_stops_within_seconds_and_resumes(job, tmp_path):
    model_dir = tmp_path / "run"
    process = start(job["params"], model_dir)
    wait_for_files(model_dir, 2, process)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    assert time.monotonic() - sent < 10
    assert process.returncode == 128 + signal.SIGTERM, output
    assert "received SIGTERM: stopping" in output and "run the same command again to resume" in output
    summary = json.loads((model_dir / "artifacts" / "summary.json").read_text())
    assert summary["status"] == "interrupted by SIGTERM"
    assert summary["batches_done"] + summary["batches_remaining"] == STEPS
    assert summary["batches_done"] == len(identities(model_dir))
    assert run_job(job["params"], model_dir) == 0
    assert files(model_dir) == files(job["reference"])
    summary = json.loads((model_dir / "artifacts" / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["batches_skipped"] + summary["batches_done"] == STEPS


def test_damaged_file_is_redone(job, tmp_path):
    model_dir = tmp_path / "run"
    assert run_job(job["params"], model_dir, "--inference_steps", "3") == 0
    damaged = model_dir / "artifacts" / "predictions" / "predictions_2.npz"
    damaged.write_bytes(damaged.read_bytes()[:100])
    assert run_job(job["params"], model_dir) == 0
    assert files(model_dir) == files(job["reference"])


def test_changed_inputs_are_refused_unless_overwrite(job, tmp_path, capsys):
    model_dir = tmp_path / "run"
    assert run_job(job["params"], model_dir, "--inference_steps", "2") == 0
    changed = tmp_path / "changed.yaml"
    changed.write_text(job["params"].read_text().replace("max_tokens: 40", "max_tokens: 5"))
    capsys.readouterr()
    assert run_job(changed, model_dir) == 2
    err = capsys.readouterr().err
    assert "holds predictions made from different inputs (changed: model.max_tokens)" in err and "--overwrite" in err
    assert run_job(changed, model_dir, "--inference_steps", "2", "--overwrite") == 0
    with np.load(model_dir / "artifacts" / "predictions" / "predictions_1.npz") as npz:
        assert npz["num_generated"].max() == 5
    assert run_job(changed, model_dir, "--inference_steps", "2") == 0  # same inputs now: resumes


def test_changed_data_is_refused(job, tmp_path, capsys):
    model_dir = tmp_path / "run"
    assert run_job(job["params"], model_dir, "--inference_steps", "1") == 0
    write_h5(tmp_path / "data", prompt_rows([[1, 2, 3]] * 5, 64, START))
    other = tmp_path / "other.yaml"
    other.write_text(job["params"].read_text().replace(str(job["data"]), str(tmp_path / "data")))
    capsys.readouterr()
    assert run_job(other, model_dir) == 2
    assert "(changed: data)" in capsys.readouterr().err


def test_job_array_shards_equal_one_process(job, tmp_path):
    model_dir = tmp_path / "run"
    for index in range(3):
        assert run_job(job["params"], model_dir, "--num_shards", "3", "--shard_index", str(index)) == 0
        steps = sorted(int(n.split("_")[1].split(".")[0]) for n in files(model_dir))
        assert all((s - 1) % 3 <= index for s in steps)
    assert files(model_dir) == files(job["reference"])
    summary = json.loads((model_dir / "artifacts" / "summary.json").read_text())
    assert summary["shards_reporting"] == "1/3"  # shard 0 finished first; the others report in their own files
    assert sorted(p.name for p in (model_dir / "artifacts").glob("summary_shard*.json")) == [
        "summary_shard0.json", "summary_shard1.json", "summary_shard2.json"]


@pytest.mark.parametrize("flags, message", [
    (["--num_shards", "2"], "--num_shards and --shard_index go together"),
    (["--num_shards", "2", "--shard_index", "2"], "--shard_index must be in 0..1"),
])
def test_bad_shard_flags(job, tmp_path, capsys, flags, message):
    assert run_job(job["params"], tmp_path / "run", *flags) == 2
    assert message in capsys.readouterr().err


def test_torchrun_two_processes_equal_one(job, tmp_path):
    model_dir = tmp_path / "run"
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run([str(torchrun), "--nproc_per_node=2", "--master_port=29517",
                             str(REPO_ROOT / "run_inference.py"), "--params", str(job["params"]),
                             "--model_dir", str(model_dir)], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert files(model_dir) == files(job["reference"])
    summary = json.loads((model_dir / "artifacts" / "summary.json").read_text())
    assert summary["shards_reporting"] == "2/2" and summary["status"] == "complete"
    assert summary["samples_done"] == NUM_SAMPLES and summary["batches_done"] == STEPS
