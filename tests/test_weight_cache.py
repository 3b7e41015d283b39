"""runconfig.weight_cache (modelzoo/weight_cache.py): a model laid out once for the CPU's GEMMs, mapped by later jobs
with the same predictions; a new file whenever the checkpoint changes; nothing written where the layout is opaque;
a damaged or unwritable cache never fails a job."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from harness import SMOLLM2_DIR, prompt_rows, run_job, save_tiny_model, stacked_predictions, write_h5, write_params
from precision_policies import needs_kernels
from tiny_configs import tiny_llama_config

VOCAB = 96
START = VOCAB
MAX_SEQ_LEN = 32
LENGTHS = (3, 9, 1, 17, 5)

pytestmark = needs_kernels


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in LENGTHS]
    folder = tmp_path_factory.mktemp("data")
    write_h5(folder, prompt_rows(prompts, MAX_SEQ_LEN, START))
    return folder


def job(root: Path, name: str, checkpoint: Path, data: Path, **options) -> np.ndarray:
    """Runs a job in root/name (params there too); returns its stacked predictions."""
    params = write_params(root / f"{name}.yaml", checkpoint, data, batch_size=2, start_token=START, **options)
    assert run_job(params, root / name) == 0
    return stacked_predictions(root / name)


@pytest.mark.parametrize("dtype, weight_dtype", [("bfloat16", None), ("float16", None), ("float32", "int8")])
def test_second_job_maps_the_cached_model_with_the_same_predictions(tmp_path, checkpoint, data, caplog, dtype,
                                                                  weight_dtype):
    """The first job writes one file; the second maps it instead of loading the checkpoint (whose weights are zeros by
    then, in a file of the same size and time: read, they would change every token), and both write the predictions
    of a job without the cache."""
    cache = tmp_path / "cache"
    # float16 on an AVX512-FP16 CPU multiplies natively, where the measured choice may be oneDNN's opaque layout (not
    # cacheable): torch's plain one keeps this test about mapping there (elsewhere float16 packs for half_linear).
    runconfig = {"gemm_backend": "torch"} if dtype == "float16" else {}
    options = dict(dtype=dtype, weight_dtype=weight_dtype, **runconfig)
    plain = job(tmp_path, "plain", checkpoint, data, **options)
    with caplog.at_level(logging.INFO, logger="zoo-infer"):
        first = job(tmp_path, "first", checkpoint, data, weight_cache=str(cache), **options)
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].suffix == ".pt" and "weight cache: wrote" in caplog.text
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)
    caplog.clear()
    weights = checkpoint / "model.safetensors"
    original, stat = weights.read_bytes(), weights.stat()
    header_end = 8 + int.from_bytes(original[:8], "little")
    try:
        weights.write_bytes(original[:header_end] + bytes(len(original) - header_end))
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        with caplog.at_level(logging.INFO, logger="zoo-infer"):
            second = job(tmp_path, "second", checkpoint, data, weight_cache=str(cache), **options)
    finally:
        weights.write_bytes(original)
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert "weight cache: mapped" in caplog.text and "weight cache: wrote" not in caplog.text
    np.testing.assert_array_equal(first, plain)
    np.testing.assert_array_equal(second, plain)


def test_a_changed_checkpoint_gets_a_new_file(tmp_path, data):
    """The key covers the weight files as they are on disk: rewritten weights are another entry, never the stale one."""
    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "model", seed=0)
    cache = tmp_path / "cache"
    first = job(tmp_path, "first", checkpoint, data, dtype="bfloat16", weight_cache=str(cache))
    save_tiny_model(tiny_llama_config(), checkpoint, seed=1)
    second = job(tmp_path, "second", checkpoint, data, dtype="bfloat16", weight_cache=str(cache))
    plain = job(tmp_path, "plain", checkpoint, data, dtype="bfloat16")
    assert len(list(cache.glob("*.pt"))) == 2
    np.testing.assert_array_equal(second, plain)
    assert not np.array_equal(first, second)


def test_float32_layout_is_not_cached(tmp_path, checkpoint, data, caplog):
    """oneDNN's float32 layout is opaque: nothing is written, the job says why and runs as without the option."""
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="zoo-infer"):
        cached = job(tmp_path, "cached", checkpoint, data, weight_cache=str(cache), gemm_backend="onednn")
    assert "weight cache: not written" in caplog.text and "opaque" in caplog.text
    assert not any(cache.glob("*.pt")) if cache.exists() else True
    np.testing.assert_array_equal(cached, job(tmp_path, "plain", checkpoint, data, gemm_backend="onednn"))


