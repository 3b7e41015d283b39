"""Where the C++ kernels and the GEMM choices live (modelzoo/cpu/kernels): a read-only checkout holding a
build loads it without torch's build lock; a missing build goes to $ZOO_INFER_KERNEL_DIR, else the
user cache; the GEMM choices follow the same roots. Each test copies the checkout's build, none compiles."""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import fs_faults
import modelzoo.cpu.gemm as gemm
import modelzoo.cpu.kernels
from modelzoo.cpu.kernels import cpu_kernels, kernel_build_dir, machine_dir

BUILT = kernel_build_dir(modelzoo.cpu.kernels.BUILD_ROOT) if cpu_kernels() is not None else None
needs_build = pytest.mark.skipif(BUILT is None, reason="the C++ kernels could not be built here")


@pytest.fixture
def roots(tmp_path, monkeypatch):
    """Every kernel root in tmp_path: the checkout's, the user cache's; no ZOO_INFER_KERNEL_DIR.
    cpp_extension.load records its build folder instead of compiling."""
    monkeypatch.setattr(modelzoo.cpu.kernels, "BUILD_ROOT", tmp_path / "checkout")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("ZOO_INFER_KERNEL_DIR", raising=False)
    built = []
    from torch.utils import cpp_extension
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: built.append(Path(kw["build_directory"])) or "built")
    cpu_kernels.cache_clear()
    yield built
    cpu_kernels.cache_clear()


@pytest.fixture
def read_only():
    """Makes folders read-only for the test (fs_faults.read_only)."""
    with contextlib.ExitStack() as stack:
        def make(path: Path) -> Path:
            path.mkdir(parents=True, exist_ok=True)
            return stack.enter_context(fs_faults.read_only(path))

        yield make


def copy_build(root: Path) -> Path:
    """The checkout's build of the current sources, copied under `root` (only the library: what is loaded)."""
    target = kernel_build_dir(root)
    target.mkdir(parents=True)
    for library in BUILT.glob("zoo_infer_cpu_kernels*.so"):
        shutil.copy2(library, target)
    return target


@needs_build
def test_a_read_only_checkout_loads_its_build_without_the_lock(tmp_path, roots, read_only, caplog):
    caplog.set_level("INFO", logger="zoo-infer")
    build = copy_build(tmp_path / "checkout")
    read_only(tmp_path / "checkout")
    module = cpu_kernels()
    assert module is not None and module != "built" and hasattr(module, "cached_attention")
    assert roots == [] and "unavailable" not in caplog.text and f"loaded from {build}" in caplog.text
    assert not (tmp_path / "xdg").exists()


@needs_build
def test_builds_in_two_folders_load_as_two_modules(tmp_path):
    """benchmarks/kernel_builds.py loads several builds in one process: each must run its own library, not the first
    one loaded under the same module name."""
    from modelzoo.cpu.kernels import _built_library, _load_library

    libraries = []
    for name in ("kernels-before", "kernels-after"):
        (tmp_path / name).mkdir()
        libraries.append(Path(shutil.copy2(_built_library(BUILT), tmp_path / name)))
    first, second = (_load_library(library) for library in libraries)
    assert first is not second and first.cached_attention is not second.cached_attention
    assert [Path(first.__file__), Path(second.__file__)] == libraries


@needs_build
def test_a_build_in_the_chosen_folder_comes_first(tmp_path, roots, monkeypatch, caplog):
    caplog.set_level("INFO", logger="zoo-infer")
    monkeypatch.setenv("ZOO_INFER_KERNEL_DIR", str(tmp_path / "chosen"))
    build = copy_build(tmp_path / "chosen")
    (kernel_build_dir(tmp_path / "checkout") / "zoo_infer_cpu_kernels.so").parent.mkdir(parents=True)
    (kernel_build_dir(tmp_path / "checkout") / "zoo_infer_cpu_kernels.so").write_text("not a library")
    assert hasattr(cpu_kernels(), "rms_norm") and roots == [] and f"loaded from {build}" in caplog.text


def test_a_missing_build_goes_to_the_chosen_folder_else_the_user_cache(tmp_path, roots, read_only, monkeypatch):
    read_only(tmp_path / "checkout")
    assert cpu_kernels() == "built" and roots == [kernel_build_dir(tmp_path / "xdg" / "zoo-infer" / "kernels")]
    monkeypatch.setenv("ZOO_INFER_KERNEL_DIR", str(tmp_path / "chosen"))
    cpu_kernels.cache_clear()
    assert cpu_kernels() == "built" and roots[-1] == kernel_build_dir(tmp_path / "chosen")


def test_an_unwritable_chosen_folder_is_named_in_the_warning(tmp_path, roots, read_only, monkeypatch, caplog):
    monkeypatch.setenv("ZOO_INFER_KERNEL_DIR", str(read_only(tmp_path / "chosen")))
    assert cpu_kernels() is None and roots == []
    assert f"{kernel_build_dir(tmp_path / 'chosen')} is not writable; set ZOO_INFER_KERNEL_DIR" in caplog.text


@pytest.fixture
def measured(monkeypatch):
    """measure_shape without the timing: the cache is what is tested here."""
    choice = gemm.ShapeChoice(backend="torch", gflops={"torch": {"M=256": 1.0, "M=32": 1.0}}, invariant={"torch": True})
    monkeypatch.setattr(gemm, "available_backends", lambda *args: ["torch"])
    monkeypatch.setattr(gemm, "measure_shape", lambda *args, **kwargs: choice)


def test_gemm_choices_go_to_the_writable_root_and_are_read_back(tmp_path, roots, read_only, measured, monkeypatch):
    read_only(tmp_path / "checkout")
    gemm.apply_gemm_backend(nn.Sequential(nn.Linear(32, 48)), torch.float32, torch.device("cpu"))
    written = machine_dir(tmp_path / "xdg" / "zoo-infer" / "kernels") / "gemm_choices.json"
    assert list(json.loads(written.read_text())["shapes"]) == ["float32 32x48"]
    monkeypatch.setattr(gemm, "measure_shape", lambda *args, **kwargs: pytest.fail("measured again"))
    gemm.apply_gemm_backend(nn.Sequential(nn.Linear(32, 48)), torch.float32, torch.device("cpu"))


def test_unwritable_gemm_choices_are_a_warning(tmp_path, roots, read_only, measured, monkeypatch, caplog):
    monkeypatch.setenv("ZOO_INFER_KERNEL_DIR", str(read_only(tmp_path / "chosen")))
    plan = gemm.apply_gemm_backend(nn.Sequential(nn.Linear(32, 48)), torch.float32, torch.device("cpu"))
    assert plan.layers and "GEMM choices not cached" in caplog.text
