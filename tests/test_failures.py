"""Failures an HPC job meets (a full disk, a read-only folder, damaged files, a second job, a signal
while loading, SIGKILL anywhere): one `error:` line or a clean stop, summary.json saying what
happened, no temp file left, and a rerun that ends with the files of an uninterrupted run."""
from __future__ import annotations

import json
import logging
import os
import random
import signal
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fs_faults import error_lines, fill, grow, read_only, run_process, small_disk, start_job
from harness import (SMALL_BATCH, SMALL_SAMPLES, SMALL_STEPS, SMALL_VOCAB, prompt_rows, run_job, small_job, write_h5,
                     write_params)
from modelzoo.runtime import Runtime

VOCAB, NUM_SAMPLES, BATCH, STEPS = SMALL_VOCAB, SMALL_SAMPLES, SMALL_BATCH, SMALL_STEPS
START = VOCAB


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    """A tiny model, 90 prompts and its params; plus the files of one uninterrupted run."""
    return small_job(tmp_path_factory.mktemp("failures"))


@pytest.fixture(autouse=True)
def info_logs(caplog) -> None:
    """The job's INFO lines reach caplog (its "loaded ..." line tells whether the model was loaded)."""
    caplog.set_level(logging.INFO, logger="zoo-infer")


def files(model_dir: Path) -> dict[str, bytes]:
    """Every file of the predictions folder, temp files included, by name."""
    folder = model_dir / "artifacts" / "predictions"
    return {p.name: p.read_bytes() for p in folder.iterdir()} if folder.is_dir() else {}


def finished(model_dir: Path) -> int:
    """How many predictions files are under their final name (a listing only: writers may be running)."""
    return len(list((model_dir / "artifacts" / "predictions").glob("predictions_*.npz")))


def temp_files(model_dir: Path) -> list[Path]:
    return list(model_dir.rglob("*.tmp"))


def summary(model_dir: Path) -> dict:
    return json.loads((model_dir / "artifacts" / "summary.json").read_text())


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every path under `folder` but the lock files (whose holder line a run rewrites)."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")
            if not p.name.startswith(".lock.")}


# --- a full disk -------------------------------------------------------------------------------------

def test_disk_fills_mid_run_then_rerun_resumes(job, tmp_path):
    with small_disk(tmp_path / "disk", "64k") as disk:
        model_dir = disk / "run"
        code, _, err = run_process(job["params"], model_dir)
        assert code == 2, err
        assert "Traceback" not in err
        [line] = error_lines(err)
        assert line.startswith(f"error: cannot write {model_dir}/artifacts/predictions/predictions_")
        assert line.endswith(".npz: No space left on device (errno ENOSPC)")
        done = summary(model_dir)
        assert done["status"] == "failed" and done["errors"] == [line.removeprefix("error: ")]
        assert 0 < done["batches_done"] < STEPS and done["batches_done"] == len(files(model_dir))
        assert done["batches_done"] + done["batches_remaining"] == STEPS
        assert not temp_files(model_dir)
        grow(disk, "2m")  # the user frees space and reruns
        code, _, err = run_process(job["params"], model_dir)
        assert code == 0, err
        assert f"resuming: {done['batches_done']} of this shard's {STEPS} steps are already on disk" in err
        assert files(model_dir) == files(job["reference"])
        assert summary(model_dir)["status"] == "complete"


def test_disk_full_at_start_fails_before_loading(job, tmp_path):
    with small_disk(tmp_path / "disk", "64k") as disk:
        fill(disk)
        model_dir = disk / "run"
        code, _, err = run_process(job["params"], model_dir)
        assert code == 2, err
        assert "Traceback" not in err and " loaded " not in err
        [line] = error_lines(err)
        assert line.startswith(f"error: cannot write {model_dir}/artifacts/") and "(errno ENOSPC)" in line
        assert not temp_files(model_dir)
        assert not files(model_dir)


# --- read-only or wrong output folders -------------------------------------------------------------

def test_read_only_parent_fails_before_loading(job, tmp_path, capsys, caplog):
    parent = tmp_path / "shared"
    parent.mkdir()
    with read_only(parent):
        assert run_job(job["params"], parent / "run") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot create the folder {parent / 'run'}") and err.count("\n") == 1, err
    assert not any(r.message.startswith("loaded ") for r in caplog.records)


def test_finished_run_in_read_only_folder_writes_nothing(job, tmp_path, capsys, caplog):
    model_dir = tmp_path / "run"
    assert run_job(job["params"], model_dir) == 0
    before = snapshot(model_dir)
    caplog.clear()
    with read_only(model_dir):
        assert run_job(job["params"], model_dir) == 0
    assert snapshot(model_dir) == before
    assert any("nothing to do" in r.message for r in caplog.records)
    assert not any(r.message.startswith("loaded ") for r in caplog.records)
    assert run_job(job["params"], model_dir) == 0  # writable again: still nothing to do, nothing written
    assert snapshot(model_dir) == before