def test_a_damaged_file_is_rebuilt(tmp_path, checkpoint, data, caplog):
    """A cache file cut short (a full disk, a copy gone wrong) is read as none: a warning, the model built from the
    checkpoint, the file written anew, the same predictions."""
    cache = tmp_path / "cache"
    first = job(tmp_path, "first", checkpoint, data, dtype="bfloat16", weight_cache=str(cache))
    (file,) = cache.glob("*.pt")
    file.write_bytes(file.read_bytes()[:1000])
    with caplog.at_level(logging.INFO, logger="zoo-infer"):
        second = job(tmp_path, "second", checkpoint, data, dtype="bfloat16", weight_cache=str(cache))
    assert "weight cache: cannot read" in caplog.text and "weight cache: wrote" in caplog.text
    assert file.stat().st_size > 1000
    np.testing.assert_array_equal(second, first)


def test_an_unwritable_cache_folder_does_not_fail_the_job(tmp_path, checkpoint, data, caplog):
    """weight_cache naming a file, not a folder: a warning, no partial file left, the job completes."""
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING, logger="zoo-infer"):
        got = job(tmp_path, "run", checkpoint, data, dtype="bfloat16", weight_cache=str(blocker / "cache"))
    assert "weight cache: could not write" in caplog.text
    np.testing.assert_array_equal(got, job(tmp_path, "plain", checkpoint, data, dtype="bfloat16"))


@pytest.mark.parametrize("value", [5, "", ["a"]])
def test_weight_cache_must_be_a_path(tmp_path, checkpoint, data, value, capsys):
    params = write_params(tmp_path / "p.yaml", checkpoint, data, batch_size=2, start_token=START, weight_cache=value)
    assert run_job(params, tmp_path / "run") != 0
    assert "weight_cache must be a path" in capsys.readouterr().err


def test_python_api_takes_the_weight_cache(tmp_path, caplog):
    """ZooModel(weight_cache=...): the second load maps what the first wrote, and answers the same."""
    from modelzoo.api import ZooModel

    prompts = ["What is 2 + 2?", "Name a colour."]
    answers = []
    with caplog.at_level(logging.INFO, logger="zoo-infer"):
        for _ in range(2):
            zoo = ZooModel(SMOLLM2_DIR, dtype="bfloat16", max_seq_len=64, rows_in_flight=2, weight_cache=tmp_path)
            answers.append([a.token_ids for a in zoo.generate(prompts, zoo.default_options(max_tokens=12),
                                                               chat_template=True)])
            del zoo
    assert caplog.text.count("weight cache: wrote") == 1 and caplog.text.count("weight cache: mapped") == 1
    assert answers[0] == answers[1]


def test_a_killed_writers_partial_file_is_removed(tmp_path, checkpoint, data):
    """A partial file of this host whose writer is gone (killed mid-write) is deleted by the next writer; a live
    writer's, another host's and another key's are left."""
    import socket
    import subprocess

    cache = tmp_path / "cache"
    job(tmp_path, "first", checkpoint, data, dtype="bfloat16", weight_cache=str(cache))
    (file,) = cache.glob("*.pt")
    key, host = file.stem, socket.gethostname().split(".")[0]
    gone = subprocess.Popen(["true"])
    gone.wait()
    abandoned = cache / f".{key}.pt.{host}.{gone.pid}.tmp"
    kept = [cache / f".{key}.pt.{host}.1.tmp", cache / f".{key}.pt.elsewhere.{gone.pid}.tmp",
            cache / f".other.pt.{host}.{gone.pid}.tmp"]
    for partial in [abandoned, *kept]:
        partial.write_bytes(b"half")
    file.unlink()
    job(tmp_path, "second", checkpoint, data, dtype="bfloat16", weight_cache=str(cache))
    assert not abandoned.exists() and all(p.exists() for p in kept) and file.exists()


def test_nothing_is_written_to_a_disk_without_room(tmp_path, checkpoint, data, caplog, monkeypatch):
    """Where the folder's disk has less free space than the model (and a GiB to spare), nothing is written: a warning
    naming both sizes, the job as without the cache."""
    from types import SimpleNamespace

    from modelzoo import weight_cache

    monkeypatch.setattr(weight_cache.shutil, "disk_usage", lambda path: SimpleNamespace(free=2**29))
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="zoo-infer"):
        got = job(tmp_path, "run", checkpoint, data, dtype="bfloat16", weight_cache=str(cache))
    assert "weight cache: not written" in caplog.text and "0.50 GiB free" in caplog.text
    assert not list(cache.iterdir())
    np.testing.assert_array_equal(got, job(tmp_path, "plain", checkpoint, data, dtype="bfloat16"))


