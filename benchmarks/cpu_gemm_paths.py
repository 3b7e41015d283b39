#!/usr/bin/env python
"""The C++ GEMMs for 16-bit and int8 weights on each code path this build has, against what those weights multiplied
with before, side by side on this CPU.

    .venv/bin/python benchmarks/cpu_gemm_paths.py                      # SmolLM2-135M and Llama-3.2-3B shapes
    .venv/bin/python benchmarks/cpu_gemm_paths.py --shapes 576x1536 --rows 1,64 --threads 2

For each weight shape (K inputs x N outputs) and row count M, GFLOP/s of:
  - `half_linear` (modelzoo/cpu/kernels/half_gemm.cpp): bfloat16 weights kept in 2 bytes, widened to float32 as they are
    read, on its AVX2 path and, where built, its AVX-512 one, over the packed weight and (`half_linear_rows`) over the
    weight where it lies;
  - `bf16_linear` and `bf16_linear_rows` (modelzoo/cpu/kernels/bf16_gemm.cpp, where the CPU has AVX512-BF16): the
    bfloat16 policy's GEMM over the packed weight and over the weight where it lies;
  - `float32 weights`: the same values widened once to float32 and multiplied by the fastest float32 GEMM candidate
    (modelzoo/cpu/gemm.py, as `auto` picks): what a 16-bit job ran on before on a CPU without native 16-bit multiplies,
    at twice the bytes of weights;
  - `vnni16` (modelzoo/cpu/kernels/int8_gemm.cpp): int8 weights in groups of 32 inputs, 16-bit activations, on its AVX2
    path and, where the CPU has them, its AVX512-VNNI and AMX-INT8 ones;
  - `int8 float`: the same int8 weights dequantized per call, the only int8 backend an AVX2 CPU had before.
Forcing the AVX2 paths on an AVX-512 CPU shows how that code runs (on this CPU's clock and caches; an AVX2 CPU's
own figures need that CPU). Each figure is the best of --repeats timed calls after a warm-up, the candidates
alternating; the outputs of one kernel's paths are checked bit for bit against each other.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.machine import cpu_description  # noqa: E402
from modelzoo.cpu.facts import cpu_flags  # noqa: E402
from modelzoo.cpu.gemm import _shape_key, available_backends, measured_shapes, wrap  # noqa: E402
from modelzoo.cpu.int8_compute import _candidate  # noqa: E402
from modelzoo.cpu.kernels import cpu_kernels  # noqa: E402
from modelzoo.cpu.precision import BF16Linear, HalfLinear, InPlaceBF16Linear, InPlaceHalfLinear  # noqa: E402

# SmolLM2-135M's MLP, then Llama-3.2-3B's attention output, MLP up and MLP down
DEFAULT_SHAPES = "576x1536,3072x3072,3072x8192,8192x3072"


def best_seconds(calls: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, float]:
    """The least time of `repeats` calls of each, the candidates alternating after one warm-up call each."""
    for call in calls.values():
        call()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def on_path(setter: Callable[[str], str], path: str, layer: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A call of `layer` on kernel code path `path` (set before each call: the candidates alternate)."""
    def call() -> torch.Tensor:
        setter(path)
        return layer(x)
    return call


def candidates(in_features: int, out_features: int, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Every candidate's call for one shape and input (see the module docstring)."""
    kernels = cpu_kernels()
    linear = nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    half = HalfLinear(linear)
    widened = nn.Linear(in_features, out_features, bias=False).requires_grad_(False)
    widened.weight.copy_(linear.weight.float())
    key = _shape_key(widened, torch.float32)  # the job's own measured and cached choice for this shape
    choice = measured_shapes({key: (in_features, out_features)}, torch.float32,
                             available_backends(torch.device("cpu"), torch.float32))[key]["backend"]
    float32 = wrap(widened, choice)
    paths = [path for path in ("avx2", "avx512") if path == "avx2" or "avx512f" in cpu_flags()]
    calls = {f"half_linear {path}": on_path(kernels.half_gemm_path, path, half, x) for path in paths}
    in_place = InPlaceHalfLinear(linear)
    calls.update({f"half_linear_rows {path}": on_path(kernels.half_gemm_path, path, in_place, x) for path in paths})
    if kernels.bf16_dot_available():
        packed, rows_read = BF16Linear(linear), InPlaceBF16Linear(linear)
        calls["bf16_linear"], calls["bf16_linear_rows"] = lambda: packed(x), lambda: rows_read(x)
    calls[f"float32 weights ({choice})"] = lambda: float32(x)
    int8 = _candidate(widened, "vnni16", 32)
    calls.update({f"vnni16 {path}": on_path(kernels.int8_gemm_path, path, int8, x)
                  for path in kernels.int8_gemm_paths()})
    dequantized = _candidate(widened, "float", 32)
    calls["int8 float"] = lambda: dequantized(x)
    return calls


def check_paths_agree(calls: dict[str, Callable[[], torch.Tensor]]) -> None:
    """Each kernel's code paths and layouts give the same bits (a failure here is a kernel bug)."""
    for kernel in ("half_linear", "vnni16", "bf16_linear"):
        outputs = [call() for name, call in calls.items() if name.split()[0] in (kernel, kernel + "_rows")]
        if not all(torch.equal(outputs[0], other) for other in outputs[1:]):
            raise SystemExit(f"error: {kernel}'s code paths disagree")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'576x1536,3072x8192' -> [(576, 1536), (3072, 8192)]: (inputs, outputs) of each weight."""
    try:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
        raise SystemExit(f"error: --shapes takes KxN,... (inputs x outputs of each weight, positive), got {text!r}")
    return shapes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"KxN,... (default: {DEFAULT_SHAPES})")
    parser.add_argument("--rows", default="1,16,64,256", help="row counts M (default: 1,16,64,256)")
    parser.add_argument("--threads", type=int, default=0, help="threads (default 0: every core available)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per candidate (default: 7)")
    args = parser.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    if cpu_kernels() is None:
        raise SystemExit("error: the C++ kernels are not built here (make setup)")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{cpu_description()}; {torch.get_num_threads()} threads")
    for in_features, out_features in shapes:
        for rows in (int(m) for m in args.rows.split(",")):
            x = torch.randn(rows, in_features)
            calls = candidates(in_features, out_features, x)
            check_paths_agree(calls)
            seconds = best_seconds(calls, args.repeats)
            flops = 2 * rows * in_features * out_features
            rates = "  ".join(f"{name} {flops / s / 1e9:6.1f}" for name, s in seconds.items())
            print(f"K={in_features:5d} N={out_features:5d} M={rows:4d}  GFLOP/s: {rates}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
