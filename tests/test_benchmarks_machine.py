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
    runs), for float32 the library candidates', and for bfloat16 with AVX512-BF16 the bfloat16 policy's kernels'."""
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
    if precision.bf16_kernel_available():  # the bfloat16 policy's GEMMs: bf16_linear, and amx_bf16_linear with AMX
        monkeypatch.undo()
        from modelzoo.cpu.gemm import available_bf16_kernels

        bfloat16 = machine.gemm_rates(shapes, torch.bfloat16, decode_rows=4)
        assert all(set(choice.gflops) == set(available_bf16_kernels()) for choice in bfloat16.values())


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
            lib = peak_rate._build(Path(folder), peak_rate._compiler())
            assert lib.peak_gflops(peak_rate.BF16_AMX, 1, 10) < 0 and lib.peak_gflops(peak_rate.INT8_AMX, 1, 10) < 0
    monkeypatch.setenv("CC", "/nonexistent/cc")  # no compiler: said, not raised
    peaks, why_not = peak_rate.measure_peaks(2, ["float32"])
    assert peaks == {"float32": None} and why_not.startswith("not measured (")


def test_read_bandwidth_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory read bandwidth is a positive rate, said with what was read; bad arguments are refused by the C
    function, a missing compiler is said, not raised."""
    peak_rate = load_script("benchmarks/peak_rate.py")
    if platform.machine() != "x86_64":
        assert peak_rate.measure_bandwidth(2)[0] is None
        pytest.skip("the bandwidth is measured on x86-64 only")
    gbps, why_not = peak_rate.measure_bandwidth(2)
    assert why_not == "" and gbps > 0.1
    assert peak_rate.bandwidth_bytes() >= max(peak_rate.BANDWIDTH_BYTES, 4 * peak_rate.largest_cache_bytes())
    assert peak_rate.describe_bandwidth(gbps, 2) == (f"{gbps:.1f} GB/s (2 threads reading "
                                                     f"{peak_rate.bandwidth_bytes() >> 20} MiB, 2 passes, best of 3)")
    with tempfile.TemporaryDirectory() as folder:
        lib = peak_rate._build(Path(folder), peak_rate._compiler())
        assert lib.read_gbps(0, 2**20, 1) < 0 and lib.read_gbps(2, 32, 1) < 0 and lib.read_gbps(1, 2**20, 0) < 0
        assert lib.read_gbps(1, 2**20, 1) > 0  # a buffer in cache: a rate all the same
    monkeypatch.setenv("CC", "/nonexistent/cc")
    gbps, why_not = peak_rate.measure_bandwidth(2)
    assert gbps is None and why_not.startswith("not measured (")
    assert peak_rate.describe_bandwidth(None, 2, why_not) == why_not


def test_decode_bound_counts_every_weight_once_a_step_and_each_rows_cache() -> None:
    """The decode's bound: steps of decode_rows tokens, each reading every weight in the dtype's bytes; the KV cache
    read up to each row's length (the shared prefix in every row); the slower of the reads and the FLOPs binds."""
    from collections import Counter

    machine = load_script("benchmarks/machine.py")
    shapes = machine.LinearShapes(Counter({(4, 8): 2}), (4, 10), kv_features=6)  # 104 weights, 40 in the head
    # 2 prompts of 10 tokens in all generate 4 each: 3 decoded each (the prefill chose the first), 2 rows a step.
    work = machine.Workload(prompt_tokens=10, prompts=2, generated_tokens=8, decode_rows=2)
    assert work.decode_tokens == 6
    assert work.kv_reads() == 3 * 10 + 2 * (1 + 2 + 3)  # each decoded token reads its row's prompt and those before
    # the prefill: every prompt token through the body, a row a prompt through the head; each decoded token's input
    # row through every layer
    assert work.prefill_flops(shapes) == 2 * (64 * 10 + 40 * 2) and work.decode_flops(shapes) == 2 * 104 * 6
    # one of the two body layers read alone (the last layer's after its attention): a row a prompt, as the head
    alone = machine.LinearShapes(Counter({(4, 8): 2}), (4, 10), 6, read_alone=Counter({(4, 8): 1}))
    assert work.prefill_flops(alone) == 2 * (32 * 10 + (40 + 32) * 2) and work.decode_flops(alone) == 2 * 104 * 6
    assert work.flops(shapes) == work.prefill_flops(shapes) + work.decode_flops(shapes)
    bound = machine.decode_bound(shapes, "float32", work, peak_gflops=1e-6, bandwidth_gbps=1e-6)
    assert (bound.steps, bound.weight_bytes, bound.kv_bytes) == (3, 104 * 4, 42 * 2 * 6 * 4)
    assert bound.memory_seconds == pytest.approx((3 * 416 + 2016) / 1e3)
    assert bound.compute_seconds == pytest.approx(2 * 104 * 6 / 1e3)
    assert bound.seconds == bound.memory_seconds and bound.describe().endswith(": the reads bind")
    assert bound.describe().startswith("3 steps reading 0.00 GB of weights each")
    int8 = machine.decode_bound(shapes, "int8", work, peak_gflops=None, bandwidth_gbps=1e-6)
    assert int8.weight_bytes == pytest.approx(104 * (1 + 4 / 32))  # a byte and a float32 scale per 32
    assert int8.seconds == int8.memory_seconds and "no peak for this dtype" in int8.describe()
    assert machine.decode_bound(shapes, "float32", work, None, None).seconds is None
    shared = machine.Workload(prompt_tokens=10, prompts=2, generated_tokens=8, decode_rows=2, shared_prefix=3)
    assert shared.kv_reads() == work.kv_reads() + 3 * 3  # the second row's copy of the prefix, read 3 times
    cached = machine.decode_bound(shapes, "float32", work, 1e-6, 1e-6, cache_bytes=10**9)  # the reads fit: no memory
    assert cached.memory_seconds is None and cached.seconds == cached.compute_seconds
    assert "fit in the 953 MiB last-level cache: no memory bound" in cached.describe()
    roofline = machine.roofline_tokens_per_s(shapes, "float32", 1e-6, 1e-6, work)
    assert roofline == pytest.approx(8 / (2 * (640 + 80) / 1e3 + bound.memory_seconds))


