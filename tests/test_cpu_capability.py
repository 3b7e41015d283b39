"""PyTorch's CPU vector level (ATEN_CPU_CAPABILITY) holds for zoo-infer too: at AVX2 on an AVX-512 CPU the flags
past AVX2 are hidden, the C++ kernels are built for x86-64-v3 in a folder of their own, and a job runs as on an AVX2
CPU, with the same tokens as transformers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import modelzoo.cpu.facts as facts
import modelzoo.cpu.kernels as kernels
from harness import (REPO_ROOT, expected_rows, family_prompts, hf_greedy, prompt_rows, save_tiny_model,
                     stacked_predictions, write_h5, write_params)
from repo_scripts import load_script
from tiny_configs import VOCAB, tiny_llama_config

AVX512_FLAGS = "fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile avx_vnni"


@pytest.fixture
def avx512_cpu(monkeypatch):
    """/proc/cpuinfo of an AVX-512 CPU with AMX and AVX-VNNI."""
    monkeypatch.setattr(facts, "_first_processor", lambda: {"model name": "Some Xeon", "flags": AVX512_FLAGS})


@pytest.mark.parametrize("capability", ["AVX512", "AVX2"])
def test_the_flags_and_the_build_follow_pytorchs_vector_level(capability, avx512_cpu, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    flags, build = facts.cpu_flags(), kernels.kernel_build_dir(kernels.BUILD_ROOT)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512" if capability == "AVX2" else "AVX2")
    assert build != kernels.kernel_build_dir(kernels.BUILD_ROOT)  # a build of its own, GEMM choices of their own
    assert build.parent != kernels.machine_dir(kernels.BUILD_ROOT)
    if capability == "AVX512":
        assert flags == frozenset(AVX512_FLAGS.split())
    else:
        assert flags == frozenset({"fpu", "sse2", "avx", "avx2", "fma", "f16c"})


def test_the_compiler_targets_x86_64_v3_where_held_to_avx2(avx512_cpu, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert kernels.compile_flags() == ("-O3", "-march=x86-64-v3", "-mtune=native", "-fopenmp")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert kernels.compile_flags() == ("-O3", "-march=native", "-fopenmp")


def test_an_avx2_cpu_keeps_its_flags_and_its_native_build(monkeypatch):
    """An AVX2 CPU (AVX-VNNI and all) runs at AVX2 anyway: nothing hidden, built for itself, as before."""
    flags = "fpu sse2 avx avx2 fma f16c avx_vnni"
    monkeypatch.setattr(facts, "_first_processor", lambda: {"model name": "Some Core", "flags": flags})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert facts.cpu_flags() == frozenset(flags.split()) and not facts.held_to_avx2()
    assert kernels.compile_flags() == ("-O3", "-march=native", "-fopenmp")


def test_a_hold_that_leaves_onednn_or_mkl_out_is_a_warning(avx512_cpu, monkeypatch, caplog):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    kernels.warn_if_held_in_part()
    assert "set MKL_ENABLE_INSTRUCTIONS=AVX2 too" in caplog.text
    caplog.clear()
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    kernels.warn_if_held_in_part()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    kernels.warn_if_held_in_part()
    assert caplog.text == ""


@pytest.mark.skipif("avx512f" not in facts.cpu_flags(), reason="an AVX2 CPU runs at AVX2 already")
@pytest.mark.skipif(kernels.cpu_kernels() is None, reason="the C++ kernels could not be built here")
def test_a_job_at_avx2_on_an_avx512_cpu_equals_transformers(tmp_path):
    """float32 and bfloat16 jobs in a process at ATEN_CPU_CAPABILITY=avx2 (and oneDNN, MKL at AVX2): kernels built for
    x86-64-v3 (no VNNI, half_linear's AVX2 path), both the tokens of transformers in float32, the checkpoint's
    weights being bfloat16 values (a bfloat16 job widens them in the GEMM: float32 arithmetic, as on any AVX2 CPU)."""
    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "model")
    weights = load_file(checkpoint / "model.safetensors")
    save_file({name: tensor.bfloat16().float() for name, tensor in weights.items()}, checkpoint / "model.safetensors")
    prompts = family_prompts(VOCAB)
    expected = expected_rows(prompts, hf_greedy(checkpoint, prompts, 16), 64, VOCAB)
    write_h5(tmp_path / "data", prompt_rows(prompts, 64, VOCAB))
    held = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    # without the test session's inductor folder (tests/conftest.py): the job takes its own CPU level's
    env = {**{key: value for key, value in os.environ.items() if key != "TORCHINDUCTOR_CACHE_DIR"}, **held}
    for dtype in ("float32", "bfloat16"):
        params = write_params(tmp_path / f"{dtype}.yaml", checkpoint, tmp_path / "data", batch_size=3, start_token=VOCAB,
                              max_tokens=16, dtype=dtype)
        job = subprocess.run([sys.executable, str(REPO_ROOT / "run_inference.py"), "--params", str(params),
                              "--model_dir", str(tmp_path / dtype)], env=env, capture_output=True, text=True,
                             timeout=900)
        assert job.returncode == 0, job.stderr
        assert "C++ CPU kernels (x86-64-v3, as PyTorch is held to AVX2)" in job.stderr
        assert "still use AVX-512" not in job.stderr
        np.testing.assert_array_equal(stacked_predictions(tmp_path / dtype)[: len(prompts)], expected, err_msg=dtype)
    summary = json.loads((tmp_path / "bfloat16" / "artifacts" / "summary.json").read_text())
    assert summary["dtype"] == "bfloat16 weights, float32 arithmetic and KV cache"
    layouts = set(summary["gemm"]["layers"].values())  # packed or read in place, per shape, as measured
    assert layouts and layouts <= {"half_linear", "half_linear_rows"}, layouts
    probe = ("from modelzoo.cpu.kernels import cpu_kernels; k = cpu_kernels(); "
             "print(k.half_gemm_path(), k.int8_vnni_available(), k.bf16_dot_available())")
    built = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=900)
    assert built.stdout.split() == ["avx2", "False", "False"], built.stderr


def test_the_benchmarks_name_the_vector_level_they_ran_at(avx512_cpu, monkeypatch):
    cpu_description = load_script("benchmarks/machine.py").cpu_description
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cpu_description().endswith("; avx2, run at AVX2 (ATEN_CPU_CAPABILITY))")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert cpu_description().endswith("; avx2 avx512f avx512_bf16 avx512_vnni amx_bf16)")
