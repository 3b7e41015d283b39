"""The benchmarks' machine probes: GEMM rates, the arithmetic peak, cpu_gemm_paths.py and kernel_builds.py."""
from __future__ import annotations

import platform
import re
import tempfile
from pathlib import Path

import pytest

from repo_scripts import load_script


def test_gemm_rates_measure_the_kernel_the_precision_policy_multiplies_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark's GEMM ceiling for a 16-bit dtype without native multiplies is half_linear's rate (what the job
    runs), and for float32 the library candidates'."""
    from collections import Counter

    import torch

    from modelzoo.cpu import precision
    from modelzoo.cpu.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("the C++ kernels cannot be built here")
    machine = load_script("benchmarks/machine.py")
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))  # an AVX2 CPU
    shapes = machine.LinearShapes(Counter({(64, 48): 2}), (64, 96))
    rates = machine.gemm_rates(shapes, torch.float16, decode_rows=4)
    assert set(rates) == {(64, 48), (64, 96)}
    for choice in rates.values():
        assert set(choice.gflops) == {"half_linear"} and choice.invariant == {"half_linear": True}
        assert set(choice.gflops["half_linear"]) == {"M=4", "M=32", "M=1024"}
    float32 = machine.gemm_rates(shapes, torch.float32, decode_rows=4)
    assert "half_linear" not in float32[(64, 48)].gflops and "torch" in float32[(64, 48)].gflops


def test_peak_rate_instructions_and_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which instruction bounds which dtype on which CPU; the measured peaks are positive numbers."""
    peak_rate = load_script("benchmarks/peak_rate.py")
    zen4 = {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"}
    assert peak_rate.instructions_for(zen4) == {"float32": peak_rate.FP32_ZMM, "bfloat16": peak_rate.BF16_ZMM,
                                                "float16": peak_rate.FP32_ZMM, "int8": None}
    assert peak_rate.instructions_for({"avx2", "fma"}) == {**dict.fromkeys(("float32", "bfloat16", "float16"),
                                                                           peak_rate.FP32_YMM), "int8": None}
    sapphire_rapids = zen4 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"}  # AMX: its tiles bound bf16, int8
    assert peak_rate.instructions_for(sapphire_rapids) == {"float32": peak_rate.FP32_ZMM, "bfloat16": peak_rate.BF16_AMX,
                                                           "float16": None, "int8": peak_rate.INT8_AMX}
    assert peak_rate.instructions_for({"sse4_2"}) == dict.fromkeys(("float32", "bfloat16", "float16", "int8"))
    if platform.machine() != "x86_64":
        pytest.skip("the peak is measured on x86-64 only")
    monkeypatch.setattr(peak_rate, "ITERATIONS", 100_000)
    peaks, why_not = peak_rate.measure_peaks(2, ["float32", "bfloat16"])
    assert why_not == "" and peaks["float32"] > 1
    assert (peaks["bfloat16"] is None) == (peak_rate.instructions_for(peak_rate.cpu_flags())["bfloat16"] is None)
    assert peak_rate.describe(peaks, 2).startswith(f"float32 {peaks['float32']:.0f} (vfmadd231ps ")
    if "amx_tile" not in peak_rate.cpu_flags():  # the AMX loops are refused here, not run (no SIGILL)
        with tempfile.TemporaryDirectory() as folder:
            lib = peak_rate._build(Path(folder))
            assert lib.peak_gflops(peak_rate.BF16_AMX, 1, 10) < 0 and lib.peak_gflops(peak_rate.INT8_AMX, 1, 10) < 0
    monkeypatch.setenv("CC", "/nonexistent/cc")  # no compiler: said, not raised
    peaks, why_not = peak_rate.measure_peaks(2, ["float32"])
    assert peaks == {"float32": None} and why_not.startswith("not measured (")


def test_cpu_gemm_paths(capsys: pytest.CaptureFixture) -> None:
    """benchmarks/cpu_gemm_paths.py on a tiny shape: a rate for every candidate this build has, at each row count
    (its own check that each kernel's paths agree passes); a malformed --shapes is refused."""
    from modelzoo.cpu.facts import cpu_flags
    from modelzoo.cpu.kernels import cpu_kernels

    gemm_paths = load_script("benchmarks/cpu_gemm_paths.py")
    with pytest.raises(SystemExit, match="--shapes takes KxN,... .* got '64x'"):
        gemm_paths.main(["--shapes", "64x"])
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ kernels cannot be built here")
    assert gemm_paths.main(["--shapes", "64x48", "--rows", "1,7", "--repeats", "1", "--threads", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("K=")]
    assert [line.split("GFLOP/s")[0].split() for line in lines] == [["K=", "64", "N=", "48", "M=", "1"],
                                                                     ["K=", "64", "N=", "48", "M=", "7"]]
    expected = ["half_linear avx2", "vnni16 avx2", "int8 float"]
    expected += ["half_linear avx512"] if "avx512f" in cpu_flags() else []
    expected += ["vnni16 vnni"] if kernels.int8_vnni_available() else []
    for line in lines:
        for name in expected:
            assert re.search(re.escape(name) + r" +\d+\.\d ", line + " "), (name, line)
        assert re.search(r"float32 weights \((onednn|mkl|torch|onednn_blocks|torch_blocks)\) +\d+\.\d", line), line


def test_kernel_builds(capsys: pytest.CaptureFixture) -> None:
    """benchmarks/kernel_builds.py on tiny shapes: this checkout's build under two labels measures every figure for
    both and finds their outputs identical; a malformed build argument or a folder without a library is refused."""
    kernel_builds = load_script("benchmarks/kernel_builds.py")
    from modelzoo.cpu.kernels import cpu_kernels, kernel_build_dir

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ kernels cannot be built here")
    folder = kernel_build_dir()
    tiny = ["--rounds", "1", "--layers", "2", "--rows", "5", "--prefill_tokens", "40", "--min_context", "3",
            "--max_context", "20", "--hidden", "64", "--intermediate", "64", "--heads", "4", "--kv_heads", "2",
            "--head_dim", "16", "--vocab", "48"]
    assert kernel_builds.main([f"a={folder}", f"b={folder}", *tiny]) == 0
    printed = capsys.readouterr().out
    lines = {line.split(":")[0]: line for line in printed.splitlines() if line.startswith(("a:", "b:"))}
    assert set(lines) == {"a", "b"}, printed
    expected = ["decode attention ms/layer", "prefill attention ms/layer"]
    if kernels.bf16_dot_available():
        expected += [f"{phase} {name} GFLOP/s" for phase in ("decode", "prefill") for name in ("qkv", "o", "gate_up",
                                                                                               "down")]
        expected.append("decode lm_head GFLOP/s")
    for line in lines.values():
        assert line.endswith("identical to a: True"), line
        for name in expected:
            assert re.search(re.escape(name) + r" \d+(\.\d+)? ", line), (name, line)
    with pytest.raises(SystemExit, match="a build is label=folder"):
        kernel_builds.main([str(folder), *tiny])
    with pytest.raises(SystemExit, match="no built kernel library in"):
        kernel_builds.main(["a=/nonexistent/folder", *tiny])
    with pytest.raises(SystemExit, match="--min_context <= --max_context <= --prefill_tokens"):
        kernel_builds.main(["--max_context", "2000"])