def test_cpu_gemm_paths(capsys: pytest.CaptureFixture) -> None:
    """benchmarks/cpu_gemm_paths.py on a tiny shape: a rate for every candidate this build has, at each row count
    (its own check that each kernel's paths agree passes); a malformed --shapes is refused."""
    from modelzoo.cpu.facts import cpu_flags
    from modelzoo.cpu.gemm import BACKENDS
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
        backends = "|".join(BACKENDS)
        assert re.search(rf"float32 weights \(({backends})\) +\d+\.\d", line), line


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
    # A GEMM a bfloat16 job runs here: amx_bf16_linear with AMX, bf16_linear with AVX512-BF16, else half_linear.
    gemm = ("amx_bf16_linear" if kernels.amx_bf16_available() else
            "bf16_linear" if kernels.bf16_dot_available() else "half_linear")
    assert f"GEMMs: {gemm}" in printed
    expected = ["decode attention ms/layer", "prefill attention ms/layer", "decode lm_head GFLOP/s"]
    expected += [f"{phase} {name} GFLOP/s" for phase in ("decode", "prefill")
                 for name in ("qkv", "o", "gate_up", "down")]
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


def test_gemm_ceiling_times_each_shape_at_its_rate_for_its_rows() -> None:
    """The GEMM ceiling: prompt tokens through the body at the M = 1024 rate, one row a prompt through the head and
    the linears read alone at the decode rate, every decoded token through all at the decode rate."""
    from collections import Counter
    from types import SimpleNamespace

    machine = load_script("benchmarks/machine.py")
    shapes = machine.LinearShapes(Counter({(4, 8): 2}), (4, 10), read_alone=Counter({(4, 8): 1}))
    rates = {shape: SimpleNamespace(gflops={"a": {"M=1024": 1.0, "M=2": 0.5}, "b": {"M=1024": 2.0, "M=2": 0.25}})
             for shape in [(4, 8), (4, 10)]}  # the best backend's rate at each M: 2 (prefill), 0.5 (decode)
    work = machine.Workload(prompt_tokens=10, prompts=2, generated_tokens=8, decode_rows=2)
    prefill = 2 * 32 * 10 / 2e9  # one body layer over the prompt tokens
    one_row = 2 * (32 + 40) * 2 / 0.5e9  # the layer read alone and the head, a row a prompt
    decode = 2 * (64 + 40) * 6 / 0.5e9
    assert machine.ceiling_tokens_per_s(shapes, rates, work) == pytest.approx(8 / (prefill + one_row + decode))
