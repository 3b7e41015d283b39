"""A run's output folder, `<model_dir>/artifacts/`: what may be written there, and when.

Before the model loads, the job takes the folder (creates it, locks its shard's steps) and plans
its resume reading only: which steps have a whole file made from this run's inputs. Only a run
with work to do then clears what earlier runs left (damaged files, dead writers' temp files) and
writes the manifest and params_inference.yaml; a run with nothing to do writes nothing, so a
finished run in a read-only folder exits cleanly.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from modelzoo.errors import UserError
from modelzoo.files import WriteError, make_folder, remove, remove_dead_temps, write_text_atomic
from modelzoo.job.manifest import MANIFEST, ManifestState, check_manifest, manifest_digest, write_manifest
from modelzoo.job.output_lock import OutputLock
from modelzoo.job.predictions import (FileState, file_states, predictions_path, temp_files, write_predictions,
                                  written_steps)

log = logging.getLogger("zoo-infer")


class OutputFolder:
    """The artifacts folder of one shard's run (under tensor parallel, only the group's rank 0 writes)."""

    def __init__(self, model_dir: Path, shard_index: int, shard_count: int, writes: bool) -> None:
        self.model_dir = model_dir
        self.artifacts = model_dir / "artifacts"
        self.predictions_dir = self.artifacts / "predictions"
        self.writes = writes
        self.lock = OutputLock(self.artifacts, shard_index, shard_count)
        self.unwritable: WriteError | None = None  # why nothing can be written here, if so
        self.manifest: dict[str, Any] = {}
        self.manifest_state = ManifestState.ABSENT
        self.inputs_sha256 = ""
        self.overwriting = False  # --overwrite: earlier files are deleted, not "damaged"

    def take(self) -> None:
        """Creates the folder and locks this shard's steps. A folder that cannot be written is noted
        in `unwritable`, an error only once there turns out to be work to do."""
        make_folder(self.model_dir)
        try:
            make_folder(self.artifacts)
            if self.writes:
                self.lock.acquire()
        except WriteError as error:
            self.unwritable = error

    def plan(self, steps: list[int], manifest: dict[str, Any], shape: tuple[int, int], overwrite: bool) -> list[int]:
        """The steps still to do, reading only: the manifest on disk must equal this run's, and a step
        is done when its file reads whole, has `shape` and records this run's inputs. With overwrite, all."""
        self.manifest, self.inputs_sha256 = manifest, manifest_digest(manifest)
        self.overwriting = overwrite
        if overwrite:
            self.manifest_state = ManifestState.ABSENT  # rewritten
            return steps
        self.manifest_state = check_manifest(self.artifacts, manifest)
        states = file_states(self.predictions_dir, steps, shape, self.inputs_sha256)
        foreign = [step for step, state in states.items() if state is FileState.OTHER_INPUTS]
        if foreign and self.manifest_state is not ManifestState.EQUAL:
            why = "no manifest.json" if self.manifest_state is ManifestState.ABSENT else "an unreadable manifest.json"
            raise UserError(f"{self.predictions_dir} holds predictions (predictions_{foreign[0]}.npz and "
                            f"{len(foreign) - 1} more) made from other inputs than this run's, and {why}; "
                            "use another --model_dir, or --overwrite to delete them and start over")
        if self.manifest_state is ManifestState.UNREADABLE:
            log.warning("%s is unreadable (damaged after it was written): rebuilding it from the %d predictions "
                        "files that record this run's inputs", self.artifacts / MANIFEST,
                        sum(state is FileState.COMPLETE for state in states.values()))
        return [step for step in steps if states[step] is not FileState.COMPLETE]

    def prepare(self, todo: list[int], params_yaml: str | None) -> None:
        """Readies the folder for `todo`: removes their damaged files and dead writers' temp files,
        writes the manifest where it is missing or damaged, and params_inference.yaml (`params_yaml`,
        by the first shard)."""
        make_folder(self.predictions_dir)
        for folder in (self.artifacts, self.predictions_dir):
            remove_dead_temps(folder)
        written, leftovers = written_steps(self.predictions_dir), temp_files(self.predictions_dir)
        for step in todo:
            path = predictions_path(self.predictions_dir, step)
            if step in written:
                if not self.overwriting:
                    log.warning("%s is damaged, of another shape or from other inputs: redoing it", path.name)
                remove(path)
            for leftover in leftovers.get(step, []):
                remove(leftover)
        self.repair_manifest()
        if params_yaml is not None:
            self.write_params(params_yaml)

    def write_params(self, params_yaml: str) -> None:
        """artifacts/params_inference.yaml: the effective params."""
        write_text_atomic(self.artifacts / "params_inference.yaml", params_yaml)

    def repair_manifest(self) -> None:
        """Writes the manifest where it is missing or damaged. Every shard does, before its first file:
        the content depends only on the inputs, so shards starting together write the same bytes."""
        if self.manifest_state is not ManifestState.EQUAL:
            write_manifest(self.artifacts, self.manifest)
            self.manifest_state = ManifestState.EQUAL

    def write_step(self, step: int, arrays: dict[str, np.ndarray]) -> None:
        """One step's predictions file, recording this run's inputs."""
        write_predictions(self.predictions_dir, step, self.inputs_sha256, arrays)

    def close(self) -> None:
        """Drops the lock."""
        self.lock.close()