def test_the_file_holds_each_tensors_bytes_and_the_packed_weights_arena_once(tmp_path):
    """Before writing, a tensor viewing a small part of a larger storage (a checkpoint's map, most of whose weights
    were replaced) gets its own copy; the packed weights, which fill their arena, stay where they are and are written
    as that one storage; a tied tensor is one copy; the file maps back to the same values."""
    import torch
    from torch import nn

    from modelzoo import weight_cache
    from modelzoo.cpu.memory import PackedWeightArena

    arena = PackedWeightArena(2 * 64 * 1024 * 4)
    model = nn.Module()
    model.first, model.second = (arena.take((64, 1024), torch.float32).normal_() for _ in range(2))
    mostly_replaced = torch.randn(16, 1024)
    model.norm = nn.Parameter(mostly_replaced[3], requires_grad=False)
    model.tied = model.first
    arena_address = model.first.untyped_storage().data_ptr()
    size = weight_cache._compact(model)
    assert model.first.untyped_storage().data_ptr() == arena_address == model.second.untyped_storage().data_ptr()
    assert model.tied is model.first
    assert isinstance(model.norm, nn.Parameter) and model.norm.untyped_storage().nbytes() == 1024 * 4
    assert torch.equal(model.norm, mostly_replaced[3])
    assert size == model.first.untyped_storage().nbytes() + 1024 * 4
    path = tmp_path / "model.pt"
    torch.save(model, path)
    assert size <= path.stat().st_size < size + 64 * 1024
    loaded = torch.load(path, mmap=True, weights_only=False)
    assert torch.equal(loaded.first, model.first) and torch.equal(loaded.second, model.second)
    assert loaded.tied.data_ptr() == loaded.first.data_ptr() and torch.equal(loaded.norm, model.norm)


@pytest.mark.parametrize("options, hinted", [
    ({"dtype": "bfloat16"}, True),
    ({"dtype": "float32", "weight_dtype": "int8"}, True),
    ({"dtype": "bfloat16", "weight_cache": "cache"}, False),  # the cache is set already
    ({"dtype": "float32", "gemm_backend": "onednn"}, False),  # an opaque layout, which the cache cannot write
])
def test_a_long_layout_points_to_the_weight_cache(tmp_path, checkpoint, data, caplog, monkeypatch, options, hinted):
    """A job whose weight layout takes CACHE_HINT_SECONDS or more, without runconfig.weight_cache, says in its log how
    later jobs skip it, where the cache could hold that layout; otherwise it does not."""
    import modelzoo.runtime

    monkeypatch.setattr(modelzoo.runtime, "CACHE_HINT_SECONDS", 0.0)  # any layout is long enough
    if "weight_cache" in options:
        options = {**options, "weight_cache": str(tmp_path / options["weight_cache"])}
    with caplog.at_level(logging.INFO, logger="zoo-infer"):
        job(tmp_path, "job", checkpoint, data, **options)
    assert ("later jobs of this checkpoint map the laid-out model" in caplog.text) is hinted


def _resident_kib(address: int) -> int:
    """This process's resident KiB of the memory mapping holding `address` (/proc/self/smaps' Rss)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line: start-end perms offset dev inode [path]
            start, end = (int(part, 16) for part in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "Rss:":
            return int(fields[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _mapped_model(tmp_path: Path):
    """A module of two 4 MiB tensors saved and mapped back as the cache maps its files (nothing read yet)."""
    import mmap

    import torch
    from torch import nn

    model = nn.Module()
    model.first, model.second = torch.randn(1024, 1024), torch.randn(1024, 1024)
    path = tmp_path / "model.pt"
    torch.save({"model": model}, path)
    with torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE):
        return path, torch.load(path, mmap=True, weights_only=False)["model"]


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_a_mapped_cache_is_read_in_at_set_up(tmp_path, caplog):
    """Mapping reads nothing; the cache's read-in then puts every page of the model's tensors in this process (no page
    fault left for the first forwards), and says how long it took."""
    from modelzoo import weight_cache
    from modelzoo.cpu import memory

    path, model = _mapped_model(tmp_path)
    address = model.first.data_ptr()
    assert _resident_kib(address) < 1024  # not read yet: at most the pages of the file's header and pickle
    with caplog.at_level(logging.INFO, logger="zoo-infer"):
        weight_cache._read_in(path, model)
    if not memory.populate([model.first]):
        pytest.skip("this kernel has no MADV_POPULATE_READ (Linux 5.14)")
    assert _resident_kib(address) >= 2 * 4096 and "weight cache: its pages read in in " in caplog.text


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_a_cache_larger_than_the_memory_left_is_not_read_in(tmp_path, caplog, monkeypatch):
    """Where the file would not fit in the memory left (it would evict its own pages), nothing is read ahead, and the
    log says its pages come as the forwards meet them."""
    from modelzoo import weight_cache

    path, model = _mapped_model(tmp_path)
    monkeypatch.setattr(weight_cache, "available_host_memory", lambda: path.stat().st_size - 1)
    with caplog.at_level(logging.INFO, logger="zoo-infer"):
        weight_cache._read_in(path, model)
    assert "do not fit in the" in caplog.text and "its pages read in" not in caplog.text
    assert _resident_kib(model.first.data_ptr()) < 1024