def test_unfinished_run_in_read_only_folder_fails_before_loading(job, tmp_path, capsys, caplog):
    model_dir = tmp_path / "run"
    assert run_job(job["params"], model_dir, "--inference_steps", "2") == 0
    before = snapshot(model_dir)
    caplog.clear()
    capsys.readouterr()
    with read_only(model_dir):
        assert run_job(job["params"], model_dir) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write to {model_dir / 'artifacts'}: ") and err.count("\n") == 1, err
    assert snapshot(model_dir) == before
    assert not any(r.message.startswith("loaded ") for r in caplog.records)


def test_model_dir_that_is_a_file(job, tmp_path, capsys):
    model_dir = tmp_path / "run"
    model_dir.write_text("not a folder")
    assert run_job(job["params"], model_dir) == 2
    assert capsys.readouterr().err == f"error: {model_dir} is a file, not a folder\n"


# --- damaged inputs and outputs --------------------------------------------------------------------

def test_truncated_h5_is_named(job, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    whole = (job["data"] / "data.h5").read_bytes()
    (data / "data.h5").write_bytes(whole[: len(whole) // 2])
    params = tmp_path / "params.yaml"
    params.write_text(job["params"].read_text().replace(str(job["data"]), str(data)))
    assert run_job(params, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot read {data / 'data.h5'} as HDF5 (") and "truncated" in err
    assert err.count("\n") == 1


def flip_last_byte_of(path: Path, member: str) -> None:
    """Flips the last data byte of one member of an uncompressed zip (the CRC no longer matches)."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(member)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = np.frombuffer(raw[info.header_offset + 26: info.header_offset + 30], dtype="<u2")
    end = info.header_offset + 30 + int(name_len) + int(extra_len) + info.compress_size
    raw[end - 1] ^= 0x01
    path.write_bytes(bytes(raw))


def test_flipped_byte_in_a_finished_file_is_redone(job, tmp_path, caplog):
    model_dir = tmp_path / "run"
    assert run_job(job["params"], model_dir, "--inference_steps", "3") == 0
    damaged = model_dir / "artifacts" / "predictions" / "predictions_2.npz"
    flip_last_byte_of(damaged, "num_generated.npy")
    with np.load(damaged) as npz:  # the arrays np.load reads first still load
        assert npz["predictions"].shape == (BATCH, 64)
    caplog.clear()
    assert run_job(job["params"], model_dir) == 0
    assert any("predictions_2.npz is damaged" in r.message for r in caplog.records)
    assert files(model_dir) == files(job["reference"])


def test_truncated_manifest_is_rebuilt_from_the_files_that_verify(job, tmp_path, caplog):
    model_dir = tmp_path / "run"
    assert run_job(job["params"], model_dir, "--inference_steps", "5") == 0
    manifest = model_dir / "artifacts" / "manifest.json"
    original = manifest.read_bytes()
    manifest.write_bytes(original[: len(original) // 2])
    caplog.clear()
    assert run_job(job["params"], model_dir) == 0
    assert any(f"{manifest} is unreadable" in r.message and "rebuilding it from the 5 predictions files" in r.message
               for r in caplog.records)
    assert manifest.read_bytes() == original
    assert summary(model_dir)["batches_skipped"] == 5
    assert files(model_dir) == files(job["reference"])
    manifest.write_bytes(original[:10])  # damaged again, in a finished run: rebuilt, nothing else written
    caplog.clear()
    assert run_job(job["params"], model_dir) == 0
    assert any("nothing to do" in r.message for r in caplog.records)
    assert manifest.read_bytes() == original


def test_predictions_from_other_inputs_without_a_manifest_are_refused(job, tmp_path, capsys):
    model_dir = tmp_path / "run"
    changed = tmp_path / "changed.yaml"
    changed.write_text(job["params"].read_text().replace("max_tokens: 40", "max_tokens: 5"))
    assert run_job(changed, model_dir, "--inference_steps", "2") == 0
    (model_dir / "artifacts" / "manifest.json").unlink()
    capsys.readouterr()
    assert run_job(job["params"], model_dir) == 2
    err = capsys.readouterr().err
    assert "holds predictions (predictions_1.npz and 1 more) made from other inputs than this run's, and no " \
           "manifest.json" in err


def test_out_of_vocabulary_ids_are_found_before_loading(job, tmp_path, capsys, caplog):
    rows = prompt_rows(job["prompts"], 64, START)
    rows[NUM_SAMPLES - 1, 0] = VOCAB + 7  # in the last step's prompt
    write_h5(tmp_path / "data", rows)
    params = tmp_path / "params.yaml"
    params.write_text(job["params"].read_text().replace(str(job["data"]), str(tmp_path / "data")))
    for flags in ([], ["--compile_only"]):
        caplog.clear()
        assert run_job(params, tmp_path / "run", *flags) == 2
        err = capsys.readouterr().err
        assert err == (f"error: sample {NUM_SAMPLES - 1}: token id {VOCAB + 7} in its prompt is outside the model's "
                       f"vocabulary (0..{VOCAB - 1})\n")
        assert not any(r.message.startswith("loaded ") for r in caplog.records)
        assert not files(tmp_path / "run")


# --- two jobs, signals while loading ----------------------------------------------------------------

def test_second_identical_job_is_refused_and_shards_share_the_folder(job, tmp_path, capsys):
    model_dir = tmp_path / "run"
    first = start_job(job["params"], model_dir)
    lock = model_dir / "artifacts" / ".lock.shard0-of-1"
    deadline = time.monotonic() + 60
    while not (lock.is_file() and f"pid {first.pid}" in lock.read_text()):
        assert first.poll() is None and time.monotonic() < deadline, "the first job never took its lock"
        time.sleep(0.01)
    try:
        assert run_job(job["params"], model_dir) == 2
        err = capsys.readouterr().err
        assert err == (f"error: {model_dir} is in use: another job (host {os.uname().nodename} pid {first.pid}) is "
                       "running the same steps there; wait for it to end, or use another --model_dir\n")
    finally:
        first.kill()
        first.wait()
    shards = [start_job(job["params"], model_dir, "--num_shards", "2", "--shard_index", str(i)) for i in (0, 1)]
    for shard in shards:
        _, err = shard.communicate(timeout=300)
        assert shard.returncode == 0, err
    assert files(model_dir) == files(job["reference"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_while_loading_stops_with_a_summary(job, tmp_path, capsys, monkeypatch, sig):
    load = Runtime.load

    def load_then_signal(self, *args, **kwargs):
        model = load(self, *args, **kwargs)
        os.kill(os.getpid(), sig)  # the scheduler's signal lands while the model is loading
        time.sleep(1)  # never reached: the handler raises
        raise AssertionError("the signal did not stop the loading")

    monkeypatch.setattr(Runtime, "load", load_then_signal)
    model_dir = tmp_path / "run"
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    assert run_job(job["params"], model_dir) == 128 + sig
    err = capsys.readouterr().err
    assert err == (f"interrupted by {sig.name}: 0 batches written, {STEPS} left; "
                   "run the same command again to resume\n")
    done = summary(model_dir)
    assert done["status"] == f"interrupted by {sig.name}" and done["batches_remaining"] == STEPS
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # the job's handlers are gone again
    monkeypatch.undo()
    assert run_job(job["params"], model_dir) == 0
    assert files(model_dir) == files(job["reference"])


# --- SIGKILL anywhere, many times ------------------------------------------------------------------

def test_soak_sigkill_at_random_moments(job, tmp_path):
    """20 kills, each followed by a rerun: half at a random moment between the process start and
    its first new file (start-up, loading, kernel and GEMM set-up, the first prefill), half
    a random moment after a random number of new files (decode, the next batch's prefill,
    mid-write); then the files equal an uninterrupted run's and no temp file is left."""
    params = write_params(tmp_path / "params.yaml", job["checkpoint"], job["data"], batch_size=2, start_token=START,
                          max_tokens=40, rows_in_flight=2)  # 45 steps: 20 kills leave some work for the last run
    reference = tmp_path / "reference"
    begin, timed = time.monotonic(), start_job(params, reference)
    while not finished(reference) and timed.poll() is None:
        time.sleep(0.002)
    first_file = time.monotonic() - begin
    _, err = timed.communicate(timeout=300)
    assert timed.returncode == 0, err
    model_dir = tmp_path / "run"
    rng = random.Random(20261123)
    killed_running = 0
    for kill in range(20):
        process = start_job(params, model_dir)
        if kill % 2:
            wanted = finished(model_dir) + rng.randint(1, 2)
            deadline = time.monotonic() + 120
            while finished(model_dir) < wanted and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.002)
            time.sleep(rng.uniform(0, 0.05))
        else:  # a random time, but no later than this run's first new file (so the job is never done early)
            before, deadline = finished(model_dir), time.monotonic() + rng.uniform(0, first_file + 0.2)
            while time.monotonic() < deadline and finished(model_dir) == before and process.poll() is None:
                time.sleep(0.002)
        killed_running += process.poll() is None
        process.kill()
        process.communicate()
    assert 0 < finished(model_dir) < 45
    code, _, err = run_process(params, model_dir)
    assert code == 0, err
    assert files(model_dir) == files(reference)
    assert not temp_files(model_dir)
    assert killed_running == 20, "every kill should land in a running job"


def test_data_tool_on_a_full_disk(tmp_path, capsys):
    from data_tools import create_inference_h5 as create
    from harness import SMOLLM2_DIR

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a prompt long enough to need a block\n" * 2000)
    with small_disk(tmp_path / "disk", "16k") as disk:
        out = disk / "data"
        assert create.main(["--input", str(prompts), "--tokenizer", str(SMOLLM2_DIR), "--max_seq_len", "64",
                            "--output_dir", str(out)]) == 2
        err = capsys.readouterr().err
        assert err == f"error: cannot write {out / 'data.h5'}: No space left on device (errno ENOSPC)\n"
        assert not out.exists()  # nothing left behind: no temporary file, not even the folder it made
