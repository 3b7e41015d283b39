"""`<model_dir>/artifacts/manifest.json`: what a run's predictions depend on, so a resume is safe.

The manifest holds the params that shape the outputs (the `model` and `inference_input` sections
without paths; `runconfig` is run-only), a fingerprint of the data files and of the checkpoint,
and the tool version. A rerun into the same model_dir resumes only when its manifest is equal.
"""
from __future__ import annotations

import hashlib
import json
from enum import Enum
from pathlib import Path
from typing import Any

import modelzoo
from modelzoo.errors import UserError
from modelzoo.generation.options import MANIFEST_WHEN_SET
from modelzoo.files import write_text_atomic
from modelzoo.job.params import InferenceParams

MANIFEST = "manifest.json"
_SAMPLE = 1 << 20  # bytes hashed at the start, middle and end of large files


def file_fingerprint(path: Path) -> dict[str, Any]:
    """Name, size and a sha256 over the whole file (small) or three 1 MiB samples (large).

    Sampling keeps a multi-GB checkpoint or data set cheap to fingerprint; together with the exact
    size it catches replaced files, which is what a resume must not mix up.
    """
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        if size <= 3 * _SAMPLE:
            digest.update(handle.read())
        else:
            for offset in (0, size // 2, size - _SAMPLE):
                handle.seek(offset)
                digest.update(handle.read(_SAMPLE))
    return {"name": path.name, "size": size, "sha256": digest.hexdigest()}


def checkpoint_files(folder: Path) -> list[Path]:
    """The files of a checkpoint folder that define its outputs: config and weights (not tokenizer)."""
    names = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
    return sorted(p for p in folder.iterdir()
                  if p.name in names or p.suffix in (".safetensors", ".bin"))


def build_manifest(params: InferenceParams, data_files: list[Path]) -> dict[str, Any]:
    """The manifest of a run: params that shape the outputs, input fingerprints, tool version."""
    model = params.to_dict()["model"]
    model.pop("checkpoint_path")  # the fingerprint stands for it: a moved checkpoint still resumes
    # Keys newer than some runs on disk, left out where they change nothing, so those runs still resume.
    if model["weight_dtype"] is None:
        model.pop("int8_group_size")  # shapes nothing without int8
    for key in MANIFEST_WHEN_SET + ("json_schema", "adapter"):
        if not model[key]:
            model.pop(key)
    # Each adapter's files stand for its folder: a moved adapter still resumes, a changed one does not.
    adapters = model.pop("adapters")
    if adapters:
        model["adapters"] = {name: [file_fingerprint(p) for p in sorted(Path(folder).iterdir()) if p.is_file()]
                             for name, folder in adapters.items()}
    inputs = params.to_dict()["inference_input"]
    inputs.pop("data_dir")
    return {
        "model": model,
        "inference_input": inputs,
        "data": [file_fingerprint(p) for p in data_files],
        "checkpoint": [file_fingerprint(p) for p in checkpoint_files(Path(params.model.checkpoint_path))],
        "tool_version": modelzoo.__version__,
    }


def differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the entries that differ between two manifests."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


class ManifestState(Enum):
    """What a run found in its artifacts folder."""

    EQUAL = "equal"
    ABSENT = "absent"
    UNREADABLE = "unreadable"  # damaged after it was written: rebuilt from the files that verify


def manifest_text(manifest: dict[str, Any]) -> str:
    """The manifest as written: sorted keys, so equal manifests give equal bytes."""
    return json.dumps(manifest, indent=2, sort_keys=True) + "\n"


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's text: what each predictions file records of its inputs."""
    return hashlib.sha256(manifest_text(manifest).encode()).hexdigest()


def check_manifest(artifacts: Path, manifest: dict[str, Any]) -> ManifestState:
    """Compares the manifest on disk with this run's; raises when they differ."""
    path = artifacts / MANIFEST
    if not path.is_file():
        return ManifestState.ABSENT
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return ManifestState.UNREADABLE
    if not isinstance(old, dict):
        return ManifestState.UNREADABLE
    changed = differences(old, manifest)
    if changed:
        raise UserError(f"{artifacts.parent} holds predictions made from different inputs (changed: {', '.join(changed)}); "
                        "use another --model_dir, or --overwrite to delete them and start over")
    return ManifestState.EQUAL


def write_manifest(artifacts: Path, manifest: dict[str, Any]) -> None:
    """Writes the manifest atomically."""
    write_text_atomic(artifacts / MANIFEST, manifest_text(manifest))
